"""Cost models over the IR: milliseconds per op, from result and operand `types`.

- `Roofline(hardware)`: heavy ops (mm, addmm, bmm, matmul, linear, attention forward and
  backward) take max(FLOPs / peak, bytes / HBM bandwidth) + a launch overhead; every other
  computation takes bytes moved (operands + results) / HBM bandwidth + the launch overhead;
  views, waits, markers, inputs, constants, the output and frees take 0, and so does a cast whose
  result is its operand's storage (`alias`), under every model. A collective launch takes
  latency + bytes·(n−1)/n ÷ collective bandwidth on its communication stream (bytes = the
  gathered output of an all-gather, the input of a reduce-scatter; an all-reduce moves twice
  that), n = the op's group size.
- `Callback(fn)`: your function op -> ms (None falls back to another model).
- `Measured(table)`: measured ms by target name (`"aten.mm.default"`, or the packet `"aten.mm"`);
  inputs, constants, markers and the output are never looked up.

`as_cost_model` turns any of these (or a profile name, a Hardware, a callable, a mapping)
into a CostModel; `op_costs(program, model)` gives {op name: ms}; `CostAnalysis` exposes the
same to passes through `PassContext(cost_model=...)` (it duck-types passes' Analysis, so
this package never imports passes/).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from operator import attrgetter, itemgetter
from typing import Any

import attrs

from ..ir.errors import CostModelError
from ..ir.gcpause import gc_paused
from ..ir.opclass import MATMULS, is_attention, is_attention_backward, op_name  # noqa: F401  (re-exported)
from ..ir import Cast, Constant, Input, Launch, Marker, Op, Output, Program, Free, View, Wait
from .hardware import H100, Hardware, hardware

ZERO_COST = (View, Wait, Marker, Input, Constant, Output, Free)
#: ops that hold storage for the whole step (and cost nothing)
STATIC = (Input, Constant)


def is_zero_cost(op: Op) -> bool:
    """Views, waits, markers, inputs, constants, the output and frees take no compute time; nor
    does a cast whose result is its operand's storage (`alias`: a conversion that returns its
    input, or the pad of a shard that lowering takes for the shard, `lowering/fx.py`), whatever
    the cost model (`op_costs`)."""
    return isinstance(op, ZERO_COST) or (type(op) is Cast and op.alias is not None)
#: the group size assumed for a collective whose op does not say (one node of 8 devices)
DEFAULT_GROUP_SIZE = 8


# ---- what an op does -------------------------------------------------------------------

def _types(program: Program, name: str):
    return program.op(name).types  # the raw node dict: networkx's view costs more than the lookup


def _first_tensor(types):
    return next((t for t in types if t.dtype != "none"), None)


def _operand_type(program: Program, op: Op, index: int):
    if index >= len(op.operands):
        return None
    return _first_tensor(_types(program, op.operands[index]))


def _known(*shapes) -> bool:
    return all(s is not None and all(d >= 0 for d in s) for s in shapes)


def matmul_flops(op: Op, program: Program) -> int | None:
    """2·numel(out)·k for mm/addmm/bmm/baddbmm/matmul/linear; k = the reduced extent, read
    from the first matrix operand (operand 1 for addmm/baddbmm, whose operand 0 is the bias)."""
    out = _first_tensor(op.types)
    first = 1 if op_name(getattr(op, "target", "")) in ("addmm", "baddbmm") and len(op.operands) >= 2 else 0
    a = _operand_type(program, op, first)
    if out is None or a is None or not a.shape or not _known(out.shape, a.shape):
        return None
    k = a.shape[-1]
    return 2 * math.prod(out.shape) * k


def _seq_kv(k_shape: tuple[int, ...]) -> int:
    """Key/value sequence length: dim -2 of a 4-d [B, H, S, D] (BNSD) key, dim 1 of a 3-d
    [B, S, H] (BSH) key; other layouts are not recognised (dim -2 is used)."""
    if len(k_shape) == 3:
        return k_shape[1]
    return k_shape[-2]


def attention_flops(op: Op, program: Program) -> int | None:
    """FLOPs of attention, as torch.utils.flop_counter counts SDPA (no causal discount).

    Forward: q·kᵀ and p·v: 2·numel(q)·S_kv·(1 + Dv/Dq). Backward: recompute q·kᵀ, then dv, dp,
    dq, dk: 2·numel(q)·S_kv·(3 + 2·Dv/Dq) (= 2.5× the forward when Dv = Dq). The forward reads
    q, k, v from operands 0..2; the backward from its results dq, dk, dv (the aten backward ops
    take the output gradient first, npu_fusion_attention_grad takes q first; results agree).
    """
    target = getattr(op, "target", "")
    if is_attention_backward(target):
        tensors = [t for t in op.types if t.dtype != "none"]
        if len(tensors) >= 3:
            q, k, v = tensors[:3]
        else:
            q, k, v = (_operand_type(program, op, i) for i in (1, 2, 3))
        backward = True
    else:
        q, k, v = (_operand_type(program, op, i) for i in (0, 1, 2))
        backward = False
    if q is None or k is None or not q.shape or not k.shape or not _known(q.shape, k.shape):
        return None
    dq = q.shape[-1]
    dv = v.shape[-1] if v is not None and v.shape and v.shape[-1] >= 0 else dq
    s_kv = _seq_kv(k.shape)
    numel_q = math.prod(q.shape)
    ratio = dv / dq if dq else 1.0
    factor = (3 + 2 * ratio) if backward else (1 + ratio)
    return int(round(2 * numel_q * s_kv * factor))


def flops(op: Op, program: Program) -> int | None:
    """FLOPs of a heavy op (matmul family or attention); None for other ops or unknown shapes."""
    target = getattr(op, "target", "")
    if not target or isinstance(op, Launch) or is_zero_cost(op):
        return None
    heavy = _HEAVY.get(target)
    if heavy is None:  # what the target is, read off its name once (a graph has few targets)
        heavy = _HEAVY[target] = attention_flops if is_attention(target) else (
            matmul_flops if op_name(target) in MATMULS else _no_flops)
    return heavy(op, program)


def _no_flops(op: Op, program: Program) -> None:
    return None


#: target -> how `flops` counts an op of it (attention_flops, matmul_flops or _no_flops)
_HEAVY: dict[str, Callable[[Op, Program], int | None]] = {}


def bytes_moved(op: Op, program: Program) -> int:
    """Bytes read and written: every operand's known tensor bytes (once each) plus the results'."""
    total = op.nbytes_out
    for operand in op.operands:
        total += program.op(operand).nbytes_out
    return total


def collective_kind(target: str) -> str:
    t = target.lower()
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast"):
        if kind in t:
            return kind
    return "other"


def _coalesced_bytes(kind: str, op: Launch, program: Program, i: int) -> int:
    """`collective_bytes` of a coalesced launch's result `i` (from its operand `i`)."""
    out = op.types[i]
    if kind != "all_gather":
        a = _operand_type(program, op, i)
        if a is not None and a.nbytes is not None:
            return a.nbytes
    if out.nbytes is None:
        return 0
    return out.nbytes * (op.group_size or 1) if kind == "reduce_scatter" else out.nbytes


def collective_bytes(op: Launch, program: Program) -> int:
    """The bytes the bandwidth term counts: an all-gather's gathered output (its `nbytes` when
    the type is unknown), a reduce-scatter's input (its output × group size when the input's
    type is unknown), otherwise the (first) input; a coalesced launch's, summed over its results."""
    kind = collective_kind(op.target)
    if len(op.types) > 1:  # coalesced: every result, from every input
        return sum(_coalesced_bytes(kind, op, program, i) for i in range(len(op.types))) or op.nbytes or 0
    if kind == "all_gather":
        out = _first_tensor(op.types)
        if out is not None and out.nbytes is not None:
            return out.nbytes
        return op.nbytes or 0
    a = _operand_type(program, op, 0)
    if a is not None and a.nbytes is not None:
        return a.nbytes
    out = _first_tensor(op.types)
    if out is None or out.nbytes is None:
        return 0
    # input unknown: a reduce-scatter's input is its output times the group size
    return out.nbytes * (op.group_size or 1) if kind == "reduce_scatter" else out.nbytes


# ---- models ----------------------------------------------------------------------------

class CostModel:
    """Milliseconds per op. Subclasses implement `op_ms`; `collective_ms` prices a collective
    from its kind, byte count and group size (for peers that re-size collectives)."""

    def op_ms(self, op: Op, program: Program) -> float:
        raise NotImplementedError

    def collective_ms(self, kind: str, nbytes: int, group_size: int | None) -> float:
        raise NotImplementedError


@attrs.frozen
class Roofline(CostModel):
    """The roofline model on one Hardware profile (see the module docstring).

    `launch_us` overrides the profile's per-kernel overhead; `default_group_size` is used for
    collectives whose op has no `group_size`; `flops_efficiency` / `bandwidth_efficiency`
    derate the peaks (1.0 = datasheet peak).
    """

    hw: Hardware = H100
    launch_us: float | None = None
    default_group_size: int = DEFAULT_GROUP_SIZE
    flops_efficiency: float = 1.0
    bandwidth_efficiency: float = 1.0

    @property
    def overhead_ms(self) -> float:
        return (self.hw.launch_us if self.launch_us is None else self.launch_us) / 1e3

    def memory_ms(self, nbytes: int) -> float:
        return nbytes / (self.hw.hbm_gbps * self.bandwidth_efficiency * 1e6)

    def compute_ms(self, n_flops: int, dtype: str | None) -> float:
        return n_flops / (self.hw.tflops(dtype) * self.flops_efficiency * 1e9)

    def collective_ms(self, kind: str, nbytes: int, group_size: int | None) -> float:
        n = group_size if group_size and group_size > 0 else self.default_group_size
        if n <= 1:
            return 0.0
        factor = {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0, "other": 1.0}.get(kind, (n - 1) / n)
        seconds = nbytes * factor / (self.hw.coll_gbps * self.bandwidth_efficiency * 1e9)
        return self.hw.coll_latency_us / 1e3 + seconds * 1e3

    def op_ms(self, op: Op, program: Program) -> float:
        if is_zero_cost(op):
            return 0.0
        if isinstance(op, Launch):
            return self.collective_ms(collective_kind(op.target), collective_bytes(op, program), op.group_size)
        memory = self.memory_ms(bytes_moved(op, program))
        n_flops = flops(op, program)
        if n_flops:
            out = _first_tensor(op.types)
            memory = max(memory, self.compute_ms(n_flops, out.dtype if out is not None else None))
        return memory + self.overhead_ms


@attrs.frozen
class Callback(CostModel):
    """`fn(op) -> ms`; when it returns None the `fallback` model prices the op."""

    fn: Callable[[Op], float | None]
    fallback: CostModel = attrs.field(factory=Roofline)

    def op_ms(self, op: Op, program: Program) -> float:
        value = self.fn(op)
        return self.fallback.op_ms(op, program) if value is None else float(value)

    def collective_ms(self, kind: str, nbytes: int, group_size: int | None) -> float:
        return self.fallback.collective_ms(kind, nbytes, group_size)


@attrs.frozen
class Measured(CostModel):
    """Measured milliseconds by target name; the exact target wins over its packet name
    (`aten.mm.default` over `aten.mm`), and an op's own name (`names`, e.g. {"m2": 3.0}) over
    both. Ops not in the table go to `fallback`; inputs, constants, markers and the output are
    never looked up."""

    table: Mapping[str, float] = attrs.field(converter=lambda m: dict(m))
    fallback: CostModel = attrs.field(factory=Roofline)
    names: Mapping[str, float] = attrs.field(factory=dict, converter=lambda m: dict(m))

    def op_ms(self, op: Op, program: Program) -> float:
        target = getattr(op, "target", "")
        if not isinstance(op, (Marker, Output, *STATIC)) and op.name in self.names:
            return float(self.names[op.name])
        if target and not isinstance(op, (Marker, Output, *STATIC)):
            if target in self.table:
                return float(self.table[target])
            packet = target.rsplit(".", 1)[0]
            if packet in self.table:
                return float(self.table[packet])
        return self.fallback.op_ms(op, program)

    def collective_ms(self, kind: str, nbytes: int, group_size: int | None) -> float:
        return self.fallback.collective_ms(kind, nbytes, group_size)


def parse_cost_table(text: str, source: str = "<cost table>", fallback: CostModel | None = None) -> Measured:
    """A cost table file (`fxsched opt --cost-table FILE`): one `KEY = MS` a line, KEY an op's
    name (`%m2`) or a target (`aten.mm.default`, or the packet `aten.mm`), MS a finite
    non-negative number of milliseconds; blank lines and lines starting with `#` or `//` are
    skipped. Ops it does not list cost what `fallback` (the hardware's roofline) says."""
    names, targets = {}, {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith(("#", "//")):
            continue
        key, eq, value = line.partition("=")
        key, value = key.strip(), value.strip()
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if not eq or not key or key == "%" or not math.isfinite(ms) or ms < 0:
            raise CostModelError(f"{source}:{number}: expected KEY = MS (KEY an op %name or a target, MS a finite "
                                 f"non-negative number of milliseconds), got {line!r}")
        table = names if key.startswith("%") else targets
        if key.lstrip("%") in table:
            raise CostModelError(f"{source}:{number}: {key} is given twice")
        table[key.lstrip("%")] = ms
    return Measured(targets, fallback=fallback or Roofline(), names=names)


def as_cost_model(spec: Any = None) -> CostModel:
    """None -> Roofline(H100); a profile name (`"h200"`) or a Hardware -> its Roofline; a
    CostModel as is; a mapping -> Measured; a callable (op -> ms or None) -> Callback."""
    if spec is None:
        return Roofline()
    if isinstance(spec, CostModel):
        return spec
    if isinstance(spec, str):
        return Roofline(hardware(spec))
    if isinstance(spec, Hardware):
        return Roofline(spec)
    if isinstance(spec, Mapping):
        return Measured(spec)
    if callable(spec):
        return Callback(spec)
    raise TypeError(f"cannot make a cost model from {type(spec).__name__}: pass a profile name, Hardware, "
                    "CostModel, {target: ms} mapping or a function op -> ms")


def op_costs(program: Program, model: Any = None) -> dict[str, float]:
    """{op name: ms} for every op of `program` (in the graph's node order). A model that raises on an
    op, or answers anything but a finite non-negative number, is a CostModelError naming the
    model and the op (it is the model's answer that is wrong, not the pass that asked)."""
    model = as_cost_model(model)
    costs = {}
    node = program.node_data
    # the ops in the node table's own order, picked out in C: a lookup per name in schedule
    # order was a cache miss or two per op at 100k nodes (40 ms), and no op's price depends
    # on the order
    names, ops = node.keys(), map(_OP, node.values())
    # the roofline itself prices the zero-cost kinds at 0.0 without a look at the op: most ops
    # of a graph are such (views, waits, inputs), and the call per op was most of this loop
    roofline = type(model) is Roofline
    # The roofline's price of an op is a function of its kind, target, group size, nbytes and
    # the types of it and of its operands, in order: ops alike in these (a layer's and the next
    # one's) are priced once. Types are keyed by the identity of their tuple (lowering makes one
    # per dtype and shape, and every op, so every tuple, lives as long as this call): no hashing
    # of shapes. 2.8k prices for the 29k priced ops of the 100k-node generated graph.
    prices: dict[tuple, float] = {}
    with gc_paused():
        for name, op in zip(names, ops):
            if type(op) is Cast and op.alias is not None:
                # its operand itself (`is_zero_cost`), whatever the model: a rank that pads its
                # shard before the gather is priced as one that gathers it as it is
                costs[name] = 0.0
                continue
            if roofline:
                if isinstance(op, ZERO_COST):
                    costs[name] = 0.0
                    continue
                key = (type(op), getattr(op, "target", ""), getattr(op, "group_size", None), getattr(op, "nbytes", None),
                       id(op.types), *map(id, map(_TYPES, map(_OP, map(node.__getitem__, op.operands)))))
                ms = prices.get(key)
                if ms is not None:
                    costs[name] = ms
                    continue
            try:
                ms = model.op_ms(op, program)
            except (TypeError, ValueError, ArithmeticError, LookupError) as exc:
                raise CostModelError(f"cost model {_describe(model)} failed on {_describe_op(op)}: "
                                     f"{type(exc).__name__}: {exc}") from exc
            if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms < 0:
                raise CostModelError(f"cost model {_describe(model)} gave {ms!r} ms for {_describe_op(op)}: "
                                     "a cost must be a finite non-negative number")
            costs[name] = ms
            if roofline:
                prices[key] = ms
    return costs


_OP, _TYPES = itemgetter("op"), attrgetter("types")


def _describe(model: CostModel) -> str:
    fn = getattr(model, "fn", None)
    return f"{type(model).__name__}({getattr(fn, '__qualname__', fn)!s})" if fn is not None else repr(model)


def _describe_op(op: Op) -> str:
    target = getattr(op, "target", "")
    return f"%{op.name} ({op.KIND}{' ' + repr(target) if target else ''})"


@attrs.frozen
class CostAnalysis:
    """Per-op costs for passes: `ctx.get(CostAnalysis, program)` reads `ctx.options["cost_model"]`
    (anything `as_cost_model` takes; H100 roofline when absent). Costs do not depend on the
    order, so a pass that only reorders may list it in `preserves`."""

    model: CostModel
    ms: Mapping[str, float]

    @classmethod
    def compute(cls, program: Program, ctx=None) -> CostAnalysis:
        options = getattr(ctx, "options", None) or {}
        model = as_cost_model(options.get("cost_model"))
        return cls(model, op_costs(program, model))
