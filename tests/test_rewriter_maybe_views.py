"""The rewriter orders a new access of a storage against what reads or writes it through a
`maybe` view (`reshape`, `contiguous`, `to` with no `meta["val"]`: a view or a copy, nothing says
which), as ir/storage.py's rules do when the edges are first derived: such a view orders as an
alias of its source, its users as readers and writers of the source's storage.

Each test lowers a small graph with such a view, makes one edit through the `Rewriter` API (a
created writer, a created reader, a user moved onto the storage by `replace_uses`), and runs the
result in every legal order (networkx's first 400 and 30 seeded random ones) against the
rewritten program in its own schedule order (the order the rewrite was made for): bitwise.
Before the rewriter followed maybe views, some legal orders read the storage on the wrong side
of the write (counted in the report, /work/notes/report-alias.md).
"""

from __future__ import annotations

import copy
import itertools
import operator

import networkx as nx
import pytest
import torch
from torch import fx, nn

from fxsched.ir import Compute, TensorType, parse_program, verify
from fxsched.ir.program import Schedule
from fxsched.ir.rewriter import Call, Operand, Rewriter, RewriteError
from fxsched.lowering import lower
from fxsched.raising import raise_program

from test_fronts_attack import _random_orders

F32 = (TensorType("float32", (4,)),)


def _run(program, inputs) -> list[torch.Tensor]:
    gm = raise_program(program)
    torch.manual_seed(0)
    with torch.no_grad():
        out = gm(*[t.clone() for t in inputs])
    return [t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)]


def wrong_orders(program, inputs, most: int = 400, shuffled: int = 30) -> tuple[int, int]:
    """(orders computing other numbers than `program` in its schedule order, orders tried)."""
    program = copy.deepcopy(program)
    expected = _run(program, inputs)
    first = list(program.schedule.names())
    wrong = tried = 0
    for order in itertools.chain(itertools.islice(nx.all_topological_sorts(program.graph), most),
                                 _random_orders(program, shuffled, 0)):
        program.schedule = Schedule(order)
        got = _run(program, inputs)
        wrong += not (len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(expected, got)))
        tried += 1
    program.schedule = Schedule(first)
    assert tried > 1 + shuffled  # else the check says nothing
    return wrong, tried


def _graph(build) -> fx.GraphModule:
    graph = fx.Graph()
    build(graph)
    return fx.GraphModule(nn.Module(), graph)


def _reads_through_a_maybe_view(g):
    """x.reshape(4) (no val: a maybe view), two reads of it; z written in place; y free."""
    x, z, y = g.placeholder("x"), g.placeholder("z"), g.placeholder("y")
    v = g.call_method("reshape", (x, 4))
    r = g.call_function(torch.neg, (v,))
    s = g.call_function(operator.mul, (v, 3))
    w = g.call_method("add_", (z, 1))
    g.output((r, s, w, g.call_function(torch.sin, (y,))))


def _inc(name: str, target: str) -> tuple[Compute, Call]:
    return (Compute(name=name, operands=(target,), target="aten.add_.Tensor", types=F32, writes=(target,),
                    alias=target),
            Call("aten.add_.Tensor", (Operand(0), 1.0)))


INPUTS = [torch.arange(4.0), torch.arange(4.0) * 10, torch.ones(4)]


def test_a_created_write_orders_against_reads_through_a_maybe_view():
    """x += 1 created between the maybe view and its readers: they read it after the write."""
    program = lower(_graph(_reads_through_a_maybe_view))
    (v,) = [o.name for o in program.ops() if getattr(o, "maybe", False)]
    (r,) = program.users(v)[:1]
    op, call = _inc("inc", "x")
    Rewriter(program).create(op, before=r, payload=call)
    verify(program)
    assert wrong_orders(program, INPUTS)[0] == 0


def test_a_created_read_orders_against_a_write_through_a_maybe_view():
    """The write is through the maybe view (v.add_(1)); neg(x) created before it (and read by the
    output in sin(y)'s place, as a bucket's copy-out replaces a wait) reads x first."""
    def build(g):
        x, y = g.placeholder("x"), g.placeholder("y")
        n = g.call_function(torch.sin, (y,))
        v = g.call_method("reshape", (x, 4))
        w = g.call_method("add_", (v, 1))
        g.output((w, n, g.call_function(torch.cos, (y,))))

    program = lower(_graph(build))
    (v,) = [o.name for o in program.ops() if getattr(o, "maybe", False)]
    (w,) = program.users(v)
    rewriter = Rewriter(program)
    rewriter.create(Compute(name="early", operands=("x",), target="aten.neg.default", types=F32),
                    before=w, payload=Call("aten.neg.default", (Operand(0),)))
    rewriter.replace_uses("sin", "early")
    verify(program)
    assert wrong_orders(program, [INPUTS[0], INPUTS[2]])[0] == 0


def test_a_user_moved_onto_a_storage_writes_after_its_reads_through_a_maybe_view():
    """replace_uses(z, x) on z.add_(1), scheduled after the maybe view's readers: it now writes
    x, so they keep reading x before it."""
    program = lower(_graph(_reads_through_a_maybe_view))
    (w,) = [o.name for o in program.ops() if o.writes]
    Rewriter(program).replace_uses("z", "x", only={w})
    verify(program)
    assert wrong_orders(program, INPUTS)[0] == 0


FREED = """\
%x = input
%y = input
^entry
%v = view "reshape"(%x) {maybe}
%a = compute "aten.neg"(%v)
%f = free "fsdp.free"(%x) {params = ["p"]}
%b = compute "aten.sin"(%y)
%output = output(%a, %b)
"""


def test_after_a_free_a_read_through_a_maybe_view_is_no_use_after_free_and_a_write_is():
    """As ir/storage.py: a read through a maybe view after its source's free may read a copy (no
    order with the free, no refusal); a read of the source itself, or a write through the view,
    is a use after free; a read through it before the free precedes the free."""
    program = parse_program(FREED)
    rewriter = Rewriter(program)
    rewriter.create(Compute(name="late", operands=("v",), target="aten.cos"), before="b")
    assert not any(e == ("f", "late") for e in program.graph.edges)
    with pytest.raises(RewriteError, match="%direct would read storage that %f frees before it"):
        rewriter.create(Compute(name="direct", operands=("x",), target="aten.cos"), before="b")
    with pytest.raises(RewriteError, match="%bump would read storage that %f frees before it"):
        rewriter.create(Compute(name="bump", operands=("v",), target="aten.add_.Tensor", writes=("v",), alias="v"),
                        before="b")
    rewriter.create(Compute(name="early", operands=("v",), target="aten.cos"), before="f")
    rewriter.replace_uses("y", "v", only={"b"})  # b now reads through the view after the free: a copy
    verify(program)
    assert program.graph.has_edge("early", "f") and not program.graph.has_edge("f", "b")
