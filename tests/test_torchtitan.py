"""torchtitan's graph trainer (fxsched.integrations.torchtitan): llama3's debug model under SimpleFSDP,
traced by graph_trainer's joint tracer on CPU, scheduled by fxsched in place of graph_trainer's FSDP
scheduling pass, bitwise equal to the unscheduled step on 2 gloo ranks.

Skipped where torchtitan is not installed (`pip install -e '.[torchtitan]'`, see .ci/run).
"""

from __future__ import annotations

import functools
import os
import sys

import pytest
import torch

from fxsched.integrations.torchtitan import (FSDP_SCHEDULING_PASSES, fxsched_pass, fxsched_pass_pipeline,
                                             replace_fsdp_scheduling)
from fxsched.runtime import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

try:
    import torchtitan.experiments.graph_trainer  # noqa: F401
    HAVE_TORCHTITAN = True
except Exception:  # noqa: BLE001 — absent, or present without the packages its graph trainer imports
    HAVE_TORCHTITAN = False

needs_torchtitan = pytest.mark.skipif(not HAVE_TORCHTITAN, reason="torchtitan (graph_trainer) is not installed: "
                                                                  "pip install -e '.[torchtitan]' (see .ci/run)")


# --------------------------------------------------------------------------- pass list plumbing (no torchtitan)


def _named(name):
    def fn(gm, example_inputs=None):
        return gm
    fn.__name__ = name
    return fn


def test_replace_fsdp_scheduling_takes_the_place_of_torchtitans_pass():
    ours = _named("ours")
    names = ["eliminate_dead_code_pass", "selective_activation_remat_pass", FSDP_SCHEDULING_PASSES[0],
             FSDP_SCHEDULING_PASSES[1], "regional_inductor_pass"]
    passes = [_named(n) for n in names[:2]] + [functools.partial(_named(names[2]), module_bucket_plans=[])] + [
        _named(n) for n in names[3:]]
    out = replace_fsdp_scheduling(passes, ours)
    assert [getattr(p, "__name__", None) for p in out] == [
        "eliminate_dead_code_pass", "selective_activation_remat_pass", "ours", "regional_inductor_pass"]
    # without an FSDP scheduling pass: ours goes before the terminal Inductor / cudagraph passes
    out = replace_fsdp_scheduling([_named("a"), _named("regional_inductor_pass"), _named("cudagraph_pass")], ours)
    assert [p.__name__ for p in out] == ["a", "ours", "regional_inductor_pass", "cudagraph_pass"]
    # keep: torchtitan's bucketing stays, ours orders its buckets right after it; the second one still goes
    out = replace_fsdp_scheduling(passes, ours, keep=True)
    assert [getattr(p, "__name__", None) or p.func.__name__ for p in out] == [
        "eliminate_dead_code_pass", "selective_activation_remat_pass", FSDP_SCHEDULING_PASSES[0], "ours",
        "regional_inductor_pass"]


def test_pipeline_function_uses_given_base_and_names_parameters():
    from types import SimpleNamespace

    from torch.fx.experimental.proxy_tensor import make_fx

    _C = torch.ops._c10d_functional

    def f(shard, x):
        return (torch.tanh(x @ _C.wait_tensor(_C.all_gather_into_tensor(shard, 2, "0")).view(4, 4)),)

    gm = make_fx(f, tracing_mode="fake")(torch.randn(8), torch.randn(2, 4))
    traced = SimpleNamespace(gm=gm, state_fqns=["layers.0.weight"], input_subclass_layouts={})
    seen = {}

    def base(traced_result, config, *, parallel_dims=None):
        seen["args"] = (traced_result, config, parallel_dims)
        return [_named("selective_activation_remat_pass"), _named(FSDP_SCHEDULING_PASSES[0])]

    passes = fxsched_pass_pipeline(traced, "config", parallel_dims="dims", pipeline="sink", base=base)
    assert seen["args"] == (traced, "config", "dims")
    assert [getattr(p, "__name__", "") for p in passes] == ["selective_activation_remat_pass",
                                                             "fxsched_schedule_pass"]
    out = passes[1](gm, None)
    assert out is gm
    (gather,) = gm.graph.find_nodes(op="call_function", target=_C.all_gather_into_tensor.default)
    assert gather.meta["param_name"] == "layers.0.weight"
    assert passes[1].runs[0]["gathers"] == 1 and passes[1].pipeline == "sink"


def test_bad_pipeline_fails_when_the_pass_is_made():
    from fxsched.passes import PipelineError

    with pytest.raises(PipelineError):
        fxsched_pass("anchor,nope")


# --------------------------------------------------------------------------- torchtitan's llama3 on 2 gloo ranks


def _traced_step(world_size, layers):
    """On one rank: llama3's debug model under SimpleFSDP over all ranks, its step traced and
    rematerialised: (model, inputs, the traced step, its node names, its outputs as traced)."""
    from torch.distributed.device_mesh import init_device_mesh
    from titan import build_llama3, rematerialise, run_step, trace_step

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
    model, inputs = build_llama3(mesh, layers=layers)
    traced = rematerialise(trace_step(model, inputs))
    return model, inputs, traced, [n.name for n in traced.gm.graph.nodes], run_step(traced, model, inputs)


def _titan_worker(rank, world_size, layers, pipeline):
    from titan import run_step

    from fxsched.integrations.torchtitan import param_names

    model, inputs, traced, before, plain = _traced_step(world_size, layers)
    ours = fxsched_pass(pipeline, names=param_names(traced))
    traced.gm = ours(traced.gm, traced.example_inputs)
    after = [n.name for n in traced.gm.graph.nodes]
    scheduled = run_step(traced, model, inputs)
    (run,) = ours.runs
    gathers = [n for n in traced.gm.graph.nodes if "all_gather_into_tensor" in str(n.target)]
    return {"plain": plain, "scheduled": scheduled, "reordered": before != after and sorted(before) == sorted(after),
            "gathers": len(gathers), "tagged": len(run["structural"]["tagged"]),
            "reductions": len(run["structural"]["reductions"]),
            "reduce_scatters": sum("reduce_scatter_tensor" in str(n.target) for n in traced.gm.graph.nodes),
            "moved": run["moved"], "param_names": sorted({n.meta.get("param_name") for n in gathers}),
            "state_fqns": traced.state_fqns, "params": sum(1 for _ in model.parameters()),
            "overlapped": run["report"]["passes"].get("overlap-reduce-scatter", {}).get("overlapped", 0)}


@needs_torchtitan
@pytest.mark.multirank
def test_llama3_debug_model_scheduled_step_is_bitwise_equal_on_two_ranks():
    results = run_ranks(_titan_worker, 2, args=(2, "default"), timeout=600)
    for rank, r in enumerate(results):
        assert len(r["plain"]) == len(r["scheduled"]) == 1 + r["params"]  # the loss, a gradient per parameter
        for a, b in zip(r["plain"], r["scheduled"], strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), f"rank {rank}: the scheduled step differs"
        assert r["reordered"]
        # every FSDP collective recognised: the forward gathers, the re-gathers remat made, the reduce-scatters
        assert r["tagged"] == r["gathers"] >= 30 and r["reductions"] == r["reduce_scatters"] == 17
        assert r["moved"] > 0 and r["overlapped"] > 0
        assert set(r["param_names"]) <= set(r["state_fqns"]) and "tok_embeddings.weight" in r["param_names"]
    assert results[0]["plain"][0].item() != 0.0


# --------------------------------------------------------------------------- group=: graph_trainer's path


def _titan_group_worker(rank, world_size, layers):
    """On one rank: llama3's step as traced and rematerialised (`plain`), then the pass pipeline
    `register(..., group=)` puts in graph_trainer's registry, built as graph_trainer builds
    it (`PASS_PIPELINE_REGISTRY[name](traced, config, parallel_dims=...)`, its default list stood in
    for by the FSDP scheduling pass alone) and run by graph_trainer's `apply_graph_passes`: first
    with rank 1's lowering failing (what each rank raised: the group is in use), then as it is: the
    step's outputs (`scheduled`), the collectives' fingerprint `check_ranks_agree` returns and their list."""
    import contextlib
    from datetime import timedelta
    from unittest import mock

    import torch.distributed as dist

    from titan import run_step
    from torchtitan.experiments.graph_trainer.passes import apply_graph_passes
    from torchtitan.experiments.graph_trainer.registry import PASS_PIPELINE_REGISTRY

    from fxsched.integrations.torchtitan import register
    from fxsched.runtime.agreement import check_ranks_agree, collective_entries

    model, inputs, traced, before, plain = _traced_step(world_size, layers)
    # the ranks' group, its collectives given up after 2 minutes (a rank left waiting fails the test sooner)
    group = dist.new_group(list(range(world_size)), timeout=timedelta(seconds=120))
    name = register("fxsched-group-test", "default", group=group)
    passes = PASS_PIPELINE_REGISTRY[name](traced, None, parallel_dims=None,
                                          base=lambda traced, config, parallel_dims=None: [
                                              _named(FSDP_SCHEDULING_PASSES[0])])
    fault = mock.patch("fxsched.api.lower_in_order", side_effect=RuntimeError("injected fault"))
    try:
        with fault if rank == 1 else contextlib.nullcontext():
            apply_graph_passes(traced.gm, traced.example_inputs, passes)
        failed = None
    except RuntimeError as exc:
        failed = (type(exc).__name__, str(exc))
    kept = [n.name for n in traced.gm.graph.nodes] == before
    traced.gm = apply_graph_passes(traced.gm, traced.example_inputs, passes)
    after = [n.name for n in traced.gm.graph.nodes]
    return {"plain": plain, "scheduled": run_step(traced, model, inputs), "failed": failed, "kept": kept,
            "passes": [getattr(p, "__name__", None) for p in passes], "runs": len(passes[0].runs),
            "reordered": before != after and sorted(before) == sorted(after),
            "params": sum(1 for _ in model.parameters()),
            "fingerprint": check_ranks_agree(traced.gm), "entries": collective_entries(traced.gm)}


@needs_torchtitan
@pytest.mark.multirank
def test_graph_trainers_pipeline_with_a_group_agrees_across_ranks_and_is_bitwise_equal_on_two_ranks():
    """torchtitan's graph trainer with `register(group=...)` (its registry builds the pass list,
    its `apply_graph_passes` runs it) on llama3's debug model (1 block) on 2 gloo ranks: where rank 1
    fails in the pass, rank 0 raises `PeerFailure` naming it (the group reaches the agreement) and
    both keep their graphs; then both schedule, their collectives come in one order
    (`check_ranks_agree`'s fingerprints equal), and each rank's step computes bitwise what the
    unscheduled step does."""
    from fxsched.runtime.agreement import compare_entries

    results = run_ranks(_titan_group_worker, 2, args=(1,), timeout=600)
    assert results[1]["failed"] == ("RuntimeError", "injected fault")
    kind, message = results[0]["failed"]
    assert kind == "PeerFailure" and "rank 1: RuntimeError: injected fault" in message, message
    assert compare_entries([r["entries"] for r in results]) is None
    assert results[0]["fingerprint"] == results[1]["fingerprint"]
    for rank, r in enumerate(results):
        assert r["kept"] and r["passes"] == ["fxsched_schedule_pass"] and r["runs"] == 1, rank
        assert r["reordered"], rank
        assert len(r["plain"]) == len(r["scheduled"]) == 1 + r["params"]  # the loss, a gradient per parameter
        for a, b in zip(r["plain"], r["scheduled"], strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), f"rank {rank}: the scheduled step differs"
    assert not torch.equal(results[0]["plain"][0], results[1]["plain"][0])  # the ranks' data differ


# --------------------------------------------------------------------------- torchtitan's buckets, then fxsched


def _bucketed_worker(rank, world_size, layers, reorder):
    from torch.distributed.device_mesh import init_device_mesh
    from titan import build_llama3, joint_bucketing, rematerialise, run_step, trace_step

    from fxsched.cost import Roofline, hardware, simulate
    from fxsched.integrations.torchtitan import param_names
    from fxsched.ir import CopyOut, Launch
    from fxsched.lowering import lower

    from peers import setup_inductor

    torch.set_num_threads(1)
    model_costs = Roofline(hardware("h100"))
    # torchtitan's pass asks triton's GPU driver for the device's numbers: give it the profile's
    setup_inductor(model_costs.hw.hbm_gbps, model_costs.hw.tflops("f32"))
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
    model, inputs = build_llama3(mesh, layers=layers)
    traced = joint_bucketing(rematerialise(trace_step(model, inputs)), layers, reorder=reorder)
    gm = traced.gm
    before = [n.name for n in gm.graph.nodes]
    plain = run_step(traced, model, inputs)
    before_sim = simulate(lower(gm), model_costs)
    # on torchtitan's own schedule, capped at its peak: overlap-reduce-scatter's delayed waits hold
    # their gradients (a collective reads its input until its wait)
    ours = fxsched_pass("memory-cap,default" if reorder else "default", names=param_names(traced))
    traced.gm = ours(gm, traced.example_inputs)
    after = [n.name for n in traced.gm.graph.nodes]
    scheduled = run_step(traced, model, inputs)
    program = lower(traced.gm)  # the tags fxsched's pass left: what it recognised
    (run,) = ours.runs
    buckets = [op for op in program.ops() if isinstance(op, Launch) and op.is_gather]
    return {"plain": plain, "scheduled": scheduled, "reordered": before != after and sorted(before) == sorted(after),
            "out_gathers": sum("all_gather_into_tensor_out" in str(n.target) for n in gm.graph.nodes),
            "gathers": sum("all_gather_into_tensor" in str(n.target) for n in gm.graph.nodes),
            "buckets": [(op.bucket, op.params, op.nbytes) for op in buckets],
            "copy_outs": sum(isinstance(op, CopyOut) for op in program.ops()),
            "reductions": len(run["structural"]["reductions"]),
            "reduce_scatters": sum("reduce_scatter_tensor" in str(n.target) for n in gm.graph.nodes),
            "moved": run["moved"], "param_fqns": [name for name, _ in model.named_parameters()],
            "overlapped": run["report"]["passes"].get("overlap-reduce-scatter", {}).get("overlapped", 0),
            **_compared(before_sim, simulate(program, model_costs), buckets),
            "params": sum(1 for _ in model.parameters())}


def _compared(before, after, buckets) -> dict:
    """Simulated step, exposed communication and peak, before and after fxsched; and the buckets
    whose gather is more exposed after than before (fxsched must not undo torchtitan's prefetch)."""
    exposed = lambda sim, name: sim.exposed_by_collective.get(name, 0.0)  # noqa: E731
    return {"step_before": before.step_ms, "step_after": after.step_ms,
            "exposed_before": before.exposed_ms, "exposed_after": after.exposed_ms,
            "peak_before": before.peak_bytes, "peak_after": after.peak_bytes,
            "more_exposed": [op.name for op in buckets if exposed(after, op.name) > exposed(before, op.name) + 1e-9]}


@needs_torchtitan
@pytest.mark.multirank
@pytest.mark.parametrize("reorder", [True, False], ids=["bucketed-and-reordered", "bucketed-only"])
def test_llama3_bucketed_by_torchtitan_then_scheduled_is_bitwise_equal_on_two_ranks(reorder):
    """torchtitan's joint bucketing pass (`all_gather_into_tensor_out` into a `_pre_bucket_all_gather`
    buffer, copy-outs by clone; packed reduce-scatters) and then fxsched's default pipeline: every
    bucket recognised with its members and copy-outs, the order changed, the simulated step and
    its exposed communication no worse (after torchtitan's whole pass: its peak memory and each
    bucket's exposed time no worse either, so fxsched undoes none of its prefetching), the step
    bitwise equal; on torchtitan's whole pass fxsched runs capped at its peak (`memory-cap`).
    With torchtitan's own reordering left out (its buckets where its bucketer put them),
    fxsched launches buckets earlier itself."""
    results = run_ranks(_bucketed_worker, 2, args=(2, reorder), timeout=600)
    for rank, r in enumerate(results):
        assert len(r["plain"]) == len(r["scheduled"]) == 1 + r["params"]
        for a, b in zip(r["plain"], r["scheduled"], strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), f"rank {rank}: the scheduled step differs"
        assert r["reordered"]
        # every gather is a bucket torchtitan made, every one recognised, with its members named by FQN
        assert r["gathers"] == r["out_gathers"] == len(r["buckets"]) == 7
        assert all(bucket and params and nbytes for bucket, params, nbytes in r["buckets"])
        assert {p for _, params, _ in r["buckets"] for p in params} == set(r["param_fqns"])
        assert r["copy_outs"] > 0 and r["reductions"] == r["reduce_scatters"] == 4
        # capped at torchtitan's peak, all 4 reduce-scatters overlap the compute after them, each
        # waited once its collective ends (held to their first use, only 2 fitted, before 2026-12-03)
        assert r["overlapped"] == 4
        assert r["step_after"] <= r["step_before"] + 1e-9
        assert r["exposed_after"] <= r["exposed_before"] + 1e-9
        if reorder:  # on torchtitan's own schedule: at no more memory, and no bucket exposed longer
            assert r["peak_after"] <= r["peak_before"]
            assert r["more_exposed"] == []
        if not reorder:  # torchtitan did not prefetch: fxsched launches buckets early and the step gets shorter
            assert r["moved"] > 0 and r["step_after"] < r["step_before"]
    assert results[0]["plain"][0].item() != 0.0


# --------------------------------------------------------------------------- Inductor's buckets, then fxsched


def _inductor_bucketed_worker(rank, world_size, layers):
    from torch._inductor.fx_passes.overlap_scheduling import schedule_overlap_bucketing
    from torch.distributed.device_mesh import init_device_mesh
    from titan import build_llama3, rematerialise, run_step, trace_step

    from fxsched.cost import Roofline, hardware, op_costs, simulate
    from fxsched.ir import CopyOut, Launch, Opaque, verify
    from fxsched.lowering import lower

    from peers import INDUCTOR_OPTIONS, setup_inductor

    torch.set_num_threads(1)
    model_costs = Roofline(hardware("h100"))
    setup_inductor(model_costs.hw.hbm_gbps, model_costs.hw.tflops("f32"))  # the gloo group is the one it reads
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
    model, inputs = build_llama3(mesh, layers=layers)
    traced = rematerialise(trace_step(model, inputs))
    costs = op_costs(lower(traced.gm), model_costs)
    # Inductor's overlap scheduler with its FSDP pre-bucketing (its default), on this rank's graph:
    # its gather bucket's pack bakes in the rank it runs on
    traced.gm = schedule_overlap_bucketing(traced.gm, custom_runtime_estimation=lambda n, size: costs.get(n.name, 0.001),
                                           max_in_flight_gb=1.0, **INDUCTOR_OPTIONS)
    traced.gm.recompile()
    before = [n.name for n in traced.gm.graph.nodes]
    plain = run_step(traced, model, inputs)
    step_before = simulate(lower(traced.gm), model_costs).step_ms
    ours = fxsched_pass("default", names=param_names_of(traced))
    traced.gm = ours(traced.gm, traced.example_inputs)
    scheduled = run_step(traced, model, inputs)
    program = lower(traced.gm)
    verify(program)
    (run,) = ours.runs
    launches = [op for op in program.ops() if isinstance(op, Launch)]
    return {"plain": plain, "scheduled": scheduled, "params": sum(1 for _ in model.parameters()),
            "reordered": before != [n.name for n in traced.gm.graph.nodes],
            "gathers": sum("all_gather_into_tensor" in str(n.target) for n in traced.gm.graph.nodes),
            "reduce_scatters": sum("reduce_scatter_tensor" in str(n.target) for n in traced.gm.graph.nodes),
            "buckets": [(op.role and op.role.value, len(op.params), op.bucket is not None) for op in launches],
            "copy_outs": sum(isinstance(op, CopyOut) for op in program.ops()),
            "opaque": sum(isinstance(op, Opaque) for op in program.ops()),
            "skipped": run["structural"]["skipped"],
            "step_before": step_before, "step_after": simulate(program, model_costs).step_ms}


def param_names_of(traced):
    from fxsched.integrations.torchtitan import param_names

    return param_names(traced)


@needs_torchtitan
@pytest.mark.multirank
def test_llama3_bucketed_by_inductor_then_scheduled_is_bitwise_equal_on_two_ranks():
    """Inductor's `schedule_overlap_bucketing` with FSDP pre-bucketing on graph_trainer's joint graph
    (the `inductor-bucketing` peer of bench_clients.py): its one gather bucket (every gather and
    re-gather: `all_gather_into_tensor_out` into a `copy_(narrow(empty), cat)` pack, clones out) and
    its packed reduce-scatters recognised, fxsched's default scheduled on them, no slower, bitwise
    equal on 2 gloo ranks."""
    results = run_ranks(_inductor_bucketed_worker, 2, args=(2,), timeout=600)
    for rank, r in enumerate(results):
        assert len(r["plain"]) == len(r["scheduled"]) == 1 + r["params"]
        for a, b in zip(r["plain"], r["scheduled"], strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), f"rank {rank}: the scheduled step differs"
        assert r["reordered"] and r["skipped"] == [] and r["opaque"] == 0
        gathers = [b for b in r["buckets"] if b[0] in ("fsdp_all_gather", "fsdp_all_gather_backward")]
        reductions = [b for b in r["buckets"] if b[0] == "fsdp_reduce_scatter"]
        assert len(gathers) == r["gathers"] and all(bucket for _, _, bucket in gathers)
        assert sum(n for _, n, _ in gathers) == r["copy_outs"] >= 30  # every gather and re-gather is a member
        assert len(reductions) == r["reduce_scatters"] > 0 and len(gathers) + len(reductions) == len(r["buckets"])
        assert r["step_after"] <= r["step_before"] + 1e-9
