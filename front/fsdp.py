"""FSDP front: trace a module into a joint forward/backward fx graph tagged as an FSDP graph
pass leaves it (docs/design.md, "The input fxsched expects"); ``fsdp_joint_graph`` is the entry point."""

from __future__ import annotations

import contextlib
import math
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives  # noqa: F401  registers autograd for the functional collectives
from torch import fx, nn
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from ..ir import tags

__all__ = [
    "DEFAULT_GROUP_NAME",
    "Bucket",
    "FrontResult",
    "fsdp_free_storage",
    "fsdp_joint_graph",
    "shard_tensor",
    "unshard_tensor",
]

# The name torch gives the default process group of a freshly initialised process
# (``dist.group.WORLD.group_name``); functional collectives find their group by it.
DEFAULT_GROUP_NAME = "0"

_aten = torch.ops.aten
_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
_WAIT = torch.ops._c10d_functional.wait_tensor.default
_REDUCE_SCATTER = torch.ops._c10d_functional.reduce_scatter_tensor.default
_CAST = _aten._to_copy.default
# Ops that share storage with their input although their schema does not say so.
_HIDDEN_ALIAS_OPS = frozenset({_aten._unsafe_view.default})


@torch.fx.node.has_side_effect
def fsdp_free_storage(tensor: torch.Tensor) -> None:
    """Release the storage behind an unsharded parameter (reshard after forward)."""
    if isinstance(tensor, fx.Proxy):
        # Symbolic retracing (unpickling a GraphModule re-traces its code): record the
        # call, which would otherwise vanish since it dispatches no tensor op.
        return tensor.tracer.create_proxy("call_function", fsdp_free_storage, (tensor,), {})
    # Only plain tensors own storage we may drop: fake/meta values (shape propagation,
    # retracing) and tensor subclasses are left alone.
    if type(tensor) is torch.Tensor and not tensor.is_meta:
        tensor.untyped_storage().resize_(0)


@dataclass(frozen=True)
class Bucket:
    """Parameters gathered together by one flat all-gather."""

    bucket_id: str
    members: tuple[str, ...]


def shard_tensor(tensor: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """The flat dim-0 shard ``rank`` of ``tensor``, zero padded to a multiple of ``world_size``."""
    flat = tensor.detach().reshape(-1)
    shard = -(-flat.numel() // world_size)
    padded = torch.cat([flat, flat.new_zeros(shard * world_size - flat.numel())])
    return padded[rank * shard:(rank + 1) * shard].clone()


def unshard_tensor(shards: Sequence[torch.Tensor], shape: Sequence[int]) -> torch.Tensor:
    """Inverse of ``shard_tensor``: concatenate the per-rank shards and drop the padding."""
    flat = torch.cat([s.reshape(-1) for s in shards])
    return flat[: math.prod(shape)].reshape(shape).clone()


@dataclass
class FrontResult:
    """The tagged joint graph and what is needed to feed it and read its outputs.

    ``gm`` takes ``(shard of each parameter in param_names order..., data inputs...)`` and
    returns ``(loss, grad of each shard in param_names order...)``; gradients are summed over
    ranks by the reduce-scatters, so they are shards of the gradient of the sum of the
    per-rank losses.
    """

    gm: fx.GraphModule
    param_names: list[str]
    param_shapes: dict[str, torch.Size]
    world_size: int
    group_name: str
    num_data_inputs: int
    buckets: list[Bucket]
    mixed_precision: torch.dtype | None
    reshard_after_forward: bool

    def shard_numel(self, name: str) -> int:
        return -(-math.prod(self.param_shapes[name]) // self.world_size)

    def shard_inputs(self, module: nn.Module, rank: int, data: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Graph inputs for ``rank``: each parameter's flat padded shard, then ``data``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world size {self.world_size}")
        if len(data) != self.num_data_inputs:
            raise ValueError(f"expected {self.num_data_inputs} data inputs, got {len(data)}")
        params = dict(module.named_parameters())
        missing = [n for n in self.param_names if n not in params]
        if missing:
            raise ValueError(f"module lacks parameters the graph was traced with: {missing}")
        shards = []
        for name in self.param_names:
            if params[name].shape != self.param_shapes[name]:
                raise ValueError(
                    f"parameter {name!r} has shape {tuple(params[name].shape)}, "
                    f"traced with {tuple(self.param_shapes[name])}"
                )
            shards.append(shard_tensor(params[name], self.world_size, rank))
        return [*shards, *data]

    def split_outputs(self, outputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss, {param name: gradient shard})`` from one rank's graph outputs."""
        if len(outputs) != 1 + len(self.param_names):
            raise ValueError(f"expected {1 + len(self.param_names)} outputs, got {len(outputs)}")
        return outputs[0], dict(zip(self.param_names, outputs[1:]))

    def unshard_grads(self, outputs_per_rank: Sequence[Sequence[torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Full gradients ``{param name: grad}`` from every rank's graph outputs, in rank order."""
        if len(outputs_per_rank) != self.world_size:
            raise ValueError(f"expected outputs of {self.world_size} ranks, got {len(outputs_per_rank)}")
        per_rank = [self.split_outputs(out)[1] for out in outputs_per_rank]
        return {
            name: unshard_tensor([grads[name] for grads in per_rank], self.param_shapes[name])
            for name in self.param_names
        }


# --------------------------------------------------------------------------- options


def _check_options(world_size, group_name, mixed_precision, example_inputs) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not isinstance(group_name, str) or not group_name:
        raise ValueError(f"group_name must be a non-empty string, got {group_name!r}")
    if mixed_precision is not None and (
        not isinstance(mixed_precision, torch.dtype) or not mixed_precision.is_floating_point
    ):
        raise ValueError(f"mixed_precision must be None or a floating dtype, got {mixed_precision!r}")
    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"example_inputs[{i}] must be a tensor, got {type(x).__name__}")


def _resolve_buckets(module: nn.Module, names: list[str], buckets) -> list[Bucket]:
    """Turn the ``buckets`` option into Bucket objects ordered by their first parameter."""
    if buckets is None:
        return []
    if buckets == "per-module":
        known = set(names)
        groups: dict[int, list[str]] = {}
        for prefix, sub in module.named_modules():
            owned = [f"{prefix}.{n}" if prefix else n for n, _ in sub.named_parameters(recurse=False)]
            # Shared parameters are reported under their first name only.
            owned = [n for n in owned if n in known]
            if owned:
                groups[id(sub)] = owned
        member_lists = list(groups.values())
    elif isinstance(buckets, str):
        raise ValueError(f"buckets must be None, 'per-module' or a list of lists of names, got {buckets!r}")
    else:
        member_lists = [list(b) for b in buckets]
        seen: set[str] = set()
        known = set(names)
        for i, members in enumerate(member_lists):
            if not members:
                raise ValueError(f"bucket {i} is empty")
            for name in members:
                if name not in known:
                    raise ValueError(f"bucket {i} names unknown parameter {name!r}")
                if name in seen:
                    raise ValueError(f"parameter {name!r} is in more than one bucket")
                seen.add(name)
    position = {n: i for i, n in enumerate(names)}
    member_lists = [sorted(m, key=position.__getitem__) for m in member_lists]
    member_lists.sort(key=lambda m: position[m[0]])
    return [Bucket(f"bucket{i}", tuple(m)) for i, m in enumerate(member_lists)]


# --------------------------------------------------------------------------- tracing


class _LazyParameters(dict):
    """A module's ``_parameters`` whose lookups return the gathered (unsharded) parameter.

    ``nn.Module.__getattr__`` reads parameters through ``_parameters[name]``, so every access
    in the forward (including ones from outside the owning module, e.g. tied weights) goes
    through ``realize`` and the gather lands just before the first use, as FSDP does.
    """

    def __init__(self, original: dict, name_of: dict[int, str], realize: Callable[[str], torch.Tensor]):
        super().__init__(original)
        self._name_of = name_of
        self._realize = realize

    def __getitem__(self, key):
        value = dict.__getitem__(self, key)
        return None if value is None else self._realize(self._name_of[id(value)])

    def get(self, key, default=None):
        return self[key] if key in self else default


@contextlib.contextmanager
def _lazy_parameters(module: nn.Module, name_of: dict[int, str], realize):
    swapped = []
    try:
        for sub in module.modules():
            own = sub.__dict__["_parameters"]
            if own:
                sub.__dict__["_parameters"] = _LazyParameters(own, name_of, realize)
                swapped.append((sub, own))
        yield
    finally:
        for sub, own in swapped:
            sub.__dict__["_parameters"] = own


@dataclass
class _Plan:
    names: list[str]
    shapes: dict[str, torch.Size]
    dtypes: dict[str, torch.dtype]
    buckets: list[Bucket]
    world_size: int
    group_name: str
    compute_dtype: torch.dtype | None

    def shard_len(self, name: str) -> int:
        return -(-math.prod(self.shapes[name]) // self.world_size)

    def cast(self, shard: torch.Tensor) -> torch.Tensor:
        if self.compute_dtype is None or shard.dtype == self.compute_dtype:
            return shard
        return _CAST(shard, dtype=self.compute_dtype)

    def gather(self, packed: torch.Tensor) -> torch.Tensor:
        return _WAIT(_GATHER(packed, self.world_size, self.group_name))

    def to_param(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        numel = math.prod(self.shapes[name])
        return _aten.view.default(_aten.slice.Tensor(flat, 0, 0, numel), list(self.shapes[name]))

    def gather_param(self, shard: torch.Tensor, name: str) -> torch.Tensor:
        return self.to_param(self.gather(self.cast(shard)), name)

    def gather_bucket(self, shards: dict[str, torch.Tensor], bucket: Bucket) -> dict[str, torch.Tensor]:
        lens = [self.shard_len(m) for m in bucket.members]
        packed = _aten.cat.default([self.cast(shards[m]) for m in bucket.members])
        # Rank r's block of the gathered buffer is its packed shards: view it as
        # (world_size, total) and copy each member's column band out contiguously.
        grid = _aten.view.default(self.gather(packed), [self.world_size, sum(lens)])
        out, offset = {}, 0
        for name, length in zip(bucket.members, lens):
            band = _aten.slice.Tensor(grid, 1, offset, offset + length)
            copy = _aten.clone.default(band, memory_format=torch.contiguous_format)
            out[name] = self.to_param(_aten.view.default(copy, [self.world_size * length]), name)
            offset += length
        return out


def _trace(module, loss_fn, plan: _Plan, example_inputs) -> tuple[fx.GraphModule, str]:
    """make_fx over forward + ``torch.autograd.grad``; returns the graph and the last forward node's name."""
    name_of = {id(p): n for n, p in module.named_parameters()}
    bucket_of = {m: b for b in plan.buckets for m in b.members}
    n_params = len(plan.names)
    boundary: list[str] = []

    def joint(*flat):
        shards = dict(zip(plan.names, flat[:n_params]))
        data = list(flat[n_params:])
        gathered: dict[str, torch.Tensor] = {}

        def realize(name: str) -> torch.Tensor:
            if name not in gathered:
                bucket = bucket_of.get(name)
                # A parameter read first under the forward's torch.no_grad() (an in-place
                # clamp_ of it) is still a leaf that requires grad: its gather must be recorded
                # by autograd, or every later use of it gets no gradient (zeros).
                with torch.enable_grad():
                    if bucket is None:
                        gathered[name] = plan.gather_param(shards[name], name)
                    else:
                        gathered.update(plan.gather_bucket(shards, bucket))
            return gathered[name]

        if plan.compute_dtype is not None:
            # Mixed precision runs the compute in the low dtype, inputs included.
            data = [plan.cast(x) if x.is_floating_point() else x for x in data]
        with _lazy_parameters(module, name_of, realize):
            loss = loss_fn(module, *data)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("loss_fn must return a tensor with one element")
        if not loss.requires_grad:
            raise ValueError("the loss does not depend on any parameter")
        boundary.append(next(iter(reversed(get_proxy_mode().tracer.graph.nodes))).name)
        grads = torch.autograd.grad(
            loss, [shards[n] for n in plan.names], allow_unused=True, materialize_grads=True
        )
        return (loss, *grads)

    shards = [
        torch.empty(plan.shard_len(n), dtype=plan.dtypes[n], requires_grad=True) for n in plan.names
    ]
    # Real buffers of the module become graph constants (_allow_non_fake_inputs).
    gm = make_fx(joint, tracing_mode="fake", _allow_non_fake_inputs=True)(*shards, *example_inputs)
    return gm, boundary[0]


# --------------------------------------------------------------------------- graph analysis


def _alias_sources(node: fx.Node) -> list[fx.Node]:
    """The inputs of ``node`` whose storage its output shares (an in-place op's result is the
    tensor it wrote: make_fx reads later uses of that tensor through the in-place node)."""
    if node.op != "call_function":
        return []
    target = node.target
    if target is operator.getitem:
        # getitem of a list of aliases (split, unbind) aliases that list's source.
        src = node.args[0]
        return [src] if isinstance(src, fx.Node) else []
    if not isinstance(target, torch._ops.OpOverload):
        return []
    if target in _HIDDEN_ALIAS_OPS:
        return [a for a in node.args[:1] if isinstance(a, fx.Node)]
    schema = target._schema
    sets = {
        s
        for r in schema.returns
        if r.alias_info is not None
        for s in r.alias_info.before_set
    }
    if not sets:
        return []
    sources = []
    for i, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is None or not (set(info.before_set) & sets):
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        if isinstance(value, fx.Node):
            sources.append(value)
    return sources


def _alias_closure(root: fx.Node, stop: Callable[[fx.Node], bool] | None = None) -> list[fx.Node]:
    """``root`` and every node whose output shares its storage (not entering ``stop`` nodes)."""
    seen = {root}
    out = [root]
    stack = [root]
    while stack:
        node = stack.pop()
        for user in node.users:
            if user in seen or (stop is not None and stop(user)):
                continue
            if node in _alias_sources(user):
                seen.add(user)
                out.append(user)
                stack.append(user)
    return out


def _is_backward(node: fx.Node) -> bool:
    return bool(node.meta.get(tags.AUTOGRAD_BACKWARD, False))


def _after_outputs(node: fx.Node, order: dict[fx.Node, int]) -> fx.Node:
    """The node after which to insert so as to follow ``node`` and its getitem projections."""
    last = node
    for user in node.users:
        if user.target is operator.getitem and order.get(user, -1) > order.get(last, -1):
            last = user
    return last


def _placeholder_sources(node: fx.Node) -> set[fx.Node] | None:
    """The placeholders a gather input is packed from (casts, cat), or None if it is not a pack."""
    out, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n.op == "placeholder":
            out.add(n)
        elif n.target in (_CAST, _aten.cat.default):
            stack.extend(n.all_input_nodes)
        else:
            return None
    return out


@dataclass
class _Gather:
    """A forward gather and what it realises: ``roots`` maps each parameter to its unsharded storage."""

    node: fx.Node
    param_name: str
    bucket: Bucket | None
    nbytes: int
    roots: dict[str, fx.Node]


def _tag(gm: fx.GraphModule, plan: _Plan, boundary: str) -> list[_Gather]:
    graph = gm.graph
    in_backward = False
    for node in graph.nodes:
        if node.op == "output":
            # The output hands back the gradients: it closes the backward phase.
            node.meta[tags.AUTOGRAD_BACKWARD] = True
        else:
            node.meta[tags.AUTOGRAD_BACKWARD] = in_backward
        in_backward = in_backward or node.name == boundary

    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    name_of_input = dict(zip(placeholders, plan.names))
    buckets_by_members = {frozenset(b.members): b for b in plan.buckets}
    bucket_of = {m: b for b in plan.buckets for m in b.members}

    gathers = []
    for node in graph.nodes:
        if node.target is not _GATHER or _is_backward(node):
            continue
        sources = _placeholder_sources(node.args[0]) or set()
        names = {name_of_input[p] for p in sources if p in name_of_input}
        bucket = buckets_by_members.get(frozenset(names))
        if bucket is None and (len(names) != 1 or names & bucket_of.keys()):
            continue  # not a parameter gather (e.g. the model's own collective): left untagged
        (wait,) = node.users
        nbytes = node.meta["val"].numel() * node.meta["val"].dtype.itemsize
        node.meta.update(comm_type=tags.ALL_GATHER, fsdp_unsharded_nbytes=int(nbytes))
        if bucket is None:
            (name,) = names
            node.meta[tags.PARAM_NAME] = name
            gathers.append(_Gather(node, name, None, nbytes, {name: wait}))
            continue
        node.meta.update(
            param_name=bucket.bucket_id,
            fsdp_bucket_id=bucket.bucket_id,
            fsdp_bucket_members=list(bucket.members),
        )
        (grid,) = wait.users
        copies = [c for band in grid.users for c in band.users if c.target is _aten.clone.default]
        copies.sort(key=lambda c: c.args[0].args[2])  # by column offset = member order
        if len(copies) != len(bucket.members):
            raise AssertionError(f"bucket {bucket.bucket_id}: found {len(copies)} copy-outs")
        for copy in copies:
            copy.meta[tags.BUCKET_COPY_OUT] = bucket.bucket_id
        gathers.append(_Gather(node, bucket.bucket_id, bucket, nbytes, dict(zip(bucket.members, copies))))

    # A reduce-scatter belongs to the parameters whose gradient outputs it feeds.
    output = next(iter(reversed(graph.nodes)))
    out_args = output.args[0]
    grad_of = {arg: plan.names[i - 1] for i, arg in enumerate(out_args) if i > 0 and isinstance(arg, fx.Node)}
    for node in graph.nodes:
        if node.target is not _REDUCE_SCATTER:
            continue
        names, seen, stack = set(), {node}, [node]
        while stack:
            n = stack.pop()
            if n in grad_of:
                names.add(grad_of[n])
            for user in n.users:
                if user not in seen and user.op != "output":
                    seen.add(user)
                    stack.append(user)
        buckets = {bucket_of.get(n) for n in names}
        if len(buckets) != 1 or (None in buckets and len(names) != 1):
            continue  # feeds no gradient output, or several unrelated ones: not a parameter's
        (bucket,) = buckets
        node.meta[tags.COMM_TYPE] = tags.REDUCE_SCATTER
        if bucket is None:
            node.meta[tags.PARAM_NAME] = next(iter(names))
        else:
            node.meta.update(
                param_name=bucket.bucket_id,
                fsdp_bucket_id=bucket.bucket_id,
                fsdp_bucket_members=list(bucket.members),
            )
    return gathers


# --------------------------------------------------------------------------- reshard after forward


def _reshard(gm: fx.GraphModule, gathers: list[_Gather], inserted: list[fx.Node]) -> None:
    """Free each gathered parameter after its last forward reader and re-gather it for backward."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}

    def new_node(target, args, kwargs=None, meta=None) -> fx.Node:
        node = graph.call_function(target, tuple(args), kwargs or {})
        node.meta.update(meta or {})
        inserted.append(node)
        return node

    # Frees that follow the same reader go in the order they were made (gather order).
    last_free: dict[fx.Node, fx.Node] = {}

    def free_after(reader: fx.Node, args: list[fx.Node], meta: dict) -> None:
        with graph.inserting_after(last_free.get(reader, reader)):
            last_free[reader] = new_node(fsdp_free_storage, args, meta=meta)

    # Forward aliases of each parameter's unsharded storage (backward views of them are
    # backward readers, rewired below), through in-place results too.
    all_closures = [
        {name: _alias_closure(root, stop=_is_backward) for name, root in g.roots.items()} for g in gathers
    ]
    gathered = {n for closures in all_closures for closure in closures.values() for n in closure}
    for g, closures in zip(gathers, all_closures):
        for name, closure in closures.items():
            readers = set(closure)
            readers.update(u for n in closure for u in n.users if not _is_backward(u))
            last = _after_outputs(max(readers, key=order.__getitem__), order)
            free_after(last, [g.roots[name]], _free_meta(tags.RESHARD_FREE, name, g, False))

        backward_uses = {
            name: [(u, n) for n in closure for u in n.users if _is_backward(u)]
            for name, closure in closures.items()
        }
        needed = [name for name in g.roots if backward_uses[name]]
        if not needed:
            continue
        first = min((u for name in needed for u, _ in backward_uses[name]), key=order.__getitem__)
        with graph.inserting_before(first):
            new_roots = _regather(g, needed, new_node)
            for name in needed:
                # Rebuild from the new root the alias chains leading to what the backward
                # reads, and replay every forward in-place write of the storage (the backward
                # reads what the forward left there, as it would without the reshard).
                members = set(closures[name])
                writers = _forward_writers(closures[name], members, gathered, name)
                wanted: set[fx.Node] = set()
                stack = [src for _, src in backward_uses[name]] + writers
                while stack:
                    n = stack.pop()
                    if n not in wanted:
                        wanted.add(n)
                        if n is not g.roots[name]:
                            stack.extend(a for a in n.all_input_nodes if a in members)
                replica = {g.roots[name]: new_roots[name]}
                for node in sorted(wanted - {g.roots[name]}, key=order.__getitem__):
                    replica[node] = new_node(
                        node.target,
                        fx.map_arg(node.args, lambda a: replica.get(a, a)),
                        fx.map_arg(node.kwargs, lambda a: replica.get(a, a)),
                        meta=_phase_copy(node.meta),
                    )
                for user, src in backward_uses[name]:
                    user.replace_input_with(src, replica[src])
        for name in needed:
            # Backward free after the last reader of the re-gathered storage.
            closure = _alias_closure(new_roots[name])
            readers = set(closure)
            readers.update(u for n in closure for u in n.users)
            last = _after_outputs(max(readers, key=lambda n: order.get(n, -1)), order)
            free_after(last, [new_roots[name]], _free_meta(tags.RESHARD_FREE_BACKWARD, name, g, True))


def _writes(node: fx.Node) -> list[fx.Node]:
    """The nodes ``node`` writes in place: its schema's ``Tensor(a!)`` arguments (lists too)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return []
    out: list[fx.Node] = []
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        fx.map_arg(value, out.append)
    return out


def _forward_writers(closure: list[fx.Node], members: set[fx.Node], gathered: set[fx.Node], name: str) -> list[fx.Node]:
    """The forward ops that write parameter ``name``'s gathered storage (``members``), to be
    replayed on its backward re-gather; a ValueError for one that cannot be replayed there."""
    writers = list(dict.fromkeys(  # in a fixed order, so the first refused is always the same
        u for n in closure for u in n.users
        if not _is_backward(u) and any(w in members for w in _writes(u))
    ))
    for w in writers:
        why = None
        if torch.Tag.nondeterministic_seeded in w.target.tags:
            why = "it is random (a replay draws other numbers)"
        elif w.target.namespace in ("_c10d_functional", "c10d", "c10d_functional"):
            why = "it is a collective"
        else:
            others = [a.name for a in w.all_input_nodes if a in gathered and a not in members]
            if others:
                why = f"it reads {others}, another parameter's gathered storage, freed by then"
        if why:
            raise ValueError(
                f"%{w.name} ({w.target}) writes the gathered storage of parameter {name!r} in the forward, "
                f"which the backward reads: resharding would re-gather it and replay the write, but {why}; "
                "use reshard_after_forward=False"
            )
    return writers


def _phase_copy(meta: dict) -> dict:
    # Values are recomputed (fresh storages); eager_input_vals would point at forward values.
    kept = {k: v for k, v in meta.items() if k not in ("val", "tensor_meta", "seq_nr", "eager_input_vals")}
    kept[tags.AUTOGRAD_BACKWARD] = True
    return kept


def _free_meta(comm_type: str, name: str, g: _Gather, backward: bool) -> dict:
    meta = {tags.COMM_TYPE: comm_type, tags.PARAM_NAME: name, tags.AUTOGRAD_BACKWARD: backward, "val": None}
    if g.bucket is not None:
        meta[tags.BUCKET_ID] = g.bucket.bucket_id
    return meta


def _regather(g: _Gather, needed: list[str], new_node) -> dict[str, fx.Node]:
    """Emit the backward re-gather of ``g`` (same launch chain as the forward one); returns new roots."""
    old = g.node
    launch_meta = {
        k: v
        for k, v in old.meta.items()
        if k in (tags.PARAM_NAME, tags.UNSHARDED_NBYTES, tags.BUCKET_ID, tags.BUCKET_MEMBERS)
    }
    launch_meta.update(comm_type=tags.ALL_GATHER_BACKWARD, autograd_backward=True)

    def copy_chain(node: fx.Node) -> fx.Node:
        # The pack / cast DAG between the shard placeholders and the gather.
        if node.op == "placeholder":
            return node
        return new_node(
            node.target,
            fx.map_arg(node.args, copy_chain),
            fx.map_arg(node.kwargs, copy_chain),
            meta=_phase_copy(node.meta),
        )

    launch = new_node(_GATHER, [copy_chain(old.args[0]), *old.args[1:]], meta=launch_meta)
    (old_wait,) = old.users
    wait = new_node(_WAIT, [launch], meta=_phase_copy(old_wait.meta))
    if g.bucket is None:
        return {g.param_name: wait}
    (old_grid,) = old_wait.users
    grid = new_node(old_grid.target, [wait, *old_grid.args[1:]], meta=_phase_copy(old_grid.meta))
    roots = {}
    for name in needed:
        old_copy = g.roots[name]
        old_band = old_copy.args[0]
        band = new_node(old_band.target, [grid, *old_band.args[1:]], meta=_phase_copy(old_band.meta))
        roots[name] = new_node(old_copy.target, [band], dict(old_copy.kwargs), meta=_phase_copy(old_copy.meta))
    return roots


# --------------------------------------------------------------------------- values


def _fill_values(gm: fx.GraphModule, inserted: Iterable[fx.Node]) -> None:
    """Fresh FakeTensor ``val`` for inserted nodes (never shared with the forward, so storages differ)."""
    fake_mode = next(
        n.meta["val"].fake_mode for n in gm.graph.nodes if n.op == "placeholder"
    )
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    with fake_mode:
        for node in sorted(inserted, key=order.__getitem__):
            if node.target is fsdp_free_storage:
                node.meta["val"] = None
                continue
            args = fx.map_arg(node.args, lambda n: n.meta["val"])
            kwargs = fx.map_arg(node.kwargs, lambda n: n.meta["val"])
            val = node.target(*args, **kwargs)
            node.meta["val"] = val
            if isinstance(val, torch.Tensor):
                node.meta["tensor_meta"] = _extract_tensor_metadata(val)
    for node in list(gm.graph.nodes):
        if "val" not in node.meta and node.target is operator.getitem and not node.users:
            # make_fx leaves unused projections of outputs that are None (e.g. the input
            # gradient of native_layer_norm_backward when the input needs none).
            gm.graph.erase_node(node)
    output = next(iter(reversed(gm.graph.nodes)))
    output.meta["val"] = fx.map_arg(output.args[0], lambda n: n.meta.get("val"))
    missing = [n.name for n in gm.graph.nodes if "val" not in n.meta]
    if missing:
        raise AssertionError(f"nodes without meta['val'] after tracing: {missing}")


# --------------------------------------------------------------------------- entry point


def fsdp_joint_graph(
    module: nn.Module,
    example_inputs: Sequence[torch.Tensor],
    loss_fn: Callable[..., torch.Tensor],
    world_size: int,
    *,
    reshard_after_forward: bool = True,
    buckets: None | str | Sequence[Sequence[str]] = None,
    mixed_precision: torch.dtype | None = None,
    group_name: str = DEFAULT_GROUP_NAME,
) -> FrontResult:
    """Trace ``loss_fn(module, *example_inputs)`` and its gradients as a tagged FSDP joint graph.

    ``loss_fn`` receives the module (its parameters read as gathered, unsharded tensors)
    and one rank's data inputs, and returns a scalar loss. ``example_inputs`` are one rank's
    data (shapes and dtypes are baked into the graph). ``buckets``: None (one gather per
    parameter), ``"per-module"`` (parameters owned directly by the same submodule) or a list
    of lists of parameter names (parameters not listed are gathered alone). Module buffers
    become graph constants. Each parameter is gathered at its first read in the forward.
    A forward that writes a parameter in place writes its gathered copy, never the shard; the
    backward re-gather replays such writes (a ValueError names one it cannot replay).

    Tags (``node.meta``), beyond that contract:

    - every node: ``autograd_backward`` (bool; the output node counts as backward) and
      ``val`` (``None`` for frees);
    - gathers: ``param_name`` is the parameter, or for a bucket its id (``"bucket<i>"``,
      ids ordered by first member), with ``fsdp_bucket_id``/``fsdp_bucket_members``;
    - reduce-scatters: ``comm_type="fsdp_reduce_scatter"`` and the same names as the gather;
    - frees (``fsdp_free_storage(t)``): one per parameter, ``param_name`` the parameter.
      For a bucket member, ``t`` is the member's copy-out and the free also carries
      ``fsdp_bucket_id``; the flat bucket buffer has no reader after its copy-outs and
      is released by the generated code like any dead value.
    """
    example_inputs = tuple(example_inputs)
    _check_options(world_size, group_name, mixed_precision, example_inputs)
    named = list(module.named_parameters())
    if not named:
        raise ValueError("module has no parameters to shard")
    for name, p in named:
        if not p.is_floating_point():
            raise ValueError(f"parameter {name!r} has non-floating dtype {p.dtype}")
    names = [n for n, _ in named]
    plan = _Plan(
        names=names,
        shapes={n: p.shape for n, p in named},
        dtypes={n: p.dtype for n, p in named},
        buckets=_resolve_buckets(module, names, buckets),
        world_size=world_size,
        group_name=group_name,
        compute_dtype=mixed_precision,
    )
    gm, boundary = _trace(module, loss_fn, plan, example_inputs)
    gathers = _tag(gm, plan, boundary)
    inserted: list[fx.Node] = []
    if reshard_after_forward:
        _reshard(gm, gathers, inserted)
    _fill_values(gm, inserted)
    gm.graph.lint()
    gm.recompile()
    return FrontResult(
        gm=gm,
        param_names=names,
        param_shapes=dict(plan.shapes),
        world_size=world_size,
        group_name=group_name,
        num_data_inputs=len(example_inputs),
        buckets=list(plan.buckets),
        mixed_precision=mixed_precision,
        reshard_after_forward=reshard_after_forward,
    )
