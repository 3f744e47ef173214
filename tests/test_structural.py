"""Structural recognition of FSDP gathers in untagged graphs (lowering/structural.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed._functional_collectives  # noqa: F401  (autograd for the functional collectives)
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

import fxsched
from fxsched.integrations.structural import (STRUCTURAL_TAG, find_fsdp_gathers, tag_fsdp_gathers,
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
    assert "2 tagged, 0 skipped" in str(result) and "%s1_1" in str(result)


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
    assert tag_fsdp_gathers(gm.graph).as_dict() == {"tagged": [], "skipped": []}
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
