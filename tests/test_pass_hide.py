"""hide (cost-guided anchoring) through the API: a budget after hide, an untagged program, and
anchor after hide. Their before/after IR tests are tests/filecheck/passes/hide.fxir and
overlap-reduce-scatter.fxir (`fxsched opt --cost-table`, costs.table there: the costs below)."""

from __future__ import annotations

from textwrap import dedent

from fxsched.ir import parse_program, print_program
from fxsched.passes import PassContext, PassManager

# ms per target: every "c" is 1 ms of compute, a gather 2 ms, a reduce-scatter 3 ms
COSTS = {"c": 1.0, "mm": 1.0, "ag": 2.0, "rs": 3.0}

TWO_GATHERS = dedent('''
    %x = input
    %w1 = input
    %w2 = input
    ^entry
    %a1 = launch "ag"(%w1) {group = "0", role = fsdp_all_gather, nbytes = 1000, params = ["w1"]}
    %t1 = wait(%a1)
    %m1 = compute "mm"(%x, %t1)
    %c1 = compute "c"(%m1)
    %c2 = compute "c"(%c1)
    %c3 = compute "c"(%c2)
    %c4 = compute "c"(%c3)
    %a2 = launch "ag"(%w2) {group = "0", role = fsdp_all_gather, nbytes = 1000, params = ["w2"]}
    %t2 = wait(%a2)
    %m2 = compute "mm"(%c4, %t2)
    %output = output(%m2)
''')


def run(text: str, pipeline: str, costs=COSTS):
    program = parse_program(text)
    result = PassManager(pipeline).run(program, PassContext(cost_model=costs))
    return program, result.stats()


def test_budget_still_applies_after_hide():
    program, stats = run(TWO_GATHERS.replace("nbytes = 1000", "nbytes = 2000000000"), "hide,budget{max-in-flight-gb=1.0},prefetch,sink")
    assert program.op("a2").hold == "over budget" and not program.op("a2").prefetched


def test_untagged_program_is_unchanged():
    text = dedent('''
        %x = input
        ^entry
        %a = compute "c"(%x)
        %b = compute "c"(%a)
        %output = output(%b)
    ''')
    program, stats = run(text, "hide,budget,prefetch,sink,overlap-reduce-scatter")
    assert print_program(program) == text.lstrip("\n")
    assert not any(s["changed"] for s in stats.values())


def test_anchor_after_hide_takes_over_hides_holds_but_keeps_lowerings():
    text = TWO_GATHERS.replace('params = ["w2"]}', 'params = ["w2"], hold = "no parameter name"}')
    program, _ = run(text, "hide")
    assert program.op("a1").hold == "cannot be hidden"
    PassManager("anchor").run(program)
    # a1 is in the first consumer group: anchor's own reason replaces hide's
    assert program.op("a1").hold == "first group"
    # a hold lowering set (malformed tags) survives both passes
    assert program.op("a2").hold == "no parameter name" and program.op("a2").anchor is None
