"""Recognise FSDP parameter gathers in graphs without HyperParallel tags, and tag them.

FX → tagged FX (in place, on `node.meta` only; no node is added, removed or moved), so that
`lower` sees the gathers of torch.compile / SimpleFSDP graphs as it sees tagged ones.

A gather is recognised structurally: a functional `all_gather_into_tensor` whose input traces
back, through single-input casts and views, to a graph input (the parameter's shard), and
whose only user is a `wait_tensor`. It gets the tags of SPEC.md's input contract:
`comm_type` (`fsdp_all_gather`, or `fsdp_all_gather_backward` in the backward phase),
`param_name` (the graph input's name) and `fsdp_unsharded_nbytes` (from the gather's
`meta["val"]`; left out when unknown, so the budget holds the gather). A gather that already
has a `comm_type` is left as it is. Everything not recognised is listed with the reason.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Iterator
from typing import Any

import attrs
import torch
from torch import fx

from .fx import COLLECTIVE_NAMESPACES

__all__ = ["STRUCTURAL_TAG", "StructuralGather", "StructuralResult", "find_fsdp_gathers", "tag_fsdp_gathers",
           "untag_fsdp_gathers"]

#: set to True on the gathers this stage tagged (so the tags can be told apart, or removed)
STRUCTURAL_TAG = "fsdp_structural"
_TAG_KEYS = ("comm_type", "param_name", "fsdp_unsharded_nbytes", STRUCTURAL_TAG)
_CASTS = {"prims::convert_element_type", "aten::_to_copy", "aten::to"}
# single-input ops that re-lay out a shard without changing what it holds, though their schema
# does not declare an alias (or copies): still "the parameter's shard"
_LAYOUT_COPIES = {"aten::clone", "aten::contiguous", "aten::_unsafe_view", "aten::reshape", "aten::flatten",
                  "aten::view_as_real", "aten::view_as_complex"}
_PHASES = (None, "forward", "backward")
LOG = logging.getLogger("fxsched.lowering.structural")


@attrs.frozen
class StructuralGather:
    """One recognised gather: the launch, its graph input, the ops between them, its tags."""

    launch: str
    wait: str
    param_name: str
    phase: str
    nbytes: int | None
    path: tuple[str, ...]  # the casts/views between the graph input and the gather, input first

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self, recurse=False) | {"path": list(self.path)}


@attrs.define
class StructuralResult:
    tagged: list[StructuralGather] = attrs.field(factory=list)
    skipped: list[tuple[str, str]] = attrs.field(factory=list)  # (gather node, why it was not tagged)

    def as_dict(self) -> dict[str, Any]:
        return {"tagged": [g.as_dict() for g in self.tagged],
                "skipped": [{"node": n, "reason": r} for n, r in self.skipped]}

    def __str__(self) -> str:
        lines = [f"structural FSDP gathers: {len(self.tagged)} tagged, {len(self.skipped)} skipped"]
        for g in self.tagged:
            via = "".join(f" → %{p}" for p in g.path)
            lines.append(f"  %{g.launch}: {g.phase} gather of %{g.param_name}{via}, "
                         f"{'size unknown' if g.nbytes is None else f'{g.nbytes} bytes'}")
        lines += [f"  %{n}: not tagged: {r}" for n, r in self.skipped]
        return "\n".join(lines)


def _schema_name(node: fx.Node) -> str | None:
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return None if schema is None else schema.name


def _is_collective(node: fx.Node, op: str) -> bool:
    name = _schema_name(node)
    return name is not None and name.split("::")[0] in COLLECTIVE_NAMESPACES and name.endswith("::" + op)


def _passes_shard_through(node: fx.Node) -> bool:
    """A single-input cast, view or layout copy (what may sit between a shard and its gather)."""
    if node.op != "call_function" or len(node.all_input_nodes) != 1:
        return False
    if node.target is operator.getitem:
        return True
    name = _schema_name(node)
    if name is None:
        return False
    if name in _CASTS or name in _LAYOUT_COPIES:
        return True
    schema = node.target._schema
    return (not schema.is_mutable and bool(schema.returns) and schema.returns[0].alias_info is not None
            and not schema.returns[0].alias_info.is_write)


def _trace_to_input(node: fx.Node) -> tuple[fx.Node | None, list[fx.Node], fx.Node]:
    """Follow single-input casts/views up from `node`: (the graph input or None, the path, where it stopped)."""
    path: list[fx.Node] = []
    while node.op != "placeholder":
        if not _passes_shard_through(node):
            return None, path, node
        path.append(node)
        node = node.all_input_nodes[0]
    path.reverse()
    return node, path, node


def _nbytes(node: fx.Node) -> int | None:
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return None
    numel = value.numel()
    return numel * value.dtype.itemsize if isinstance(numel, int) else None


def _phase(node: fx.Node, phase: str | None) -> str:
    if phase is not None:
        return phase
    return "backward" if node.meta.get("autograd_backward") else "forward"


def find_fsdp_gathers(graph: fx.Graph | fx.GraphModule, *, phase: str | None = None
                      ) -> Iterator[tuple[fx.Node, StructuralGather | None, str | None]]:
    """Each functional all-gather in graph order: (node, what it is as an FSDP gather or None, why not)."""
    if phase not in _PHASES:
        raise ValueError(f"phase must be None, 'forward' or 'backward', got {phase!r}")
    graph = graph.graph if isinstance(graph, fx.GraphModule) else graph
    for node in graph.nodes:
        if not _is_collective(node, "all_gather_into_tensor"):
            continue
        if node.meta.get("comm_type") is not None and not node.meta.get(STRUCTURAL_TAG):
            yield node, None, f"already tagged comm_type={node.meta['comm_type']!r}"
            continue
        users = list(node.users)
        if len(users) != 1 or not _is_collective(users[0], "wait_tensor"):
            yield node, None, f"its users are {[u.name for u in users]}, not exactly one wait_tensor"
            continue
        shard = node.args[0] if node.args else node.kwargs.get("input")
        if not isinstance(shard, fx.Node):
            yield node, None, "its input is not a graph value"
            continue
        source, path, stop = _trace_to_input(shard)
        if source is None:
            yield node, None, (f"its input does not trace back to a graph input through single-input "
                               f"casts/views (stopped at %{stop.name}, {stop.op} {stop.target})")
            continue
        yield node, StructuralGather(launch=node.name, wait=users[0].name, param_name=source.name,
                                     phase=_phase(node, phase), nbytes=_nbytes(node),
                                     path=tuple(p.name for p in path)), None


def tag_fsdp_gathers(graph: fx.Graph | fx.GraphModule, *, phase: str | None = None) -> StructuralResult:
    """Tag every structurally recognised FSDP gather of `graph` in place; say what was and was not tagged.

    `phase` None reads each gather's phase as lowering does (`meta["autograd_backward"]`);
    "forward"/"backward" says the whole graph is that phase (e.g. Inductor's backward graph).
    Running it twice gives the same tags.
    """
    graph = graph.graph if isinstance(graph, fx.GraphModule) else graph
    result = StructuralResult()
    for node, gather, reason in list(find_fsdp_gathers(graph, phase=phase)):
        if gather is None:
            result.skipped.append((node.name, reason))
            continue
        meta = node.meta
        meta["comm_type"] = "fsdp_all_gather_backward" if gather.phase == "backward" else "fsdp_all_gather"
        meta["param_name"] = gather.param_name
        if gather.nbytes is None:
            meta.pop("fsdp_unsharded_nbytes", None)
        else:
            meta["fsdp_unsharded_nbytes"] = gather.nbytes
        meta[STRUCTURAL_TAG] = True
        result.tagged.append(gather)
    if result.tagged or result.skipped:
        LOG.debug("%s", result)
    return result


def untag_fsdp_gathers(graph: fx.Graph | fx.GraphModule) -> int:
    """Remove the tags `tag_fsdp_gathers` left; returns how many gathers it untagged."""
    graph = graph.graph if isinstance(graph, fx.GraphModule) else graph
    count = 0
    for node in graph.nodes:
        if node.meta.get(STRUCTURAL_TAG):
            for key in _TAG_KEYS:
                node.meta.pop(key, None)
            count += 1
    return count
