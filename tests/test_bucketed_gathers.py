"""Bucketed gathers as Inductor's and torchtitan's bucketing passes emit them, recognised
structurally (lowering/structural.py) and lowered to one bucket launch each (ir: `launch` with
`bucket` and `params`, its pack moving with it, its copy-outs sinking with its wait).

The graphs are traced from torch's own bucket builders (`torch._inductor.fx_passes.bucketing`):
`custom_ops` (`bucketing._pre_bucket_all_gather` packs, `all_gather_into_tensor_out` gathers into
it: torchtitan's joint pass uses this), `default` (`copy_(narrow(empty), cat(shards))` then
`all_gather_into_tensor_out`), `functional` (`all_gather_into_tensor_out(cat(shards), out=empty)`),
and HyperParallel's `all_gather_into_tensor(cat(shards))` with clones out of the gathered buffer.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed._functional_collectives  # noqa: F401  (autograd for the functional collectives)
from torch._inductor.fx_passes import bucketing as inductor_bucketing
from torch.fx.experimental.proxy_tensor import make_fx

import fxsched
from fxsched.integrations.structural import tag_fsdp_collectives, untag_fsdp_gathers
from fxsched.ir import CopyOut, Launch, Role, verify
from fxsched.lowering import lower
from fxsched.runtime import run_graph

_C = torch.ops._c10d_functional
WORLD = 2
F32 = torch.float32

_MERGE = {
    "custom_ops": inductor_bucketing.all_gather_merge_fn_to_trace_custom_ops,
    "default": inductor_bucketing.all_gather_merge_fn_to_trace,
    "functional": inductor_bucketing.all_gather_merge_fn_to_trace_functional,
}


def _hyperparallel(shards, group, world, dtype, dtypes, rank):
    """front/fsdp.py's bucket: cat, gather, view (world, total), a clone per member's column band."""
    lens = [s.numel() for s in shards]
    grid = _C.wait_tensor(_C.all_gather_into_tensor(torch.cat([s.reshape(-1) for s in shards]), world, group))
    grid = grid.view(world, sum(lens))
    out, at = [], 0
    for s, n in zip(shards, lens):
        out.append(grid[:, at:at + n].clone().view((s.shape[0] * world,) + s.shape[1:]))
        at += n
    return out


_MERGE["hyperparallel"] = _hyperparallel


def _model(form, rank=0):
    """Layer 0 gathers its weight alone; layers 1 and 2 share one bucket, used after layer 0's compute."""
    merge = _MERGE[form]

    def f(s0, s1, s2, x):
        w0 = _C.wait_tensor(_C.all_gather_into_tensor(s0, WORLD, "0"))
        h = torch.tanh(x @ w0)
        for _ in range(3):
            h = torch.tanh(h @ w0)
        w1, w2 = merge([s1, s2], "0", WORLD, F32, [F32, F32], rank)
        h = torch.tanh(h @ w1)
        return (torch.tanh(h @ w2).sum(),)

    return f


def _inputs(rank=0):
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g),
            torch.randn(3, 4, generator=g)]


def _trace(form, rank=0):
    return make_fx(_model(form, rank), tracing_mode="fake")(*_inputs(rank))


@pytest.mark.parametrize("form", sorted(_MERGE))
def test_bucket_recognised_with_members_and_copy_outs(form):
    gm = _trace(form)
    result = tag_fsdp_collectives(gm)
    assert result.skipped == []
    plain, bucket = result.tagged
    assert plain.members == () and plain.param_name == "s0_1"
    assert bucket.members == ("s1_1", "s2_1") and bucket.bucket == bucket.launch
    assert bucket.nbytes == 2 * 2 * 8 * 4  # the whole gathered buffer: 2 ranks × 2 members × 8 f32
    node = next(n for n in gm.graph.nodes if n.name == bucket.launch)
    assert node.meta["fsdp_bucket_members"] == ["s1_1", "s2_1"] and node.meta["fsdp_bucket_id"] == bucket.launch
    # a copy-out (a clone of the member's column band of the (world, total) buffer) per member
    assert len(bucket.copy_outs) == 2
    assert "bucketed gather of %s1_1, %s2_1" in str(result)

    program = lower(gm)
    verify(program)
    launches = [op for op in program.ops() if isinstance(op, Launch)]
    assert [(op.role, op.params, op.bucket is not None) for op in launches] == [
        (Role.GATHER, ("s0_1",), False), (Role.GATHER, ("s1_1", "s2_1"), True)]
    copies = [op for op in program.ops() if isinstance(op, CopyOut)]
    assert sorted(op.name for op in copies) == sorted(bucket.copy_outs)
    assert {op.bucket for op in copies} <= {launches[1].bucket}
    if form in ("custom_ops", "default", "functional"):  # `_out`: the launch writes its packed buffer
        assert launches[1].writes and launches[1].alias == launches[1].writes[0]

    assert untag_fsdp_gathers(gm) == 2
    assert not any("fsdp_bucket_copy_out" in n.meta or "fsdp_bucket_id" in n.meta for n in gm.graph.nodes)


@pytest.mark.parametrize("form", sorted(_MERGE))
def test_bucket_launches_early_with_its_pack(form):
    """The reference pipeline prefetches the bucket under layer 0's compute: the launch and its
    whole pack (custom op, or empty + narrow + cat + copy_) move up together, before the tanh chain."""
    gm = _trace(form)
    tag_fsdp_collectives(gm)
    done = fxsched.schedule(gm, "reference")
    bucket = next(row for row in done.report["gathers"] if row["params"] == ["s1_1", "s2_1"])
    assert bucket["moved"]
    order = [n.name for n in done.graph_module.graph.nodes]
    launch = order.index(bucket["launch"])
    pack = [n.name for n in gm.graph.nodes if n.op == "call_function" and n.name in order
            and order.index(n.name) < launch and any(p in ("s1_1", "s2_1") for p in map(str, n.all_input_nodes))]
    first_tanh = order.index("tanh_1")
    assert launch < first_tanh and all(order.index(p) < first_tanh for p in pack)
    # the copy-outs sink with the wait: each just before its member's first use
    copies = [n.name for n in done.graph_module.graph.nodes if n.meta.get("fsdp_bucket_copy_out")]
    assert len(copies) == 2 and order.index(copies[1]) > order.index("tanh_4")
    done.graph_module.graph.lint()


@pytest.mark.multirank
@pytest.mark.parametrize("form", ["functional", "hyperparallel"])
def test_scheduled_bucket_is_bitwise_equal_on_two_ranks(form):
    """Rank-free forms (the others bake the tracing rank into the pack): scheduled by `default` and by
    `reference`, each bitwise equal to the unscheduled graph on 2 gloo ranks."""
    gm = _trace(form)
    tag_fsdp_collectives(gm)
    inputs = [_inputs(rank) for rank in range(WORLD)]
    scheduled = [fxsched.schedule(gm, pipeline).graph_module for pipeline in ("default", "reference")]
    assert [n.name for n in scheduled[1].graph.nodes] != [n.name for n in gm.graph.nodes]
    plain = run_graph(gm, inputs)
    for module in scheduled:
        for a, b in zip(plain, run_graph(module, inputs), strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
