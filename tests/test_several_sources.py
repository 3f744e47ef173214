"""Results that may be (views of) each of several operands, which lowering refused
(`LoweringError`) until the IR could say them: a higher-order op whose subgraphs return one of
several of its inputs (`invoke_subgraph` returning two, `cond` whose branches return different
ones), and views of several sources (`broadcast_tensors(a, b)`, `meshgrid`, custom ops
`(Tensor(a) x, Tensor(b) y) -> (Tensor(a), Tensor(b))` and `Tensor(a)[] -> Tensor(a)[]`). Each
result now `may_alias` those operands (ir/storage.py): every access of it, or of a getitem of
it, counts as an access of each of their storages. Every legal order (networkx's first 400 and
30 seeded random ones) computes the input graph's numbers bitwise, and an FSDP-shaped graph with
both runs bitwise on 2 gloo ranks under the pipelines.
"""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx, nn
from torch.fx.experimental.proxy_tensor import make_fx

import fxsched
from fxsched.lowering import lower

from test_fronts_attack import _graph, assert_every_legal_order_computes_the_same


def _invoke_two(sub: fx.GraphModule) -> fx.GraphModule:
    """`r = invoke_subgraph(sub, x, y)`, both elements read around writes of x and y."""
    from torch._higher_order_ops.invoke_subgraph import invoke_subgraph

    root = nn.Module()
    root.sub = sub

    def build(g):
        x, y = g.placeholder("x"), g.placeholder("y")
        call = g.call_function(invoke_subgraph, (g.get_attr("sub"), "sub0", x, y))
        r0, r1 = (g.call_function(operator.getitem, (call, i)) for i in range(2))
        first = g.call_function(operator.mul, (r0, 3))
        g.call_method("add_", (x, 1))
        second = g.call_function(operator.mul, (r1, 5))
        g.call_method("mul_", (y, 2))
        g.output((first, second, g.call_function(operator.sub, (r0, r1)), g.call_function(operator.neg, (x,)),
                  g.call_function(torch.sin, (y,))))

    return _graph(build, root)


@pytest.mark.parametrize("body", [lambda a, b: (a, b), lambda a, b: (b.view(-1), a.mul_(2))],
                         ids=["both", "view-and-written"])
def test_a_higher_order_op_returning_several_of_its_operands_may_be_each(body):
    """The subgraph returns both inputs (or a view of one and the other written in place): the
    result may be x's or y's storage. It was a LoweringError; now every legal order computes the
    input's numbers."""
    gm = _invoke_two(make_fx(body)(torch.ones(4), torch.ones(4)))
    op = lower(gm).op("invoke_subgraph")
    assert op.may_alias == ("x", "y") and op.alias is None
    assert_every_legal_order_computes_the_same(gm, [torch.randn(4), torch.randn(4)])


def _cond_branches_returning_a_then_b() -> nn.Module:
    """A root holding `cond`'s branches: the true one returns its first operand, the false one its
    second."""
    root = nn.Module()
    root.true_graph = make_fx(lambda a, b: (a,))(torch.ones(4), torch.ones(4))
    root.false_graph = make_fx(lambda a, b: (b,))(torch.ones(4), torch.ones(4))
    return root


def test_a_cond_whose_branches_return_different_operands_may_be_each():
    """`cond(p, a, b)` returning its first operand in one branch and its second in the other: which
    one, nothing says before it runs. Each branch is run (p true and false)."""
    root = _cond_branches_returning_a_then_b()

    def build(g):
        p, x, y = g.placeholder("p"), g.placeholder("x"), g.placeholder("y")
        call = g.call_function(torch.ops.higher_order.cond, (p, g.get_attr("true_graph"), g.get_attr("false_graph"),
                                                             [x, y]))
        r = g.call_function(operator.getitem, (call, 0))
        first = g.call_function(operator.mul, (r, 3))
        g.call_method("add_", (x, 1))
        g.call_method("mul_", (y, 2))
        g.output((first, g.call_function(operator.mul, (r, 5)), g.call_function(torch.sin, (x,)),
                  g.call_function(torch.cos, (y,))))

    gm = _graph(build, root)
    assert lower(gm).op("cond").may_alias == ("x", "y")
    for p in (True, False):
        assert_every_legal_order_computes_the_same(gm, [torch.tensor(p), torch.randn(4), torch.randn(4)])


def _views_of_a_and_b_then_b_written(op: str, mode: str):
    """`broadcast_tensors(a, b)` / `meshgrid(a, b)` traced by make_fx keeping them (pre_dispatch),
    its views of a and of b read before and after a write of b; the graph and its inputs."""
    def f(a, b):
        x, y = torch.broadcast_tensors(a, b) if op == "broadcast_tensors" else torch.meshgrid(a, b, indexing="ij")
        before = y * 3
        b.add_(1)
        return x * 2, before, y * 5, a.neg()

    inputs = [torch.randn(3, 1), torch.randn(1, 3)] if op == "broadcast_tensors" else [torch.randn(3), torch.randn(2)]
    return make_fx(f, tracing_mode=mode, pre_dispatch=True)(*[t.clone() for t in inputs]), inputs


@pytest.mark.parametrize("mode", ["real", "fake"])
@pytest.mark.parametrize("op", ["broadcast_tensors", "meshgrid"])
def test_views_of_several_sources_whose_second_is_written_keep_their_numbers(op, mode):
    """`broadcast_tensors(a, b)` / `meshgrid(a, b)` (make_fx keeping them: pre_dispatch) return
    views of a and of b, then b is written: a LoweringError until now."""
    gm, inputs = _views_of_a_and_b_then_b_written(op, mode)
    (call,) = [o for o in lower(gm).ops() if o.may_alias]
    assert call.may_alias == tuple(n.name for n in gm.graph.find_nodes(op="placeholder"))
    assert_every_legal_order_computes_the_same(gm, inputs)


@pytest.mark.parametrize("mode", ["real", "fake"])
@pytest.mark.parametrize("op", ["two_views", "list_views"])
def test_a_custom_op_returning_views_of_several_arguments_keeps_their_numbers(op, mode):
    """`(Tensor(a) x, Tensor(b) y) -> (Tensor(a), Tensor(b))`, `(Tensor(a)[] xs) -> Tensor(a)[]`
    (tests/test_fronts_attack3.py defines them), then a write of y and one through a result."""
    from test_fronts_attack3 import _ops

    def f(x, y):
        out = _ops.two_views(x, y) if op == "two_views" else _ops.list_views([x, y])
        before = out[1] * 3
        y.add_(1)
        out[0].mul_(2)  # a write through the view of x
        return before, out[1] * 5, x * 7, torch.sin(torch.ones(3))

    gm = make_fx(f, tracing_mode=mode)(torch.randn(4), torch.randn(4))
    assert [o.may_alias for o in lower(gm).ops() if o.may_alias] == [("x_1", "y_1")]
    assert_every_legal_order_computes_the_same(gm, [torch.randn(4), torch.randn(4)])


@pytest.mark.parametrize("mode", ["real", "fake"])
@pytest.mark.parametrize("op", ["two_views", "list_views"])
def test_a_write_through_a_custom_ops_view_of_its_second_argument_keeps_its_numbers(op, mode):
    """No write of y itself, so it was no LoweringError: the op was a view of x, a write through
    its view of y a write of x, and 93 of the 114 orders tried read y on the wrong side of it."""
    from test_fronts_attack3 import _ops

    def f(x, y):
        out = _ops.two_views(x, y) if op == "two_views" else _ops.list_views([x, y])
        before = y * 3
        out[1].mul_(2)
        return before, y * 5, out[0] * 7

    gm = make_fx(f, tracing_mode=mode)(torch.randn(4), torch.randn(4))
    assert_every_legal_order_computes_the_same(gm, [torch.randn(4), torch.randn(4)])


# --------------------------------------------------------------------------- FSDP


PIPELINES = ("reference", "default", "rewrite", "default,unshard", "default,bucket")


def _fsdp_graph() -> fx.GraphModule:
    """Two gathered parameters (a [4, 4] weight, a [1, 4] bias): the activation and the bias
    broadcast together (views of each), an `invoke_subgraph` returning both of its inputs, and a
    write of the activation (the second source) between reads of the views; frees after."""
    from torch._higher_order_ops.invoke_subgraph import invoke_subgraph

    from fxsched.front import fsdp_free_storage
    c10d = torch.ops._c10d_functional
    aten = torch.ops.aten
    root = nn.Module()
    root.sub = make_fx(lambda a, b: (a, b))(torch.ones(4, 4), torch.ones(1, 4))

    def build(g):
        x, s0, s1 = g.placeholder("x"), g.placeholder("s0"), g.placeholder("s1")
        waits = []
        for s, param, nbytes in ((s0, "p0", 64), (s1, "p1", 16)):
            ag = g.call_function(c10d.all_gather_into_tensor.default, (s, 2, "0"))
            ag.meta.update(comm_type="fsdp_all_gather", param_name=param, fsdp_unsharded_nbytes=nbytes)
            waits.append(g.call_function(c10d.wait_tensor.default, (ag,)))
        w = g.call_function(aten.view.default, (waits[0], [4, 4]))
        bias = g.call_function(aten.view.default, (waits[1], [1, 4]))
        h = g.call_function(aten.mm.default, (x, w))
        pair = g.call_function(aten.broadcast_tensors.default, ([bias, h],))
        bb, bh = (g.call_function(operator.getitem, (pair, i)) for i in range(2))
        y = g.call_function(aten.add.Tensor, (bb, bh))
        call = g.call_function(invoke_subgraph, (g.get_attr("sub"), "sub0", h, bias))
        ch = g.call_function(operator.getitem, (call, 0))
        early = g.call_function(aten.mul.Tensor, (ch, 3))
        g.call_function(aten.mul_.Tensor, (h, 2))  # the second source written
        z = g.call_function(aten.mm.default, (h, w))
        late = g.call_function(aten.mul.Tensor, (bh, 5))
        later = g.call_function(aten.sub.Tensor, (ch, y))
        for wait, param in ((waits[0], "p0"), (waits[1], "p1")):
            free = g.call_function(fsdp_free_storage, (wait,))
            free.meta.update(comm_type="fsdp_reshard_free", param_name=param)
        g.output((y, early, z, late, later))

    return _graph(build, root)


def test_an_fsdp_graph_with_several_sources_lowers_and_schedules():
    program = lower(_fsdp_graph())
    assert program.op("broadcast_tensors_default").may_alias == ("view_default_1", "mm_default")
    assert program.op("invoke_subgraph").may_alias == ("mm_default", "view_default_1")
    for pipeline in PIPELINES:
        fxsched.schedule(_fsdp_graph(), pipeline)


@pytest.mark.multirank
def test_an_fsdp_graph_with_several_sources_runs_bitwise_on_two_ranks():
    """The schedules (`PIPELINES`) and 30 random legal orders compute the graph's numbers on 2
    gloo ranks."""
    from test_fronts_attack2 import assert_bitwise_on_two_ranks

    torch.manual_seed(0)
    feeds = [[torch.randn(4, 4) + rank, torch.randn(8) - rank, torch.randn(2) + 2 * rank] for rank in range(2)]
    assert_bitwise_on_two_ranks(_fsdp_graph, feeds, 30, PIPELINES, key="fsdp graph")


# --------------------------------------------------------------------------- exact per element


def _unordered(program, one: str, other: str) -> bool:
    """Neither op is ordered before the other (no path either way)."""
    import networkx as nx

    return not nx.has_path(program.graph, one, other) and not nx.has_path(program.graph, other, one)


@pytest.mark.parametrize("mode", ["real", "fake"])
@pytest.mark.parametrize("op", ["broadcast_tensors", "meshgrid"])
def test_each_element_of_broadcast_tensors_views_its_own_source_only(op, mode):
    """broadcast_tensors' and meshgrid's i-th result views the i-th tensor alone: its getitem is
    an alias of that tensor, so a read of the first result is free of a write of b (it was
    ordered after it, as a result that may be b's: 48 legal orders, now 96), and every legal
    order still computes the input's numbers."""
    import networkx as nx

    gm, inputs = _views_of_a_and_b_then_b_written(op, mode)
    program = lower(gm)
    a, b = (n.name for n in gm.graph.find_nodes(op="placeholder"))
    items = [o for o in program.ops() if getattr(o, "target", None) == "_operator.getitem"]
    assert [o.alias for o in items] == [a, b] and not any(o.may_alias for o in items)
    (write,) = [o.name for o in program.ops() if o.writes]
    (read_x,) = [o.name for o in program.ops() if o.operands == (items[0].name,)]
    assert _unordered(program, write, read_x)
    assert sum(1 for _ in nx.all_topological_sorts(program.graph)) == 96
    assert_every_legal_order_computes_the_same(gm, inputs)


def test_broadcast_tensors_of_one_tensor_twice_and_python_varargs():
    """`torch.broadcast_tensors(a, b, a)` as a Python call (varargs, symbolic_trace): the third
    element views a, a write of a is ordered with it and not with the second."""
    def f(a, b):
        x, y, z = torch.broadcast_tensors(a, b, a)
        first = z * 3
        a.add_(1)
        return first, x * 2, y * 5, z * 7

    gm = fx.symbolic_trace(f)
    program = lower(gm)
    items = [o for o in program.ops() if getattr(o, "target", None) == "_operator.getitem"]
    assert [o.alias for o in items] == ["a", "b", "a"]
    assert_every_legal_order_computes_the_same(gm, [torch.randn(3, 1), torch.randn(1, 3)])


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_each_view_of_a_custom_op_with_an_alias_set_per_result_views_its_own_argument(mode):
    """`(Tensor(a) x, Tensor(b) y) -> (Tensor(a), Tensor(b))`: the first result views x alone, so
    the write of y and the write through the first result are free of each other (270 legal
    orders, now 1170); `Tensor(a)[] -> Tensor(a)[]` pins no position and keeps each getitem a
    view of the op, which may be either."""
    import networkx as nx

    from test_fronts_attack3 import _ops

    def f(x, y):
        out = _ops.two_views(x, y)
        before = out[1] * 3
        y.add_(1)
        out[0].mul_(2)  # a write through the view of x
        return before, out[1] * 5, x * 7, torch.sin(torch.ones(3))

    gm = make_fx(f, tracing_mode=mode)(torch.randn(4), torch.randn(4))
    program = lower(gm)
    assert [o.alias for o in program.ops() if getattr(o, "target", None) == "_operator.getitem"] == ["x_1", "y_1"]
    write_y, write_x = (o.name for o in program.ops() if o.writes)
    assert _unordered(program, write_y, write_x)
    assert sum(1 for _ in nx.all_topological_sorts(program.graph)) == 1170
    assert_every_legal_order_computes_the_same(gm, [torch.randn(4), torch.randn(4)])

    def g(x, y):
        out = _ops.list_views([x, y])
        return out[0] * 2, out[1] * 3

    listed = lower(make_fx(g, tracing_mode=mode)(torch.randn(4), torch.randn(4)))
    assert {type(o).__name__ for o in listed.ops() if getattr(o, "target", None) == "_operator.getitem"} == {"View"}


@pytest.mark.parametrize("body, aliases, orders", [(lambda a, b: (a, b), ["x", "y"], 156),
                                                   (lambda a, b: (b.view(-1), a.mul_(2)), ["y", "x"], 330)],
                         ids=["both", "view-and-written"])
def test_each_element_a_subgraph_returns_from_one_input_aliases_that_operand_alone(body, aliases, orders):
    """`invoke_subgraph` whose subgraph returns (x, y) (or (a view of y, x written)): the op may
    be either, but each element is one known input's, so its getitem aliases that operand only
    (30 legal orders on main, where every getitem may be both, now 156 and 330)."""
    import networkx as nx

    gm = _invoke_two(make_fx(body)(torch.ones(4), torch.ones(4)))
    program = lower(gm)
    assert [o.alias for o in program.ops() if getattr(o, "target", None) == "_operator.getitem"] == aliases
    assert sum(1 for _ in nx.all_topological_sorts(program.graph)) == orders
    assert_every_legal_order_computes_the_same(gm, [torch.randn(4), torch.randn(4)])


def test_a_cond_whose_branches_return_different_operands_keeps_its_getitem_a_view_of_either():
    """Whose element it is, nothing says before the cond runs: its getitem stays a view of the op
    (which `may_alias` both), not an alias of one."""
    root = _cond_branches_returning_a_then_b()

    def build(g):
        p, x, y = g.placeholder("p"), g.placeholder("x"), g.placeholder("y")
        call = g.call_function(torch.ops.higher_order.cond, (p, g.get_attr("true_graph"), g.get_attr("false_graph"),
                                                             [x, y]))
        g.output((g.call_function(operator.mul, (g.call_function(operator.getitem, (call, 0)), 3)),))

    program = lower(_graph(build, root))
    (item,) = [o for o in program.ops() if getattr(o, "target", None) == "_operator.getitem"]
    assert type(item).__name__ == "View" and item.operands == ("cond",)


def test_a_read_through_broadcast_tensors_after_a_free_of_its_own_source_is_a_use_after_free():
    """A gathered weight broadcast with the activation, freed, then the weight's element read: the
    element was a view of the call, which may be either storage, so the read was only a note
    (taken for fresh storage); now it aliases the weight, and the free before it is refused."""
    from fxsched.front import fsdp_free_storage
    from fxsched.lowering import LoweringError

    c10d, aten = torch.ops._c10d_functional, torch.ops.aten

    def build(g):
        x, s0 = g.placeholder("x"), g.placeholder("s0")
        ag = g.call_function(c10d.all_gather_into_tensor.default, (s0, 2, "0"))
        ag.meta.update(comm_type="fsdp_all_gather", param_name="p0", fsdp_unsharded_nbytes=16)
        wait = g.call_function(c10d.wait_tensor.default, (ag,))
        item = g.call_function(operator.getitem, (g.call_function(aten.broadcast_tensors.default, ([wait, x],)), 0))
        free = g.call_function(fsdp_free_storage, (wait,))
        free.meta.update(comm_type="fsdp_reshard_free", param_name="p0")
        g.output((g.call_function(aten.mul.Tensor, (item, 2)),))

    with pytest.raises(LoweringError, match="reads storage that %fsdp_free_storage freed before it"):
        lower(_graph(build))
