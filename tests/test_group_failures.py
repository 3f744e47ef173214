"""Ranks that schedule together (`group=`) when one of them fails: every rank leaves with an error,
none waits for the one that failed.

With a group the ranks meet in collectives (`runtime.agreement.Agreement`: the agreement on one
program after lowering, and a settle after the passes). A rank that failed before one of them —
its lowering, an option or a pipeline only it was given, a pass — used to leave the others waiting
there (or pairing it with its own next collective). Each case runs on 2 gloo ranks on a fresh group
whose collectives give up after HANG_SECONDS, as tests/test_fronts_attack4.py's harness does: a
rank left waiting records "hang"; after each case the ranks all-reduce on that group, which only
ranks still in step get right. Rank 1 is the one given the fault.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

import fxsched
from fxsched.runtime import run_ranks

HANG_SECONDS = 30  # a collective of a case's group that waits longer has hung (a rank's schedule takes < 1 s)
PIPELINE = "default"


def _clone(gm):
    """A copy with its own nodes (meta copied): the drop-in and the Inductor pass work in place."""
    graph = torch.fx.Graph(owning_module=gm)
    graph._codegen = gm.graph._codegen
    env = {}
    for node in gm.graph.nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
    return torch.fx.GraphModule(gm, graph)


def _injected(*args, **kwargs):
    raise RuntimeError("injected fault on this rank")


def _fault(faulty: bool, target: str):
    """`target` (a dotted name) raising on the faulty rank, while open; nothing on the others."""
    return mock.patch(target, _injected) if faulty else contextlib.nullcontext()


def _inductor(gm, pg):
    """The torch.compile pass with the group, on_error="warn", on `gm`'s graph: its record."""
    from fxsched.integrations.inductor import FxschedInductorPass

    fx_pass = FxschedInductorPass(PIPELINE, group=pg, on_error="warn")
    fx_pass(gm.graph)
    return fx_pass.runs[-1]


def _case(name, rank, gm, pg):
    """Run case `name` on this rank (the fault on rank 1): what it returns."""
    faulty = rank == 1
    if name == "lowering fails":
        with _fault(faulty, "fxsched.api.lower_in_order"):
            return fxsched.schedule(gm, PIPELINE, group=pg)
    if name == "an option only one rank got is bad":
        return fxsched.schedule(gm, PIPELINE, group=pg, max_peak_gb=-1.0 if faulty else None)
    if name == "a pipeline only one rank got is bad":
        return fxsched.schedule(gm, "anchor,nope" if faulty else PIPELINE, group=pg)
    if name == "the ranks got other pipelines":
        return fxsched.schedule(gm, "reference" if faulty else PIPELINE, group=pg)
    if name == "the ranks got other cost models":
        return fxsched.schedule(gm, PIPELINE, group=pg, cost_model="h200" if faulty else None)
    if name == "a pass fails after the sizes were agreed":
        with _fault(faulty, "fxsched.api.PassManager.run"):
            return fxsched.schedule(gm, PIPELINE, group=pg)
    if name == "the drop-in's config is bad on one rank":
        config = fxsched.PassConfig()
        if faulty:
            config = SimpleNamespace(fsdp_allgather_prefetch="yes", max_in_flight_gb=1.0)
        return fxsched.overlap_param_gather(gm, config, group=pg)
    if name == "the drop-in is disabled on one rank":
        return fxsched.overlap_param_gather(gm, fxsched.PassConfig(fsdp_allgather_prefetch=not faulty), group=pg)
    if name == "the drop-in is disabled on every rank":
        return fxsched.overlap_param_gather(gm, fxsched.PassConfig(fsdp_allgather_prefetch=False), group=pg)
    if name == "torchtitan's pass list fails to build on one rank":
        from fxsched.integrations.torchtitan import fxsched_pass_pipeline

        base = _injected if faulty else (lambda traced, config, parallel_dims=None: [])
        traced = SimpleNamespace(gm=gm, state_fqns=[], input_subclass_layouts={})
        fxsched_pass_pipeline(traced, None, pipeline=PIPELINE, base=base, group=pg)
        return None
    if name == "inductor, warn: recognising the collectives fails":
        with _fault(faulty, "fxsched.integrations.inductor.tag_fsdp_collectives"):
            return _inductor(gm, pg)
    if name == "inductor, warn: a pass fails after the sizes were agreed":
        with _fault(faulty, "fxsched.api.PassManager.run"):
            return _inductor(gm, pg)
    if name == "inductor, warn: no fault":
        return _inductor(gm, pg)
    if name == "no fault":
        return fxsched.schedule(gm, PIPELINE, group=pg)
    raise AssertionError(name)


CASES = ("lowering fails", "an option only one rank got is bad", "a pipeline only one rank got is bad",
         "the ranks got other pipelines", "the ranks got other cost models",
         "a pass fails after the sizes were agreed", "the drop-in's config is bad on one rank",
         "the drop-in is disabled on one rank", "the drop-in is disabled on every rank",
         "torchtitan's pass list fails to build on one rank", "no fault")
INDUCTOR_CASES = ("inductor, warn: recognising the collectives fails",
                  "inductor, warn: a pass fails after the sizes were agreed", "inductor, warn: no fault")


def _failures_worker(rank, world_size, cases):
    """On one rank: each case on a copy of a small FSDP joint graph and a fresh group with a short
    timeout; per case the error it raised (type, message, the failed ranks it names), whether the
    graph kept its order, the Inductor pass's record's error, the collective order of what it
    scheduled, and the all-reduce on the case's group after it."""
    import torch.distributed as dist

    from fxsched.front import fsdp_joint_graph
    from fxsched.models import build_model
    from fxsched.runtime.agreement import collective_entries

    torch.set_num_threads(1)
    module, inputs, model_loss = build_model("gpt", layers=1, width=16, seed=3)
    traced = fsdp_joint_graph(module, inputs, lambda m, *xs: model_loss(m(*xs), *xs), world_size).gm
    out = {}
    for name in cases:
        dist.barrier()  # the ranks start each case together (on the default group: no short timeout)
        pg = dist.new_group(list(range(world_size)), timeout=timedelta(seconds=HANG_SECONDS))
        gm = _clone(traced)
        before = [n.name for n in gm.graph.nodes]
        result = {"error": None, "record_error": None, "entries": None}
        try:
            got = _case(name, rank, gm, pg)
        except Exception as exc:  # noqa: BLE001 — what each rank raised is the result
            result["error"] = (type(exc).__name__, str(exc), getattr(exc, "ranks", None))
        else:
            if isinstance(got, dict):  # the Inductor pass's record
                result["record_error"] = got.get("error")
            module_out = got.graph_module if hasattr(got, "graph_module") else gm
            result["entries"] = collective_entries(module_out)
        result["kept_order"] = [n.name for n in gm.graph.nodes] == before
        try:
            total = torch.tensor([rank + 1])
            dist.all_reduce(total, group=pg)
            result["after"] = int(total.item())
        except Exception as exc:  # noqa: BLE001 — gloo's timeout: the ranks were out of step
            result["after"] = "hang: " + str(exc).splitlines()[0][:100]
        out[name] = result
    return out


def _hung(result) -> bool:
    return result["error"] is not None and ("imed out" in result["error"][1] or "imeout" in result["error"][1])


@pytest.mark.multirank
def test_a_rank_that_fails_leaves_every_rank_of_the_group_with_an_error_and_none_hangs():
    """Rank 1 fails alone: its lowering raises, an option or the pipeline only it got is bad, a
    pass raises after the sizes were agreed, the drop-in's config is bad there, torchtitan's pass
    list fails to build there. Before the ranks met with their statuses, rank 0 waited in the
    exchange (the first three and the config: out of step, a hang), went on to a schedule rank 1
    never got (the pass), or returned a pass list whose fxsched pass would wait for rank 1. Now rank 1 raises its own error and rank 0
    `PeerFailure` naming rank 1 and its error; the ranks stay in step (the all-reduce after each
    case is 1 + 2). Given other pipelines or cost models, or the drop-in disabled on one rank only,
    every rank raises `PlanMismatch` (their collectives would come in other orders); disabled on
    every rank, none does."""
    results = run_ranks(_failures_worker, 2, args=(CASES,), timeout=600)
    for name in CASES:
        for rank, r in enumerate(results):
            assert not _hung(r[name]) and r[name]["after"] == 3, (name, rank, r[name])
    own = {"lowering fails": "RuntimeError", "an option only one rank got is bad": "ConfigError",
           "a pipeline only one rank got is bad": "PipelineError", "a pass fails after the sizes were agreed":
           "RuntimeError", "the drop-in's config is bad on one rank": "ConfigError",
           "torchtitan's pass list fails to build on one rank": "RuntimeError"}
    for name, kind in own.items():
        zero, one = results[0][name]["error"], results[1][name]["error"]
        assert one is not None and one[0] == kind, (name, one)
        assert zero is not None and zero[0] == "PeerFailure" and zero[2] == [1], (name, zero)
        assert "rank 1: " + kind in zero[1], (name, zero[1])  # rank 1's error, in a line
        assert results[0][name]["kept_order"] and results[1][name]["kept_order"], name
    assert "injected fault on this rank" in results[0]["lowering fails"]["error"][1]
    plans = ("the ranks got other pipelines", "the ranks got other cost models", "the drop-in is disabled on one rank")
    for name in plans:
        for rank, r in enumerate(results):
            error = r[name]["error"]
            assert error is not None and error[0] == "PlanMismatch", (name, rank, error)
        assert results[0][name]["error"][1] == results[1][name]["error"][1], name
    assert "'h200'" in results[0]["the ranks got other cost models"]["error"][1]
    for rank, r in enumerate(results):
        disabled = r["the drop-in is disabled on every rank"]
        assert disabled["error"] is None and disabled["kept_order"], rank
        assert r["no fault"]["error"] is None, (rank, r["no fault"])
    assert results[0]["no fault"]["entries"] == results[1]["no fault"]["entries"]


@pytest.mark.multirank
def test_the_inductor_pass_with_warn_leaves_every_rank_unscheduled_alike_where_one_rank_fails():
    """`FxschedInductorPass(group=..., on_error="warn")` leaves a graph it fails on unscheduled.
    Where it failed on rank 1 alone (recognising the collectives, before the ranks met; a pass,
    after they agreed on sizes), rank 0 waited for rank 1 in the first case, and in the second
    scheduled its graph while rank 1 kept its own: run together, another collective order on each
    rank. Now every rank fails alike and keeps its graph as it was (rank 0's record: `PeerFailure`);
    without a fault both schedule it, alike, in another order than traced."""
    cases = INDUCTOR_CASES
    results = run_ranks(_failures_worker, 2, args=(cases,), timeout=600)
    for name in cases:
        for rank, r in enumerate(results):
            assert r[name]["error"] is None and r[name]["after"] == 3, (name, rank, r[name])
    for name in cases[:2]:
        for rank, r in enumerate(results):
            assert r[name]["kept_order"] and r[name]["record_error"], (name, rank, r[name])
        assert results[0][name]["record_error"].startswith("PeerFailure: rank 1 of group"), results[0][name]
        assert "injected fault on this rank" in results[1][name]["record_error"]
    fine = [r["inductor, warn: no fault"] for r in results]
    assert all(f["record_error"] is None and not f["kept_order"] for f in fine), fine
    assert fine[0]["entries"] == fine[1]["entries"]
