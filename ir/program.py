"""A program: ops in a networkx DiGraph with `data` and `effect` edges, plus a schedule.

Legality is one question — is the schedule a topological order of the graph? — so every
ordering rule is an edge (see ir/effects.py), and passes only ever reorder the schedule.
The graph is an `IRGraph`, a DiGraph whose edges made here share one read-only attribute dict
per kind (and `why`); its `add_edge`/`add_edges_from` give an edge they change a dict of its own,
and editing a shared dict in place (`graph.edges[u, v]["why"] = ...`) raises TypeError.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Iterator
from itertools import chain, compress, cycle, filterfalse, repeat
from operator import attrgetter, itemgetter
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

    def copy(self, as_view=False):
        """DiGraph.copy (node and edge attribute dicts copied, same iteration order), made from
        the adjacency dicts directly: a rewriting pass copies the program per candidate, and
        networkx's edge-by-edge copy was most of its time. A shared edge dict is read-only, so
        the copy shares it too."""
        if as_view:
            return super().copy(as_view=True)
        new = self.__class__()
        new.graph.update(self.graph)
        new._node.update((n, d.copy()) for n, d in self._node.items())
        succ = {u: {v: e if type(e) is _SharedAttrs else e.copy() for v, e in nbrs.items()}
                for u, nbrs in self._succ.items()}
        new._succ = new._adj = succ
        new._pred = {v: {u: succ[u][v] for u in nbrs} for v, nbrs in self._pred.items()}
        _clear_cache(new)
        return new


class _Block:
    """A run of consecutive names of a schedule: the names, the position of the first, the
    block's place in the schedule's list of blocks, and its key (see `Schedule._block`)."""

    __slots__ = ("names", "start", "at", "key")

    def __init__(self, names: list[str], start: int, at: int, key: int):
        self.names, self.start, self.at, self.key = names, start, at, key


_BLOCK = 128  # names per block as built; a block that grows to twice this is split


class Schedule:
    """A total order of node names with O(1) position lookup.

    The order is kept in blocks of about a hundred names; a name's position is its block's start
    plus its offset in the block. A move re-indexes only the blocks it takes names out of and puts
    them into, and shifts the starts of the blocks in between: a pass that moves a gather 10k
    nodes earlier costs a few hundred writes, not 10k (one flat list re-indexed the whole span, and
    the default pipeline's long moves made it quadratic: 38 of 47 s at 100k nodes).
    """

    __slots__ = ("_blocks", "_keyed", "_block", "_off", "_moved", "_flat")

    def __init__(self, names: Iterable[str] = ()):
        order = list(names)
        self._blocks: list[_Block] = []
        # name -> its block's key, an index into `_keyed` (key -> block; None once dropped): a
        # key never changes, so a copy copies this table as it is (a dict copy) where one keyed
        # by the blocks themselves was rebuilt name by name, 22 ms at 100k nodes
        self._keyed: list[_Block | None] = []
        self._block: dict[str, int] = {}
        self._off: dict[str, int] = dict(zip(order, cycle(range(_BLOCK))))  # name -> offset in its block
        for at, start in enumerate(range(0, len(order), _BLOCK)):
            block = _Block(order[start:start + _BLOCK], start, at, at)
            self._blocks.append(block)
            self._keyed.append(block)
            self._block.update(dict.fromkeys(block.names, at))
        self._moved: set[str] = set()
        self._flat: list[str] | None = order  # the whole order, until a move; never changed in place

    def take_moved(self) -> set[str]:
        """The nodes `move_before` moved since the last call (then forgets them). A move keeps
        the relative order of every other node, so only rules involving these can break."""
        moved, self._moved = self._moved, set()
        return moved

    def _order(self) -> list[str]:
        if self._flat is None:
            self._flat = list(chain.from_iterable(b.names for b in self._blocks))
        return self._flat

    def __len__(self) -> int:
        last = self._blocks[-1] if self._blocks else None
        return last.start + len(last.names) if last else 0

    def __iter__(self) -> Iterator[str]:
        return iter(self._order())

    def __getitem__(self, index):
        if self._flat is not None or not isinstance(index, int):
            return self._order()[index]
        size = len(self)
        if index < 0:
            index += size
        if not 0 <= index < size:
            raise IndexError("schedule index out of range")
        block = self._blocks[bisect_right(self._blocks, index, key=_start) - 1]
        return block.names[index - block.start]

    def __contains__(self, name: str) -> bool:
        return name in self._off

    def __eq__(self, other) -> bool:
        return isinstance(other, Schedule) and len(self) == len(other) and self._order() == other._order()

    def index(self, name: str) -> int:
        return self._keyed[self._block[name]].start + self._off[name]

    def names(self) -> list[str]:
        return list(self._order())

    def copy(self) -> Schedule:
        new = Schedule.__new__(Schedule)
        new._keyed = [b and _Block(list(b.names), b.start, b.at, b.key) for b in self._keyed]
        new._blocks = [new._keyed[b.key] for b in self._blocks]
        new._block = dict(self._block)
        new._off = dict(self._off)
        new._moved = set(self._moved)
        new._flat = self._flat
        return new

    def adopt(self, other: Schedule) -> None:
        """Take `other`'s order as this schedule's, in place (those holding this schedule see
        the new order); what `other` moved counts as moved here too. `other` must not be used
        after: the two would share their blocks. (prefetch takes the order budget planned.)"""
        self._blocks, self._keyed, self._block, self._off = other._blocks, other._keyed, other._block, other._off
        self._flat = other._flat
        self._moved |= other._moved

    def move_before(self, names: list[str], target: str) -> None:
        """Move `names` (kept in the given order) to just before `target`."""
        keyed, block_of, off = self._keyed, self._block, self._off
        if len(names) == 1:  # (sink's and overlap-reduce-scatter's moves: no set, no table of sources)
            name = names[0]
            if name == target:
                raise ValueError(f"cannot move %{target} before itself")
            block, into = keyed[block_of[name]], keyed[block_of[target]]
            if block is into:
                self._move_within(name, target, into)
            else:
                self._move_one(name, block, target, into)
            return
        moving = set(names)
        if target in moving:
            raise ValueError(f"cannot move %{target} before itself")
        sources: dict[_Block, int] = {}  # block -> lowest offset a name leaves it from
        for name in names:
            block, at = keyed[block_of[name]], off[name]
            if sources.get(block, at) >= at:
                sources[block] = at
        self._moved |= moving
        self._flat = None
        # out of their blocks (in C: each block filtered), then the rest re-indexed
        for block, lo in sources.items():
            block.names[lo:] = filterfalse(moving.__contains__, block.names[lo:])
            off.update(zip(block.names[lo:], range(lo, len(block.names))))
        # into the target's block, just before it
        into, at = keyed[block_of[target]], off[target]
        into.names[at:at] = names
        block_of.update(dict.fromkeys(names, into.key))
        off.update(zip(into.names[at:], range(at, len(into.names))))
        # names moved only between the touched blocks: the starts of those after the first change
        blocks = self._blocks
        first = min(into.at, min(b.at for b in sources))
        last = max(into.at, max(b.at for b in sources))
        for k in range(first + 1, last + 1):
            before = blocks[k - 1]
            blocks[k].start = before.start + len(before.names)
        if len(into.names) >= 2 * _BLOCK:
            self._split(into)
        if any(not b.names for b in sources):
            self._drop_empty()

    def _move_one(self, name: str, block: _Block, target: str, into: _Block) -> None:
        """`move_before([name], target)` where `target` is in another block: `name` leaves
        `block` (the names after it there shift down one), goes into `into` just before
        `target` (the names from there shift up one), and the starts of the blocks between
        shift by one."""
        self._moved.add(name)
        self._flat = None
        off = self._off
        names, lo = block.names, off[name]
        del names[lo]
        off.update(zip(names[lo:], range(lo, len(names))))
        names, at = into.names, off[target]
        names.insert(at, name)
        self._block[name] = into.key
        off.update(zip(names[at:], range(at, len(names))))
        blocks = self._blocks
        if into.at < block.at:
            for later in blocks[into.at + 1:block.at + 1]:
                later.start += 1
        else:
            for later in blocks[block.at + 1:into.at + 1]:
                later.start -= 1
        if len(names) >= 2 * _BLOCK:
            self._split(into)
        if not block.names:
            self._drop_empty()

    def _move_within(self, name: str, target: str, block: _Block) -> None:
        """`move_before([name], target)` where both are in `block`: only the names between the
        two places shift, and no other block changes (sink's moves are mostly such short ones)."""
        self._moved.add(name)
        self._flat = None
        names, off = block.names, self._off
        lo, at = off[name], off[target]
        del names[lo]
        if lo < at:  # later: the target moved up one
            names.insert(at - 1, name)
            off.update(zip(names[lo:at], range(lo, at)))
        else:
            names.insert(at, name)
            off.update(zip(names[at:lo + 1], range(at, lo + 1)))

    def insert_before(self, name: str, target: str) -> None:
        """Add a new name just before `target` (the rewriter's `create`): one block re-indexed."""
        into, at = self._keyed[self._block[target]], self._off[target]
        into.names.insert(at, name)
        self._block[name] = into.key
        self._off.update(zip(into.names[at:], range(at, len(into.names))))
        for block in self._blocks[into.at + 1:]:
            block.start += 1
        self._flat = None
        if len(into.names) >= 2 * _BLOCK:
            self._split(into)

    def remove(self, name: str) -> None:
        """Take a name out (the rewriter's `erase`): one block re-indexed."""
        block, at = self._keyed[self._block.pop(name)], self._off.pop(name)
        del block.names[at]
        self._off.update(zip(block.names[at:], range(at, len(block.names))))
        for later in self._blocks[block.at + 1:]:
            later.start -= 1
        self._moved.discard(name)
        self._flat = None
        if not block.names:
            self._drop_empty()

    def _split(self, block: _Block) -> None:
        half = len(block.names) // 2
        new = _Block(block.names[half:], block.start + half, block.at + 1, len(self._keyed))
        del block.names[half:]
        self._keyed.append(new)
        self._block.update(dict.fromkeys(new.names, new.key))
        self._off.update(zip(new.names, range(len(new.names))))
        self._blocks.insert(new.at, new)
        for k in range(new.at + 1, len(self._blocks)):
            self._blocks[k].at = k

    def _drop_empty(self) -> None:
        for b in self._blocks:
            if not b.names:
                self._keyed[b.key] = None
        self._blocks = [b for b in self._blocks if b.names]
        for k, b in enumerate(self._blocks):
            b.at = k


_start = attrgetter("start")
_OP = itemgetter("op")


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
    # anchor -> the launches anchored at it, made on first use (`anchored_at`), kept by `add`
    # and `replace`; an entry whose launch was removed or re-anchored since is skipped on read
    _anchored: dict[str, set[str]] | None = attrs.field(default=None, init=False, repr=False)
    # the barriers in schedule order, found on first use (`barriers`): barriers never move, and
    # adding one drops the list
    _barriers: list[str] | None = attrs.field(default=None, init=False, repr=False)

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
                if self._anchored is not None and getattr(op, "anchor", None) is not None:
                    self._anchored.setdefault(op.anchor, set()).add(name)
                if op.KIND == "barrier":
                    self._barriers = None
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
        # picked out in C (no generator step per op): callers walk every op of a large graph
        return map(_OP, map(self.graph._node.__getitem__, self.schedule))

    def replace(self, op: Op) -> None:
        """Swap in a new version of an op (same name and operands), e.g. from attrs.evolve."""
        # the node's own attribute dict, looked up once (the passes replace ~19k launch ops at
        # 100k nodes; networkx's `graph.nodes` view was a second lookup by name)
        data = self.graph._node[op.name]
        if data["op"].operands != op.operands:
            raise ValueError(f"replace(%{op.name}) may not change operands")
        data["op"] = op
        if self._anchored is not None and getattr(op, "anchor", None) is not None:
            self._anchored.setdefault(op.anchor, set()).add(op.name)

    def barriers(self) -> list[str]:
        """The barriers in schedule order (found once: they never move; the rewriter neither
        creates nor erases one, and `add` of one finds them again)."""
        if self._barriers is None:
            node = self.graph._node
            self._barriers = [n for n in self.schedule.names() if node[n]["op"].KIND == "barrier"]
        return self._barriers

    def anchored_at(self, name: str) -> list[str]:
        """The launches whose anchor is `name`, sorted by name (an index made once, then kept)."""
        if self._anchored is None:
            self._anchored = {}
            for node_name, data in self.graph._node.items():
                anchor = getattr(data["op"], "anchor", None)
                if anchor is not None:
                    self._anchored.setdefault(anchor, set()).add(node_name)
        node = self.graph._node
        return sorted(n for n in self._anchored.get(name, ()) if n in node and getattr(node[n]["op"], "anchor", None) == name)

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
        node, succ = self.graph._node, self.graph._succ
        while stack:
            for p in self.graph._pred[stack.pop()]:
                # its data users as a set: `users` sorts them by position, which a subset test ignores
                if (p not in feeders and isinstance(node[p]["op"], kinds)
                        and {u for u, e in succ[p].items() if e["kind"] == DATA} <= feeders):
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

    def ops_of(self, kinds: type | tuple[type, ...]) -> list[Op]:
        """The ops that are `kinds`, in the node table's order (not the schedule's), picked out in
        C: a lookup of each op by name in schedule order is a cache miss or two per node at 100k
        nodes (40 ms), where the table's values are read in 9; a caller that needs the few it
        picks in schedule order sorts them by position."""
        ops = list(map(_OP, self.graph._node.values()))
        return list(compress(ops, map(isinstance, ops, repeat(kinds))))

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
