"""Coalesced collectives (`*_coalesced`) as launches: one launch with an operand and a result per
member, each result a view of it (FX's getitem) waited by one wait that names the launch
(ir/ops.py). Recognised structurally as FSDP gathers (every input a graph input's shard: a bucket
without copy-outs) or gradient reductions (every result reaching only the output), they move
as any bucket; the raised graph is the scheduled one, bitwise equal to the unscheduled on 2 ranks.

The graphs come from torch's own code: the joint graph of a step whose forward gathers with
`all_gather_into_tensor_coalesced` (torch's autograd formula makes the backward's
`reduce_scatter_tensor_coalesced`), traced by AOTAutograd; and Inductor's
`bucket_reduce_scatter(mode="coalesced")` run on a joint graph with plain gathers.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed._functional_collectives  # noqa: F401  (autograd for the functional collectives)
from torch import fx
from torch._functorch.aot_autograd import aot_export_joint_simple
from torch._inductor.fx_passes import bucketing as inductor_bucketing

import fxsched
from fxsched.cost import simulate
from fxsched.integrations.structural import tag_fsdp_collectives
from fxsched.ir import Launch, Opaque, Role, VerifyError, View, Wait, parse_program, print_program, verify, waits_of
from fxsched.lowering import lower
from fxsched.runtime import run_graph

_C = torch.ops._c10d_functional
WORLD = 2


def _coalesced(shards):
    return [_C.wait_tensor(t) for t in _C.all_gather_into_tensor_coalesced(shards, WORLD, "0")]


def _gather(shard):
    return _C.wait_tensor(_C.all_gather_into_tensor(shard, WORLD, "0"))


def _step_coalesced(s0, s1, s2, x):
    """FSDP-style: s0 and s1 gathered in one coalesced call, used by layers 0 and 2; s2 alone
    (coalesced too) after layer 0's compute, so a schedule can launch it earlier."""
    w0, w1 = _coalesced([s0, s1])
    h = torch.tanh(x @ w0.view(4, 4))
    for _ in range(3):
        h = torch.tanh(h @ w0.view(4, 4))
    (w2,) = _coalesced([s2])
    h = torch.tanh(h @ w1.view(4, 4))
    return (torch.tanh(h @ w2.view(4, 4)).sum(),)


def _step_plain(s0, s1, s2, x):
    h = torch.tanh(x @ _gather(s0).view(4, 4))
    w1 = _gather(s1).view(4, 4)
    for _ in range(3):
        h = torch.tanh(h @ w1)
    return (torch.tanh(h @ _gather(s2).view(4, 4)).sum(),)


def _inputs(rank=0):
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(2, 4, generator=g, requires_grad=True) for _ in range(3)] + [torch.randn(3, 4, generator=g)]


def _joint(step) -> fx.GraphModule:
    """AOTAutograd's joint graph (primals, then tangents), called with flat arguments."""
    gm = aot_export_joint_simple(step, _inputs(), trace_joint=True)
    gm.graph._codegen = fx.graph.CodeGen()
    gm.recompile()
    return gm


def _inductor_coalesced() -> fx.GraphModule:
    """Plain gathers; the backward's three gradient reduce-scatters bucketed by Inductor into one
    `reduce_scatter_tensor_coalesced` (its nodes carry no autograd_backward mark)."""
    gm = _joint(_step_plain)
    inductor_bucketing.bucket_reduce_scatter(gm, lambda _: 1000.0, mode="coalesced")
    gm.recompile()
    return gm


def _rank_inputs():
    return [[t.detach() for t in _inputs(rank)] + [torch.tensor(1.0)] for rank in range(WORLD)]


def _nodes(gm, target):
    return gm.graph.find_nodes(op="call_function", target=target)


def test_coalesced_gathers_and_reductions_are_recognised_and_lowered_to_launches():
    gm = _joint(_step_coalesced)
    result = tag_fsdp_collectives(gm)
    assert result.skipped == []
    assert [(g.members, g.nbytes, len(g.waits)) for g in result.tagged] == [
        (("primals_1", "primals_2"), 2 * 16 * 4, 2), (("primals_3",), 16 * 4, 1)]
    assert [(r.kind, len(r.waits)) for r in result.reductions] == [
        ("reduce_scatter_tensor_coalesced", 1), ("reduce_scatter_tensor_coalesced", 2)]
    assert "forward coalesced gather of %primals_1, %primals_2, 128 bytes" in str(result)

    program = lower(gm)
    verify(program)
    assert not any(isinstance(op, Opaque) for op in program.ops())
    launches = [op for op in program.ops() if isinstance(op, Launch)]
    assert [(op.role, op.params, op.bucket is not None, len(op.types), len(op.operands)) for op in launches] == [
        (Role.GATHER, ("primals_1", "primals_2"), True, 2, 2), (Role.GATHER, ("primals_3",), True, 1, 1),
        (Role.REDUCE_SCATTER, (), False, 1, 1), (Role.REDUCE_SCATTER, (), False, 2, 2)]
    for launch in launches:  # a wait per result, each reading its own getitem (a view of the launch)
        waits = [program.op(w) for w in waits_of(program, launch.name)]
        assert len(waits) == len(launch.types) and all(w.launch == launch.name for w in waits)
        assert {program.op(w.operands[0]).operands for w in waits} == {(launch.name,)}
        assert all(isinstance(program.op(w.operands[0]), View) for w in waits)

    text = print_program(program)
    assert "{launch = %all_gather_into_tensor_coalesced}" in text
    again = parse_program(text)
    verify(again)
    assert print_program(again) == text


def test_inductor_coalesced_reduce_scatter_bucket_is_recognised_past_the_backward_mark():
    gm = _inductor_coalesced()
    (node,) = _nodes(gm, _C.reduce_scatter_tensor_coalesced.default)
    assert "autograd_backward" not in node.meta  # Inductor's bucketing did not mark it: its place says backward
    result = tag_fsdp_collectives(gm)
    assert len(result.tagged) == 3 and result.skipped == []
    (reduction,) = result.reductions
    assert reduction.launch == node.name and len(reduction.waits) == 3
    launch = lower(gm).op(node.name)
    assert isinstance(launch, Launch) and launch.role is Role.REDUCE_SCATTER and len(launch.types) == 3


def test_coalesced_gather_is_prefetched_as_a_bucket():
    gm = _joint(_step_coalesced)
    tag_fsdp_collectives(gm)
    done = fxsched.schedule(gm, "reference")
    verify(done.program)
    row = next(row for row in done.report["gathers"] if row["params"] == ["primals_3"])
    assert row["moved"]
    order = [n.name for n in done.graph_module.graph.nodes]
    assert order.index("all_gather_into_tensor_coalesced_1") < order.index("tanh")  # launched under layer 0
    # its getitem and wait sink together to just before the first use (as a bucket's wait and copy-outs)
    at = order.index("getitem_2")
    assert order[at:at + 4] == ["getitem_2", "wait_tensor_2", "view_5", "mm_5"]
    assert order.index("mm_4") < at  # past layer 1's matmul, which reads the first bucket
    done.graph_module.graph.lint()


def test_coalesced_gradient_reduce_scatter_overlaps_the_backward():
    gm = _joint(_step_coalesced)
    tag_fsdp_collectives(gm)
    done = fxsched.schedule(gm, "default")
    stats = done.result.stats()["overlap-reduce-scatter"]
    # the first launches as soon as its gradient is ready, and runs under the backward compute
    # after it (its wait stays where that hides it); the last has no compute after it
    assert stats["hoisted"] == 1 and stats["overlapped"] + stats["in place"] == 2
    order = [n.name for n in done.graph_module.graph.nodes]
    first, *_ = _nodes(gm, _C.reduce_scatter_tensor_coalesced.default)
    (getitem,) = first.users
    (wait,) = getitem.users
    # backward matmuls run between the first coalesced reduce-scatter's launch and its wait
    assert any(n.startswith("mm") for n in order[order.index(first.name):order.index(wait.name)])
    before = simulate(lower(gm), "h100")
    after = simulate(done.program, "h100")
    assert before.exposed_by_collective[first.name] > 0 and after.exposed_by_collective[first.name] == 0
    assert after.step_ms < before.step_ms and after.exposed_ms < before.exposed_ms


def test_an_in_place_coalesced_collective_stays_opaque():
    """`all_reduce_coalesced_` writes its inputs: its waits complete that write, which a wait per
    result naming the launch does not say; it keeps its place."""
    import operator

    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    reduced = g.call_function(_C.all_reduce_coalesced_.default, ([a, b], "sum", "0"))
    waits = [g.call_function(_C.wait_tensor.default, (g.call_function(operator.getitem, (reduced, i)),))
             for i in range(2)]
    g.output(tuple(waits))
    program = lower(fx.GraphModule(torch.nn.Module(), g))
    verify(program)
    assert isinstance(program.op(reduced.name), Opaque) and program.op(reduced.name).writes == ("a", "b")


def test_verify_refuses_a_malformed_coalesced_launch():
    good = """
    %a = input
    %b = input
    ^entry
    %c = launch "ag_coalesced"(%a, %b) {group = "0"} : (f32[4], f32[4])
    %r0 = view "getitem"(%c) : f32[4]
    %r1 = view "getitem"(%c) : f32[4]
    %w0 = wait(%r0) {launch = %c}
    %w1 = wait(%r1) {launch = %c}
    %output = output(%w0, %w1)
    """
    text = "\n".join(line.strip() for line in good.splitlines())
    verify(parse_program(text))
    # a result read by something other than its wait
    bad = text.replace("%output = output(%w0, %w1)", "%n = compute \"neg\"(%r1)\n%output = output(%w0, %w1, %n)")
    with pytest.raises(VerifyError, match="coalesced launch's every user must be a view of one result"):
        verify(parse_program(bad))
    # a wait naming a launch its operand is no view of
    bad = text.replace("%w1 = wait(%r1) {launch = %c}", "%w1 = wait(%a) {launch = %c}")
    with pytest.raises(VerifyError, match="a wait naming launch %c must have exactly one operand, a view"):
        verify(parse_program(bad))
    # a coalesced launch waited directly as well
    bad = text.replace("%w1 = wait(%r1) {launch = %c}", "%w1 = wait(%c)")
    with pytest.raises(VerifyError, match="coalesced launch's every user"):
        verify(parse_program(bad))


@pytest.mark.multirank
@pytest.mark.parametrize("build", ["coalesced-gathers", "inductor-coalesced-reduce-scatter"])
def test_scheduled_coalesced_graphs_are_bitwise_equal_on_two_ranks(build):
    gm = _joint(_step_coalesced) if build == "coalesced-gathers" else _inductor_coalesced()
    tag_fsdp_collectives(gm)
    scheduled = [fxsched.schedule(gm, pipeline).graph_module for pipeline in ("default", "reference")]
    original = [n.name for n in gm.graph.nodes]
    assert all([n.name for n in s.graph.nodes] != original for s in scheduled)
    inputs = _rank_inputs()
    plain = run_graph(gm, inputs)
    for module in scheduled:
        for a, b in zip(plain, run_graph(module, inputs), strict=True):
            assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b, strict=True))
