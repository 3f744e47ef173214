"""budget: replicas launched early and not yet consumed never exceed max-in-flight-gb.

Before/after cases are also IR test files: tests/filecheck/passes/budget.fxir, budget-unknown-size.fxir."""

from __future__ import annotations


import pytest

from irtest import dedent, filecheck, run
from fxsched.ir import parse_program, print_program, verify
from fxsched.passes import PassContext, PassManager, parse_pipeline

HALF_GIB = 2**29


def chain(sizes: list[int | None], backward: bool = False) -> str:
    """Gathers a1.. (sizes in bytes, None = unknown), each read by one matmul m1.."""
    role = "fsdp_all_gather_backward" if backward else "fsdp_all_gather"
    lines = ["%x = input", *(f"%w{i} = input" for i in range(1, len(sizes) + 1)), "^entry"]
    if backward:
        lines.append("^backward")
    prev = "%x"
    for i, size in enumerate(sizes, 1):
        nbytes = "" if size is None else f"nbytes = {size}, "
        lines += [f'%a{i} = launch "ag"(%w{i}) {{role = {role}, {nbytes}params = ["w{i}"]}}',
                  f"%t{i} = wait(%a{i})", f'%m{i} = compute "aten.mm"({prev}, %t{i}) {{heavy}}']
        prev = f"%m{i}"
    lines.append(f"%output = output({prev})")
    return "\n".join(lines) + "\n"


def holds(program) -> dict[str, str | None]:
    return {op.name: op.hold for op in program.ops() if getattr(op, "is_gather", False)}


def test_a_replica_is_in_flight_until_its_first_consumer_not_after():
    """Depth 1: a2 is in flight from just before m1 until m2 reads it. a3 would launch just
    before m2, where a2 is still in flight: 1200 > 1100 bytes. a4 launches before m3, after m2
    consumed a2: it fits. With 1200 bytes all fit."""
    sizes = [1, 600, 600, 600]
    budget = 1100 / 2**30
    program, _ = run(chain(sizes), f"anchor,budget{{max-in-flight-gb={budget!r}}},prefetch")
    assert holds(program) == {"a1": "first group", "a2": None, "a3": "over budget", "a4": None}
    program, _ = run(chain(sizes), f"anchor,budget{{max-in-flight-gb={1200 / 2**30!r}}},prefetch")
    assert holds(program) == {"a1": "first group", "a2": None, "a3": None, "a4": None}


@pytest.mark.parametrize("backward", [False, True])
def test_unknown_size_is_held_and_not_counted(backward):
    program, result = run(chain([100, 100, None, 100], backward), "anchor,budget{max-in-flight-gb=1e-06},prefetch,sink")
    assert holds(program) == {"a1": "first group", "a2": None, "a3": "unknown size", "a4": None}
    stats = result.stats()
    assert stats["budget{max-in-flight-gb=1e-06}"]["unknown size"] == 1
    assert stats["budget{max-in-flight-gb=1e-06}"]["budget_bytes"] == int(1e-06 * 2**30)
    assert stats["prefetch"]["backward" if backward else "forward"] == 2
    filecheck(print_program(program), '''
        CHECK:      %m2 = compute
        CHECK-NEXT: %a3 = launch {{.*}}hold = "unknown size"}
        CHECK-NEXT: %a4 = launch {{.*}}anchor = %m3, prefetched}
        CHECK-NEXT: %t3 = wait(%a3)
    ''')


def test_budget_zero_turns_prefetch_off_but_sinking_still_runs():
    text = chain([100, 100, 100])
    program, result = run(text, "anchor,budget{max-in-flight-gb=0},prefetch,sink")
    assert holds(program) == {"a1": "first group", "a2": "over budget", "a3": "over budget"}
    stats = result.stats()
    assert stats["budget{max-in-flight-gb=0.0}"]["over budget"] == 2
    assert stats["prefetch"]["forward"] == 0 and not stats["prefetch"]["changed"]
    # nothing moved: the order is the original one (the waits already sit before their readers)
    assert program.schedule.names() == parse_program(text).schedule.names()


def test_budget_plans_on_a_copy_and_leaves_the_order_alone():
    program = parse_program(chain([HALF_GIB] * 4))
    before = program.schedule.names()
    ctx = PassContext()
    for p in parse_pipeline("anchor{forward-depth=2},budget"):
        p.apply(ctx, program)
        verify(program)
    assert program.schedule.names() == before
    # the holds it wrote are the ones the prefetch then honours
    assert holds(program)["a4"] == "over budget"


def test_gathers_moved_by_an_earlier_run_stay_in_flight():
    """a2 was prefetched by an earlier run (it sits before m1): with it, a3 does not fit."""
    text = '''
        %x = input
        %w1 = input
        %w2 = input
        %w3 = input
        ^entry
        %a1 = launch "ag"(%w1) {role = fsdp_all_gather, nbytes = 536870912, params = ["w1"]}
        %a2 = launch "ag"(%w2) {role = fsdp_all_gather, nbytes = 805306368, params = ["w2"], prefetched}
        %t1 = wait(%a1)
        %m1 = compute "aten.mm"(%x, %t1) {heavy}
        %t2 = wait(%a2)
        %m2 = compute "aten.mm"(%m1, %t2) {heavy}
        %a3 = launch "ag"(%w3) {role = fsdp_all_gather, nbytes = 536870912, params = ["w3"]}
        %t3 = wait(%a3)
        %m3 = compute "aten.mm"(%m2, %t3) {heavy}
        %output = output(%m3)
    '''
    program, _ = run(text, "anchor{forward-depth=2},budget,prefetch")
    assert holds(program)["a3"] == "over budget"
    program, _ = run(text.replace(", prefetched}", "}"), "anchor{forward-depth=2},budget,prefetch")
    assert holds(program)["a3"] is None


def test_a_gather_moved_again_by_a_second_run_counts_once():
    """Regression: a replica an earlier run moved kept its old span in the in-flight curve when
    moved again, so it counted twice and was held back as over budget."""
    first, _ = run(chain([HALF_GIB] * 3), "anchor,budget,prefetch,sink")
    assert holds(first) == {"a1": "first group", "a2": None, "a3": None}
    second, result = run(print_program(first), "anchor{forward-depth=2},budget,prefetch")
    # a2 already sits at m1; a3 moves from before m2 to before m1: 0.5 + 0.5 GiB fits
    assert holds(second) == {"a1": "first group", "a2": "no earlier legal slot", "a3": None}
    assert result.stats()["prefetch"]["forward"] == 1
    names = second.schedule.names()
    assert names.index("a3") < names.index("m1")


def test_no_earlier_legal_slot_is_recorded_by_budget():
    text = '''
        %x = input
        %w1 = input
        %w2 = input
        ^entry
        %a1 = launch "ag"(%w1) {role = fsdp_all_gather, nbytes = 1, params = ["w1"]}
        %t1 = wait(%a1)
        %m1 = compute "aten.mm"(%x, %t1) {heavy}
        %b = barrier "aten.copy_"(%x, %m1) {reason = "mutation"}
        %a2 = launch "ag"(%w2) {role = fsdp_all_gather, nbytes = 1, params = ["w2"]}
        %t2 = wait(%a2)
        %m2 = compute "aten.mm"(%m1, %t2) {heavy}
        %output = output(%m2)
    '''
    program, result = run(text, "anchor,budget,prefetch")
    assert holds(program)["a2"] == "no earlier legal slot"
    assert result.stats()["budget"]["no earlier legal slot"] == 1
    assert result.stats()["prefetch"]["no earlier legal slot"] == 0  # already held by budget



# after hide: a communication-bound forward, so hide anchors every gather at the first slot (c1).
# a2 (600 B) does not fit the 1000 B budget there beside a1: it goes to the earliest slot that
# fits, c2, after a1's consumer. a3 (100 B, needed after a2) fits at c1. a0 (3 ms) still runs on
# the stream when a2 launches
NEED_ORDER = dedent('''
    %x = input
    %w0 = input
    %w1 = input
    %w2 = input
    %w3 = input
    ^entry
    %c1 = compute "c"(%x)
    %a1 = launch "ag"(%w1) {group = "0", role = fsdp_all_gather, nbytes = 600, params = ["w1"]}
    %t1 = wait(%a1)
    %m1 = compute "mm"(%c1, %t1)
    %c2 = compute "c"(%m1)
    %a0 = launch "ag3"(%w0) {group = "0", role = fsdp_all_gather, nbytes = 10, params = ["w0"]}
    %t0 = wait(%a0)
    %m0 = compute "mm"(%c2, %t0)
    %a2 = launch "ag"(%w2) {group = "0", role = fsdp_all_gather, nbytes = 600, params = ["w2"]}
    %t2 = wait(%a2)
    %m2 = compute "mm"(%m0, %t2)
    %a3 = launch "ag5"(%w3) {group = "0", role = fsdp_all_gather, nbytes = 100, params = ["w3"]}
    %t3 = wait(%a3)
    %m3 = compute "mm"(%m2, %t3)
    %output = output(%m3)
''')
NEED_ORDER_COSTS = {"c": 1.0, "mm": 1.0, "ag": 1.0, "ag3": 3.0, "ag5": 5.0}


def test_what_is_needed_after_a_gather_moved_later_for_the_budget_launches_after_it():
    """a3 would fit at its anchor, c1, but launched there it runs on the stream ahead of a2 (the
    stream runs in launch order) and a2 waits on all of it: it launches after a2, at c2, which
    becomes its anchor. The gathers launch in the order they are needed, and the step is 1 ms
    shorter than with a3 ahead of a2 (12 ms, as budget placed them before)."""
    from fxsched.cost import simulate

    budget = f"budget{{max-in-flight-gb={1000 / 2**30!r}}}"
    program = parse_program(NEED_ORDER)
    result = PassManager(f"hide,{budget},prefetch").run(program, PassContext(cost_model=NEED_ORDER_COSTS))
    stats = result.stats()[budget]
    assert stats["later for budget"] == 1 and stats["after one moved later"] == 1
    assert program.op("a2").anchor == "c2" and program.op("a3").anchor == "c2"
    launches = [op.name for op in program.ops() if getattr(op, "is_gather", False)]
    assert launches == ["a1", "a0", "a2", "a3"]
    filecheck(print_program(program), '''
        CHECK:      %m1 = compute
        CHECK-NEXT: %a2 = launch {{.*}}anchor = %c2, prefetched}
        CHECK-NEXT: %a3 = launch {{.*}}anchor = %c2, prefetched}
        CHECK-NEXT: %c2 = compute
    ''')
    ahead = program.copy()
    ahead.schedule.move_before(["a3"], "a2")
    verify(ahead)
    assert simulate(program, NEED_ORDER_COSTS).step_ms == 11.0
    assert simulate(ahead, NEED_ORDER_COSTS).step_ms == 12.0
