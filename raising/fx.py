"""Raise a Program into a fresh torch.fx GraphModule in schedule order, meta kept.

The module's Python code is generated lazily, on its first call or `.code` (torch's
`_LazyGraphModule`, as Inductor's own passes use): a scheduling pass hands the graph on and
most callers never run its code, and generating it is over half of raising at 30k nodes.
"""

from __future__ import annotations

from torch import fx

try:  # torch-internal; without it, fall back to an eager recompile
    from torch.fx._lazy_graph_module import _LazyGraphModule as _GraphModule
except ImportError:  # pragma: no cover
    _GraphModule = fx.GraphModule

from ..ir import Input, Marker, Program
from ..ir.gcpause import gc_paused


class RaisingError(ValueError):
    pass


def raise_program(program: Program, *, lint: bool = True) -> fx.GraphModule:
    """Copy each lowered FX node into a new graph in schedule order; markers vanish."""
    with gc_paused():
        return _raise(program, lint)


def _raise(program: Program, lint: bool) -> fx.GraphModule:
    source = program.origin
    if not isinstance(source, fx.GraphModule):
        raise RaisingError("this program was not lowered from a GraphModule (parsed from text?): "
                           "nothing to raise it into")
    graph = fx.Graph(owning_module=source, tracer_cls=source.graph._tracer_cls)
    graph._codegen = source.graph._codegen
    env: dict[fx.Node, fx.Node] = {}
    nodes = program.graph.nodes
    payload = program.payload
    for name in program.schedule:
        op = nodes[name]["op"]
        if isinstance(op, Marker):
            continue
        node = payload.get(name)
        if node is None:
            raise RaisingError(f"%{name} ({op.KIND}) has no FX node to raise from")
        env[node] = graph.node_copy(node, env.__getitem__)
        if isinstance(op, Input) and env[node].name != name:
            raise RaisingError(f"input %{name} was renamed to {env[node].name}")
    gm = _GraphModule(source, graph, class_name=type(source).__name__)
    gm.meta.update(source.meta)
    if lint:
        graph.lint()
    return gm
