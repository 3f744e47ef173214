"""Synthetic tagged FSDP joint forward+backward FX graphs of a requested size (the input
contract of docs/design.md), written node by node with fx.Graph.call_function: 100k nodes, with vals, in seconds."""

from __future__ import annotations

import gc
import math
import operator
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from ..ir import tags

__all__ = ["generate_graph", "release_storage", "min_nodes"]

aten = torch.ops.aten
prims = torch.ops.prims
c10d = torch.ops._c10d_functional

ALL_GATHER = c10d.all_gather_into_tensor.default
REDUCE_SCATTER = c10d.reduce_scatter_tensor.default
WAIT = c10d.wait_tensor.default
CAST = prims.convert_element_type.default


@fx.node.has_side_effect
def release_storage(tensor: torch.Tensor) -> None:
    """Free the unsharded parameter's storage (what an FSDP reshard does); aliases see size 0."""
    tensor.untyped_storage().resize_(0)


# Layer parameter table: short name -> (shape in units of hidden H / ffn F, read in backward).
# Linear biases are not read by the backward (their grad is a sum of the output grad), so
# the backward does not re-gather them, as a traced graph would not.
_ATTN_PARAMS = (
    ("attn_norm.weight", ("H",), True),
    ("attn_norm.bias", ("H",), True),
    ("attn.qkv.weight", ("3H", "H"), True),
    ("attn.qkv.bias", ("3H",), False),
    ("attn.proj.weight", ("H", "H"), True),
    ("attn.proj.bias", ("H",), False),
)
_MLP_PARAMS = (
    ("mlp_norm.weight", ("H",), True),
    ("mlp_norm.bias", ("H",), True),
    ("mlp.fc1.weight", ("F", "H"), True),
    ("mlp.fc1.bias", ("F",), False),
    ("mlp.fc2.weight", ("H", "F"), True),
    ("mlp.fc2.bias", ("H",), False),
)
_HEAD_PARAMS = (
    ("norm.weight", ("H",), True),
    ("norm.bias", ("H",), True),
    ("head.weight", ("V", "H"), True),
)
_BARRIER_EVERY = 4  # a forward buffer update and a backward barrier in layers 1, 5, 9, ...


@dataclass(frozen=True)
class _Param:
    name: str
    shape: tuple[int, ...]
    numel: int
    shard: int  # elements per rank: the flat parameter padded to a multiple of world_size
    backward_read: bool


@dataclass(frozen=True)
class _Layer:
    index: int
    params: tuple[_Param, ...]
    forward_groups: tuple[tuple[_Param, ...], ...]
    backward_groups: tuple[tuple[_Param, ...], ...]
    gelu: str
    barrier: bool

    def signature(self) -> tuple:
        """What the layer's node count depends on."""
        return (self.barrier, tuple(map(len, self.forward_groups)), tuple(map(len, self.backward_groups)))


@dataclass(frozen=True)
class _Config:
    seed: int
    world_size: int
    group_name: str
    buckets: bool
    mixed_precision: bool
    barriers: bool
    attention: bool
    reshard: bool
    batch: int
    seq: int
    hidden: int
    heads: int
    vocab: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def ffn(self) -> int:
        return 4 * self.hidden

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.mixed_precision else torch.float32

    def param(self, name: str, dims: Sequence[str], backward_read: bool) -> _Param:
        sizes = {"H": self.hidden, "3H": 3 * self.hidden, "F": self.ffn, "V": self.vocab}
        shape = tuple(sizes[d] for d in dims)
        numel = math.prod(shape)
        return _Param(name, shape, numel, -(-numel // self.world_size), backward_read)

    def layer(self, index: int) -> _Layer:
        # Per-layer RNG keyed by (seed, index): a layer looks the same whatever the layer count,
        # so node counts can be computed layer by layer. str seeds hash with sha512: stable.
        rng = random.Random(f"fxsched.generate:{self.seed}:layer:{index}")
        table = (_ATTN_PARAMS if self.attention else ()) + _MLP_PARAMS
        params = tuple(self.param(f"layers.{index}.{n}", d, b) for n, d, b in table)
        gelu = rng.choice(("none", "tanh"))
        forward = self._groups(params, rng)
        backward = self._groups(tuple(p for p in params if p.backward_read), rng)
        barrier = self.barriers and index % _BARRIER_EVERY == 1
        return _Layer(index, params, forward, backward, gelu, barrier)

    def head(self) -> tuple[_Param, ...]:
        return tuple(self.param(n, d, b) for n, d, b in _HEAD_PARAMS)

    def _groups(self, params: tuple[_Param, ...], rng: random.Random) -> tuple[tuple[_Param, ...], ...]:
        """Split into gathers: singletons, or with buckets consecutive runs of 2-4 parameters."""
        if not self.buckets:
            return tuple((p,) for p in params)
        groups, start = [], 0
        while start < len(params):
            size = rng.choice((2, 3, 4))
            groups.append(params[start:start + size])
            start += size
        return tuple(groups)


class _Counter:
    """A sink that only counts nodes: the dry run that sizes the graph."""

    def __init__(self) -> None:
        self.count = 0

    def placeholder(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> None:
        self.count += 1

    def op(self, target: Any, args: tuple, kwargs: dict, meta: dict) -> None:
        self.count += 1

    def output(self, values: Sequence[Any]) -> None:
        self.count += 1


@dataclass
class _OutSpec:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    alias: int | str | None  # schema position (or kwarg name) of the input this output views


class _FxSink:
    """Builds the fx.Graph and gives every node a FakeTensor `val`.

    Running each op under FakeTensorMode costs 0.1-1 ms; a layer repeats the same ops on the
    same shapes, so each distinct (op, input metadata, constants) is run once under fake mode
    and later nodes copy its output metadata onto fresh meta tensors (or, for outputs the
    schema declares aliasing, onto an `as_strided` of the input's meta tensor, so views
    share their base's fake storage as they would after a real trace).
    """

    def __init__(self) -> None:
        self.graph = fx.Graph()
        self.mode = FakeTensorMode()
        self.device = torch.device("cpu")
        self._specs: dict[tuple, list[_OutSpec | None]] = {}
        self._meta: dict[fx.Node, Any] = {}  # node -> meta tensor, or tuple of them
        self._desc: dict[fx.Node, Any] = {}  # node -> hashable metadata, or tuple of them

    def _fake(self, meta: torch.Tensor) -> FakeTensor:
        return FakeTensor(self.mode, meta, self.device)

    def _record(self, node: fx.Node, meta: torch.Tensor) -> None:
        self._meta[node] = meta
        self._desc[node] = (tuple(meta.shape), meta.stride(), meta.storage_offset(), meta.dtype)

    def placeholder(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> fx.Node:
        node = self.graph.placeholder(name)
        meta = torch.empty(tuple(shape), dtype=dtype, device="meta")
        node.meta["val"] = self._fake(meta)
        self._record(node, meta)
        return node

    def op(self, target: Any, args: tuple, kwargs: dict, meta: dict) -> fx.Node:
        node = self.graph.create_node("call_function", target, args, kwargs)
        node.meta.update(meta)
        if target is operator.getitem:
            source, index = args
            node.meta["val"] = source.meta["val"][index]
            self._meta[node] = self._meta[source][index]
            self._desc[node] = self._desc[source][index]
        elif target is release_storage:
            node.meta["val"] = None  # returns None; never run it on a fake, it would shrink the val
        else:
            self._compute(node, target, args, kwargs)
        return node

    def output(self, values: Sequence[fx.Node]) -> None:
        node = self.graph.output(tuple(values))
        node.meta["val"] = tuple(v.meta["val"] for v in values)

    def _key(self, value: Any) -> Any:
        if isinstance(value, fx.Node):
            return self._desc[value]
        if isinstance(value, (list, tuple)):
            return (type(value).__name__, *map(self._key, value))
        if isinstance(value, dict):
            return tuple((k, self._key(v)) for k, v in value.items())
        return (type(value).__name__, value)  # keep 1 and 1.0 apart: they promote differently

    def _compute(self, node: fx.Node, target: Any, args: tuple, kwargs: dict) -> None:
        key = (target, self._key(args), self._key(kwargs))
        specs = self._specs.get(key)
        if specs is None:
            specs = self._specs[key] = self._infer(target, args, kwargs)
        metas = []
        for spec in specs:
            if spec is None:
                metas.append(None)
            elif spec.alias is None:
                metas.append(torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device="meta"))
            else:
                base = args[spec.alias] if isinstance(spec.alias, int) else kwargs[spec.alias]
                metas.append(self._meta[base].as_strided(spec.shape, spec.stride, spec.offset))
        if len(target._schema.returns) == 1:
            node.meta["val"] = self._fake(metas[0])
            self._record(node, metas[0])
            return
        node.meta["val"] = tuple(None if m is None else self._fake(m) for m in metas)
        self._meta[node] = tuple(metas)
        self._desc[node] = tuple(
            None if m is None else (tuple(m.shape), m.stride(), m.storage_offset(), m.dtype) for m in metas
        )

    def _infer(self, target: Any, args: tuple, kwargs: dict) -> list[_OutSpec | None]:
        fake_args, fake_kwargs = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        with self.mode:
            out = target(*fake_args, **fake_kwargs)
        schema = target._schema
        outs = [out] if len(schema.returns) == 1 else list(out)
        specs: list[_OutSpec | None] = []
        for index, tensor in enumerate(outs):
            if tensor is None:
                specs.append(None)
                continue
            alias = None
            info = schema.returns[index].alias_info if index < len(schema.returns) else None
            if info is not None:
                for position, argument in enumerate(schema.arguments):
                    if argument.alias_info is not None and argument.alias_info.before_set & info.before_set:
                        alias = position if position < len(args) else argument.name
                        break
            if tensor.storage_offset() and alias is None:
                raise NotImplementedError(f"{target}: fresh output with a storage offset")
            specs.append(_OutSpec(tuple(tensor.shape), tensor.stride(), tensor.storage_offset(), tensor.dtype, alias))
        return specs


@dataclass
class _Builder:
    """Emits one model's joint graph into a sink; shapes come from the config, never from vals."""

    cfg: _Config
    sink: Any
    backward: bool = False
    shards: dict[str, Any] = field(default_factory=dict)
    buffers: dict[int, Any] = field(default_factory=dict)
    live: dict[str, Any] = field(default_factory=dict)  # param name -> its unsharded tensor
    grads: dict[str, Any] = field(default_factory=dict)  # param name -> reduce-scattered shard
    saved: dict[int, dict[str, Any]] = field(default_factory=dict)

    # ---- emission helpers -------------------------------------------------------------
    def op(self, target: Any, *args: Any, meta: dict | None = None, **kwargs: Any) -> Any:
        node_meta = dict(meta) if meta else {}
        if self.backward:
            node_meta[tags.AUTOGRAD_BACKWARD] = True
        return self.sink.op(target, args, kwargs, node_meta)

    def items(self, value: Any, count: int) -> list[Any]:
        return [self.op(operator.getitem, value, i) for i in range(count)]

    def placeholders(self, layers: Iterable[_Layer], head: Iterable[_Param]) -> Any:
        cfg = self.cfg
        tokens = self.sink.placeholder("activations", (cfg.batch, cfg.seq, cfg.hidden), torch.float32)
        layers = list(layers)
        for param in [p for layer in layers for p in layer.params] + list(head):
            self.shards[param.name] = self.sink.placeholder(
                "shard_" + param.name.replace(".", "_"), (param.shard,), torch.float32
            )
        for layer in layers:
            if layer.barrier:
                self.buffers[layer.index] = self.sink.placeholder(
                    f"layers_{layer.index}_running_mean", (cfg.hidden,), torch.float32
                )
        return tokens

    # ---- FSDP collectives ---------------------------------------------------------------
    def gather(self, groups: Sequence[Sequence[_Param]], bucket_prefix: str) -> None:
        """All-gather each group (a parameter, or a bucket) and realise its parameters' views."""
        cfg = self.cfg
        comm_type = tags.ALL_GATHER_BACKWARD if self.backward else tags.ALL_GATHER
        itemsize = cfg.dtype.itemsize
        for number, group in enumerate(groups):
            sources = [self.shard(p) for p in group]
            if len(group) == 1:
                param = group[0]
                meta = {
                    tags.COMM_TYPE: comm_type,
                    tags.PARAM_NAME: param.name,
                    tags.UNSHARDED_NBYTES: cfg.world_size * param.shard * itemsize,
                }
                launch = self.op(ALL_GATHER, sources[0], cfg.world_size, cfg.group_name, meta=meta)
                self.live[param.name] = self.unflatten(self.op(WAIT, launch), param)
                continue
            # Bucket ids are unique per launch (the backward re-gather gets its own) and never
            # falsy, so `if meta.get("fsdp_bucket_id")` style checks see every bucket.
            bucket = f"{bucket_prefix}bucket{number}" + (".backward" if self.backward else "")
            total = sum(p.shard for p in group)
            meta = {
                tags.COMM_TYPE: comm_type,
                tags.PARAM_NAME: bucket,
                tags.UNSHARDED_NBYTES: cfg.world_size * total * itemsize,
                tags.BUCKET_ID: bucket,
                tags.BUCKET_MEMBERS: tuple(p.name for p in group),
            }
            packed = self.op(aten.cat.default, sources)
            launch = self.op(ALL_GATHER, packed, cfg.world_size, cfg.group_name, meta=meta)
            rows = self.op(aten.view.default, self.op(WAIT, launch), [cfg.world_size, total])
            offset = 0
            for param in group:
                part = self.op(aten.slice.Tensor, rows, 1, offset, offset + param.shard)
                copy = self.op(
                    aten.clone.default, part, memory_format=torch.contiguous_format,
                    meta={tags.BUCKET_COPY_OUT: bucket},
                )
                flat = self.op(aten.view.default, copy, [cfg.world_size * param.shard])
                self.live[param.name] = self.unflatten(flat, param)
                offset += param.shard

    def shard(self, param: _Param) -> Any:
        """The gather's input: the shard placeholder, or under mixed precision its private bf16 cast."""
        shard = self.shards[param.name]
        return self.op(CAST, shard, torch.bfloat16) if self.cfg.mixed_precision else shard

    def unflatten(self, flat: Any, param: _Param) -> Any:
        trimmed = self.op(aten.slice.Tensor, flat, 0, 0, param.numel)  # drop the world_size padding
        return self.op(aten.view.default, trimmed, list(param.shape))

    def release(self, *names: str) -> None:
        """Free unsharded storage after its last reader (in forward only when resharding)."""
        if not self.backward and not self.cfg.reshard:
            return
        comm_type = tags.RESHARD_FREE_BACKWARD if self.backward else tags.RESHARD_FREE
        for name in names:
            self.op(release_storage, self.live.pop(name), meta={tags.COMM_TYPE: comm_type, tags.PARAM_NAME: name})

    def release_rest(self, params: Iterable[_Param]) -> None:
        self.release(*[p.name for p in params if p.name in self.live])

    def reduce_scatter(self, param: _Param, grad: Any) -> None:
        cfg = self.cfg
        if cfg.mixed_precision:
            grad = self.op(CAST, grad, torch.float32)  # reduce in fp32, like FSDP's reduce_dtype
        flat = self.op(aten.view.default, grad, [param.numel])
        padding = param.shard * cfg.world_size - param.numel
        if padding:
            flat = self.op(aten.constant_pad_nd.default, flat, [0, padding])
        meta = {tags.COMM_TYPE: tags.REDUCE_SCATTER, tags.PARAM_NAME: param.name}
        launch = self.op(REDUCE_SCATTER, flat, "sum", cfg.world_size, cfg.group_name, meta=meta)
        self.grads[param.name] = self.op(WAIT, launch)

    # ---- model pieces -----------------------------------------------------------------------
    def linear(self, x: Any, weight: Any, bias: Any | None) -> Any:
        if bias is None:
            return self.op(aten.mm.default, x, self.op(aten.t.default, weight))
        return self.op(aten.addmm.default, bias, x, self.op(aten.t.default, weight))

    def linear_backward(self, grad: Any, x: Any, weight: Any) -> tuple[Any, Any]:
        """Gradient of the input, and of the weight, of `x @ weight.T`."""
        grad_x = self.op(aten.mm.default, grad, weight)
        grad_w = self.op(aten.mm.default, self.op(aten.t.default, grad), x)
        return grad_x, grad_w

    def layer_norm(self, x: Any, weight: Any, bias: Any) -> list[Any]:
        return self.items(self.op(aten.native_layer_norm.default, x, [self.cfg.hidden], weight, bias, 1e-5), 3)

    def layer_norm_backward(self, grad: Any, x: Any, stats: list[Any], weight: Any, bias: Any) -> list[Any]:
        out = self.op(
            aten.native_layer_norm_backward.default, grad, x, [self.cfg.hidden], stats[1], stats[2],
            weight, bias, [True, True, True],
        )
        return self.items(out, 3)

    def bias_grad(self, grad: Any) -> Any:
        return self.op(aten.sum.dim_IntList, grad, [0])

    def forward_layer(self, layer: _Layer, x: Any, filler: int) -> Any:
        cfg, pre = self.cfg, f"layers.{layer.index}."
        saved = self.saved[layer.index] = {"x": x}
        if layer.barrier:
            # A running-statistics buffer update: an input mutation, so a barrier.
            self.op(aten.copy_.default, self.buffers[layer.index], self.op(aten.mean.dim, x, [0]))
        self.gather(layer.forward_groups, pre)
        P = {name[len(pre):]: self.live[name] for name in (p.name for p in layer.params)}
        if cfg.attention:
            b, s, nh = cfg.batch, cfg.seq, cfg.heads
            stats = saved["ln1"] = self.layer_norm(x, P["attn_norm.weight"], P["attn_norm.bias"])
            self.release(pre + "attn_norm.weight", pre + "attn_norm.bias")
            h = saved["h1"] = stats[0]
            qkv = self.linear(h, P["attn.qkv.weight"], P["attn.qkv.bias"])
            self.release(pre + "attn.qkv.weight", pre + "attn.qkv.bias")
            qkv = self.op(aten.view.default, qkv, [b, s, 3, nh, cfg.hidden // nh])
            qkv = self.op(aten.permute.default, qkv, [2, 0, 3, 1, 4])
            q, k, v = saved["qkv"] = [self.op(aten.select.int, qkv, 0, i) for i in range(3)]
            attn = self.op(aten._scaled_dot_product_flash_attention_for_cpu.default, q, k, v, 0.0, True)
            out, lse = saved["attn"] = self.items(attn, 2)
            a = self.op(aten.permute.default, out, [0, 2, 1, 3])
            a = saved["a"] = self.op(aten.view.default, a, [cfg.tokens, cfg.hidden])
            proj = self.linear(a, P["attn.proj.weight"], P["attn.proj.bias"])
            self.release(pre + "attn.proj.weight", pre + "attn.proj.bias")
            x = saved["x1"] = self.op(aten.add.Tensor, x, proj)
        stats = saved["ln2"] = self.layer_norm(x, P["mlp_norm.weight"], P["mlp_norm.bias"])
        self.release(pre + "mlp_norm.weight", pre + "mlp_norm.bias")
        h2 = saved["h2"] = stats[0]
        f1 = saved["f1"] = self.linear(h2, P["mlp.fc1.weight"], P["mlp.fc1.bias"])
        self.release(pre + "mlp.fc1.weight", pre + "mlp.fc1.bias")
        a1 = saved["a1"] = self.op(aten.gelu.default, f1, approximate=layer.gelu)
        y = self.linear(a1, P["mlp.fc2.weight"], P["mlp.fc2.bias"])
        self.release(pre + "mlp.fc2.weight", pre + "mlp.fc2.bias")
        for _ in range(filler):  # size padding: residual-branch scaling by 1.0, exact numerically
            y = self.op(aten.mul.Tensor, y, 1.0)
        return self.op(aten.add.Tensor, x, y)

    def backward_layer(self, layer: _Layer, grad: Any, filler: int, need_input_grad: bool) -> Any:
        cfg, pre = self.cfg, f"layers.{layer.index}."
        saved = self.saved.pop(layer.index)
        if layer.barrier:
            # A node the graph's producer marks as a barrier (e.g. a loss-scale sync point).
            grad = self.op(aten.mul.Tensor, grad, 1.0, meta={tags.BARRIER: True})
        if cfg.reshard:
            self.gather(layer.backward_groups, pre)
        P = {name[len(pre):]: self.live.get(name) for name in (p.name for p in layer.params)}
        grads: dict[str, Any] = {}
        g = grad
        for _ in range(filler):
            g = self.op(aten.mul.Tensor, g, 1.0)
        g_a1, grads["mlp.fc2.weight"] = self.linear_backward(g, saved["a1"], P["mlp.fc2.weight"])
        self.release(pre + "mlp.fc2.weight")
        grads["mlp.fc2.bias"] = self.bias_grad(g)
        g_f1 = self.op(aten.gelu_backward.default, g_a1, saved["f1"], approximate=layer.gelu)
        g_h2, grads["mlp.fc1.weight"] = self.linear_backward(g_f1, saved["h2"], P["mlp.fc1.weight"])
        self.release(pre + "mlp.fc1.weight")
        grads["mlp.fc1.bias"] = self.bias_grad(g_f1)
        x_in = saved["x1"] if cfg.attention else saved["x"]
        g_x, grads["mlp_norm.weight"], grads["mlp_norm.bias"] = self.layer_norm_backward(
            g_h2, x_in, saved["ln2"], P["mlp_norm.weight"], P["mlp_norm.bias"]
        )
        self.release(pre + "mlp_norm.weight", pre + "mlp_norm.bias")
        if cfg.attention or need_input_grad:
            grad = self.op(aten.add.Tensor, grad, g_x)
        if cfg.attention:
            b, s, nh = cfg.batch, cfg.seq, cfg.heads
            g_a, grads["attn.proj.weight"] = self.linear_backward(grad, saved["a"], P["attn.proj.weight"])
            self.release(pre + "attn.proj.weight")
            grads["attn.proj.bias"] = self.bias_grad(grad)
            g_out = self.op(aten.view.default, g_a, [b, s, nh, cfg.hidden // nh])
            g_out = self.op(aten.permute.default, g_out, [0, 2, 1, 3])
            q, k, v = saved["qkv"]
            out, lse = saved["attn"]
            g_qkv = self.op(
                aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                g_out, q, k, v, out, lse, 0.0, True,
            )
            g_qkv = self.op(aten.stack.default, self.items(g_qkv, 3))
            g_qkv = self.op(aten.permute.default, g_qkv, [1, 3, 0, 2, 4])
            g_qkv = self.op(aten.clone.default, g_qkv, memory_format=torch.contiguous_format)
            g_qkv = self.op(aten.view.default, g_qkv, [cfg.tokens, 3 * cfg.hidden])
            g_h1, grads["attn.qkv.weight"] = self.linear_backward(g_qkv, saved["h1"], P["attn.qkv.weight"])
            self.release(pre + "attn.qkv.weight")
            grads["attn.qkv.bias"] = self.bias_grad(g_qkv)
            g_x, grads["attn_norm.weight"], grads["attn_norm.bias"] = self.layer_norm_backward(
                g_h1, saved["x"], saved["ln1"], P["attn_norm.weight"], P["attn_norm.bias"]
            )
            self.release(pre + "attn_norm.weight", pre + "attn_norm.bias")
            if need_input_grad:
                grad = self.op(aten.add.Tensor, grad, g_x)
        self.release_rest(layer.params)  # reshard=False: biases no backward op reads
        for param in layer.params:
            self.reduce_scatter(param, grads[param.name[len(pre):]])
        return grad

    def build(self, layers: Sequence[_Layer], fillers: Sequence[int]) -> None:
        cfg, head = self.cfg, self.cfg.head()
        tokens = self.placeholders(layers, head)
        if cfg.mixed_precision:
            tokens = self.op(CAST, tokens, torch.bfloat16)
        x = self.op(aten.view.default, tokens, [cfg.tokens, cfg.hidden])
        for layer, filler in zip(layers, fillers):
            x = self.forward_layer(layer, x, filler)

        # Head: final LayerNorm, vocabulary projection, loss = mean of squared logits.
        self.gather([(p,) for p in head], "")
        norm_w, norm_b, head_w = (self.live[p.name] for p in head)
        stats = self.layer_norm(x, norm_w, norm_b)
        self.release("norm.weight", "norm.bias")
        logits = self.linear(stats[0], head_w, None)
        self.release("head.weight")
        loss = self.op(aten.mean.default, self.op(aten.mul.Tensor, logits, logits))
        if cfg.mixed_precision:
            loss = self.op(CAST, loss, torch.float32)

        self.backward = True
        if cfg.reshard:
            self.gather([(p,) for p in head], "")
        norm_w, norm_b, head_w = (self.live[p.name] for p in head)
        g_logits = self.op(aten.mul.Tensor, logits, 2.0 / (cfg.tokens * cfg.vocab))
        g_h, g_head = self.linear_backward(g_logits, stats[0], head_w)
        self.release("head.weight")
        g_x, g_norm_w, g_norm_b = self.layer_norm_backward(g_h, x, stats, norm_w, norm_b)
        self.release("norm.weight", "norm.bias")
        for param, grad in zip(head, (g_norm_w, g_norm_b, g_head)):
            self.reduce_scatter(param, grad)
        grad = g_x
        for layer, filler in zip(reversed(layers), reversed(fillers)):
            grad = self.backward_layer(layer, grad, filler, need_input_grad=layer.index > 0)
        self.sink.output([loss, *(self.grads[name] for name in self.shards)])


def _check_int(name: str, value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _config(seed: int, world_size: int, group_name: str, buckets: bool, mixed_precision: bool,
            barriers: bool, attention: bool, reshard: bool, batch: int, seq: int, hidden: int,
            heads: int, vocab: int) -> _Config:
    _check_int("seed", seed, -(2**63))
    _check_int("world_size", world_size, 1)
    for name, value in (("batch", batch), ("seq", seq), ("hidden", hidden), ("heads", heads), ("vocab", vocab)):
        _check_int(name, value, 1)
    if hidden % heads:
        raise ValueError(f"hidden={hidden} is not divisible by heads={heads}")
    if not isinstance(group_name, str) or not group_name:
        raise ValueError(f"group_name must be a non-empty str, got {group_name!r}")
    for name, value in (("buckets", buckets), ("mixed_precision", mixed_precision), ("barriers", barriers),
                        ("attention", attention), ("reshard", reshard)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be a bool, got {value!r}")
    return _Config(seed, world_size, group_name, buckets, mixed_precision, barriers, attention, reshard,
                   batch, seq, hidden, heads, vocab)


class _Sizer:
    """Node counts from dry runs: the fixed part (inputs, head, output) and each layer's part."""

    def __init__(self, cfg: _Config) -> None:
        self.cfg = cfg
        self._by_signature: dict[tuple, int] = {}
        self.fixed = self._count([])

    def _count(self, layers: list[_Layer]) -> int:
        counter = _Counter()
        _Builder(self.cfg, counter).build(layers, [0] * len(layers))
        return counter.count

    def layer(self, layer: _Layer) -> int:
        # Layer 0 skips its input-gradient adds (nothing reads them), so it is sized on its own;
        # any other layer is sized as the second of two.
        signature = (layer.index == 0, layer.signature())
        if signature not in self._by_signature:
            probe = [self.cfg.layer(0), layer] if layer.index else [layer]
            base = self._count(probe[:1]) if layer.index else self.fixed
            self._by_signature[signature] = self._count(probe) - base
        return self._by_signature[signature]


class _TooSmall(ValueError):
    def __init__(self, message: str, minimum: int) -> None:
        super().__init__(message)
        self.minimum = minimum


def _size(cfg: _Config, num_nodes: int, layers: int | None) -> tuple[list[_Layer], list[int]]:
    """Choose the layers and per-layer padding (in forward+backward pairs) that give ~num_nodes."""
    sizer = _Sizer(cfg)
    plan = [cfg.layer(0)]
    total = sizer.fixed + sizer.layer(plan[0])
    while layers is None or len(plan) < layers:
        candidate = cfg.layer(len(plan))
        cost = sizer.layer(candidate)
        if layers is None and total + cost > num_nodes:
            break
        plan.append(candidate)
        total += cost
    if total > num_nodes:
        raise _TooSmall(
            f"num_nodes={num_nodes} is too small: {len(plan)} layer(s) with these options "
            f"take at least {total} nodes",
            total,
        )
    units = (num_nodes - total) // 2  # each padding unit is one forward and one backward node
    fillers = [units // len(plan)] * len(plan)
    rng = random.Random(f"fxsched.generate:{cfg.seed}:filler")
    for index in rng.sample(range(len(plan)), units % len(plan)):
        fillers[index] += 1
    return plan, fillers


def _corrupt_sizes(graph: fx.Graph, fraction: float, seed: int) -> None:
    """Make `fraction` of the gathers' sizes unknown: the key dropped, a bool, or negative."""
    gathers = [n for n in graph.nodes if n.target is ALL_GATHER]
    rng = random.Random(f"fxsched.generate:{seed}:missing")
    for index in sorted(rng.sample(range(len(gathers)), round(fraction * len(gathers)))):
        meta = gathers[index].meta
        how = rng.choice(("drop", "bool", "negative"))
        if how == "drop":
            del meta[tags.UNSHARDED_NBYTES]
        elif how == "bool":
            meta[tags.UNSHARDED_NBYTES] = True
        else:
            meta[tags.UNSHARDED_NBYTES] = -meta[tags.UNSHARDED_NBYTES] - 1


def min_nodes(**options: Any) -> int:
    """The smallest `num_nodes` that `generate_graph(num_nodes, **options)` accepts."""
    try:
        generate_graph(1, **options)
    except _TooSmall as error:
        return error.minimum
    return 1


def generate_graph(
    num_nodes: int,
    *,
    seed: int = 0,
    world_size: int = 2,
    layers: int | None = None,
    buckets: bool = False,
    mixed_precision: bool = False,
    barriers: bool = True,
    attention: bool = True,
    missing_sizes: float = 0.0,
    reshard: bool = True,
    group_name: str = "0",
    batch: int = 2,
    seq: int = 8,
    hidden: int = 16,
    heads: int = 2,
    vocab: int = 32,
) -> fx.GraphModule:
    """Build a tagged FSDP joint forward+backward graph of `num_nodes` nodes (within one).

    The model is a stack of pre-LayerNorm transformer layers (flash attention for CPU unless
    `attention=False`, GELU MLP) and a LayerNorm + linear head; loss = mean(logits**2).
    Placeholders: `activations` [batch, seq, hidden] fp32, one flat fp32 shard per parameter
    (`shard_<name>`, numel padded to a multiple of world_size, divided by it), then one
    `layers_<i>_running_mean` buffer per barrier layer. Outputs: (loss, reduce-scattered
    gradient shards in placeholder order).

    With `layers=None` the layer count is the largest that fits; the rest of `num_nodes` is
    filled with x*1.0 on each layer's MLP branch (forward) and its gradient (backward).
    Deterministic in its arguments; `seed` picks bucket sizes, GELU variants, the padding's
    layout and which gathers lose their size. Raises ValueError on bad arguments, or when
    `num_nodes` is below what one layer (or `layers` layers) needs; see `min_nodes`.
    """
    _check_int("num_nodes", num_nodes, 1)
    if layers is not None:
        _check_int("layers", layers, 1)
    if isinstance(missing_sizes, bool) or not isinstance(missing_sizes, (int, float)) or not 0 <= missing_sizes <= 1:
        raise ValueError(f"missing_sizes must be a fraction in [0, 1], got {missing_sizes!r}")
    cfg = _config(seed, world_size, group_name, buckets, mixed_precision, barriers, attention, reshard,
                  batch, seq, hidden, heads, vocab)
    plan, fillers = _size(cfg, num_nodes, layers)
    # The build allocates millions of long-lived objects; generational GC passes over them
    # find nothing to free and cost ~40% of the time at 100k nodes.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        sink = _FxSink()
        _Builder(cfg, sink).build(plan, fillers)
        if missing_sizes:
            _corrupt_sizes(sink.graph, missing_sizes, seed)
        gm = fx.GraphModule(torch.nn.Module(), sink.graph)
    finally:
        if gc_was_enabled:
            gc.enable()
    gm.meta["fxsched_generate"] = {
        "num_nodes": num_nodes, "layers": len(plan), "seed": seed, "world_size": world_size,
    }
    return gm
