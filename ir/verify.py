"""The verifier: checks a program's structure and that its schedule keeps every rule.

Each message names the node and the broken rule. Passes may assume verified input and must
leave the program verified; the pass manager runs this between passes.

Every rule is checked through its edges (the schedule keeps each one). Three are also derived
again from the ops' own facts, so that a pass dropping an edge, or changing what an op says
without redoing its edges, is caught: the `free` rule (every reader of a storage before its
free), the phases, and `collective-order` (`_collective_order`). Each is a fact of the ops and
of an order that every legal schedule keeps (collectives of one group keep theirs), so the
schedule at hand derives the same pairs as the traced order did. `p2p-order` is not, and is
checked through its edges alone, as `storage` is: a wait follows the sends and receives traced
before it, and a legal schedule may move a wait below a send traced after it (nothing orders
them: `isend; wait; irecv` scheduled `isend; irecv; wait`), where deriving it from that schedule
would ask for an edge the rule never made and reject a legal program; the traced order is gone
once a pass moved ops (tests/test_verify.py).
"""

from __future__ import annotations

from itertools import compress, repeat
from operator import attrgetter, is_, itemgetter, not_

import networkx as nx

from .effects import collective_order
from .errors import InputError
from .gcpause import gc_paused
from .ops import Free, Input, Launch, Marker, Opaque, Output, Phase, View, Wait
from .program import DATA, Program
from .storage import storage_readers, storage_root


class VerifyError(InputError):
    """The program breaks an IR rule. Raised on input before any pass runs (the input's fault);
    after a pass, the pass manager wraps it in a PassFailure (the pass's)."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        shown = problems[:10]
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        super().__init__("invalid program:\n  " + "\n  ".join(shown) + more)


def verify(program: Program, *, structure: bool = True, rules: bool = True) -> None:
    """Raise VerifyError listing every broken rule (structure first, then the schedule).

    `structure=False` checks only the schedule against the graph: enough after a pass that
    changed nothing but the order and op attributes. `rules=False` (with `structure=False`)
    checks the schedule against the edges alone, not the frees and phases against the ops
    again: enough where every edge is one derive_effects made, as it makes an edge of each
    of those rules (the pass manager's last check of a run of passes that only moved nodes on
    what lowering returned, `PassManager(verify_input=False)`).
    """
    with gc_paused():
        _verify(program, structure, rules)


def _verify(program: Program, structure: bool, rules: bool = True) -> None:
    problems = _structure(program) if structure else []
    if not problems:
        problems = _schedule(program) if structure or rules else _edges(program)
        # a schedule with every edge forward proves the graph acyclic; look for a cycle
        # only when some edge points backward, and then report the cycle alone
        if problems and not nx.is_directed_acyclic_graph(program.graph):
            cycle = nx.find_cycle(program.graph)
            problems = ["cycle: " + " -> ".join(f"%{u}" for u, _ in cycle) + f" -> %{cycle[0][0]}"]
    if problems:
        raise VerifyError(problems)


def _structure(program: Program) -> list[str]:
    # raw adjacency dicts: networkx's views cost more than the checks at 100k nodes
    graph = program.graph
    succ, pred, node = graph._succ, graph._pred, graph._node
    problems = []
    # One walk over the nodes, each op's later checks picked out while it is at hand: the node
    # table, and the predecessor table beside it (networkx fills both in the same order), read
    # in their own order. At 100k nodes a lookup by name, or another walk over the ops, costs a
    # cache miss or more per node (208 -> 137 ms at 100k nodes, 11.9 -> 10.6 at 10k).
    same_order = list(node) == list(pred)
    writes, aliases, collectives = [], [], []
    for (name, data), into in zip(node.items(), pred.values() if same_order else map(pred.__getitem__, node)):
        op = data.get("op")
        if op is None or op.name != name:
            problems.append(f"%{name}: node has no op or a mismatched name")
            continue
        data_preds = {p for p, e in into.items() if e["kind"] == DATA}
        if data_preds != set(op.operands):
            problems.append(f"%{name}: data edges {sorted(data_preds)} differ from operands {list(op.operands)}")
        if op.writes:
            writes.append(op)
        if op.alias or op.may_alias:
            aliases.append(op)
        if isinstance(op, (Wait, Launch)):  # the rules below are for waits and launches only
            collectives.append(op)
    if problems:
        return problems
    # what an op writes, and the operand its result shares storage with, are among its operands
    for op in writes:
        if not set(op.writes) <= set(op.operands):
            problems.append(f"%{op.name}: writes {list(op.writes)}, which are not all operands {list(op.operands)}")
    for op in aliases:
        if op.alias and op.alias not in op.operands:
            problems.append(f"%{op.name}: alias %{op.alias} is not an operand {list(op.operands)}")
        if op.may_alias:
            if not set(op.may_alias) <= set(op.operands):
                problems.append(f"%{op.name}: may_alias {list(op.may_alias)}, which are not all operands "
                                f"{list(op.operands)}")
            if op.alias or isinstance(op, View):  # its storage is another's: it cannot also be fresh
                problems.append(f"%{op.name}: may_alias with {'alias' if op.alias else 'a view'}: a result "
                                "shares one storage, or may share some (may_alias), not both")
    for op in collectives:
        name = op.name
        if isinstance(op, Wait):
            if op.launch is not None:  # one result of a coalesced launch: a view of it
                source = node[op.operands[0]]["op"] if len(op.operands) == 1 and op.operands[0] in node else None
                if (not isinstance(source, View) or source.operands != (op.launch,)
                        or not isinstance(node.get(op.launch, {}).get("op"), Launch)):
                    problems.append(f"%{name}: a wait naming launch %{op.launch} must have exactly one operand, a "
                                    f"view of that launch (one of its results); has {list(op.operands)}")
                continue
            launches = [p for p in op.operands if isinstance(node[p]["op"], Launch)]
            if len(op.operands) != 1 or len(launches) != 1:
                problems.append(f"%{name}: a wait must have exactly one operand, a launch; has {list(op.operands)}")
        else:  # a launch
            users = [u for u, e in succ[name].items() if e["kind"] == DATA]
            waits = [u for u in users if isinstance(node[u]["op"], Wait)]
            results = [u for u in users if isinstance(node[u]["op"], View)
                       and any(getattr(node[w]["op"], "launch", None) == name for w in succ[u])]
            if results:  # coalesced: each user is a result view read by one wait naming the launch
                for view in users:
                    readers = [u for u, e in succ[view].items() if e["kind"] == DATA]
                    if (view not in results or len(readers) != 1 or not isinstance(node[readers[0]]["op"], Wait)
                            or node[readers[0]]["op"].launch != name):
                        problems.append(f"%{name}: a coalesced launch's every user must be a view of one result "
                                        f"read by exactly one wait naming it; %{view} is not")
            elif len(waits) != 1:
                problems.append(f"%{name}: a launch must have exactly one wait; has {len(waits)}")
            if op.anchor is not None and (op.anchor not in node or op.anchor == name):  # every reference an op holds
                problems.append(f"%{name}: anchor {op.anchor if op.anchor.startswith('^') else '%' + op.anchor} "
                                f"{'is the launch itself' if op.anchor == name else 'is not a node of the program'}")
            if op.unordered and not op.may_unorder:
                problems.append(f"%{name}: only an FSDP reduce-scatter of a known group (role fsdp_reduce_scatter, "
                                f"a group) may be unordered; has role {op.role.value if op.role else None} and "
                                f"group {op.group!r}")
            if op.nbytes is not None and (not isinstance(op.nbytes, int) or isinstance(op.nbytes, bool)
                                          or op.nbytes < 0):
                problems.append(f"%{name}: nbytes must be a non-negative int, or absent when unknown; "
                                f"has {op.nbytes!r}")
    return problems


def _schedule(program: Program) -> list[str]:
    # This runs after every pass, and at 30k nodes its cost is memory traffic, not arithmetic:
    # so one walk down the schedule checks every edge and every free against the set of nodes
    # already passed (set operations, no table of positions), the phases are read in C (map,
    # compress), and only a broken schedule pays for the loops that name each problem. What is
    # checked is the same either way.
    graph = program.graph
    node, pred = graph._node, graph._pred
    names = program.schedule.names()
    try:
        data = list(map(node.__getitem__, names))
    except KeyError:  # a name that is no node
        return [_not_a_permutation(names, node)]
    if len(names) != len(node):
        return [_not_a_permutation(names, node)]
    ops = list(map(itemgetter("op"), data))
    kinds = list(map(type, ops))
    classes = set(kinds)
    free_class = {k: issubclass(k, Free) for k in classes}
    frees = {names[at]: ops[at] for at in compress(range(len(ops)), map(free_class.__getitem__, kinds))
             if ops[at].operands}  # in schedule order

    # edges forward: each node's predecessors were all passed before it; frees: every reader of
    # the freed storage (through views) was passed before the free, save the free itself (it
    # reads its operand) and other frees (freeing twice reads nothing). Only the first free of a
    # storage is checked (a later one comes after it), so each storage's readers are walked once.
    passed: set[str] = set()
    checked: set[str] = set()  # storages whose first free was checked
    roots: dict[str, str] = {}
    edges_forward = readers_first = True
    for name, preds in zip(names, map(pred.__getitem__, names)):
        if not passed.issuperset(preds):
            edges_forward = False
        if name in frees:
            root = storage_root(program, frees[name].operands[0], roots)
            if root not in checked:
                checked.add(root)
                late = storage_readers(program, root).difference(passed)
                late.discard(name)
                if late and not all(isinstance(node[r]["op"], Free) for r in late):
                    readers_first = False
        passed.add(name)
    if len(passed) != len(names):  # a name repeated (so another is missing)
        return [_not_a_permutation(names, node)]

    problems = []
    # positions, to name what is broken (a schedule that keeps every rule needs none)
    pos = None if edges_forward and readers_first else dict(zip(names, range(len(names))))
    if not edges_forward:
        for u, nbrs in graph._succ.items():
            at = pos[u]
            for v, e in nbrs.items():
                if at >= pos[v]:
                    problems.append(_broken(u, v, e))

    # phases: no forward op after the first backward one (inputs, markers and the output have
    # no phase of their own); kinds are tested once per class, not once per op
    phased_class = {k: not issubclass(k, (Input, Marker, Output)) for k in classes}
    phased = list(compress(range(len(ops)), map(phased_class.__getitem__, kinds)))  # positions
    backward = list(map(is_, map(attrgetter("phase"), map(ops.__getitem__, phased)), repeat(Phase.BACKWARD)))
    if True in backward:
        first = backward.index(True)
        seen_backward = names[phased[first]]
        for k in compress(range(first + 1, len(phased)), map(not_, backward[first + 1:])):
            problems.append(f"%{names[phased[k]]}: forward op scheduled after backward op %{seen_backward} "
                            "(phases out of order)")

    if edges_forward:  # (else the edges' problems say it)
        problems += _collective_order(program, names, ops, kinds, classes)

    if not readers_first:
        first_frees = {}  # storage -> its first free
        for name, op in frees.items():
            first_frees.setdefault(storage_root(program, op.operands[0], roots), name)
        for root, name in first_frees.items():
            at = pos[name]
            for reader in storage_readers(program, root):
                if reader != name and pos[reader] > at and not isinstance(node[reader]["op"], Free):
                    problems.append(f"%{reader}: reads storage freed by %{name} but is scheduled after it")
    return problems


def _collective_order(program: Program, names: list[str], ops: list, kinds: list[type],
                      classes: set[type]) -> list[str]:
    """`collective-order`, checked against the ops' own facts: of every pair of one group's
    collectives that the rule orders (`effects.collective_order` of the schedule: two
    `unordered` reduce-scatters are the only pair it leaves free), the graph's edges order the
    later after the earlier. So a pass that drops such an edge, or marks or unmarks a launch
    without redoing the edges (`Rewriter.unorder`), is caught, not only a schedule against the
    edges. Nearly every pair has its own edge; the others are searched for a path back, within
    the positions between the two (every edge points forward)."""
    collective = {k: issubclass(k, (Launch, Opaque)) for k in classes}
    picked = list(compress(zip(names, ops), map(collective.__getitem__, kinds)))
    if len(picked) < 2:
        return []
    succ, pred = program.graph._succ, program.graph._pred
    problems, pos = [], None
    for before, after in collective_order(picked):
        if after in succ[before]:
            continue
        if pos is None:
            pos = dict(zip(names, range(len(names))))
        low, stack, seen = pos[before], [after], {after}
        while stack:
            current = stack.pop()
            if before in pred[current]:
                break
            for p in pred[current]:
                if p not in seen and pos[p] > low:
                    seen.add(p)
                    stack.append(p)
        else:
            problems.append(f"%{after}: not ordered after %{before} by any edge, but the collective order "
                            f"keeps them so (collective-order: the same group, not both unordered)")
    return problems


def _edges(program: Program) -> list[str]:
    """`_schedule` without the frees and phases: the schedule is a permutation of the nodes
    and every edge points forward (one walk, as in `_schedule`)."""
    graph = program.graph
    node, pred = graph._node, graph._pred
    names = program.schedule.names()
    if len(names) != len(node):
        return [_not_a_permutation(names, node)]
    passed: set[str] = set()
    edges_forward = True
    try:
        for name, preds in zip(names, map(pred.__getitem__, names)):
            if not passed.issuperset(preds):
                edges_forward = False
            passed.add(name)
    except KeyError:  # a name that is no node
        return [_not_a_permutation(names, node)]
    if len(passed) != len(names):  # a name repeated (so another is missing)
        return [_not_a_permutation(names, node)]
    if edges_forward:
        return []
    pos = dict(zip(names, range(len(names))))
    return [_broken(u, v, e) for u, nbrs in graph._succ.items() for v, e in nbrs.items() if pos[u] >= pos[v]]


def _not_a_permutation(names: list[str], node: dict) -> str:
    missing = sorted(set(node) - set(names))[:5]
    extra = sorted(set(names) - set(node))[:5]
    seen: set[str] = set()
    repeated = sorted({n for n in names if n in seen or seen.add(n)})[:5]
    return f"schedule is not a permutation of the nodes: missing {missing}, unknown {extra}, repeated {repeated}"


def verify_moves(program: Program, moved: set[str]) -> None:
    """Raise VerifyError for every edge at a node in `moved` that the schedule breaks.

    For a schedule that was verified and then changed only by `Schedule.move_before` (which keeps
    the relative order of every node it did not move) on an unchanged graph: an edge between two
    unmoved nodes still points forward, so these edges are the only ones to check. Phases and
    frees are kept by edges too (ir/effects.py), so the edges carry every rule; a full `verify`
    at the end of a pipeline checks them independently.
    """
    graph = program.graph
    if len(moved) * 6 > len(graph) and _moved_edges_forward(program, moved):
        return
    pos = program.schedule.index
    problems = []
    # (each moved node's position read once: a lookup costs a cache miss or more at 100k nodes)
    for at, name in sorted(zip(map(pos, moved), moved)):  # positions differ: names are never compared
        for u, e in graph._pred[name].items():
            if pos(u) >= at:
                problems.append(_broken(u, name, e))
        for v, e in graph._succ[name].items():
            if v not in moved and at >= pos(v):  # a moved successor reports it itself
                problems.append(_broken(name, v, e))
    if problems:
        raise VerifyError(problems)


def _moved_edges_forward(program: Program, moved: set[str]) -> bool:
    """Whether every edge at a node in `moved` points forward, by one walk down the order
    against the set of nodes passed (as `_edges` walks), not a position lookup per node and
    neighbour: where a pass moved a sixth of the nodes or more (sink moves ~27k of 100k), the
    two lookups of `Schedule.index` per name, each a miss in a table of every name at 100k,
    cost more than the walk (sink's check 72 -> 42 ms at 100k). False: look again with
    positions, to name what is broken."""
    graph = program.graph
    pred, succ = graph._pred, graph._succ
    passed: set[str] = set()
    add = passed.add
    for name in program.schedule.names():
        if name in moved and not (passed.issuperset(pred[name]) and passed.isdisjoint(succ[name])):
            return False
        add(name)
    return True


def _broken(u: str, v: str, e: dict) -> str:
    rule = "a data edge" if e["kind"] == DATA else f"an effect edge ({e['why']})"
    return f"%{v}: scheduled before %{u}, which it must follow by {rule}"
