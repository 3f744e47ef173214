"""A program's sizes apart from its structure, and a way to give it other sizes.

Ranks that trace one SPMD program each with its own concrete sizes (expert parallelism's split
sizes, traced as numbers) lower programs that are equal but for the extents of their values.
The cost model and the memory simulation read those extents, so each rank's passes would price
its program differently and may order the collectives differently (runtime/agreement.py
`agree_sizes` exchanges what is here so that every rank schedules one program):

- `structure(program)`: one line per op in schedule order, its text with every extent `?`, a
  launch's `nbytes` left out and process groups numbered, then the effect edges, sorted. Two
  programs have equal lines exactly when they are equal but for sizes and the groups' names.
- `sizes(program)`: every extent of every op's types, op by op in schedule order, and after a
  launch's extents its `nbytes` (`UNKNOWN_BYTES` when unknown). Programs of equal structure give
  lists of one length whose positions mean the same thing.
- `with_sizes(program, values)`: the program with those sizes (ops replaced where they differ).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from .ops import Launch, Op, TensorType
from .program import Program
from .text import print_op

__all__ = ["UNKNOWN_BYTES", "op_sizes", "sizes", "structure", "with_sizes"]

#: a launch's unknown `nbytes` in `sizes`: the largest int64, so that the element-wise maximum
#: over ranks is unknown where any rank does not know it (the budget holds such a gather). An
#: unknown extent is -1, the smallest: where one rank knows it, the maximum is what it knows.
UNKNOWN_BYTES = (1 << 63) - 1


def _masked(op: Op, groups: dict[str, str]) -> Op:
    changes = {"types": tuple(TensorType(t.dtype, (-1,) * len(t.shape)) for t in op.types)}
    if isinstance(op, Launch):
        changes["nbytes"] = None
    group = getattr(op, "group", None)
    if group is not None:
        changes["group"] = groups.setdefault(group, f"group #{len(groups)}")
    return attrs.evolve(op, **changes)


def structure(program: Program) -> list[str]:
    """The program's text without its sizes (see the module docstring). Process groups are named
    by their order of first use: on a 2-D mesh the ranks of one FSDP group hold tensor-parallel
    groups of other names, and no pass reads a group's name but to tell groups apart."""
    groups: dict[str, str] = {}
    lines = [print_op(_masked(op, groups)) for op in program.ops()]
    lines += sorted(f"effect %{u} -> %{v} ({why})" for u, v, why in program.effect_edges())
    return lines


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
