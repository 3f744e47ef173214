"""Llama-style decoder: hand-written RMSNorm, rotary position embedding, causal SDPA, SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._common import check_positive_int, pick_heads


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 so a bf16 run does not lose the mean square to rounding.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return x32.type_as(x) * self.weight


def apply_rotary(x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotate-half RoPE on `x[batch, heads, seq, head_dim]`.

    The angles are computed inside forward (no buffers) so functional_call and AOT tracing
    see a module whose only state is its parameters.
    """
    seq, dim = x.shape[-2], x.shape[-1]
    half = dim // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
    angles = torch.arange(seq, dtype=torch.float32, device=x.device)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class LlamaBlock(nn.Module):
    def __init__(self, width: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = RMSNorm(width)
        self.wq = nn.Linear(width, width, bias=False)
        self.wk = nn.Linear(width, width, bias=False)
        self.wv = nn.Linear(width, width, bias=False)
        self.wo = nn.Linear(width, width, bias=False)
        self.ffn_norm = RMSNorm(width)
        self.w1 = nn.Linear(width, ffn, bias=False)
        self.w3 = nn.Linear(width, ffn, bias=False)
        self.w2 = nn.Linear(ffn, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        h = self.attn_norm(x)

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.heads, w // self.heads).transpose(1, 2)

        q, k, v = apply_rotary(heads(self.wq(h))), apply_rotary(heads(self.wk(h))), heads(self.wv(h))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, s, w))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    """`Llama(tokens[batch, seq]) -> logits[batch, seq, vocab]`."""

    def __init__(
        self, layers: int = 2, width: int = 64, heads: int | None = None, vocab: int = 128, seq: int = 16
    ) -> None:
        super().__init__()
        check_positive_int("layers", layers)
        check_positive_int("width", width)
        check_positive_int("vocab", vocab)
        self.seq = check_positive_int("seq", seq)
        heads = pick_heads(width, heads)
        if (width // heads) % 2:
            raise ValueError(f"rotary embedding needs an even head dim, got width/heads = {width // heads}")
        # Llama's SwiGLU width: 2/3 of 4*width, rounded up to a multiple of 8.
        ffn = -(-(8 * width // 3) // 8) * 8
        self.tok = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(LlamaBlock(width, heads, ffn) for _ in range(layers))
        self.norm = RMSNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] > self.seq:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds the model's seq={self.seq}")
        x = self.tok(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
