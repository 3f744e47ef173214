"""GPT-style decoder: token + position embeddings, pre-LayerNorm causal SDPA blocks, GELU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._common import check_positive_int, pick_heads


class GPTBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, w // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, w))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """`GPT(tokens[batch, seq]) -> logits[batch, seq, vocab]`."""

    def __init__(
        self, layers: int = 2, width: int = 64, heads: int | None = None, vocab: int = 128, seq: int = 16
    ) -> None:
        super().__init__()
        check_positive_int("layers", layers)
        check_positive_int("width", width)
        check_positive_int("vocab", vocab)
        self.seq = check_positive_int("seq", seq)
        heads = pick_heads(width, heads)
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(GPTBlock(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] > self.seq:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds the model's seq={self.seq}")
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
