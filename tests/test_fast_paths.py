"""Shortcuts taken for speed compute exactly what the plain way computes: `Op.make` builds the
op `__init__` makes, for every kind, and a subclass's `make` the subclass; overlap-reduce-scatter's
walk (`plan_waits`) works out which ops stay put and the bytes rising to them only where it asks,
and gets what one walk over the whole order gets."""

from __future__ import annotations

import random

import attrs
import pytest

from fxsched.ir import OP_KINDS, Compute, Phase, Role, TensorType


def _values(cls) -> dict:
    """A non-default value for every field of `cls`."""
    given = {"name": "x", "operands": ("a", "b"), "phase": Phase.BACKWARD, "types": (TensorType("f32", (2, 3)),),
             "writes": ("a",), "alias": "a", "params": ("p", "q"), "role": Role.REGATHER}
    values = {}
    for f in attrs.fields(cls):
        if f.name in given:
            values[f.name] = given[f.name]
        elif f.type in ("bool", bool):
            values[f.name] = True
        elif "int" in str(f.type):
            values[f.name] = 7
        elif f.converter is tuple:  # (`make` takes a field as given: a tuple field is given a tuple)
            values[f.name] = (f"{f.name}-value",)
        else:
            values[f.name] = f"{f.name}-value"
    return values


@pytest.mark.parametrize("cls", sorted(OP_KINDS.values(), key=lambda c: c.KIND), ids=lambda c: c.KIND)
def test_make_builds_what_init_builds(cls):
    values = _values(cls)
    made, built = cls.make(**values), cls(**values)
    assert type(made) is cls and made == built and hash(made) == hash(built)
    assert attrs.asdict(made, recurse=False) == attrs.asdict(built, recurse=False)
    positional = cls.make(values["name"], values["operands"], values["phase"], values["types"])
    assert positional == cls(name="x", operands=("a", "b"), phase=Phase.BACKWARD, types=values["types"])
    assert cls.make(name="y") == cls(name="y")  # every default
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        made.name = "z"


def test_make_of_a_subclass_builds_the_subclass():
    @attrs.frozen(kw_only=True)
    class Tagged(Compute):
        tag: str = "t"

    op = Tagged.make(name="x", target="aten.mm.default")
    assert type(op) is Tagged and op.tag == "t" and op.target == "aten.mm.default"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plan_waits_runs_are_the_whole_order_walk(seed):
    from fxsched.front.generate import generate_graph
    from fxsched.ir import Launch, waits_of
    from fxsched.lowering import lower
    from fxsched.passes.reduce_scatter_waits import _Runs, launches_and_waits

    program = lower(generate_graph(2000, seed=seed))
    names = program.schedule.names()
    launches = [n for n, op in launches_and_waits(program).items()
                if isinstance(op, Launch) and op.role is Role.REDUCE_SCATTER]
    launch_of = {w: launch for launch in launches for w in waits_of(program, launch)}
    rnd = random.Random(seed)
    travelling = set(rnd.sample(names, len(names) // 3))
    nbytes = {launch: rnd.randrange(1, 2**20) for launch in launches}
    assert launch_of and nbytes
    # the walk plan_waits made before: every position, first to last, then last to first
    stays, travels = [False] * len(names), True
    for i, name in enumerate(names):
        if name not in launch_of:
            stays[i], travels = not (travels or name in travelling), name in travelling
    rise = [0] * (len(names) + 1)
    for i in range(len(names) - 1, -1, -1):
        rise[i] = nbytes.get(names[i], 0) + (0 if i + 1 == len(names) or stays[i + 1] else rise[i + 1])
    assert any(stays) and not all(stays) and any(rise)
    runs = _Runs(names, launch_of, travelling, nbytes)
    asked = list(range(len(names)))
    rnd.shuffle(asked)  # in any order: what one question fills in is right for the next
    assert [runs.rise(i) for i in asked] == [rise[i] for i in asked]
    assert [runs.stays(i) for i in range(len(names))] == stays
