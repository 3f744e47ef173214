"""sink: waits, views and copy-outs move down to just before their first use, latest first.

The before/after cases are IR test files: tests/filecheck/passes/sink.fxir."""

from __future__ import annotations


from irtest import dedent
from fxsched.ir import parse_program, verify
from fxsched.passes import PassContext, parse_pipeline


def test_sinking_runs_with_prefetch_off_and_each_pass_leaves_a_valid_program():
    program = parse_program(dedent('''
        %x = input
        %w = input
        ^entry
        %a = launch "ag"(%w) {role = fsdp_all_gather, nbytes = 1, params = ["w"]}
        %t = wait(%a)
        %n = compute "aten.neg"(%x)
        %m = compute "aten.mm"(%x, %t) {heavy}
        %output = output(%m)
    '''))
    ctx = PassContext()
    for p in parse_pipeline("anchor{forward-depth=0},budget,prefetch,sink"):
        p.apply(ctx, program)
        verify(program)
    assert program.schedule.names()[3:6] == ["a", "n", "t"]  # sinking runs even with prefetch off
