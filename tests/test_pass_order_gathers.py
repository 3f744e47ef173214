"""order-gathers: adjacent gather chains launch most urgent first; nothing leaves its run.

The before/after cases are IR test files: tests/filecheck/passes/order-gathers.fxir."""

from __future__ import annotations

from irtest import run

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
