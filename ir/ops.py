"""The IR's node kinds: small attrs classes, one per kind, registered by their text keyword.

An op knows its name, its data operands and its phase; kind-specific fields say what the
passes need (sizes, roles, flags). Nothing here reads torch.fx: lowering fills the fields.
"""

from __future__ import annotations

import enum
from typing import ClassVar

import attrs

from . import tags

OP_KINDS: dict[str, type[Op]] = {}


class Phase(enum.Enum):
    FORWARD = "fwd"
    BACKWARD = "bwd"


class Role(enum.Enum):
    """What an FSDP graph pass said a collective is for (lowered from `comm_type`)."""

    GATHER = tags.ALL_GATHER
    REGATHER = tags.ALL_GATHER_BACKWARD
    REDUCE_SCATTER = tags.REDUCE_SCATTER


def irop(keyword: str, *, movable: bool = True, effect: bool = False):
    """Register an op class under its text keyword and declare its traits.

    `movable`: a pass may change its position (inputs, markers and the output may not).
    `effect`: it orders against other effects (barriers, frees) — see ir/effects.py.
    """

    def register(cls):
        cls.KIND = keyword
        cls.MOVABLE = movable
        cls.EFFECT = effect
        cls.make = _maker(cls)
        OP_KINDS[keyword] = cls
        return cls

    return register


def _maker(cls) -> classmethod:
    """`cls.make(name, operands, phase, types, **fields)`: the op `cls(...)` builds from the same
    values, for values already of their fields' types (a tuple where the field converts to one;
    nothing is converted or checked). The four common fields may be given by position.

    Lowering makes one op per FX node, and attrs' `__init__` (an `object.__setattr__` and a
    converter call per field) was a quarter of lowering's per-node time; `make` sets each slot
    through its own descriptor, in under half the time. Generated as attrs generates `__init__`,
    with the fields' defaults. A subclass (with fields of its own) gets its `__init__`.
    """
    fields = attrs.fields(cls)
    assert not any(isinstance(f.default, attrs.Factory) for f in fields), "a factory default: use __init__"
    assert [f.name for f in fields[:4]] == ["name", "operands", "phase", "types"], "the common fields first"
    params = [f.name if f.default is attrs.NOTHING else f"{f.name}=_default_{f.name}" for f in fields]
    params.insert(4, "*")
    names = ", ".join(f"{f.name}={f.name}" for f in fields)
    source = (f"def make(cls, {', '.join(params)}):\n"
              f"    if cls is not _cls:\n"
              f"        return cls({names})\n"
              f"    self = _new(cls)\n"
              + "".join(f"    _set_{f.name}(self, {f.name})\n" for f in fields)
              + "    return self\n")
    namespace = {"_cls": cls, "_new": object.__new__}
    for f in fields:
        namespace[f"_set_{f.name}"] = getattr(cls, f.name).__set__  # the slot's member descriptor
        if f.default is not attrs.NOTHING:
            namespace[f"_default_{f.name}"] = f.default
    exec(source, namespace)  # noqa: S102  (generated from the class's own fields, as attrs does)
    return classmethod(namespace["make"])


DTYPE_BYTES = {"f64": 8, "f32": 4, "f16": 2, "bf16": 2, "f8e4m3": 1, "f8e5m2": 1, "c64": 8, "c128": 16,
               "i64": 8, "i32": 4, "i16": 2, "i8": 1, "u8": 1, "b1": 1, "none": 0}


@attrs.frozen
class TensorType:
    """What a value is: a dtype (short name, see DTYPE_BYTES) and a shape (-1: unknown extent).

    `none` stands for a non-tensor element of a multi-output op.
    """

    dtype: str
    shape: tuple[int, ...] = attrs.field(default=(), converter=tuple)

    @property
    def numel(self) -> int | None:
        n = 1
        for d in self.shape:
            if d < 0:
                return None
            n *= d
        return n

    @property
    def nbytes(self) -> int | None:
        numel = self.numel
        return None if numel is None else numel * DTYPE_BYTES.get(self.dtype, 4)

    def __str__(self) -> str:
        if self.dtype == "none":
            return "none"
        return f"{self.dtype}[{','.join('?' if d < 0 else str(d) for d in self.shape)}]"


@attrs.frozen(kw_only=True)
class Op:
    KIND: ClassVar[str] = "op"
    MOVABLE: ClassVar[bool] = True
    EFFECT: ClassVar[bool] = False

    name: str
    operands: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    phase: Phase = Phase.FORWARD
    #: the result's type(s): one per output; empty when unknown
    types: tuple[TensorType, ...] = attrs.field(default=(), converter=tuple)
    #: operands whose storage this op writes in place (an in-place or `out=` op, a mutating
    #: collective, a call fxsched cannot see into); see ir/effects.py
    writes: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    #: the operand whose storage the result shares, when the op is no View (an in-place op's
    #: result, an op whose `meta["val"]` shares its input's storage); None: fresh storage
    alias: str | None = None
    #: operands whose storage the result MAY share, when nothing says whether it does (a call
    #: fxsched cannot see into, with no `meta["val"]`: it may return one of its tensors, or a
    #: view of one). The result has storage of its own too; each access of it also counts as an
    #: access of each of theirs (a write through it writes them), and an access after one's free
    #: is a note, not a use after free (it may be fresh). Never with `alias`, nor on a View.
    #: See ir/effects.py
    may_alias: tuple[str, ...] = attrs.field(default=(), converter=tuple)

    @property
    def nbytes_out(self) -> int:
        """Bytes of all known tensor outputs (unknown extents count 0)."""
        return sum(t.nbytes or 0 for t in self.types)

    def fields(self) -> dict[str, object]:
        """Kind-specific fields (everything but name, operands, phase and types), in declaration
        order, then the storage effects every op may have (`writes`, `alias`, `may_alias`)."""
        names = [f.name for f in attrs.fields(type(self)) if f.name not in COMMON_FIELDS]
        names.sort(key=EFFECT_FIELDS.__contains__)  # stable: effects last
        return {name: getattr(self, name) for name in names}


COMMON_FIELDS = frozenset({"name", "operands", "phase", "types"})
EFFECT_FIELDS = frozenset({"writes", "alias", "may_alias"})


@irop("input", movable=False)
@attrs.frozen(kw_only=True)
class Input(Op):
    """A graph input (placeholder)."""

    target: str = ""


@irop("constant")
@attrs.frozen(kw_only=True)
class Constant(Op):
    """A module attribute read (get_attr): no operands, no cost, stays where the graph put it."""

    target: str = ""


@irop("output", movable=False)
@attrs.frozen(kw_only=True)
class Output(Op):
    pass


@irop("marker", movable=False)
@attrs.frozen(kw_only=True)
class Marker(Op):
    """A virtual node with no computation: `^entry` ends the inputs, `^backward` starts the backward phase."""


@irop("compute")
@attrs.frozen(kw_only=True)
class Compute(Op):
    """Any other computation. `random` ones draw from the RNG, so they keep their relative order."""

    target: str = ""
    heavy: bool = False
    attention: bool = False
    random: bool = False


@irop("cast")
@attrs.frozen(kw_only=True)
class Cast(Op):
    """A dtype conversion (or DTensor's pad of a smaller shard before its gather); a lone cast of a
    shard moves with the gather that reads it. With `alias` its result is taken for its operand's
    storage: a conversion that returns its input, or a shard's pad before its gather (lowering:
    the ranks without the pad gather the shard itself), which then costs no time and no bytes."""

    target: str = ""


@irop("view")
@attrs.frozen(kw_only=True)
class View(Op):
    """An op whose result aliases its first operand's storage.

    `maybe`: the schema says the result may alias, and nothing said whether it does (`reshape`,
    `contiguous`, `to` copy when they must): it orders as an alias, but a read of it after its
    source's free is no use-after-free (it may be a copy): a note, not an error.
    """

    target: str = ""
    maybe: bool = False


@irop("copy_out")
@attrs.frozen(kw_only=True)
class CopyOut(Op):
    """A clone that copies one member out of a bucket's gathered buffer."""

    target: str = ""
    bucket: str = ""


@irop("launch")
@attrs.frozen(kw_only=True)
class Launch(Op):
    """A collective launch. `role` is set for FSDP collectives; others keep their relative order.

    A coalesced launch (`*_coalesced`: several operands, one result per operand in `types`) is
    waited result by result: each result is a `view` of the launch (FX's getitem), read by
    exactly one `wait` that names the launch (`Wait.launch`). A bucket of them has `bucket` and
    `params` (one member per result) and no copy-outs.

    `nbytes` is None when the size is unknown; `group_size` is the number of ranks in the
    process group (None when unknown). `anchor` names the node the launch should
    go just before (set by an anchoring pass); `hold` says why the launch stays where it is;
    `prefetched` is set once a pass has moved it there.

    `unordered` (FSDP's gradient reduce-scatters only: role `fsdp_reduce_scatter`, a known
    group) says it need not keep its traced order with the other unordered ones of its group:
    every rank runs the same deterministic passes on the same graph, so every rank issues them
    in the same order, whatever it is (as for the gathers, which keep no collective order).
    Its order against every other collective of its group, and against those of unknown group,
    is kept (`collective-order`, ir/effects.py). Set by `unorder-reduce-scatters` through
    `Rewriter.unorder`, which updates the edges; raising writes it on the node
    (`tags.UNORDERED`) and lowering reads it back where it may be set, so a raised graph
    scheduled again keeps the freedom its schedule assumed.
    """

    target: str = ""
    group: str | None = None
    group_size: int | None = None
    role: Role | None = None
    nbytes: int | None = None
    params: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    bucket: str | None = None
    #: a reduction's operator (`"sum"`, `"avg"`: a reduce-scatter's or all-reduce's `reduce_op`)
    reduce_op: str | None = None
    anchor: str | None = None
    hold: str | None = None
    prefetched: bool = False
    unordered: bool = False

    @property
    def is_gather(self) -> bool:
        return self.role in (Role.GATHER, Role.REGATHER)

    @property
    def may_unorder(self) -> bool:
        """Whether `unordered` may be set on it: an FSDP gradient reduce-scatter of a known group."""
        return self.role is Role.REDUCE_SCATTER and self.group is not None


@irop("wait")
@attrs.frozen(kw_only=True)
class Wait(Op):
    """Completes a launch: its operand is the launch, or (`launch` set) one result of a
    coalesced launch, a view of it (FX's getitem) that only this wait reads."""

    target: str = ""
    #: the coalesced launch whose result the operand is (None: the operand is the launch)
    launch: str | None = None

    @property
    def launched_by(self) -> str | None:
        """The launch this wait completes (None: a wait with no operand, which verify refuses)."""
        return self.launch if self.launch is not None else (self.operands[0] if self.operands else None)


@irop("free", effect=True)
@attrs.frozen(kw_only=True)
class Free(Op):
    """Releases the storage of its first operand (and every view of it) for `params`."""

    target: str = ""
    params: tuple[str, ...] = attrs.field(default=(), converter=tuple)


@irop("barrier", movable=False, effect=True)
@attrs.frozen(kw_only=True)
class Barrier(Op):
    """A side effect nothing may cross: a call on state fxsched cannot see (torch.fx's
    side-effectful functions), or an explicit `barrier` tag. (In-place writes are no barrier:
    they write their operands' storage, see `Op.writes`.)

    `heavy`/`attention` as for Compute: a heavy op tagged as a barrier still anchors prefetch.
    """

    target: str = ""
    reason: str = ""
    heavy: bool = False
    attention: bool = False


# An `Opaque`'s reason when it is a wait on something that is not a launch (an opaque
# collective's result): it completes that collective.
WAIT_ON_NO_LAUNCH = "wait on no launch"


@irop("opaque", movable=False)
@attrs.frozen(kw_only=True)
class Opaque(Op):
    """A collective, or a wait, that the passes do not schedule (a collective not waited exactly
    once, a coalesced one whose results are not each waited once, a wait on no launch): it stays
    where it is, in order with the collectives of its `group` (of every group when None), and
    writes what `writes` says. `reason` says why.
    `group_size` is the collective's rank count, where known (the ranks' agreement check reads it).
    """

    target: str = ""
    group: str | None = None
    group_size: int | None = None
    reason: str = ""
