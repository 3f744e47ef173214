"""Llama-3-8B's layer shapes for the clients benchmark, traced through fxsched's FSDP front with
fake tensors: the module is built on the meta device (no parameter memory), the front traces
with fake tensors, so nothing of the model's size is ever allocated.

Shape (Meta's Llama-3-8B config): dim 4096, FFN 14336, 32 query heads and 8 key/value heads
(grouped-query attention, head dim 128), vocab 128256, RMSNorm, rotary embedding, SwiGLU;
`layers` of its 32 blocks. Parameters in `dtype` (bf16 as trained, or fp32).

    gm = llama3_8b_graph(layers=4, dtype=torch.bfloat16, seq=8192, batch=1, world_size=8)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fxsched.front import fsdp_joint_graph
from fxsched.models._common import next_token_loss
from fxsched.models.llama import RMSNorm, apply_rotary

DIM, FFN, HEADS, KV_HEADS, VOCAB = 4096, 14336, 32, 8, 128256


class Block(nn.Module):
    def __init__(self, dim: int, ffn: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.attn_norm = RMSNorm(dim)
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)
        self.ffn_norm = RMSNorm(dim)
        self.w1 = nn.Linear(dim, ffn, bias=False)
        self.w3 = nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q), apply_rotary(k)
        repeat = self.heads // self.kv_heads  # grouped-query attention: each K/V head serves `repeat` query heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, s, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama3(nn.Module):
    def __init__(self, layers: int, dim: int = DIM, ffn: int = FFN, heads: int = HEADS, kv_heads: int = KV_HEADS,
                 vocab: int = VOCAB) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, ffn, heads, kv_heads) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def llama3_8b_graph(layers: int, *, dtype=torch.bfloat16, seq: int = 8192, batch: int = 1, world_size: int = 8,
                    **shape):
    """The tagged FSDP joint graph (fxsched's front) of `layers` Llama-3-8B blocks; `shape`
    overrides dim/ffn/heads/kv_heads/vocab (for tests at a small size)."""
    with torch.device("meta"):
        module = Llama3(layers, **shape).to(dtype)
    vocab = shape.get("vocab", VOCAB)
    tokens = torch.randint(0, vocab, (batch, seq))
    front = fsdp_joint_graph(module, [tokens], lambda m, t: next_token_loss(m(t).float(), t), world_size)
    return front.gm
