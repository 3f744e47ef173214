"""`lint(graph)`: `torch.fx.Graph.lint()`, at C speed where the graph passes it.

The package face lints every graph it is given before lowering it, and at 100k nodes torch's
lint (a Python loop with a call per input edge and a lookup-table probe per node that hashes
the target in Python) is 0.13 s, a tenth of a drop-in's own work. `lint` first tests what
Graph.lint asks of the graph with set and map operations over all nodes at once; that test is
sufficient (whatever passes it passes Graph.lint), not necessary: on any doubt Graph.lint
itself runs, so a bad graph gets torch's own error, word for word.

What Graph.lint asks (torch 2.x), and where the test finds it:
- each node's op is a known one, its graph is this graph, and no two nodes share a name:
  the sets of the nodes' ops, graphs and names;
- each node is in the lookup table under its key, (op, target) for call_function and
  (op, None) otherwise: every member of a bucket is a node of the graph with the bucket's op
  (and, for call_function, the very target of its key), and the buckets hold as many members
  as the graph has nodes;
- each input of a node is a node of this graph listed before it: a running set of the nodes
  seen so far covers each node's inputs (`seen` holds only this graph's nodes);
  (this test and the names' are left out where lowering has just found both: `lowered`)
- with an owning module, a call_function target is callable (one test per bucket, whose
  members share the key's target), any other target is a str, and a get_attr or call_module
  target resolves in the module (`targets_resolve`).
"""

from __future__ import annotations

from itertools import repeat
from operator import attrgetter, is_not

import torch
from torch import fx

try:  # torch-internal: the ops Graph.lint accepts
    from torch.fx.graph import _legal_ops as _LEGAL
except ImportError:  # pragma: no cover  (another torch: lint always runs itself)
    _LEGAL = None

__all__ = ["lint", "targets_resolve"]

_op, _name, _graph, _target = (attrgetter(a) for a in ("op", "name", "graph", "target"))


def lint(graph: fx.Graph, *, lowered: bool = False) -> None:
    """`graph.lint()`: raises what it raises, and only when it does (see the module doc).

    `lowered`: lowering has just walked this graph and found what two of the tests would, each
    node's name unique and its inputs nodes of the graph listed before it (`lower_in_order`),
    so they are left out: at 100k nodes they were 55 of lint's 90 ms, a set of every name and
    a walk of every node's inputs, each out of cache again."""
    if not _passes(graph, lowered):
        graph.lint()


def _passes(graph: fx.Graph, lowered: bool = False) -> bool:
    table = getattr(getattr(graph, "_find_nodes_lookup_table", None), "table", None)
    if _LEGAL is None or not isinstance(table, dict):
        return False
    nodes = list(graph.nodes)
    if not set(map(_op, nodes)).issubset(_LEGAL) or any(map(is_not, map(_graph, nodes), repeat(graph))):
        return False
    if lowered:
        seen = set(nodes)  # (for the lookup table's test below)
    else:
        if len(set(map(_name, nodes))) != len(nodes):
            return False
        seen = set()
        add, covers = seen.add, seen.issuperset
        for node in nodes:
            if not covers(node._input_nodes):
                return False
            add(node)
    # Each bucket's members are nodes of the graph with the bucket's key; then no node is in two
    # buckets (no two keys fit one node), and members as many as nodes means every node is in one.
    for (op, target), bucket in table.items():
        if not {op}.issuperset(map(_op, bucket)) or not seen.issuperset(bucket):
            return False
        if op == "call_function":
            if any(map(is_not, map(_target, bucket), repeat(target))):
                return False
        elif target is not None and bucket:
            return False
    if sum(map(len, table.values())) != len(nodes):
        return False
    module = graph.owning_module
    if not module:  # (lint's own test: no module, no target checks)
        return True
    for (op, target), bucket in table.items():
        if bucket and not (callable(target) if op == "call_function"
                           else all(map(isinstance, map(_target, bucket), repeat(str)))):
            return False
    return targets_resolve(graph, module)


def targets_resolve(graph: fx.Graph, module: torch.nn.Module) -> bool:
    """What Graph.lint asks of each get_attr and call_module node: its dotted target names an
    attribute of `module` (a module, for call_module), no atom of it None."""
    for op in ("get_attr", "call_module"):
        for node in graph.find_nodes(op=op, sort=False):
            found = module
            for atom in node.target.split("."):
                found = getattr(found, atom, None)
                if found is None or (op == "call_module" and not isinstance(found, torch.nn.Module)):
                    return False
    return True
