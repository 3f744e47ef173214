"""Turn every ordering rule into an explicit effect edge, once, from the program's first order.

Each op has effects on resources, as MLIR's memory effects:
- storages (alias classes): an op reads the storage of each operand, writes the storage of
  each operand in its `writes`, and a `free` frees its first operand's storage. A value's
  storage is its root: views (and `alias` results) share their source's; anything else owns a
  fresh one. Rules: `storage` — two ops that touch one storage, at least one of them writing
  it, keep their order; `free` — every access of a storage precedes its free (an access after
  the free is an error: the input graph uses freed memory; through a `maybe` view it is only a
  note, that view may be a copy). Edges run from the last writer and from the readers since,
  so a storage costs its accesses, not their square. A collective reads its inputs until its
  wait (the launch is asynchronous), so a wait reads its launch's operands too (a wait on an
  opaque collective's result, its collective's): their next write or free follows the wait, not
  only the launch (in the input order a write or free between
  launch and wait is kept there, with a note: the input races with its own collective);
- `regather` — a gather follows the latest earlier free of each of its parameters;
- `collective-order` — non-gather collectives (and opaque ones) of one process group keep
  their relative order; one whose group is unknown orders against every group. An FSDP
  gradient reduce-scatter marked `unordered` (`Launch.unordered`) keeps its place among the
  group's other collectives but not among the other unordered ones (`collective_order`);
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

from .errors import InputError
from .ops import WAIT_ON_NO_LAUNCH, Barrier, Compute, Free, Input, Launch, Marker, Op, Opaque, Output, Phase, View, Wait
from .program import DATA, Program, Schedule

ENTRY = "^entry"
BACKWARD = "^backward"


class EffectError(InputError):
    """The program's first order already breaks a rule (so no schedule could keep it)."""


def _source(op: Op) -> str | None:
    """The operand whose storage `op`'s result shares, if any."""
    if isinstance(op, View):
        return op.operands[0] if op.operands else None
    return op.alias


def storage_roots(program: Program) -> dict[str, tuple[str, str | None]]:
    """For every node: (the node owning its storage, the first `maybe` view on the way there or
    None). O(N): each node is walked once. A cycle of aliases (possible in hand-written text,
    which may refer forward; the verifier names the cycle) stops at the node closing it."""
    node = program.graph._node
    roots: dict[str, tuple[str, str | None]] = {}
    for start in node:
        if start in roots:
            continue
        path, on_path, current = [], set(), start
        while current not in roots:
            source = _source(node[current]["op"])
            if source is None or source not in node or current in on_path:
                roots[current] = (current, None)
                break
            on_path.add(current)
            path.append(current)
            current = source
        for name in reversed(path):
            if name in roots:  # closed a cycle
                continue
            op = node[name]["op"]
            root, via = roots[_source(op)]
            roots[name] = (root, via or (name if isinstance(op, View) and op.maybe else None))
    return roots


def storage_root(program: Program, name: str, cache: dict[str, str] | None = None) -> str:
    """The node whose storage `name` aliases (follows views and `alias` results to their base;
    stops at a cycle). `cache` (name -> root), when given, is read and filled, so that many
    calls cost each alias chain once."""
    node = program.graph._node
    path: list[str] = []
    seen: set[str] = set()
    while True:
        if cache is not None and name in cache:
            name = cache[name]
            break
        source = _source(node[name]["op"])
        if source is None or source not in node or name in seen:
            break
        seen.add(name)
        path.append(name)
        name = source
    if cache is not None:
        cache.update(dict.fromkeys(path, name))
    return name


def storage_readers(program: Program, root: str) -> set[str]:
    """Every node that reads `root`'s storage directly or through a chain of views and `alias`
    results (not through a `maybe` view: its users may read a copy)."""
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
            if _source(op) == current and not (isinstance(op, View) and op.maybe):
                stack.append(user)
    return readers


def place_markers(program: Program) -> None:
    """Put `^entry` after the inputs and `^backward` before the first backward op, if absent."""
    _place_markers(program)


def _place_markers(program: Program, ops: list[Op] | None = None) -> tuple[list[str], list[Op]]:
    """`place_markers`, returning the new schedule's names and their ops, position by position:
    the rules below walk the two lists side by side (a lookup per name in the graph's dicts cost
    as much as a rule at 100k nodes). `ops`: the schedule's ops, when the caller has them."""
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
            reordered = True
        marker = program.add(Marker(name=ENTRY))
        order.insert(count, ENTRY)
        ops.insert(count, marker)
        added.append(ENTRY)
    if BACKWARD not in node:
        backward = Phase.BACKWARD
        first = next((at for at, op in enumerate(ops) if op.phase is backward and _phased(op)), None)
        if first is not None:
            marker = program.add(Marker(name=BACKWARD, phase=Phase.BACKWARD))
            order.insert(first, BACKWARD)
            ops.insert(first, marker)
            added.append(BACKWARD)
    _insert_markers(program, order, added, reordered)
    return order, ops


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


def derive_effects(program: Program, ops: list[Op] | None = None) -> None:
    """Add the effect edges of every rule, reading the current schedule as the original order.
    `ops`: the program's ops in that order, when the caller has them (lowering just made them)."""
    order, ops = _place_markers(program, ops)
    _storage_edges(program, order, ops)
    kinds = list(map(type, ops))  # the rules below pick out the ops they read in C, by class
    present = set(kinds)

    last_free: dict[str, str] = {}
    previous_random = None
    for name, op in compress(zip(order, ops), _of(kinds, present, (Compute, Free, Launch))):
        if isinstance(op, Compute):
            if op.random:
                if previous_random is not None:
                    program.add_effect(previous_random, name, "rng-order")
                previous_random = name
        elif isinstance(op, Free):
            for param in op.params:
                last_free[param] = name
        elif isinstance(op, Launch) and op.is_gather:
            for param in op.params:
                if param in last_free:
                    program.add_effect(last_free[param], name, "regather")

    _collective_edges(program, order, ops, kinds, present)
    _barrier_and_phase_edges(program, order, ops)
    _boundary_edges(program, order, ops, kinds, present)


def _of(kinds: list[type], present: set[type], classes: tuple[type, ...]):
    """Per op (by its class, in `kinds`), whether it is an instance of `classes`: each class
    tested once, the ops mapped in C (for `compress`)."""
    table = {k: issubclass(k, classes) for k in present}
    return map(table.__getitem__, kinds)


def _roots_in_order(program: Program, order: list[str], ops: list[Op]) -> dict[str, tuple[str, str | None]]:
    """`storage_roots`, in one walk down the order when every view's (and alias's) source comes
    before it, as in a lowered graph; otherwise (hand-written text may refer forward)
    `storage_roots` itself."""
    roots: dict[str, tuple[str, str | None]] = {}
    node = program.graph._node
    for name, op in zip(order, ops):
        if isinstance(op, View):
            source = op.operands[0] if op.operands else None
        else:
            source = op.alias
        if source is None or source not in node:
            roots[name] = (name, None)
            continue
        found = roots.get(source)
        if found is None:  # a source later in the order, or a cycle
            return storage_roots(program)
        root, via = found
        roots[name] = (root, via) if via is not None or not (isinstance(op, View) and op.maybe) else (root, name)
    return roots


def _storage_edges(program: Program, order: list[str], ops: list[Op]) -> None:
    """`storage` and `free` edges: per storage, the last writer (or free) and the readers since;
    a reader follows the last writer, a writer follows the readers since (or, with none, the
    last writer). Each access costs O(1)."""
    roots = _roots_in_order(program, order, ops)
    add_effect = program.add_effect
    last_write: dict[str, str] = {}
    readers: dict[str, list[str]] = {}
    freed: dict[str, str] = {}
    in_flight: dict[str, list[tuple[str, list[str]]]] = {}  # launch -> (storage it reads, readers then)
    writing: dict[str, str] = {}  # storage -> the in-place collective writing it until its wait
    for name, op in zip(order, ops):
        operands = op.operands
        if not operands:
            continue
        if type(op) is Wait:
            if op.launched_by in in_flight:
                _collective_read(program, name, op, op.launched_by, in_flight, roots, last_write, readers, freed)
            if writing:  # an in-place collective's write ends at its wait
                for root in [r for r, launch in writing.items() if launch == op.launched_by]:
                    del writing[root]
        elif type(op) is Opaque and op.reason == WAIT_ON_NO_LAUNCH and (launch := roots[operands[0]][0]) in in_flight:
            # a wait on an opaque collective's result completes it: the same read
            _collective_read(program, name, op, launch, in_flight, roots, last_write, readers, freed)
        is_free = isinstance(op, Free)
        if op.writes or is_free:
            written = [roots[w][0] for w in op.writes]
            if is_free:
                written.append(roots[operands[0]][0])
        else:
            written = ()
        for operand in operands:
            root, via = roots[operand]
            if root in written or (is_free and root in freed):  # a write covers its read; freeing twice reads nothing
                continue
            if root in freed:
                if via is not None:
                    program.notes.append(f"%{name} reads %{via}, which may alias storage %{freed[root]} freed before "
                                         f"it: taken for a copy (no order kept with the free)")
                    continue
                raise EffectError(f"%{name} reads storage that %{freed[root]} freed before it "
                                  f"(use after free in the input graph)")
            if writing and root in writing:  # (not the collective's own wait: it ended the write above)
                program.notes.append(f"%{name} reads storage the collective %{writing[root]} writes until its wait: "
                                     "the input races with its collective (kept between them, as in the input)")
            writer = last_write.get(root)
            if writer is not None:
                add_effect(writer, name, "storage")
            since = readers.get(root)
            if since is None:
                since = readers[root] = [name]
            elif since[-1] != name:
                since.append(name)
            if type(op) is Launch or type(op) is Opaque:  # a collective reads until its wait
                in_flight.setdefault(name, []).append((root, since))
        if not written:
            continue
        why = "free" if is_free else "storage"
        for root in dict.fromkeys(written):
            if root in freed:
                if is_free:  # freed again: after the first free, which follows every access
                    add_effect(freed[root], name, "free")
                    continue
                raise EffectError(f"%{name} writes storage that %{freed[root]} freed before it "
                                  f"(use after free in the input graph)")
            since = readers.pop(root, None)
            if since:
                for reader in since:
                    add_effect(reader, name, why)
            elif root in last_write:
                add_effect(last_write[root], name, why)
            last_write[root] = name
            if is_free:
                freed[root] = name
            if type(op) is Launch:  # an in-place collective (all_reduce_, an `out=` gather) writes until its wait
                writing[root] = name


def _collective_read(program: Program, name: str, op: Op, launch: str, in_flight: dict[str, list],
                     roots: dict, last_write: dict[str, str], readers: dict[str, list[str]],
                     freed: dict[str, str]) -> None:
    """The wait `name` (`op`) reads what `launch` read (the collective reads it until the wait),
    so a later write or free of it follows the wait. `in_flight[launch]`: each storage the launch
    read, with its readers list then (the same list still there: no write since, and no edge is
    needed)."""
    own = {roots[w][0] for w in op.writes}  # an in-place collective's wait writes its buffer
    for root, then in in_flight[launch]:
        if root in own:
            continue
        own.add(root)  # read once, however many operands share it
        if root in freed:
            program.notes.append(f"%{freed[root]} frees storage the collective %{launch} reads until its wait "
                                 f"%{name}: kept before the wait as in the input (counted live until the wait)")
            continue
        since = readers.get(root)
        if since is not then:  # written since the launch: the input races with its collective
            writer = last_write[root]
            program.notes.append(f"%{writer} writes storage the collective %{launch} reads until its wait "
                                 f"%{name}: kept before the wait as in the input")
            program.add_effect(writer, name, "storage")
        if since is None:
            readers[root] = [name]
        elif since[-1] != name:
            since.append(name)


def _collective_edges(program: Program, order: list[str], ops: list[Op], kinds: list[type],
                      present: set[type]) -> None:
    """`collective-order`: per process group, non-gather launches and opaque collectives keep
    their order (those marked `unordered` only against the others); one with no known group
    follows the latest of every group, and they follow it."""
    add_effect = program.add_effect
    for before, after in collective_order(compress(zip(order, ops), _of(kinds, present, (Launch, Opaque)))):
        add_effect(before, after, "collective-order")


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
# derive_effects: they read networkx's adjacency dicts directly and use for/else rather
# than any(generator).

def _barrier_and_phase_edges(program: Program, order: list[str], ops: list[Op]) -> None:
    """`barrier`: a segment's last nodes (no successor in it) precede the barrier ending it, its
    first nodes (no predecessor in it) follow the barrier starting it; barriers keep their order.
    `phase`: a forward op no forward op follows precedes `^backward`, a backward op no backward
    op precedes follows it.

    One walk for both rules: each phased op gets a code, 2 * segment + (1 if backward); a
    neighbour with the op's own code (in its segment and its phase: nearly always the first
    one looked at) answers both rules' question on that side at once, and only an op without
    one pays for the two tests. Barriers' codes are negative (-2 * (k + 1) + backward), so no
    segment test counts them and the phase bit still reads. The edges are those the two rules
    add one after the other: a plain op's barrier edges are its own, added before its phase
    test reads its neighbours (as when the barrier rule ran first); a barrier's neighbours are
    complete only once the walk is done, so barriers take their phase test after it.
    """
    add_effect = program.add_effect
    barriers: list[str] = []
    code: dict[str, int] = {}  # every phased op (barriers too), in schedule order
    backward, phases = Phase.BACKWARD, False
    for name, op in zip(order, ops):
        if isinstance(op, _UNPHASED):
            phases = phases or name == BACKWARD
        elif isinstance(op, Barrier):
            if barriers:
                add_effect(barriers[-1], name, "barrier")
            barriers.append(name)
            code[name] = -2 * len(barriers) + (op.phase is backward)
        else:
            code[name] = 2 * len(barriers) + (op.phase is backward)
    if not barriers and not phases:
        return
    graph = program.graph
    succ, pred, get = graph._succ, graph._pred, code.get
    last = len(barriers)
    for name, c in code.items():
        if c < 0:  # a barrier: its phase test after the walk
            continue
        seg = c >> 1
        nbrs = succ[name]
        for s in nbrs:
            if get(s) == c:
                break
        else:
            if seg < last:  # the segment's last node(s): before the barrier that ends it
                for s in nbrs:
                    x = get(s)
                    if x is not None and x >> 1 == seg:
                        break
                else:
                    add_effect(name, barriers[seg], "barrier")
            if phases and not c & 1:  # forward, and no forward op after it (barrier edge included)
                for s in nbrs:
                    x = get(s)
                    if x is not None and not x & 1:
                        break
                else:
                    add_effect(name, BACKWARD, "phase")
        nbrs = pred[name]
        for p in nbrs:
            if get(p) == c:
                break
        else:
            if seg > 0:  # the segment's first node(s): after the barrier that starts it
                for p in nbrs:
                    x = get(p)
                    if x is not None and x >> 1 == seg:
                        break
                else:
                    add_effect(barriers[seg - 1], name, "barrier")
            if phases and c & 1:  # backward, and no backward op before it
                for p in nbrs:
                    x = get(p)
                    if x is not None and x & 1:
                        break
                else:
                    add_effect(BACKWARD, name, "phase")
    if phases:
        for name in barriers:
            if code[name] & 1:
                for p in pred[name]:
                    x = get(p)
                    if x is not None and x & 1:
                        break
                else:
                    add_effect(BACKWARD, name, "phase")
            else:
                for s in succ[name]:
                    x = get(s)
                    if x is not None and not x & 1:
                        break
                else:
                    add_effect(name, BACKWARD, "phase")


def _boundary_edges(program: Program, order: list[str], ops: list[Op], kinds: list[type],
                    present: set[type]) -> None:
    graph = program.graph
    add_effect = program.add_effect
    outputs = list(compress(order, _of(kinds, present, (Output,))))
    inputs = list(compress(order, _of(kinds, present, (Input,))))
    for before, after in zip(inputs, inputs[1:]):  # the raised function keeps its signature
        add_effect(before, after, "entry")
    if inputs:
        add_effect(inputs[-1], ENTRY, "entry")
    input_names = set(inputs)
    succ, pred = graph._succ, graph._pred
    for name, op in zip(order, ops):
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
