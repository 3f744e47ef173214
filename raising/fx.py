"""Raise a Program into a fresh torch.fx GraphModule in schedule order, meta kept."""

from __future__ import annotations

from torch import fx

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
    gm = fx.GraphModule(source, graph, class_name=type(source).__name__)
    gm.meta.update(source.meta)
    if lint:
        graph.lint()
    return gm
