"""Structural recognition of FSDP gathers in untagged graphs (lowering/structural.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed._functional_collectives  # noqa: F401  (autograd for the functional collectives)
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

import fxsched
from fxsched.integrations.structural import (STRUCTURAL_TAG, find_fsdp_gathers, tag_fsdp_collectives, tag_fsdp_gathers,
                                             untag_fsdp_gathers)
from fxsched.ir import Launch, Role
from fxsched.lowering import lower

_C = torch.ops._c10d_functional


def _gather(t, world=2):
    return _C.wait_tensor(_C.all_gather_into_tensor(t, world, "0"))


def _trace(f, *args):
    return make_fx(f, tracing_mode="fake")(*args)


def _gathers(gm):
    return gm.graph.find_nodes(op="call_function", target=_C.all_gather_into_tensor.default)


def _layers(s1, s2, x):
    """Two layers, each gathering its (cast, viewed) shard right before use: SimpleFSDP's shape."""
    w1 = _gather(s1.to(torch.bfloat16).view(-1)).float().view(4, 4)
    x = torch.tanh(x @ w1)
    w2 = _gather(s2).view(4, 4)
    return (torch.tanh(x @ w2),)


def _layers_gm():
    return _trace(_layers, torch.randn(8), torch.randn(8), torch.randn(2, 4))


def test_tags_gathers_through_casts_and_views():
    gm = _layers_gm()
    result = tag_fsdp_gathers(gm)
    assert [g.param_name for g in result.tagged] == ["s1_1", "s2_1"] and result.skipped == []
    first, second = result.tagged
    assert first.path == ("_to_copy", "view")
    assert second.path == ()
    g1, g2 = _gathers(gm)
    assert g1.meta["comm_type"] == g2.meta["comm_type"] == "fsdp_all_gather"
    assert g1.meta["param_name"] == "s1_1" and g1.meta[STRUCTURAL_TAG] is True
    assert g1.meta["fsdp_unsharded_nbytes"] == 16 * 2  # 16 bf16 elements gathered
    assert g2.meta["fsdp_unsharded_nbytes"] == 16 * 4
    assert "2 gathers and 0 gradient reductions tagged, 0 skipped" in str(result) and "%s1_1" in str(result)


def test_lowering_sees_tagged_gathers():
    gm = _layers_gm()
    assert not any(isinstance(op, Launch) and op.is_gather for op in lower(gm).ops())  # untagged: not gathers
    tag_fsdp_gathers(gm)
    launches = [op for op in lower(gm).ops() if isinstance(op, Launch) and op.is_gather]
    assert [(op.role, op.params, op.nbytes) for op in launches] == [
        (Role.GATHER, ("s1_1",), 32), (Role.GATHER, ("s2_1",), 64)]


def test_tagged_graph_is_scheduled():
    gm = _layers_gm()
    tag_fsdp_gathers(gm)
    done = fxsched.schedule(gm, "reference")
    moved = [row for row in done.report["gathers"] if row["moved"]]
    # anchored at the first consumer of the first gather: its cast back to f32
    assert [(row["params"], row["anchor"]) for row in moved] == [(["s2_1"], "_to_copy_1")]
    order = [n.name for n in done.graph_module.graph.nodes]
    assert order.index("all_gather_into_tensor_1") < order.index("_to_copy_1") < order.index("mm")


def test_backward_phase_from_meta_or_override():
    gm = _layers_gm()
    g1, g2 = _gathers(gm)
    g2.meta["autograd_backward"] = True
    assert [g.phase for g in tag_fsdp_gathers(gm).tagged] == ["forward", "backward"]
    assert g2.meta["comm_type"] == "fsdp_all_gather_backward"
    assert [g.phase for g in tag_fsdp_gathers(gm, phase="backward").tagged] == ["backward", "backward"]
    assert g1.meta["comm_type"] == "fsdp_all_gather_backward"
    with pytest.raises(ValueError, match="phase"):
        tag_fsdp_gathers(gm, phase="bwd")


def test_not_recognised_with_reasons():
    def f(s, x):
        a = _gather(s * 2.0)               # computed from the shard, not a cast/view of it
        b = _gather(x @ x)                 # an activation
        c = _C.all_gather_into_tensor(s, 2, "0")
        return (a, b, _C.wait_tensor(c), c + 1)  # c has a second user besides its wait

    gm = _trace(f, torch.randn(4), torch.randn(4, 4))
    result = tag_fsdp_gathers(gm)
    assert result.tagged == []
    reasons = dict(result.skipped)
    assert len(reasons) == 3
    assert "stopped at %mul" in reasons["all_gather_into_tensor"]
    assert "stopped at %mm" in reasons["all_gather_into_tensor_1"]
    assert "not exactly one wait_tensor" in reasons["all_gather_into_tensor_2"]
    assert all("comm_type" not in g.meta for g in _gathers(gm))


def test_hyperparallel_tags_win():
    gm = _layers_gm()
    g1, _ = _gathers(gm)
    g1.meta.update(comm_type="fsdp_all_gather", param_name="layers.0.weight", fsdp_unsharded_nbytes=7)
    result = tag_fsdp_gathers(gm)
    assert [g.param_name for g in result.tagged] == ["s2_1"]
    assert result.skipped == [("all_gather_into_tensor", "already tagged comm_type='fsdp_all_gather'")]
    assert g1.meta["param_name"] == "layers.0.weight" and STRUCTURAL_TAG not in g1.meta
    untag_fsdp_gathers(gm)
    assert g1.meta["param_name"] == "layers.0.weight"  # not ours: kept


def test_idempotent_and_untag():
    gm = _layers_gm()
    first = tag_fsdp_gathers(gm)
    metas = [dict(g.meta) for g in _gathers(gm)]
    assert tag_fsdp_gathers(gm) == first
    assert [dict(g.meta) for g in _gathers(gm)] == metas
    assert untag_fsdp_gathers(gm) == 2
    assert all("comm_type" not in g.meta and "param_name" not in g.meta for g in _gathers(gm))


def test_unknown_size_is_left_out():
    gm = _layers_gm()
    g1, _ = _gathers(gm)
    del g1.meta["val"]
    tag_fsdp_gathers(gm)
    assert "fsdp_unsharded_nbytes" not in g1.meta
    program = lower(gm)
    assert program.op(g1.name).nbytes is None
    assert any("size unknown" in note for note in program.notes)


def test_graph_without_gathers_is_untouched():
    gm = _trace(lambda x: (torch.tanh(x @ x),), torch.randn(3, 3))
    metas = [dict(n.meta) for n in gm.graph.nodes]
    assert tag_fsdp_gathers(gm.graph).as_dict() == {"tagged": [], "reductions": [], "skipped": []}
    assert [dict(n.meta) for n in gm.graph.nodes] == metas


def test_find_reports_every_gather_in_order():
    gm = _layers_gm()
    found = list(find_fsdp_gathers(gm.graph))
    assert [n.name for n, _, _ in found] == ["all_gather_into_tensor", "all_gather_into_tensor_1"]
    assert all(g is not None and why is None for _, g, why in found)
    assert all("comm_type" not in n.meta for n, _, _ in found)  # finding tags nothing


def test_hand_built_graph_with_getitem_and_clone():
    graph = fx.Graph()
    shard = graph.placeholder("shard")
    piece = graph.call_function(torch.ops.aten.clone.default, (shard,))
    launch = graph.call_function(_C.all_gather_into_tensor.default, (piece, 2, "0"))
    wait = graph.call_function(_C.wait_tensor.default, (launch,))
    graph.output((wait,))
    (gather,) = tag_fsdp_gathers(graph).tagged
    assert gather.path == (piece.name,) and gather.param_name == "shard" and gather.nbytes is None


# --------------------------------------------------------------------------- gradient reductions


def _reduce(t, kind="rs", group="0"):
    if kind == "rs":
        return _C.wait_tensor(_C.reduce_scatter_tensor(t, "sum", 2, group))
    return _C.wait_tensor(_C.all_reduce(t, "sum", group))


def _backward_gm(f, *args):
    gm = _trace(f, *args)
    for node in gm.graph.nodes:
        if node.op == "call_function":
            node.meta["autograd_backward"] = True
    return gm


def _grads(x, w):
    """Two gradients, each cast to bf16, reduce-scattered, cast back to fp32 for the output (SimpleFSDP's
    backward with bf16 parameters); more compute after the first."""
    g1 = torch.tanh(x @ w)
    r1 = _reduce(g1.to(torch.bfloat16).flatten()).float()
    g2 = torch.tanh(g1 @ w)
    r2 = _reduce(g2.to(torch.bfloat16).flatten()).float()
    return (r1, r2)


def _reductions(gm):
    return gm.graph.find_nodes(op="call_function", target=_C.reduce_scatter_tensor.default)


def test_gradient_reduce_scatters_are_tagged_with_their_tails():
    gm = _backward_gm(_grads, torch.randn(4, 4), torch.randn(4, 4))
    result = tag_fsdp_collectives(gm)
    assert result.skipped == [] and result.tagged == []
    assert [(r.kind, r.group, r.tail) for r in result.reductions] == [
        ("reduce_scatter_tensor", "0", ("_to_copy_1",)),
        ("reduce_scatter_tensor", "0", ("_to_copy_3",))]
    rs = _reductions(gm)
    assert all(n.meta["comm_type"] == "fsdp_reduce_scatter" and n.meta[STRUCTURAL_TAG] for n in rs)
    assert [op.role for op in lower(gm).ops() if isinstance(op, Launch)] == [Role.REDUCE_SCATTER] * 2
    assert "2 gradient reductions tagged" in str(result)
    assert untag_fsdp_gathers(gm) == 2 and not any("comm_type" in n.meta for n in rs)
    assert tag_fsdp_gathers(gm).reductions == []  # gathers only


def test_cast_after_a_reduce_scatter_wait_does_not_pin_it():
    gm = _backward_gm(_grads, torch.randn(4, 4), torch.randn(4, 4))
    tag_fsdp_collectives(gm)
    done = fxsched.schedule(gm, "overlap-reduce-scatter")
    order = [n.name for n in done.graph_module.graph.nodes]
    # the first gradient's wait and its cast moved below the second gradient's matmul
    assert order.index("mm_1") < order.index("wait_tensor") < order.index("_to_copy_1")
    assert done.result.stats()["overlap-reduce-scatter"]["overlapped"] >= 1
    assert order != [n.name for n in gm.graph.nodes]
    # the same without the structural tags: nothing is a gradient reduction, nothing moves
    untag_fsdp_gathers(gm)
    plain = fxsched.schedule(gm, "overlap-reduce-scatter")
    assert [n.name for n in plain.graph_module.graph.nodes] == [n.name for n in gm.graph.nodes]


def test_hsdp_reduce_scatter_then_all_reduce_and_ddp_all_reduce():
    def f(x, w):
        g1 = torch.tanh(x @ w)
        hsdp = _reduce(_reduce(g1.flatten()), "ar", "1") / 4  # reduce-scatter in the shard group, all-reduce across
        ddp = _reduce(x @ w, "ar")
        return (hsdp, ddp)

    gm = _backward_gm(f, torch.randn(4, 4), torch.randn(4, 4))
    result = tag_fsdp_collectives(gm)
    assert [(r.kind, r.group) for r in result.reductions] == [
        ("reduce_scatter_tensor", "0"), ("all_reduce", "1"), ("all_reduce", "0")]
    first = result.reductions[0]
    assert first.tail == ("all_reduce", "wait_tensor_1", "div")  # through the all-reduce to the output
    roles = [op.role for op in lower(gm).ops() if isinstance(op, Launch)]
    assert roles == [Role.REDUCE_SCATTER] * 3
    assert [r.launch for r in tag_fsdp_collectives(gm, groups=["0"]).reductions] == [
        "reduce_scatter_tensor", "all_reduce_1"]


def test_a_tied_parameters_gradients_summed_after_their_reductions():
    """llama3 1B ties its embedding and output weights: gathered for each use, the parameter's
    gradient comes back as one reduce-scatter per use, summed for the output. Both are gradient
    reductions; a reduction added to anything else (an activation) is not."""
    def tied(x, w):
        g1 = torch.tanh(x @ w)
        g2 = torch.tanh(g1 @ w)
        return (_reduce(g1.flatten()) + _reduce(g2.flatten()).float(),)

    gm = _backward_gm(tied, torch.randn(4, 4), torch.randn(4, 4))
    result = tag_fsdp_collectives(gm)
    assert result.skipped == [] and len(result.reductions) == 2
    assert all("add" in r.tail for r in result.reductions)

    def mixed(x, w):
        return (_reduce((x @ w).flatten()) + x.flatten()[:8],)

    gm = _backward_gm(mixed, torch.randn(4, 4), torch.randn(4, 4))
    result = tag_fsdp_collectives(gm)
    assert result.reductions == [] and "reaches %add" in result.skipped[0][1]


def test_activation_collectives_are_not_fsdp():
    """Tensor parallelism: collectives on activations feed compute, or gather a computed value,
    or gather token ids; in the forward an all-reduce to the output (a loss) is not a gradient's."""
    def f(tokens, x, w):
        act = _reduce(x @ w, "ar")                         # TP all-reduce of a row-parallel output
        seq = _reduce((act @ w).flatten())                 # sequence-parallel reduce-scatter
        gathered = _gather(seq).view(4, 4)                 # sequence-parallel all-gather of an activation
        ids = _gather(tokens)                              # token ids gathered (an integer graph input)
        return (torch.tanh(gathered @ w).sum() + ids.sum(),)

    gm = _backward_gm(f, torch.randint(9, (4,)), torch.randn(4, 4), torch.randn(4, 4))
    result = tag_fsdp_collectives(gm)
    assert result.tagged == [] and result.reductions == []
    reasons = dict(result.skipped)
    assert "reaches %mm_1" in reasons["all_reduce"] and "activation" in reasons["all_reduce"]
    assert "reaches %all_gather_into_tensor" in reasons["reduce_scatter_tensor"]
    assert "stopped at %wait_tensor_1" in reasons["all_gather_into_tensor"]  # a computed value
    assert "torch.int64" in reasons["all_gather_into_tensor_1"]
    assert not any("comm_type" in n.meta for n in gm.graph.nodes)

    loss = _trace(lambda x: (_reduce(x.sum(), "ar") / 2,), torch.randn(4))
    (skip,) = tag_fsdp_collectives(loss).skipped
    assert skip[1] == "a forward collective: not a gradient's reduction"


def test_groups_limit_recognition():
    gm = _layers_gm()
    result = tag_fsdp_collectives(gm, groups={"1"})
    assert result.tagged == [] and all("not one of the FSDP groups ['1']" in r for _, r in result.skipped)
    assert len(tag_fsdp_collectives(gm, groups={"0"}).tagged) == 2
    with pytest.raises(TypeError):
        tag_fsdp_collectives(gm, groups="0")
