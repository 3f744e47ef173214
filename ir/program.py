"""A program: ops in a networkx DiGraph with `data` and `effect` edges, plus a schedule.

Legality is one question — is the schedule a topological order of the graph? — so every
ordering rule is an edge (see ir/effects.py), and passes only ever reorder the schedule.
The graph is an `IRGraph`, a DiGraph whose edges made here share one read-only attribute dict
per kind (and `why`); its `add_edge`/`add_edges_from` give an edge they change a dict of its own,
and editing a shared dict in place (`graph.edges[u, v]["why"] = ...`) raises TypeError.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import filterfalse
from typing import Any

import attrs
import networkx as nx

from .ops import Op

DATA = "data"
EFFECT = "effect"


class _SharedAttrs(dict):
    """The attribute dict of every edge of one kind (and `why`): read-only, as editing it would
    edit them all. One dict per edge was ~30 MiB and 200k allocations at 100k nodes."""

    __slots__ = ()

    def _read_only(self, *args, **kwargs):
        raise TypeError("an IR edge's attributes are shared with every edge of its kind: "
                        "give the edge a new dict instead of editing this one")

    __setitem__ = __delitem__ = __ior__ = update = setdefault = pop = popitem = clear = _read_only

    def __reduce__(self):  # copy/pickle rebuild it from a plain dict, not key by key
        return (type(self), (dict(self),))


_DATA_ATTRS = _SharedAttrs(kind=DATA)
_EFFECT_ATTRS: dict[str, _SharedAttrs] = {}  # why -> the attributes of every effect edge with it


def _effect_attrs(why: str) -> _SharedAttrs:
    attrs_ = _EFFECT_ATTRS.get(why)
    if attrs_ is None:
        attrs_ = _EFFECT_ATTRS.setdefault(why, _SharedAttrs(kind=EFFECT, why=why))
    return attrs_


class IRGraph(nx.DiGraph):
    """A networkx DiGraph whose edges may share a read-only attribute dict (see `Program.add_all`).

    networkx's `add_edge` updates an existing edge's dict in place: here an edge with a shared
    dict gets a copy of its own first, so adding an edge again (or with new attributes) works as
    on any DiGraph and leaves the other edges of its kind alone.
    """

    def add_edge(self, u_of_edge, v_of_edge, **attr):
        self._unshare(u_of_edge, v_of_edge)
        super().add_edge(u_of_edge, v_of_edge, **attr)

    def add_edges_from(self, ebunch_to_add, **attr):
        ebunch = list(ebunch_to_add)
        for e in ebunch:
            self._unshare(e[0], e[1])
        super().add_edges_from(ebunch, **attr)

    def _unshare(self, u, v) -> None:
        nbrs = self._succ.get(u)
        if nbrs is not None and type(nbrs.get(v)) is _SharedAttrs:
            nbrs[v] = self._pred[v][u] = dict(nbrs[v])


class Schedule:
    """A total order of node names with O(1) position lookup.

    Moves re-index only the span between a node's old and new place, so a pass that moves
    nodes a short way costs the distance moved, not the size of the graph.
    """

    __slots__ = ("_order", "_pos", "_moved")

    def __init__(self, names: Iterable[str] = ()):
        self._order: list[str] = list(names)
        self._pos: dict[str, int] = {n: i for i, n in enumerate(self._order)}
        self._moved: set[str] = set()

    def take_moved(self) -> set[str]:
        """The nodes `move_before` moved since the last call (then forgets them). A move keeps
        the relative order of every other node, so only rules involving these can break."""
        moved, self._moved = self._moved, set()
        return moved

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
        new._moved = set(self._moved)
        return new

    def move_before(self, names: list[str], target: str) -> None:
        """Move `names` (kept in the given order) to just before `target`."""
        moving = set(names)
        if target in moving:
            raise ValueError(f"cannot move %{target} before itself")
        self._moved |= moving
        order, pos = self._order, self._pos
        to = pos[target]
        # the window is rebuilt from slices and re-indexed by dict.update, all in C: passes move
        # nodes hundreds of places, and a Python loop per node passed over was most of their time
        if len(names) == 1:  # one node (a wait, a view): the nodes in between shift by one
            at = pos[names[0]]
            lo, hi = (at, to) if at < to else (to, at + 1)
            window = [*order[at + 1:to], *names] if at < to else [*names, *order[to:at]]
        else:
            spots = sorted(map(pos.__getitem__, names))
            lo, hi = min(spots[0], to), max(spots[-1] + 1, to)
            window = list(filterfalse(moving.__contains__, order[lo:hi]))
            if to < hi:
                at = window.index(target)
                window[at:at] = names
            else:  # target is just past the window: the moved nodes end it
                window.extend(names)
        order[lo:hi] = window
        pos.update(zip(window, range(lo, hi)))


# networkx >= 3.3 caches derived views on the graph; writing its adjacency dicts directly must
# drop them, as its own add_node / add_edge do (older releases have no cache)
_clear_cache = getattr(nx, "_clear_cache", lambda graph: None)


@attrs.define(eq=False)
class Program:
    """The IR of one graph.

    `payload` maps names, and `origin` the whole program, to whatever a lowering kept for
    raising (FX nodes and their GraphModule); the IR never looks inside them.
    """

    graph: nx.DiGraph = attrs.field(factory=IRGraph)
    schedule: Schedule = attrs.field(factory=Schedule)
    notes: list[str] = attrs.field(factory=list)
    payload: dict[str, Any] = attrs.field(factory=dict)
    origin: Any = None

    # ---- construction -------------------------------------------------------------
    def add(self, op: Op) -> Op:
        """Add an op with data edges from its operands (which must exist already)."""
        self.add_all((op,))
        return op

    def add_all(self, ops: Iterable[Op]) -> None:
        """`add` each op in turn."""
        # What graph.add_node and graph.add_edge do, on networkx's adjacency dicts directly:
        # lowering adds every node and most edges here, and their general-purpose argument
        # handling was a third of the cost. Same adjacency dicts, filled in the same order; an
        # edge's attributes are the one shared dict of its kind.
        graph = self.graph
        succ, pred, node = graph._succ, graph._pred, graph._node
        shared = isinstance(graph, IRGraph)  # a plain DiGraph (given by a caller) gets a dict per edge
        try:
            for op in ops:
                name = op.name
                if name in succ:
                    raise ValueError(f"duplicate op name %{name}")
                succ[name] = {}
                into = pred[name] = {}
                node[name] = {"op": op}
                for operand in op.operands:
                    if operand not in succ:
                        raise ValueError(f"%{name} uses %{operand}, which is not defined")
                    succ[operand][name] = into[operand] = _DATA_ATTRS if shared else {"kind": DATA}
        finally:
            _clear_cache(graph)

    def add_effect(self, before: str, after: str, why: str) -> None:
        """Order `before` ahead of `after`; a data edge already orders them."""
        graph = self.graph
        succ = graph._succ
        if before == after or (before in succ and after in succ[before]):
            return
        if before in succ and after in succ:  # graph.add_edge, directly (as in `add`)
            succ[before][after] = graph._pred[after][before] = (
                _effect_attrs(why) if isinstance(graph, IRGraph) else {"kind": EFFECT, "why": why})
            _clear_cache(graph)
        else:  # let networkx add the missing node(s) as it always has
            graph.add_edge(before, after, kind=EFFECT, why=why)

    # ---- access -------------------------------------------------------------------
    def op(self, name: str) -> Op:
        # the raw node dict: networkx's `graph.nodes[...]` view costs more than the lookup,
        # and passes ask for ops hundreds of thousands of times on a large graph
        return self.graph._node[name]["op"]

    def ops(self) -> Iterator[Op]:
        """Ops in schedule order."""
        nodes = self.graph._node
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

    def private_feeders(self, name: str, kinds: tuple[type, ...]) -> set[str]:
        """`name` and the ops of `kinds` that feed only it, directly or through each other
        (what travels with it when it moves: a launch's views or casts)."""
        feeders, stack = {name}, [name]
        while stack:
            for p in self.graph.pred[stack.pop()]:
                if p not in feeders and isinstance(self.op(p), kinds) and set(self.users(p)) <= feeders:
                    feeders.add(p)
                    stack.append(p)
        return feeders

    # networkx's adjacency dicts themselves, for the hot loops of passes and analyses (its
    # views cost more than the loops): read them, never write them — `add`, `add_effect` and
    # `replace` keep them consistent
    @property
    def successors(self) -> dict[str, dict[str, dict]]:
        """name -> {successor: edge attributes (`kind`, and `why` for an effect)}."""
        return self.graph._succ

    @property
    def predecessors(self) -> dict[str, dict[str, dict]]:
        """name -> {predecessor: edge attributes}."""
        return self.graph._pred

    @property
    def node_data(self) -> dict[str, dict]:
        """name -> {"op": Op}."""
        return self.graph._node

    def size(self) -> tuple[int, int]:
        """(ops, edges), counted off the adjacency (networkx's number_of_edges walks a view)."""
        return len(self.graph._node), sum(map(len, self.graph._succ.values()))

    def effect_edges(self) -> list[tuple[str, str, str]]:
        return [(u, v, e["why"]) for u, v, e in self.graph.edges(data=True) if e["kind"] == EFFECT]

    def copy(self) -> Program:
        return Program(self.graph.copy(), self.schedule.copy(), list(self.notes), dict(self.payload), self.origin)

    def __str__(self) -> str:
        from .text import print_program

        return print_program(self)
