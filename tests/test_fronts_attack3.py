"""Inputs from torch.compile's world (custom ops with alias annotations, Inductor's higher-order ops,
effect tokens, functional collectives) whose lowering missed an alias or a write, found by
attacking the effect model as tests/test_fronts_attack.py and tests/test_fronts_attack2.py do:
every (or many random) topological order(s) of the lowered program, raised back to FX, must
compute bitwise what the input graph does. Each test here computed other numbers in some legal
order (or failed) before its fix.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fxsched.lowering import lower

from test_fronts_attack import assert_every_legal_order_computes_the_same

# --------------------------------------------------------------------------- custom ops' alias annotations

#: custom ops whose schema says what their result views or what they write, as `torch.library.define`
#: lets a user say it (`torch.library.custom_op` refuses results that alias inputs)
_LIB = torch.library.Library("fxsched_attack3", "DEF")
for _schema, _impl in [
    ("second_view(Tensor x, Tensor(a) y) -> Tensor(a)", lambda x, y: y.view(-1)),
    ("two_views(Tensor(a) x, Tensor(b) y) -> (Tensor(a), Tensor(b))", lambda x, y: (x.view(-1), y.view(-1))),
    ("list_views(Tensor(a)[] xs) -> Tensor(a)[]", lambda xs: [t.view(-1) for t in xs]),
    ("fresh_and_view(Tensor x, Tensor(a) y) -> (Tensor, Tensor(a))", lambda x, y: (x * 2, y.view(-1))),
    ("write_first_view_second(Tensor(a!) x, Tensor(b) y) -> Tensor(b)", lambda x, y: (x.add_(1), y.view(-1))[1]),
    ("write_second(Tensor x, Tensor(a!) y) -> ()", lambda x, y: (y.add_(x), None)[1]),
    ("write_second_ret(Tensor x, Tensor(a!) y) -> Tensor(a!)", lambda x, y: y.add_(x)),
    ("write_list(Tensor(a!)[] xs) -> ()", lambda xs: (torch._foreach_mul_(xs, 2), None)[1]),
    ("write_kw(Tensor x, *, Tensor(a!) out) -> Tensor(a!)", lambda x, out: out.copy_(x * 3)),
    ("write_optional(Tensor x, Tensor(a!)? y) -> ()", lambda x, y: (y.add_(x) if y is not None else None, None)[1]),
]:
    _LIB.define(_schema)
    _LIB.impl(_schema.split("(")[0], _impl, "CompositeExplicitAutograd")
_ops = torch.ops.fxsched_attack3

#: (x, y) -> what is read after a write of y (or of x): each reads a result that views y
_CUSTOM = {
    "second_view": lambda x, y: (lambda v: (y.add_(1), v * 2))(_ops.second_view(x, y)),
    "fresh_and_view": lambda x, y: (lambda t: (y.add_(1), t[0] * 2, t[1] * 3))(_ops.fresh_and_view(x, y)),
    "write_first_view_second": lambda x, y: (lambda v: (y.add_(1), v * 2, x * 1))(_ops.write_first_view_second(x, y)),
    "two_views, x written": lambda x, y: (lambda t: (x.add_(1), t[0] * 2, t[1] * 3))(_ops.two_views(x, y)),
    "write_second": lambda x, y: (lambda a: (_ops.write_second(x, y), a, y * 3))(y * 2),
    "write_second_ret": lambda x, y: (lambda a: (lambda r: (a, r * 5, y * 3))(_ops.write_second_ret(x, y)))(y * 2),
    "write_list": lambda x, y: (lambda a: (_ops.write_list([x, y]), a, y * 3, x + 1))(y * 2),
    "write_kw": lambda x, y: (lambda a: (_ops.write_kw(x, out=y), a, y * 3))(y * 2),
    "write_optional": lambda x, y: (lambda a: (_ops.write_optional(x, y), a, y * 3))(y * 2),
}


def _custom_graph(case: str, mode: str):
    def f(x, y):
        out = tuple(t for t in _CUSTOM[case](x, y) if isinstance(t, torch.Tensor))
        # work independent of the custom op, so that there are many orders to try
        return (*out, torch.sin(torch.ones(3)), torch.cos(torch.ones(2)))

    return make_fx(f, tracing_mode=mode)(torch.randn(4), torch.randn(4))


@pytest.mark.parametrize("mode", ["real", "fake"])
@pytest.mark.parametrize("case", list(_CUSTOM))
def test_custom_ops_results_view_and_write_what_their_schema_says(case, mode):
    """A custom op's schema may say its result views its second argument (`Tensor(a) y ->
    Tensor(a)`), or one element of a tuple result does (`-> (Tensor, Tensor(a))`), or a mutating op
    returns a view of another argument (`(Tensor(a!) x, Tensor(b) y) -> Tensor(b)`): each was read
    as a view of the first argument (or as fresh storage), so a read of the result crossed a write
    of y: of the 430 orders tried, 216 (second_view), 147 (fresh_and_view) and 192
    (write_first_view_second, real mode; fake vals said it) computed other numbers. Now its result
    aliases the argument the schema names. The writes (`Tensor(a!)` second, in a list,
    keyword-only, optional) were right already."""
    x, y = torch.randn(4), torch.randn(4)
    assert_every_legal_order_computes_the_same(_custom_graph(case, mode), [x, y])


#: custom-op views of a tensor (as the second argument, an element of a tuple result, the result of
#: an op writing another argument) and custom-op writes of it, for random programs
_CUSTOM_VIEWS = [lambda t: _ops.second_view(t * 0, t), lambda t: _ops.fresh_and_view(t, t)[1],
                 lambda t: _ops.write_first_view_second(t * 1, t), lambda t: t.view(-1), lambda t: t[1:]]
_CUSTOM_WRITES = [lambda t: _ops.write_second(t * 0 + 1, t), lambda t: _ops.write_second_ret(t * 0 + 2, t),
                  lambda t: _ops.write_list([t]), lambda t: _ops.write_kw(t * 1, out=t), lambda t: t.mul_(2)]


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_random_programs_of_custom_op_views_and_writes_keep_their_numbers(mode):
    """40 random programs of custom-op views and writes (and aten ones), traced by make_fx: 15
    random legal orders of each compute its outputs and final inputs bitwise. Before the custom-op
    views were read as the schema says (c6b72d3), 11 of the 40 failed in real mode and 8 in fake mode."""
    from test_fronts_attack2 import _run_steps, _steps, assert_random_legal_orders_compute_the_same

    inputs = [torch.randn(2, 2), torch.randn(2, 2)]
    for seed in range(40):
        steps = _steps(seed, _CUSTOM_VIEWS, _CUSTOM_WRITES)
        gm = make_fx(lambda a, b: _run_steps(steps, a, b), tracing_mode=mode)(*[t.clone() for t in inputs])
        assert_random_legal_orders_compute_the_same(gm, inputs, 15, seed)


@pytest.mark.parametrize("op", ["two_views", "list_views"])
def test_a_custom_op_returning_views_of_several_arguments_one_of_them_written_keeps_its_numbers(op):
    """`(Tensor(a) x, Tensor(b) y) -> (Tensor(a), Tensor(b))` or `(Tensor(a)[] xs) -> Tensor(a)[]`
    returns views of x and of y; a View says one source. A write of y after it crossed a read of
    y's view (147 of 430 orders, when they were read as views of x), then was a LoweringError; now
    the op `may_alias` x and y and every legal order computes the input's numbers
    (tests/test_several_sources.py: real mode, a write through a result); each getitem, whose
    source the schema (two_views) or the fake val (list_views) names, now aliases it alone."""
    def f(x, y):
        out = _ops.two_views(x, y) if op == "two_views" else _ops.list_views([x, y])
        y.add_(1)
        return out[0] * 2, out[1] * 3

    inputs = [torch.randn(4), torch.randn(4)]
    gm = make_fx(f, tracing_mode="fake")(*inputs)
    program = lower(gm)
    assert [program.op(n).alias for n in ("getitem", "getitem_1")] == ["x_1", "y_1"]
    assert program.op(op).may_alias == ()
    assert_every_legal_order_computes_the_same(gm, inputs)


# --------------------------------------------------------------------------- functional collectives' results

_c10d = torch.ops._c10d_functional
_aten = torch.ops.aten


def _pad(g, outs):
    """Outputs, and work independent of the collectives (so that there are many orders)."""
    extra = [g.call_function(torch.sin, (g.call_function(torch.ones, (3,)),)),
             g.call_function(torch.cos, (g.call_function(torch.ones, (2,)),))]
    g.output(tuple(outs + extra))


def _wait_result_written_launch_read(g):
    """`w = wait_tensor(r)` is r (wait_tensor returns the tensor it is given); r is read by name
    after a write through w."""
    x = g.placeholder("x")
    r = g.call_function(_c10d.all_reduce.default, (x, "sum", "0"))
    w = g.call_function(_c10d.wait_tensor.default, (r,))
    g.call_function(_aten.add_.Tensor, (w, 1))
    _pad(g, [g.call_function(_aten.mul.Tensor, (r, 2))])


def _launch_result_written_wait_read(g):
    x = g.placeholder("x")
    r = g.call_function(_c10d.all_reduce.default, (x, "sum", "0"))
    w = g.call_function(_c10d.wait_tensor.default, (r,))
    a = g.call_function(_aten.mul.Tensor, (w, 3))
    g.call_function(_aten.add_.Tensor, (r, 1))
    _pad(g, [a, g.call_function(_aten.mul.Tensor, (w, 2))])


def _all_to_all_result_read_by_name(g):
    x = g.placeholder("x")
    r = g.call_function(_c10d.all_to_all_single.default, (x, [2, 2], [2, 2], "0"))
    w = g.call_function(_c10d.wait_tensor.default, (r,))
    g.call_function(_aten.add_.Tensor, (x, 1))
    g.call_function(_aten.mul_.Tensor, (w, 3))
    _pad(g, [g.call_function(_aten.mul.Tensor, (r, 2)), g.call_function(_aten.mul.Tensor, (x, 2))])


def _coalesced_result_taken_twice(g):
    import operator

    x, y = g.placeholder("x"), g.placeholder("y")
    r = g.call_function(_c10d.all_reduce_coalesced.default, ([x, y], "sum", "0"))
    a = g.call_function(_c10d.wait_tensor.default, (g.call_function(operator.getitem, (r, 0)),))
    b = g.call_function(_c10d.wait_tensor.default, (g.call_function(operator.getitem, (r, 1)),))
    g.call_function(_aten.add_.Tensor, (a, 1))
    _pad(g, [g.call_function(_aten.mul.Tensor, (b, 2)),
             g.call_function(_aten.mul.Tensor, (g.call_function(operator.getitem, (r, 0)), 2))])


def _in_place_launch_result_read_twice(g):
    """`all_reduce_(x)` returns x; its result is waited and read by name (so not waited once):
    a write of x is ordered with the read of the result."""
    x = g.placeholder("x")
    r = g.call_function(_c10d.all_reduce_.default, (x, "sum", "0"))
    g.call_function(_c10d.wait_tensor.default, (r,))
    a = g.call_function(_aten.mul.Tensor, (r, 3))
    g.call_function(_aten.add_.Tensor, (x, 1))
    _pad(g, [a, g.call_function(_aten.mul.Tensor, (x, 2))])


def _in_place_coalesced_results_are_its_inputs(g):
    """`all_reduce_coalesced_([x, y])` returns its list: its waited getitems are x and y, written
    after by `y.add_`."""
    import operator

    x, y = g.placeholder("x"), g.placeholder("y")
    before = g.call_function(_aten.mul.Tensor, (y, 2))
    r = g.call_function(_c10d.all_reduce_coalesced_.default, ([x, y], "sum", "0"))
    a = g.call_function(_c10d.wait_tensor.default, (g.call_function(operator.getitem, (r, 0)),))
    b = g.call_function(_c10d.wait_tensor.default, (g.call_function(operator.getitem, (r, 1)),))
    g.call_function(_aten.add_.Tensor, (y, 1))
    _pad(g, [before, g.call_function(_aten.mul.Tensor, (a, 2)), g.call_function(_aten.mul.Tensor, (b, 3)),
             g.call_function(_aten.mul.Tensor, (y, 4))])


_COLLECTIVE_RESULTS = {f.__name__.strip("_"): f for f in (
    _all_to_all_result_read_by_name, _wait_result_written_launch_read, _launch_result_written_wait_read,
    _coalesced_result_taken_twice, _in_place_launch_result_read_twice,
    _in_place_coalesced_results_are_its_inputs)}  # the first reads rank data


def test_a_collective_whose_result_is_also_read_by_name_is_opaque_and_its_wait_is_its_result():
    """A launch read by name besides its wait is opaque; its wait (on no launch) returns the
    tensor it is given, and an in-place launch returns its buffer: both were fresh storage."""
    from fxsched.ir import Opaque

    from test_fronts_attack import _graph

    program = lower(_graph(_COLLECTIVE_RESULTS["wait_result_written_launch_read"]))
    assert isinstance(program.op("wait_tensor_default"), Opaque)
    assert program.op("wait_tensor_default").alias == "all_reduce_default"
    program = lower(_graph(_COLLECTIVE_RESULTS["in_place_launch_result_read_twice"]))
    assert isinstance(program.op("all_reduce__default"), Opaque) and program.op("all_reduce__default").alias == "x"


@pytest.mark.multirank
def test_collectives_whose_results_are_read_by_name_in_random_legal_orders_are_bitwise_on_two_ranks():
    """A functional collective's wait returns the tensor it waits on (same storage, though
    `wait_tensor`'s schema says fresh), and an in-place one (`all_reduce_`) returns its buffer. Where
    the launch's result is read by name besides its wait (dynamo-level and hand-built graphs; the
    launch is then opaque and the wait a wait on no launch), a write through one crossed a read of
    the other: of 20 random legal orders, 8 (all_to_all_single), 10 and 17 (all_reduce), 2
    (all_reduce_coalesced) and 14 (all_reduce_) computed other numbers. An in-place coalesced one
    (`all_reduce_coalesced_`, always opaque) returns its list, and its getitems were fresh storage
    (15 of 20). Every one now computes the input's numbers on 2 gloo ranks."""
    from fxsched.runtime import run_ranks

    from ranks import check_bitwise, run_all
    from test_fronts_attack import _graph
    from test_fronts_attack2 import _raised_in_random_orders

    jobs, keys, per_key = [], [], 21
    torch.manual_seed(0)
    feeds = [[torch.randn(4) + rank, torch.randn(4) - rank] for rank in range(2)]
    for key, build in _COLLECTIVE_RESULTS.items():
        gm = _graph(build)
        n = len(gm.graph.find_nodes(op="placeholder"))
        jobs += [(gm, [f[:n] for f in feeds])]
        jobs += [(raised, [f[:n] for f in feeds]) for _, raised in _raised_in_random_orders(lower(gm), per_key - 1)]
        keys.append(key)
    results = run_ranks(run_all, 2, args=(jobs,), timeout=600, group_name="0")
    check_bitwise(results, keys, "a legal order", per_key=per_key)


def _random_collective_graph(seed: int):
    """A random program of functional collectives (launched, waited later, in place or not), views,
    in-place writes and reads, free of races: nothing reads a buffer a collective still writes, or
    writes one a collective still reads or writes."""
    import operator
    import random

    from torch import fx

    c, A, W = _c10d, _aten, _c10d.wait_tensor.default
    rng = random.Random(seed)
    g = fx.Graph()
    pool = []  # (node, base id, numel)
    nbase = [0]
    def fresh(node, numel):
        nbase[0] += 1; pool.append((node, nbase[0], numel)); return pool[-1]
    for name in ("x", "y"):
        fresh(g.placeholder(name), 8)
    pending = []  # (launch node, bases it reads, bases it writes, result entry or None)
    outs = []
    def busy_w(): return {b for p in pending for b in p[2]}
    def busy_r(): return {b for p in pending for b in p[1]}
    for _ in range(rng.randint(8, 18)):
        k = rng.random()
        node, base, numel = pool[rng.randrange(len(pool))]
        if k < 0.3 and base not in busy_w():
            kind = rng.choice(["all_reduce", "all_reduce_", "all_gather", "broadcast_", "all_to_all", "reduce_scatter", "coalesced_", "coalesced", "gather_out"])
            if kind in ("coalesced_", "coalesced"):
                node2, base2, numel2 = pool[rng.randrange(len(pool))]
                if base2 == base or base2 in busy_w() or (kind == "coalesced_" and (base in busy_r() or base2 in busy_r())):
                    continue
                op = c.all_reduce_coalesced_.default if kind == "coalesced_" else c.all_reduce_coalesced.default
                r = g.call_function(op, ([node, node2], "sum", "0"))
                for i, (b, n) in enumerate(((base, numel), (base2, numel2))):
                    gi = g.call_function(operator.getitem, (r, i))
                    if kind == "coalesced":
                        nbase[0] += 1; b = nbase[0]
                    pending.append((gi, {base, base2}, {b} if kind == "coalesced" else {base, base2}, (gi, b, n)))
                continue
            if kind == "gather_out":
                buf = g.call_function(A.zeros.default, ([2 * numel],))
                nbase[0] += 1
                r = g.call_function(c.all_gather_into_tensor_out.default, (node, 2, "0"), {"out": buf})
                pending.append((r, {base}, {nbase[0]}, (r, nbase[0], 2 * numel)))
                continue
            if kind in ("all_reduce_", "broadcast_") and base in busy_r():
                continue
            if kind == "all_reduce":
                r = g.call_function(c.all_reduce.default, (node, "sum", "0")); res = (r, None, numel); writes = ()
            elif kind == "all_reduce_":
                r = g.call_function(c.all_reduce_.default, (node, "sum", "0")); res = (r, base, numel); writes = (base,)
            elif kind == "broadcast_":
                r = g.call_function(c.broadcast_.default, (node, 0, "0")); res = (r, base, numel); writes = (base,)
            elif kind == "all_gather":
                r = g.call_function(c.all_gather_into_tensor.default, (node, 2, "0")); res = (r, None, numel * 2); writes = ()
            elif kind == "all_to_all":
                if numel % 2: continue
                r = g.call_function(c.all_to_all_single.default, (node, [numel // 2] * 2, [numel // 2] * 2, "0")); res = (r, None, numel); writes = ()
            else:
                if numel % 2: continue
                r = g.call_function(c.reduce_scatter_tensor.default, (node, "sum", 2, "0")); res = (r, None, numel // 2); writes = ()
            if res[1] is None:
                nbase[0] += 1; res = (r, nbase[0], res[2])
            pending.append((r, {base}, set(writes) | {res[1]}, res))
        elif k < 0.5 and pending:
            r, reads, writes, (rn, rb, rnumel) = pending.pop(rng.randrange(len(pending)))
            w = g.call_function(W, (r,))
            pool.append((w, rb, rnumel))
            if rng.random() < 0.6:
                pool.append((rn, rb, rnumel))  # the launch's result read by name after its wait
        elif k < 0.6:
            if base in busy_w(): continue
            v = g.call_function(A.view.default, (node, [-1])) if rng.random() < 0.5 else g.call_function(A.slice.Tensor, (node, 0, 0, numel))
            pool.append((v, base, numel))
        elif k < 0.85:
            if base in busy_w() or base in busy_r(): continue
            g.call_function(rng.choice([A.add_.Tensor, A.mul_.Tensor]), (node, rng.choice([1.5, 2, -1])))
        else:
            if base in busy_w(): continue
            outs.append(g.call_function(A.mul.Tensor, (node, 3)))
    for r, _, _, (rn, rb, rnumel) in pending:
        pool.append((g.call_function(W, (r,)), rb, rnumel))
    for node, base, numel in pool[:2]:
        outs.append(g.call_function(A.mul.Tensor, (node, 1)))
    g.output(tuple(outs))
    return fx.GraphModule(torch.nn.Module(), g)


@pytest.mark.multirank
def test_random_programs_of_functional_collectives_in_random_legal_orders_are_bitwise_on_two_ranks():
    """60 random race-free programs of functional collectives (all_reduce, all_reduce_, broadcast_,
    all_gather, an `out=` all_gather, all_to_all_single, reduce_scatter, all_reduce_coalesced and
    its in-place form; each waited later, its result sometimes read by name too), views, in-place
    writes and reads: 15 random legal orders of each compute its numbers bitwise on 2 gloo ranks.
    On c6b72d3^'s lowering (before opaque waits and in-place launches returned what they are
    given) 13 of the 60 programs computed other numbers in some order; after that fix, 2 (an
    opaque `out=` gather's result aliased its buffer, so its wait on no launch no longer found the
    collective it completes, and a write of the gather's input moved between them)."""
    from fxsched.runtime import run_ranks

    from ranks import run_all
    from test_fronts_attack2 import _raised_in_random_orders

    per, programs = 16, 60
    torch.manual_seed(0)
    feeds = [[torch.randn(8) + rank, torch.randn(8) - rank] for rank in range(2)]
    jobs = []
    for seed in range(programs):
        gm = _random_collective_graph(seed)
        jobs += [(gm, feeds)] + [(raised, feeds) for _, raised in _raised_in_random_orders(lower(gm), per - 1, seed)]
    results = run_ranks(run_all, 2, args=(jobs,), timeout=900, group_name="0")
    wrong = {seed: [k for k in range(1, per) if any(
        not all(torch.equal(a, b) for a, b in zip(results[rank][per * seed], results[rank][per * seed + k], strict=True))
        for rank in range(2))] for seed in range(programs)}
    assert not any(wrong.values()), {seed: orders for seed, orders in wrong.items() if orders}


# --------------------------------------------------------------------------- FSDP2's custom ops


def test_fsdp2s_copy_in_writes_its_output_buffer_and_returns_views_of_it():
    """`fsdp::all_gather_copy_in(inputs, all_gather_output, ...)` (what torch.compile traces of
    fully_shard's all-gather) copies its inputs into all_gather_output and returns a narrow view of
    it and it, though its schema says neither: reads of the buffer crossed the copy and a later
    write of it crossed reads of the results (429 of 430 orders computed other numbers). FSDP2
    gives it a fresh `empty` buffer, which nothing else reads; a graph may not."""
    import operator

    import torch.distributed.fsdp._fully_shard._fsdp_collectives  # noqa: F401  registers fsdp::

    from test_fronts_attack import _graph

    def build(g):
        x, b = g.placeholder("x"), g.placeholder("b")
        before = g.call_function(_aten.mul.Tensor, (b, 2))
        r = g.call_function(torch.ops.fsdp.all_gather_copy_in.default, ([x], b, [4], 4, 1))
        mine, whole = (g.call_function(operator.getitem, (r, i)) for i in (0, 1))
        after = g.call_function(_aten.mul.Tensor, (b, 3))
        g.call_function(_aten.add_.Tensor, (b, 1))
        g.output((before, after, g.call_function(_aten.mul.Tensor, (mine, 5)),
                  g.call_function(_aten.mul.Tensor, (whole, 7)), g.call_function(torch.sin, (g.call_function(torch.ones, (3,)),))))

    gm = _graph(build)
    op = lower(gm).op("all_gather_copy_in_default")
    assert op.writes == ("b",) and op.alias == "b"
    assert_every_legal_order_computes_the_same(gm, [torch.randn(4), torch.randn(8)])


def test_inductors_reinterpret_and_pool_allocations_are_views():
    """`inductor::_reinterpret_tensor(x, size, stride)` and `inductor::_alloc_from_pool(x, offset,
    ...)` return views of x (a reinterpretation, a slice of a pool buffer) though their schemas say
    fresh: a write of x crossed reads of them (281 of 366 legal orders computed other numbers)."""
    import torch._inductor.lowering  # noqa: F401  registers inductor::

    from fxsched.ir import View

    from test_fronts_attack import _graph

    inductor = torch.ops.inductor

    def build(g):
        x = g.placeholder("x")
        v = g.call_function(inductor._reinterpret_tensor.default, (x, [2, 2], [2, 1], 0))
        p = g.call_function(inductor._alloc_from_pool.default, (x, 8, torch.float32, [2], [1]))
        g.call_function(_aten.add_.Tensor, (x, 1))
        g.output((g.call_function(_aten.mul.Tensor, (v, 2)), g.call_function(_aten.mul.Tensor, (p, 3)),
                  g.call_function(torch.sin, (g.call_function(torch.ones, (3,)),))))

    gm = _graph(build)
    program = lower(gm)
    assert isinstance(program.op("_reinterpret_tensor_default"), View)
    assert isinstance(program.op("_alloc_from_pool_default"), View)
    assert_every_legal_order_computes_the_same(gm, [torch.randn(4)])


# --------------------------------------------------------------------------- a user's triton kernel


class _StandInKernel:
    """A stand-in for a user's triton kernel, so that the wrappers run on CPU (they call
    `kernel[grid](**kwargs)`): adds the first of its pointer pair into the second, doubles
    `out_ptr`."""

    arg_names: list[str] = []

    def __getitem__(self, grid):
        def run(ptrs, out_ptr):
            ptrs[1].add_(ptrs[0])
            out_ptr.mul_(2)

        return run


def _triton_graph(functional: bool):
    import operator

    from torch import fx
    from torch._higher_order_ops.triton_kernel_wrap import (kernel_side_table, triton_kernel_wrapper_functional,
                                                             triton_kernel_wrapper_mutation)

    g = fx.Graph()
    x, y, o = g.placeholder("x"), g.placeholder("y"), g.placeholder("o")
    before = g.call_function(operator.mul, (y, 1))
    kwargs = dict(kernel_idx=kernel_side_table.add_kernel(_StandInKernel()),
                  constant_args_idx=kernel_side_table.add_constant_args({}), grid=[(1, 1, 1)],
                  tma_descriptor_metadata={}, kwargs={"ptrs": (x, y), "out_ptr": o})
    if functional:  # after Inductor's reinplacing: y, which the kernel writes, is no longer cloned
        kwargs["tensors_to_clone"] = ["out_ptr"]
    call = g.call_function(triton_kernel_wrapper_functional if functional else triton_kernel_wrapper_mutation, (), kwargs)
    outs = [before, g.call_function(operator.mul, (y, 3)), g.call_function(operator.mul, (o, 1)),
            g.call_function(torch.sin, (g.call_function(torch.ones, (3,)),))]
    if functional:
        outs.append(g.call_function(operator.getitem, (call, "out_ptr")))
    g.output(tuple(outs))
    return fx.GraphModule(torch.nn.Module(), g)


@pytest.mark.parametrize("functional", [False, True], ids=["mutation", "functional"])
def test_a_users_triton_kernel_writes_the_tensors_it_is_given_in_tuples_and_does_not_clone(functional):
    """`triton_kernel_wrapper_mutation` with a tuple of pointers in its kwargs (triton takes tuple
    arguments) wrote only the tensors given directly (177 of 210 legal orders computed other
    numbers); `triton_kernel_wrapper_functional` writes the tensors it does not clone that its
    kernel stores to (after Inductor's reinplacing, `tensors_to_clone` lists fewer than the kernel
    writes) and was pure (367 of 430). Each now writes every tensor of its kwargs, in tuples too, a
    functional one those it does not clone."""
    gm = _triton_graph(functional)
    name = "triton_kernel_wrapper_functional" if functional else "triton_kernel_wrapper_mutation"
    assert set(lower(gm).op(name).writes) == ({"x", "y"} if functional else {"x", "y", "o"})
    assert_every_legal_order_computes_the_same(gm, [torch.ones(2), torch.ones(2), torch.ones(2)])


# --------------------------------------------------------------------------- torch.compile's functional graphs (nothing found)


@torch.library.custom_op("fxsched_attack3::scale_", mutates_args=("x",))
def _scale_(x: torch.Tensor, s: float) -> None:
    x.mul_(s)


@torch.library.custom_op("fxsched_attack3::bump", mutates_args=())
def _bump(x: torch.Tensor) -> torch.Tensor:
    """Effectful (registered ORDERED below): adds into a tensor no graph names."""
    _BUMPED.add_(x)
    return _BUMPED.clone()


_BUMPED = torch.zeros(4)


@_bump.register_fake
def _(x):
    return torch.empty_like(x)


_bump.register_effect(__import__("torch._library.effects", fromlist=["EffectType"]).EffectType.ORDERED)


class _Compiled(torch.nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.register_buffer("buf", torch.arange(8.0))

    def forward(self, x, y):
        a = x * 2
        if self.kind == "auto_functionalized_v2 of an input":
            _scale_(x, 3.0)
        elif self.kind == "auto_functionalized_v2 of a view of an input":
            _scale_(x[1:3], 3.0)
        elif self.kind == "auto_functionalized_v2 of a buffer":
            _scale_(self.buf[2:6], 5.0)
        elif self.kind == "with_effects":
            a = a + _bump(x[:4]).sum() + _bump(y[:4] * 2).sum()
            y.add_(1)
            a = a + _bump(y[:4]).sum()
        elif self.kind == "invoke_subgraph":
            a = _region(_region(a, y), y)
        return a, x * 3, y + self.buf, torch.sin(torch.ones(3))


@torch.compiler.nested_compile_region
def _region(x, y):
    return torch.tanh(x * y) + x


@pytest.mark.parametrize("kind", ["auto_functionalized_v2 of an input", "auto_functionalized_v2 of a view of an input",
                                  "auto_functionalized_v2 of a buffer", "with_effects", "invoke_subgraph"])
def test_torch_compiles_graphs_of_mutating_effectful_and_nested_calls_keep_their_numbers(kind, monkeypatch):
    """The graph AOTAutograd hands a backend (what fxsched's Inductor pass reads) for a custom op
    that mutates an input, a view of one or a buffer (`auto_functionalized_v2` with `_all_bases`,
    and the `copy_` of the input mutation at the end), an effectful op (`with_effects` and its
    tokens) and `nested_compile_region` (`invoke_subgraph`): random legal orders compute the
    graph's numbers (nothing found: these pin it)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    import test_fronts_attack2

    run = test_fronts_attack2._run

    def run_from_zero(gm, inputs):  # each run's effects start from the same state
        _BUMPED.zero_()
        return run(gm, inputs)

    monkeypatch.setattr(test_fronts_attack2, "_run", run_from_zero)

    captured = []

    def capture(gm, inputs):
        captured.append(gm)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    compiled = torch.compile(_Compiled(kind), fullgraph=True,
                             backend=aot_autograd(fw_compiler=capture, keep_inference_input_mutations=True))
    with torch.no_grad():
        compiled(torch.randn(8), torch.randn(8))
    (gm,) = captured
    targets = {str(n.target) for n in gm.graph.nodes}
    assert kind.split(" ")[0] in " ".join(targets)
    inputs = [torch.randn(tuple(n.meta["val"].shape)) for n in gm.graph.find_nodes(op="placeholder")]
    test_fronts_attack2.assert_random_legal_orders_compute_the_same(gm, inputs, count=30)


# --------------------------------------------------------------------------- torchtitan's graphs (nothing found)


def _titan_orders_worker(rank, world_size, count, bucketed):
    """On one rank: llama3's debug model traced by torchtitan's graph trainer (SimpleFSDP,
    rematerialised; `bucketed`: then torchtitan's own bucketing and reordering), its step run in
    the traced order and in `count` seeded random legal orders of its lowered program (the same
    orders on every rank); the indices of the orders that computed other numbers."""
    import os
    import sys

    from torch.distributed.device_mesh import init_device_mesh

    from fxsched.ir.program import Schedule
    from fxsched.raising import raise_program

    from test_fronts_attack import _random_orders

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    from titan import build_llama3, joint_bucketing, rematerialise, run_step, trace_step

    torch.set_num_threads(1)
    if bucketed:  # torchtitan's pass asks triton's GPU driver for the device's numbers: give it a profile's
        from fxsched.cost import Roofline, hardware

        from peers import setup_inductor

        hw = Roofline(hardware("h100")).hw
        setup_inductor(hw.hbm_gbps, hw.tflops("f32"))
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
    model, inputs = build_llama3(mesh, layers=2)
    traced = rematerialise(trace_step(model, inputs))
    if bucketed:
        traced = joint_bucketing(traced, 2, reorder=True)
    plain = run_step(traced, model, inputs)
    program = lower(traced.gm)
    wrong = []
    for k, order in enumerate(_random_orders(program, count, 0)):
        program.schedule = Schedule(order)
        traced.gm = raise_program(program)
        if not all(torch.equal(a, b) for a, b in zip(plain, run_step(traced, model, inputs), strict=True)):
            wrong.append(k)
    return {"wrong": wrong, "ops": len(program.graph), "loss": plain[0]}


@pytest.mark.multirank
@pytest.mark.parametrize("bucketed", [False, True], ids=["rematerialised", "torchtitan-bucketed"])
def test_torchtitans_llama3_step_in_random_legal_orders_is_bitwise_on_two_ranks(bucketed):
    """torchtitan's graph trainer's joint step of llama3 (SimpleFSDP's gathers and reduce-scatters,
    backward re-gathers; then torchtitan's own buckets: `all_gather_into_tensor_out` into packed
    buffers and their copy-outs) in 30 random legal orders of the lowered program computes the
    traced step's loss and gradients bitwise on 2 gloo ranks (nothing found: this pins it)."""
    pytest.importorskip("torchtitan.experiments.graph_trainer")
    from fxsched.runtime import run_ranks

    results = run_ranks(_titan_orders_worker, 2, args=(30, bucketed), timeout=900)
    for rank, r in enumerate(results):
        assert r["wrong"] == [], f"rank {rank}: random legal orders {r['wrong']} computed other numbers"
        assert r["ops"] > 700
    assert results[0]["loss"].item() != 0.0
