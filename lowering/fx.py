"""Lower a tagged torch.fx GraphModule into a Program. All reading of FSDP tags lives here.

Malformed tags give a LoweringError naming the FX node, or a conservative choice (the
gather stays where it is, or the node becomes a barrier) recorded in `program.notes`.
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple

import torch
from torch import fx

from ..ir import (DTYPE_BYTES, Barrier, EffectError, Cast, Compute, Constant, CopyOut, Free, Input, Launch, Op, Output, Phase, Program,
                  Role, Schedule, TensorType, View, Wait, derive_effects)
from ..ir.errors import InputError
from ..ir.gcpause import gc_paused
from ..ir import tags
from ..ir.holds import BUCKET_WITHOUT_MEMBERS, NO_PARAMETER_NAME
from ..ir.opclass import is_attention, is_heavy

GATHER_TAGS = {tags.ALL_GATHER: Role.GATHER, tags.ALL_GATHER_BACKWARD: Role.REGATHER}
FREE_TAGS = (tags.RESHARD_FREE, tags.RESHARD_FREE_BACKWARD)
REDUCE_SCATTER_TAG = tags.REDUCE_SCATTER
KNOWN_COMM_TYPES = frozenset({*GATHER_TAGS, *FREE_TAGS, REDUCE_SCATTER_TAG})
CAST_OPS = {"prims::convert_element_type", "aten::_to_copy"}
COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional")


class LoweringError(InputError):
    """A tag the lowering cannot interpret safely; the message names the FX node."""


def target_name(node: fx.Node) -> str:
    return _target_name(node.target)


def _target_name(target) -> str:
    if isinstance(target, str):
        return target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", repr(target))
    return f"{module}.{name}" if module else name


def _packet_mutates(node: fx.Node) -> bool:
    """An overload packet (`aten.add_`) doesn't say which overload runs: it mutates if one of them
    writes a positional argument, or a keyword one (`out=`) that the call passes."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverloadPacket):
        return False
    return any(arg.alias_info is not None and arg.alias_info.is_write and (not arg.kwarg_only or arg.name in node.kwargs)
               for name in target.overloads() for arg in getattr(target, name)._schema.arguments)


class _Target(NamedTuple):
    """All that lowering asks of a node's `(op, target)` and not of its args or meta.

    A graph has a few hundred distinct targets and tens of thousands of nodes, so `_classify`
    works this out once per target: the schema reads and `str(OpOverload)` per node were a
    large share of lowering.
    """

    name: str  # target_name
    schema: Any  # the op's FunctionSchema (call_function only), else None
    collective: bool  # a functional collective (launch or wait)
    wait: bool  # a functional collective's wait_tensor
    all_gather: bool  # a functional all_gather_into_tensor
    view: bool  # the result aliases the first operand (getitem, or a schema alias that is read only)
    mutable: bool  # the schema mutates, or an in-place method by naming convention
    packet: bool  # an OpOverloadPacket: whether it mutates depends on the call (_packet_mutates)
    cast: bool
    random: bool  # draws from the RNG
    clone: bool  # aten.clone.default (a bucket's copy-out when tagged so)
    heavy: bool
    attention: bool
    group_at: int | None  # position of the `group_name` argument, if the schema has one
    group_size_at: int | None  # position of the (last) `group_size` argument


def _classify(op: str, target) -> _Target:
    name = _target_name(target)
    call = op == "call_function"
    schema = getattr(target, "_schema", None) if call else None
    collective = schema is not None and schema.name.split("::")[0] in COLLECTIVE_NAMESPACES
    view = (call and target is operator.getitem) or (
        schema is not None and not schema.is_mutable and bool(schema.returns)
        and schema.returns[0].alias_info is not None and not schema.returns[0].alias_info.is_write)
    arguments = [a.name for a in schema.arguments] if schema is not None else []
    attention = call and is_attention(name)
    return _Target(
        name=name,
        schema=schema,
        collective=collective,
        wait=collective and schema.name.endswith("::wait_tensor"),
        all_gather=schema is not None and schema.name.endswith("::all_gather_into_tensor"),
        view=view,
        mutable=((schema is not None and schema.is_mutable)
                 # an in-place method (`x.add_(y)`) by Python's naming convention
                 or (op == "call_method" and str(target).endswith("_") and not str(target).startswith("_"))),
        packet=call and isinstance(target, torch._ops.OpOverloadPacket),
        cast=schema is not None and schema.name in CAST_OPS,
        random=isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags,
        clone=call and target is torch.ops.aten.clone.default,
        heavy=call and is_heavy(name),
        attention=attention,
        group_at=arguments.index("group_name") if "group_name" in arguments else None,
        group_size_at=len(arguments) - 1 - arguments[::-1].index("group_size") if "group_size" in arguments else None,
    )


_DTYPES = {torch.float64: "f64", torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
           torch.complex64: "c64", torch.complex128: "c128", torch.int64: "i64", torch.int32: "i32",
           torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "b1"}
for _name, _short in (("float8_e4m3fn", "f8e4m3"), ("float8_e5m2", "f8e5m2")):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _short


def _type(value, cache: dict | None = None) -> TensorType:
    """The TensorType of one `meta["val"]` element. `cache` maps (dtype, shape) to the
    TensorType already made for it: a graph has few distinct ones, and converting the shape
    dim by dim was most of the cost. A symbolic shape is unhashable and is not cached."""
    if not isinstance(value, torch.Tensor):
        return TensorType("none")
    key = (value.dtype, value.shape)
    if cache is not None:
        try:
            return cache[key]
        except KeyError:
            pass
        except TypeError:  # a symbolic extent (SymInt) cannot be hashed
            cache = None
    dtype, shape = key
    if dtype not in _DTYPES:  # a dtype the IR has no short name for: teach it the long one
        _DTYPES[dtype] = str(dtype).removeprefix("torch.")
        DTYPE_BYTES.setdefault(_DTYPES[dtype], dtype.itemsize)
    result = TensorType(_DTYPES[dtype], tuple(d if isinstance(d, int) else -1 for d in shape))
    if cache is not None:
        cache[key] = result
    return result


def value_types(node: fx.Node, cache: dict | None = None) -> tuple[TensorType, ...]:
    """The types of `meta["val"]` (a tensor, or a tuple/list of them); empty when absent.
    `cache`: see `_type`."""
    value = node.meta.get("val")
    if value is None:
        return ()
    if isinstance(value, (tuple, list)):
        return tuple(_type(v, cache) for v in value)
    return (_type(value, cache),)


def _nbytes(node: fx.Node, notes: list[str]) -> int | None:
    value = node.meta.get(tags.UNSHARDED_NBYTES)
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
        # per-graph caches: (node.op, id(target)) -> _Target (by identity, so a target need not be
        # hashable; the graph keeps every target alive), and (dtype, shape) -> TensorType
        self.targets: dict[tuple[str, int], _Target] = {}
        self.types: dict = {}

    def target(self, node: fx.Node) -> _Target:
        key = (node.op, id(node.target))
        try:
            return self.targets[key]
        except KeyError:
            found = self.targets[key] = _classify(node.op, node.target)
            return found

    def opaque(self, node: fx.Node) -> bool:
        """A collective whose result is not waited exactly once: it cannot be reasoned about."""
        if node.op != "call_function":
            return False
        info = self.target(node)
        return info.collective and not info.wait and (
            len(node.users) != 1 or not self.target(next(iter(node.users))).wait)

    def phase(self, node: fx.Node) -> Phase:
        if node.meta.get(tags.AUTOGRAD_BACKWARD):
            self.backward_seen = True
            return Phase.BACKWARD
        if self.backward_seen:  # forward ops past the first backward one join the backward phase
            self.late_forward += 1
            return Phase.BACKWARD
        return Phase.FORWARD

    def lower(self, node: fx.Node) -> Op:
        kind = node.op
        base = {"name": node.name, "operands": tuple([n.name for n in node.all_input_nodes]),
                "types": value_types(node, self.types)}
        if kind == "placeholder":
            return Input(target=str(node.target), **base)
        if kind == "output":
            base["types"] = ()
            return Output(**base)
        base["phase"] = self.phase(node)
        if kind == "get_attr":
            return Constant(target=str(node.target), **base)
        info = self.target(node)
        target = info.name
        meta = node.meta
        comm_type = meta.get(tags.COMM_TYPE)
        if info.collective and (meta.get(tags.BARRIER) or comm_type in FREE_TAGS):
            # a collective (or its wait) turned into a barrier or free would leave its partner
            # unpaired: say which tag, not what the verifier makes of the result
            tag = f"{tags.BARRIER}={meta[tags.BARRIER]!r}" if meta.get(tags.BARRIER) else f"comm_type={comm_type!r}"
            raise LoweringError(f"%{node.name} ({target}) is a collective {'wait' if info.wait else 'launch'} "
                                f"tagged {tag}: barrier and free tags go on other nodes; remove the tag")
        if comm_type is not None and comm_type not in KNOWN_COMM_TYPES:
            self.notes.append(f"%{node.name}: unknown comm_type={comm_type!r} (known: "
                              f"{', '.join(sorted(KNOWN_COMM_TYPES))}): treated as untagged")
        if meta.get(tags.BARRIER):
            return Barrier(target=target, reason="tagged barrier", heavy=info.heavy, attention=info.attention, **base)
        if comm_type in GATHER_TAGS and info.all_gather:
            return self.gather(node, target, GATHER_TAGS[comm_type], base)
        if comm_type in FREE_TAGS:
            return self.free(node, target, base)
        if info.collective:
            if self.opaque(node) or any(self.opaque(a) for a in node.all_input_nodes):
                self.notes.append(f"%{node.name}: collective not waited exactly once: kept as a barrier")
                return Barrier(target=target, reason="collective not waited exactly once", **base)
            if info.wait:
                return Wait(target=target, **base)
            if comm_type in GATHER_TAGS:
                self.notes.append(f"%{node.name}: comm_type={comm_type!r} on {target}: not a gather, kept in order")
            role = Role.REDUCE_SCATTER if comm_type == REDUCE_SCATTER_TAG else None
            return Launch(target=target, group=_group(node, info), group_size=_group_size(node, info), role=role,
                          **base)
        if comm_type in GATHER_TAGS:
            self.notes.append(f"%{node.name}: comm_type={comm_type!r} on {target}, not a collective: ignored")
        if info.clone and meta.get(tags.BUCKET_COPY_OUT) is not None:
            return CopyOut(target=target, bucket=str(meta[tags.BUCKET_COPY_OUT]), **base)
        if info.view:
            return View(target=target, **base)
        mutates = info.mutable or (info.packet and _packet_mutates(node))
        if node.is_impure(impure_random=False) or mutates:
            return Barrier(target=target, reason="mutation" if mutates else "side effect", heavy=info.heavy,
                           attention=info.attention, **base)
        if info.cast:
            return Cast(target=target, **base)
        return Compute(target=target, heavy=info.heavy, attention=info.attention, random=info.random, **base)

    def gather(self, node: fx.Node, target: str, role: Role, base: dict) -> Launch:
        users = list(node.users)
        if len(users) != 1 or not self.target(users[0]).wait:
            raise LoweringError(
                f"FSDP gather %{node.name} ({node.meta[tags.COMM_TYPE]}) must have exactly one user, a wait_tensor; "
                f"it has {[u.name for u in users]}")
        meta = node.meta
        hold = None
        bucket = meta.get(tags.BUCKET_ID)
        if bucket is not None:
            members = meta.get(tags.BUCKET_MEMBERS)
            if not isinstance(members, (list, tuple)) or not members or not all(isinstance(m, str) for m in members):
                self.notes.append(f"%{node.name}: bucket {bucket!r} has no valid fsdp_bucket_members ({members!r}): not moved")
                params, hold = (), BUCKET_WITHOUT_MEMBERS
            else:
                params = tuple(members)
            bucket = str(bucket)
        else:
            name = meta.get(tags.PARAM_NAME)
            if isinstance(name, str) and name:
                params = (name,)
            else:
                self.notes.append(f"%{node.name}: param_name={name!r} is not a name: not moved")
                params, hold = (), NO_PARAMETER_NAME
        info = self.target(node)
        return Launch(target=target, group=_group(node, info), group_size=_group_size(node, info), role=role,
                      nbytes=_nbytes(node, self.notes),
                      params=params, bucket=bucket, hold=hold,
                      prefetched=tags.PREFETCH_ANCHOR in meta,  # moved by an earlier run
                      **base)

    def free(self, node: fx.Node, target: str, base: dict) -> Op:
        name = node.meta.get(tags.PARAM_NAME)
        members = node.meta.get(tags.BUCKET_MEMBERS)
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


def _group(node: fx.Node, info: _Target) -> str | None:
    """The `group_name` argument of a functional collective, as a string; None when absent."""
    if info.schema is None:
        return None
    if info.group_at is not None and info.group_at < len(node.args):
        return str(node.args[info.group_at])
    value = node.kwargs.get("group_name")
    return None if value is None else str(value)


def _group_size(node: fx.Node, info: _Target) -> int | None:
    """The `group_size` argument of a functional collective (all_gather_into_tensor,
    reduce_scatter_tensor, ...); None when the op has none or it is not a plain int."""
    if info.schema is None:
        return None
    value = node.kwargs.get("group_size")
    if info.group_size_at is not None and info.group_size_at < len(node.args):
        value = node.args[info.group_size_at]
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def lower(gm: fx.GraphModule) -> Program:
    """Lower `gm` (left untouched) into a verified-ready Program with all effect edges."""
    with gc_paused():
        return _lower(gm)


def _lower(gm: fx.GraphModule) -> Program:
    lowering = _Lowering(gm)
    program = Program(origin=gm)
    nodes = list(gm.graph.nodes)
    program.add_all([lowering.lower(node) for node in nodes])
    program.payload.update({node.name: node for node in nodes})
    order = [node.name for node in nodes]
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
