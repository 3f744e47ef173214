"""Shared test helpers: GIB, and running graphs on gloo ranks to compare them bitwise.

A multirank test builds `jobs`, a list of (graph module, feeds per rank) — typically each
unscheduled graph followed by its scheduled versions — runs them all in one spawn with
`run_ranks(run_all, world, args=(jobs,))` (a spawn costs seconds: one per test, not per graph),
and checks the outputs with `check_bitwise`. Spawned ranks import this module by name (tests/
is on their sys.path, as it is on pytest's).
"""

from __future__ import annotations

import torch

GIB = 1 << 30
WORLD = 2


def rank_data(inputs, world: int) -> list[tuple]:
    """Each rank its own data: token ids shifted by the rank (mod 97), activations by the rank."""
    return [tuple((x + r) % 97 if not x.is_floating_point() else x + r for x in inputs) for r in range(world)]


def rank_feeds(front, module, inputs, world: int = WORLD) -> list[list[torch.Tensor]]:
    """The front's graph inputs on every rank (its shards of the parameters, its own data)."""
    data = rank_data(inputs, world)
    return [front.shard_inputs(module, r, data[r]) for r in range(world)]


def run_all(rank, world_size, jobs):
    """On one rank: every (graph module, feeds per rank) of `jobs`, in order; the outputs of each.
    The inputs are cloned (a graph may write them), so every job reads the same values."""
    torch.manual_seed(0)
    out = []
    for gm, feeds in jobs:
        with torch.no_grad():
            result = gm(*[t.clone() if isinstance(t, torch.Tensor) else t for t in feeds[rank]])
        out.append([t.detach() for t in result])
    return out


def check_bitwise(results, keys, what: str, per_key: int = 2) -> None:
    """`results` of `run_all` over jobs laid out as `per_key` graphs per key (the first the
    reference): every later graph's outputs equal the reference's bitwise, on every rank; and
    the ranks saw different data (else the comparison could not tell them apart)."""
    for rank, outputs in enumerate(results):
        for i, key in enumerate(keys):
            before = outputs[per_key * i]
            for j in range(1, per_key):
                after = outputs[per_key * i + j]
                assert len(before) == len(after), f"{key} #{j} rank {rank}: {what} has other outputs"
                for a, b in zip(before, after):
                    assert a.dtype == b.dtype and torch.equal(a, b), f"{key} #{j} rank {rank}: {what} differs"
    assert not torch.equal(results[0][0][0], results[1][0][0])  # the ranks saw different data
