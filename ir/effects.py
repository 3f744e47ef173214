"""Turn every ordering rule into an explicit effect edge, once, from the program's first order.

Each op has effects on resources, as MLIR's memory effects:
- storages (alias classes): `storage` — two ops that touch one storage, at least one of them
  writing it, keep their order; `free` — every access of a storage precedes its free. What a
  storage is (roots, `maybe` views, results that `may_alias` others) and the walk that makes
  these edges live in ir/storage.py;
- `regather` — a gather follows the latest earlier free of each of its parameters;
- `collective-order` — non-gather collectives (and opaque ones) of one process group keep
  their relative order; one whose group is unknown orders against every group. An FSDP
  gradient reduce-scatter marked `unordered` (`Launch.unordered`) keeps its place among the
  group's other collectives but not among the other unordered ones (`collective_order`);
- `p2p-order` — the wait of a send or a receive (`isend`/`irecv`) follows every send and
  receive of its group (of every group, for one of unknown group) traced before it: it blocks
  until the peer posts the matching op, and the peer runs the same schedule, so a wait moved
  above a send the peer needs first waits for a send no rank has posted (a ring exchange,
  `irecv; wait; isend`, hung on 2 gloo ranks). The launches keep their order already
  (`collective-order`); an edge from the last one before the wait orders them all;
- `rng-order` — random ops keep their order (they share the generator);
- `barrier` — unknown state (tagged barriers, calls fxsched cannot see into): nothing crosses;
- `phase` — forward before `^backward` before backward; `entry`/`output` — inputs first and
  in their order, output last.
Edges are a transitive reduction where that is cheap, so the graph stays O(N) and deriving
them is O(N + uses).
"""

from __future__ import annotations

from itertools import compress
from operator import itemgetter

from .opclass import is_point_to_point
from .ops import Barrier, Compute, Free, Input, Launch, Marker, Op, Opaque, Output, Phase, Wait
from .program import EFFECT, IRGraph, Program, Schedule, _clear_cache, _effect_attrs
from .storage import _storage_edges

ENTRY = "^entry"
BACKWARD = "^backward"


def place_markers(program: Program) -> None:
    """Put `^entry` after the inputs and `^backward` before the first backward op, if absent."""
    _place_markers(program)


def _place_markers(program: Program, ops: list[Op] | None = None,
                   numbers: list[int] | None = None) -> tuple[list[str], list[Op], list[int] | None]:
    """`place_markers`, returning the new schedule's names and their ops, position by position:
    the rules below walk the two lists side by side (a lookup per name in the graph's dicts cost
    as much as a rule at 100k nodes). `ops`: the schedule's ops, when the caller has them.
    `numbers`: the schedule's nodes' numbers (`_Numbered`), when the caller has them: returned
    moved as the names are, with the markers' (the graph adds them last); else None."""
    order = program.schedule.names()
    node = program.graph._node
    ops = list(map(itemgetter("op"), map(node.__getitem__, order))) if ops is None else list(ops)
    reordered, added = False, []
    if ENTRY not in node:
        kinds = list(map(type, ops))
        is_input = {k: issubclass(k, Input) for k in set(kinds)}
        flags = list(map(is_input.__getitem__, kinds))
        count = flags.count(True)
        if False in flags[:count]:  # an input after a non-input
            program.notes.append("inputs were not all first: moved them to the top")
            first = [at for at, flag in enumerate(flags) if flag]
            rest = [at for at, flag in enumerate(flags) if not flag]
            order, ops = [order[at] for at in first + rest], [ops[at] for at in first + rest]
            if numbers is not None:
                numbers = [numbers[at] for at in first + rest]
            reordered = True
        if numbers is not None:
            numbers.insert(count, len(node))
        marker = program.add(Marker(name=ENTRY))
        order.insert(count, ENTRY)
        ops.insert(count, marker)
        added.append(ENTRY)
    if BACKWARD not in node:
        backward = Phase.BACKWARD
        first = next((at for at, op in enumerate(ops) if op.phase is backward and _phased(op)), None)
        if first is not None:
            if numbers is not None:
                numbers.insert(first, len(node))
            marker = program.add(Marker(name=BACKWARD, phase=Phase.BACKWARD))
            order.insert(first, BACKWARD)
            ops.insert(first, marker)
            added.append(BACKWARD)
    _insert_markers(program, order, added, reordered)
    return order, ops, numbers


def _insert_markers(program: Program, order: list[str], added: list[str], reordered: bool) -> None:
    """Make `order` (the schedule plus the markers just added) the program's schedule: each
    marker put in before the name after it, the later first (a few hundred names re-indexed;
    building the order afresh re-indexed all of it, as lowering had just done), unless the
    inputs were moved or a marker is last; then a new schedule of `order`."""
    schedule = program.schedule
    markers = sorted(map(order.index, added))
    if reordered or type(schedule) is not Schedule or (markers and markers[-1] == len(order) - 1):
        program.schedule = type(schedule)(order)
        return
    for at in reversed(markers):
        schedule.insert_before(order[at], order[at + 1])
    schedule.take_moved()  # as a new schedule: nothing moved yet


_UNPHASED = (Input, Marker, Output)


def _phased(op: Op) -> bool:
    return not isinstance(op, _UNPHASED)


def derive_effects(program: Program, ops: list[Op] | None = None,
                   operands: list[tuple[int, ...]] | None = None) -> None:
    """Add the effect edges of every rule, reading the current schedule as the original order.
    `ops`: the program's ops in that order, when the caller has them (lowering just made them).
    `operands` (with `ops`, which then are every node of the graph, in the order the graph holds
    them too): each op's operands' positions in `ops`, when the graph has no edge but their data
    edges (lowering: it numbers its nodes anyway, and need not look their names up again)."""
    numbers = list(range(len(ops))) if operands is not None else None
    order, ops, numbers = _place_markers(program, ops, numbers)
    try:
        _derive(program, _Numbered(program, order, ops, numbers, operands), ops)
    finally:  # the edges went into networkx's dicts directly (as `Program.add_effect` does)
        _clear_cache(program.graph)


def _derive(program: Program, g: _Numbered, ops: list[Op]) -> None:
    """`derive_effects`'s rules, in order, on the schedule's numbers (`g.seq`) and their ops."""
    seq = g.seq
    _storage_edges(program, g, seq, ops)
    kinds = list(map(type, ops))  # the rules below pick out the ops they read in C, by class
    present = set(kinds)

    add = g.add
    last_free: dict[str, int] = {}
    previous_random = None
    for k, op in compress(zip(seq, ops), _of(kinds, present, (Compute, Free, Launch))):
        if isinstance(op, Compute):
            if op.random:
                if previous_random is not None:
                    add(previous_random, k, "rng-order")
                previous_random = k
        elif isinstance(op, Free):
            for param in op.params:
                last_free[param] = k
        elif isinstance(op, Launch) and op.is_gather:
            for param in op.params:
                if param in last_free:
                    add(last_free[param], k, "regather")

    _collective_edges(g, seq, ops, kinds, present)
    _point_to_point_edges(g, seq, ops, kinds, present)
    markers = {g.names[k]: k for k in compress(seq, _of(kinds, present, (Marker,)))}
    _barrier_and_phase_edges(g, seq, ops, markers.get(BACKWARD))
    _boundary_edges(g, seq, ops, kinds, present, markers[ENTRY] if ENTRY in markers else g.at[ENTRY])


class _Numbered:
    """The graph's nodes numbered in the order the graph holds them (a lowered program's: the
    traced order, then the markers), for the rules' walks: each operand is looked up by name
    once, then the rules index lists by number. At 100k nodes the graph's name-keyed dicts no
    longer fit the cache: a lookup by name costs ~4x what it does at 10k, as nearly every one
    misses, while lists indexed by numbers given in traced order are read mostly in the order
    they lie in memory. (The networkx graph stays the program's graph: `add` writes each edge
    into its dicts, in the order the rules make them.)

    `names`, `operands` (each node's operands' numbers, position for position with its op's
    `operands`), `succ`/`pred` (the graph's adjacency, as numbers, kept in step by `add`: a
    rule sees the edges the rules before it added, as on the graph), and `seq`, the schedule's
    numbers in its order.
    """

    __slots__ = ("names", "seq", "operands", "succ", "pred", "_succd", "_predd", "_at", "_shared")

    def __init__(self, program: Program, order: list[str], ops: list[Op], numbers: list[int] | None,
                 operands: list[tuple[int, ...]] | None):
        graph = program.graph
        # networkx adds a node to its successor and predecessor dicts at once: both hold the
        # nodes in one order, and their values line up with the names (checked: the names are
        # the same objects, so the lists compare by identity)
        self.names = list(graph._succ)
        self._succd = list(graph._succ.values())
        self._predd = (list(graph._pred.values()) if list(graph._pred) == self.names
                       else list(map(graph._pred.__getitem__, self.names)))
        self._shared = isinstance(graph, IRGraph)
        self._at: dict[str, int] | None = None
        size = len(self.names)
        if operands is not None:  # the graph's edges are these operands' data edges
            self.seq = numbers
            self.operands = operands = list(operands)
            operands += [()] * (size - len(operands))  # the markers just added
            self.pred = pred = [list(dict.fromkeys(o)) if len(o) > 1 else list(o) for o in operands]
            self.succ = succ = [[] for _ in range(size)]
            for k, before in enumerate(pred):
                for p in before:
                    succ[p].append(k)
            return
        at = self.at
        self.seq = list(map(at.__getitem__, order))
        self.operands = [()] * size
        for k, op in zip(self.seq, ops):
            self.operands[k] = tuple(map(at.__getitem__, op.operands))
        self.succ = [list(map(at.__getitem__, nbrs)) for nbrs in self._succd]
        self.pred = [list(map(at.__getitem__, nbrs)) for nbrs in self._predd]

    @property
    def at(self) -> dict[str, int]:
        """name -> number (made on first use: lowering's walks need it only for a rare name)."""
        if self._at is None:
            self._at = dict(zip(self.names, range(len(self.names))))
        return self._at

    def find(self, k: int, op: Op, name: str) -> int | None:
        """The number of `name`, which node `k` (`op`) names in a field (its writes, alias, a
        wait's launch): one of its operands nearly always; None when no node has that name."""
        try:
            return self.operands[k][op.operands.index(name)]
        except ValueError:
            return self.at.get(name)

    def add(self, before: int, after: int, why: str) -> None:
        """`Program.add_effect` of the two nodes, on the graph and on `succ`/`pred` (the caller
        clears networkx's cache once done)."""
        if before == after:
            return
        name = self.names[after]
        nbrs = self._succd[before]
        if name in nbrs:
            return
        nbrs[name] = self._predd[after][self.names[before]] = (
            _effect_attrs(why) if self._shared else {"kind": EFFECT, "why": why})
        self.succ[before].append(after)
        self.pred[after].append(before)


def _of(kinds: list[type], present: set[type], classes: tuple[type, ...]):
    """Per op (by its class, in `kinds`), whether it is an instance of `classes`: each class
    tested once, the ops mapped in C (for `compress`)."""
    table = {k: issubclass(k, classes) for k in present}
    return map(table.__getitem__, kinds)


def _collective_edges(g: _Numbered, seq: list[int], ops: list[Op], kinds: list[type],
                      present: set[type]) -> None:
    """`collective-order`: per process group, non-gather launches and opaque collectives keep
    their order (those marked `unordered` only against the others); one with no known group
    follows the latest of every group, and they follow it."""
    add = g.add
    for before, after in collective_order(compress(zip(seq, ops), _of(kinds, present, (Launch, Opaque)))):
        add(before, after, "collective-order")


def _point_to_point_edges(g: _Numbered, seq: list[int], ops: list[Op], kinds: list[type],
                          present: set[type]) -> None:
    """`p2p-order`: each wait of a send or receive follows the last send or receive of its group
    traced before it, and the last of unknown group; one of unknown group's, the last of any
    group. Those keep their order among themselves (`collective-order`), so it follows them all;
    an opaque send or receive counts among them (an opaque op's own wait, on no launch, is of
    unknown group: ordered against every collective already)."""
    if Launch not in present or Wait not in present:
        return
    latest: dict[str | None, int] = {}  # per group (None: unknown), the last send or receive so far
    last = None  # the last of any group
    p2p: dict[int, str | None] = {}  # send or receive -> its group
    add = g.add
    for k, op in compress(zip(seq, ops), _of(kinds, present, (Launch, Opaque, Wait))):
        if not isinstance(op, Wait):  # a launch, or an opaque send or receive (waited by an opaque op)
            if is_point_to_point(op.target):
                p2p[k] = op.group
                latest[op.group] = last = k
            continue
        if not p2p or op.launched_by is None:
            continue
        launch = g.find(k, op, op.launched_by)
        if launch not in p2p:
            continue
        group = p2p[launch]
        for before in ((last,) if group is None else (latest.get(group), latest.get(None))):
            if before is not None and before != launch:
                add(before, k, "p2p-order")


def collective_order(ops) -> list[tuple[str, str]]:
    """The `collective-order` edges of `ops` ((name, op) pairs in order; ops that are no
    collective, and gathers, are skipped), O(n) of them:

    - per known group, the ordered collectives form a chain;
    - an `unordered` one (`Launch.unordered`) follows the last ordered one of its group, and the
      next ordered one follows every unordered one since: so unordered ones keep their place
      among the ordered ones, not among themselves;
    - one of unknown group is ordered in every group: it follows the last ordered one of each
      group (or the unordered ones since), and what comes after it follows it.
    """
    edges: list[tuple[str, str]] = []
    latest: dict[str, str] = {}  # per group, the last ordered one since the last of unknown group
    since: dict[str, list[str]] = {}  # per group, the unordered ones after it
    unknown = None  # the last op of unknown group
    for name, op in ops:
        if isinstance(op, Launch):
            if op.is_gather:
                continue
        elif not isinstance(op, Opaque):
            continue
        group = op.group
        if group is None:
            groups = dict.fromkeys([*latest, *since])  # in the order the groups came (no hash order)
            if groups:
                for g in groups:
                    edges.extend((before, name) for before in (since.get(g) or (latest[g],)))
            elif unknown is not None:
                edges.append((unknown, name))
            latest, since, unknown = {}, {}, name
        elif getattr(op, "unordered", False):
            before = latest.get(group, unknown)
            if before is not None:
                edges.append((before, name))
            since.setdefault(group, []).append(name)
        else:
            pending = since.pop(group, None)
            if pending:
                edges.extend((before, name) for before in pending)
            else:
                before = latest.get(group, unknown)
                if before is not None:
                    edges.append((before, name))
            latest[group] = name
    return edges


# The rules below test every node's neighbours, so their per-step cost is most of
# derive_effects: they read the numbered adjacency lists and use for/else rather than
# any(generator).

def _barrier_and_phase_edges(g: _Numbered, seq: list[int], ops: list[Op], backward_marker: int | None) -> None:
    """`barrier`: a segment's last nodes (no successor in it) precede the barrier ending it, its
    first nodes (no predecessor in it) follow the barrier starting it; barriers keep their order.
    `phase`: a forward op no forward op follows precedes `^backward` (`backward_marker`, None
    when the schedule has none), a backward op no backward op precedes follows it.

    One walk for both rules: each phased op gets a code, 2 * segment + (1 if backward); a
    neighbour with the op's own code (in its segment and its phase: nearly always the first
    one looked at) answers both rules' question on that side at once, and only an op without
    one pays for the two tests. Barriers' codes are negative (-2 * (k + 1) + backward), so no
    segment test counts them and the phase bit still reads. The edges are those the two rules
    add one after the other: a plain op's barrier edges are its own, added before its phase
    test reads its neighbours (as when the barrier rule ran first); a barrier's neighbours are
    complete only once the walk is done, so barriers take their phase test after it.
    """
    add = g.add
    barriers: list[int] = []
    code: list[int | None] = [None] * len(g.names)  # every phased op's (barriers' too); None: unphased
    phased: list[int] = []  # the phased ops, in schedule order
    backward = Phase.BACKWARD
    for k, op in zip(seq, ops):
        if isinstance(op, _UNPHASED):
            continue
        if isinstance(op, Barrier):
            if barriers:
                add(barriers[-1], k, "barrier")
            barriers.append(k)
            code[k] = -2 * len(barriers) + (op.phase is backward)
        else:
            code[k] = 2 * len(barriers) + (op.phase is backward)
        phased.append(k)
    phases = backward_marker is not None
    if not barriers and not phases:
        return
    succ, pred = g.succ, g.pred
    last = len(barriers)
    for k in phased:
        c = code[k]
        if c < 0:  # a barrier: its phase test after the walk
            continue
        seg = c >> 1
        nbrs = succ[k]
        for s in nbrs:
            if code[s] == c:
                break
        else:
            if seg < last:  # the segment's last node(s): before the barrier that ends it
                for s in nbrs:
                    x = code[s]
                    if x is not None and x >> 1 == seg:
                        break
                else:
                    add(k, barriers[seg], "barrier")
            if phases and not c & 1:  # forward, and no forward op after it (barrier edge included)
                for s in nbrs:
                    x = code[s]
                    if x is not None and not x & 1:
                        break
                else:
                    add(k, backward_marker, "phase")
        nbrs = pred[k]
        for p in nbrs:
            if code[p] == c:
                break
        else:
            if seg > 0:  # the segment's first node(s): after the barrier that starts it
                for p in nbrs:
                    x = code[p]
                    if x is not None and x >> 1 == seg:
                        break
                else:
                    add(barriers[seg - 1], k, "barrier")
            if phases and c & 1:  # backward, and no backward op before it
                for p in nbrs:
                    x = code[p]
                    if x is not None and x & 1:
                        break
                else:
                    add(backward_marker, k, "phase")
    if phases:
        for k in barriers:
            if code[k] & 1:
                for p in pred[k]:
                    x = code[p]
                    if x is not None and x & 1:
                        break
                else:
                    add(backward_marker, k, "phase")
            else:
                for s in succ[k]:
                    x = code[s]
                    if x is not None and not x & 1:
                        break
                else:
                    add(k, backward_marker, "phase")


def _boundary_edges(g: _Numbered, seq: list[int], ops: list[Op], kinds: list[type], present: set[type],
                    entry: int) -> None:
    """`entry`: the inputs in their order, then `^entry` (`entry`), before every op that
    nothing but inputs precedes; `output`: every op nothing follows precedes the output."""
    add = g.add
    outputs = list(compress(seq, _of(kinds, present, (Output,))))
    inputs = list(compress(seq, _of(kinds, present, (Input,))))
    for before, after in zip(inputs, inputs[1:]):  # the raised function keeps its signature
        add(before, after, "entry")
    if inputs:
        add(inputs[-1], entry, "entry")
    is_input = [False] * len(g.names)
    for k in inputs:
        is_input[k] = True
    succ, pred = g.succ, g.pred
    for k, op in zip(seq, ops):
        if isinstance(op, Input) or k == entry:
            continue
        for p in pred[k]:  # nothing but inputs before it: after ^entry
            if not is_input[p]:
                break
        else:
            add(entry, k, "entry")
        # an op nothing follows precedes the output (once it does, it has a successor: so the
        # first output only)
        if outputs and not isinstance(op, Output) and not succ[k]:
            add(k, outputs[0], "output")
