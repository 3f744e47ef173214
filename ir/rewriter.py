"""The rewriter: the one way a pass changes a program's node set (as MLIR's PatternRewriter).

Three edits, each keeping the program verified locally, so a rewriting pass is as easy to
write and to check as a reorder-only one:

- `create(op, before=name)`: add an op (its operands must exist and come earlier in the
  schedule) with its data edges, placed in the schedule just before `name`, and the edges the
  rules of ir/effects.py give it there: its phase's side of `^backward`, the barriers around
  it, after `^entry` when it reads only inputs (a pack of shards: without them a later pass
  could move it into the forward, or across a barrier);
- `replace_uses(old, new)`: every data use of `old` reads `new` instead, ordered against the
  other accesses of `new`'s storage as ir/storage.py would have derived (a use that frees or
  writes it after every earlier reader, a read before any later free or write; a launch's
  read lasts until its wait; what reads or writes through a `maybe` view counts too), so
  nothing can move past it later; each user gets the phase,
  barrier and entry edges of its place, as a created op does (a backward view moved onto the
  forward replica by `unshard` lost its path from `^backward` with its old operand);
- `erase(name)`: remove an op no one reads; every predecessor of it (data or effect) is
  ordered before every successor by an effect edge, so whatever the erased op ordered stays
  ordered (an erased free's readers stay ahead of the gather that followed it); a launch
  anchored at it is anchored at the op after it.

A pass that replaces ops by new ones (a bucket for several gathers) also has:

- `inherit(old, new)`: `new` takes over `old`'s effect edges (what had to run before `old`
  runs before `new`, and after it, after it), refused if the schedule breaks one of them: this
  is where "never across an effect edge" is decided;
- `hoist(name, before=target)`: move an op earlier, refused if one of its predecessors is not
  scheduled before `target`.

A pass that relaxes an ordering rule for some ops says so on the ops and lets the rewriter
redo the rule's edges there:

- `unorder(names)`: mark FSDP gradient reduce-scatters `unordered` (`Launch.unordered`) and
  replace the `collective-order` edges of their groups (and of the collectives of unknown
  group) by those `effects.collective_order` gives for the schedule as it is: each new edge is
  implied by the old ones (the schedule keeps them), so nothing that was legal becomes illegal,
  and the only pairs left unordered are two unordered reduce-scatters of one group. An old edge
  that also keeps a storage rule between the two launches (one writes what the other touches:
  an edge keeps the name of the first rule that made it) stays, renamed `storage`.

A created op's payload is a `Call` (plain data: a torch op by its IR target name, arguments
with `Operand(i)` for its operands), which raising turns into an FX node.

Edges are handled generically — whatever rule made them — so the rewriter does not depend on
how effects were derived. The rewriter keeps the schedule a permutation of the nodes; the
pass manager fully re-verifies after a pass that is not `reorders_only`.

A new read of a storage needs ordering only against the storage's writes and frees, so the
rewriter keeps each storage's writers (`_writers`) between its edits instead of walking every
reader per create (a bucket's K copy-outs read one storage: that walk made a bucket O(K^2)).
The cache is dropped where an edit can change a writer set: a created op that writes or frees,
a `replace_uses` (the two storages the users move between), an `erase`. So a program must
change only through its rewriter while one is in use (each bucket and each unsharded parameter
takes a rewriter of its own).
"""

from __future__ import annotations

from bisect import bisect

import attrs

from .effects import BACKWARD, ENTRY, collective_order
from .ops import Free, Input, Launch, Op, Opaque, Phase, Wait
from .program import DATA, EFFECT, Program
from .storage import may_be, storage_accessors, storage_readers, storage_root, through_maybe
from .waits import waits_of


class RewriteError(ValueError):
    """A rewrite that would leave the program invalid (a dangling use, a use before its producer)."""


@attrs.frozen
class Operand:
    """In a `Call`'s arguments: the created op's operand number `index` (its FX value when raised)."""

    index: int


@attrs.frozen
class Call:
    """What raising builds a created op's FX node from: a call of the torch op the IR names
    `target` (`"aten.cat.default"`, `"_c10d_functional.all_gather_into_tensor.default"`) with
    `args` and `kwargs`, where `Operand(i)` stands for the op's operand i (also inside lists).
    Plain data: a pass describes the call without touching FX. Raising writes the node's tags
    from the op itself (phase, a launch's role, parameters and bucket, a copy-out's bucket)."""

    target: str
    args: tuple = attrs.field(default=(), converter=tuple)
    kwargs: dict = attrs.field(factory=dict, hash=False)


class Rewriter:
    """Edits one program; `created`, `erased` and `replaced` count what it did (for statistics)."""

    def __init__(self, program: Program):
        self.program = program
        self.created = 0
        self.erased = 0
        self.replaced = 0
        self._writer_cache: dict[str, tuple] = {}  # storage root -> its writers, and more (`_writers`; module doc)
        self._maybe_cache: dict[str, tuple[str, ...]] = {}  # storage root -> `_maybe_set`

    # ---- create -----------------------------------------------------------------------
    def create(self, op: Op, *, before: str, payload: object = None) -> Op:
        """Add `op` with data edges from its operands, scheduled just before `before`.

        `payload` is what raising builds the op's FX node from (see raising/fx.py); without
        one, raising refuses the op."""
        program = self.program
        pos = program.schedule.index
        if not op.MOVABLE:
            raise RewriteError(f"create(%{op.name}): {op.KIND} ops are never created")
        if before not in program.schedule:
            raise RewriteError(f"create(%{op.name}): %{before} is not scheduled")
        for operand in op.operands:
            if operand not in program.graph:
                raise RewriteError(f"create(%{op.name}): operand %{operand} is not defined")
            if pos(operand) >= pos(before):
                raise RewriteError(f"create(%{op.name}): operand %{operand} is not scheduled before %{before}")
        program.add(op)
        program.schedule.insert_before(op.name, before)
        if isinstance(op, Free) or getattr(op, "writes", ()):  # a new writer of some storage
            self._writer_cache.clear()
        if op.may_alias:  # a new storage that may be others (and a new reader that may be its operands')
            self._maybe_cache.clear()
            self._writer_cache.clear()
        try:  # its reads of existing storage keep their order with that storage's writes and free
            edges = [e for operand in dict.fromkeys(op.operands) for e in self._storage_order([op.name], operand)]
            if isinstance(op, Wait) and op.launched_by in program.graph:
                # the collective reads its inputs until this wait (ir/effects.py): so does the wait
                launch = program.op(op.launched_by)
                edges += [e for operand in dict.fromkeys(launch.operands)
                          for e in self._storage_order([op.name], operand)]
            edges += self._boundary_order(op)
        except RewriteError:
            program.graph.remove_node(op.name)
            program.schedule.remove(op.name)
            raise
        for first, then, why in edges:
            program.add_effect(first, then, why)
        if payload is not None:
            program.payload[op.name] = payload
        self.created += 1
        return op

    def _boundary_order(self, op: Op) -> list[tuple[str, str, str]]:
        """The phase, barrier and entry edges ir/effects.py's rules give `op` where it is
        scheduled: a forward op precedes `^backward`, a backward op follows it (RewriteError if
        its slot is on the other side); the barriers before and after its slot bound it; it
        follows `^entry` if it reads nothing but inputs."""
        if not op.MOVABLE:  # inputs, markers, the output, barriers, opaque ops: never moved
            return []
        program = self.program
        graph, name, pos = program.graph, op.name, program.schedule.index
        edges = []
        if BACKWARD in graph:
            backward = op.phase is Phase.BACKWARD
            if backward != (pos(BACKWARD) < pos(name)):
                raise RewriteError(f"create(%{name}): a {op.phase.name.lower()} op scheduled "
                                   f"{'before' if backward else 'after'} {BACKWARD}")
            edges.append((BACKWARD, name, "phase") if backward else (name, BACKWARD, "phase"))
        barriers = program.barriers()
        if barriers:
            at = bisect(barriers, pos(name), key=pos)
            if at:
                edges.append((barriers[at - 1], name, "barrier"))
            if at < len(barriers):
                edges.append((name, barriers[at], "barrier"))
        if ENTRY in graph and all(isinstance(program.op(o), Input) for o in op.operands):
            edges.append((ENTRY, name, "entry"))
        return edges

    # ---- take over an op's order ---------------------------------------------------------
    def inherit(self, old: str, new: str, *, skip: set[str] = frozenset()) -> None:
        """Give `new` every effect edge of `old` (not those to or from `skip`: the ops merged
        with it). Raises RewriteError, changing nothing, if the schedule breaks one: `new`
        would run before something `old` had to follow, or after something that had to follow it."""
        program = self.program
        graph = program.graph
        pos = program.schedule.index
        at = pos(new)
        preds = [(p, e["why"]) for p, e in graph.pred[old].items()
                 if e["kind"] == EFFECT and p not in skip and p != new]
        succs = [(s, e["why"]) for s, e in graph.succ[old].items()
                 if e["kind"] == EFFECT and s not in skip and s != new]
        for p, why in preds:
            if pos(p) >= at:
                raise RewriteError(f"%{new} would run before %{p}, which %{old} follows ({why})")
        for s, why in succs:
            if pos(s) <= at:
                raise RewriteError(f"%{new} would run after %{s}, which follows %{old} ({why})")
        for p, why in preds:
            program.add_effect(p, new, why)
        for s, why in succs:
            program.add_effect(new, s, why)

    # ---- move ---------------------------------------------------------------------------
    def hoist(self, name: str, *, before: str) -> None:
        """Move `name` earlier, to just before `before`; refused (RewriteError) if one of its
        predecessors (data or effect) is not scheduled before `before`."""
        program = self.program
        pos = program.schedule.index
        if not program.op(name).MOVABLE:
            raise RewriteError(f"hoist(%{name}): {program.op(name).KIND} ops do not move")
        if pos(name) < pos(before):
            return
        for p, e in program.graph.pred[name].items():
            if pos(p) >= pos(before):
                why = e["why"] if e["kind"] == EFFECT else "operand"
                raise RewriteError(f"hoist(%{name}) before %{before}: it follows %{p} ({why})")
        program.schedule.move_before([name], before)

    # ---- relax the collective order -----------------------------------------------------
    def unorder(self, names) -> int:
        """Mark the launches `names` (FSDP gradient reduce-scatters of a known group:
        `Launch.may_unorder`, else RewriteError, changing nothing) `unordered`, and redo the
        `collective-order` edges of their groups (see the module doc). Returns how many were
        not marked before. O(N) for the walk down the schedule, plus the groups' collectives."""
        program = self.program
        graph = program.graph
        node, succ = graph._node, graph._succ
        new = []
        for name in dict.fromkeys(names):
            op = node[name]["op"] if name in node else None
            if not isinstance(op, Launch) or not op.may_unorder:
                raise RewriteError(f"unorder(%{name}): only an FSDP reduce-scatter of a known group "
                                   f"(role fsdp_reduce_scatter, a group) may leave the collective order")
            if not op.unordered:
                new.append(op)
        if not new:
            return 0
        groups = {op.group for op in new}
        # the collectives whose collective-order edges may change: those of these groups, and
        # those of unknown group (ordered in every group), in schedule order
        affected = [(n, op) for n, op in zip(program.schedule.names(), program.ops())
                    if (isinstance(op, Opaque) or (isinstance(op, Launch) and not op.is_gather))
                    and (op.group is None or op.group in groups)]
        members = {n for n, _ in affected}
        old = [(u, v) for u, _ in affected for v, e in succ[u].items()  # in schedule order: no hash order
               if v in members and e["kind"] == EFFECT and e["why"] == "collective-order"]
        marked = {op.name: attrs.evolve(op, unordered=True) for op in new}
        edges = collective_order([(n, marked.get(n, op)) for n, op in affected])
        pos = program.schedule.index
        for before, after in edges:  # a schedule that keeps the old edges keeps these
            if pos(before) >= pos(after):
                raise RewriteError(f"unorder: %{after} is scheduled before %{before}, which it follows "
                                   f"(collective-order): the schedule breaks the program's edges")
        for op in marked.values():
            program.replace(op)
        keep = set(edges)
        for u, v in old:
            if (u, v) in keep:
                continue
            graph.remove_edge(u, v)
            if _touch_conflict(program, u, v):  # the edge kept a storage rule too
                program.add_effect(u, v, "storage")
        for before, after in edges:
            program.add_effect(before, after, "collective-order")
        return len(new)

    # ---- replace ----------------------------------------------------------------------
    def replace_uses(self, old: str, new: str, *, only: set[str] | None = None) -> list[str]:
        """Make every data user of `old` (or those in `only`) read `new`; returns the users.

        `new` must be scheduled before each such user. Each user inherits the ordering an
        access of `new`'s storage needs (see `_order_storage`)."""
        program = self.program
        graph = program.graph
        pos = program.schedule.index
        users = [u for u in program.users(old) if only is None or u in only]
        for user in users:
            if pos(new) >= pos(user):
                raise RewriteError(f"replace_uses(%{old}, %{new}): %{new} is not scheduled before its new user %{user}")
        # what a refused replace puts back: each user's op and its edges from old and new (not a
        # copy of all its predecessors: the output reads every gradient, and is replaced once per
        # reduce-scatter bucket member)
        pred = graph._pred
        saved = {user: (program.op(user), pred[user][old], pred[user].get(new)) for user in users}
        # the users (and what reads through them) move from old's storage to new's
        self._writer_cache.pop(storage_root(program, old), None)
        self._writer_cache.pop(storage_root(program, new), None)
        if any(program.op(user).may_alias for user in users):  # a result that may be old's storage, now new's
            self._maybe_cache.clear()
        else:
            self._maybe_cache.pop(storage_root(program, old), None)
            self._maybe_cache.pop(storage_root(program, new), None)
        for user in users:
            op = program.op(user)
            graph.nodes[user]["op"] = _with_operands(op, old, new)
            graph.remove_edge(old, user)
            if graph.has_edge(new, user):  # an effect edge there already: a data edge orders it too
                graph.remove_edge(new, user)
            graph.add_edge(new, user, kind=DATA)
        # a launch reads `new` until its waits (ir/effects.py): they are new accesses of it too
        waits = [w for user in users if isinstance(program.op(user), Launch) for w in waits_of(program, user)]
        try:
            edges = self._storage_order(users + waits, new)
        except RewriteError:  # leave the program as it was
            for user, (op, from_old, from_new) in saved.items():
                graph.nodes[user]["op"] = op
                graph.remove_edge(new, user)
                if from_new is not None:
                    graph.add_edge(new, user, **from_new)
                graph.add_edge(old, user, **from_old)
            raise
        for before, after, why in edges:
            program.add_effect(before, after, why)
        # a user that read a backward value may now read only forward ones: it keeps the rules
        # of its place (^backward, its barriers) by edges of its own, as a created op gets them
        for user in users:
            for before, after, why in self._boundary_order(program.op(user)):
                program.add_effect(before, after, why)
        self.replaced += len(users)
        return users

    def _storage_order(self, users: list[str], new: str) -> list[tuple[str, str, str]]:
        """The effect edges that order the new accesses of `new`'s storage (the users and what
        reads it through them, by views) against its other accesses, as ir/storage.py orders
        accesses: of two accesses where either writes (or frees) the storage, the earlier in
        the schedule goes first. What reads or writes it through a `maybe` view counts (in the
        worst case that view is one: `storage_accessors`), but a read through one after a free
        keeps no order with it (it may read a copy: a note in ir/storage.py). Raises
        RewriteError for another read or a write after a free."""
        program = self.program
        pos = program.schedule.index
        root = storage_root(program, new)
        succ = program.graph._succ
        if not any(succ[u] for u in users) and not any(_writes(program, u, root) for u in users):
            # new reads only (nothing reads through them yet): only the storage's writers order them
            others, maybe_readers = self._writers(root)
            fresh = set(users)
            writes = dict.fromkeys(others, True)
            copies = fresh if through_maybe(program, new) else set()
        else:
            accessors, copies = storage_accessors(program, root)
            node = program.graph._node
            maybe_readers = [a for a in accessors if node[a]["op"].may_alias]
            fresh = set(users)
            for user in users:  # what reads the storage through a user that aliases (or may alias) it
                fresh |= storage_readers(program, user, through_maybe=True) & accessors
            writes = {a: _writes(program, a, root) for a in accessors | fresh}
            others = accessors
        edges = []
        for a in sorted(fresh, key=pos):
            for b in others:
                if b == a or (b in fresh and pos(b) < pos(a)) or not (writes.get(a, False) or writes[b]):
                    continue  # a pair of new accesses is taken once, from its earlier one
                first, then = (a, b) if pos(a) < pos(b) else (b, a)
                if isinstance(program.op(first), Free) and not isinstance(program.op(then), Free):
                    if then in copies and not writes.get(then, False):
                        continue  # it may read a copy taken before the free
                    raise RewriteError(f"%{then} would read storage that %{first} frees before it")
                edges.append((first, then, "free" if isinstance(program.op(then), Free) else "storage"))
        if maybe_readers or program.op(root).may_alias or any(program.op(u).may_alias for u in users):
            # (else no storage may be root's, nor root another: nothing more to order)
            maybe = self._maybe_set(root)
            if len(maybe) > 1 or any(program.op(u).may_alias for u in users):
                edges += self._maybe_order(users, fresh, maybe)
        return edges

    def _maybe_set(self, root: str) -> tuple[str, ...]:
        """`root` and every storage it may be or that may be it, through `may_alias` either way
        (ir/storage.py `may_be`, one step from each storage found; an op that reads a storage and
        whose `may_alias` names it), `root` first; `(root,)` nearly always. Kept between edits as
        `_writers` is."""
        found = self._maybe_cache.get(root)
        if found is not None:
            return found
        program = self.program
        node = program.graph._node
        cache: dict[str, str] = {}
        found, stack = {root: None}, [root]
        while stack:
            current = stack.pop()
            linked = may_be(program, current, cache)
            readers = storage_readers(program, current, through_maybe=True)
            if any(node[a]["op"].may_alias for a in readers):
                linked += [a for a in readers if node[a]["op"].may_alias
                           and any(storage_root(program, c, cache) == current for c in node[a]["op"].may_alias)]
            for other in linked:
                if other not in found:
                    found[other] = None
                    stack.append(other)
        found = self._maybe_cache[root] = tuple(found)
        return found

    def _maybe_order(self, users: list[str], fresh: set[str], maybe: tuple[str, ...]) -> list[tuple[str, str, str]]:
        """The edges a result that may share storage adds (ir/storage.py): the new accesses
        (`fresh`, and what reads through a user whose result may be the storage) are ordered, as
        the schedule has them, against every access of every storage in `maybe` where either
        writes one of them; an access after a free of another of them keeps no order with it (it
        may be fresh storage), so nothing is refused. Conservative (each access counts as a write
        where one of them writes any of the storages): such storages are rare."""
        program = self.program
        pos = program.schedule.index
        fresh = set(fresh)
        for user in users:
            if program.op(user).may_alias:
                fresh |= storage_readers(program, user, through_maybe=True)
        accessors = set().union(*(storage_readers(program, s, through_maybe=True) for s in maybe)) | fresh
        writes = {a: any(_writes(program, a, s) for s in maybe) for a in accessors}
        edges = []
        for a in sorted(fresh, key=pos):
            for b in accessors:
                if b == a or (b in fresh and pos(b) < pos(a)) or not (writes[a] or writes[b]):
                    continue
                first, then = (a, b) if pos(a) < pos(b) else (b, a)
                if isinstance(program.op(first), Free) and not isinstance(program.op(then), Free):
                    continue  # an access after the free: it may be fresh storage (a note in ir/storage.py)
                edges.append((first, then, "free" if isinstance(program.op(then), Free) else "storage"))
        return edges

    def _writers(self, root: str) -> tuple[frozenset[str], tuple[str, ...]]:
        """The ops that write or free `root`'s storage among its accessors, and those of its
        accessors with `may_alias` (whose result may be it: `_maybe_set`), kept between edits."""
        found = self._writer_cache.get(root)
        if found is None:
            program = self.program
            node = program.graph._node
            readers = storage_readers(program, root, through_maybe=True)  # a write through a maybe view writes it
            found = self._writer_cache[root] = (frozenset(a for a in readers if _writes(program, a, root)),
                                                tuple(a for a in readers if node[a]["op"].may_alias))
        return found

    # ---- erase ------------------------------------------------------------------------
    def erase(self, name: str) -> None:
        """Remove an op that no one reads; its predecessors stay ordered before its successors."""
        program = self.program
        graph = program.graph
        if not program.op(name).MOVABLE:
            raise RewriteError(f"erase(%{name}): {program.op(name).KIND} ops are never erased")
        if users := program.users(name):
            raise RewriteError(f"erase(%{name}): still read by " + ", ".join(f"%{u}" for u in users))
        preds = [(p, e) for p, e in graph.pred[name].items()]
        succs = list(graph.succ[name])
        # a launch anchored at it now launches before what follows it (the node it still precedes)
        anchored = [op for op in map(program.op, program.anchored_at(name)) if op.name != name]
        if anchored:
            follower = program.schedule[program.schedule.index(name) + 1]
            for op in anchored:
                program.replace(attrs.evolve(op, anchor=follower))
        for p, e in preds:
            # the rule the edge into the erased op kept, so a broken bridge names it
            why = e["why"] if e["kind"] == EFFECT else f"through erased %{name}"
            for s in succs:
                program.add_effect(p, s, why)
        graph.remove_node(name)
        program.schedule.remove(name)
        program.payload.pop(name, None)
        self._writer_cache.clear()  # it may have been a writer, or read through an alias of one
        self._maybe_cache.clear()
        self.erased += 1


def _touch_conflict(program: Program, a: str, b: str) -> bool:
    """Whether ops `a` and `b` touch a common storage, at least one of them writing it."""
    cache: dict[str, str] = {}

    def touched(name):
        op = program.op(name)
        writes = {storage_root(program, w, cache) for w in op.writes}
        if isinstance(op, Free) and op.operands:
            writes.add(storage_root(program, op.operands[0], cache))
        return {storage_root(program, o, cache) for o in op.operands} | writes, writes

    touch_a, write_a = touched(a)
    touch_b, write_b = touched(b)
    return bool(write_a & touch_b or write_b & touch_a)


def _writes(program: Program, name: str, root: str) -> bool:
    """Whether `name` writes or frees the storage `root` (a Free of it, or an op whose `writes`,
    where the op kind has them, name it)."""
    op = program.op(name)
    if isinstance(op, Free):
        return bool(op.operands) and storage_root(program, op.operands[0]) == root
    return any(storage_root(program, w) == root for w in getattr(op, "writes", ()))


def _with_operands(op: Op, old: str, new: str) -> Op:
    """`op` reading `new` for `old`: its operands, and any field naming an operand's storage
    (the storage effects' `writes`, `alias` and `may_alias`)."""
    operands = op.operands
    if operands.count(old) == 1:  # (in C: an op may read thousands, as the output does)
        at = operands.index(old)
        operands = (*operands[:at], new, *operands[at + 1:])
    else:
        operands = tuple(new if o == old else o for o in operands)
    changes: dict[str, object] = {"operands": operands}
    if old in getattr(op, "writes", ()):
        changes["writes"] = tuple(new if o == old else o for o in op.writes)
    if getattr(op, "alias", None) == old:
        changes["alias"] = new
    if old in op.may_alias:
        changes["may_alias"] = tuple(dict.fromkeys(new if o == old else o for o in op.may_alias))
    return attrs.evolve(op, **changes)
