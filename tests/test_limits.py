"""cost.limits: each exposed millisecond sorted by what could still hide it, worked out by hand; and the
critical path of `lower_bound`, checked against every placement of the communication of small programs."""

from __future__ import annotations

import pytest

from fxsched.cost import simulate
from fxsched.cost.limits import (AT_LIMIT, BUSY, MOVABLE, REORDERABLE, classify, critical_ms, exposure_causes,
                                 lower_bound)

from fxsched.ir import Cast, Launch, Program, Schedule, View, parse_program, waits_of

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


# ---- the critical path: a lower bound over every placement of the communication --------------

def _bound(text: str, **given):
    program = parse_program(dedent(text))
    costs = ms(program, **given)
    sim = simulate(program, costs=costs)
    return program, costs, sim, lower_bound(program, sim, costs)


def _best_placement(program, costs) -> float:
    """The least simulated step over every legal order (a topological order of the program's
    data and effect edges) that keeps the order of the ops `critical_ms` keeps: brute force."""
    import networkx as nx

    moving = set()
    for name in program.schedule:
        if isinstance(program.op(name), Launch):
            moving |= program.private_feeders(name, (View, Cast))
            for wait in waits_of(program, name):
                moving.add(wait)
                moving |= {v for v in nx.descendants(program.graph, wait) if isinstance(program.op(v), View)}
    kept = [n for n in program.schedule if n not in moving]
    best = float("inf")
    for order in nx.all_topological_sorts(program.graph):
        if [n for n in order if n not in moving] == kept:
            placed = Program(program.graph, Schedule(order), list(program.notes), dict(program.payload), program.origin)
            best = min(best, simulate(placed, costs=costs).step_ms)
    return best


# two reduce-scatters of gradients made at once, a barrier right after: the stream must run both
# before it, whatever their order (they keep it: collectives other than gathers do)
RS_BURST = '''
    %x = input
    %w = input
    ^entry
    %g = compute "mm"(%x, %w)
    %g1 = view "aten.view"(%g)
    %g2 = view "aten.slice"(%g)
    %r1 = launch "rs"(%g1) {group = "0", role = fsdp_reduce_scatter}
    %r2 = launch "rs"(%g2) {group = "0", role = fsdp_reduce_scatter}
    %c = compute "c"(%x)
    %s1 = wait(%r1)
    %s2 = wait(%r2)
    %b = barrier "aten.copy_"(%x, %c) {reason = "mutation"}
    %d = compute "d"(%b)
    %output = output(%d, %s1, %s2)
'''


def test_a_burst_queued_before_a_barrier_is_forced():
    # r2 waits 2 ms behind r1 (needed no later): `stream busy`, which the exposure at the legal
    # limit leaves out (bound 8 of a 10 ms step); the critical path has it: 1 + 2 + 2 + 1 = 6 at
    # the barrier, + 4 of d
    program, costs, sim, bound = _bound(RS_BURST, g=1.0, r1=2.0, r2=2.0, c=1.0, d=4.0)
    assert sim.step_ms == 9.0
    assert bound["compute_ms"] + bound["forced_ms"] < 9.0
    assert bound["critical_ms"] == bound["bound_ms"] == 9.0 == _best_placement(program, costs)


def test_gathers_queued_at_the_start_are_forced():
    # both launch at the start: a2 runs after a1 (2 ms), is needed 1 ms after a1 ends and takes
    # 2: 1 ms idle behind a1, `stream busy`, which the exposure at the legal limit leaves out
    program, costs, sim, bound = _bound(TWO_GATHERS.format(first=A1, second=A2), a1=2.0, a2=2.0, m1=1.0, m2=1.0)
    assert bound["compute_ms"] + bound["forced_ms"] == 4.0
    assert sim.step_ms == bound["critical_ms"] == bound["bound_ms"] == 5.0 == _best_placement(program, costs)


SMALL = [
    (RS_BURST, dict(g=1.0, r1=2.0, r2=0.5, c=3.0, d=1.0)),
    (RS_BURST, dict(g=0.5, r1=0.5, r2=3.0, c=0.5, d=2.0)),
    (TWO_GATHERS.format(first=A2, second=A1), dict(a1=2.0, a2=2.0, m1=1.0, m2=1.0)),
    (TWO_GATHERS.format(first=A1, second=A2), dict(a1=0.5, a2=3.0, m1=2.0, m2=1.0)),
    ('''
    %x = input
    %w1 = input
    %w2 = input
    ^entry
    %c1 = compute "c"(%x)
    %k = cast "aten._to_copy"(%w1)
    %a1 = launch "ag"(%k) {group = "0", role = fsdp_all_gather, nbytes = 8, params = ["w1"]}
    %a2 = launch "ag"(%w2) {group = "1", role = fsdp_all_gather, nbytes = 8, params = ["w2"]}
    %t1 = wait(%a1)
    %v1 = view "aten.view"(%t1)
    %m1 = compute "mm"(%c1, %v1)
    %t2 = wait(%a2)
    %m2 = compute "mm"(%m1, %t2)
    %r = launch "rs"(%m2) {group = "0", role = fsdp_reduce_scatter}
    %c2 = compute "c"(%m1)
    %s = wait(%r)
    %output = output(%c2, %s)
    ''', dict(c1=1.0, k=0.5, a1=2.0, a2=3.0, m1=1.0, m2=0.5, r=2.0, c2=1.0)),
]


@pytest.mark.parametrize("text,given", SMALL)
def test_the_critical_path_never_exceeds_any_placement(text, given):
    program, costs, sim, bound = _bound(text, **given)
    best = _best_placement(program, costs)
    assert critical_ms(program, costs) <= best + 1e-9 and bound["bound_ms"] <= sim.step_ms + 1e-9
