"""`gc_paused()`: the collector is off inside, back as it was after, and what was built inside
goes to the oldest generation unscanned, still collectable (nothing frozen for good)."""

from __future__ import annotations

import gc
import weakref

import pytest

from fxsched.ir.gcpause import gc_paused


class _Box:
    pass


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    gc.collect()
    yield
    if not was:
        gc.disable()


def test_what_was_built_inside_goes_to_the_oldest_generation(collector_on):
    with gc_paused():
        assert not gc.isenabled()
        built = [[i] for i in range(5000)]
    assert gc.isenabled()
    assert gc.get_count()[0] < 100  # not 5000 young objects waiting to be scanned
    oldest = {id(o) for o in gc.get_objects(generation=2)}
    assert id(built) in oldest and all(id(x) in oldest for x in built)
    assert gc.get_freeze_count() == 0


def test_a_cycle_built_inside_is_still_collected(collector_on):
    with gc_paused():
        box = _Box()
        box.me = box
        alive = weakref.ref(box)
    del box
    assert alive() is not None  # a cycle: only the collector frees it
    gc.collect()
    assert alive() is None


def test_nested_pauses_and_a_disabled_collector_are_left_alone(collector_on):
    with gc_paused():
        with gc_paused():
            pass
        assert not gc.isenabled()  # the inner pause does not re-enable it
    assert gc.isenabled()
    gc.disable()
    try:
        young = [[] for _ in range(300)]
        with gc_paused():
            pass
        assert not gc.isenabled()
        assert id(young) not in {id(o) for o in gc.get_objects(generation=2)}  # nothing moved
    finally:
        gc.enable()


def test_the_callers_frozen_objects_stay_frozen(collector_on):
    kept = [[] for _ in range(100)]
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen >= len(kept)
        with gc_paused():
            [[] for _ in range(100)]
        # still frozen: absent from the collector's generations (the count alone can drop while
        # the pause runs, when anything frozen earlier in the process is freed by refcount)
        assert not any(o is kept or o is kept[0] for o in gc.get_objects())
        assert gc.get_freeze_count() > 0
        assert gc.isenabled()
    finally:
        gc.unfreeze()
