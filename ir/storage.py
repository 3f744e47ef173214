"""Storages: what each value's memory is, and the `storage` and `free` rules' walk over them.

ir/effects.py derives every ordering rule as an edge; this module holds the storage model those
rules (and the rewriter, the verifier, lowering and `unshard`) read, and the walk that makes the
`storage` and `free` edges (`_storage_edges`, called by `effects.derive_effects`).

Storages are alias classes: an op reads the storage of each operand, writes the storage of
each operand in its `writes`, and a `free` frees its first operand's storage. A value's
storage is its root: views (and `alias` results) share their source's; anything else owns a
fresh one. Rules: `storage` — two ops that touch one storage, at least one of them writing
it, keep their order; `free` — every access of a storage precedes its free (an access after
the free is an error: the input graph uses freed memory; through a `maybe` view it is only a
note, that view may be a copy). A result whose op has `may_alias` (a call fxsched cannot see
into, with no `meta["val"]`: it may return one of those operands or a view of one) owns a fresh
storage and may be each of theirs (`maybe_storages`, transitively): every access of it counts
as an access of each of them too (a write or free of it as a write of them), and one after a
free of theirs is a note, not an error (it may be fresh). Such accesses are added to the walk
as numbers past the nodes' (`_maybe_accesses`); with no `may_alias` in the program nothing is
added. Storages linked so to more than `MAYBE_LIMIT` others (a chain of such calls) are merged
into one instead, for the whole program (`_maybe_links`), so that an access costs O(1) more
storages, not the chain's length. Edges run from the last writer and from the readers since,
so a storage costs its accesses, not their square. A collective reads its inputs until its
wait (the launch is asynchronous), so a wait reads its launch's operands too (a wait on an
opaque collective's result, its collective's): their next write or free follows the wait, not
only the launch (in the input order a write or free between
launch and wait is kept there, with a note: the input races with its own collective).

Queries by name: `storage_root` (a value's storage), `storage_roots` (every node's, and the
first `maybe` view on the way), `storage_readers` (who reads a storage, through views),
`storage_accessors` (who accesses it, through `maybe` views too: what the rewriter orders),
`storage_candidates` / `storage_candidates_of` / `maybe_storages` (the other storages a
`may_alias` result may be; `may_be`, one step of that walk).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import InputError
from .ops import WAIT_ON_NO_LAUNCH, Free, Launch, Op, Opaque, View, Wait
from .program import DATA, Program

if TYPE_CHECKING:
    from .effects import _Numbered


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


def maybe_storages(program: Program, roots: dict[str, tuple[str, str | None]] | None = None) -> dict[str, tuple[str, ...]]:
    """Per storage (its root's name) whose op has `may_alias`: every other storage it may be
    (its candidates' roots, theirs, and so on), sorted. Empty where no op has `may_alias`: the
    common case costs one walk over the ops. `roots`: `storage_roots(program)`, when at hand."""
    node = program.graph._node
    direct = [(name, data["op"].may_alias) for name, data in node.items() if data["op"].may_alias]
    if not direct:
        return {}
    if roots is None:
        roots = storage_roots(program)
    found: dict[str, tuple[str, ...]] = {}
    cache = {name: root for name, (root, _) in roots.items()}
    for name, _ in direct:
        if roots[name][0] == name:  # (a View or an alias with may_alias: verify refuses it)
            others = storage_candidates(program, name, cache)[1:]
            if others:
                found[name] = tuple(sorted(others))
    return found


def storage_candidates(program: Program, name: str, cache: dict[str, str] | None = None) -> tuple[str, ...]:
    """The storages `name` may be: its root's, then (where an op on the way has `may_alias`)
    each other one it may be (`maybe_storages`), found by walking the candidates: O(their count).
    `cache`: as `storage_root`'s. For the storages of many names, `storage_candidates_of`."""
    root = storage_root(program, name, cache)
    if not program.graph._node[root]["op"].may_alias:
        return (root,)
    found = {root: None}
    _walk_candidates(program, [root], found, cache)
    return tuple(found)


def storage_candidates_of(program: Program, names, cache: dict[str, str] | None = None) -> set[str]:
    """Every storage one of `names` may be (the union of their `storage_candidates`) in one walk,
    each storage expanded once: a chain of calls that may return their operand made a query per
    name walk the chain again (cubic in its length, as each walk also searched a list)."""
    found: dict[str, None] = {}
    starts = []
    for name in names:
        root = storage_root(program, name, cache)
        if root not in found:
            found[root] = None
            starts.append(root)
    _walk_candidates(program, starts, found, cache)
    return set(found)


def may_be(program: Program, root: str, cache: dict[str, str] | None = None) -> list[str]:
    """The storages (roots) that `root`'s op names in `may_alias`: one step of the walk."""
    node = program.graph._node
    return [storage_root(program, c, cache) for c in node[root]["op"].may_alias if c in node]


def _walk_candidates(program: Program, stack: list[str], found: dict[str, None], cache: dict[str, str] | None) -> None:
    """Add to `found` every storage that the storages on `stack` (in `found`) may be, transitively."""
    node = program.graph._node
    if cache is None:
        cache = {}
    while stack:
        for other in may_be(program, stack.pop(), cache):
            if other not in found:
                found[other] = None
                if node[other]["op"].may_alias:
                    stack.append(other)


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


def storage_readers(program: Program, root: str, *, through_maybe: bool = False) -> set[str]:
    """Every node that reads `root`'s storage directly or through a chain of views and `alias`
    results; not through a `maybe` view (its users may read a copy: no use after free), unless
    `through_maybe` (its users then count too: in the worst case it is a view, and the rules
    order them as the storage's readers and writers; `storage_accessors`)."""
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
            if _source(op) == current and (through_maybe or not (isinstance(op, View) and op.maybe)):
                stack.append(user)
    return readers


def storage_accessors(program: Program, root: str) -> tuple[set[str], set[str]]:
    """What `_storage_edges` orders as accesses of `root`'s storage, read off the graph as it is
    now (for the rewriter, which orders new accesses among them): every node that reads it
    through views, `alias` results and `maybe` views; and those of them that reach it only
    through a `maybe` view, whose read after a free of the storage is no use after free (it may
    be a copy: a note there, no order). A write through one is a write of the storage."""
    every = storage_readers(program, root, through_maybe=True)
    node = program.graph._node
    if not any(isinstance(op := node[a]["op"], View) and op.maybe for a in every):
        return every, set()  # (the two walks are one)
    return every, every - storage_readers(program, root)


def through_maybe(program: Program, name: str) -> bool:
    """Whether `name` reaches its storage root through a `maybe` view (it may be a copy)."""
    node, seen = program.graph._node, set()
    while name not in seen:
        seen.add(name)
        op = node[name]["op"]
        if isinstance(op, View) and op.maybe:
            return True
        source = _source(op)
        if source is None or source not in node:
            return False
        name = source
    return False


def _roots_in_order(program: Program, g: _Numbered, seq: list[int], ops: list[Op]
                    ) -> tuple[list[int | None], list[int | None], dict[int, tuple[int, ...]], set[int]]:
    """`storage_roots` by number (per node, its root's number, and the first `maybe` view's on
    the way or None), in one walk down the order when every view's (and alias's) source comes
    before it, as in a lowered graph; otherwise (hand-written text may refer forward) from
    `storage_roots` itself. Also, where some op has `may_alias` (`_maybe_links`): per storage,
    the others it may be, and the storages merged into one (their roots are the merged one's);
    both empty, and nothing more walked, where no op has any."""
    size = len(g.names)
    root: list[int | None] = [None] * size
    via: list[int | None] = [None] * size
    operands = g.operands
    maybe: list[tuple[int, Op]] = []
    for k, op in zip(seq, ops):
        if isinstance(op, View):
            source = operands[k][0] if op.operands else None
        elif op.alias is not None:
            source = g.find(k, op, op.alias)
        else:
            source = None
        if source is None:
            root[k] = k
            if op.may_alias:
                maybe.append((k, op))
            continue
        found = root[source]
        if found is None:  # a source later in the order, or a cycle
            at = g.at
            for name, (r, v) in storage_roots(program).items():
                k = at[name]
                root[k], via[k] = at[r], (None if v is None else at[v])
            maybe = [(k, op) for k, op in zip(seq, ops) if op.may_alias and root[k] == k]
            break
        root[k] = found
        v = via[source]
        via[k] = v if v is not None or not (isinstance(op, View) and op.maybe) else k
    if not maybe:
        return root, via, {}, set()
    also, merged = _maybe_links([(k, [root[c] for c in [g.find(k, op, name) for name in op.may_alias] if c is not None])
                                 for k, op in maybe])
    if merged:  # every value of a merged storage has the merged one's root
        root = [merged.get(r, r) for r in root]
    return root, via, also, set(merged.values())


# A storage linked through `may_alias` (either way, at any distance) to more than this many
# others is merged with them (`_maybe_links`): a chain of calls fxsched cannot see into, each on
# the last one's result and a new tensor (a wrapped layer function through a deep model), would
# make each access of the last result an access of every storage on the way, O(chain) each.
MAYBE_LIMIT = 32


def _maybe_links(direct: list[tuple[int, list[int]]]) -> tuple[dict[int, tuple[int, ...]], dict[int, int]]:
    """`direct`: (a storage whose op has `may_alias`, its candidates' storages). Returns, per
    storage, every other storage it may be (its candidates, theirs, and so on: a call on a result
    that may be x may return x), sorted; and, for the storages linked (either way) to more than
    `MAYBE_LIMIT` others, storage -> the one they are merged into (the least of them), for the
    whole program: each access of one is an access of all (exact, and linear, at the price of
    ordering accesses of two candidates of one call, before it too, as one storage's; a free of
    one of them is a write of the merged storage, and a use after it is not diagnosed). O(the
    storages named + MAYBE_LIMIT per storage)."""
    parent: dict[int, int] = {}

    def find(a: int) -> int:
        while (p := parent.get(a, a)) != a:
            parent[a] = a = parent.get(p, p)
        return a

    for storage, candidates in direct:
        for c in candidates:
            a, b = find(storage), find(c)
            if a != b:
                parent[max(a, b)] = min(a, b)  # the least number is the component's
    members: dict[int, list[int]] = {}
    for storage in {x for storage, candidates in direct for x in (storage, *candidates)}:
        members.setdefault(find(storage), []).append(storage)
    merged = {m: rep for rep, group in members.items() if len(group) > MAYBE_LIMIT + 1 for m in group if m != rep}
    edges = {storage: candidates for storage, candidates in direct if storage not in merged and find(storage) not in merged
             and len(members[find(storage)]) <= MAYBE_LIMIT + 1}
    also: dict[int, tuple[int, ...]] = {}
    for start in edges:  # a component of at most MAYBE_LIMIT + 1 storages: each walk is bounded
        seen, stack = {start}, [start]
        while stack:
            for c in edges.get(stack.pop(), ()):
                if c not in seen:
                    seen.add(c)
                    stack.append(c)
        seen.discard(start)
        if seen:
            also[start] = tuple(sorted(seen))
    return also, merged


def _storage_edges(program: Program, g: _Numbered, seq: list[int], ops: list[Op]) -> None:
    """`storage` and `free` edges: per storage, the last writer (or free) and the readers since;
    a reader follows the last writer, a writer follows the readers since (or, with none, the
    last writer). Each access costs O(1). Storages are their roots' numbers."""
    roots, vias, also, merged = _roots_in_order(program, g, seq, ops)
    add, names, operand_numbers, find = g.add, g.names, g.operands, g.find
    maybe_written: dict[int, int] = {}  # (a write's) storage it may be -> the one written
    if also:  # some result may share other storages: its accesses are theirs too
        operand_numbers = _maybe_accesses(g, seq, roots, vias, also)
    last_write: dict[int, int] = {}
    readers: dict[int, list[int]] = {}
    freed: dict[int, int] = {}
    in_flight: dict[int, list[tuple[int, list[int]]]] = {}  # launch -> (storage it reads, readers then)
    writing: dict[int, int] = {}  # storage -> the in-place collective writing it until its wait
    for k, op in zip(seq, ops):
        if not op.operands:
            continue
        operands = operand_numbers[k]
        if type(op) is Wait:
            launch = operands[0]  # the launch, or (where `op.launch` names it) a view of a coalesced one's result
            if op.launch is not None:
                source = operand_numbers[launch]
                launch = source[0] if source and names[source[0]] == op.launch else find(k, op, op.launch)
            if launch in in_flight:
                _collective_read(program, g, k, op, launch, in_flight, roots, last_write, readers, freed)
            if writing:  # an in-place collective's write ends at its wait
                for root in [r for r, by in writing.items() if by == launch]:
                    del writing[root]
        elif (type(op) is Opaque and op.reason == WAIT_ON_NO_LAUNCH
              and (launch := _completed_launch(program, g, operands[0], in_flight)) is not None):
            # a wait on an opaque collective's result completes it: the same read
            _collective_read(program, g, k, op, launch, in_flight, roots, last_write, readers, freed)
        is_free = isinstance(op, Free)
        if op.writes or is_free:
            written = [roots[find(k, op, w)] for w in op.writes]
            if is_free:
                written.append(roots[operands[0]])
            if also:  # a write (or free) of a storage that may be others writes each of them
                maybe_written = {c: r for r in written for c in also.get(r, ()) if c not in written}
                written += maybe_written
        else:
            written = ()
        for operand in operands:
            root = roots[operand]
            if root in written or (is_free and root in freed):  # a write covers its read; freeing twice reads nothing
                continue
            if root in freed:
                via = vias[operand]
                if via is not None:  # (a number past the nodes': an access through a may_alias result)
                    program.notes.append(f"%{names[k]} reads %{names[via]}, which may alias storage "
                                         f"%{names[freed[root]]} freed before it: taken for "
                                         f"{'fresh storage' if operand >= len(names) else 'a copy'} (no order kept "
                                         "with the free)")
                    continue
                raise EffectError(f"%{names[k]} reads storage that %{names[freed[root]]} freed before it "
                                  f"(use after free in the input graph)")
            if writing and root in writing:  # (not the collective's own wait: it ended the write above)
                program.notes.append(f"%{names[k]} reads storage the collective %{names[writing[root]]} writes "
                                     "until its wait: the input races with its collective (kept between them, "
                                     "as in the input)")
            writer = last_write.get(root)
            if writer is not None:
                add(writer, k, "storage")
            since = readers.get(root)
            if since is None:
                since = readers[root] = [k]
            elif since[-1] != k:
                since.append(k)
            if type(op) is Launch or type(op) is Opaque:  # a collective reads until its wait
                in_flight.setdefault(k, []).append((root, since))
        if not written:
            continue
        why = "free" if is_free else "storage"
        for root in dict.fromkeys(written):
            maybe = also and root in maybe_written
            if root in freed:
                if maybe:  # it may be fresh storage: no order with the free
                    program.notes.append(f"%{names[k]} writes %{names[maybe_written[root]]}, which may share storage "
                                         f"%{names[freed[root]]} freed before it: taken for fresh storage (no order "
                                         "kept with the free)")
                    continue
                if is_free:  # freed again: after the first free, which follows every access
                    add(freed[root], k, "free")
                    continue
                raise EffectError(f"%{names[k]} writes storage that %{names[freed[root]]} freed before it "
                                  f"(use after free in the input graph)")
            since = readers.pop(root, None)
            if since:
                for reader in since:
                    add(reader, k, why)
            elif root in last_write:
                add(last_write[root], k, why)
            last_write[root] = k
            # (freeing what may be another storage frees nothing known of it; nor does a free of a
            # storage merged with others, `_maybe_links`)
            if is_free and not maybe and not (merged and root in merged):
                freed[root] = k
            if type(op) is Launch:  # an in-place collective (all_reduce_, an `out=` gather) writes until its wait
                writing[root] = k


def _completed_launch(program: Program, g: _Numbered, number: int, in_flight: dict) -> int | None:
    """The in-flight collective that a wait on no launch, given `number`, completes: that op, or
    the op it views or aliases, and so on (an opaque in-place or `out=` collective's result aliases
    the buffer it writes: its storage root is that buffer, not the collective). None if none."""
    node, names, seen = program.graph._node, g.names, set()
    while number < len(names) and number not in seen:
        if number in in_flight:
            return number
        seen.add(number)
        op = node[names[number]]["op"]
        source = _source(op)
        if source is None or source not in op.operands:
            return None
        number = g.operands[number][op.operands.index(source)]
    return None


def _maybe_accesses(g: _Numbered, seq: list[int], roots: list, vias: list,
                    also: dict[int, tuple[int, ...]]) -> list[tuple[int, ...]]:
    """`g.operands`, where an operand's storage may be others (`also`) with an access of each
    added: a number past the nodes' (`roots` and `vias` grow to hold it) whose root is that other
    storage and whose `maybe` is the operand, so that `_storage_edges` orders it as an access of
    that storage, and one after its free is a note (the operand may be fresh storage), not a use
    after free. O(uses + the accesses added)."""
    operands = list(g.operands)
    virtual: dict[tuple[int, int], int] = {}  # (operand, other storage) -> its added number
    for k in seq:
        mine = operands[k]
        added = []
        for operand in mine:
            for other in also.get(roots[operand], ()):
                number = virtual.get((operand, other))
                if number is None:
                    number = virtual[operand, other] = len(roots)
                    roots.append(other)
                    vias.append(operand)
                added.append(number)
        if added:
            operands[k] = (*mine, *added)
    return operands


def _collective_read(program: Program, g: _Numbered, k: int, op: Op, launch: int, in_flight: dict[int, list],
                     roots: list, last_write: dict[int, int], readers: dict[int, list[int]],
                     freed: dict[int, int]) -> None:
    """The wait `k` (`op`) reads what `launch` read (the collective reads it until the wait),
    so a later write or free of it follows the wait. `in_flight[launch]`: each storage the launch
    read, with its readers list then (the same list still there: no write since, and no edge is
    needed)."""
    names = g.names
    own = {roots[g.find(k, op, w)] for w in op.writes}  # an in-place collective's wait writes its buffer
    for root, then in in_flight[launch]:
        if root in own:
            continue
        own.add(root)  # read once, however many operands share it
        if root in freed:
            program.notes.append(f"%{names[freed[root]]} frees storage the collective %{names[launch]} reads until "
                                 f"its wait %{names[k]}: kept before the wait as in the input (counted live until "
                                 "the wait)")
            continue
        since = readers.get(root)
        if since is not then:  # written since the launch: the input races with its collective
            writer = last_write[root]
            program.notes.append(f"%{names[writer]} writes storage the collective %{names[launch]} reads until its "
                                 f"wait %{names[k]}: kept before the wait as in the input")
            g.add(writer, k, "storage")
        if since is None:
            readers[root] = [k]
        elif since[-1] != k:
            since.append(k)
