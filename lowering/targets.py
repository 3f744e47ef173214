"""What an FX call does, per `(op, target)`: its schema's writes and aliases, whether it is a
collective, a view, random, in place, and what a Python call named like an aten op does.

A graph has a few hundred distinct targets and tens of thousands of nodes: `_classify` works
each target out once (`_Target`), and `lowering/fx.py` reads each node's args and meta against
it. The tables below are the calls whose schema does not say what they do.
"""

from __future__ import annotations

import inspect
import operator
from operator import attrgetter
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import fx

from ..ir.opclass import COLLECTIVE_NAMESPACES, is_attention, is_heavy

CAST_OPS = {"prims::convert_element_type", "aten::_to_copy"}
#: Collectives outside those namespaces that run to completion when called (no wait): DTensor's
#: Shard(i) -> Shard(j) redistribution, torch's symmetric-memory collectives (async tensor
#: parallelism's fused all-gather-matmul and matmul-reduce-scatter, which Inductor's
#: micro-pipeline pass emits; symmetric-memory all-reduces, all-to-alls, broadcasts a user calls),
#: each taking a `group_name`, and torch-npu's (`synchronous_collective`). Lowered as opaque
#: collectives of their group, kept in place and in order with the group's other collectives (read
#: as compute, a reorder could put them on another side of a group's collective on one rank than on
#: another)
SYNCHRONOUS_COLLECTIVES = frozenset({"_dtensor::shard_dim_alltoall"} | {f"symm_mem::{name}" for name in (
    "fused_all_gather_matmul", "fused_all_gather_scaled_matmul", "fused_matmul_reduce_scatter",
    "fused_scaled_matmul_reduce_scatter", "_low_contention_all_gather", "_low_contention_reduce_scatter",
    "one_shot_all_reduce", "one_shot_all_reduce_out", "one_shot_all_reduce_copy", "one_shot_all_reduce_copy_out",
    "two_shot_all_reduce_", "two_shot_all_reduce_out", "multimem_all_reduce_", "multimem_one_shot_all_reduce",
    "multimem_one_shot_all_reduce_out", "multimem_one_shot_reduce_out", "multimem_all_gather_out",
    "reduce_scatter_out", "all_to_all_vdev", "all_to_all_vdev_2d", "all_to_all_vdev_2d_offset",
    "nvshmem_all_to_all", "nvshmem_broadcast", "nccl_reduce_scatter_offset", "tile_reduce",
    "multi_root_tile_reduce", "get_remote_tensors")})
#: torch-npu's ops that run a collective inside (matmuls fused with an all-gather, reduce-scatter,
#: all-reduce or all-to-all, MoE dispatch and combine, its barrier) name their HCCL group by a
#: string argument of one of these names: `npu_mm_all_reduce_base(Tensor x1, Tensor x2, str hcom, ...)`,
#: `npu_moe_distribute_dispatch(..., str group_ep, ..., str group_tp="")`, `_npu_distribute_barrier(
#: Tensor x_ref, str group, ...)`. No other torch-npu op has a string argument of these names.
NPU_GROUP_ARGUMENTS = frozenset({"hcom", "group", "group_ep", "group_tp"})


def synchronous_collective(schema) -> bool:
    """A collective that runs to completion when called: one of `SYNCHRONOUS_COLLECTIVES`, or an
    `npu::` op with an HCCL group argument (`NPU_GROUP_ARGUMENTS`; read as of unknown group, it keeps
    its order with every group's collectives)."""
    return schema.name in SYNCHRONOUS_COLLECTIVES or (schema.name.startswith("npu::") and any(
        a.name in NPU_GROUP_ARGUMENTS and str(a.type) in ("str", "Optional[str]") for a in schema.arguments))


def pads_first_dim_end(node: fx.Node) -> bool:
    """An `aten.constant_pad_nd` that adds rows at the end of its input's first dim only (its pad
    list names every dim, last dim first: all zero but the last entry): DTensor's pad of a rank's
    smaller shard before it is gathered (SimpleFSDP's uneven shards). Lowered as a cast: only the
    ranks with a smaller shard have it, and it moves with its gather as a cast of a shard does;
    before a gather, a cast with `alias` (the shard itself: lowering/fx.py, `pads_for_gather`)."""
    if node.target is not torch.ops.aten.constant_pad_nd.default or not node.all_input_nodes:
        return False
    pad = node.args[1] if len(node.args) > 1 else node.kwargs.get("pad")
    value = node.all_input_nodes[0].meta.get("val")
    if not isinstance(pad, (list, tuple)) or not isinstance(value, torch.Tensor) or len(pad) != 2 * value.dim():
        return False
    return all(isinstance(p, int) and p == 0 for p in pad[:-1]) and isinstance(pad[-1], int) and pad[-1] >= 0


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


#: ops that write arguments their schema does not mark (`Tensor(a!)`): aten's older batch norms
#: update `running_mean` and `running_var` in place in training mode (functionalization knows
#: them by name too); make_fx without functionalization records `native_batch_norm` so. Taken to
#: write them in every mode (in eval mode that only costs an order that was not needed).
UNDECLARED_WRITES = {name: ("running_mean", "running_var") for name in (
    "aten::native_batch_norm", "aten::batch_norm", "aten::_batch_norm_impl_index", "aten::cudnn_batch_norm",
    "aten::miopen_batch_norm", "aten::instance_norm")}
#: the functional point-to-point receive receives into the tensor it is given and returns it
#: (`irecv_inplace`; its schema, `irecv(Tensor tensor, ...) -> Tensor`, says neither): checked on 2
#: gloo ranks
UNDECLARED_WRITES["_c10d_functional::irecv"] = ("tensor",)
UNDECLARED_RESULT = {"_c10d_functional::irecv": "tensor"}
#: Inductor's own ops that return a view of their first argument without saying so in their schema
#: (`inductor::_reinterpret_tensor(Tensor self, int[] size, int[] stride, ...) -> Tensor`, and
#: `_alloc_from_pool(Tensor self, int offset_bytes, ...)`, a view into a pool buffer)
UNDECLARED_VIEWS = frozenset({"inductor::_reinterpret_tensor", "inductor::_alloc_from_pool"})
#: FSDP2's copy-in (`fsdp::all_gather_copy_in(Tensor[] all_gather_inputs, Tensor all_gather_output, ...)
#: -> (Tensor, Tensor)`, what torch.compile traces of fully_shard) copies the inputs into
#: all_gather_output and returns a narrow view of it and it; its schema says neither
UNDECLARED_WRITES["fsdp::all_gather_copy_in"] = ("all_gather_output",)
UNDECLARED_RESULT["fsdp::all_gather_copy_in"] = "all_gather_output"
#: a batch of sends and receives (`batch_p2p_ops`) returns the receiving tensors themselves, each
#: waited through a getitem: the batch and its waits are barriers
P2P_BATCH = "_c10d_functional::batch_p2p_ops"


def _written_arguments(schema) -> tuple[tuple[int, str], ...]:
    """(position, name) of each argument the schema writes (`Tensor(a!)`, or one of
    `UNDECLARED_WRITES`)."""
    undeclared = UNDECLARED_WRITES.get(schema.name, ())
    return tuple((i, a.name) for i, a in enumerate(schema.arguments)
                 if (a.alias_info is not None and a.alias_info.is_write) or a.name in undeclared)


# Python functions that write their first argument in place (operator.iadd is `x += y`), and as
# dunder methods (`x.__iadd__(y)`, `x.__setitem__(i, v)`)
_PY_INPLACE = frozenset({"iadd", "isub", "imul", "imatmul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior",
                         "ixor", "ilshift", "irshift", "setitem", "delitem"})
# tensor attributes that are views of the tensor (`x.T`: symbolic_trace records `getattr(x, "T")`)
_VIEW_ATTRIBUTES = frozenset({"T", "mT", "H", "mH", "real", "imag", "data"})
# tensor attributes that are no tensor (`getattr(x, "shape")`): any other may be one held by x
_PLAIN_ATTRIBUTES = frozenset({"shape", "dtype", "device", "ndim", "layout", "requires_grad", "is_leaf", "is_cuda",
                               "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_nested", "names", "itemsize",
                               "nbytes", "grad_fn", "output_nr", "_version", "is_mkldnn", "name"})
# modules of Python callables fxsched knows by their name (torch's functions, operator, builtins)
_KNOWN_MODULES = ("torch", "_operator", "operator", "builtins", "math")


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
    coalesced: bool  # a functional collective returning a list (`*_coalesced`: one result per input)
    all_gather: bool  # a functional all_gather_into_tensor (also `_out` and `_coalesced`)
    view: bool  # the result aliases the first operand (getitem, or a schema alias that is read only)
    may_copy: bool  # a view by schema that may copy instead (a CompositeImplicit op: reshape, contiguous, to)
    written: tuple[tuple[int, str], ...]  # (position, name) of the arguments the schema writes
    result_alias: int | None  # position of the written argument the result aliases (`-> Tensor(a!)`)
    py_inplace: bool  # a Python call that writes its first argument by convention (`relu_`, `x.add_`, iadd)
    known: bool  # fxsched knows what the call touches (an op with a schema, torch's, operator's)
    packet: bool  # an OpOverloadPacket: which overload runs, and what it writes, depends on the call
    cast: bool
    random: bool  # draws from the RNG (an op tagged nondeterministic_seeded, or a Python call named like one)
    clone: bool  # aten.clone.default (a bucket's copy-out when tagged so)
    heavy: bool
    attention: bool
    undeclared: tuple[tuple[int, str], ...]  # (position, name) of what a Python batch norm writes (`UNDECLARED_WRITES`)
    inplace_at: int | None  # position of a Python function's `inplace` parameter (`F.relu(x, True)`)
    side_effect: bool  # a Python call into torch.distributed (`dist.all_reduce`, `dist.send`): communication fx cannot see
    group_at: int | None  # position of the `group_name` argument, if the schema has one
    group_size_at: int | None  # position of the (last) `group_size` argument
    reduce_op_at: int | None  # position of the `reduce_op` argument, if the schema has one
    several: bool  # may return views of each of several tensors it is given (`_SEVERAL`)
    positional: bool  # of those, one whose element i views the i-th tensor given (`_POSITIONAL`)
    python_written: tuple  # a Python call's: the schemas of aten's overloads of its name that write
    returned: tuple[int | None, ...]  # per element of a tuple result, the argument it is (`_returned`), or ()
    viewed: tuple[int, ...]  # positions of the arguments the result views by schema, if not the first alone (`_viewed`)
    viewed_items: tuple[int, ...]  # per element of a tuple result, the one argument it views (`_viewed_items`), or ()


def _composite(schema) -> bool:
    """A CompositeImplicit op: it decomposes into a view or a copy (reshape, contiguous, to). A
    schema the dispatcher does not know (`aten::cpu`, `-> Tensor(b|a)`: torch declares it for
    Python only) is taken to be one: it may return its input or a copy."""
    name = schema.name + (f".{schema.overload_name}" if schema.overload_name else "")
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd")
    except RuntimeError:
        return True


#: ops whose schema says the result is fresh but which may return their (first) tensor input or a
#: view of it (`einsum("ij->ji", x)`, `x.type_as(y)` of y's type, `x.to_dense()` of a dense x,
#: `sum_to_size` to x's size, the `unsafe_` splits, `torch.as_tensor(x)`): read as views that may
#: copy, decided by meta["val"] where there is one. broadcast_tensors and meshgrid may return views
#: of each of several inputs (`_several_sources`).
MAY_RETURN_INPUT = frozenset({
    "einsum", "type_as", "to_dense", "to_sparse", "chalf", "lift", "sum_to_size", "atleast_1d", "atleast_2d",
    "atleast_3d", "unsafe_split", "unsafe_chunk", "unsafe_split_with_sizes", "flatten_dense_tensors", "as_tensor",
    "asarray", "broadcast_tensors", "meshgrid", "_cast_Byte", "_cast_Char", "_cast_Double", "_cast_Float",
    "_cast_Half", "_cast_Int", "_cast_Long", "_cast_Short"})
#: of them, those that return (views of) all of several tensors they are given
_SEVERAL = frozenset({"broadcast_tensors", "meshgrid", "atleast_1d", "atleast_2d", "atleast_3d",
                      "flatten_dense_tensors"})
#: of those, the ones whose i-th result views the i-th tensor given, and only it (an expand of it;
#: meshgrid's "xy" swaps its first two inputs and its first two results back)
_POSITIONAL = frozenset({"broadcast_tensors", "meshgrid"})


#: Tensor methods with no aten op of their name that return the tensor itself when it already
#: is what they convert to (`x.float()` of a float tensor is `x`), else a copy
_MAY_RETURN_SELF = frozenset({"float", "double", "half", "bfloat16", "int", "long", "short", "char", "byte", "bool",
                              "cfloat", "cdouble", "type", "type_as", "cpu", "cuda", "to", "contiguous"})


#: Tensor methods returning the tensor's storage: `x.untyped_storage().resize_(0)` frees x (FSDP's
#: reshard), so the storage is a view of x, as a write through it is a write of x
_STORAGE_OF = frozenset({"untyped_storage", "storage", "_typed_storage"})


def _python_view(name: str) -> tuple[bool, bool]:
    """(a view, one that may copy) for a Python call named like an aten op: a view when every
    overload of `aten.<name>` returns an alias of its input and writes nothing."""
    if name in _STORAGE_OF:
        return True, False
    try:
        packet = getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        packet = None
    if not isinstance(packet, torch._ops.OpOverloadPacket) or not packet.overloads():
        return (True, True) if name in _MAY_RETURN_SELF else (False, False)
    # the overloads a tensor call may run (`split.str`, of a str, is no candidate for `x.split(1)`)
    schemas = [schema for schema in (getattr(packet, o)._schema for o in packet.overloads())
               if schema.arguments and isinstance(schema.arguments[0].type, torch.TensorType)]
    if not schemas or not all(not s.is_mutable and s.returns and s.returns[0].alias_info is not None
               and not s.returns[0].alias_info.is_write for s in schemas):
        return False, False
    return True, any(map(_composite, schemas))


#: Higher-order ops that draw from a generator whose state outlives the call (no schema, no tags):
#: `run_and_save_rng_state` returns the global state, then runs its op on it (activation
#: checkpointing with functionalized RNG: the backward replays it with `run_with_rng_state`, which
#: sets a given state and puts the global one back, so it draws from no shared state and is not
#: listed); `graphsafe_run_with_rng_state` runs its op on a generator passed in, advancing it.
RNG_DRAWING_HOPS = frozenset({"run_and_save_rng_state", "graphsafe_run_with_rng_state"})
#: Ops that draw from a generator though no `nondeterministic_seeded` tag says so: Inductor's
#: `inductor_random` / `inductor_randint` (its post-grad graphs' dropouts and `rand_like`s) take a
#: seed only Inductor's generated code reads; run as FX, or as a fallback kernel, they call
#: `torch.rand` / `torch.randint` on the global generator. `inductor_reserve_rng_state` advances
#: the generator it is given. torch-npu's fused attentions draw their dropout mask from the
#: generator when keep_prob < 1 (returning its seed and offset for the backward to replay), untagged:
#: npu_fusion_attention and _v2 until op-plugin tagged them (2026-03), _v3 and
#: npu_fused_attention_score(_fwd) still (their backwards replay the seed they are given: not listed).
UNDECLARED_RANDOM = frozenset({"prims::inductor_random", "prims::inductor_randint",
                               "inductor_prims::inductor_reserve_rng_state"} | {f"npu::{name}" for name in (
    "npu_fusion_attention", "npu_fusion_attention_v2", "npu_fusion_attention_v3", "npu_fused_attention_score",
    "npu_fused_attention_score_fwd")})

#: A float argument of these names is a dropout probability (flash-attn's `dropout_p`, torch-npu's
#: `keep_prob`): an op outside aten and prims (whose tags torch keeps) that takes one draws its mask
#: from the generator (`torch.library.custom_op` tags nothing), unless it is given the state to
#: replay (an argument named in `_REPLAYED_RNG`: flash-attn's backward's `rng_state`, torch-npu's
#: grads' `seed` and `offset`). Read as random when p is 0 too: that only keeps its order.
DROPOUT_ARGUMENTS = frozenset({"dropout_p", "keep_prob", "p_dropout", "dropout_prob", "attn_dropout"})
_REPLAYED_RNG = frozenset({"rng_state", "seed", "offset", "philox_seed", "philox_offset", "seed_offset", "dropout_mask"})


def _drops(schema) -> bool:
    """An op outside aten and prims with a dropout probability argument and no generator state
    given (`DROPOUT_ARGUMENTS`)."""
    if schema.name.split("::")[0] in ("aten", "prims"):
        return False
    names = {a.name for a in schema.arguments}
    return not names & _REPLAYED_RNG and any(a.name in DROPOUT_ARGUMENTS and str(a.type) == "float"
                                             for a in schema.arguments)


def _subgraphs(gm: fx.GraphModule, node: fx.Node) -> list[fx.GraphModule]:
    """The GraphModules a call is given (through `get_attr` nodes of `gm`)."""
    found = []
    for arg in node.all_input_nodes:
        if arg.op == "get_attr":
            value = attrgetter(arg.target)(gm)
            if isinstance(value, fx.GraphModule):
                found.append(value)
    return found


def runs_random_op(node: fx.Node) -> bool:
    """A higher-order op given an op that draws to run (`auto_functionalized(op, ...)`,
    `auto_functionalized_v2`, `with_effects(token, op, ...)`: Inductor's post-grad graph keeps a
    custom op that writes its input so until after its custom passes); not `run_with_rng_state`,
    which runs it on the state it is given and puts the global one back (`RNG_DRAWING_HOPS`)."""
    return node.target.name() != "run_with_rng_state" and any(
        _classify("call_function", a).random for a in node.args
        if isinstance(a, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)))


def wrapped_collective(node: fx.Node) -> tuple[bool, str | None]:
    """(whether, group) a higher-order op runs an op it is given that communicates
    (`auto_functionalized(symm_mem.two_shot_all_reduce_, input=x, reduce_op=..., group_name="tp")`:
    a user's call of a symmetric-memory collective that writes its input, which Inductor's
    post-grad graph keeps wrapped until after its custom passes): its `group_name` when given by
    name as a string, else None (unknown)."""
    for a in node.args:
        if isinstance(a, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) and _classify("call_function", a).collective:
            group = node.kwargs.get("group_name")
            return True, group if isinstance(group, str) else None
    return False, None


def _any_call(gm: fx.GraphModule, test: Callable[[fx.GraphModule, fx.Node], bool]) -> bool:
    """Whether `test(gm, node)` holds for a node of `gm`, or of a subgraph of one of its
    higher-order ops, at any depth (what `_graph_draws`, `_graph_communicates`,
    `_graph_side_effect` and `_graph_writes` ask of each call)."""
    for node in gm.graph.nodes:
        if test(gm, node) or (isinstance(node.target, torch._ops.HigherOrderOperator)
                              and any(_any_call(sub, test) for sub in _subgraphs(gm, node))):
            return True
    return False


def _graph_draws(gm: fx.GraphModule, target: Callable[[fx.Node], _Target]) -> bool:
    """Whether any call in `gm`, or in a subgraph of one, draws from the RNG (`target`: the
    lowering's classification of a call, cached per target)."""
    def draws(gm: fx.GraphModule, node: fx.Node) -> bool:
        if node.op == "call_module":
            return _random_module(gm.get_submodule(node.target))
        return node.op in ("call_function", "call_method") and (
            target(node).random or (isinstance(node.target, torch._ops.HigherOrderOperator) and runs_random_op(node)))
    return _any_call(gm, draws)


def _graph_communicates(gm: fx.GraphModule, target: Callable[[fx.Node], _Target]) -> bool:
    """Whether any call in `gm`, or in a subgraph of one, is a collective, a send or a receive (a
    functional or synchronous collective, a c10d op, a Python call into torch.distributed, a
    higher-order op given one to run: `wrapped_collective`)."""
    def communicates(gm: fx.GraphModule, node: fx.Node) -> bool:
        if node.op not in ("call_function", "call_method"):
            return False
        info = target(node)
        return (info.collective or info.side_effect or (info.schema is not None and info.schema.name.startswith("c10d::"))
                or (isinstance(node.target, torch._ops.HigherOrderOperator) and wrapped_collective(node)[0]))
    return _any_call(gm, communicates)


def _graph_side_effect(gm: fx.GraphModule, target: Callable[[fx.Node], _Target]) -> bool:
    """Whether any call in `gm`, or in a subgraph of one, is a side effect that would be a barrier in
    the graph itself: side-effectful to torch.fx and writing nothing its schema says
    (`inductor.resize_storage_bytes_` freeing its input, `accumulate_grad_`, a print), or a Python
    call into torch.distributed."""
    def side_effect(gm: fx.GraphModule, node: fx.Node) -> bool:
        if node.op not in ("call_function", "call_method"):
            return False
        info = target(node)
        return info.side_effect or (node.op == "call_function" and not (info.written or info.py_inplace or info.random)
                                    and node.is_impure(impure_random=False))
    return _any_call(gm, side_effect)


# Python calls that set or read the generator's state (`torch.manual_seed(0)` between two draws)
# (and a Generator's: `g.set_state(s)` between two draws from g)
_RNG_STATE = frozenset({"manual_seed", "seed", "set_rng_state", "get_rng_state", "set_state", "get_state",
                        "graphsafe_set_state", "graphsafe_get_state", "clone_state"})


#: Higher-order ops that read their tensors and write none (each op they are given is run
#: functionally); a higher-order op neither listed nor given a subgraph fxsched can read is taken
#: to write every tensor it is given
FUNCTIONAL_HOPS = frozenset({"auto_functionalized", "auto_functionalized_v2",
                             "with_effects", "run_and_save_rng_state", "run_with_rng_state",
                             "graphsafe_run_with_rng_state", "out_dtype"})
#: `triton_kernel_wrapper_mutation(kernel_idx, ..., kwargs={name: tensor})` runs a user's triton
#: kernel on the tensors of `kwargs`, writing those it stores to (all of them, as fxsched sees it);
#: `triton_kernel_wrapper_functional(..., kwargs, tensors_to_clone)` runs it on clones of
#: `tensors_to_clone` only and writes the others it stores to: before Inductor's reinplacing those
#: are the tensors the kernel only reads, after it not (`triton_written`)
TRITON_MUTATION = "triton_kernel_wrapper_mutation"
TRITON_FUNCTIONAL = "triton_kernel_wrapper_functional"

def triton_written(node: fx.Node) -> list[fx.Node]:
    """The tensors a call of a user's triton kernel may write: those of its `kwargs` (in tuples
    too: triton takes tuples of pointers) that a functional call does not clone."""
    cloned = node.kwargs.get("tensors_to_clone") or () if node.target.name() == TRITON_FUNCTIONAL else ()
    found: list[fx.Node] = []
    for key, value in (node.kwargs.get("kwargs") or {}).items():
        if key not in cloned:
            fx.map_arg(value, found.append)
    return list(dict.fromkeys(found))


def _graph_state(gm: fx.GraphModule) -> bool:
    """Whether `gm`, or a subgraph of it, reads a tensor attribute of its own (a get_attr)."""
    for node in gm.graph.find_nodes(op="get_attr"):
        value = attrgetter(node.target)(gm)
        if isinstance(value, torch.Tensor) or (isinstance(value, fx.GraphModule) and _graph_state(value)):
            return True
    return False


def _graph_tensors(gm: fx.GraphModule) -> list[torch.Tensor]:
    """The tensor attributes `gm`, or a subgraph of it, reads (its get_attrs)."""
    found = []
    for node in gm.graph.find_nodes(op="get_attr"):
        value = attrgetter(node.target)(gm)
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, fx.GraphModule):
            found += _graph_tensors(value)
    return found


def _graph_writes(gm: fx.GraphModule, target: Callable[[fx.Node], _Target]) -> bool:
    """Whether any call in `gm`, or in a subgraph of one, writes a tensor in place."""
    def writes(gm: fx.GraphModule, node: fx.Node) -> bool:
        if node.op == "call_module":
            return getattr(gm.get_submodule(node.target), "inplace", False) is True
        if node.op not in ("call_function", "call_method"):
            return False
        info = target(node)
        return (info.written or info.py_inplace or node.kwargs.get("inplace") is True
                or (isinstance(node.target, torch._ops.HigherOrderOperator)
                    and node.target.name() in (TRITON_MUTATION, TRITON_FUNCTIONAL) and triton_written(node)))
    return _any_call(gm, writes)


def _python_random(name: str) -> bool:
    """A Python call that draws from the RNG (`F.dropout`, `torch.rand_like`, `x.bernoulli_`):
    named like an aten op with an overload tagged nondeterministic_seeded, or a dropout."""
    if "dropout" in name or name in _RNG_STATE:  # dropout1d/2d/3d and feature_alpha_dropout have no aten op of that name
        return True
    packet = getattr(torch.ops.aten, name, None) if name.isidentifier() else None
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return False
    return any(torch.Tag.nondeterministic_seeded in getattr(packet, o).tags for o in packet.overloads())


def _updates_running_stats(module) -> bool:
    """A batch or instance norm in training mode that tracks running statistics: its call writes
    its `running_mean`, `running_var` and `num_batches_tracked` (symbolic_trace keeps it a call_module)."""
    return (isinstance(module, torch.nn.modules.batchnorm._NormBase) and module.training
            and module.track_running_stats)


#: torch.nn modules whose call may return its input itself or a view of it (a dropout in eval mode,
#: or with p=0, returns its input)
_MODULES_RETURNING_INPUT = (torch.nn.Identity, torch.nn.Flatten, torch.nn.Unflatten, torch.nn.modules.dropout._DropoutNd)


def _random_module(module) -> bool:
    """A module whose forward draws from the RNG: a dropout (even in eval mode: ordering a call
    that does not draw only costs freedom), or RReLU."""
    return isinstance(module, (torch.nn.modules.dropout._DropoutNd, torch.nn.RReLU))


def _undeclared_at(target, short: str) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments a Python call named like one of `UNDECLARED_WRITES`
    (`F.batch_norm`, `torch.batch_norm`, `F.instance_norm`: what dynamo records) writes: by its
    Python signature, or, for a builtin without one, by aten's schema of that name."""
    names = UNDECLARED_WRITES.get(f"aten::{short}")
    if not names:
        return ()
    try:
        arguments = list(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        packet = getattr(torch.ops.aten, short, None)
        overloads = packet.overloads() if isinstance(packet, torch._ops.OpOverloadPacket) else ()
        arguments = [a.name for a in getattr(packet, overloads[0])._schema.arguments] if overloads else []
    return tuple((arguments.index(name) if name in arguments else -1, name) for name in names)


def _inplace_at(target) -> int | None:
    """The position of a Python function's `inplace` parameter (`F.relu(input, inplace)`), if it
    has one that may be passed by position."""
    try:
        parameters = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature
        return None
    for at, parameter in enumerate(parameters):
        if parameter.name == "inplace" and parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
            return at
    return None


def _distributed(module: str, short: str) -> bool:
    """A Python function of torch.distributed that communicates in place or as a side effect
    (`dist.all_reduce`, `dist.recv`, `dist.barrier`): not one of the functional collectives'
    wrappers, which return a new tensor (but their `*inplace*` ones)."""
    if not (module == "torch.distributed" or module.startswith("torch.distributed.")):
        return False
    return not module.startswith("torch.distributed._functional_collectives") or "inplace" in short


def collective_overload(target):
    """The one overload of a collective's packet (dynamo's graphs call
    `torch.ops._c10d_functional.wait_tensor`, `torch.ops.npu.npu_all_gather_base_mm`, no
    `.default`): the call runs it, so it is read as that overload (a launch, a wait, a synchronous
    collective). Anything else: None."""
    if not isinstance(target, torch._ops.OpOverloadPacket) or target.overloads() != ["default"]:
        return None
    if (target._qualified_op_name.split("::")[0] not in COLLECTIVE_NAMESPACES
            and not synchronous_collective(target.default._schema)):
        return None
    return target.default


def _overload_random(op: torch._ops.OpOverload) -> bool:
    """An overload that draws: tagged `nondeterministic_seeded`, `UNDECLARED_RANDOM`, or `_drops`."""
    return (torch.Tag.nondeterministic_seeded in op.tags or op._schema.name in UNDECLARED_RANDOM
            or _drops(op._schema))


def _classify(op: str, target) -> _Target:
    name = _target_name(target)
    call = op == "call_function"
    if call and not hasattr(target, "_schema") and getattr(torch.Tensor, getattr(target, "__name__", ""), None) is target:
        # `torch.Tensor.view` called as a function (no module says whose it is): the method it is
        return _classify("call_method", target.__name__)._replace(name=name)
    if call:
        target = collective_overload(target) or target
    schema = getattr(target, "_schema", None) if call else None
    collective = schema is not None and (schema.name.split("::")[0] in COLLECTIVE_NAMESPACES
                                         or synchronous_collective(schema))
    view = (call and target is operator.getitem) or (
        schema is not None and not schema.is_mutable and bool(schema.returns)
        and schema.returns[0].alias_info is not None and not schema.returns[0].alias_info.is_write)
    arguments = [a.name for a in schema.arguments] if schema is not None else []
    attention = call and is_attention(name)
    written = _written_arguments(schema) if schema is not None else ()
    result_alias = None
    if written and schema.returns and (ret := schema.returns[0].alias_info) is not None and ret.is_write:
        result_alias = next((i for i, _ in written if schema.arguments[i].alias_info is not None
                             and schema.arguments[i].alias_info.before_set == ret.before_set), None)
    elif schema is not None and schema.name in UNDECLARED_RESULT:
        result_alias = next(i for i, a in enumerate(schema.arguments) if a.name == UNDECLARED_RESULT[schema.name])
    short = name.rsplit(".", 1)[-1]
    module = (getattr(target, "__module__", None) or "") if call else ""
    may_copy = view and schema is not None and _composite(schema)
    if schema is not None and schema.name in UNDECLARED_VIEWS:
        view, may_copy = True, False
    if schema is not None and schema.name == "aten::_unsafe_view":
        # a view without the alias annotation (so autograd treats its result as fresh); what
        # it does to storage is a view's: read it as one that may copy, decided by meta["val"]
        view, may_copy = True, True
    if schema is None and (op == "call_method" or (call and module.split(".")[0] == "torch")):
        # a Python call (`x.view(...)`, `x.reshape(...)`, `torch.t(x)`): what aten's op of that name says
        view, may_copy = _python_view(short)
    base = schema.name.split("::")[-1] if schema is not None else short
    if base in MAY_RETURN_INPUT and (schema is not None or op == "call_method" or module.split(".")[0] == "torch"):
        view, may_copy = True, True
    py_inplace = (
        (op == "call_method" and isinstance(target, str)
         and ((target.endswith("_") and not target.startswith("_")) or target.strip("_") in _PY_INPLACE))
        or (call and schema is None and not isinstance(target, torch._ops.OpOverloadPacket)
            and ((short.endswith("_") and not short.startswith("_"))
                 or (module in ("_operator", "operator") and short in _PY_INPLACE))))
    return _Target(
        name=name,
        schema=schema,
        collective=collective,
        wait=collective and schema.name.endswith("::wait_tensor"),
        coalesced=collective and bool(schema.returns) and isinstance(schema.returns[0].type, torch.ListType),
        all_gather=schema is not None and schema.name.endswith(("::all_gather_into_tensor", "::all_gather_into_tensor_out",
                                                                "::all_gather_into_tensor_coalesced")),
        view=view,
        may_copy=may_copy,
        written=written,
        result_alias=result_alias,
        py_inplace=py_inplace,
        known=op == "call_method" or (call and (schema is not None or isinstance(target, torch._ops.OpOverloadPacket)
                                                or (module.split(".")[0] in _KNOWN_MODULES and not _distributed(module, short))
                                                or target is operator.getitem)),
        packet=call and isinstance(target, torch._ops.OpOverloadPacket),
        cast=schema is not None and schema.name in CAST_OPS,
        # a packet (`torch.ops.npu.npu_fusion_attention(...)`, as dynamo records what the user
        # wrote) may run any of its overloads: random if one of them is
        random=(_overload_random(target) if isinstance(target, torch._ops.OpOverload)
                else isinstance(target, torch._ops.HigherOrderOperator) and target.name() in RNG_DRAWING_HOPS
                or isinstance(target, torch._ops.OpOverloadPacket)
                and any(_overload_random(getattr(target, o)) for o in target.overloads())
                or schema is None and (op == "call_method" or (call and module.split(".")[0] == "torch"))
                and _python_random(short)),
        clone=call and target is torch.ops.aten.clone.default,
        heavy=call and is_heavy(name),
        attention=attention,
        undeclared=_undeclared_at(target, short) if call and schema is None else (),
        inplace_at=_inplace_at(target) if call and schema is None else None,
        # `loss.backward()` writes the `.grad` of every leaf it reaches, which no operand names
        side_effect=schema is None and ((call and _distributed(module, short))
                                        or (short == "backward" and (op == "call_method" or module.split(".")[0] == "torch"))),
        several=view and base in _SEVERAL,
        positional=view and base in _POSITIONAL,
        python_written=_python_written(short) if schema is None and (
            op == "call_method" or (call and module.split(".")[0] == "torch")) else (),
        group_at=arguments.index("group_name") if "group_name" in arguments else None,
        group_size_at=len(arguments) - 1 - arguments[::-1].index("group_size") if "group_size" in arguments else None,
        reduce_op_at=arguments.index("reduce_op") if "reduce_op" in arguments else None,
        returned=_returned(schema) if schema is not None else (),
        viewed=_viewed(schema) if schema is not None else (),
        viewed_items=_viewed_items(schema) if schema is not None else (),
    )


def _viewed(schema) -> tuple[int, ...]:
    """The positions of the arguments whose storage the result shares by a read-only alias
    annotation (`Tensor(a) y -> Tensor(a)`), when that is not the first argument alone: a custom
    op (`torch.library.define`) may return a view of its second argument, or views of several
    (`(Tensor(a) x, Tensor(b) y) -> (Tensor(a), Tensor(b))`, `(Tensor(a)[] xs) -> Tensor(a)[]`).
    () for every aten view, whose result views its first argument."""
    aliased = [r.alias_info for r in schema.returns if r.alias_info is not None and not r.alias_info.is_write]
    sets = {s for info in aliased for s in info.before_set}
    # a list's elements' alias set (`Tensor(a)[]`) is not in Python's schema: an empty one stands for it
    contained = any(not info.before_set for info in aliased)
    found = tuple(at for at, a in enumerate(schema.arguments)
                  if a.alias_info is not None and not a.alias_info.is_write
                  and (sets & set(a.alias_info.before_set)
                       or (contained and not a.alias_info.before_set and isinstance(a.type, torch.ListType))))
    if not found:
        return ()
    if found == (0,) and not isinstance(schema.arguments[0].type, torch.ListType):
        return ()
    return found


def _viewed_items(schema) -> tuple[int, ...]:
    """For a tuple result whose every element views one argument by its own alias set
    (`(Tensor(a) x, Tensor(b) y) -> (Tensor(a), Tensor(b))`), per element that argument's
    position; () otherwise: a single result, an element fresh or of a list's set (`Tensor(a)[] ->
    Tensor(a)[]`, whose positions nothing pins), or a set several arguments share."""
    if len(schema.returns) < 2:
        return ()
    found = []
    for r in schema.returns:
        info = r.alias_info
        if info is None or info.is_write or not info.before_set or not isinstance(r.type, torch.TensorType):
            return ()
        at = [i for i, a in enumerate(schema.arguments)
              if a.alias_info is not None and not a.alias_info.is_write
              and set(a.alias_info.before_set) & set(info.before_set)]
        if len(at) != 1 or not isinstance(schema.arguments[at[0]].type, torch.TensorType):
            return ()
        found.append(at[0])
    return tuple(found)


def _returned(schema) -> tuple[int | None, ...]:
    """For an op returning a tuple, per element the position of the argument it is (None: fresh
    storage); () for any other op. An out= overload returns the tensors it writes
    (`max.dim_max(..., Tensor(a!) max, Tensor(b!) max_values) -> (Tensor(a!), Tensor(b!))`); a c10d
    op (`allreduce_([x], group, ...) -> (Tensor[], Work)`, what make_fx records of `dist.*`) returns
    its first argument's tensors, which its schema does not say."""
    if schema.name.startswith("c10d::"):
        if (schema.returns and schema.arguments and _tensors_type(schema.returns[0].type)
                and _tensors_type(schema.arguments[0].type)):
            return (0,) + (None,) * (len(schema.returns) - 1)
        return ()
    if len(schema.returns) < 2:
        return ()
    written = {frozenset(a.alias_info.before_set): at for at, a in enumerate(schema.arguments)
               if a.alias_info is not None and a.alias_info.is_write}
    found = tuple(written.get(frozenset(r.alias_info.before_set))
                  if r.alias_info is not None and r.alias_info.is_write else None for r in schema.returns)
    return found if any(at is not None for at in found) else ()


def _python_written(name: str) -> tuple:
    """The schemas of `aten.<name>`'s overloads that write an argument (a Python call of that name
    runs one of them)."""
    packet = getattr(torch.ops.aten, name, None) if name.isidentifier() else None
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return ()
    return tuple(schema for schema in (getattr(packet, o)._schema for o in packet.overloads())
                 if _written_arguments(schema))


def _tensors_type(kind) -> bool:
    """A Tensor, or a list (of lists) of them."""
    while isinstance(kind, torch.ListType):
        kind = kind.getElementType()
    return isinstance(kind, torch.TensorType)
