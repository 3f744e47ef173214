"""Shared helpers for the built-in models: argument checks, seeded construction, losses."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F


def check_positive_int(name: str, value: object) -> int:
    # bool is an int subclass; True as a layer count is almost always a bug upstream.
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def pick_heads(width: int, heads: int | None) -> int:
    """Return a head count dividing `width`: the one asked for, or the largest of 8/4/2/1."""
    if heads is None:
        heads = next(h for h in (8, 4, 2, 1) if width % h == 0 and width // h >= 8 or h == 1)
    check_positive_int("heads", heads)
    if width % heads:
        raise ValueError(f"width={width} is not divisible by heads={heads}")
    return heads


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run module construction under `seed` without disturbing the caller's global RNG."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an int, got {seed!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of position t's logits against token t+1 (a causal LM's loss)."""
    vocab = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, vocab), tokens[:, 1:].reshape(-1))


def mean_square_loss(output: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """Mean of the squared outputs; the inputs are accepted and ignored."""
    return output.square().mean()
