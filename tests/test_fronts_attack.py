"""Graphs from the fronts users feed (symbolic_trace, hand-built FX, make_fx with in-place writes)
whose lowering once missed a write or an alias, so that a legal schedule computed other numbers.

The check is the IR's promise itself: every topological order of the lowered program (all of
them, on these few-node graphs) raised back to FX computes bitwise what the input graph does. A
pass only ever picks one of those orders, so a missing effect edge is a wrong schedule waiting
for a pass that wants that order.
"""

from __future__ import annotations

import copy
import itertools
import operator

import networkx as nx
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.experimental.proxy_tensor import make_fx

from fxsched.ir import Barrier, Constant, View, parse_program, print_program
from fxsched.ir.program import Schedule
from fxsched.lowering import lower
from fxsched.raising import raise_program


def _run(gm: fx.GraphModule, inputs) -> list[torch.Tensor]:
    gm = copy.deepcopy(gm)  # the graph may write its module's tensors: each run starts from the same
    torch.manual_seed(0)  # and draws the same numbers
    with torch.no_grad():
        out = gm(*[t.clone() for t in inputs])
    return [t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)]


def assert_every_legal_order_computes_the_same(gm: fx.GraphModule, inputs, most: int = 400, shuffled: int = 30) -> int:
    """Every topological order of the lowered program (up to `most`, and `shuffled` seeded random
    ones: networkx lists orders varying the tail first, so on a bigger graph the first few hundred
    keep its head) raised and run equals the input graph bitwise; the number of orders tried (more
    than one, or the check says nothing)."""
    expected = _run(gm, inputs)
    program = lower(gm)
    tried = 0
    orders = itertools.chain(itertools.islice(nx.all_topological_sorts(program.graph), most),
                             _random_orders(program, shuffled, 0))
    for order in orders:
        program.schedule = Schedule(order)
        got = _run(raise_program(program), inputs)
        assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(expected, got)), (
            f"a legal order computes other numbers: {[n for n in order if not n.startswith('^')]}\n{program}")
        tried += 1
    assert tried > 1 + shuffled
    return tried


def _graph(build, root: nn.Module | None = None) -> fx.GraphModule:
    graph = fx.Graph()
    build(graph)
    return fx.GraphModule(root or nn.Module(), graph)


# --------------------------------------------------------------------------- module attributes


def test_two_get_attrs_of_one_buffer_are_one_storage():
    """symbolic_trace and hand-built graphs make a get_attr per use of a buffer: a write through
    one must order against reads through the other (they were two unrelated constants)."""
    root = nn.Module()
    root.register_buffer("buf", torch.arange(4.0))

    def build(g):
        x = g.placeholder("x")
        g.call_method("add_", (g.get_attr("buf"), 1))
        other = g.call_function(operator.neg, (x,))  # free to go anywhere: several legal orders
        g.output((g.call_function(operator.add, (x, g.call_function(operator.mul, (g.get_attr("buf"), 3)))), other))

    gm = _graph(build, root)
    program = lower(gm)
    second = program.op("buf_1")
    assert isinstance(second, Constant) and second.alias == "buf"
    assert_every_legal_order_computes_the_same(gm, [torch.randn(4)])
    # the text form keeps the alias (effect edges are derived again on parse)
    again = parse_program(print_program(program))
    assert again.op("buf_1").alias == "buf" and set(again.graph.edges) == set(program.graph.edges)


def test_make_fx_closing_over_a_parameter_updated_in_the_graph():
    """make_fx (real tensors) of a function that uses a module directly: each use of a parameter
    is its own get_attr of one tensor, and the in-graph update (an optimizer step, an EMA) writes
    it through one of them."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)

    def step(x):
        y = lin(x)
        with torch.no_grad():
            lin.weight.add_(1.0)
        return y + lin(x)

    gm = make_fx(step)(torch.randn(3, 4))
    assert_every_legal_order_computes_the_same(gm, [torch.randn(3, 4)])


def test_tied_attributes_share_their_storage():
    """Two attribute names for one tensor (tied weights) are one storage."""
    root = nn.Module()
    root.a = nn.Parameter(torch.ones(4), requires_grad=False)
    root.b = root.a

    def build(g):
        x = g.placeholder("x")
        r = g.call_function(operator.mul, (g.get_attr("b"), 2))
        g.call_method("mul_", (g.get_attr("a"), 5))
        g.output((r, g.call_function(operator.neg, (x,))))

    gm = _graph(build, root)
    assert lower(gm).op("a").alias == "b"
    assert_every_legal_order_computes_the_same(gm, [torch.randn(4)])


# --------------------------------------------------------------------------- Python calls


def test_tensor_attribute_view_orders_against_a_write():
    """`x.T` in symbolic_trace is `getattr(x, "T")`: a view of x, so a later `x.mul_` is ordered
    after the view's readers (it was a fresh value, and the read could move past the write)."""
    def build(g):
        x = g.placeholder("x")
        t = g.call_function(getattr, (x, "T"))
        g.call_method("mul_", (x, 2))
        g.output((g.call_function(operator.add, (t, 0)), g.call_function(operator.neg, (t,))))

    gm = _graph(build)
    assert isinstance(lower(gm).op("getattr_1"), View)
    assert_every_legal_order_computes_the_same(gm, [torch.randn(4, 4)])


def test_python_call_with_out_writes_it():
    """`torch.add(x, y, out=buf)`: the out tensor is written (it was taken for a pure call)."""
    def build(g):
        x, buf = g.placeholder("x"), g.placeholder("buf")
        r = g.call_function(operator.mul, (buf, 1))
        g.call_function(torch.add, (x, x), {"out": buf})
        g.output((g.call_function(operator.add, (r, buf)), g.call_function(operator.neg, (x,))))

    gm = _graph(build)
    assert lower(gm).op("add").writes == ("buf",)
    assert_every_legal_order_computes_the_same(gm, [torch.randn(4), torch.randn(4)])


def test_torch_distributed_python_calls_are_barriers():
    """`dist.all_reduce(x)` in a hand-built graph writes x and talks to the other ranks; fxsched
    cannot see into it (it was a known, pure call that any read of x could cross)."""
    def build(g):
        x = g.placeholder("x")
        r = g.call_function(operator.mul, (x, 1))
        g.call_function(dist.all_reduce, (x,))
        g.call_function(dist.barrier, ())
        g.output((g.call_function(operator.add, (r, x)),))

    program = lower(_graph(build))
    assert isinstance(program.op("all_reduce"), Barrier) and isinstance(program.op("barrier"), Barrier)


# --------------------------------------------------------------------------- schemas that do not say


def test_make_fx_batch_norm_updates_its_running_stats():
    """make_fx without functionalization records `aten.native_batch_norm`, whose schema marks no
    write, but which updates running_mean and running_var in training mode: a read of the running
    mean could move across it."""
    def bn(x, running_mean, running_var, weight, bias):
        before = running_mean * 1
        y = F.batch_norm(x, running_mean, running_var, weight, bias, training=True)
        return y, before, running_var + 0

    inputs = [torch.randn(4, 3, 5), torch.randn(3), torch.rand(3), torch.randn(3), torch.randn(3)]
    gm = make_fx(bn, tracing_mode="fake")(*inputs)
    norm = next(op for op in lower(gm).ops() if "native_batch_norm" in getattr(op, "target", ""))
    assert set(norm.writes) == {"running_mean_1", "running_var_1"}
    assert_every_legal_order_computes_the_same(gm, inputs)


def test_conversions_that_may_return_their_input_are_maybe_views():
    """`x.float()` of a float tensor is x, and `x.cpu()` of a CPU one (no aten op of the first name;
    the second's schema, `Tensor(b|a)`, is unknown to the dispatcher: lowering raised on it)."""
    def build(g):
        x = g.placeholder("x")
        as_float, on_cpu = g.call_method("float", (x,)), g.call_method("cpu", (x,))
        g.call_method("add_", (x, 1))
        g.output((g.call_function(operator.mul, (as_float, 2)), g.call_function(operator.mul, (on_cpu, 3)),
                  g.call_function(operator.neg, (x,))))

    gm = _graph(build)
    program = lower(gm)
    assert all(isinstance(program.op(n), View) and program.op(n).maybe for n in ("float_1", "cpu"))
    assert_every_legal_order_computes_the_same(gm, [torch.randn(4)])


def test_inplace_passed_by_position_writes():
    """`F.relu(x, True)`: `inplace` by position, not only as a keyword."""
    def build(g):
        x = g.placeholder("x")
        before = g.call_function(operator.mul, (x, 1))
        g.call_function(F.relu, (x, True))
        g.output((g.call_function(operator.add, (before, x)), g.call_function(operator.neg, (before,))))

    gm = _graph(build)
    assert lower(gm).op("relu").writes == ("x",)
    assert_every_legal_order_computes_the_same(gm, [torch.randn(4)])


def test_manual_seed_between_draws_keeps_its_place():
    """`torch.manual_seed` sets the generator the draws read: it is ordered with them."""
    def build(g):
        x = g.placeholder("x")
        first = g.call_function(torch.rand, ([4],))
        g.call_function(torch.manual_seed, (0,))
        g.output((first, g.call_function(torch.rand, ([4],)), g.call_function(operator.neg, (x,))))

    gm = _graph(build)
    assert lower(gm).op("manual_seed").random
    assert_every_legal_order_computes_the_same(gm, [torch.randn(4)])



def test_python_batch_norms_update_their_running_stats():
    """torch.compile's dynamo graph calls `F.batch_norm(x, running_mean, running_var, ..., True, ...)`
    (and `torch.batch_norm`, `F.instance_norm`): Python calls with no schema, which were pure, so a
    read of the running mean could cross the update. Built as dynamo records it."""
    def build(g):
        x, mean, var = g.placeholder("x"), g.placeholder("mean"), g.placeholder("var")
        before = g.call_function(operator.mul, (mean, 1))
        y = g.call_function(F.batch_norm, (x, mean, var, None, None, True, 0.1, 1e-5))
        z = g.call_function(torch.batch_norm, (x, None, None, mean, var, True, 0.1, 1e-5, False))
        i = g.call_function(F.instance_norm, (g.call_method("view", (x, 1, 3, 4)), mean, var), {"use_input_stats": True})
        g.output((y, z, i, before, g.call_function(operator.add, (var, 0))))

    gm = _graph(build)
    program = lower(gm)
    assert all(set(program.op(n).writes) == {"mean", "var"} for n in ("batch_norm", "batch_norm_1", "instance_norm"))
    assert_every_legal_order_computes_the_same(gm, [torch.randn(4, 3), torch.randn(3), torch.rand(3)])

# --------------------------------------------------------------------------- higher-order ops


def test_a_users_triton_kernel_writes_the_tensors_it_is_given():
    """Inductor's post-grad graphs call a user's triton kernel as `triton_kernel_wrapper_mutation`,
    which stores into tensors of its `kwargs` (it was pure compute: a read of its output buffer
    could move across it). The kernel runs on GPUs only: the check is on the lowered effects."""
    from torch._higher_order_ops.triton_kernel_wrap import triton_kernel_wrapper_mutation

    def build(g):
        x, out = g.placeholder("x"), g.placeholder("out")
        before = g.call_function(operator.mul, (out, 1))
        g.call_function(triton_kernel_wrapper_mutation, (), dict(
            kernel_idx=0, constant_args_idx=0, grid=[(1, 1, 1)], tma_descriptor_metadata={},
            kwargs={"in_ptr": x, "out_ptr": out}))
        g.output((g.call_function(operator.add, (before, out)),))

    program = lower(_graph(build))
    assert set(program.op("triton_kernel_wrapper_mutation").writes) == {"x", "out"}
    assert nx.has_path(program.graph, "mul", "triton_kernel_wrapper_mutation")
    assert nx.has_path(program.graph, "triton_kernel_wrapper_mutation", "add")


def test_a_higher_order_op_whose_subgraph_writes_its_input():
    """`invoke_subgraph` around an in-place op writes what it is given (as a subgraph that draws is
    random, tests/test_rng_hops.py); a higher-order op fxsched does not know writes all it is given."""
    from torch._higher_order_ops.invoke_subgraph import invoke_subgraph

    sub = make_fx(lambda x: (x.mul_(2),))(torch.ones(4))
    root = nn.Module()
    root.sub = sub

    def build(g):
        x = g.placeholder("x")
        before = g.call_function(operator.mul, (x, 1))
        call = g.call_function(invoke_subgraph, (g.get_attr("sub"), "sub0", x))
        g.output((g.call_function(operator.add, (before, x)), g.call_function(operator.getitem, (call, 0)),
                  g.call_function(operator.neg, (before,))))

    gm = _graph(build, root)
    assert lower(gm).op("invoke_subgraph").writes == ("x",)
    assert_every_legal_order_computes_the_same(gm, [torch.randn(4)])


def test_set_makes_the_result_a_view_of_the_source():
    """make_fx of `x.set_(y)`: the result (what later uses of x read) views y's storage, so a later
    `y.add_` is ordered against them (the result was x's own storage, and a read of it could cross
    the write)."""
    def f(x, y):
        x.set_(y)
        y.add_(1)
        return x.sum() * 1, y + 0

    inputs = [torch.randn(4), torch.randn(4)]
    gm = make_fx(f)(*[t.clone() for t in inputs])
    assert lower(gm).op("set_").alias == "y_1"
    assert_every_legal_order_computes_the_same(gm, inputs)


# --------------------------------------------------------------------------- the runner


def test_group_size_learnt_after_a_collective_that_does_not_say_it():
    """An all_reduce names its group but no size; a reduce-scatter on that group after it says 2:
    the runner refused the graph ("group 'tp' used with sizes -1 and 2")."""
    from fxsched.runtime import graph_group_names

    c10d = torch.ops._c10d_functional

    def build(g):
        x = g.placeholder("x")
        reduced = g.call_function(c10d.wait_tensor.default, (g.call_function(c10d.all_reduce.default, (x, "sum", "tp")),))
        scattered = g.call_function(c10d.reduce_scatter_tensor.default, (reduced, "sum", 2, "tp"))
        g.output((g.call_function(c10d.wait_tensor.default, (scattered,)),))

    assert graph_group_names(_graph(build)) == {"tp": 2}


def test_symbolic_trace_batch_norm_module_in_training_is_a_barrier():
    """symbolic_trace keeps `self.bn(x)` a call_module, which writes the module's running stats
    (no operand names them): a read of them through get_attr, or the order of two calls of the
    module, was free."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(3)

        def forward(self, x, y):
            before = self.bn.running_mean * 1
            a = self.bn(x)
            b = self.bn(y)
            return a, b, before, self.bn.running_mean + 0, torch.neg(x)

    gm = fx.symbolic_trace(Net())
    program = lower(gm)
    assert [op.reason for op in program.ops() if isinstance(op, Barrier)] == ["module state"] * 2
    assert_every_legal_order_computes_the_same(gm, [torch.randn(4, 3), torch.randn(4, 3)])


# --------------------------------------------------------------------------- end to end


class _BatchNormNet(nn.Module):
    """Linear -> BatchNorm (training) -> ReLU(inplace) -> Linear, plus a buffer updated in the forward."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.l1, self.bn, self.l2 = nn.Linear(width, width), nn.BatchNorm1d(width), nn.Linear(width, width)
        self.relu = nn.ReLU(inplace=True)
        self.register_buffer("ema", torch.zeros(width))

    def forward(self, x):
        h = self.relu(self.bn(self.l1(x)))
        with torch.no_grad():
            self.ema.mul_(0.9).add_(h.mean(0), alpha=0.1)
        return (self.l2(h + self.ema) + self.bn.running_mean).square().sum()


def _random_orders(program, count: int, seed: int) -> list[list[str]]:
    """Seeded random topological orders of the program's graph (Kahn's, a random key per op)."""
    import heapq
    import random

    graph, orders = program.graph, []
    for k in range(count):
        rng = random.Random(seed + k)
        keys = {v: rng.random() for v in graph.nodes}
        indegree = {v: graph.in_degree(v) for v in graph.nodes}
        ready = [(keys[v], v) for v, d in indegree.items() if d == 0]
        heapq.heapify(ready)
        order = []
        while ready:
            _, v = heapq.heappop(ready)
            order.append(v)
            for s in graph.successors(v):
                indegree[s] -= 1
                if indegree[s] == 0:
                    heapq.heappush(ready, (keys[s], s))
        orders.append(order)
    return orders


def _run_each_on_fresh_buffers(rank, world_size, jobs):
    """`ranks.run_all`, each graph on a copy of its module: the graphs write the buffers they share."""
    from ranks import run_all

    return run_all(rank, world_size, [(copy.deepcopy(gm), feeds) for gm, feeds in jobs])


@pytest.mark.multirank
def test_fsdp_front_graph_of_a_batch_norm_model_is_bitwise_in_legal_orders_on_two_ranks():
    """fxsched's own FSDP front (make_fx) keeps a model's real buffers as get_attr constants, one per
    use, and records `native_batch_norm`: before the get_attr aliases and the batch norm's writes,
    most random legal orders of this graph computed other numbers on 2 gloo ranks."""
    from fxsched.front import fsdp_joint_graph
    from fxsched.runtime import run_ranks

    from ranks import check_bitwise

    torch.manual_seed(0)
    module, x = _BatchNormNet(), torch.randn(8, 16)
    front = fsdp_joint_graph(module, [x], lambda m, x: m(x), 2)
    program = lower(front.gm)
    jobs = [front.gm]
    for order in _random_orders(program, 6, 0):
        program.schedule = Schedule(order)
        jobs.append(raise_program(program))
    feeds = [front.shard_inputs(module, rank, [x + rank]) for rank in range(2)]
    results = run_ranks(_run_each_on_fresh_buffers, 2, args=([(gm, feeds) for gm in jobs],), timeout=600)
    check_bitwise(results, ["batch-norm net"], "a legal order", per_key=len(jobs))


def test_a_read_of_an_in_place_collectives_buffer_before_its_wait_is_noted():
    """`all_reduce_(x)` writes x until its wait: a read of x between them races in the input, so what
    it reads depends on timing (a fuzzed graph with such a read of an in-place `broadcast_` computed
    other numbers on 2 gloo ranks under every pipeline, the legal orders moving the launch and the
    wait); lowering now says so, naming both, as it did for a write."""
    c10d = torch.ops._c10d_functional

    def build(g):
        x = g.placeholder("x")
        launch = g.call_function(c10d.all_reduce_.default, (x, "sum", "0"))
        racing = g.call_function(operator.mul, (x, 2))
        g.call_function(c10d.wait_tensor.default, (launch,))
        g.output((racing, g.call_function(operator.mul, (x, 3))))

    notes = lower(_graph(build)).notes
    assert [n for n in notes if "races" in n] == [
        "%mul reads storage the collective %all_reduce__default writes until its wait: the input races with its "
        "collective (kept between them, as in the input)"]


# --------------------------------------------------------------------------- inputs of one storage

def test_inputs_traced_as_views_of_one_storage_are_aliases():
    """make_fx(f)(x[:3], x[1:]) with fake tensors: two inputs, one storage. Each input was its own
    storage, so `b.add_` could cross the reads of `a` on either side of it; the later input is now
    an alias of the first (the text round-trips it), and every legal order computes what f does."""
    def f(a, b):
        y = a * 2
        b.add_(1)
        return y + a

    base = torch.arange(4.0)
    gm = make_fx(f, tracing_mode="fake")(base[:3], base[1:])
    program = lower(gm)

    def run(module):
        fresh = torch.arange(4.0)
        out = module(fresh[:3], fresh[1:])
        return [out, fresh]

    expected = run(gm)
    tried = 0
    for order in nx.all_topological_sorts(program.graph):
        program.schedule = Schedule(order)
        got = run(raise_program(program))
        assert all(torch.equal(x, y) for x, y in zip(expected, got)), order
        tried += 1
    assert tried == 1  # a * 2, b.add_, + a: one order left (each input alone allowed three)
    a, b = (n.name for n in gm.graph.find_nodes(op="placeholder"))
    assert program.op(b).alias == a and program.op(b).operands == (a,)
    assert print_program(parse_program(print_program(program))) == print_program(program)
