"""cost.limits: each exposed millisecond sorted by what could still hide it, worked out by hand."""

from __future__ import annotations

from fxsched.cost import simulate
from fxsched.cost.limits import AT_LIMIT, BUSY, MOVABLE, REORDERABLE, classify, exposure_causes

from fxsched.ir import parse_program

from irtest import dedent


def ms(program, **given):
    out = dict.fromkeys(program.schedule, 0.0)
    out.update(given)
    return out


def causes(text: str, **given):
    program = parse_program(dedent(text))
    costs = ms(program, **given)
    sim = simulate(program, costs=costs)
    return exposure_causes(program, sim, costs), classify(program, sim, costs), sim


def test_a_gather_needed_before_any_compute_is_at_its_legal_limit():
    got, _, sim = causes('''
        %x = input
        %w = input
        ^entry
        %a = launch "ag"(%w) {group = "0", role = fsdp_all_gather, nbytes = 8, params = ["w"]}
        %t = wait(%a)
        %m = compute "mm"(%x, %t)
        %output = output(%m)
    ''', a=2.0, m=1.0)
    assert sim.exposed_ms == 2.0
    assert got == {AT_LIMIT: 2.0, BUSY: 0.0, REORDERABLE: 0.0, MOVABLE: 0.0}


def test_compute_before_a_late_launch_makes_it_movable():
    got, _, _ = causes('''
        %x = input
        %w = input
        ^entry
        %c = compute "c"(%x)
        %a = launch "ag"(%w) {group = "0", role = fsdp_all_gather, nbytes = 8, params = ["w"]}
        %t = wait(%a)
        %m = compute "mm"(%c, %t)
        %output = output(%m)
    ''', c=1.0, a=2.0, m=1.0)
    assert got[MOVABLE] == 2.0 and got[AT_LIMIT] == 0.0


def test_compute_after_an_early_wait_makes_it_movable():
    got, _, _ = causes('''
        %x = input
        %g = input
        ^entry
        %rs = launch "rs"(%g) {group = "0", role = fsdp_reduce_scatter}
        %rw = wait(%rs)
        %c = compute "c"(%x)
        %output = output(%c, %rw)
    ''', rs=3.0, c=1.0)
    assert got[MOVABLE] == 3.0


A1 = '%a1 = launch "ag"(%w1) {group = "0", role = fsdp_all_gather, nbytes = 8, params = ["w1"]}'
A2 = '%a2 = launch "ag"(%w2) {group = "0", role = fsdp_all_gather, nbytes = 8, params = ["w2"]}'
TWO_GATHERS = '''
    %x = input
    %w1 = input
    %w2 = input
    ^entry
    {first}
    {second}
    %t1 = wait(%a1)
    %m1 = compute "mm"(%x, %t1)
    %t2 = wait(%a2)
    %m2 = compute "mm"(%m1, %t2)
    %output = output(%m2)
'''


def test_queued_behind_a_gather_needed_later_is_reorderable():
    # a2 launches first but is needed second: a1 waits 2 ms behind it on the stream
    got, per, _ = causes(TWO_GATHERS.format(first=A2, second=A1), a1=2.0, a2=2.0, m1=1.0, m2=1.0)
    assert per["a1"] == {"queued": 2.0, "queue": REORDERABLE, "rest": AT_LIMIT}
    assert got[REORDERABLE] == 2.0 and got[AT_LIMIT] == 2.0  # a1's own 2 ms cannot be hidden


def test_queued_behind_a_gather_needed_first_is_the_stream_busy():
    # a1 needed first runs first; a2 waits behind it, then 1 ms of m1 hides part of it
    got, per, _ = causes(TWO_GATHERS.format(first=A1, second=A2), a1=2.0, a2=2.0, m1=1.0, m2=1.0)
    assert per["a2"] == {"queued": 1.0, "queue": BUSY, "rest": AT_LIMIT}
    assert got == {AT_LIMIT: 2.0, BUSY: 1.0, REORDERABLE: 0.0, MOVABLE: 0.0}
