"""The shortcut lowering takes for speed builds exactly what the plain way builds: `Op.make`
the op `__init__` makes, for every kind, and a subclass's `make` the subclass."""

from __future__ import annotations

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
