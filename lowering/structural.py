"""Recognise FSDP collectives in graphs without HyperParallel tags, and tag them.

FX → tagged FX (in place, on `node.meta` only; no node is added, removed or moved), so that
`lower` sees the gathers and gradient reductions of torch.compile / SimpleFSDP / torchtitan
graphs as it sees tagged ones.

A gather is recognised structurally: a functional `all_gather_into_tensor` whose input traces
back, through single-input casts and views (and the pad DTensor adds at the end of a smaller
shard's first dim), to a graph input (the parameter's shard), and
whose only user is a `wait_tensor`. It gets the tags lowering reads (docs/design.md, "The input fxsched expects"):
`comm_type` (`fsdp_all_gather`, or `fsdp_all_gather_backward` in the backward phase),
`param_name` (the graph input's name) and `fsdp_unsharded_nbytes` (from the gather's
`meta["val"]`; left out when unknown, so the budget holds the gather). A gather that already
has a `comm_type` is left as it is. Everything not recognised is listed with the reason.

A bucketed gather, as Inductor's and torchtitan's bucketing passes emit it, is recognised too:
an `all_gather_into_tensor_out(narrow(buf), …, out=buf)` whose buffer is packed from shards
(`bucketing._pre_bucket_all_gather(shards)`, or `copy_(narrow(buf), cat(shards))` into an `empty` one),
or an `all_gather_into_tensor(cat(shards))` (HyperParallel's form, Inductor's functional mode),
where every shard traces back to a floating graph input. It gets `fsdp_bucket_id` (the launch's
name) and `fsdp_bucket_members` (the shards' graph inputs, in pack order) besides `comm_type`
and the gathered buffer's size; the `aten.clone`s its wait reaches through views (one per member:
the copy-outs) get `fsdp_bucket_copy_out`, so that they sink with the wait (ir: `copy_out`).
An `all_gather_into_tensor_coalesced` of such shards, each result taken by a getitem that only
its `wait_tensor` reads, is a bucket of its own (members in input order, no copy-outs; ir: one
launch, a wait per result).

A gradient reduction is a functional `reduce_scatter_tensor` (FSDP) or `all_reduce` (DDP, and
HSDP's replicate step) whose only user is its `wait_tensor` and whose waited result reaches
nothing but the graph output: through single-input casts, views, layout copies and scalar
arithmetic (a bf16 gradient cast to fp32, divided by the world size), through another
gradient reduction (HSDP's reduce-scatter then all-reduce), or through the sum of reduced
gradients (a tied parameter's, reduced once per use); their `_coalesced` forms
(Inductor's `bucket_mode="coalesced"`) when every result, waited through its getitem, does so.
Nodes past the first one marked `autograd_backward` are backward, as lowering reads them (a
bucketing pass may not have marked what it added). It is tagged
`comm_type="fsdp_reduce_scatter"` (lowering gives it the role `overlap-reduce-scatter` acts on)
and `fsdp_gradient_reduction` with its kind. Collectives of tensor parallelism act on
activations: their results feed compute, or their inputs are computed, so they are neither
gathers nor gradient reductions and keep their place in the collective order. `groups` limits
recognition to the named process groups (a graph whose TP collectives touch graph inputs or
outputs directly); a gather of a non-floating graph input (token ids) is never a parameter's,
nor one of a tangent (an output's gradient, by the `meta["desc"]` AOTAutograd gives its inputs).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Iterator
from typing import Any

import attrs
import torch
from torch import fx

from .fx import REDUCE_SCATTER_TAG
from .targets import pads_first_dim_end
from ..ir import tags
from ..ir.opclass import COLLECTIVE_NAMESPACES

__all__ = ["STRUCTURAL_TAG", "StructuralGather", "StructuralReduction", "StructuralResult", "find_fsdp_gathers",
           "find_gradient_reductions", "tag_fsdp_collectives", "tag_fsdp_gathers", "untag_fsdp_gathers"]

#: set to True on the gathers this stage tagged (so the tags can be told apart, or removed)
STRUCTURAL_TAG = tags.STRUCTURAL
REDUCTION_TAG = tags.GRADIENT_REDUCTION  # the kind of a recognised gradient reduction
_TAG_KEYS = (tags.COMM_TYPE, tags.PARAM_NAME, tags.UNSHARDED_NBYTES, REDUCTION_TAG, tags.BUCKET_ID,
             tags.BUCKET_MEMBERS, tags.BUCKET_COPY_OUT, STRUCTURAL_TAG)
_GATHERS = ("all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced")
_PRE_BUCKET_GATHER = "bucketing::_pre_bucket_all_gather"  # Inductor's custom-op pack of a bucket (its first argument: the shards)
_CAT = "aten::cat"
_EMPTY = ("aten::empty", "aten::empty_strided", "aten::new_empty")
_REDUCTIONS = ("reduce_scatter_tensor", "all_reduce", "reduce_scatter_tensor_coalesced", "all_reduce_coalesced")
_CASTS = {"prims::convert_element_type", "aten::_to_copy", "aten::to"}
# single-input ops that re-lay out a shard without changing what it holds, though their schema
# does not declare an alias (or copies): still "the parameter's shard"
_LAYOUT_COPIES = {"aten::clone", "aten::contiguous", "aten::_unsafe_view", "aten::reshape", "aten::flatten",
                  "aten::view_as_real", "aten::view_as_complex"}
# DTensor pads a rank's smaller shard of a parameter whose first dim no world size divides at
# the end of that dim before gathering it (SimpleFSDP, torchtitan): only the ranks with a smaller
# shard have the pad, so taken for compute it made the ranks recognise other gathers
_PAD = "aten::constant_pad_nd"  # (when `pads_first_dim_end`)
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
    members: tuple[str, ...] = ()  # a bucket's graph inputs, in pack order (empty: not a bucket)
    copy_outs: tuple[str, ...] = ()  # a bucket's clones that copy its members out of the gathered buffer
    waits: tuple[str, ...] = ()  # a coalesced gather's wait per result (its first is `wait`)

    @property
    def bucket(self) -> str | None:
        return self.launch if self.members else None

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self, recurse=False) | {"path": list(self.path), "members": list(self.members),
                                                    "copy_outs": list(self.copy_outs), "waits": list(self.waits)}


@attrs.frozen
class StructuralReduction:
    """One recognised gradient reduction: the launch, its wait, its kind, what lies between the wait and the output."""

    launch: str
    wait: str
    kind: str                # "reduce_scatter_tensor" or "all_reduce" (or their `_coalesced` forms)
    group: str | None
    tail: tuple[str, ...]    # the casts/views/scalar ops (and later reductions) from the wait(s) to the output
    waits: tuple[str, ...] = ()  # a coalesced reduction's wait per result (its first is `wait`)

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self, recurse=False) | {"tail": list(self.tail), "waits": list(self.waits)}


@attrs.define
class StructuralResult:
    tagged: list[StructuralGather] = attrs.field(factory=list)
    skipped: list[tuple[str, str]] = attrs.field(factory=list)  # (collective node, why it was not tagged)
    reductions: list[StructuralReduction] = attrs.field(factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"tagged": [g.as_dict() for g in self.tagged],
                "reductions": [r.as_dict() for r in self.reductions],
                "skipped": [{"node": n, "reason": r} for n, r in self.skipped]}

    def __str__(self) -> str:
        lines = [f"structural FSDP collectives: {len(self.tagged)} gathers and {len(self.reductions)} gradient "
                 f"reductions tagged, {len(self.skipped)} skipped"]
        for g in self.tagged:
            via = "".join(f" → %{p}" for p in g.path)
            if g.waits:
                lines.append(f"  %{g.launch}: {g.phase} coalesced gather of {', '.join('%' + m for m in g.members)}, "
                             f"{'size unknown' if g.nbytes is None else f'{g.nbytes} bytes'}")
                continue
            if g.members:
                lines.append(f"  %{g.launch}: {g.phase} bucketed gather of {', '.join('%' + m for m in g.members)}, "
                             f"{'size unknown' if g.nbytes is None else f'{g.nbytes} bytes'}, "
                             f"{len(g.copy_outs)} copy-outs")
                continue
            lines.append(f"  %{g.launch}: {g.phase} gather of %{g.param_name}{via}, "
                         f"{'size unknown' if g.nbytes is None else f'{g.nbytes} bytes'}")
        for r in self.reductions:
            via = "".join(f" → %{p}" for p in r.tail)
            waits = ", ".join(f"%{w}" for w in r.waits) if r.waits else f"%{r.wait}"
            lines.append(f"  %{r.launch}: gradient {r.kind} → {waits}{via} → output")
        lines += [f"  %{n}: not tagged: {r}" for n, r in self.skipped]
        return "\n".join(lines)


def _schema_name(node: fx.Node) -> str | None:
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return None if schema is None else schema.name


def _is_collective(node: fx.Node, op: str | None = None) -> bool:
    name = _schema_name(node)
    return (name is not None and name.split("::")[0] in COLLECTIVE_NAMESPACES
            and (op is None or name.endswith("::" + op)))


def _group(node: fx.Node) -> str | None:
    """The `group_name` argument of a functional collective, as lowering reads it."""
    schema = node.target._schema
    names = [a.name for a in schema.arguments]
    if "group_name" not in names:
        return None
    at = names.index("group_name")
    value = node.args[at] if at < len(node.args) else node.kwargs.get("group_name")
    return None if value is None else str(value)


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
    if name == _PAD:
        return pads_first_dim_end(node)
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
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):  # coalesced
        sizes = [v.numel() * v.dtype.itemsize for v in value]
        return sum(sizes) if all(isinstance(n, int) for n in sizes) else None
    if not isinstance(value, torch.Tensor):
        return None
    numel = value.numel()
    return numel * value.dtype.itemsize if isinstance(numel, int) else None


def _numel(node: fx.Node) -> int | None:
    value = node.meta.get("val")
    numel = value.numel() if isinstance(value, torch.Tensor) else None
    return numel if isinstance(numel, int) else None


def _passes_gradient_through(node: fx.Node) -> bool:
    """What may sit between a gradient's reduction and the output: a single-input cast, view or
    layout copy, or single-input arithmetic that keeps the element count (`grad / world_size`)."""
    if _passes_shard_through(node):
        return True
    if node.op != "call_function" or len(node.all_input_nodes) != 1 or _schema_name(node) is None:
        return False
    if node.target._schema.is_mutable or _is_collective(node):
        return False
    numel, source = _numel(node), _numel(node.all_input_nodes[0])
    return numel is not None and numel == source


def _phase(node: fx.Node, phase: str | None, backward: set[fx.Node] | None = None) -> str:
    """`phase`, else the node's own: backward when marked so or (`backward`) past the first node
    marked so, as lowering reads it (a pass that added nodes there may not have marked them)."""
    if phase is not None:
        return phase
    if backward is not None:
        return "backward" if node in backward else "forward"
    return "backward" if node.meta.get(tags.AUTOGRAD_BACKWARD) else "forward"


def _backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """The nodes lowering puts in the backward phase: the first marked backward and all after it."""
    found, seen = set(), False
    for node in graph.nodes:
        seen = seen or bool(node.meta.get(tags.AUTOGRAD_BACKWARD))
        if seen and node.op != "output":
            found.add(node)
    return found


def _check_args(phase: str | None, groups) -> frozenset[str] | None:
    if phase not in _PHASES:
        raise ValueError(f"phase must be None, 'forward' or 'backward', got {phase!r}")
    if isinstance(groups, str):
        raise TypeError("groups must be a collection of group names, not one string")
    return None if groups is None else frozenset(str(g) for g in groups)


def find_fsdp_gathers(graph: fx.Graph | fx.GraphModule, *, phase: str | None = None,
                      groups=None) -> Iterator[tuple[fx.Node, StructuralGather | None, str | None]]:
    """Each functional all-gather in graph order: (node, what it is as an FSDP gather or None, why not).

    `groups`: when given, only gathers on these process groups (names) can be FSDP ones."""
    groups = _check_args(phase, groups)
    graph = graph.graph if isinstance(graph, fx.GraphModule) else graph
    backward = _backward_nodes(graph) if phase is None else None
    for node in graph.nodes:
        if not any(_is_collective(node, op) for op in _GATHERS):
            continue
        if node.meta.get(tags.COMM_TYPE) is not None and not node.meta.get(STRUCTURAL_TAG):
            yield node, None, f"already tagged comm_type={node.meta[tags.COMM_TYPE]!r}"
            continue
        if groups is not None and _group(node) not in groups:
            yield node, None, f"its group {_group(node)!r} is not one of the FSDP groups {sorted(groups)}"
            continue
        users = list(node.users)
        if _coalesced(node):  # a bucket of its own: a result per shard, each waited through its getitem
            waits = _waits(node)
            if waits is None:
                yield node, None, f"its users are {[u.name for u in users]}, not a getitem per result, each waited once"
                continue
            pieces = node.args[0] if node.args else node.kwargs.get("inputs", ())
            members, why = _members(pieces)
            if why is not None:
                yield node, None, why
                continue
            yield node, StructuralGather(launch=node.name, wait=waits[0].name, param_name=node.name,
                                         phase=_phase(node, phase, backward), nbytes=_nbytes(node), path=(),
                                         members=members, waits=tuple(w.name for w in waits)), None
            continue
        if len(users) != 1 or not _is_collective(users[0], "wait_tensor"):
            yield node, None, f"its users are {[u.name for u in users]}, not exactly one wait_tensor"
            continue
        shard = node.args[0] if node.args else node.kwargs.get("input")
        if not isinstance(shard, fx.Node):
            yield node, None, "its input is not a graph value"
            continue
        shards, why = _bucket_shards(node, shard)
        if why is not None:
            yield node, None, why
            continue
        if shards is not None:  # a bucket: every packed shard is a parameter's
            members, why = _members(shards)
            if why is not None:
                yield node, None, why
            else:
                yield node, StructuralGather(launch=node.name, wait=users[0].name, param_name=node.name,
                                             phase=_phase(node, phase, backward), nbytes=_nbytes(node), path=(),
                                             members=members, copy_outs=tuple(_copy_outs(users[0]))), None
            continue
        source, path, stop = _trace_to_input(shard)
        if source is None:
            yield node, None, (f"its input does not trace back to a graph input through single-input "
                               f"casts/views (stopped at %{stop.name}, {stop.op} {stop.target})")
            continue
        if (why := _not_a_parameter(source)) is not None:
            yield node, None, "its " + why
            continue
        yield node, StructuralGather(launch=node.name, wait=users[0].name, param_name=source.name,
                                     phase=_phase(node, phase, backward), nbytes=_nbytes(node),
                                     path=tuple(p.name for p in path)), None


def _members(shards) -> tuple[tuple[str, ...], str | None]:
    """A bucket's members (the graph inputs its shards trace back to, in order), or why not one."""
    members = []
    for piece in shards:
        source, _, stop = _trace_to_input(piece) if isinstance(piece, fx.Node) else (None, [], piece)
        if source is None:
            return (), (f"bucket member %{getattr(stop, 'name', stop)} does not trace back to a graph input "
                        "through single-input casts/views")
        if (why := _not_a_parameter(source)) is not None:
            return (), "bucket member " + why
        members.append(source.name)
    return tuple(members), None


def _coalesced(node: fx.Node) -> bool:
    """A `*_coalesced` functional collective (a list of inputs, a result per input)."""
    name = _schema_name(node)
    return name is not None and name.endswith("_coalesced") and _is_collective(node)


def _waits(node: fx.Node) -> list[fx.Node] | None:
    """The waits completing a functional collective: its one wait_tensor, or (coalesced) one per
    result, each on a getitem that only it reads; None when it is not waited so."""
    if not _coalesced(node):
        wait = _single_wait(node)
        return None if wait is None else [wait]
    inputs = node.args[0] if node.args else None  # one result per input: each must be waited
    count = len(inputs) if isinstance(inputs, (list, tuple)) else None
    waits, indices = [], []
    for user in node.users:
        if (user.op != "call_function" or user.target is not operator.getitem or len(user.args) != 2
                or not isinstance(user.args[1], int)):
            return None
        wait = _single_wait(user)
        if wait is None:
            return None
        waits.append(wait)
        indices.append(user.args[1])
    if not waits or count is None or sorted(indices) != list(range(count)):
        return None
    position = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(waits, key=position.__getitem__)


def _not_a_parameter(source: fx.Node) -> str | None:
    value = source.meta.get("val")
    if isinstance(value, torch.Tensor) and not (value.dtype.is_floating_point or value.dtype.is_complex):
        return f"graph input %{source.name} holds {value.dtype}, not a parameter's values"
    # AOTAutograd describes each input of the graphs it makes (`meta["desc"]`, the same on every
    # rank): a tangent (the gradient of an output, as the loss's reaches the backward graph, or a
    # DTensor tangent's local tensor) is never a parameter's shard; a tp gather of it (sequence
    # parallel's last block) was taken for a re-gather. The model's own input is a plain input,
    # as a parameter torch.compile lifts is: that one the graph does not tell apart.
    is_tangent = getattr(source.meta.get("desc"), "is_tangent", None)
    if callable(is_tangent) and is_tangent() is True:
        return f"graph input %{source.name} is the gradient of an output (AOTAutograd's tangent), not a parameter's shard"
    return None


def _views_of(node: fx.Node) -> list[fx.Node]:
    """`node` and every single-input view (by schema, or getitem) of it, transitively."""
    found, stack = [node], [node]
    while stack:
        for user in stack.pop().users:
            if user not in found and _is_view(user):
                found.append(user)
                stack.append(user)
    return found


def _is_view(node: fx.Node) -> bool:
    if node.op != "call_function" or len(node.all_input_nodes) != 1:
        return False
    if node.target is operator.getitem:
        return True
    name = _schema_name(node)
    if name == "aten::_unsafe_view":
        return True
    if name is None:
        return False
    schema = node.target._schema
    return (not schema.is_mutable and bool(schema.returns) and schema.returns[0].alias_info is not None
            and not schema.returns[0].alias_info.is_write)


def _bucket_shards(launch: fx.Node, shard: fx.Node) -> tuple[list | None, str | None]:
    """A bucketed gather's packed shards (None: not a bucket), or why it is neither a bucket nor a
    plain gather. Forms (Inductor's bucketing.py, torchtitan's joint pass): `cat(shards)` gathered;
    `_out` into a buffer packed by `_pre_bucket_all_gather(shards)`, or from `copy_(narrow(buf), cat(shards))`
    into `buf = empty(...)`."""
    out = launch.kwargs.get("out")
    if _schema_name(shard) == _CAT and not isinstance(out, fx.Node):
        return list(shard.args[0]), None
    if not isinstance(out, fx.Node):
        return None, None  # a plain gather: its input is traced as a shard
    if _schema_name(out) == _PRE_BUCKET_GATHER:
        return list(out.args[0]) if out.args else list(out.kwargs.get("ag_ins", ())), None
    if _schema_name(shard) == _CAT:  # functional mode: the packed input, gathered into a fresh buffer
        return list(shard.args[0]), None
    if (_schema_name(out) in _EMPTY and _schema_name(shard) == "aten::copy_" and shard.args[0] in _views_of(out)
            and isinstance(cat := shard.args[1], fx.Node) and _schema_name(cat) == _CAT):
        return list(cat.args[0]), None  # default mode: the input is copy_(narrow(buf), cat(shards))
    return None, f"its out buffer %{out.name} ({out.target}) is not a bucket's packed buffer"


def _copy_outs(wait: fx.Node) -> list[fx.Node]:
    """The `aten.clone`s the wait's result reaches through views: a bucket's per-member copy-outs."""
    clones, stack, seen = [], [wait], {wait}
    while stack:
        for user in stack.pop().users:
            if user in seen:
                continue
            seen.add(user)
            if user.op == "call_function" and user.target is torch.ops.aten.clone.default:
                clones.append(user)
            elif _is_view(user):
                stack.append(user)
    position = {n: i for i, n in enumerate(wait.graph.nodes)} if clones else {}
    return [c.name for c in sorted(clones, key=position.__getitem__)]


def _reduction_kind(node: fx.Node) -> str | None:
    for kind in _REDUCTIONS:
        if _is_collective(node, kind):
            return kind
    return None


def _single_wait(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 and _is_collective(users[0], "wait_tensor") else None


_ADDS = {"aten::add"}  # aten.add.Tensor: a tied parameter's gradients, reduced one by one, summed


def _accumulates_gradients(node: fx.Node) -> bool:
    """A sum of reduced gradients (a tied parameter, e.g. llama3 1B's embedding and output, is
    gathered for each use, so its gradient comes back as one reduction per use and an add): a
    functional add whose every input is, through casts and views, a reduction's wait."""
    if node.op != "call_function" or _schema_name(node) not in _ADDS or node.target._schema.is_mutable:
        return False
    inputs = node.all_input_nodes
    if len(inputs) < 2 or any(not isinstance(a, fx.Node) for a in node.args[:2]):
        return False
    for value in inputs:
        while _passes_gradient_through(value) and not _is_collective(value, "wait_tensor"):
            value = value.all_input_nodes[0]
        source = value.all_input_nodes[0] if _is_collective(value, "wait_tensor") and value.all_input_nodes else None
        if source is not None and source.target is operator.getitem:  # a coalesced reduction's result
            source = source.args[0]
        if source is None or _reduction_kind(source) is None:
            return False
    return True


def _tail_to_output(wait: fx.Node) -> tuple[list[fx.Node], fx.Node | None]:
    """The nodes from `wait` to the graph output (passing a gradient through, or reducing it
    further), and None; or what was found so far and the first user that is neither."""
    tail, seen, stack = [], {wait}, [wait]
    while stack:
        for user in stack.pop().users:
            if user.op == "output" or user in seen:
                continue
            if _passes_gradient_through(user) or _accumulates_gradients(user):
                found = [user]
            elif _reduction_kind(user) is not None and (then := _single_wait(user)) is not None:
                found = [user, then]
            else:
                return tail, user
            seen.update(found)
            tail += found
            stack.append(found[-1])
    return tail, None


def find_gradient_reductions(graph: fx.Graph | fx.GraphModule, *, phase: str | None = None, groups=None
                             ) -> Iterator[tuple[fx.Node, StructuralReduction | None, str | None]]:
    """Each functional reduce-scatter and all-reduce in graph order: (node, what it is as a
    gradient reduction or None, why not). `phase`, `groups`: as for `find_fsdp_gathers`."""
    groups = _check_args(phase, groups)
    graph = graph.graph if isinstance(graph, fx.GraphModule) else graph
    backward = _backward_nodes(graph) if phase is None else None
    position = {n: i for i, n in enumerate(graph.nodes)}
    for node in graph.nodes:
        kind = _reduction_kind(node)
        if kind is None:
            continue
        if node.meta.get(tags.COMM_TYPE) is not None and not node.meta.get(STRUCTURAL_TAG):
            yield node, None, f"already tagged comm_type={node.meta[tags.COMM_TYPE]!r}"
            continue
        if groups is not None and _group(node) not in groups:
            yield node, None, f"its group {_group(node)!r} is not one of the FSDP groups {sorted(groups)}"
            continue
        if _phase(node, phase, backward) != "backward":
            yield node, None, "a forward collective: not a gradient's reduction"
            continue
        waits = _waits(node)
        if waits is None:
            want = "a getitem per result, each waited once" if _coalesced(node) else "exactly one wait_tensor"
            yield node, None, f"its users are {[u.name for u in node.users]}, not {want}"
            continue
        tail, stop = [], None
        for wait in waits:
            more, stop = _tail_to_output(wait)
            tail += more
            if stop is not None:
                break
        if stop is not None:
            yield node, None, (f"its result reaches %{stop.name} ({stop.op} {stop.target}), not only the graph "
                               f"output through casts/views: an activation's collective")
            continue
        yield node, StructuralReduction(launch=node.name, wait=waits[0].name, kind=kind, group=_group(node),
                                        tail=tuple(n.name for n in sorted(set(tail), key=position.__getitem__)),
                                        waits=tuple(w.name for w in waits) if _coalesced(node) else ()), None


def tag_fsdp_gathers(graph: fx.Graph | fx.GraphModule, *, phase: str | None = None, groups=None) -> StructuralResult:
    """Tag every structurally recognised FSDP gather of `graph` in place; say what was and was not tagged.

    `phase` None reads each gather's phase as lowering does (`meta["autograd_backward"]`);
    "forward"/"backward" says the whole graph is that phase (e.g. Inductor's backward graph).
    `groups`: only collectives on these process groups are FSDP ones (None: any group).
    Running it twice gives the same tags. `tag_fsdp_collectives` also tags gradient reductions.
    """
    return tag_fsdp_collectives(graph, phase=phase, groups=groups, reductions=False)


def tag_fsdp_collectives(graph: fx.Graph | fx.GraphModule, *, phase: str | None = None, groups=None,
                         reductions: bool = True) -> StructuralResult:
    """`tag_fsdp_gathers`, and (with `reductions`) every gradient reduce-scatter / all-reduce too."""
    graph = graph.graph if isinstance(graph, fx.GraphModule) else graph
    result = StructuralResult()
    if reductions:
        for node, found, reason in list(find_gradient_reductions(graph, phase=phase, groups=groups)):
            if found is None:
                result.skipped.append((node.name, reason))
                continue
            node.meta.update({tags.COMM_TYPE: REDUCE_SCATTER_TAG, REDUCTION_TAG: found.kind, STRUCTURAL_TAG: True})
            result.reductions.append(found)
    by_name = {n.name: n for n in graph.nodes}
    for node, gather, reason in list(find_fsdp_gathers(graph, phase=phase, groups=groups)):
        if gather is None:
            result.skipped.append((node.name, reason))
            continue
        meta = node.meta
        meta[tags.COMM_TYPE] = tags.ALL_GATHER_BACKWARD if gather.phase == "backward" else tags.ALL_GATHER
        meta[tags.PARAM_NAME] = gather.param_name
        if gather.members:
            meta[tags.BUCKET_ID] = gather.bucket
            meta[tags.BUCKET_MEMBERS] = list(gather.members)
            for clone in gather.copy_outs:
                copy_meta = by_name[clone].meta
                copy_meta[tags.BUCKET_COPY_OUT] = gather.bucket
                copy_meta[STRUCTURAL_TAG] = True
        if gather.nbytes is None:
            meta.pop(tags.UNSHARDED_NBYTES, None)
        else:
            meta[tags.UNSHARDED_NBYTES] = gather.nbytes
        meta[STRUCTURAL_TAG] = True
        result.tagged.append(gather)
    if result.tagged or result.reductions or result.skipped:
        LOG.debug("%s", result)
    return result


def untag_fsdp_gathers(graph: fx.Graph | fx.GraphModule) -> int:
    """Remove the tags `tag_fsdp_gathers` left; returns how many gathers it untagged."""
    graph = graph.graph if isinstance(graph, fx.GraphModule) else graph
    count = 0
    for node in graph.nodes:
        if node.meta.get(STRUCTURAL_TAG):
            count += tags.COMM_TYPE in node.meta  # a bucket's copy-outs carry tags too: not counted
            for key in _TAG_KEYS:
                node.meta.pop(key, None)
    return count
