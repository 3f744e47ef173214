"""The result of a call fxsched cannot see into (`Op.may_alias`, ir/storage.py): a Python function
of no known module (one `torch.fx.wrap`'d under symbolic_trace, or called from a hand-built
graph), with no `meta["val"]` saying whether its result shares storage, may return one of its
tensors or a view of one. Each access of its result counts as an access of each of their storages
too (a write through it writes them), and one after a free of theirs is a note, not a use after
free (it may be fresh storage).

Each case runs every legal order (tests/test_fronts_attack.py's check) of the lowered graph,
raised back to FX, against the input graph bitwise: before `may_alias` the result was fresh
storage, and the orders that moved a read of it across `x.add_` (or a read of x across a write
through it) computed other numbers (`test_the_orders_that_break_without_may_alias`).
"""

from __future__ import annotations

import operator

import networkx as nx
import pytest
import torch
from torch import fx, nn
from torch.fx.experimental.proxy_tensor import make_fx

import fxsched
from fxsched.ir import (Barrier, ParseError, VerifyError, maybe_storages, parse_program, print_program,
                        storage_candidates, verify)
from fxsched.ir.rewriter import Rewriter
from fxsched.lowering import lower

from test_fronts_attack import _graph, _run, assert_every_legal_order_computes_the_same
from test_fronts_attack2 import (_invoke, _raised_in_random_orders, assert_bitwise_on_two_ranks,
                                 assert_random_legal_orders_compute_the_same)


# --------------------------------------------------------------------------- the calls


@torch.fx.wrap
def returns_first(a, b):
    """Returns its first input itself."""
    return a


@torch.fx.wrap
def views_second(a, b):
    """Returns a view of its second input."""
    return b.view(-1)


@torch.fx.wrap
def fresh(a, b):
    """Returns fresh storage."""
    return a * 2 + b


CALLS = {"input": returns_first, "view of the second": views_second, "fresh": fresh}


def _body(r, x, y):
    """Reads of the result around an in-place write of each input, a write through the result,
    and reads of the inputs after it: any of them may cross another unless the result counts as
    x's and y's storage too."""
    a = r * 3
    x.add_(1)
    b = r * 5
    y.mul_(2)
    c = r - 1
    r.add_(7)
    return a, b, c, x * 1, y * 1, r * 1


class _Traced(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, x, y):
        # each wrapped function by its global name (fx.wrap patches the name, not the function)
        if self.kind == "input":
            r = returns_first(x, y)
        elif self.kind == "view of the second":
            r = views_second(x, y)
        else:
            r = fresh(x, y)
        return _body(r, x, y)


def _hand_built(function) -> fx.GraphModule:
    def build(g):
        x, y = g.placeholder("x"), g.placeholder("y")
        r = g.call_function(function, (x, y))
        a = g.call_function(operator.mul, (r, 3))
        g.call_method("add_", (x, 1))
        b = g.call_function(operator.mul, (r, 5))
        g.call_method("mul_", (y, 2))
        c = g.call_function(operator.sub, (r, 1))
        g.call_method("add_", (r, 7))
        g.output((a, b, c, g.call_function(operator.mul, (x, 1)), g.call_function(operator.mul, (y, 1)),
                  g.call_function(operator.mul, (r, 1))))

    return _graph(build)


def _graphs():
    for kind, function in CALLS.items():
        yield pytest.param(lambda kind=kind: fx.symbolic_trace(_Traced(kind)), id=f"symbolic_trace-{kind}")
        yield pytest.param(lambda function=function: _hand_built(function), id=f"hand-built-{kind}")


def _inputs():
    torch.manual_seed(1)
    return [torch.randn(4), torch.randn(4)]


def _call(program):
    """The call fxsched cannot see into."""
    (op,) = [op for op in program.ops() if getattr(op, "target", "").rsplit(".", 1)[-1]
             in ("returns_first", "views_second", "fresh")]
    return op


@pytest.mark.parametrize("make", list(_graphs()))
def test_every_legal_order_of_a_call_that_may_return_its_input_computes_the_same(make):
    """Returns (a) its input, (b) a view of its second input, (c) fresh storage: the call writes
    both (it may), its result may be either's storage, and every legal order computes the input
    graph's numbers bitwise."""
    gm = make()
    program = lower(gm)
    call = _call(program)
    assert call.writes == ("x", "y") and call.may_alias == ("x", "y") and call.alias is None
    assert any("cannot see into" in n and "may_alias" in n for n in program.notes)
    assert assert_every_legal_order_computes_the_same(gm, _inputs()) > 31
    assert_random_legal_orders_compute_the_same(gm, _inputs(), count=40, seed=3)


def test_the_orders_that_break_without_may_alias():
    """The same graphs with the field cleared (what lowering gave before: fresh storage): some
    legal orders compute other numbers, for the input and the view of it; none for the fresh one.
    So the check above can fail."""
    import attrs
    from fxsched.ir.effects import derive_effects
    from fxsched.ir.program import Program, Schedule

    wrong = {}
    for kind in CALLS:
        gm = fx.symbolic_trace(_Traced(kind))
        lowered = lower(gm)
        program = Program(origin=gm)
        ops = [lowered.op(n) for n in lowered.schedule.names() if not n.startswith("^")]
        program.add_all([attrs.evolve(op, may_alias=()) for op in ops])
        program.payload.update(lowered.payload)
        program.schedule = Schedule([op.name for op in ops])
        derive_effects(program)
        expected = _run(gm, _inputs())
        wrong[kind] = sum(not all(torch.equal(a, b) for a, b in zip(expected, _run(raised, _inputs())))
                          for _, raised in _raised_in_random_orders(program, 40, 3))
    assert wrong["input"] > 0 and wrong["view of the second"] > 0 and wrong["fresh"] == 0, wrong


# --------------------------------------------------------------------------- where evidence exists


def _with_vals(result_shares: bool) -> fx.GraphModule:
    """The hand-built graph with FakeTensor vals: the call's val a view of y's, or fresh."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    gm = _hand_built(views_second if result_shares else fresh)
    mode = FakeTensorMode()
    with mode:
        x, y = mode.from_tensor(torch.randn(4)), mode.from_tensor(torch.randn(4))
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                node.meta["val"] = x if node.name == "x" else y
            elif node.op == "call_function" and node.target in (views_second, fresh):
                node.meta["val"] = y.view(-1) if result_shares else torch.empty(4)
    return gm


def test_a_val_that_shows_shared_storage_is_an_alias_and_fresh_storage_is_fresh():
    """Where `meta["val"]` says, it decides as before: a view of y's storage aliases y; fresh
    storage is fresh (no may_alias)."""
    shared = _call(lower(_with_vals(True)))
    assert shared.alias == "y" and shared.may_alias == ()
    own = _call(lower(_with_vals(False)))
    assert own.alias is None and own.may_alias == ()
    assert_every_legal_order_computes_the_same(_with_vals(True), _inputs())


def test_calls_fxsched_sees_into_are_unchanged():
    """aten ops, known torch functions and modules, and a GraphModule called as a module keep
    their answers: no may_alias anywhere."""
    def f(x, y):
        r = torch.relu(x) + y
        x.add_(1)
        return r.view(-1) * 2, torch.ops.aten.mm.default(x.view(2, 2), y.view(2, 2))

    for gm in (make_fx(f)(torch.randn(4), torch.randn(4)), fx.symbolic_trace(f)):
        assert not any(op.may_alias for op in lower(gm).ops())
    inner = fx.symbolic_trace(lambda a: a.view(-1))
    root = nn.Module()
    root.inner = inner

    def build(g):
        x = g.placeholder("x")
        r = g.call_module("inner", (x,))
        g.call_method("add_", (x, 1))
        g.output((g.call_function(operator.mul, (r, 2)),))

    program = lower(_graph(build, root))
    assert program.op("inner").alias == "x" and program.op("inner").may_alias == ()


def test_a_module_fxsched_does_not_know_may_return_its_input():
    """A leaf module not from torch.nn (no state, no val): as a Python function of no known module."""
    class Passthrough(nn.Module):
        def forward(self, a, b):
            return b

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Passthrough()

        def forward(self, x, y):
            return _body(self.inner(x, y), x, y)

    class Tracer(fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return isinstance(m, Passthrough) or super().is_leaf_module(m, qualname)

    model = Model()
    gm = fx.GraphModule(model, Tracer().trace(model))
    assert lower(gm).op("inner").may_alias == ("x", "y")
    assert_every_legal_order_computes_the_same(gm, _inputs())


def test_a_side_effectful_call_that_returns_its_input_is_a_barrier_that_may_alias():
    """A call torch.fx takes for side-effectful is a barrier; its result's later reads are after it,
    but not ordered with a later write of x without may_alias (a barrier orders only across it)."""
    def build(g):
        x, y = g.placeholder("x"), g.placeholder("y")
        r = g.call_function(_noisy_identity, (x, y))
        g.call_method("add_", (x, 1))
        g.output((g.call_function(operator.mul, (r, 2)), g.call_function(operator.mul, (x, 1))))

    gm = _graph(build)
    op = lower(gm).op("_noisy_identity")
    assert isinstance(op, Barrier) and op.may_alias == ("x", "y")
    assert_every_legal_order_computes_the_same(gm, _inputs())


def _noisy_identity(a, b):
    return a


fx.node._side_effectful_functions.add(_noisy_identity)


def test_a_subgraph_returning_a_call_that_may_return_its_input_aliases_that_input():
    """A higher-order op whose subgraph returns such a call's result on its one input: the op's
    result may be that input (`returned_inputs` reads may_alias), so it aliases it."""

    def body(g):
        a = g.placeholder("a")
        g.output((g.call_function(returns_first, (a, a)),))

    gm = _invoke(_graph(body))
    assert lower(gm).op("invoke_subgraph").alias == "x"
    assert_every_legal_order_computes_the_same(gm, [torch.randn(4)])


# --------------------------------------------------------------------------- the IR


TEXT = """\
%x = input
%y = input
^entry
%r = compute "mystery"(%x, %y) {writes = [%x, %y], may_alias = [%x, %y]} : f32[4]
%v = view "aten.view"(%r) : f32[4]
%s = compute "mystery2"(%v) {writes = [%v], may_alias = [%v]} : f32[4]
%a = compute "aten.neg"(%s) : f32[4]
%w = compute "aten.add_.Tensor"(%x) {writes = [%x], alias = %x} : f32[4]
%b = compute "aten.neg"(%s) : f32[4]
%t = compute "aten.add_.Tensor"(%s) {writes = [%s], alias = %s} : f32[4]
%c = compute "aten.neg"(%y) : f32[4]
%output = output(%a, %b, %c, %t)
"""


def test_may_alias_prints_parses_and_orders_through_views_and_chains():
    """The field prints and parses back; a result of a call on a view of such a result may be
    each of the storages the first may be (`maybe_storages`, `storage_candidates`); a read of it
    keeps its order with a write of x, and a write through it with a read of y."""
    program = parse_program(TEXT)
    verify(program)
    assert print_program(program) == TEXT
    assert maybe_storages(program) == {"r": ("x", "y"), "s": ("r", "x", "y")}
    assert storage_candidates(program, "s") == ("s", "r", "x", "y")
    assert storage_candidates(program, "v") == ("r", "x", "y")
    assert storage_candidates(program, "w") == ("x",)
    edges = {(u, v) for u, v, _ in program.effect_edges()}
    assert {("a", "w"), ("w", "b"), ("t", "c")} <= edges


def test_an_access_after_a_candidates_free_is_a_note_not_a_use_after_free():
    """A read, or a write, of a result that may be x after x's free: it may be fresh storage (a
    note); a read of x itself there is still an error. A read before the free stays before it."""
    program = parse_program("""\
%x = input
^entry
%r = compute "mystery"(%x) {writes = [%x], may_alias = [%x]}
%early = compute "aten.neg"(%r)
%f = free "free"(%x) {params = ["p"]}
%late = compute "aten.neg"(%r)
%w = compute "aten.add_.Tensor"(%r) {writes = [%r], alias = %r}
%output = output(%early, %late, %w)
""")
    verify(program)
    assert ("early", "f") in {(u, v) for u, v, _ in program.effect_edges()}
    assert ("f", "late") not in {(u, v) for u, v, _ in program.effect_edges()}
    notes = [n for n in program.notes if "freed before it" in n]
    assert any(n.startswith("%late reads %r") for n in notes) and any(n.startswith("%w writes %r") for n in notes)
    with pytest.raises(ParseError, match="%late reads storage that %f freed before it"):
        parse_program("%x = input\n^entry\n%f = free \"free\"(%x) {params = [\"p\"]}\n"
                      "%late = compute \"aten.neg\"(%x)\n%output = output(%late)\n")


def test_a_free_of_a_result_that_may_be_x_is_a_write_of_x_not_its_free():
    """Freeing the result orders it after x's earlier readers and before x's later accesses,
    and a later read of x is no use after free."""
    program = parse_program("""\
%x = input
^entry
%r = compute "mystery"(%x) {writes = [%x], may_alias = [%x]}
%a = compute "aten.neg"(%x)
%f = free "free"(%r) {params = ["p"]}
%b = compute "aten.neg"(%x)
%output = output(%a, %b)
""")
    verify(program)
    edges = {(u, v) for u, v, _ in program.effect_edges()}
    assert {("a", "f"), ("f", "b")} <= edges


@pytest.mark.parametrize("text, message", [
    ('%r = compute "m"(%x) {may_alias = [%y]}', r"%r: may_alias \['y'\], which are not all operands \['x'\]"),
    ('%r = compute "m"(%x) {alias = %x, may_alias = [%x]}', "may_alias with alias"),
    ('%r = view "aten.view"(%x) {may_alias = [%x]}', "may_alias with a view"),
])
def test_verify_checks_may_alias(text, message):
    with pytest.raises(VerifyError, match=message):
        verify(parse_program(f"%x = input\n%y = input\n^entry\n{text}\n%output = output(%r)\n"))


def test_may_alias_naming_an_undefined_node_is_a_parse_error():
    with pytest.raises(ParseError, match="line 3, column .*: %nope is not defined"):
        parse_program('%x = input\n^entry\n%r = compute "m"(%x) {may_alias = [%nope]}\n%output = output(%r)\n')


def test_replace_uses_substitutes_may_alias_and_orders_through_it():
    """The rewriter's operand substitution rewrites may_alias as it does writes and alias; the
    users' new accesses are ordered as ir/storage.py would: reads of the result, which may now
    be z's storage, keep their order with a later write of z."""
    program = parse_program("""\
%x = input
%z = input
^entry
%r = compute "mystery"(%x) {may_alias = [%x]}
%a = compute "aten.neg"(%r)
%w = compute "aten.add_.Tensor"(%z) {writes = [%z], alias = %z}
%output = output(%a, %w)
""")
    Rewriter(program).replace_uses("x", "z", only={"r"})
    assert program.op("r").may_alias == ("z",) and program.op("r").operands == ("z",)
    verify(program)
    assert ("a", "w") in {(u, v) for u, v, _ in program.effect_edges()}
    assert ("a", "w") in {(u, v) for u, v, _ in parse_program(print_program(program)).effect_edges()}


# --------------------------------------------------------------------------- FSDP


def _scale(w):
    """A Python function fxsched cannot see into, applied to a gathered parameter: fresh storage."""
    return w * 0.5 + 1


PIPELINES = ("reference", "default", "rewrite", "default,unshard", "default,bucket")


def _fsdp_graph() -> fx.GraphModule:
    """Two gathered parameters; the first goes through `_scale` (fresh), its gathered buffer is
    freed, and the scaled copy is read after the free."""
    from fxsched.front import fsdp_free_storage
    c10d = torch.ops._c10d_functional
    aten = torch.ops.aten

    def build(g):
        x, s0, s1 = g.placeholder("x"), g.placeholder("s0"), g.placeholder("s1")
        waits = []
        for s, param in ((s0, "p0"), (s1, "p1")):
            ag = g.call_function(c10d.all_gather_into_tensor.default, (s, 2, "0"))
            ag.meta.update(comm_type="fsdp_all_gather", param_name=param, fsdp_unsharded_nbytes=64)
            waits.append(g.call_function(c10d.wait_tensor.default, (ag,)))
        w0 = g.call_function(aten.view.default, (waits[0], [4, 4]))
        scaled = g.call_function(_scale, (w0,))
        h = g.call_function(aten.mm.default, (x, w0))
        free = g.call_function(fsdp_free_storage, (waits[0],))
        free.meta.update(comm_type="fsdp_reshard_free", param_name="p0")
        w1 = g.call_function(aten.view.default, (waits[1], [4, 4]))
        h = g.call_function(aten.mm.default, (h, w1))
        g.output((g.call_function(aten.mm.default, (h, scaled)),))

    return _graph(build)


def test_a_call_on_a_gathered_buffer_read_after_its_free_is_a_note():
    """The result may be the gathered buffer's storage: reads of it before the free stay before
    it, and the read after it is a note (it may be fresh), not a use after free."""
    program = lower(_fsdp_graph())
    assert program.op("_scale").may_alias == ("view_default",)
    assert "%mm_default_2 reads %_scale, which may alias storage %fsdp_free_storage freed before it: taken for " \
           "fresh storage (no order kept with the free)" in program.notes
    assert nx.has_path(program.graph, "_scale", "fsdp_free_storage")  # it writes the buffer: before the free
    for pipeline in PIPELINES:
        fxsched.schedule(_fsdp_graph(), pipeline)


@pytest.mark.multirank
def test_a_call_on_a_gathered_buffer_runs_bitwise_on_two_ranks():
    """The schedules (`PIPELINES`) and random legal orders of the FSDP-shaped graph compute
    its numbers on 2 gloo ranks."""
    torch.manual_seed(0)
    feeds = [[torch.randn(4, 4) + rank, torch.randn(8) - rank, torch.randn(8) + 2 * rank] for rank in range(2)]
    assert_bitwise_on_two_ranks(_fsdp_graph, feeds, 6, PIPELINES, key="fsdp graph")


UNSHARD = """\
%x = input : f32[64,64]
%w = input : f32[2048]
^entry
%ag = launch "_c10d_functional.all_gather_into_tensor.default"(%w) {group = "0", group_size = 2, role = fsdp_all_gather, nbytes = 16384, params = ["w"]} : f32[4096]
%t = wait "_c10d_functional.wait_tensor.default"(%ag) : f32[4096]
%v = view "aten.view.default"(%t) : f32[64,64]
%y = compute "aten.mm.default"(%x, %v) {heavy} : f32[64,64]
%r = compute "mystery"(%v) {may_alias = [%v]} : f32[64,64]
%rw = compute "aten.add_.Tensor"(%r, %y) {writes = [%r], alias = %r} : f32[64,64]
%f = free "fsdp_free_storage"(%t) {params = ["w"]}
%z = compute "aten.relu.default"(%rw) : f32[64,64]
^backward
%big = compute "aten.ones.default"() : f32[256,256]
%s = compute "aten.sum.default"(%big) : f32[]
%rag = launch "_c10d_functional.all_gather_into_tensor.default"(%w) {group = "0", group_size = 2, role = fsdp_all_gather_backward, nbytes = 16384, params = ["w"]} : f32[4096]
%rt = wait "_c10d_functional.wait_tensor.default"(%rag) : f32[4096]
%rv = view "aten.view.default"(%rt) : f32[64,64]
%g = compute "aten.addmm.default"(%s, %z, %rv) {heavy} : f32[64,64]
%rf = free "fsdp_free_storage"(%rt) {params = ["w"]}
%output = output(%g)
"""


def test_unshard_keeps_the_regather_of_a_replica_written_through_a_result_that_may_be_it():
    """A write through a result that may be the forward replica may change it: the backward must
    re-gather (`replica written`), not read the replica (tests/filecheck/passes/unshard.fxir
    unshards the same program without the call)."""
    from fxsched.passes import PassManager

    program = parse_program(UNSHARD)
    PassManager("unshard{max-peak-increase-gb=0.0001}").run(program)
    assert program.op("rag").hold == "replica written"
    plain = parse_program(UNSHARD.replace(" {may_alias = [%v]}", ""))
    PassManager("unshard{max-peak-increase-gb=0.0001}").run(plain)
    assert "rag" not in plain.graph  # without may_alias it unshards: the check above can fail


def _chain(links: int) -> fx.GraphModule:
    """h = f(h, w_i) for `links` calls fxsched cannot see into (returning h, or w_i, in turn: a
    wrapped layer function through a deep model), with in-place writes of the inputs and of h
    between them and reads of each result."""
    def build(g):
        x = g.placeholder("x")
        ws = [g.placeholder(f"w{i}") for i in range(links)]
        h, outs = x, []
        for i, w in enumerate(ws):
            h = g.call_function(returns_first if i % 2 else views_second, (h, w))
            outs.append(g.call_function(operator.mul, (h, i + 1)))
            if i % 5 == 1:
                g.call_method("add_", (ws[i - 1], 1))
            if i % 7 == 3:
                g.call_method("mul_", (h, 2))
        g.call_method("add_", (x, 3))
        g.output((*outs, g.call_function(operator.mul, (x, 1)), *(g.call_function(operator.neg, (w,)) for w in ws)))

    return _graph(build)


@pytest.mark.parametrize("links", [12, 40])
def test_a_chain_of_such_calls_keeps_its_numbers_and_stays_linear(links):
    """12 links: each result may be every storage before it (exact); 40: past `MAYBE_LIMIT` the
    linked storages are merged into one (each access costs one storage, not the chain's length).
    Either way random legal orders compute the input's numbers."""
    from fxsched.ir import storage

    torch.manual_seed(2)
    inputs = [torch.randn(4) for _ in range(links + 1)]
    gm = _chain(links)
    direct = [(k, [k - 1, 1000 + k]) for k in range(1, links + 1)]
    also, merged = storage._maybe_links(direct)
    if links * 2 + 1 > storage.MAYBE_LIMIT + 1:
        assert not also and len(set(merged.values())) == 1 and len(merged) == 2 * links
    else:
        assert not merged and len(also[links]) == 2 * links
    assert_random_legal_orders_compute_the_same(gm, inputs, count=40, seed=5)


def test_a_forward_reference_to_a_result_that_may_alias_parses_and_verify_names_it():
    """Hand-written text may refer forward (the roots then come from `storage_roots`): the
    may_alias links are found there too (%v, a read of what may be x, precedes %r's write of x),
    and verify names the cycle that makes with the data edge."""
    with pytest.raises(VerifyError, match=r"cycle: %r -> %v -> %r"):
        verify(parse_program('%x = input\n^entry\n%v = view "aten.view"(%r)\n'
                             '%r = compute "m"(%x) {writes = [%x], may_alias = [%x]}\n'
                             '%w = compute "aten.add_.Tensor"(%x) {writes = [%x], alias = %x}\n'
                             '%a = compute "aten.neg"(%v)\n%output = output(%a, %w)\n'))
