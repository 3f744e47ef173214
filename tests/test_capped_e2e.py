"""End to end under a tight cap: built-in models scheduled with `default,bucket,unshard` and
`max_peak_gb` at the input's simulated peak (or, where nothing fits under it, at `default`'s)
stay within it, rewrite the collectives, and compute bitwise the same loss and gradients as the
unscheduled graph on 2 gloo ranks.

At the input's peak, bucket and unshard get only the memory the scheduling passes freed: the
cases below take buckets (and on encoder unsharded parameters) that fill it to the byte, which
is the edge where a wrong size or a replica read after its free would show in the outputs.
Since a collective's input counts as live until its wait (cost/simulate.py `keeps_alive`),
`default` raises the peak on every built-in model, and a few configurations rewrite nothing at
the input's peak: llama bf16 is capped at `default`'s own peak (it unshards there); encoder and
llama with FSDP's per-module buckets rewrite nothing at either cap and are left out.
"""

from __future__ import annotations

import pytest
import torch

import fxsched
from fxsched.cost.simulate import simulate
from fxsched.front import fsdp_joint_graph
from fxsched.ir import verify
from fxsched.lowering import lower
from fxsched.models import build_model
from fxsched.runtime import run_ranks

from ranks import GIB, WORLD, check_bitwise, rank_feeds, run_all

PIPELINE = "default,bucket,unshard"
# (model, mixed precision, FSDP buckets, the cap: the input's peak or default's)
CASES = [("encoder", None, None, "input"), ("encoder", torch.bfloat16, None, "input"),
         ("gpt", None, None, "input"), ("gpt", torch.bfloat16, None, "input"), ("gpt", None, "per-module", "input"),
         ("llama", None, None, "input"), ("llama", torch.bfloat16, None, "default")]


@pytest.fixture(scope="module")
def capped():
    cases = {}
    for name, mp, buckets, where in CASES:
        module, inputs, model_loss = build_model(name, layers=2, width=32, seed=1)
        front = fsdp_joint_graph(module, inputs, lambda m, *xs: model_loss(m(*xs), *xs), WORLD,
                                 mixed_precision=mp, buckets=buckets)
        peak = simulate(lower(front.gm)).peak_bytes
        if where == "default":
            peak = max(peak, simulate(fxsched.schedule(front.gm, "default").program).peak_bytes)
        done = fxsched.schedule(front.gm, PIPELINE, max_peak_gb=peak / GIB)
        cases[(name, mp, buckets, where)] = (front, done, peak, rank_feeds(front, module, inputs))
    return cases


@pytest.mark.parametrize("case", CASES, ids=[f"{n}-{mp or 'f32'}-{b or 'single'}-{w}" for n, mp, b, w in CASES])
def test_capped_schedule_stays_within_its_cap_and_rewrites(capped, case):
    front, done, peak, _ = capped[case]
    verify(done.program)
    done.graph_module.graph.lint()
    gap = done.gap
    assert abs(gap["cap_bytes"] - peak) <= 1           # the cap asked for (GiB round trip)
    assert gap["peak_bytes"] <= gap["cap_bytes"]
    assert simulate(lower(done.graph_module)).peak_bytes <= gap["cap_bytes"]  # and so is the raised graph's
    # llama and gpt with per-module buckets: the scheduling passes fill the cap with gathers launched
    # at the earliest slot that fits (budget's partial prefetch), and no bucket or replica then saves
    # enough (llama f32 before inputs counted live to their waits: 0.9589 ms, shorter than the 0.9980
    # the rewrites bought without it); the others still rewrite
    assert gap["bought"] or case[0] == "llama" or case[2] == "per-module", \
        "nothing was bucketed or unsharded: the bitwise check would test reordering only"


def test_the_tight_cap_binds_and_both_rewrites_run(capped):
    stats = [done.result.stats() for _, done, _, _ in capped.values()]
    passes = lambda prefix, key: sum(v.get(key, 0) for s in stats for k, v in s.items() if k.startswith(prefix))  # noqa: E731
    assert passes("bucket", "buckets") > 0 and passes("unshard", "unsharded") > 0
    # at the input's peak some candidates do not fit: the cap is what stops them
    assert passes("bucket", "bucket over peak cap") + passes("unshard", "over peak cap") > 0


@pytest.mark.multirank
def test_capped_graphs_are_bitwise_equal_on_two_ranks(capped):
    jobs = []
    for front, done, _, feeds in capped.values():
        jobs += [(front.gm, feeds), (done.graph_module, feeds)]
    check_bitwise(run_ranks(run_all, WORLD, args=(jobs,), timeout=600), list(capped), "capped schedule")
