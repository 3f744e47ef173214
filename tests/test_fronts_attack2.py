"""More inputs whose lowering missed a write, an alias or a side effect, found by attacking the
effect model as tests/test_fronts_attack.py does: every (or many random) topological order(s) of
the lowered program, raised back to FX, must compute bitwise what the input graph does. Each test
here computed other numbers (or failed) in some legal order before its fix.
"""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx, nn
from torch.fx.experimental.proxy_tensor import make_fx

from fxsched.ir import Barrier, View
from fxsched.lowering import LoweringError, lower

from test_fronts_attack import _graph, assert_every_legal_order_computes_the_same


# --------------------------------------------------------------------------- set_


def test_uses_of_a_tensor_after_its_set_read_the_new_storage():
    """`x.set_(y)` called from Python (symbolic_trace, hand-built): x views y's storage from then on,
    so `y.add_` must keep its order with a later read of x itself (not only of set_'s result), and
    with a read through an in-place op's result on x (which is x)."""
    def build(g):
        x, y = g.placeholder("x"), g.placeholder("y")
        same = g.call_method("mul_", (x, 1))  # x itself
        g.call_method("set_", (x, y))
        g.call_method("add_", (y, 1))
        g.output((g.call_function(operator.mul, (x, 2)), g.call_function(operator.mul, (same, 3)),
                  g.call_function(operator.neg, (y,))))

    gm = _graph(build)
    program = lower(gm)
    assert program.op("set_").alias == "y" and program.op("mul").operands == ("set_",)
    assert_every_legal_order_computes_the_same(gm, [torch.randn(4), torch.randn(4)])


def test_a_second_set_rebinds_again():
    """x.set_(y), then x.set_(z): later uses of x view z (a write of z orders against them), not y."""
    def build(g):
        x, y, z = g.placeholder("x"), g.placeholder("y"), g.placeholder("z")
        g.call_method("set_", (x, y))
        g.call_method("set_", (x, z))
        g.call_method("add_", (z, 1))
        g.output((g.call_function(operator.mul, (x, 2)), g.call_function(operator.neg, (y,))))

    gm = _graph(build)
    assert lower(gm).op("set__1").operands == ("set_", "z")
    assert_every_legal_order_computes_the_same(gm, [torch.randn(4), torch.randn(4), torch.randn(4)])


# --------------------------------------------------------------------------- higher-order ops


def _invoke(sub: fx.GraphModule) -> fx.GraphModule:
    """`r = invoke_subgraph(sub, x)[0]; x.add_(1); return r * 3, -x`."""
    from torch._higher_order_ops.invoke_subgraph import invoke_subgraph

    root = nn.Module()
    root.sub = sub

    def build(g):
        x = g.placeholder("x")
        call = g.call_function(invoke_subgraph, (g.get_attr("sub"), "sub0", x))
        r = g.call_function(operator.getitem, (call, 0))
        g.call_method("add_", (x, 1))
        g.output((g.call_function(operator.mul, (r, 3)), g.call_function(operator.neg, (x,))))

    return _graph(build, root)


@pytest.mark.parametrize("body", [lambda x: (x.mul_(2),), lambda x: (x.view(2, 2),), lambda x: (x,)],
                         ids=["written", "view", "itself"])
def test_a_higher_order_op_returning_its_input_aliases_it(body):
    """A subgraph that returns its input (written in place, a view of it, or itself): the op's result
    is that input's storage, so `x.add_` after the call keeps its order with reads of the result (it
    was fresh storage: a read could cross the write)."""
    gm = _invoke(make_fx(body)(torch.ones(4)))
    assert lower(gm).op("invoke_subgraph").alias == "x"
    assert_every_legal_order_computes_the_same(gm, [torch.randn(4)])


def test_a_higher_order_op_that_may_return_one_of_several_operands_is_refused():
    """An op the IR cannot say (its result aliases one operand, not one of two): a LoweringError
    naming it, not a guess."""
    from torch._higher_order_ops.invoke_subgraph import invoke_subgraph

    root = nn.Module()
    root.sub = make_fx(lambda a, b: (a, b))(torch.ones(4), torch.ones(4))

    def build(g):
        x, y = g.placeholder("x"), g.placeholder("y")
        call = g.call_function(invoke_subgraph, (g.get_attr("sub"), "sub0", x, y))
        g.output((g.call_function(operator.getitem, (call, 0)),))

    with pytest.raises(LoweringError, match=r"%invoke_subgraph .* may return one of its operands \['%x', '%y'\]"):
        lower(_graph(build, root))


# --------------------------------------------------------------------------- module state


def test_a_called_module_whose_parameter_a_get_attr_writes_is_a_barrier():
    """symbolic_trace of `self.lin(x)` then `self.lin.weight.add_(1)`: the call reads the weight,
    which no operand names, so it could move past the write."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            with torch.no_grad():
                self.lin.weight.add_(1.0)
            return y, torch.neg(x)

    torch.manual_seed(0)
    gm = fx.symbolic_trace(Net())
    program = lower(gm)
    assert isinstance(program.op("lin"), Barrier) and program.op("lin").reason == "module state"
    assert_every_legal_order_computes_the_same(gm, [torch.randn(3, 4)])


def test_a_called_module_whose_parameter_is_only_read_elsewhere_is_no_barrier():
    """Tied weights read through a get_attr and a call (no write): nothing to order."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x) + x @ self.lin.weight

    assert not any(isinstance(op, Barrier) for op in lower(fx.symbolic_trace(Net())).ops())


def test_a_module_fxsched_does_not_know_with_state_is_a_barrier():
    """A custom leaf module (a tracer's `is_leaf_module`) may write its own buffers: two calls of a
    counter were free to swap."""
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("n", torch.zeros(1))

        def forward(self, x):
            self.n.add_(1)
            return x * self.n

    class Tracer(fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return isinstance(m, Counter) or super().is_leaf_module(m, qualname)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = Counter()

        def forward(self, x, y):
            return self.c(x), self.c(y), torch.neg(x), torch.abs(y)

    root = Net()
    gm = fx.GraphModule(root, Tracer().trace(root))
    program = lower(gm)
    assert [op.reason for op in program.ops() if isinstance(op, Barrier)] == ["module state"] * 2
    assert_every_legal_order_computes_the_same(gm, [torch.randn(3), torch.randn(3)])


@pytest.mark.parametrize("module", [nn.Identity(), nn.Flatten(0), nn.Unflatten(0, (2, 2)), nn.Dropout(0.5).eval(),
                                    nn.Dropout(0.0)], ids=["identity", "flatten", "unflatten", "dropout-eval", "dropout-0"])
def test_a_module_call_that_returns_its_input_or_a_view_aliases_it(module):
    """symbolic_trace keeps `self.m(x)` a call_module; nn.Identity returns x itself, Flatten a view,
    a dropout in eval mode x: a later `x.add_` was free to cross the reads of the result."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = module

        def forward(self, x):
            y = self.m(x)
            x.add_(1)
            return y * 2, torch.neg(x)

    gm = fx.symbolic_trace(Net())
    assert lower(gm).op("m").alias == "x"
    assert_every_legal_order_computes_the_same(gm, [torch.randn(4)])


# --------------------------------------------------------------------------- storages


def test_a_resize_through_the_untyped_storage_writes_the_tensor():
    """FSDP's reshard frees with `x.untyped_storage().resize_(0)`: the storage was a fresh value, so
    a read of x could move after the free (and read freed memory)."""
    def build(g):
        x = g.placeholder("x")
        r = g.call_function(operator.mul, (x, 2))
        g.call_method("resize_", (g.call_method("untyped_storage", (x,)), 0))
        g.output((r, g.call_function(operator.neg, (r,))))

    gm = _graph(build)
    assert lower(gm).op("resize_").writes == ("untyped_storage",)
    assert_every_legal_order_computes_the_same(gm, [torch.randn(4)])


# --------------------------------------------------------------------------- vals that say nothing


def test_real_mode_make_fx_vals_say_nothing_about_storage():
    """make_fx in real mode gives each node's val a fake mode and a storage of its own: `reshape`
    (pre_dispatch keeps it) of x had a val sharing nothing with x's, so it was read as a copy, and a
    read of it crossed `x.add_`. Vals of another fake mode than the graph's first are no evidence."""
    def f(x):
        y = x.reshape(4)
        x.add_(1)
        return y * 2, x.neg()

    gm = make_fx(f, pre_dispatch=True)(torch.randn(2, 2))
    reshape = lower(gm).op("reshape")
    assert isinstance(reshape, View) and reshape.maybe
    assert_every_legal_order_computes_the_same(gm, [torch.randn(2, 2)])
