"""Schedule (ir/program.py) against a plain list: random moves of one name and of several,
across and within its blocks, with copies taken along the way."""

from __future__ import annotations

import random

import pytest

from fxsched.ir.program import Schedule


def move_in_list(order: list[str], names: list[str], target: str) -> list[str]:
    rest = [n for n in order if n not in set(names)]
    at = rest.index(target)
    return rest[:at] + list(names) + rest[at:]


def check(schedule: Schedule, order: list[str]) -> None:
    assert list(schedule) == order
    assert schedule.names() == order
    assert len(schedule) == len(order)
    assert all(schedule.index(n) == i for i, n in enumerate(order))
    assert all(schedule[i] == n for i, n in enumerate(order))
    assert schedule[-1] == order[-1] and schedule[3:7] == order[3:7]
    assert schedule == Schedule(order)


@pytest.mark.parametrize("seed", range(6))
def test_moves_match_a_list(seed):
    rng = random.Random(seed)
    order = [f"n{i}" for i in range(rng.choice([5, 300, 1500]))]
    schedule = Schedule(order)
    copies = []
    for step in range(400):
        k = 1 if rng.random() < 0.6 else rng.randint(2, min(8, len(order) - 1))
        names = rng.sample(order, k)
        # as passes move them: a chain keeps its given order, the target is another node,
        # sometimes far away, sometimes next to them
        target = rng.choice([n for n in order if n not in names])
        schedule.move_before(names, target)
        order = move_in_list(order, names, target)
        assert schedule.take_moved() == set(names)
        if step % 50 == 0:
            copies.append((schedule.copy(), list(order)))
            check(schedule, order)
        if step % 97 == 0:  # a getitem between moves, as placement reads its target
            i = rng.randrange(len(order))
            assert schedule[i] == order[i] and schedule.index(order[i]) == i
    check(schedule, order)
    for copy, then in copies:  # moves after a copy change neither
        check(copy, then)


def test_many_moves_into_one_place_and_out_of_another():
    # names piling up before one target split its block; names leaving empty theirs
    order = [f"n{i}" for i in range(1000)]
    schedule = Schedule(order)
    for i in range(600, 1000):
        schedule.move_before([f"n{i}"], "n5")
        order = move_in_list(order, [f"n{i}"], "n5")
    check(schedule, order)
    schedule.move_before([f"n{i}" for i in range(100, 300)], "n0")
    order = move_in_list(order, [f"n{i}" for i in range(100, 300)], "n0")
    check(schedule, order)


def test_bad_moves_and_lookups():
    schedule = Schedule(["a", "b", "c"])
    with pytest.raises(ValueError):
        schedule.move_before(["a", "b"], "b")
    with pytest.raises(ValueError):  # one name: its own fast path
        schedule.move_before(["b"], "b")
    with pytest.raises(KeyError):
        schedule.index("z")
    with pytest.raises(IndexError):
        schedule.move_before(["c"], "a") or schedule[3]
    assert "z" not in schedule and "a" in schedule
    assert len(Schedule()) == 0 and list(Schedule()) == []


def test_adopt_takes_a_copys_order_and_its_moves():
    # prefetch takes the order budget planned on a copy: the schedule object stays, its order
    # and moved names become the copy's, and later moves work on it as on any schedule
    order = [f"n{i}" for i in range(700)]
    schedule = Schedule(order)
    schedule.move_before(["n3"], "n1")
    order = move_in_list(order, ["n3"], "n1")
    planned = schedule.copy()
    schedule.take_moved()
    for names, target in ((["n650"], "n10"), (["n400", "n401"], "n200"), (["n5"], "n600")):
        planned.move_before(names, target)
        order = move_in_list(order, names, target)
    held = schedule
    schedule.adopt(planned)
    assert held is schedule
    check(schedule, order)
    assert schedule.take_moved() == {"n3", "n650", "n400", "n401", "n5"}
    schedule.move_before(["n699"], "n0")
    check(schedule, move_in_list(order, ["n699"], "n0"))
