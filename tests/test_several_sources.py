"""Results that may be (views of) each of several operands, which lowering refused
(`LoweringError`) until the IR could say them: a higher-order op whose subgraphs return one of
several of its inputs (`invoke_subgraph` returning two, `cond` whose branches return different
ones), and views of several sources (`broadcast_tensors(a, b)`, `meshgrid`, custom ops
`(Tensor(a) x, Tensor(b) y) -> (Tensor(a), Tensor(b))` and `Tensor(a)[] -> Tensor(a)[]`). Each
result now `may_alias` those operands (ir/storage.py): every access of it, or of a getitem of
it, counts as an access of each of their storages; where an element's own storages are known
(its position), its getitem is an access of those alone, and where every user of the op is such
a getitem, the op itself `may_alias` none. Every legal order (networkx's first 400 and 30 seeded
random ones) computes the input graph's numbers bitwise, and an FSDP-shaped graph with both runs
bitwise on 2 gloo ranks under the pipelines.
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
    input's numbers. (Each getitem is one known input's, so the op itself need not be either:
    test_each_element_a_subgraph_returns_...; a use of the whole result keeps it, below.)"""
    gm = _invoke_two(make_fx(body)(torch.ones(4), torch.ones(4)))
    op = lower(gm).op("invoke_subgraph")
    assert op.may_alias == () and op.alias is None
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
    program = lower(gm)
    assert program.op("getitem").may_alias == ("x", "y") and program.op("cond").may_alias == ()
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
    program = lower(gm)
    assert program.op(op).may_alias == ()  # (its getitems each alias their own source: below)
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
    # where each element's source is known (two_views' schema, list_views' fake val), each getitem
    # aliases its own and the op none; list_views' real-mode vals say nothing: the op may be each
    known = op == "two_views" or mode == "fake"
    assert [o.may_alias for o in lower(gm).ops() if o.may_alias] == ([] if known else [("x_1", "y_1")])
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
    assert [program.op(n).alias for n in ("getitem", "getitem_1", "getitem_2")] == [
        "view_default_1", "mm_default", "mm_default"]
    assert not any(o.may_alias for o in program.ops())
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
    ordered after it, as a result that may be b's: 48 legal orders, then 96), and every legal
    order still computes the input's numbers. The call itself, every user of which is such a
    getitem, is no access of a or b but through its operands (it was: 96, now 120)."""
    import networkx as nx

    gm, inputs = _views_of_a_and_b_then_b_written(op, mode)
    program = lower(gm)
    a, b = (n.name for n in gm.graph.find_nodes(op="placeholder"))
    items = [o for o in program.ops() if getattr(o, "target", None) == "_operator.getitem"]
    assert [o.alias for o in items] == [a, b] and not any(o.may_alias for o in program.ops())
    (write,) = [o.name for o in program.ops() if o.writes]
    (read_x,) = [o.name for o in program.ops() if o.operands == (items[0].name,)]
    assert _unordered(program, write, read_x)
    assert sum(1 for _ in nx.all_topological_sorts(program.graph)) == 120
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


def _custom_views_then_writes(views, mode: str) -> fx.GraphModule:
    """make_fx of a custom op's views of x and y (`views(x, y)`): the second read, y written, a
    write through the first (a view of x), then both read again."""
    def f(x, y):
        out = views(x, y)
        before = out[1] * 3
        y.add_(1)
        out[0].mul_(2)  # a write through the view of x
        return before, out[1] * 5, x * 7, torch.sin(torch.ones(3))

    return make_fx(f, tracing_mode=mode)(torch.randn(4), torch.randn(4))


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_each_view_of_a_custom_op_with_an_alias_set_per_result_views_its_own_argument(mode):
    """`(Tensor(a) x, Tensor(b) y) -> (Tensor(a), Tensor(b))`: the first result views x alone, so
    the write of y and the write through the first result are free of each other (270 legal
    orders, then 1170; with the op no access of x or y but through its operands, 1575);
    `Tensor(a)[] -> Tensor(a)[]` pins no position by schema: where the val does not say (real
    mode) each getitem stays a view of the op, which may be either (fake: the next test)."""
    import networkx as nx

    from test_fronts_attack3 import _ops

    gm = _custom_views_then_writes(_ops.two_views, mode)
    program = lower(gm)
    assert [o.alias for o in program.ops() if getattr(o, "target", None) == "_operator.getitem"] == ["x_1", "y_1"]
    write_y, write_x = (o.name for o in program.ops() if o.writes)
    assert _unordered(program, write_y, write_x)
    assert sum(1 for _ in nx.all_topological_sorts(program.graph)) == 1575
    assert_every_legal_order_computes_the_same(gm, [torch.randn(4), torch.randn(4)])

    def g(x, y):
        out = _ops.list_views([x, y])
        return out[0] * 2, out[1] * 3

    listed = lower(make_fx(g, tracing_mode="real")(torch.randn(4), torch.randn(4)))
    assert {type(o).__name__ for o in listed.ops() if getattr(o, "target", None) == "_operator.getitem"} == {"View"}
    assert listed.op("list_views").may_alias == ("x_1", "y_1")


@pytest.mark.parametrize("body, aliases, orders", [(lambda a, b: (a, b), ["x", "y"], 180),
                                                   (lambda a, b: (b.view(-1), a.mul_(2)), ["y", "x"], 450)],
                         ids=["both", "view-and-written"])
def test_each_element_a_subgraph_returns_from_one_input_aliases_that_operand_alone(body, aliases, orders):
    """`invoke_subgraph` whose subgraph returns (x, y) (or (a view of y, x written)): the op may
    be either, but each element is one known input's, so its getitem aliases that operand only
    (30 legal orders where every getitem may be both, then 156 and 330; with the op itself no
    access of x or y but through its operands, 180 and 450)."""
    import networkx as nx

    gm = _invoke_two(make_fx(body)(torch.ones(4), torch.ones(4)))
    program = lower(gm)
    assert [o.alias for o in program.ops() if getattr(o, "target", None) == "_operator.getitem"] == aliases
    assert sum(1 for _ in nx.all_topological_sorts(program.graph)) == orders
    assert_every_legal_order_computes_the_same(gm, [torch.randn(4), torch.randn(4)])


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


def _cond_branches_returning_a_b_then_a_c() -> nn.Module:
    """A root holding `cond`'s branches over three operands: the true one returns (a, b), the false
    one (a, c)."""
    root = nn.Module()
    root.true_graph = make_fx(lambda a, b, c: (a, b))(torch.ones(4), torch.ones(4), torch.ones(4))
    root.false_graph = make_fx(lambda a, b, c: (a, c))(torch.ones(4), torch.ones(4), torch.ones(4))
    return root


def _cond_of_three(root: nn.Module) -> fx.GraphModule:
    """`r0, r1 = cond(p, ..., [x, y, z])`, each element read around writes of x, y and z."""
    def build(g):
        p, x, y, z = g.placeholder("p"), g.placeholder("x"), g.placeholder("y"), g.placeholder("z")
        call = g.call_function(torch.ops.higher_order.cond, (p, g.get_attr("true_graph"), g.get_attr("false_graph"),
                                                             [x, y, z]))
        r0, r1 = (g.call_function(operator.getitem, (call, i)) for i in range(2))
        first = g.call_function(operator.mul, (r1, 3))
        g.call_method("add_", (x, 1))
        second = g.call_function(operator.mul, (r0, 5))
        g.call_method("mul_", (y, 2))
        g.call_method("sub_", (z, 1))
        g.output((first, second, g.call_function(operator.mul, (r1, 7)), g.call_function(torch.sin, (x,)),
                  g.call_function(torch.cos, (y,)), g.call_function(torch.tan, (z,))))

    return _graph(build, root)


def test_a_cond_whose_branches_return_different_operands_makes_that_getitem_either():
    """Whose element it is, nothing says before the cond runs: its getitem may be either operand
    (not an alias of one); the op, whose only user is that getitem, need not be."""
    root = _cond_branches_returning_a_then_b()

    def build(g):
        p, x, y = g.placeholder("p"), g.placeholder("x"), g.placeholder("y")
        call = g.call_function(torch.ops.higher_order.cond, (p, g.get_attr("true_graph"), g.get_attr("false_graph"),
                                                             [x, y]))
        g.output((g.call_function(operator.mul, (g.call_function(operator.getitem, (call, 0)), 3)),))

    program = lower(_graph(build, root))
    (item,) = [o for o in program.ops() if getattr(o, "target", None) == "_operator.getitem"]
    assert item.alias is None and item.may_alias == ("x", "y") and item.operands == ("cond", "x", "y")
    assert program.op("cond").may_alias == ()


def test_a_cond_whose_branches_agree_at_one_position_aliases_that_element_alone():
    """Branches returning (a, b) and (a, c): the first element is x whatever p is, the second y or
    z. The first getitem aliases x alone and the second may be y or z, not x; the op itself, used
    by those getitems only, is no access of any of them but through its operands. Both getitems
    were views of the op, which may be x, y or z (every branch had to agree at every position):
    672 legal orders, now 21120. Every legal order computes the input's numbers, p true and false."""
    import networkx as nx

    gm = _cond_of_three(_cond_branches_returning_a_b_then_a_c())
    program = lower(gm)
    first, second = (program.op(n) for n in ("getitem", "getitem_1"))
    assert (first.alias, first.may_alias) == ("x", ()) and (second.alias, second.may_alias) == (None, ("y", "z"))
    assert program.op("cond").may_alias == ()
    assert _unordered(program, "add_", "mul") and _unordered(program, "add_", "mul_2")  # x written, the second read
    assert sum(1 for _ in nx.all_topological_sorts(program.graph)) == 21120
    for p in (True, False):
        assert_every_legal_order_computes_the_same(gm, [torch.tensor(p), torch.randn(4), torch.randn(4),
                                                        torch.randn(4)])


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_each_element_of_a_list_view_custom_op_views_the_source_its_val_shares(mode):
    """`Tensor(a)[] -> Tensor(a)[]`: the schema pins no position, the fake val does (each element
    shares its own input's storage): each getitem aliases that input alone and the op none (270
    legal orders, where each getitem may be x or y, now 1575, as two_views'). A real-mode val says
    nothing of storage: it stays as it was (270)."""
    import networkx as nx

    from test_fronts_attack3 import _ops

    gm = _custom_views_then_writes(lambda x, y: _ops.list_views([x, y]), mode)
    program = lower(gm)
    aliases = [o.alias for o in program.ops() if getattr(o, "target", None) == "_operator.getitem"]
    assert aliases == (["x_1", "y_1"] if mode == "fake" else [None, None])
    assert sum(1 for _ in nx.all_topological_sorts(program.graph)) == (1575 if mode == "fake" else 270)
    assert_every_legal_order_computes_the_same(gm, [torch.randn(4), torch.randn(4)])


def test_a_list_view_of_a_tensor_and_a_view_of_it_orders_both_elements_with_its_writes():
    """Aliasing sources: `list_views([x, x[1:]])`. Each element's val shares x's storage, and the
    slice's: each getitem may be either (one storage), and a write of x, or through either
    element, keeps its order with reads of both elements."""
    from test_fronts_attack3 import _ops

    def f(x):
        out = _ops.list_views([x, x[1:]])
        before = out[1] * 3
        x.add_(1)
        out[0].mul_(2)
        return before, out[1] * 5, out[0] * 7, torch.sin(torch.ones(3))

    gm = make_fx(f, tracing_mode="fake")(torch.randn(4))
    program = lower(gm)
    items = [o for o in program.ops() if getattr(o, "target", None) == "_operator.getitem"]
    assert [o.may_alias for o in items] == [("x_1", "slice_1")] * 2
    assert_every_legal_order_computes_the_same(gm, [torch.randn(4)])


@pytest.mark.parametrize("op", ["broadcast_tensors", "list_views"])
def test_a_write_through_the_whole_result_keeps_the_op_every_sources(op):
    """`_foreach_mul_(out, 2)` writes every element through the op's result itself, no getitem: the
    op keeps `may_alias` both, so the write is one of x's and y's storages (without it, a write of
    fresh storage: reads of x and y crossed it)."""
    from test_fronts_attack3 import _ops

    def f(x, y):
        out = _ops.list_views([x, y]) if op == "list_views" else torch.broadcast_tensors(x, y)
        before = out[1] * 3, x * 2
        torch._foreach_mul_(out, 2)
        return *before, out[0] * 5, y * 7, torch.sin(torch.ones(3))

    gm = make_fx(f, tracing_mode="fake", pre_dispatch=True)(torch.randn(4), torch.randn(4))
    # make_fx passes the getitems; the list itself, as a hand-built FX graph may
    (write,) = gm.graph.find_nodes(op="call_function", target=torch.ops.aten._foreach_mul_.Scalar)
    target = _ops.list_views.default if op == "list_views" else torch.ops.aten.broadcast_tensors.default
    write.args = (gm.graph.find_nodes(op="call_function", target=target)[0], *write.args[1:])
    gm.recompile()
    program = lower(gm)
    assert program.op(op).may_alias == ("x_1", "y_1")
    assert_every_legal_order_computes_the_same(gm, [torch.randn(4), torch.randn(4)])


def _gathered(build_item):
    """A gathered weight's element (`build_item(g, wait, x)`) read after the weight's free."""
    from fxsched.front import fsdp_free_storage

    c10d = torch.ops._c10d_functional

    def build(g):
        x, s0 = g.placeholder("x"), g.placeholder("s0")
        ag = g.call_function(c10d.all_gather_into_tensor.default, (s0, 2, "0"))
        ag.meta.update(comm_type="fsdp_all_gather", param_name="p0", fsdp_unsharded_nbytes=16)
        wait = g.call_function(c10d.wait_tensor.default, (ag,))
        item = build_item(g, wait, x)
        free = g.call_function(fsdp_free_storage, (wait,))
        free.meta.update(comm_type="fsdp_reshard_free", param_name="p0")
        g.output((g.call_function(torch.ops.aten.mul.Tensor, (item, 2)),))

    return build


def test_a_read_of_a_conds_element_after_a_free_of_its_one_source_is_a_use_after_free():
    """The first element of a cond whose branches return (a, b) and (a, c) is a, the gathered
    weight: read after its free, it is a use after free (it was a view of the op, which may be
    either: only a note). The second element, which may be b or c, read after a free of b is a
    note, as any `may_alias` result's."""
    from fxsched.lowering import LoweringError

    root = _cond_branches_returning_a_b_then_a_c()

    def element(at, order):
        def build_item(g, wait, x):
            operands = [wait, x, x] if order == "weight first" else [x, wait, x]
            call = g.call_function(torch.ops.higher_order.cond,
                                   (g.placeholder("p"), g.get_attr("true_graph"), g.get_attr("false_graph"), operands))
            return g.call_function(operator.getitem, (call, at))
        return build_item

    with pytest.raises(LoweringError, match="reads storage that %fsdp_free_storage freed before it"):
        lower(_graph(_gathered(element(0, "weight first")), root))
    program = lower(_graph(_gathered(element(1, "weight second")), root))
    assert any("taken for fresh storage" in note for note in program.notes)


def test_a_read_of_a_list_views_element_after_a_free_of_its_source_is_a_use_after_free():
    """list_views([weight, x]) traced with fake vals: the first element is the weight's (its val
    says so), freed before the read: a use after free (it was only a note)."""
    from fxsched.lowering import LoweringError

    from test_fronts_attack3 import _ops

    def build_item(g, wait, x):
        return g.call_function(operator.getitem, (g.call_function(_ops.list_views.default, ([wait, x],)), 0))

    gm = _graph(_gathered(build_item))
    with torch._subclasses.FakeTensorMode() as mode:  # the vals make_fx would record
        x, weight = torch.randn(8), torch.randn(8)
        vals = {"x": x, "wait_tensor_default": weight, "list_views_default": [weight.view(-1), x.view(-1)]}
        for node in gm.graph.nodes:
            if node.name in vals:
                node.meta["val"] = vals[node.name]
    del mode
    with pytest.raises(LoweringError, match="reads storage that %fsdp_free_storage freed before it"):
        lower(gm)


def test_a_subgraph_returning_a_nested_tuple_keeps_its_element_every_operands():
    """A subgraph returning ((a, b), -a): the first element is no tensor of one input, so fxsched
    cannot pin it: the op still `may_alias` x and y and the getitem of the pair's second element
    orders with the write of y (without it, taken for fresh storage, a legal order read y
    doubled)."""
    from torch._higher_order_ops.invoke_subgraph import invoke_subgraph

    def sub(g):
        a, b = g.placeholder("a"), g.placeholder("b")
        g.output(((a, b), g.call_function(torch.neg, (a,))))

    root = nn.Module()
    root.sub = _graph(sub)

    def build(g):
        x, y = g.placeholder("x"), g.placeholder("y")
        call = g.call_function(invoke_subgraph, (g.get_attr("sub"), "sub0", x, y))
        second = g.call_function(operator.getitem, (g.call_function(operator.getitem, (call, 0)), 1))
        first = g.call_function(operator.mul, (second, 3))
        g.call_method("mul_", (y, 2))
        g.output((first, g.call_function(operator.mul, (second, 5)), g.call_function(torch.sin, (y,)),
                  g.call_function(operator.getitem, (call, 1))))

    gm = _graph(build, root)
    assert lower(gm).op("invoke_subgraph").may_alias == ("x", "y")
    assert_every_legal_order_computes_the_same(gm, [torch.randn(4), torch.randn(4)])


def test_a_cond_element_one_branch_returns_and_the_other_makes_may_be_that_operand_or_fresh():
    """Branches returning (a, b) and (a * 2, b): the first element is x or fresh storage. Its
    getitem `may_alias` x alone (not an alias of it): ordered with x's writes, and it may be
    fresh; the second is y in both, an alias of it."""
    root = nn.Module()
    root.true_graph = make_fx(lambda a, b: (a, b))(torch.ones(4), torch.ones(4))
    root.false_graph = make_fx(lambda a, b: (a * 2, b))(torch.ones(4), torch.ones(4))

    def build(g):
        p, x, y = g.placeholder("p"), g.placeholder("x"), g.placeholder("y")
        call = g.call_function(torch.ops.higher_order.cond, (p, g.get_attr("true_graph"), g.get_attr("false_graph"),
                                                             [x, y]))
        r, s = (g.call_function(operator.getitem, (call, i)) for i in range(2))
        first = g.call_function(operator.mul, (r, 3))
        g.call_method("add_", (x, 1))
        g.call_method("mul_", (y, 2))
        g.output((first, g.call_function(operator.mul, (r, 5)), g.call_function(torch.sin, (x,)),
                  g.call_function(torch.cos, (y,)), g.call_function(operator.mul, (s, 7))))

    gm = _graph(build, root)
    program = lower(gm)
    assert [(program.op(n).alias, program.op(n).may_alias) for n in ("getitem", "getitem_1")] == [
        (None, ("x",)), ("y", ())]
    for p in (True, False):
        assert_every_legal_order_computes_the_same(gm, [torch.tensor(p), torch.randn(4), torch.randn(4)])


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_each_element_of_atleast_1d_views_the_source_its_val_shares(mode):
    """`atleast_1d(a, b)` (b 0-d: a view of it) returns views of a and of b, no schema or table
    pinning which is which; a fake val does (`val_items`): each getitem aliases its own input and
    the op none (18 legal orders, where each may be either, now 70). Real mode: as before (18)."""
    import networkx as nx

    def f(a, b):
        x, y = torch.atleast_1d(a, b)
        before = y * 3
        b.add_(1)
        return x * 2, before, y * 5, a.neg()

    inputs = [torch.randn(3), torch.randn(())]
    gm = make_fx(f, tracing_mode=mode, pre_dispatch=True)(*[t.clone() for t in inputs])
    program = lower(gm)
    known = mode == "fake"
    assert [program.op(n).alias for n in ("getitem", "getitem_1")] == (["a_1", "b_1"] if known else [None, None])
    assert program.op("atleast_1d").may_alias == (() if known else ("a_1", "b_1"))
    assert sum(1 for _ in nx.all_topological_sorts(program.graph)) == (70 if known else 18)
    assert_every_legal_order_computes_the_same(gm, inputs)
