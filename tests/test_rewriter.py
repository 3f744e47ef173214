"""The rewriter (ir/rewriter.py): create, replace uses and erase keep the program verified."""

from __future__ import annotations

import pytest

from fxsched.ir import EFFECT, Barrier, Compute, Phase, Wait, parse_program, verify
from fxsched.ir.rewriter import Rewriter, RewriteError

TEXT = """
%x = input
%w = input
^entry
%ag = launch "ag"(%w) {role = fsdp_all_gather, nbytes = 4, params = ["w"]}
%t = wait(%ag)
%v = view "aten.view"(%t)
%y = compute "aten.mm"(%x, %v)
%f = free "free"(%t) {params = ["w"]}
%z = compute "aten.neg"(%y)
^backward
%rag = launch "ag"(%w) {role = fsdp_all_gather_backward, nbytes = 4, params = ["w"]}
%rt = wait(%rag)
%g = compute "aten.mm"(%z, %rt)
%rf = free "free"(%rt) {params = ["w"]}
%output = output(%g)
"""


def test_erase_keeps_what_the_erased_op_ordered():
    program = parse_program(TEXT)
    Rewriter(program).erase("f")
    verify(program)
    # the free ordered %y (a reader of %t) before the re-gather: it still does, by an effect edge
    assert program.graph.has_edge("y", "rag") and program.graph.edges["y", "rag"]["kind"] == EFFECT
    assert "f" not in program.schedule and "f" not in program.graph


def test_erase_refuses_an_op_still_read():
    program = parse_program(TEXT)
    with pytest.raises(RewriteError, match="still read by %g"):
        Rewriter(program).erase("rt")


def test_replace_uses_moves_reads_and_frees_to_the_new_value():
    program = parse_program(TEXT)
    rewriter = Rewriter(program)
    with pytest.raises(RewriteError, match="%g would read storage that %f frees before it"):
        rewriter.replace_uses("rt", "t")
    verify(program)  # the refused rewrite left the program as it was
    assert program.op("g").operands == ("z", "rt")
    rewriter.erase("f")
    assert rewriter.replace_uses("rt", "t") == ["g", "rf"]
    assert program.op("g").operands == ("z", "t") and program.op("rf").operands == ("t",)
    # the backward free now frees %t: every reader of %t's storage is ordered before it
    for reader in ("v", "y", "g"):
        assert program.graph.has_edge(reader, "rf")
    for name in ("rt", "rag"):
        rewriter.erase(name)
    verify(program)
    assert rewriter.erased == 3 and rewriter.replaced == 2


def test_replace_uses_refuses_a_value_defined_after_its_new_user():
    program = parse_program(TEXT)
    with pytest.raises(RewriteError, match="not scheduled before its new user %y"):
        Rewriter(program).replace_uses("v", "rt")


def test_create_places_the_op_before_the_given_node():
    program = parse_program(TEXT)
    Rewriter(program).create(Compute(name="n", operands=("y",), target="aten.neg"), before="z")
    verify(program)
    assert program.schedule.index("n") == program.schedule.index("z") - 1
    with pytest.raises(RewriteError, match="operand %z is not scheduled before %y"):
        Rewriter(program).create(Compute(name="m", operands=("z",), target="aten.neg"), before="y")


def test_create_orders_a_new_read_before_the_storage_free_and_refuses_one_after():
    program = parse_program(TEXT)
    rewriter = Rewriter(program)
    rewriter.create(Compute(name="n", operands=("t",), target="aten.neg"), before="y")
    assert program.graph.has_edge("n", "f") and program.graph.edges["n", "f"]["why"] == "free"
    with pytest.raises(RewriteError, match="%m would read storage that %f frees before it"):
        rewriter.create(Compute(name="m", operands=("v",), target="aten.neg"), before="z")
    assert "m" not in program.graph and "m" not in program.schedule  # the refused op is gone again
    verify(program)


def test_inherit_takes_over_effect_edges_and_refuses_to_cross_one():
    program = parse_program(TEXT)
    rewriter = Rewriter(program)
    # a second gather of w in the backward, made just before the re-gather: it follows the forward free
    rewriter.create(Compute(name="early", operands=("w",), target="aten.neg", phase=Phase.BACKWARD), before="rag")
    rewriter.inherit("rag", "early")
    assert program.graph.edges["f", "early"]["why"] == "regather"
    verify(program)
    # placed before the free, it would cross the regather edge: refused, nothing added
    rewriter.create(Compute(name="late", operands=("w",), target="aten.neg"), before="f")
    edges = program.size()[1]
    with pytest.raises(RewriteError, match="%late would run before %f, which %rag follows \\(regather\\)"):
        rewriter.inherit("rag", "late")
    assert program.size()[1] == edges


def test_hoist_moves_an_op_earlier_but_not_before_its_predecessors():
    program = parse_program(TEXT)
    rewriter = Rewriter(program)
    rewriter.hoist("z", before="f")
    assert program.schedule.index("z") == program.schedule.index("f") - 1
    verify(program)
    with pytest.raises(RewriteError, match="hoist\\(%rag\\) before %y: it follows %f \\(regather\\)"):
        rewriter.hoist("rag", before="y")


RS_TEXT = """
%x = input
^entry
%y = compute "aten.neg"(%x)
^backward
%g = compute "aten.mm"(%y, %y)
%h = compute "aten.neg"(%g)
%rs = launch "rs"(%g) {role = fsdp_reduce_scatter, nbytes = 4}
%c = compute "aten.neg"(%y)
%rw = wait(%rs)
%f = free "free"(%g)
%output = output(%rw, %c)
"""


def test_create_orders_a_new_wait_before_a_later_write_of_its_collectives_input():
    # a collective reads its input until its wait (ir/effects.py): a wait made for it is such a
    # read, so the free after it stays after it, and a wait made after the free is refused
    program = parse_program(RS_TEXT)
    rewriter = Rewriter(program)
    with pytest.raises(RewriteError, match="%w3 would read storage that %f frees before it"):
        rewriter.create(Wait(name="w3", operands=("rs",), target="wait", phase=Phase.BACKWARD), before="output")
    rewriter.create(Wait(name="w2", operands=("rs",), target="wait", phase=Phase.BACKWARD), before="f")
    assert program.graph.edges["w2", "f"]["why"] == "free"
    rewriter.replace_uses("rw", "w2")
    rewriter.erase("rw")
    verify(program)


def test_replace_uses_orders_a_launchs_wait_before_a_free_of_its_new_input():
    # %h's storage is freed by %hf after %rw: the reduce-scatter reading %h instead of %g reads it
    # until %rw, so %rw must come before %hf (a free between launch and wait is refused)
    program = parse_program(RS_TEXT.replace('%f = free "free"(%g)', '%f = free "free"(%g)\n%hf = free "free"(%h)'))
    rewriter = Rewriter(program)
    assert rewriter.replace_uses("g", "h", only={"rs"}) == ["rs"]
    assert program.graph.edges["rw", "hf"]["why"] == "free"
    verify(program)
    early = parse_program(RS_TEXT.replace('%c = compute "aten.neg"(%y)', '%c = compute "aten.neg"(%y)\n%hf = free "free"(%h)'))
    with pytest.raises(RewriteError, match="%rw would read storage that %hf frees before it"):
        Rewriter(early).replace_uses("g", "h", only={"rs"})
    assert early.op("rs").operands == ("g",)


def test_a_rewriter_orders_new_reads_against_writers_made_or_moved_since_it_last_looked():
    # the rewriter keeps each storage's writers between edits: a writer it creates, and one
    # that replace_uses moves onto the storage, order the reads made after them
    program = parse_program(TEXT)
    rewriter = Rewriter(program)
    rewriter.create(Compute(name="r1", operands=("v",), target="aten.neg"), before="y")  # %t's writers: %f
    rewriter.create(Compute(name="inplace", operands=("v",), target="aten.add_", writes=("v",), alias="v"),
                    before="y")
    rewriter.create(Compute(name="r2", operands=("t",), target="aten.neg"), before="y")
    assert program.graph.edges["inplace", "r2"]["why"] == "storage"
    assert program.graph.edges["r1", "inplace"]["why"] == "storage"
    verify(program)
    # %rf (a free of %rt) moves onto %t: a read of %t created after it is ordered before it
    rewriter.erase("f")
    rewriter.create(Compute(name="r3", operands=("t",), target="aten.neg", phase=Phase.BACKWARD), before="g")
    assert not program.graph.has_edge("r3", "rf")
    rewriter.replace_uses("rt", "t")
    rewriter.create(Compute(name="r4", operands=("t",), target="aten.neg", phase=Phase.BACKWARD), before="g")
    assert program.graph.edges["r4", "rf"]["why"] == "free"
    for name in ("rt", "rag"):
        rewriter.erase(name)
    verify(program)


@pytest.mark.parametrize("model, width", [("gpt", 32), ("encoder", 32), ("gpt", 1024)])
def test_rewrites_add_the_edges_a_walk_of_every_reader_adds(model, width, monkeypatch):
    # the rewriter's kept writer sets against a walk of the storage's readers per edit (what it
    # did before it kept them): the same IR, effect edges and why, after unshard and bucket
    from fxsched.ir import print_program
    from fxsched.front import fsdp_joint_graph
    from fxsched.lowering import lower
    from fxsched.models import build_model
    from fxsched.passes import PassManager

    module, inputs, loss = build_model(model, layers=2, width=width, seed=1)
    base = lower(fsdp_joint_graph(module, inputs, lambda m, *xs: loss(m(*xs), *xs), 2).gm)

    def run():
        program = base.copy()
        result = PassManager("default,unshard,bucket").run(program)
        edges = sorted((a, b, e["kind"], e.get("why")) for a, b, e in program.graph.edges(data=True))
        return print_program(program, effects=True), edges, result

    kept, kept_edges, result = run()
    assert any(r.changed for p, r in result.results if p.name == "bucket")  # buckets were made
    walk = Rewriter._writers

    def walked(self, root):
        self._writer_cache.clear()
        return walk(self, root)

    monkeypatch.setattr(Rewriter, "_writers", walked)
    walked_text, walked_edges, _ = run()
    assert kept == walked_text and kept_edges == walked_edges


BARRIERED = """
%x = input
%w = input
^entry
%a = compute "aten.neg"(%x)
%b = barrier "aten.copy_"(%a) {reason = "mutation"}
%c = compute "aten.neg"(%a)
^backward
%d = compute "aten.neg"(%c)
%e = barrier "aten.copy_"(%d) {reason = "mutation"}
%g = compute "aten.neg"(%d)
%output = output(%g)
"""


def test_create_gives_a_new_op_its_phase_barrier_and_entry_edges():
    """A backward op reading only an input (a pack of shards) is created between the two
    barriers: it follows ^backward, ^entry and %b, and precedes %e — else a later pass that
    moves what its edges allow (fill-waits, gradients-first) could take it into the forward, as
    it did a bucket's pack, or across a barrier."""
    program = parse_program(BARRIERED)
    Rewriter(program).create(Compute(name="pack", operands=("w",), phase=Phase.BACKWARD, target="aten.cat"),
                             before="d")
    verify(program)
    for first, then in (("^backward", "pack"), ("^entry", "pack"), ("b", "pack"), ("pack", "e")):
        assert program.graph.has_edge(first, then) and program.graph.edges[first, then]["kind"] == EFFECT
    # a forward op in the forward precedes ^backward and the barrier after it
    Rewriter(program).create(Compute(name="early", operands=("a",), target="aten.neg"), before="c")
    assert program.graph.has_edge("early", "^backward") and program.graph.has_edge("b", "early")
    assert not program.graph.has_edge("^entry", "early")  # it reads %a, which follows ^entry
    verify(program)


def test_create_refuses_an_op_on_the_wrong_side_of_backward_and_ops_that_never_move():
    program = parse_program(BARRIERED)
    with pytest.raises(RewriteError, match="a forward op scheduled after \\^backward"):
        Rewriter(program).create(Compute(name="late", operands=("c",), target="aten.neg"), before="g")
    with pytest.raises(RewriteError, match="a backward op scheduled before \\^backward"):
        Rewriter(program).create(Compute(name="soon", operands=("a",), phase=Phase.BACKWARD, target="aten.neg"),
                                 before="c")
    with pytest.raises(RewriteError, match="barrier ops are never created"):
        Rewriter(program).create(Barrier(name="z", operands=("a",), target="aten.copy_"), before="c")
    assert "late" not in program.graph and "soon" not in program.graph and "z" not in program.graph
    verify(program)
