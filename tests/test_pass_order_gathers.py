"""order-gathers: adjacent gather chains launch most urgent first; nothing leaves its run."""

from __future__ import annotations

from fxsched.ir import print_program, verify

from irtest import dedent, filecheck, run

# after a barrier, three gathers launched in the order the graph emitted them: the one needed
# last goes first on the stream
AFTER_BARRIER = '''
    %x = input
    %w1 = input
    %w2 = input
    %w3 = input
    %buf = input
    ^entry
    %b = barrier "aten.copy_"(%buf, %x) {reason = "mutation"}
    %a3 = launch "ag"(%w3) {group = "0", role = fsdp_all_gather, nbytes = 1000, params = ["w3"]}
    %a2 = launch "ag"(%w2) {group = "0", role = fsdp_all_gather, nbytes = 1000, params = ["w2"]}
    %a1 = launch "ag"(%w1) {group = "0", role = fsdp_all_gather, nbytes = 1000, params = ["w1"]}
    %t1 = wait(%a1)
    %m1 = compute "mm"(%x, %t1)
    %t2 = wait(%a2)
    %m2 = compute "mm"(%m1, %t2)
    %t3 = wait(%a3)
    %m3 = compute "mm"(%m2, %t3)
    %output = output(%m3)
'''


def test_adjacent_gathers_launch_in_order_of_first_use():
    program, result = run(AFTER_BARRIER, "order-gathers")
    filecheck(print_program(program), '''
        CHECK: %b = barrier
        CHECK-NEXT: %a1 = launch
        CHECK-NEXT: %a2 = launch
        CHECK-NEXT: %a3 = launch
        CHECK-NEXT: %t1 = wait(%a1)
    ''')
    assert result.stats()["order-gathers"] == {"runs": 1, "reordered": 1, "moved ahead": 2, "over budget": 0, "changed": True}
    assert program.op("a1").prefetched and program.op("a2").prefetched and not program.op("a3").prefetched
    # a second run finds nothing to do
    again = run(print_program(program), "order-gathers")[1]
    assert again.stats()["order-gathers"]["reordered"] == 0


def test_a_compute_between_gathers_splits_the_run():
    text = AFTER_BARRIER.replace('''    %a2 = launch''', '''    %c = compute "c"(%x)
    %a2 = launch''')
    program, _ = run(text, "order-gathers")
    filecheck(print_program(program), '''
        CHECK: %b = barrier
        CHECK-NEXT: %a3 = launch
        CHECK-NEXT: %c = compute
        CHECK-NEXT: %a1 = launch
        CHECK-NEXT: %a2 = launch
    ''')


def test_casts_travel_with_their_launch():
    text = AFTER_BARRIER.replace('''    %a1 = launch "ag"(%w1)''', '''    %k1 = cast "aten._to_copy.default"(%w1) : bf16[4]
    %a1 = launch "ag"(%k1)''')
    program, _ = run(text, "order-gathers")
    verify(program)
    filecheck(print_program(program), '''
        CHECK: %b = barrier
        CHECK-NEXT: %k1 = cast
        CHECK-NEXT: %a1 = launch
        CHECK-NEXT: %a2 = launch
        CHECK-NEXT: %a3 = launch
    ''')


def test_untagged_program_is_unchanged():
    text = dedent('''
        %x = input
        ^entry
        %a = compute "c"(%x)
        %output = output(%a)
    ''')
    program, result = run(text, "order-gathers")
    assert print_program(program) == text and not result.stats()["order-gathers"]["changed"]


def test_a_gather_of_unknown_size_stays_where_it_is():
    program, _ = run(AFTER_BARRIER.replace('nbytes = 1000, params = ["w2"]', 'params = ["w2"]'), "order-gathers")
    filecheck(print_program(program), '''
        CHECK: %b = barrier
        CHECK-NEXT: %a3 = launch
        CHECK-NEXT: %a2 = launch
        CHECK-NEXT: %a1 = launch
    ''')


def test_a_reorder_that_would_go_over_the_budget_keeps_its_order():
    # a1 and a2 move ahead of a3: their 2 x 1000 bytes fit in 2000 bytes, not in 1500
    program, result = run(AFTER_BARRIER, f"order-gathers{{max-in-flight-gb={1500 / 2**30!r}}}")
    (stats,) = result.stats().values()
    assert stats["over budget"] == 1
    assert program.schedule.names().index("a3") < program.schedule.names().index("a1")
    assert not any(program.op(a).prefetched for a in ("a1", "a2", "a3"))
    fits, _ = run(AFTER_BARRIER, f"order-gathers{{max-in-flight-gb={2000 / 2**30!r}}}")
    assert fits.schedule.names().index("a1") < fits.schedule.names().index("a3")


def test_a_zero_budget_moves_nothing_ahead_not_even_an_empty_gather():
    text = AFTER_BARRIER.replace("nbytes = 1000", "nbytes = 0")
    program, result = run(text, "order-gathers{max-in-flight-gb=0.0}")
    assert not any(program.op(a).prefetched for a in ("a1", "a2", "a3"))
    (stats,) = result.stats().values()
    assert stats["over budget"] == 1 and stats["reordered"] == 0
