"""The verifier: checks a program's structure and that its schedule keeps every rule.

Each message names the node and the broken rule. Passes may assume verified input and must
leave the program verified; the pass manager runs this between passes.
"""

from __future__ import annotations

import networkx as nx

from .effects import storage_readers, storage_root
from .gcpause import gc_paused
from .ops import Free, Input, Launch, Marker, Output, Phase, Wait
from .program import DATA, Program


class VerifyError(ValueError):
    def __init__(self, problems: list[str]):
        self.problems = problems
        shown = problems[:10]
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        super().__init__("invalid program:\n  " + "\n  ".join(shown) + more)


def verify(program: Program, *, structure: bool = True) -> None:
    """Raise VerifyError listing every broken rule (structure first, then the schedule).

    `structure=False` checks only the schedule against the graph: enough after a pass that
    changed nothing but the order and op attributes.
    """
    with gc_paused():
        _verify(program, structure)


def _verify(program: Program, structure: bool) -> None:
    problems = _structure(program) if structure else []
    if not problems:
        problems = _schedule(program)
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
    for name, data in node.items():
        op = data.get("op")
        if op is None or op.name != name:
            problems.append(f"%{name}: node has no op or a mismatched name")
            continue
        data_preds = {p for p, e in pred[name].items() if e["kind"] == DATA}
        if data_preds != set(op.operands):
            problems.append(f"%{name}: data edges {sorted(data_preds)} differ from operands {list(op.operands)}")
    if problems:
        return problems
    for name, data in node.items():
        op = data["op"]
        if isinstance(op, Wait):
            launches = [p for p in op.operands if isinstance(node[p]["op"], Launch)]
            if len(op.operands) != 1 or len(launches) != 1:
                problems.append(f"%{name}: a wait must have exactly one operand, a launch; has {list(op.operands)}")
        elif isinstance(op, Launch):
            waits = [u for u, e in succ[name].items() if e["kind"] == DATA and isinstance(node[u]["op"], Wait)]
            if len(waits) != 1:
                problems.append(f"%{name}: a launch must have exactly one wait; has {len(waits)}")
            if op.nbytes is not None and (not isinstance(op.nbytes, int) or isinstance(op.nbytes, bool)
                                          or op.nbytes < 0):
                problems.append(f"%{name}: nbytes must be a non-negative int, or absent when unknown; "
                                f"has {op.nbytes!r}")
    return problems


def _schedule(program: Program) -> list[str]:
    graph = program.graph
    node = graph._node
    schedule = program.schedule
    problems = []
    names = schedule.names()
    if len(names) != len(set(names)) or set(names) != set(node):
        missing = sorted(set(node) - set(names))[:5]
        extra = sorted(set(names) - set(node))[:5]
        seen: set[str] = set()
        repeated = sorted({n for n in names if n in seen or seen.add(n)})[:5]
        return [f"schedule is not a permutation of the nodes: missing {missing}, unknown {extra}, repeated {repeated}"]
    pos = {n: i for i, n in enumerate(names)}
    for u, nbrs in graph._succ.items():
        at = pos[u]
        for v, e in nbrs.items():
            if at >= pos[v]:
                rule = "a data edge" if e["kind"] == DATA else f"an effect edge ({e['why']})"
                problems.append(f"%{v}: scheduled before %{u}, which it must follow by {rule}")
    seen_backward = None
    frees = []
    for name in names:
        op = node[name]["op"]
        if isinstance(op, (Input, Marker, Output)):
            continue
        if isinstance(op, Free) and op.operands:
            frees.append(name)
        if op.phase is Phase.BACKWARD:
            seen_backward = seen_backward or name
        elif seen_backward is not None:
            problems.append(f"%{name}: forward op scheduled after backward op %{seen_backward} (phases out of order)")
    for name in frees:
        at = pos[name]
        for reader in storage_readers(program, storage_root(program, node[name]["op"].operands[0])):
            if reader != name and pos[reader] > at and not isinstance(node[reader]["op"], Free):
                problems.append(f"%{reader}: reads storage freed by %{name} but is scheduled after it")
    return problems
