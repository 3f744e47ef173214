"""Turn every ordering rule into an explicit effect edge, once, from the program's first order.

Rules (each edge's `why`): `free` — every reader of a storage, through its views, precedes
the free (a reader after its free is an error: the input graph reads freed memory);
`regather` — a gather follows the latest earlier free of each of its parameters;
`collective-order` — non-gather collectives keep their relative order; `rng-order` —
random ops keep theirs (they share the generator); `barrier` — nothing
crosses a barrier; `phase` — forward before `^backward` before backward; `entry`/`output` —
inputs first and in their order, output last. Edges are a transitive reduction where that is cheap, so the
graph stays O(N).
"""

from __future__ import annotations

from .ops import Barrier, Compute, Free, Input, Launch, Marker, Op, Output, Phase, View
from .program import DATA, Program

ENTRY = "^entry"
BACKWARD = "^backward"


class EffectError(ValueError):
    """The program's first order already breaks a rule (so no schedule could keep it)."""


def storage_root(program: Program, name: str) -> str:
    """The node whose storage `name` aliases (follows views to their base)."""
    while isinstance(op := program.op(name), View) and op.operands:
        name = op.operands[0]
    return name


def storage_readers(program: Program, root: str) -> set[str]:
    """Every node that reads `root`'s storage directly or through a chain of views."""
    readers: set[str] = set()
    succ, node = program.graph._succ, program.graph._node
    stack = [root]
    while stack:
        current = stack.pop()
        for user, e in succ[current].items():
            if e["kind"] != DATA or user in readers:
                continue
            readers.add(user)
            op = node[user]["op"]
            if isinstance(op, View) and op.operands[0] == current:
                stack.append(user)
    return readers


def place_markers(program: Program) -> None:
    """Put `^entry` after the inputs and `^backward` before the first backward op, if absent."""
    order = program.schedule.names()
    ops = [program.op(n) for n in order]
    if ENTRY not in program.graph:
        inputs = [n for n, op in zip(order, ops) if isinstance(op, Input)]
        rest = [n for n, op in zip(order, ops) if not isinstance(op, Input)]
        if inputs and order[: len(inputs)] != inputs:
            program.notes.append("inputs were not all first: moved them to the top")
        program.add(Marker(name=ENTRY))
        order = inputs + [ENTRY] + rest
    if BACKWARD not in program.graph:
        first = next((i for i, n in enumerate(order) if _phased(program.op(n)) and
                      program.op(n).phase is Phase.BACKWARD), None)
        if first is not None:
            program.add(Marker(name=BACKWARD, phase=Phase.BACKWARD))
            order.insert(first, BACKWARD)
    program.schedule = type(program.schedule)(order)


def _phased(op: Op) -> bool:
    return not isinstance(op, (Input, Marker, Output))


def derive_effects(program: Program) -> None:
    """Add the effect edges of every rule, reading the current schedule as the original order."""
    place_markers(program)
    graph = program.graph
    order = program.schedule.names()
    ops = {n: graph.nodes[n]["op"] for n in order}

    index = {n: i for i, n in enumerate(order)}
    for name in order:  # free: readers of the storage first
        op = ops[name]
        if isinstance(op, Free) and op.operands:
            for reader in sorted(storage_readers(program, storage_root(program, op.operands[0]))):
                if reader == name or isinstance(ops[reader], Free):  # freeing twice reads nothing
                    continue
                if index[reader] > index[name]:
                    raise EffectError(f"%{reader} reads storage that %{name} freed before it "
                                      f"(use after free in the input graph)")
                program.add_effect(reader, name, "free")

    last_free: dict[str, str] = {}
    previous_collective = previous_random = None
    for name in order:
        op = ops[name]
        if isinstance(op, Compute) and op.random:
            if previous_random is not None:
                program.add_effect(previous_random, name, "rng-order")
            previous_random = name
        elif isinstance(op, Free):
            for param in op.params:
                last_free[param] = name
        elif isinstance(op, Launch):
            if op.is_gather:
                for param in op.params:
                    if param in last_free:
                        program.add_effect(last_free[param], name, "regather")
            else:
                if previous_collective is not None:
                    program.add_effect(previous_collective, name, "collective-order")
                previous_collective = name

    _barrier_edges(program, order, ops)
    _phase_edges(program, order, ops)
    _boundary_edges(program, order, ops)


def _barrier_edges(program: Program, order: list[str], ops: dict[str, Op]) -> None:
    graph = program.graph
    segment: dict[str, int] = {}
    barriers: list[str] = []
    for name in order:
        op = ops[name]
        if isinstance(op, Barrier):
            if barriers:
                program.add_effect(barriers[-1], name, "barrier")
            barriers.append(name)
        elif _phased(op):
            segment[name] = len(barriers)
    if not barriers:
        return
    for name, seg in segment.items():
        if seg < len(barriers) and not any(segment.get(s) == seg for s in graph._succ[name]):
            program.add_effect(name, barriers[seg], "barrier")
        if seg > 0 and not any(segment.get(p) == seg for p in graph._pred[name]):
            program.add_effect(barriers[seg - 1], name, "barrier")


def _phase_edges(program: Program, order: list[str], ops: dict[str, Op]) -> None:
    if BACKWARD not in ops:
        return
    graph = program.graph
    phase = {n: op.phase for n, op in ops.items() if _phased(op) or isinstance(op, Barrier)}
    for name, ph in phase.items():
        if ph is Phase.FORWARD:
            if not any(phase.get(s) is Phase.FORWARD for s in graph._succ[name]):
                program.add_effect(name, BACKWARD, "phase")
        elif not any(phase.get(p) is Phase.BACKWARD for p in graph._pred[name]):
            program.add_effect(BACKWARD, name, "phase")


def _boundary_edges(program: Program, order: list[str], ops: dict[str, Op]) -> None:
    graph = program.graph
    outputs = [n for n in order if isinstance(ops[n], Output)]
    inputs = [n for n in order if isinstance(ops[n], Input)]
    for before, after in zip(inputs, inputs[1:]):  # the raised function keeps its signature
        program.add_effect(before, after, "entry")
    if inputs:
        program.add_effect(inputs[-1], ENTRY, "entry")
    for name in order:
        op = ops[name]
        if isinstance(op, Input) or name == ENTRY:
            continue
        if all(isinstance(ops[p], Input) for p in graph._pred[name]):
            program.add_effect(ENTRY, name, "entry")
        if not isinstance(op, Output):
            for out in outputs:
                if not graph._succ[name]:
                    program.add_effect(name, out, "output")
