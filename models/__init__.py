"""Built-in models and `build_model`; convention: `loss_fn(module(*inputs), *inputs)` is a scalar."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ._common import check_positive_int, mean_square_loss, next_token_loss, seeded
from .encoder import Encoder
from .gpt import GPT
from .llama import Llama

__all__ = ["MODELS", "build_model", "GPT", "Llama", "Encoder"]

LossFn = Callable[..., torch.Tensor]


def _token_inputs(module: GPT | Llama, batch: int, seed: int, vocab: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randint(vocab, (batch, module.seq), generator=generator),)


def _build_gpt(layers: int, width: int, seed: int, batch: int = 2, **kwargs: Any):
    vocab = kwargs.get("vocab", 128)
    with seeded(seed):
        module = GPT(layers, width, **kwargs)
    return module, _token_inputs(module, batch, seed, vocab), next_token_loss


def _build_llama(layers: int, width: int, seed: int, batch: int = 2, **kwargs: Any):
    vocab = kwargs.get("vocab", 128)
    with seeded(seed):
        module = Llama(layers, width, **kwargs)
    return module, _token_inputs(module, batch, seed, vocab), next_token_loss


def _build_encoder(layers: int, width: int, seed: int, batch: int = 2, seq: int = 16, **kwargs: Any):
    check_positive_int("seq", seq)
    with seeded(seed):
        module = Encoder(layers, width, **kwargs)
    generator = torch.Generator().manual_seed(seed)
    return module, (torch.randn(batch, seq, width, generator=generator),), mean_square_loss


# name -> builder(layers, width, seed, batch=2, **model kwargs) -> (module, inputs, loss_fn)
MODELS: dict[str, Callable[..., tuple[nn.Module, tuple[torch.Tensor, ...], LossFn]]] = {
    "gpt": _build_gpt,
    "llama": _build_llama,
    "encoder": _build_encoder,
}


def build_model(
    name: str, layers: int = 2, width: int = 64, seed: int = 0, **kwargs: Any
) -> tuple[nn.Module, tuple[torch.Tensor, ...], LossFn]:
    """Build model `name` in train mode with deterministic weights and inputs for `seed`.

    Extra keyword arguments go to the model: `heads`, `batch` (all), `vocab`, `seq`
    (gpt, llama), `seq` (encoder). Returns `(module, example_inputs, loss_fn)` with
    `loss_fn(module(*example_inputs), *example_inputs)` a scalar tensor.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    check_positive_int("layers", layers)
    check_positive_int("width", width)
    check_positive_int("batch", kwargs.get("batch", 2))
    module, inputs, loss_fn = MODELS[name](layers, width, seed, **kwargs)
    return module.train(), inputs, loss_fn
