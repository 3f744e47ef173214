"""The rewriter (ir/rewriter.py): create, replace uses and erase keep the program verified."""

from __future__ import annotations

import pytest

from fxsched.ir import Compute, EFFECT, parse_program, verify
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
