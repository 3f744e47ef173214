"""Storage effects (issue 12): in-place writes order against their storage's users only, frees
after every access, opaque collectives keep their place, and it all stays linear.

IR-level tests write programs by hand; the FX-level ones build graphs as users do (make_fx,
symbolic_trace) and check what the lowering and the pipelines make of them. Running the
scheduled graphs on 2 gloo ranks is tests/test_inplace_e2e.py.
"""

from __future__ import annotations

import importlib
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.experimental.proxy_tensor import make_fx

import fxsched
from irtest import dedent, run
from fxsched.front.generate import generate_graph
from fxsched.ir import (BACKWARD, ENTRY, Barrier, Compute, Opaque, ParseError, Schedule, VerifyError, View, Wait,
                        derive_effects, parse_program, print_program, verify)
from fxsched.ir import storage as storage_module
verify_module = importlib.import_module("fxsched.ir.verify")
from fxsched.lowering import lower
from fxsched.passes import DEFAULT_PIPELINE, REFERENCE_PIPELINE
from fxsched.ir.holds import held_by_lowering

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
AG = c10d.all_gather_into_tensor.default
WAIT = c10d.wait_tensor.default


def edges(program, why):
    return {(u, v) for u, v, w in program.effect_edges() if w == why}


# ---- IR: what an in-place op orders -------------------------------------------------------------

INPLACE_ON_A_TEMPORARY = """\
%x = input
%s0 = input
%s1 = input
^entry
%g0 = launch "ag"(%s0) {role = fsdp_all_gather, nbytes = 64, params = ["p0"]}
%w0 = wait(%g0)
%m0 = compute "aten.mm"(%x, %w0) {heavy}
%t = compute "aten.mean.dim"(%m0)
%t2 = compute "aten.add_.Tensor"(%t) {writes = [%t], alias = %t}
%r = compute "aten.rsqrt"(%t2)
%n = compute "aten.mul"(%m0, %r)
%g1 = launch "ag"(%s1) {role = fsdp_all_gather, nbytes = 64, params = ["p1"]}
%w1 = wait(%g1)
%m1 = compute "aten.mm"(%n, %w1) {heavy}
%output = output(%m1)
"""


def test_an_inplace_op_on_a_temporary_orders_nothing_else():
    p = parse_program(INPLACE_ON_A_TEMPORARY)
    # the write is no barrier: its only effect edges are with its storage's users (here all
    # data edges already), and the gather after it may launch above it
    assert edges(p, "barrier") == set() and edges(p, "storage") == set()
    assert not any(isinstance(op, Barrier) for op in p.ops())
    program, _ = run(INPLACE_ON_A_TEMPORARY, REFERENCE_PIPELINE)
    order = program.schedule.names()
    assert order.index("g1") < order.index("t2")  # prefetched across the write
    verify(program)


def test_reads_and_writes_of_one_storage_keep_their_order():
    p = parse_program(dedent("""
        %x = input
        ^entry
        %r1 = compute "aten.neg"(%x)
        %r2 = compute "aten.exp"(%x)
        %a = compute "aten.add_.Tensor"(%x, %r1) {writes = [%x], alias = %x}
        %r3 = compute "aten.neg"(%x)
        %b = compute "aten.mul_.Tensor"(%x, %r3) {writes = [%x], alias = %x}
        %c = compute "aten.mul_.Tensor"(%x) {writes = [%x], alias = %x}
        %v = view "aten.view"(%c)
        %r4 = compute "aten.neg"(%v)
        %output = output(%r2, %r4, %a, %b)
    """))
    # readers before a write precede it; the write precedes the readers after it; writes keep
    # their order (through the readers between them, or directly)
    assert edges(p, "storage") == {("r2", "a"), ("a", "r3"), ("b", "c"), ("c", "r4"), ("c", "output")}
    verify(p)
    for before, after in [("r2", "a"), ("a", "r3"), ("b", "c")]:
        p.schedule.move_before([after], before)
        with pytest.raises(fxsched.ir.VerifyError, match="effect edge \\(storage\\)"):
            verify(p)
        p.schedule.move_before([before], after)  # put it back
    verify(p)


def test_the_text_form_declares_and_prints_what_an_op_writes():
    p = parse_program(INPLACE_ON_A_TEMPORARY)
    assert p.op("t2").writes == ("t",) and p.op("t2").alias == "t"
    text = print_program(p)
    assert '%t2 = compute "aten.add_.Tensor"(%t) {writes = [%t], alias = %t}' in text
    assert print_program(parse_program(text)) == text


def test_writes_and_alias_must_be_operands():
    p = parse_program("%x = input\n%y = input\n%a = compute(%x) {writes = [%y], alias = %y}\n%output = output(%a)\n")
    with pytest.raises(fxsched.ir.VerifyError) as info:
        verify(p)
    assert info.value.problems == ["%a: writes ['y'], which are not all operands ['x']",
                                   "%a: alias %y is not an operand ['x']"]


def test_a_write_after_the_free_is_a_use_after_free():
    with pytest.raises(ParseError, match=r"%a writes storage that %f freed before it"):
        parse_program(dedent("""
            %s = input
            ^entry
            %g = launch "ag"(%s) {role = fsdp_all_gather, params = ["p"]}
            %w = wait(%g)
            %v = view(%w)
            %f = free(%v) {params = ["p"]}
            %a = compute "aten.add_"(%v) {writes = [%v]}
            %output = output(%a)
        """))


def test_a_read_through_a_maybe_view_after_the_free_is_a_note_not_an_error():
    text = dedent("""
        %s = input
        ^entry
        %g = launch "ag"(%s) {role = fsdp_all_gather, params = ["p"]}
        %w = wait(%g)
        %t = view "aten.t"(%w)
        %c = view "aten.contiguous"(%t) {maybe}
        %f = free(%w) {params = ["p"]}
        %n = compute "aten.neg"(%c)
        %output = output(%n)
    """)
    p = parse_program(text)
    assert p.notes == ["%n reads %c, which may alias storage %f freed before it: taken for a copy "
                       "(no order kept with the free)"]
    assert ("c", "f") in edges(p, "free")  # the maybe view itself reads the storage: before the free
    verify(p)
    with pytest.raises(ParseError, match=r"%n reads storage that %f freed before it"):
        parse_program(text.replace(" {maybe}", ""))  # a view for certain: the graph reads freed memory


def test_a_cycle_of_views_is_a_verify_error_not_a_hang():
    p = parse_program("%x = input\n%a = view(%b)\n%b = view(%a)\n%c = compute(%x)\n%output = output(%b, %c)\n")
    with pytest.raises(fxsched.ir.VerifyError, match=r"cycle: %a -> %b -> %a"):
        verify(p)
    # the same with an alias, and with a free of it
    p = parse_program("%x = input\n%a = compute(%b) {alias = %b}\n%b = view(%a)\n%f = free(%a) {params = [\"p\"]}\n"
                      "%output = output(%x)\n")
    with pytest.raises(fxsched.ir.VerifyError, match=r"cycle"):
        verify(p)


def test_opaque_ops_keep_their_group_order_and_what_they_write():
    p = parse_program(dedent("""
        %x = input
        %y = input
        %s = input
        ^entry
        %rs = launch "rs"(%x) {group = "0", role = fsdp_reduce_scatter}
        %rsw = wait(%rs)
        %co = opaque "all_reduce_coalesced_"(%y) {group = "0", reason = "coalesced collective", writes = [%y]}
        %m = compute "aten.neg"(%y)
        %u = opaque "wait_tensor"(%x) {reason = "wait on no launch", writes = [%x]}
        %g = launch "ag"(%s) {group = "0", role = fsdp_all_gather, nbytes = 64, params = ["p"]}
        %w = wait(%g)
        %mm = compute "aten.mm"(%m, %w) {heavy}
        %output = output(%rsw, %u, %mm)
    """))
    # in order with the group's collectives (the wait, of no known group, with every group's);
    # what reads the storage they write follows them; the gather is on no order
    assert edges(p, "collective-order") == {("rs", "co"), ("co", "u")}
    assert ("co", "m") in edges(p, "storage") and ("rs", "u") in edges(p, "storage")
    assert not any("g" in e for e in edges(p, "collective-order"))
    verify(p)


# ---- linear: thousands of frees of views of one buffer ---------------------------------------------

def test_thousands_of_frees_of_views_of_one_buffer_stay_linear(monkeypatch):
    n = 3000
    lines = ["%s = input", "^entry", '%g = launch "ag"(%s) {role = fsdp_all_gather, params = ["p"]}', "%w = wait(%g)"]
    for i in range(n):
        lines += [f"%v{i} = view(%w)", f"%r{i} = compute \"aten.neg\"(%v{i})"]
    for i in range(n):
        lines.append(f'%f{i} = free(%v{i}) {{params = ["p"]}}')
    lines.append("%output = output(" + ", ".join(f"%r{i}" for i in range(n)) + ")")
    p = parse_program("\n".join(lines) + "\n")
    # readers before the first free, then each free after the one before: O(N) edges, not n^2
    assert len(edges(p, "free")) == (2 * n - 1) + (n - 1)  # %v0 -> %f0 is a data edge
    assert p.graph.number_of_edges() < 6 * p.graph.number_of_nodes()
    # the verifier walks the freed storage's readers once, not once per free
    walks = []
    real = verify_module.storage_readers
    monkeypatch.setattr(verify_module, "storage_readers", lambda *a: walks.append(a) or real(*a))
    verify(p)
    assert len(walks) == 1
    # and deriving the effects looks at each op's operands once: no reader walk at all
    monkeypatch.setattr(storage_module, "storage_readers", lambda *a: pytest.fail("derive walked readers"))
    parse_program("\n".join(lines) + "\n")


# ---- FX graphs as users build them ------------------------------------------------------------------

def _tag_gather(ag, param, nbytes=64, **meta):
    ag.meta.update(comm_type="fsdp_all_gather", param_name=param, fsdp_unsharded_nbytes=nbytes, **meta)


def rmsnorm_block(inplace: bool):
    """make_fx of two gathered matmuls around an RMSNorm whose eps add is in place (or not)."""
    def f(x, s0, s1):
        w0 = c10d.wait_tensor(c10d.all_gather_into_tensor(s0, 2, "0")).view(8, 8)
        h = x @ w0
        var = h.pow(2).mean(-1, keepdim=True)
        var = var.add_(1e-6) if inplace else var + 1e-6
        h = h * torch.rsqrt(var)
        w1 = c10d.wait_tensor(c10d.all_gather_into_tensor(s1, 2, "0")).view(8, 8)
        return (h @ w1,)

    gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 8), torch.randn(32), torch.randn(32))
    gathers = [n for n in gm.graph.nodes if n.target is AG]
    for i, ag in enumerate(gathers):
        _tag_gather(ag, f"p{i}", nbytes=256)
    return gm


def test_make_fx_add_on_a_temporary_is_a_write_not_a_barrier():
    gm = rmsnorm_block(inplace=True)
    assert any(n.target is aten.add_.Tensor for n in gm.graph.nodes)
    p = lower(gm)
    add_ = next(op for op in p.ops() if getattr(op, "target", None) == "aten.add_.Tensor")
    assert type(add_) is Compute and add_.writes == (add_.operands[0],) and add_.alias == add_.operands[0]
    assert not any(isinstance(op, Barrier) for op in p.ops()) and edges(p, "barrier") == set()
    # its gather moves exactly as in the out-of-place version
    for pipeline in (REFERENCE_PIPELINE, DEFAULT_PIPELINE):
        moved = [fxsched.schedule(rmsnorm_block(inplace), pipeline).report["gathers"] for inplace in (True, False)]
        assert [(g["moved"], g.get("reason")) for g in moved[0]] == [(g["moved"], g.get("reason")) for g in moved[1]]
        assert any(g["moved"] for g in moved[0])


class InplaceNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.act = nn.ReLU(inplace=True)

    def forward(self, x, w):
        h = torch.relu_(x @ w)
        h = F.relu(h - 1, inplace=True)
        h = self.act(h * 2)
        h.add_(1)
        return h


def test_symbolic_trace_inplace_calls_write_their_first_argument():
    gm = fx.symbolic_trace(InplaceNet())
    p = lower(gm)
    writers = {op.target.rsplit(".", 1)[-1]: op.writes for op in p.ops() if op.writes}
    assert set(writers) == {"relu_", "relu", "act", "add_"}  # torch.relu_, F.relu(inplace=True), module, method
    assert all(len(w) == 1 for w in writers.values())
    assert not any(isinstance(op, Barrier) for op in p.ops())
    assert p.notes == []
    verify(p)


def test_a_call_fxsched_cannot_see_into_writes_its_tensors_with_a_note():
    def mystery(a, b):
        return a + b

    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    m = g.call_function(mystery, (x, y))
    g.output(m)
    p = lower(fx.GraphModule(nn.Module(), g))
    assert p.op(m.name).writes == ("x", "y")
    assert any("cannot see into" in n for n in p.notes)


def _gathered_shard_graph(shard_op):
    """A shard written in place (shard_op(graph, shard) -> node), then gathered and used."""
    g = fx.Graph()
    x, s0, s1 = g.placeholder("x"), g.placeholder("s0"), g.placeholder("s1")
    ag0 = g.call_function(AG, (s0, 2, "0"))
    _tag_gather(ag0, "p0")
    w0 = g.call_function(aten.view.default, (g.call_function(WAIT, (ag0,)), [4, 4]))
    h = g.call_function(aten.mm.default, (x, w0))
    h = g.call_function(aten.mm.default, (h, h))
    write = shard_op(g, s1)
    h = g.call_function(aten.mm.default, (h, h))
    ag1 = g.call_function(AG, (s1, 2, "0"))
    _tag_gather(ag1, "p1")
    w1 = g.call_function(aten.view.default, (g.call_function(WAIT, (ag1,)), [4, 4]))
    g.output((g.call_function(aten.mm.default, (h, w1)),))
    return fx.GraphModule(nn.Module(), g), write, ag1


def _all_reduce_(g, shard):
    ar = g.call_function(c10d.all_reduce_.default, (shard, "sum", "0"))
    return g.call_function(WAIT, (ar,))


@pytest.mark.parametrize("pipeline", [REFERENCE_PIPELINE, DEFAULT_PIPELINE])
def test_a_gather_stays_after_an_inplace_all_reduce_of_its_shard(pipeline):
    gm, wait, ag1 = _gathered_shard_graph(_all_reduce_)
    p = lower(gm)
    launch = p.op(wait.args[0].name)
    assert launch.writes == ("s1",) and isinstance(p.op(wait.name), Wait) and p.op(wait.name).writes == (launch.name,)
    order = [n.name for n in fxsched.schedule(gm, pipeline).graph_module.graph.nodes]
    assert order.index(wait.name) < order.index(ag1.name)


@pytest.mark.parametrize("pipeline", [REFERENCE_PIPELINE, DEFAULT_PIPELINE])
def test_a_gather_stays_after_torch_relu_of_its_shard(pipeline):
    gm, write, ag1 = _gathered_shard_graph(lambda g, s: g.call_function(torch.relu_, (s,)))
    order = [n.name for n in fxsched.schedule(gm, pipeline).graph_module.graph.nodes]
    assert order.index(write.name) < order.index(ag1.name)
    # and a write of another storage does not hold it back
    gm, write, ag1 = _gathered_shard_graph(lambda g, s: g.call_function(torch.relu_, (g.placeholder("other"),)))
    order = [n.name for n in fxsched.schedule(gm, pipeline).graph_module.graph.nodes]
    assert order.index(ag1.name) < order.index(write.name)


def test_to_dtype_without_a_val_is_a_maybe_view_that_stays_before_a_write_of_its_source():
    g = fx.Graph()
    x, s = g.placeholder("x"), g.placeholder("s")
    ag = g.call_function(AG, (s, 2, "0"))
    _tag_gather(ag, "p")
    wt = g.call_function(WAIT, (ag,))
    cast = g.call_function(aten.to.dtype, (wt, torch.float32))
    h = g.call_function(aten.mm.default, (x, x))
    write = g.call_function(aten.mul_.Tensor, (wt, 2))
    h = g.call_function(aten.mm.default, (h, g.call_function(aten.view.default, (cast, [4, 4]))))
    g.output((h, write))
    gm = fx.GraphModule(nn.Module(), g)
    p = lower(gm)
    assert isinstance(p.op(cast.name), View) and p.op(cast.name).maybe
    assert any("may alias" in n and cast.name in n for n in p.notes)
    for pipeline in (REFERENCE_PIPELINE, DEFAULT_PIPELINE):
        order = [n.name for n in fxsched.schedule(gm, pipeline).graph_module.graph.nodes]
        assert order.index(cast.name) < order.index(write.name)  # sink stops before the write


def _contiguous_after_free(with_vals: bool):
    def f(x, s):
        w = c10d.wait_tensor(c10d.all_gather_into_tensor(s, 2, "0")).view(4, 4)
        m = x @ w
        c = w.t().contiguous()
        r = w.t().reshape(16)
        return m, c, r

    if with_vals:
        gm = make_fx(f, tracing_mode="fake", pre_dispatch=True)(torch.randn(4, 4), torch.randn(8))
    else:
        gm = fx.symbolic_trace(f)
    return gm


@pytest.mark.parametrize("with_vals", [True, False], ids=["vals", "no vals"])
def test_contiguous_and_reshape_read_after_the_free_are_no_use_after_free(with_vals):
    gm = _contiguous_after_free(with_vals)
    nodes = list(gm.graph.nodes)
    ag = next(n for n in nodes if n.target is AG or "all_gather" in str(n.target))
    _tag_gather(ag, "p")
    wait = next(iter(ag.users))
    copies = [n for n in nodes if "contiguous" in str(n.target) or "reshape" in str(n.target)]
    assert len(copies) == 2
    last = max(copies, key=nodes.index)
    with gm.graph.inserting_after(last):
        free = gm.graph.call_function(fxsched.front.fsdp_free_storage, (wait,))
    free.meta.update(comm_type="fsdp_reshard_free", param_name="p")
    # the copies' readers come after the free: move the output's uses there
    gm.recompile()
    p = lower(gm)  # no LoweringError
    verify(p)
    for pipeline in (REFERENCE_PIPELINE, DEFAULT_PIPELINE):
        verify(fxsched.schedule(gm, pipeline).program)


def test_coalesced_collectives_not_waited_per_result_and_waits_on_no_launch_are_opaque_and_the_rest_is_scheduled():
    """A coalesced collective whose every result is waited (through its getitem) is a launch
    (tests/test_coalesced.py); one with a result left unwaited, or read by more than its wait, is opaque."""
    g = fx.Graph()
    x, s0, s1, a, b = (g.placeholder(n) for n in ("x", "s0", "s1", "a", "b"))
    ag0 = g.call_function(AG, (s0, 2, "0"))
    _tag_gather(ag0, "p0")
    h = g.call_function(aten.mm.default, (x, g.call_function(aten.view.default, (g.call_function(WAIT, (ag0,)), [4, 4]))))
    coalesced = g.call_function(c10d.all_gather_into_tensor_coalesced.default, ([a, b], 2, "0"))
    parts = [g.call_function(operator.getitem, (coalesced, i)) for i in range(2)]
    waits = [g.call_function(WAIT, (p,)) for p in parts[:1]] + [g.call_function(WAIT, (parts[1],)) for _ in range(2)]
    rs = g.call_function(c10d.reduce_scatter_tensor_coalesced.default, ([a, b], "sum", 2, "0"))
    rs_waits = [g.call_function(WAIT, (g.call_function(operator.getitem, (rs, 0)),))]  # result 1 never waited
    ar = g.call_function(c10d.all_reduce_coalesced.default, ([a, b], "sum", "0"))
    ar_parts = [g.call_function(operator.getitem, (ar, i)) for i in range(2)]
    ar_waits = [g.call_function(WAIT, (p,)) for p in ar_parts]
    ar_waits.append(g.call_function(aten.neg.default, (ar_parts[1],)))  # a result read before its wait
    lone = g.call_function(WAIT, (x,))  # a wait on no launch
    h = g.call_function(aten.mm.default, (h, h))
    h = g.call_function(aten.mm.default, (h, h))
    ag1 = g.call_function(AG, (s1, 2, "0"))
    _tag_gather(ag1, "p1")
    w1 = g.call_function(aten.view.default, (g.call_function(WAIT, (ag1,)), [4, 4]))
    h = g.call_function(aten.mm.default, (h, w1))
    g.output((h, *waits, *rs_waits, *ar_waits, lone))
    gm = fx.GraphModule(nn.Module(), g)
    p = lower(gm)
    verify(p)
    opaque = [n.name for n in gm.graph.nodes if isinstance(p.op(n.name), Opaque)]
    assert set(opaque) == {coalesced.name, rs.name, ar.name, lone.name, *(w.name for w in waits + rs_waits + ar_waits[:2])}
    assert sum("coalesced collective whose results are not each waited once" in n for n in p.notes) == 3
    for pipeline in (REFERENCE_PIPELINE, DEFAULT_PIPELINE):
        done = fxsched.schedule(gm, pipeline)
        verify(done.program)
        order = [n.name for n in done.graph_module.graph.nodes]
        assert [n for n in order if n in opaque] == [n for n in (n.name for n in gm.graph.nodes) if n in opaque]
        # the tagged gathers are still scheduled: the reference launches the second ahead of the
        # opaque ops (the default's cost model finds it hidden where it is)
        if pipeline == REFERENCE_PIPELINE:
            assert order.index(ag1.name) < order.index(coalesced.name)
        assert all(g["moved"] or not held_by_lowering(g["reason"]) for g in done.report["gathers"])


def test_a_free_of_a_gathered_buffer_read_after_it_names_the_node():
    g = fx.Graph()
    s = g.placeholder("s")
    ag = g.call_function(AG, (s, 2, "0"))
    _tag_gather(ag, "p")
    wt = g.call_function(WAIT, (ag,))
    v = g.call_function(aten.view.default, (wt, [4, 4]))
    free = g.call_function(fxsched.front.fsdp_free_storage, (wt,))
    free.meta.update(comm_type="fsdp_reshard_free", param_name="p")
    late = g.call_function(aten.neg.default, (v,))
    g.output((late,))
    with pytest.raises(fxsched.lowering.LoweringError, match=f"%{late.name} reads storage that %{free.name} freed"):
        lower(fx.GraphModule(nn.Module(), g))


class _RandomCalls(nn.Module):
    """Python-level random calls as `symbolic_trace` records them: F.dropout, torch.rand_like,
    an nn.Dropout (call_module), x.uniform_() (call_method) — and plain compute between them."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        a = F.dropout(x, 0.1)
        b = torch.rand_like(x)
        c = self.drop(x)
        d = x.clone().uniform_()
        return F.relu(a) + b + c + d


def test_python_random_calls_share_the_rng_and_keep_their_order():
    """Issue 12: F.dropout, torch.rand_like, nn.Dropout and x.uniform_() draw from the one
    generator, so swapping two of them changes the numbers: they are random ops on the RNG
    chain (torch.rand_like no longer a barrier), and a schedule that swaps two fails verify."""
    gm = fx.symbolic_trace(_RandomCalls())
    program = lower(gm)
    random = [n.name for n in gm.graph.nodes if isinstance(program.op(n.name), Compute) and program.op(n.name).random]
    assert random == ["dropout", "rand_like", "drop", "uniform_"]
    assert not any(isinstance(op, Barrier) for op in program.ops())
    assert {(u, v) for u, v, w in program.effect_edges() if w == "rng-order"} == set(zip(random, random[1:]))
    for pipeline in (REFERENCE_PIPELINE, DEFAULT_PIPELINE, "sink"):
        order = [n.name for n in fxsched.schedule(gm, pipeline).graph_module.graph.nodes]
        assert [n for n in order if n in random] == random
    program.schedule.move_before(["rand_like"], "dropout")  # no data edge between them: only the RNG orders them
    with pytest.raises(VerifyError, match="rand_like"):
        verify(program)


# ---- lowering's numbered path ------------------------------------------------------------------

def _aliased_inputs():
    def f(a, b):
        y = a * 2
        b.add_(1)
        return y + a

    base = torch.arange(4.0)
    return make_fx(f, tracing_mode="fake")(base[:3], base[1:])


def _get_attr_twice():
    root = nn.Module()
    root.register_buffer("buf", torch.arange(4.0))
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.call_method("add_", (graph.get_attr("buf"), 1))
    graph.output(graph.call_function(operator.add, (x, graph.call_function(operator.mul, (graph.get_attr("buf"), 3)))))
    return fx.GraphModule(root, graph)


@pytest.mark.parametrize("make", [lambda: generate_graph(1500, seed=3, buckets=True), _aliased_inputs, _get_attr_twice,
                                  lambda: fx.symbolic_trace(_RandomCalls())])
def test_lowering_derives_by_position_the_edges_names_give(make):
    """Lowering hands derive_effects its ops' operands as positions (an aliased input's or
    get_attr's: the first one's); deriving again from the names alone, on the same program
    without its effect edges and markers, adds the same edges, each in the same place of the
    graph's adjacency (the passes read it in that order)."""
    program = lower(make())
    again = program.copy()
    again.graph.remove_edges_from([(u, v) for u, v, e in program.graph.edges(data=True) if e["kind"] != "data"])
    again.graph.remove_nodes_from([ENTRY, BACKWARD])
    again.schedule = Schedule(n for n in program.schedule if n not in (ENTRY, BACKWARD))
    derive_effects(again)
    assert again.schedule == program.schedule
    for adjacency in ("_succ", "_pred"):
        assert ([(n, list(nbrs.items())) for n, nbrs in getattr(again.graph, adjacency).items()]
                == [(n, list(nbrs.items())) for n, nbrs in getattr(program.graph, adjacency).items()])


def test_derive_effects_reads_each_node_s_own_adjacency_whatever_order_the_dicts_hold():
    """The numbered walk lines networkx's predecessor dicts up with the nodes by the order the
    graph holds them in; a graph whose predecessor dict holds another order (rebuilt by hand)
    gets the same edges."""
    gm = generate_graph(400, seed=1)
    program, again = lower(gm), lower(gm)
    for p in (program, again):
        p.graph.remove_edges_from([(u, v) for u, v, e in p.graph.edges(data=True) if e["kind"] != "data"])
        p.graph.remove_nodes_from([ENTRY, BACKWARD])
        p.schedule = Schedule(n for n in p.schedule if n not in (ENTRY, BACKWARD))
    again.graph._pred = dict(reversed(again.graph._pred.items()))
    derive_effects(program)
    derive_effects(again)
    assert sorted(again.effect_edges()) == sorted(program.effect_edges())
