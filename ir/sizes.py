"""A program's sizes apart from its structure, and a way to give it other sizes.

Ranks that trace one SPMD program each with its own concrete sizes (expert parallelism's split
sizes, traced as numbers) lower programs that are equal but for the extents of their values.
The cost model and the memory simulation read those extents, so each rank's passes would price
its program differently and may order the collectives differently (runtime/agreement.py
`agree_sizes` exchanges what is here so that every rank schedules one program):

- `structure(program)`: one line per op in schedule order, its text with every extent `?`, a
  launch's `nbytes` left out and process groups numbered, then the effect edges, sorted. Two
  programs have equal lines exactly when they are equal but for sizes and the groups' names.
  `structure_digest(program)` is a digest of the same (each op's fields, not its text: a fifth of
  the time), which ranks compare before they compare lines.
- `sizes(program)`: every extent of every op's types, op by op in schedule order, and after a
  launch's extents its `nbytes` (`UNKNOWN_BYTES` when unknown). Programs of equal structure give
  lists of one length whose positions mean the same thing.
- `with_sizes(program, values)`: the program with those sizes (ops replaced where they differ).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from operator import attrgetter

import attrs

from .ops import Launch, Op, TensorType
from .program import EFFECT, Program
from .text import print_op

__all__ = ["UNKNOWN_BYTES", "op_sizes", "sizes", "structure", "structure_digest", "with_sizes"]

#: a launch's unknown `nbytes` in `sizes`: the largest int64, so that the element-wise maximum
#: over ranks is unknown where any rank does not know it (the budget holds such a gather). An
#: unknown extent is -1, the smallest: where one rank knows it, the maximum is what it knows.
UNKNOWN_BYTES = (1 << 63) - 1


def _masked_types(types: tuple[TensorType, ...]) -> str:
    text = ", ".join(str(TensorType(t.dtype, (-1,) * len(t.shape))) for t in types)
    return text if len(types) == 1 else f"({text})"


def structure(program: Program) -> list[str]:
    """The program's text without its sizes (see the module docstring). Process groups are named
    by their order of first use: on a 2-D mesh the ranks of one FSDP group hold tensor-parallel
    groups of other names, and no pass reads a group's name but to tell groups apart."""
    groups: dict[str, str] = {}
    # lowering shares one tuple of types among the ops of one type: each is masked once (the
    # ops, so their tuples, live through this call)
    masked: dict[int, str] = {}
    lines = []
    for op in program.ops():
        group = getattr(op, "group", None)
        if isinstance(op, Launch) or group is not None:  # a few ops: the rest are printed as they are
            changes = {"nbytes": None} if isinstance(op, Launch) else {}
            if group is not None:
                changes["group"] = groups.setdefault(group, f"group #{len(groups)}")
            op = attrs.evolve(op, **changes)
        line = print_op(op)
        if op.types:  # the types come last, after the last " : " (no type's text holds one)
            text = masked.get(id(op.types))
            if text is None:
                text = masked[id(op.types)] = _masked_types(op.types)
            line = f"{line.rpartition(' : ')[0]} : {text}"
        lines.append(line)
    lines += sorted(f"effect %{u} -> %{v} ({why})" for u, v, why in program.effect_edges())
    return lines


#: op class -> (a getter of all its fields, in order; where its types, nbytes and group are)
_FIELDS: dict[type, tuple] = {}


def _fields_of(cls: type) -> tuple:
    names = [f.name for f in attrs.fields(cls)]
    entry = _FIELDS[cls] = (attrgetter(*names), names.index("types"),
                            names.index("nbytes") if "nbytes" in names else None,
                            names.index("group") if "group" in names else None)
    return entry


def structure_digest(program: Program) -> str:
    """sha256 (hex) of what `structure` shows: every op's kind and fields in schedule order, its
    types as dtype and rank, a launch's nbytes left out, groups numbered by first use; then the
    effect edges in the order lowering made them (one order for equal programs)."""
    groups: dict[str, str] = {}
    masked: dict[int, tuple] = {}
    keys = []
    for op in program.ops():
        cls = type(op)
        getter, types_at, nbytes_at, group_at = _FIELDS.get(cls) or _fields_of(cls)
        values = list(getter(op))
        types = values[types_at]
        key = masked.get(id(types))
        if key is None:
            key = masked[id(types)] = tuple((t.dtype, len(t.shape)) for t in types)
        values[types_at] = key
        if nbytes_at is not None:
            values[nbytes_at] = None
        if group_at is not None and values[group_at] is not None:
            values[group_at] = groups.setdefault(values[group_at], f"group #{len(groups)}")
        keys.append((op.KIND, *values))
    edges = [(u, v, e["why"]) for u, succ in program.successors.items() for v, e in succ.items()
             if e["kind"] == EFFECT]
    return hashlib.sha256(repr((keys, edges)).encode()).hexdigest()


def op_sizes(op: Op) -> list[int]:
    """One op's part of `sizes`."""
    out = [d for t in op.types for d in t.shape]
    if isinstance(op, Launch):
        out.append(UNKNOWN_BYTES if op.nbytes is None else op.nbytes)
    return out


def sizes(program: Program) -> list[int]:
    """The program's extents and launch sizes, op by op in schedule order (module docstring)."""
    return [v for op in program.ops() for v in op_sizes(op)]


def with_sizes(program: Program, values: Sequence[int]) -> list[str]:
    """Give `program` the sizes `values` (as `sizes` lays them out), in place: each op whose sizes
    differ is replaced by one with these. Returns the names of the ops replaced, in schedule order."""
    values = list(values)
    expected = len(sizes(program))
    if len(values) != expected:
        raise ValueError(f"with_sizes: the program has {expected} sizes, {len(values)} were given")
    changed: list[str] = []
    at = 0
    # one tuple of types per distinct value, as lowering makes them (the cost model prices ops
    # alike in their types' identity once)
    interned: dict[tuple, tuple[TensorType, ...]] = {}
    for op in list(program.ops()):
        mine = op_sizes(op)
        theirs = values[at:at + len(mine)]
        at += len(mine)
        if theirs == mine:
            continue
        types, pos = [], 0
        for t in op.types:
            types.append((t.dtype, tuple(theirs[pos:pos + len(t.shape)])))
            pos += len(t.shape)
        key = tuple(types)
        if key not in interned:
            interned[key] = tuple(TensorType(dtype, shape) for dtype, shape in types)
        changes = {"types": interned[key]}
        if isinstance(op, Launch):
            changes["nbytes"] = None if theirs[-1] == UNKNOWN_BYTES else theirs[-1]
        program.replace(attrs.evolve(op, **changes))
        changed.append(op.name)
    return changed
