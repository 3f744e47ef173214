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

from .errors import InputError
from .ops import Barrier, Compute, Free, Input, Launch, Marker, Op, Output, Phase, View
from .program import DATA, Program

ENTRY = "^entry"
BACKWARD = "^backward"


class EffectError(InputError):
    """The program's first order already breaks a rule (so no schedule could keep it)."""


def storage_root(program: Program, name: str) -> str:
    """The node whose storage `name` aliases (follows views to their base)."""
    node = program.graph._node
    while isinstance(op := node[name]["op"], View) and op.operands:
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
    _place_markers(program)


def _place_markers(program: Program) -> dict[str, Op]:
    """`place_markers`, returning the op of every name in the new schedule (derive_effects
    reads them all, and looking each up in the graph again cost as much as a rule)."""
    order = program.schedule.names()
    node = program.graph._node
    ops = {n: node[n]["op"] for n in order}
    if ENTRY not in program.graph:
        inputs = [n for n in order if isinstance(ops[n], Input)]
        if order[: len(inputs)] == inputs:  # as lowering leaves them: the rest is what follows
            rest = order[len(inputs):]
        else:
            program.notes.append("inputs were not all first: moved them to the top")
            rest = [n for n in order if not isinstance(ops[n], Input)]
        ops[ENTRY] = program.add(Marker(name=ENTRY))
        order = inputs + [ENTRY] + rest
    if BACKWARD not in program.graph:
        first = next((i for i, n in enumerate(order) if _phased(ops[n]) and ops[n].phase is Phase.BACKWARD), None)
        if first is not None:
            ops[BACKWARD] = program.add(Marker(name=BACKWARD, phase=Phase.BACKWARD))
            order.insert(first, BACKWARD)
    program.schedule = type(program.schedule)(order)
    return ops


_UNPHASED = (Input, Marker, Output)


def _phased(op: Op) -> bool:
    return not isinstance(op, _UNPHASED)


def derive_effects(program: Program) -> None:
    """Add the effect edges of every rule, reading the current schedule as the original order."""
    ops = _place_markers(program)
    order = program.schedule.names()
    index = program.schedule.index
    for name in order:  # free: readers of the storage first
        op = ops[name]
        if isinstance(op, Free) and op.operands:
            for reader in sorted(storage_readers(program, storage_root(program, op.operands[0]))):
                if reader == name or isinstance(ops[reader], Free):  # freeing twice reads nothing
                    continue
                if index(reader) > index(name):
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


# The rules below test every node's neighbours, so their per-step cost is most of
# derive_effects: they read networkx's adjacency dicts directly and use for/else rather
# than any(generator).

def _barrier_edges(program: Program, order: list[str], ops: dict[str, Op]) -> None:
    graph = program.graph
    add_effect = program.add_effect
    segment: dict[str, int] = {}
    barriers: list[str] = []
    for name in order:
        op = ops[name]
        if isinstance(op, Barrier):
            if barriers:
                add_effect(barriers[-1], name, "barrier")
            barriers.append(name)
        elif not isinstance(op, _UNPHASED):
            segment[name] = len(barriers)
    if not barriers:
        return
    succ, pred, get = graph._succ, graph._pred, segment.get
    last = len(barriers)
    for name, seg in segment.items():
        if seg < last:  # the segment's last node(s): before the barrier that ends it
            for s in succ[name]:
                if get(s) == seg:
                    break
            else:
                add_effect(name, barriers[seg], "barrier")
        if seg > 0:  # its first node(s): after the barrier that starts it
            for p in pred[name]:
                if get(p) == seg:
                    break
            else:
                add_effect(barriers[seg - 1], name, "barrier")


def _phase_edges(program: Program, order: list[str], ops: dict[str, Op]) -> None:
    if BACKWARD not in ops:
        return
    graph = program.graph
    add_effect = program.add_effect
    phase = {}  # of every phased op (barriers too), in schedule order
    for name in order:
        op = ops[name]
        if not isinstance(op, _UNPHASED):
            phase[name] = op.phase
    succ, pred, get = graph._succ, graph._pred, phase.get
    forward, backward = Phase.FORWARD, Phase.BACKWARD
    for name, ph in phase.items():
        if ph is forward:
            for s in succ[name]:
                if get(s) is forward:
                    break
            else:
                add_effect(name, BACKWARD, "phase")
        else:
            for p in pred[name]:
                if get(p) is backward:
                    break
            else:
                add_effect(BACKWARD, name, "phase")


def _boundary_edges(program: Program, order: list[str], ops: dict[str, Op]) -> None:
    graph = program.graph
    add_effect = program.add_effect
    outputs, inputs = [], []
    for name in order:
        op = ops[name]
        if isinstance(op, Output):
            outputs.append(name)
        elif isinstance(op, Input):
            inputs.append(name)
    for before, after in zip(inputs, inputs[1:]):  # the raised function keeps its signature
        add_effect(before, after, "entry")
    if inputs:
        add_effect(inputs[-1], ENTRY, "entry")
    input_names = set(inputs)
    succ, pred = graph._succ, graph._pred
    for name in order:
        op = ops[name]
        if isinstance(op, Input) or name == ENTRY:
            continue
        for p in pred[name]:  # nothing but inputs before it: after ^entry
            if p not in input_names:
                break
        else:
            add_effect(ENTRY, name, "entry")
        # an op nothing follows precedes the output (once it does, it has a successor: so the
        # first output only)
        if outputs and not isinstance(op, Output) and not succ[name]:
            add_effect(name, outputs[0], "output")
