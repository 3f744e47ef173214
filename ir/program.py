"""A program: ops in a networkx DiGraph with `data` and `effect` edges, plus a schedule.

Legality is one question — is the schedule a topological order of the graph? — so every
ordering rule is an edge (see ir/effects.py), and passes only ever reorder the schedule.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import attrs
import networkx as nx

from .ops import Op

DATA = "data"
EFFECT = "effect"


class Schedule:
    """A total order of node names with O(1) position lookup.

    Moves re-index only the span between a node's old and new place, so a pass that moves
    nodes a short way costs the distance moved, not the size of the graph.
    """

    __slots__ = ("_order", "_pos")

    def __init__(self, names: Iterable[str] = ()):
        self._order: list[str] = list(names)
        self._pos: dict[str, int] = {n: i for i, n in enumerate(self._order)}

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def __getitem__(self, index):
        return self._order[index]

    def __contains__(self, name: str) -> bool:
        return name in self._pos

    def __eq__(self, other) -> bool:
        return isinstance(other, Schedule) and self._order == other._order

    def index(self, name: str) -> int:
        return self._pos[name]

    def names(self) -> list[str]:
        return list(self._order)

    def copy(self) -> Schedule:
        new = Schedule.__new__(Schedule)
        new._order = list(self._order)
        new._pos = dict(self._pos)
        return new

    def move_before(self, names: list[str], target: str) -> None:
        """Move `names` (kept in the given order) to just before `target`."""
        moving = set(names)
        if target in moving:
            raise ValueError(f"cannot move %{target} before itself")
        spots = sorted(self._pos[n] for n in names)
        lo = min(spots[0], self._pos[target])
        hi = max(spots[-1] + 1, self._pos[target])
        window = [n for n in self._order[lo:hi] if n not in moving]
        if self._pos[target] < hi:
            at = window.index(target)
            window[at:at] = names
        else:  # target is just past the window: the moved nodes end it
            window.extend(names)
        self._order[lo:hi] = window
        for offset, name in enumerate(window, lo):
            self._pos[name] = offset


@attrs.define(eq=False)
class Program:
    """The IR of one graph.

    `payload` maps names, and `origin` the whole program, to whatever a lowering kept for
    raising (FX nodes and their GraphModule); the IR never looks inside them.
    """

    graph: nx.DiGraph = attrs.field(factory=nx.DiGraph)
    schedule: Schedule = attrs.field(factory=Schedule)
    notes: list[str] = attrs.field(factory=list)
    payload: dict[str, Any] = attrs.field(factory=dict)
    origin: Any = None

    # ---- construction -------------------------------------------------------------
    def add(self, op: Op) -> Op:
        """Add an op with data edges from its operands (which must exist already)."""
        if op.name in self.graph:
            raise ValueError(f"duplicate op name %{op.name}")
        self.graph.add_node(op.name, op=op)
        for operand in op.operands:
            if operand not in self.graph:
                raise ValueError(f"%{op.name} uses %{operand}, which is not defined")
            self.graph.add_edge(operand, op.name, kind=DATA)
        return op

    def add_effect(self, before: str, after: str, why: str) -> None:
        """Order `before` ahead of `after`; a data edge already orders them."""
        if before == after or self.graph.has_edge(before, after):
            return
        self.graph.add_edge(before, after, kind=EFFECT, why=why)

    # ---- access -------------------------------------------------------------------
    def op(self, name: str) -> Op:
        return self.graph.nodes[name]["op"]

    def ops(self) -> Iterator[Op]:
        """Ops in schedule order."""
        nodes = self.graph.nodes
        return (nodes[n]["op"] for n in self.schedule)

    def replace(self, op: Op) -> None:
        """Swap in a new version of an op (same name and operands), e.g. from attrs.evolve."""
        old = self.op(op.name)
        if old.operands != op.operands:
            raise ValueError(f"replace(%{op.name}) may not change operands")
        self.graph.nodes[op.name]["op"] = op

    def users(self, name: str) -> list[str]:
        """Data users of `name`, in schedule order."""
        succ = self.graph.succ[name]
        users = [n for n, e in succ.items() if e["kind"] == DATA]
        users.sort(key=self.schedule.index)
        return users

    def effect_edges(self) -> list[tuple[str, str, str]]:
        return [(u, v, e["why"]) for u, v, e in self.graph.edges(data=True) if e["kind"] == EFFECT]

    def copy(self) -> Program:
        return Program(self.graph.copy(), self.schedule.copy(), list(self.notes), dict(self.payload), self.origin)

    def __str__(self) -> str:
        from .text import print_program

        return print_program(self)
