"""Lower a tagged torch.fx GraphModule into a Program. All reading of FSDP tags lives here.

Malformed tags give a LoweringError naming the FX node, or a conservative choice (the
gather stays where it is, or the node becomes a barrier) recorded in `program.notes`.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from ..ir import (DTYPE_BYTES, Barrier, EffectError, Cast, Compute, Constant, CopyOut, Free, Input, Launch, Op, Output, Phase, Program,
                  Role, Schedule, TensorType, View, Wait, derive_effects)
from ..ir.gcpause import gc_paused

GATHER_TAGS = {"fsdp_all_gather": Role.GATHER, "fsdp_all_gather_backward": Role.REGATHER}
FREE_TAGS = ("fsdp_reshard_free", "fsdp_reshard_free_backward")
REDUCE_SCATTER_TAG = "fsdp_reduce_scatter"
HEAVY_OPS = {"aten.mm", "aten.addmm", "aten.bmm", "aten.matmul", "aten.linear"}
ATTENTION_NAMES = ("scaled_dot_product", "flash_attention", "npu_fusion_attention")
CAST_OPS = {"prims::convert_element_type", "aten::_to_copy"}
COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional")


class LoweringError(ValueError):
    """A tag the lowering cannot interpret safely; the message names the FX node."""


def target_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", repr(target))
    return f"{module}.{name}" if module else name


def _schema(node: fx.Node):
    return getattr(node.target, "_schema", None) if node.op == "call_function" else None


def _is_collective(node: fx.Node) -> bool:
    schema = _schema(node)
    return schema is not None and schema.name.split("::")[0] in COLLECTIVE_NAMESPACES


def _is_wait(node: fx.Node) -> bool:
    schema = _schema(node)
    return schema is not None and _is_collective(node) and schema.name.endswith("::wait_tensor")


def _packet_mutates(node: fx.Node) -> bool:
    """An overload packet (`aten.add_`) doesn't say which overload runs: it mutates if one of them
    writes a positional argument, or a keyword one (`out=`) that the call passes."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverloadPacket):
        return False
    return any(arg.alias_info is not None and arg.alias_info.is_write and (not arg.kwarg_only or arg.name in node.kwargs)
               for name in target.overloads() for arg in getattr(target, name)._schema.arguments)


def _is_view(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target is operator.getitem:
        return True
    schema = _schema(node)
    return (schema is not None and not schema.is_mutable and bool(schema.returns)
            and schema.returns[0].alias_info is not None and not schema.returns[0].alias_info.is_write)


_DTYPES = {torch.float64: "f64", torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
           torch.complex64: "c64", torch.complex128: "c128", torch.int64: "i64", torch.int32: "i32",
           torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "b1"}
for _name, _short in (("float8_e4m3fn", "f8e4m3"), ("float8_e5m2", "f8e5m2")):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _short


def _type(value) -> TensorType:
    if not isinstance(value, torch.Tensor):
        return TensorType("none")
    shape = tuple(d if isinstance(d, int) else -1 for d in value.shape)
    if value.dtype not in _DTYPES:  # a dtype the IR has no short name for: teach it the long one
        _DTYPES[value.dtype] = str(value.dtype).removeprefix("torch.")
        DTYPE_BYTES.setdefault(_DTYPES[value.dtype], value.dtype.itemsize)
    return TensorType(_DTYPES[value.dtype], shape)


def value_types(node: fx.Node) -> tuple[TensorType, ...]:
    """The types of `meta["val"]` (a tensor, or a tuple/list of them); empty when absent."""
    value = node.meta.get("val")
    if value is None:
        return ()
    if isinstance(value, (tuple, list)):
        return tuple(_type(v) for v in value)
    return (_type(value),)


def _nbytes(node: fx.Node, notes: list[str]) -> int | None:
    value = node.meta.get("fsdp_unsharded_nbytes")
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    notes.append(f"%{node.name}: fsdp_unsharded_nbytes={value!r} is not a non-negative int: size unknown")
    return None


class _Lowering:
    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.notes: list[str] = []
        self.backward_seen = False
        self.late_forward = 0
        # collectives whose result is not waited exactly once cannot be reasoned about
        self.opaque_collectives = {
            n for n in gm.graph.nodes
            if _is_collective(n) and not _is_wait(n)
            and (len(n.users) != 1 or not _is_wait(next(iter(n.users))))
        }

    def phase(self, node: fx.Node) -> Phase:
        if node.meta.get("autograd_backward"):
            self.backward_seen = True
            return Phase.BACKWARD
        if self.backward_seen:  # forward ops past the first backward one join the backward phase
            self.late_forward += 1
            return Phase.BACKWARD
        return Phase.FORWARD

    def lower(self, node: fx.Node) -> Op:
        base = {"name": node.name, "operands": tuple(n.name for n in node.all_input_nodes),
                "types": value_types(node)}
        if node.op == "placeholder":
            return Input(target=str(node.target), **base)
        if node.op == "output":
            base["types"] = ()
            return Output(**base)
        base["phase"] = self.phase(node)
        if node.op == "get_attr":
            return Constant(target=str(node.target), **base)
        target = target_name(node)
        meta = node.meta
        comm_type = meta.get("comm_type")
        attention = node.op == "call_function" and any(a in target for a in ATTENTION_NAMES)
        heavy = attention or (node.op == "call_function" and (target in HEAVY_OPS or target.rsplit(".", 1)[0] in HEAVY_OPS))
        if meta.get("barrier"):
            return Barrier(target=target, reason="tagged barrier", heavy=heavy, attention=attention, **base)
        if comm_type in GATHER_TAGS and _schema(node) is not None \
                and _schema(node).name.endswith("::all_gather_into_tensor"):
            return self.gather(node, target, GATHER_TAGS[comm_type], base)
        if comm_type in FREE_TAGS:
            return self.free(node, target, base)
        if _is_collective(node):
            if node in self.opaque_collectives or any(a in self.opaque_collectives for a in node.all_input_nodes):
                self.notes.append(f"%{node.name}: collective not waited exactly once: kept as a barrier")
                return Barrier(target=target, reason="collective not waited exactly once", **base)
            if _is_wait(node):
                return Wait(target=target, **base)
            if comm_type in GATHER_TAGS:
                self.notes.append(f"%{node.name}: comm_type={comm_type!r} on {target}: not a gather, kept in order")
            role = Role.REDUCE_SCATTER if comm_type == REDUCE_SCATTER_TAG else None
            return Launch(target=target, group=_group(node), group_size=_group_size(node), role=role, **base)
        if comm_type in GATHER_TAGS:
            self.notes.append(f"%{node.name}: comm_type={comm_type!r} on {target}, not a collective: ignored")
        if node.op == "call_function" and node.target is torch.ops.aten.clone.default \
                and meta.get("fsdp_bucket_copy_out") is not None:
            return CopyOut(target=target, bucket=str(meta["fsdp_bucket_copy_out"]), **base)
        if _is_view(node):
            return View(target=target, **base)
        schema = _schema(node)
        mutates = ((schema is not None and schema.is_mutable) or _packet_mutates(node)
                   # an in-place method (`x.add_(y)`) by Python's naming convention
                   or (node.op == "call_method" and str(node.target).endswith("_")
                       and not str(node.target).startswith("_")))
        if node.is_impure(impure_random=False) or mutates:
            return Barrier(target=target, reason="mutation" if mutates else "side effect", heavy=heavy,
                           attention=attention, **base)
        if schema is not None and schema.name in CAST_OPS:
            return Cast(target=target, **base)
        random = isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags
        return Compute(target=target, heavy=heavy, attention=attention, random=random, **base)

    def gather(self, node: fx.Node, target: str, role: Role, base: dict) -> Launch:
        users = list(node.users)
        if len(users) != 1 or not _is_wait(users[0]):
            raise LoweringError(
                f"FSDP gather %{node.name} ({node.meta['comm_type']}) must have exactly one user, a wait_tensor; "
                f"it has {[u.name for u in users]}")
        meta = node.meta
        hold = None
        bucket = meta.get("fsdp_bucket_id")
        if bucket is not None:
            members = meta.get("fsdp_bucket_members")
            if not isinstance(members, (list, tuple)) or not members or not all(isinstance(m, str) for m in members):
                self.notes.append(f"%{node.name}: bucket {bucket!r} has no valid fsdp_bucket_members ({members!r}): not moved")
                params, hold = (), "bucket without members"
            else:
                params = tuple(members)
            bucket = str(bucket)
        else:
            name = meta.get("param_name")
            if isinstance(name, str) and name:
                params = (name,)
            else:
                self.notes.append(f"%{node.name}: param_name={name!r} is not a name: not moved")
                params, hold = (), "no parameter name"
        return Launch(target=target, group=_group(node), group_size=_group_size(node), role=role,
                      nbytes=_nbytes(node, self.notes),
                      params=params, bucket=bucket, hold=hold,
                      prefetched="fsdp_prefetch_anchor" in meta,  # moved by an earlier run
                      **base)

    def free(self, node: fx.Node, target: str, base: dict) -> Op:
        name = node.meta.get("param_name")
        members = node.meta.get("fsdp_bucket_members")
        if isinstance(members, (list, tuple)) and members and all(isinstance(m, str) for m in members):
            params = tuple(members)
        elif isinstance(name, str) and name:
            params = (name,)
        else:
            self.notes.append(f"%{node.name}: storage free without param_name ({name!r}): kept as a barrier")
            return Barrier(target=target, reason="free without parameter name", **base)
        if not node.all_input_nodes:
            self.notes.append(f"%{node.name}: storage free with no tensor operand: kept as a barrier")
            return Barrier(target=target, reason="free without operand", **base)
        return Free(target=target, params=params, **base)


def _group(node: fx.Node) -> str | None:
    schema = _schema(node)
    if schema is None:
        return None
    for arg, value in zip(schema.arguments, node.args):
        if arg.name == "group_name":
            return str(value)
    value = node.kwargs.get("group_name")
    return None if value is None else str(value)


def _group_size(node: fx.Node) -> int | None:
    """The `group_size` argument of a functional collective (all_gather_into_tensor,
    reduce_scatter_tensor, ...); None when the op has none or it is not a plain int."""
    schema = _schema(node)
    if schema is None:
        return None
    value = node.kwargs.get("group_size")
    for arg, given in zip(schema.arguments, node.args):
        if arg.name == "group_size":
            value = given
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def lower(gm: fx.GraphModule) -> Program:
    """Lower `gm` (left untouched) into a verified-ready Program with all effect edges."""
    with gc_paused():
        return _lower(gm)


def _lower(gm: fx.GraphModule) -> Program:
    lowering = _Lowering(gm)
    program = Program(origin=gm)
    order = []
    for node in gm.graph.nodes:
        program.add(lowering.lower(node))
        program.payload[node.name] = node
        order.append(node.name)
    if lowering.late_forward:
        program.notes.append(f"{lowering.late_forward} untagged nodes after the first backward node: "
                             "treated as backward")
    program.notes[:0] = lowering.notes
    program.schedule = Schedule(order)
    try:
        derive_effects(program)
    except EffectError as exc:
        raise LoweringError(str(exc)) from exc
    return program
