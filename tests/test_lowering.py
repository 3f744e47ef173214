"""Lowering hand-built FX graphs: kinds and attributes for every tag, notes, errors, effect edges."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.distributed._functional_collectives  # noqa: F401  (registers the functional collectives)
import torch.nn.functional as F
from torch import fx

from fxsched.ir import (BACKWARD, ENTRY, Barrier, Cast, Compute, Constant, CopyOut, Free, Input, Launch, Opaque, Output, Phase,
                        Role, View, Wait, print_program, verify)
from fxsched.lowering import LoweringError, lower, target_name
from fxsched.raising import raise_program

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
AG = c10d.all_gather_into_tensor.default
WAIT = c10d.wait_tensor.default
RS = c10d.reduce_scatter_tensor.default
AR = c10d.all_reduce.default


@torch.fx.node.has_side_effect
def reshard_free(tensor):
    """What an FSDP pass inserts after the last use of an unsharded parameter."""
    tensor.untyped_storage().resize_(0)


@torch.fx.node.has_side_effect
def log_value(tensor):
    pass


# an NPU attention kernel stand-in, registered by name as torch-npu would
_lib = torch.library.Library("fxsched_test", "DEF")
_lib.define("npu_fusion_attention(Tensor q, Tensor k, Tensor v) -> Tensor")
_lib.impl("npu_fusion_attention", lambda q, k, v: q + k + v, "CompositeExplicitAutograd")


class G:
    """A tiny builder over fx.Graph that sets meta in one call."""

    def __init__(self):
        self.graph = fx.Graph()

    def input(self, name):
        return self.graph.placeholder(name)

    def call(self, target, *args, kwargs=None, name=None, **meta):
        node = self.graph.call_function(target, args, kwargs or {})
        if name:
            node.name = name  # only used before any collision
        node.meta.update(meta)
        return node

    def gather(self, shard, param=None, nbytes=64, group="0", comm_type="fsdp_all_gather", view=(4, 4), **meta):
        """all_gather_into_tensor → wait_tensor → slice → view, tagged like an FSDP pass does."""
        if param is not None:
            meta.setdefault("param_name", param)
        if nbytes is not None:
            meta["fsdp_unsharded_nbytes"] = nbytes
        ag = self.call(AG, shard, 2, group, comm_type=comm_type, **meta)
        wt = self.call(WAIT, ag)
        sl = self.call(aten.slice.Tensor, wt, 0, 0, 16)
        vw = self.call(aten.view.default, sl, list(view))
        return ag, wt, sl, vw

    def output(self, *values):
        self.graph.output(tuple(values))
        return fx.GraphModule(torch.nn.Module(), self.graph)


def op(program, node):
    return program.op(node.name)


def edges(program, why):
    return {(u, v) for u, v, w in program.effect_edges() if w == why}


# ---- kinds and attributes --------------------------------------------------------------------

def test_every_kind_is_recognised():
    g = G()
    x, w, b = g.input("x"), g.input("w"), g.input("bucket_shard")
    cast = g.call(torch.ops.prims.convert_element_type.default, w, torch.bfloat16)
    ag, wt, sl, vw = g.gather(cast, param="layer.w", nbytes=4096, group="7")
    bag = g.call(AG, b, 2, "0", comm_type="fsdp_all_gather", fsdp_bucket_id=3,
                 fsdp_bucket_members=["a.w", "a.b"], fsdp_unsharded_nbytes=128)
    bwt = g.call(WAIT, bag)
    co = g.call(aten.clone.default, bwt, fsdp_bucket_copy_out=3)
    plain_clone = g.call(aten.clone.default, x)
    mm = g.call(aten.mm.default, x, vw)
    att = g.call(F.scaled_dot_product_attention, mm, mm, mm)
    flash = g.call(aten._scaled_dot_product_flash_attention_for_cpu.default, att, att, att)
    first = g.call(operator.getitem, flash, 0)
    npu = g.call(torch.ops.fxsched_test.npu_fusion_attention.default, first, first, first)
    add = g.call(aten.add.Tensor, npu, co)
    to_copy = g.call(aten._to_copy.default, add, kwargs={"dtype": torch.float16})
    free = g.call(reshard_free, wt, comm_type="fsdp_reshard_free", param_name="layer.w")
    copy_ = g.call(aten.copy_.default, x, add)
    tagged = g.call(aten.neg.default, add, barrier=True)
    side = g.call(log_value, add)
    rand = g.call(aten.rand_like.default, add)
    rs = g.call(RS, add, "sum", 2, "0", comm_type="fsdp_reduce_scatter", autograd_backward=True)
    rsw = g.call(WAIT, rs, autograd_backward=True)
    ar = g.call(AR, rsw, "sum", "1", autograd_backward=True)
    arw = g.call(WAIT, ar, autograd_backward=True)
    gm = g.output(arw, to_copy, plain_clone, rand, tagged)
    before = gm.code
    p = lower(gm)
    assert gm.code == before  # lowering leaves the module alone

    assert op(p, x) == Input(name="x", target="x")
    assert isinstance(op(p, cast), Cast) and op(p, cast).target == "prims.convert_element_type.default"
    assert isinstance(op(p, to_copy), Cast)
    assert op(p, ag) == Launch(name=ag.name, operands=(cast.name,), target="_c10d_functional.all_gather_into_tensor.default",
                               group="7", group_size=2, role=Role.GATHER, nbytes=4096, params=("layer.w",))
    assert op(p, wt) == Wait(name=wt.name, operands=(ag.name,), target="_c10d_functional.wait_tensor.default")
    assert isinstance(op(p, sl), View) and isinstance(op(p, vw), View) and isinstance(op(p, first), View)
    assert op(p, bag).params == ("a.w", "a.b") and op(p, bag).bucket == "3" and op(p, bag).hold is None
    assert op(p, co) == CopyOut(name=co.name, operands=(bwt.name,), target="aten.clone.default", bucket="3")
    assert type(op(p, plain_clone)) is Compute  # a clone without the copy-out tag is plain compute
    assert op(p, mm) == Compute(name=mm.name, operands=(x.name, vw.name), target="aten.mm.default", heavy=True)
    for attention in (att, flash, npu):
        assert op(p, attention).heavy and op(p, attention).attention, attention.name
    assert op(p, att).target == "torch._C._nn.scaled_dot_product_attention"
    assert not op(p, add).heavy and not op(p, add).attention and not op(p, add).random
    assert op(p, free) == Free(name=free.name, operands=(wt.name,), target=target_name(free), params=("layer.w",))
    # an in-place op is no barrier: it writes its operand's storage (and returns it)
    assert op(p, copy_) == Compute(name=copy_.name, operands=(x.name, add.name), target="aten.copy_.default",
                                   writes=(x.name,), alias=x.name)
    assert op(p, tagged).reason == "tagged barrier" and isinstance(op(p, tagged), Barrier)
    assert op(p, side).reason == "side effect" and isinstance(op(p, side), Barrier)
    assert isinstance(op(p, rand), Compute) and op(p, rand).random
    assert op(p, rs) == Launch(name=rs.name, operands=(add.name,), target="_c10d_functional.reduce_scatter_tensor.default",
                               group="0", group_size=2, role=Role.REDUCE_SCATTER, phase=Phase.BACKWARD, reduce_op="sum")
    assert op(p, ar).role is None and op(p, ar).group == "1" and not op(p, ar).is_gather
    assert op(p, ar).reduce_op == "sum" and op(p, ag).reduce_op is None
    assert op(p, ar).group_size is None  # all_reduce has no group_size argument
    assert isinstance(op(p, arw), Wait) and op(p, arw).phase is Phase.BACKWARD
    assert isinstance(p.op("output"), Output)
    assert p.notes == []
    verify(p)


def test_overload_packets_are_classified_too():
    g = G()
    x = g.input("x")
    mm = g.call(aten.mm, x, x)
    add_ = g.call(aten.add_, mm, x)
    neg = g.call(aten.neg, add_)
    out = g.call(aten.neg, add_, kwargs={"out": neg})
    gm = g.output(out)
    p = lower(gm)
    assert type(op(p, mm)) is Compute and op(p, mm).heavy  # its mm.out overload is not used
    assert type(op(p, neg)) is Compute
    assert type(op(p, add_)) is Compute and op(p, add_).writes == (mm.name,) and op(p, add_).alias == mm.name
    assert type(op(p, out)) is Compute and op(p, out).writes == (neg.name,)  # out= passed


def test_placeholders_are_inputs_and_get_attr_a_constant_in_place():
    g = G()
    x = g.input("x")
    root = torch.nn.Module()
    root.register_buffer("buf", torch.ones(2))
    const = g.graph.get_attr("buf")
    add = g.call(aten.add.Tensor, x, const)
    g.graph.output(add)
    p = lower(fx.GraphModule(root, g.graph))
    assert p.op("x") == Input(name="x", target="x")
    assert op(p, const) == Constant(name=const.name, target="buf")
    assert p.schedule.names() == ["x", ENTRY, const.name, add.name, "output"]


# ---- sizes ----------------------------------------------------------------------------------

@pytest.mark.parametrize("value, expected", [(0, 0), (12345, 12345), (2**40, 2**40)])
def test_nbytes_valid(value, expected):
    g = G()
    ag, wt, sl, vw = g.gather(g.input("w"), param="w", nbytes=value)
    p = lower(g.output(vw))
    assert op(p, ag).nbytes == expected
    assert p.notes == []


@pytest.mark.parametrize("value", [True, False, -1, 64.0, "64", None], ids=repr)
def test_nbytes_unknown_is_none_with_a_note(value):
    g = G()
    ag, wt, sl, vw = g.gather(g.input("w"), param="w", nbytes=None)
    if value is not None:
        ag.meta["fsdp_unsharded_nbytes"] = value
    p = lower(g.output(vw))
    assert op(p, ag).nbytes is None
    assert op(p, ag).hold is None  # unknown size is the budget's business, not the lowering's
    assert p.notes == [f"%{ag.name}: fsdp_unsharded_nbytes={value!r} is not a non-negative int: size unknown"]


# ---- gathers, buckets, names -----------------------------------------------------------------

def test_regather_role_and_backward_phase():
    g = G()
    ag, wt, sl, vw = g.gather(g.input("w"), param="w", comm_type="fsdp_all_gather_backward", autograd_backward=True)
    p = lower(g.output(vw))
    assert op(p, ag).role is Role.REGATHER and op(p, ag).is_gather and op(p, ag).phase is Phase.BACKWARD


def test_bucket_members_become_params():
    g = G()
    ag = g.call(AG, g.input("flat"), 2, "0", comm_type="fsdp_all_gather", fsdp_bucket_id="b1",
                fsdp_bucket_members=("l.q", "l.k", "l.v"), param_name="ignored", fsdp_unsharded_nbytes=96)
    wt = g.call(WAIT, ag)
    outs = [g.call(aten.clone.default, g.call(aten.slice.Tensor, wt, 0, 16 * i, 16 * i + 16),
                   fsdp_bucket_copy_out="b1") for i in range(3)]
    p = lower(g.output(*outs))
    launch = op(p, ag)
    assert (launch.params, launch.bucket, launch.nbytes, launch.hold) == (("l.q", "l.k", "l.v"), "b1", 96, None)
    assert all(isinstance(op(p, o), CopyOut) and op(p, o).bucket == "b1" for o in outs)


@pytest.mark.parametrize("members", [None, [], "l.q", ["l.q", 3]], ids=repr)
def test_bucket_without_valid_members_is_held_with_a_note(members):
    g = G()
    meta = {"fsdp_bucket_id": 5, "fsdp_unsharded_nbytes": 96}
    if members is not None:
        meta["fsdp_bucket_members"] = members
    ag = g.call(AG, g.input("flat"), 2, "0", comm_type="fsdp_all_gather", **meta)
    wt = g.call(WAIT, ag)
    p = lower(g.output(wt))
    launch = op(p, ag)
    assert launch.params == () and launch.bucket == "5" and launch.hold == "bucket without members"
    assert p.notes == [f"%{ag.name}: bucket 5 has no valid fsdp_bucket_members ({members!r}): not moved"]


@pytest.mark.parametrize("name", [None, "", 7], ids=repr)
def test_gather_without_param_name_is_held_with_a_note(name):
    g = G()
    ag, wt, sl, vw = g.gather(g.input("w"))
    if name is not None:
        ag.meta["param_name"] = name
    p = lower(g.output(vw))
    assert op(p, ag).hold == "no parameter name" and op(p, ag).params == ()
    assert p.notes == [f"%{ag.name}: param_name={name!r} is not a name: not moved"]


def test_gather_with_no_user_is_an_error_naming_the_node():
    g = G()
    ag = g.call(AG, g.input("w"), 2, "0", comm_type="fsdp_all_gather", param_name="w", fsdp_unsharded_nbytes=8)
    gm = g.output(g.graph.find_nodes(op="placeholder")[0])
    with pytest.raises(LoweringError, match=rf"FSDP gather %{ag.name} \(fsdp_all_gather\) must have exactly one "
                                            r"user, a wait_tensor; it has \[\]"):
        lower(gm)


def test_gather_with_two_users_is_an_error_naming_the_node():
    g = G()
    ag = g.call(AG, g.input("w"), 2, "0", comm_type="fsdp_all_gather_backward", param_name="w")
    w1, w2 = g.call(WAIT, ag), g.call(WAIT, ag)
    with pytest.raises(LoweringError) as info:
        lower(g.output(w1, w2))
    assert f"%{ag.name} (fsdp_all_gather_backward)" in str(info.value)
    assert f"[{w1.name!r}, {w2.name!r}]" in str(info.value)


def test_gather_whose_user_is_not_a_wait_is_an_error():
    g = G()
    ag = g.call(AG, g.input("w"), 2, "0", comm_type="fsdp_all_gather", param_name="w")
    neg = g.call(aten.neg.default, ag)
    with pytest.raises(LoweringError, match=rf"%{ag.name} .* it has \['{neg.name}'\]"):
        lower(g.output(neg))


def test_gather_tag_on_other_ops_is_noted_not_followed():
    g = G()
    x = g.input("x")
    ar = g.call(AR, x, "sum", "0", comm_type="fsdp_all_gather", param_name="x")
    arw = g.call(WAIT, ar)
    neg = g.call(aten.neg.default, arw, comm_type="fsdp_all_gather_backward", param_name="x")
    p = lower(g.output(neg))
    assert op(p, ar).role is None and op(p, ar).params == ()
    assert type(op(p, neg)) is Compute
    assert p.notes == [
        f"%{ar.name}: comm_type='fsdp_all_gather' on _c10d_functional.all_reduce.default: not a gather, kept in order",
        f"%{neg.name}: comm_type='fsdp_all_gather_backward' on aten.neg.default, not a collective: ignored"]


def test_group_names_come_from_the_schema_argument():
    g = G()
    x = g.input("x")
    a1 = g.call(AG, x, 2, "tp_group")
    a2 = g.call(AG, x, kwargs={"group_size": 2, "group_name": "dp"})
    w1, w2 = g.call(WAIT, a1), g.call(WAIT, a2)
    p = lower(g.output(w1, w2))
    assert op(p, a1).group == "tp_group" and op(p, a2).group == "dp"
    assert op(p, a1).group_size == 2 and op(p, a2).group_size == 2
    assert op(p, a1).role is None  # untagged gathers are plain collectives that keep their order (per group)
    assert edges(p, "collective-order") == set()  # two groups: two streams, no order between them


def test_collective_not_waited_exactly_once_is_opaque():
    g = G()
    x = g.input("x")
    ar = g.call(AR, x, "sum", "0")
    w1, w2 = g.call(WAIT, ar), g.call(WAIT, ar)
    lone = g.call(AR, x, "sum", "0")
    p = lower(g.output(w1, w2, lone))
    for node in (ar, lone):
        assert isinstance(op(p, node), Opaque) and op(p, node).reason == "collective not waited exactly once"
        assert op(p, node).group == "0"
    for node in (w1, w2):  # waits on no launch
        assert isinstance(op(p, node), Opaque) and op(p, node).reason == "wait on no launch"
    assert (f"%{ar.name}: _c10d_functional.all_reduce.default: collective not waited exactly once: kept in place, "
            "in order with group '0'") in p.notes
    assert not any(isinstance(o, Barrier) for o in p.ops())
    verify(p)


# ---- frees ----------------------------------------------------------------------------------

def test_free_by_param_name_and_by_bucket_members():
    g = G()
    w = g.input("w")
    ag, wt, sl, vw = g.gather(w, param="w")
    f1 = g.call(reshard_free, vw, comm_type="fsdp_reshard_free", param_name="w")
    f2 = g.call(reshard_free, wt, comm_type="fsdp_reshard_free_backward", fsdp_bucket_members=["a", "b"],
                param_name="w", autograd_backward=True)
    p = lower(g.output(w))
    assert op(p, f1).params == ("w",) and op(p, f1).phase is Phase.FORWARD
    assert op(p, f2).params == ("a", "b") and op(p, f2).phase is Phase.BACKWARD
    assert p.notes == []


def test_reader_after_its_free_is_a_lowering_error():
    g = G()
    ag, wt, sl, vw = g.gather(g.input("w"), param="w")
    free = g.call(reshard_free, wt, comm_type="fsdp_reshard_free", param_name="w")
    with pytest.raises(LoweringError, match=f"%output reads storage that %{free.name} freed before it"):
        lower(g.output(sl))


@pytest.mark.parametrize("name", [None, "", ["w"]], ids=repr)
def test_free_without_param_name_is_a_barrier_with_a_note(name):
    g = G()
    ag, wt, sl, vw = g.gather(g.input("w"), param="w")
    meta = {"comm_type": "fsdp_reshard_free"}
    if name is not None:
        meta["param_name"] = name
    free = g.call(reshard_free, wt, **meta)
    p = lower(g.output(vw))
    assert op(p, free) == Barrier(name=free.name, operands=(wt.name,), target=target_name(free),
                                  reason="free without parameter name")
    assert p.notes == [f"%{free.name}: storage free without param_name ({name!r}): kept as a barrier"]


def test_free_without_operand_is_a_barrier_with_a_note():
    g = G()
    x = g.input("x")
    free = g.call(reshard_free, comm_type="fsdp_reshard_free", param_name="w")
    p = lower(g.output(x))
    assert isinstance(op(p, free), Barrier) and op(p, free).reason == "free without operand"
    assert p.notes == [f"%{free.name}: storage free with no tensor operand: kept as a barrier"]


# ---- phases ---------------------------------------------------------------------------------

def test_phases_from_autograd_backward():
    g = G()
    x = g.input("x")
    a = g.call(aten.neg.default, x)
    b = g.call(aten.neg.default, a, autograd_backward=True)
    c = g.call(aten.neg.default, b, autograd_backward=1)
    d = g.call(aten.neg.default, c, autograd_backward=False)  # untagged after backward: joins it
    p = lower(g.output(d))
    assert [op(p, n).phase for n in (a, b, c, d)] == [Phase.FORWARD] + [Phase.BACKWARD] * 3
    assert p.schedule.names() == ["x", ENTRY, a.name, BACKWARD, b.name, c.name, d.name, "output"]
    assert p.notes == ["1 untagged nodes after the first backward node: treated as backward"]
    verify(p)


# ---- effect edges: one per rule -------------------------------------------------------------

def build_fsdp_like():
    """Forward gather, free, re-gather in backward, reduce-scatters, a barrier, a random op."""
    g = G()
    x, w = g.input("x"), g.input("w")
    ag, wt, sl, vw = g.gather(w, param="w")
    t = g.call(aten.t.default, vw)
    mm = g.call(aten.mm.default, x, t)
    rnd = g.call(aten.rand_like.default, mm)
    free = g.call(reshard_free, wt, comm_type="fsdp_reshard_free", param_name="w")
    cp = g.call(aten.copy_.default, x, mm)
    rnd2 = g.call(aten.rand_like.default, x)
    rag, rwt, rsl, rvw = g.gather(w, param="w", comm_type="fsdp_all_gather_backward", autograd_backward=True)
    for n in (rwt, rsl, rvw):
        n.meta["autograd_backward"] = True
    gmm = g.call(aten.mm.default, mm, rvw, autograd_backward=True)
    rs1 = g.call(RS, gmm, "sum", 2, "0", comm_type="fsdp_reduce_scatter", autograd_backward=True)
    rs1w = g.call(WAIT, rs1, autograd_backward=True)
    rs2 = g.call(RS, gmm, "sum", 2, "0", comm_type="fsdp_reduce_scatter", autograd_backward=True)
    rs2w = g.call(WAIT, rs2, autograd_backward=True)
    gm = g.output(rs1w, rs2w, rnd, rnd2)
    return gm, locals()


def test_effect_edges_for_every_rule():
    gm, n = build_fsdp_like()
    p = lower(gm)
    verify(p)
    name = {k: v.name for k, v in n.items() if isinstance(v, fx.Node)}
    # free: every reader of the gathered storage, through the slice/view/t chain
    assert edges(p, "free") == {(name[k], name["free"]) for k in ("sl", "vw", "t", "mm")}
    assert edges(p, "regather") == {(name["free"], name["rag"])}
    assert edges(p, "collective-order") == {(name["rs1"], name["rs2"])}
    assert edges(p, "rng-order") == {(name["rnd"], name["rnd2"])}
    # copy_ writes x: no barrier; what reads x after it follows it (what read it before already
    # feeds it: mm)
    assert edges(p, "barrier") == set()
    assert edges(p, "storage") == {(name["cp"], name["rnd2"])}
    assert (name["rnd2"], BACKWARD) in edges(p, "phase") and (BACKWARD, name["rag"]) in edges(p, "phase")
    assert (ENTRY, name["ag"]) in edges(p, "entry")
    assert edges(p, "output") == set()  # every sink already feeds the output
    text = print_program(p, effects=True)
    assert f"// effect %{name['free']} -> %{name['rag']} (regather)" in text


def test_free_edges_reach_readers_of_the_storage_through_getitem_and_views():
    g = G()
    x, w = g.input("x"), g.input("w")
    ag = g.call(AG, w, 2, "0", comm_type="fsdp_all_gather", fsdp_bucket_id=0,
                fsdp_bucket_members=["a", "b"], fsdp_unsharded_nbytes=64)
    wt = g.call(WAIT, ag)
    parts = g.call(aten.split.Tensor, wt, 16)
    first = g.call(operator.getitem, parts, 0)
    second = g.call(operator.getitem, parts, 1)
    use1 = g.call(aten.neg.default, first)
    copy = g.call(aten.clone.default, second, fsdp_bucket_copy_out=0)
    free = g.call(reshard_free, wt, comm_type="fsdp_reshard_free", fsdp_bucket_members=["a", "b"])
    use2 = g.call(aten.neg.default, copy)  # reads the copy, not the bucket: may follow the free
    p = lower(g.output(use1, use2, x))
    readers = {u for u, v in edges(p, "free") if v == free.name}
    assert readers == {parts.name, first.name, second.name, use1.name, copy.name}
    verify(p)


# ---- graphs without tags ------------------------------------------------------------------------

def test_untagged_graph_lowers_and_raises_to_identical_code():
    def f(x, w, b):
        h = torch.relu(x @ w.t() + b)
        h = F.scaled_dot_product_attention(h[None, None], h[None, None], h[None, None])[0, 0]
        y = torch.ops.aten.mm.default(h, w)
        x.add_(1)
        return y.sum(), h.to(torch.float16)

    gm = fx.symbolic_trace(f)
    for node in gm.graph.nodes:
        node.meta["kept"] = node.name
    p = lower(gm)
    verify(p)
    assert not any(isinstance(o, (Launch, Free)) for o in p.ops())
    raised = raise_program(p)
    assert raised.code == gm.code
    assert [n.meta.get("kept") for n in raised.graph.nodes] == [n.name for n in gm.graph.nodes]
    args = (torch.randn(4, 4), torch.randn(4, 4), torch.randn(4))
    expected = gm(args[0].clone(), *args[1:])
    got = raised(args[0].clone(), *args[1:])
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_untagged_aten_graph_round_trips():
    gm, _ = build_fsdp_like()
    for node in gm.graph.nodes:
        for key in ("comm_type", "param_name", "fsdp_unsharded_nbytes", "autograd_backward"):
            node.meta.pop(key, None)
    p = lower(gm)
    assert p.notes == [] and BACKWARD not in p.graph
    # the free function is still a side effect: a barrier; copy_ writes x
    assert sum(isinstance(o, Barrier) for o in p.ops()) == 1
    assert [o.writes for o in p.ops() if o.writes] == [("x",)]
    assert raise_program(p).code == gm.code


def test_tagged_graph_raises_to_identical_code_and_keeps_meta():
    gm, _ = build_fsdp_like()
    p = lower(gm)
    raised = raise_program(p)
    assert raised.code == gm.code
    for a, b in zip(gm.graph.nodes, raised.graph.nodes):
        assert a.name == b.name and a.meta == b.meta
