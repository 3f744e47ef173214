"""A stack of torch.nn.TransformerEncoderLayer (batch_first, no dropout) with a LayerNorm + Linear head."""

from __future__ import annotations

import torch
from torch import nn

from ._common import check_positive_int, pick_heads


class Encoder(nn.Module):
    """`Encoder(x[batch, seq, width]) -> y[batch, seq, width]`.

    Layers are kept in a ModuleList rather than nn.TransformerEncoder, whose nested-tensor
    and fast-path logic only adds noise to a traced graph. Dropout is 0.0 so training mode
    (needed to keep the layers off their inference fast path) is still deterministic.
    """

    def __init__(self, layers: int = 2, width: int = 64, heads: int | None = None) -> None:
        super().__init__()
        check_positive_int("layers", layers)
        check_positive_int("width", width)
        heads = pick_heads(width, heads)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))
