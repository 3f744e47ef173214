"""Inductor's `schedule_overlap_bucketing` with its FSDP pre-bucketing (its default; the
`inductor-bucketing` peer of bench/bench_clients.py) on a joint graph, then fxsched: Inductor's
buckets are recognised structurally (one gather bucket: `all_gather_into_tensor_out` into a buffer
packed by `copy_(narrow(empty), cat(shards))`, clones out; the gradient reduce-scatters packed by
`cat` and split after the wait, or `reduce_scatter_tensor_coalesced` in bucket_mode="coalesced"),
lowered, verified and scheduled; on 2 gloo ranks the scheduled step is bitwise equal to Inductor's.

Inductor's all-gather bucket bakes the rank it was traced on into its pack, so each rank runs
Inductor's pass on its own copy of the graph, with the process group that runs it.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from fxsched.runtime import run_ranks

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

#: Inductor's bucketing as the bench's `inductor-bucketing` peer runs it (bench/bench_clients.py)
PEER = {"max_in_flight_gb": 1.0, "compute_estimator": "analytical", "collective_estimator": "analytical"}


def _bucketed(mode: str | None):
    """The joint graph of test_coalesced's plain step, through Inductor's overlap scheduler with
    FSDP pre-bucketing (our roofline costs as its estimate), with `bucket_mode=mode` (None: its
default; "coalesced" makes its reduce-scatter bucket a `reduce_scatter_tensor_coalesced`, its
gather bucket stays the default form)."""
    from test_coalesced import _joint, _step_plain
    from torch._inductor.fx_passes.overlap_scheduling import schedule_overlap_bucketing

    from fxsched.cost import Roofline, hardware, op_costs
    from fxsched.lowering import lower

    from peers import setup_inductor

    model = Roofline(hardware("h100"))
    setup_inductor(model.hw.hbm_gbps, model.hw.tflops("f32"))  # uses the group initialised: gloo, or `fake_group`
    gm = _joint(_step_plain)
    costs = op_costs(lower(gm), model)
    estimate = lambda node, override_size: costs.get(node.name, 0.001)  # noqa: E731  (new nodes: a microsecond)
    out = schedule_overlap_bucketing(gm, custom_runtime_estimation=estimate, bucket_mode=mode, **PEER)
    out.recompile()
    return gm, out, model


@pytest.fixture
def fake_group():
    """A fake 2-rank default process group for Inductor's pass in this process, destroyed after
    (tests that run graphs in-process need there to be none, or a 1-rank one)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", [None, "coalesced"], ids=["default", "coalesced"])
def test_inductor_buckets_on_a_joint_graph_are_recognised_and_scheduled(mode, fake_group):
    import fxsched
    from fxsched.cost import simulate
    from fxsched.integrations.structural import tag_fsdp_collectives
    from fxsched.ir import CopyOut, Launch, Opaque, Role, verify
    from fxsched.lowering import lower

    _, gm, model = _bucketed(mode)
    targets = {str(n.target) for n in gm.graph.nodes if "c10d" in str(n.target)}
    result = tag_fsdp_collectives(gm)
    assert result.skipped == []
    (bucket,) = result.tagged
    assert sorted(bucket.members) == ["primals_1", "primals_2", "primals_3"] and len(bucket.copy_outs) == 3
    program = lower(gm)
    verify(program)
    assert not any(isinstance(op, Opaque) for op in program.ops())
    launches = [op for op in program.ops() if isinstance(op, Launch)]
    assert [op.role for op in launches] == [Role.GATHER, Role.REDUCE_SCATTER]
    assert sum(isinstance(op, CopyOut) for op in program.ops()) == 3
    if mode == "coalesced":  # Inductor's coalesced reduce-scatter bucket: one launch, a result per gradient
        assert "_c10d_functional.reduce_scatter_tensor_coalesced.default" in targets
        assert len(launches[1].types) == 3
    done = fxsched.schedule(gm, "default", cost_model=model)
    rs = done.result.stats()["overlap-reduce-scatter"]
    assert rs["overlapped"] + rs["in place"] + rs["over budget"] == 1  # the one reduce-scatter bucket is its
    assert simulate(done.program, model).step_ms <= simulate(program, model).step_ms + 1e-12


def _worker(rank, world_size, mode):
    import fxsched
    from fxsched.integrations.structural import tag_fsdp_collectives

    torch.set_num_threads(1)
    original, bucketed, model = _bucketed(mode)
    tag_fsdp_collectives(bucketed)
    scheduled = fxsched.schedule(bucketed, "default", cost_model=model).graph_module
    from test_coalesced import _inputs

    inputs = [t.detach() for t in _inputs(rank)] + [torch.tensor(1.0)]
    return {"original": original(*inputs), "inductor": bucketed(*inputs), "fxsched": scheduled(*inputs),
            "reordered": [n.name for n in scheduled.graph.nodes] != [n.name for n in bucketed.graph.nodes]}


@pytest.mark.multirank
@pytest.mark.parametrize("mode", [None, "coalesced"], ids=["default", "coalesced"])
def test_fxsched_after_inductor_bucketing_is_bitwise_equal_on_two_ranks(mode):
    results = run_ranks(_worker, 2, args=(mode,), timeout=300)
    for rank, r in enumerate(results):
        assert r["reordered"]
        for name in ("inductor", "original"):  # bucketing and reordering change no bit either
            for a, b in zip(r[name], r["fxsched"], strict=True):
                assert (a is None and b is None) or torch.equal(a, b), f"rank {rank}: fxsched differs from {name}"
