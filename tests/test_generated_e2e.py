"""End to end on the generated graphs: every pipeline, bitwise on 2 gloo ranks.

The generated joint graphs (front/generate.py) are the benchmark's workload and the property
tests' input, and they carry what the built-in models do not: barrier layers that `copy_` into a
running-mean buffer, FSDP buckets with copy-outs, mixed precision, no reshard after forward,
gathers of unknown size. The property tests check the rules each schedule keeps; this runs the
scheduled graphs — the reference, the default, the rewrites (unshard, bucket) and two pipelines
that also reorder compute, capped and not, one with FSDP's reduce-scatters reordered — on real tensors and compares every output (the loss and
each reduce-scattered gradient shard) bitwise with the graph as generated. All graphs run in one
spawn.
"""

from __future__ import annotations

import pytest
import torch

import fxsched
from fxsched.front.generate import generate_graph, min_nodes

from ranks import check_bitwise, run_all

OPTIONS = [
    dict(seed=1, layers=2),
    dict(seed=2, layers=3, buckets=True, mixed_precision=True),
    dict(seed=3, layers=2, reshard=False, attention=False),
    dict(seed=4, layers=2, missing_sizes=0.3, barriers=False),
]
PIPELINES = ["reference", "default", "rewrite", "memory-cap,gradients-first,default,unshard,bucket,fill-waits",
             # the peer-cap benchmark's: fill-waits after bucket moved a bucket's pack of shards into
             # the forward (a created op had no phase edge) on the first and last option sets
             "gradients-first,default,bucket,unshard,fill-waits",
             # FSDP's reduce-scatters in an order of their own (gradients-first swaps them, bucket
             # packs them): the same gradients
             "unorder-reduce-scatters,gradients-first,default,bucket,unshard,fill-waits"]
REWRITES = ("unshard", "bucket", "gradients-first", "fill-waits", "unorder-reduce-scatters")


def _feeds(gm, seed: int) -> list[list[torch.Tensor]]:
    """Per rank, a random tensor for each placeholder (activations, shards, buffers: all fp32)."""
    feeds = []
    for rank in range(2):
        gen = torch.Generator().manual_seed(100 * seed + rank)
        feeds.append([torch.randn(n.meta["val"].shape, dtype=n.meta["val"].dtype, generator=gen)
                      for n in gm.graph.find_nodes(op="placeholder")])
    return feeds


@pytest.fixture(scope="module")
def scheduled():
    cases, taken = [], {}
    for options in OPTIONS:
        gm = generate_graph(min_nodes(**options) + 50, **options)
        runs = [fxsched.schedule(gm, pipeline) for pipeline in PIPELINES]
        for done in runs:
            done.graph_module.graph.lint()
            for key, stats in done.result.stats().items():
                if key.split("{")[0] in REWRITES:
                    count = stats.get("unsharded", stats.get("buckets", stats.get("moved", stats.get("unordered", 0))))
                    taken[key.split("{")[0]] = taken.get(key.split("{")[0], 0) + count
        cases.append((str(options), gm, runs, _feeds(gm, options["seed"])))
    return cases, taken


def test_every_rewrite_is_taken_somewhere(scheduled):
    """So the bitwise check below covers each of them."""
    _, taken = scheduled
    assert all(taken.get(name, 0) > 0 for name in REWRITES), taken


@pytest.mark.multirank
def test_generated_graphs_are_bitwise_equal_on_two_ranks_under_every_pipeline(scheduled):
    from fxsched.runtime import run_ranks

    cases, _ = scheduled
    jobs = []
    for _, gm, runs, feeds in cases:
        jobs.append((gm, feeds))
        jobs.extend((done.graph_module, feeds) for done in runs)
    results = run_ranks(run_all, 2, args=(jobs,), timeout=600)
    check_bitwise(results, [key for key, *_ in cases], f"scheduled graph (#1-#{len(PIPELINES)}: {PIPELINES})",
                  per_key=1 + len(PIPELINES))
