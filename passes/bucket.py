"""bucket: merges gathers launched close together on one stream into one collective, and likewise gradient reduce-scatters.

A gather bucket packs its members' shards into one buffer (`cat`), gathers it once and copies
each member out of the result: the gathered buffer is rank-major (rank 0's packed shards, then
rank 1's, ...), so it is viewed as [ranks, packed], each member's column band is cloned into a
contiguous [ranks, shard] tensor and flattened, which is exactly what the member's own gather
returned. A reduce-scatter bucket views each gradient as [ranks, shard], concatenates them along
the shard dimension (row r: every member's chunk for rank r, in member order), reduce-scatters
the flattened result once, and each member reads its slice of the reduced chunk, exactly what
its own reduce-scatter returned. Collectives work on dim 0, so a shard or gradient of any rank
is flattened first (a reshape) and each member's result viewed back to its own shape.

Members: launches of one stream (process group and size), phase and kind (forward gathers,
re-gathers, or reduce-scatters of one reduce op) and dtype, in schedule order; buckets made by
an FSDP pass (a launch with a `bucket`) are kept as they are and never merged. A gather bucket
launches where its first member did, a reduce-scatter bucket where its last did; one wait goes
where the first member was waited, and its copy-outs (gathers) or slices (reduce-scatters)
replace the members' waits there. Each new op takes over its members' effect edges through the
rewriter, which refuses a bucket that would cross one (a free, a barrier, the phase boundary,
a member's input not ready yet): that member is held with `bucket effect edge`.

Buckets are chosen greedily, in schedule order per stream: a bucket grows by the next member
while the simulated step (cost/simulate.py: latency saved, overlap lost, the pack and copy ops
on the compute stream) gets shorter by more than `min-saved-ms`, the bucket stays within
`max-bucket-mb`, the gathered bytes in flight within `max-in-flight-gb` (or the input's, if
higher), and the simulated peak memory within the cap (`max-peak-gb`, or the input's peak plus
`max-peak-increase-gb`; the smaller when both: unshard's semantics, in `peak_cap`). A launch
that could not join says why in the statistics and, when its launch has no reason yet, in its
`hold`. Run it after the scheduling passes (`default,bucket`) so the cost model sees the final
order.

How a candidate bucket is priced without rewriting the program (a dry run of the rewriter's
checks, a simulation of only the stretch it changes, its change to the live-bytes curve) is
passes/bucket_trials.py; this file is the pass: its options, the greedy choice of buckets and
the real merge, whose ops the trials build the same way.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import TYPE_CHECKING

import attrs

from ..cost.model import CostAnalysis
from ..cost.simulate import simulate
from ..ir import DATA, Cast, Compute, CopyOut, Launch, Phase, Program, Role, TensorType, View, Wait, holds
from ..ir.holds import OVER_PEAK_CAP, SAVES_TOO_LITTLE, register_hold
from ..ir.rewriter import Call, Operand, RewriteError, Rewriter
from .base import ModulePass, PassContext, PassResult, check_budget, check_ms, option, register_pass
from .memory_cap import GIB, cap_bytes, rewrite_cap, rewrite_stats

if TYPE_CHECKING:
    from .bucket_trials import Trial


MIB = 1 << 20

EFFECT_EDGE = register_hold("bucket effect edge", "bucket: joining the bucket before it would move its launch or "
                                                  "wait across an effect edge (a free, a barrier, the phase "
                                                  "boundary, or its input is not ready where the bucket launches)")
OVER_SIZE = register_hold("over bucket size", "bucket: the bucket before it would grow past max-bucket-mb")
NOT_PACKABLE = register_hold("not packable", "bucket: its shard and result are not flat tensors of known size "
                                             "(or not a functional all-gather / reduce-scatter with one wait)")

GATHER_OP = "all_gather_into_tensor.default"
REDUCE_SCATTER_OP = "reduce_scatter_tensor.default"
WAIT_OP = "wait_tensor.default"


@attrs.frozen
class Member:
    launch: str
    wait: str
    source: str        # what it gathers or reduces (its one operand)
    cast: str | None   # a gather's private cast of its shard, hoisted with it
    numel: int         # its shard's elements (a gather's input, a reduce-scatter's output)
    nbytes: int        # the collective's bytes (gathered output, reduce-scatter input)
    shape: tuple[int, ...]  # the collective's result


@register_pass
@dataclasses.dataclass(frozen=True)
class Bucket(ModulePass):
    name = "bucket"

    max_bucket_mb: float = option(256.0, "most MiB one bucket may gather (gathered bytes) or reduce (input bytes)")
    max_in_flight_gb: float = option(1.0, "most gathered GiB in flight (launched, not yet waited) in the simulated "
                                          "step, or the input's when that is more")
    max_peak_gb: float = option(0.0, "cap on the simulated peak memory, in GiB (0: none; the input's peak plus "
                                     "max-peak-increase-gb applies)")
    max_peak_increase_gb: float = option(0.0, "how far, in GiB, the simulated peak may rise over the input's "
                                              "(used when max-peak-gb is 0, or with it: the smaller cap wins)")
    min_saved_ms: float = option(0.0, "a bucket grows only while each member shortens the simulated step by more "
                                      "than this many ms")
    gathers: bool = option(True, "bucket parameter all-gathers")
    reduce_scatters: bool = option(True, "bucket gradient reduce-scatters")

    def __post_init__(self):
        for field in ("max-bucket-mb", "max-in-flight-gb", "max-peak-gb", "max-peak-increase-gb"):
            check_budget(self.name, field, getattr(self, field.replace("-", "_")))
        check_ms(self.name, "min-saved-ms", self.min_saved_ms)

    def apply(self, ctx: PassContext, program: Program) -> PassResult:
        from .bucket_trials import Trials  # it builds its trials' ops with this file's builders

        analysis = ctx.get(CostAnalysis, program)
        costs = dict(analysis.ms)   # and the new ops', as buckets are made
        before = simulate(program, costs=costs)
        cap = rewrite_cap(self.max_peak_gb, self.max_peak_increase_gb, before.peak_bytes, cap_bytes(ctx))
        inflight_cap = max(self.max_in_flight_gb * GIB, before.max_inflight_bytes)
        held: dict[str, str] = {}
        bought: dict[str, dict] = {}
        names = _Names(program)
        kinds = [k for k, on in (("gather", self.gathers), ("reduce-scatter", self.reduce_scatters)) if on]
        for kind in kinds:
            runs, not_packable = _runs(program, kind)
            held.update(dict.fromkeys(not_packable, NOT_PACKABLE))
            for run in runs:
                trials = Trials(program, costs, analysis.model)
                start = 0
                while start < len(run):
                    members, best, end = [run[start]], None, start + 1
                    grow, nbytes = trials.grow(run[start], kind, names.fresh(kind)), run[start].nbytes
                    while end < len(run):
                        nbytes += run[end].nbytes
                        if nbytes > self.max_bucket_mb * MIB:
                            held[run[end].launch] = OVER_SIZE
                            break
                        try:
                            trial = grow.evaluate(run[end])
                        except RewriteError:
                            held[run[end].launch] = EFFECT_EDGE
                            break
                        reason = self.refusal(trial, best, cap, inflight_cap)
                        if reason is not None:
                            held[run[end].launch] = reason
                            break
                        members, best = members + [run[end]], trial
                        end += 1
                    best = grow.close(best, members)
                    if best is not None:
                        name = names.fresh(kind)
                        bought[name] = {
                            "kind": kind, "members": [m.launch for m in members],
                            "bytes": sum(m.nbytes for m in members),
                            "step_saved_ms": round(-best.step_ms, 6),
                            "peak_change_bytes": best.peak_bytes - trials.peak_without,
                        }
                        merge(program, members, kind, name)
                        trials.make(best)
                        names.taken(name)
                        for m in members:
                            held.pop(m.launch, None)
                    start = end

        after = simulate(program, costs=costs) if bought else before
        for launch, reason in held.items():
            if launch in program.graph:
                op = program.op(launch)
                if op.is_gather and op.hold is None:
                    program.replace(attrs.evolve(op, hold=reason))
        stats = {
            "buckets": len(bought),
            "gathers bucketed": sum(len(b["members"]) for b in bought.values() if b["kind"] == "gather"),
            "reduce-scatters bucketed": sum(len(b["members"]) for b in bought.values() if b["kind"] != "gather"),
            **Counter(held[n] for n in held if n in program.graph),
            **rewrite_stats(before, after, cap),
            "bought": bought,
        }
        return PassResult(bool(bought), stats)

    def refusal(self, trial: Trial, best: Trial | None, cap: float, inflight_cap: float) -> str | None:
        """Why a bucket `trial` is not taken over the bucket before it, `best` (None: the
        program as it is), or None when it is."""
        if trial.peak_bytes > cap:
            return OVER_PEAK_CAP
        if trial.inflight_bytes > inflight_cap:
            return holds.OVER_BUDGET
        if not trial.step_ms < (best.step_ms if best else 0.0) - self.min_saved_ms:
            return SAVES_TOO_LITTLE
        return None


class _Names:
    """Fresh bucket names (`ag_bucket0`, `rs_bucket0`, ...), unused by ops and bucket ids."""

    def __init__(self, program: Program):
        self.program = program
        self.buckets = {op.bucket for op in program.ops() if isinstance(op, Launch)}
        self.next = {}

    def fresh(self, kind: str) -> str:
        stem = "ag_bucket" if kind == "gather" else "rs_bucket"
        i = self.next.get(stem, 0)
        graph = self.program.graph
        while any(f"{stem}{i}{suffix}" in graph for suffix in ("", "_pack", "_wait")) or f"{stem}{i}" in self.buckets:
            i += 1
        self.next[stem] = i
        return f"{stem}{i}"

    def taken(self, name: str) -> None:
        self.buckets.add(name)


# ---- candidates --------------------------------------------------------------------------

def _runs(program: Program, kind: str) -> tuple[list[list[Member]], list[str]]:
    """The launches that may share a bucket, per stream key, each list in schedule order; and
    the launches of that kind that cannot be packed."""
    runs: dict[tuple, list[Member]] = {}
    refused = []
    for op in program.ops():
        if not isinstance(op, Launch) or op.bucket is not None:
            continue
        if kind == "gather" and not op.is_gather or kind != "gather" and op.role is not Role.REDUCE_SCATTER:
            continue
        if holds.held_by_lowering(op.hold):
            continue
        member = _member(program, op, kind)
        if member is None:
            refused.append(op.name)
            continue
        dtype = op.types[0].dtype
        key = (op.phase, op.role, op.group, op.group_size, dtype, op.reduce_op)
        runs.setdefault(key, []).append(member)
    return sorted(runs.values(), key=lambda r: program.schedule.index(r[0].launch)), refused


def _member(program: Program, op: Launch, kind: str) -> Member | None:
    """`op` as a bucket member, or None if it cannot be packed."""
    node, succ = program.node_data, program.successors
    users = [u for u, e in succ[op.name].items() if e["kind"] == DATA]
    ranks = op.group_size
    if len(users) != 1 or not isinstance(node[users[0]]["op"], Wait) or not node[users[0]]["op"].target.endswith(WAIT_OP):
        return None
    if len(op.operands) != 1 or ranks is None or len(op.types) != 1 or op.writes or op.alias:
        return None
    if not op.target.endswith(GATHER_OP if kind == "gather" else REDUCE_SCATTER_OP):
        return None
    source = node[op.operands[0]]["op"]
    if len(source.types) != 1 or source.types[0].dtype != op.types[0].dtype:
        return None
    (inp,), (out,) = source.types, op.types
    # collectives on dim 0: the gathered (or reduced) tensor is the ranks' chunks one after another
    if not inp.shape or inp.numel is None or out.numel is None or inp.shape[1:] != out.shape[1:]:
        return None
    if kind == "gather":
        if out.numel != ranks * inp.numel:
            return None
        cast = source.name if isinstance(source, Cast) and [u for u, e in succ[source.name].items()
                                                            if e["kind"] == DATA] == [op.name] else None
        return Member(op.name, users[0], source.name, cast, inp.numel, out.nbytes, out.shape)
    if inp.numel != ranks * out.numel or op.reduce_op is None:
        return None
    return Member(op.name, users[0], source.name, None, out.numel, inp.nbytes, out.shape)


# ---- the rewrite -------------------------------------------------------------------------

def merge(program: Program, members: list[Member], kind: str, name: str, rewriter=None) -> list[str]:
    """Replace `members` by one bucket named `name`; returns the created ops' names. Raises
    RewriteError where the bucket would cross an effect edge: check first with a `DryRun` as
    the rewriter (which changes nothing), as the program is half rewritten when it raises."""
    rewriter = rewriter or Rewriter(program)
    if kind == "gather":
        created = _merge_gathers(program, rewriter, members, name)
    else:
        created = _merge_reduce_scatters(program, rewriter, members, name)
    for m in members:
        rewriter.erase(m.wait)
        rewriter.erase(m.launch)
    return created


def _merge_gathers(program: Program, rw: Rewriter, members: list[Member], name: str) -> list[str]:
    first = program.op(members[0].launch)
    phase = first.phase
    skip = {n for m in members for n in (m.launch, m.wait)}
    # every member's shard (or its private cast) is ready where the first member launches
    for m in members[1:]:
        if m.cast is not None:
            rw.hoist(m.cast, before=first.name)
    flats = [flat_source(program, rw, m.source, f"{name}_in{i}", phase, before=first.name)
             for i, m in enumerate(members)]
    here = min((m.wait for m in members), key=program.schedule.index)
    wait_op = program.op(here)
    (pack, pack_call), (launch, launch_call), (wait, wait_call), (grid, grid_call) = gather_bucket_ops(
        name, first, wait_op, flats, sum(m.numel for m in members), sum(m.nbytes for m in members),
        tuple(p for m in members for p in program.op(m.launch).params))
    rw.create(pack, before=first.name, payload=pack_call)
    rw.create(launch, before=first.name, payload=launch_call)
    for m in members:
        rw.inherit(m.launch, launch.name, skip=skip)
    # the copy-outs of every member follow the bucket's one wait
    rw.create(wait, before=here, payload=wait_call)
    rw.create(grid, before=here, payload=grid_call)
    sources = {m.source for m in members}
    created = [*(f for f in flats if f not in sources), pack.name, launch.name, wait.name,
               grid.name]
    offset = 0
    for i, m in enumerate(members):
        band, copy, flat = (rw.create(op, before=here, payload=payload)
                            for op, payload in member_outputs(name, i, m, offset, wait_op.phase,
                                                              first.types[0].dtype, first.group_size))
        rw.inherit(m.wait, flat.name, skip=skip)
        rw.replace_uses(m.wait, flat.name)
        created += [band.name, copy.name, flat.name]
        offset += m.numel
    return created


def gather_bucket_ops(name: str, first: Launch, wait_op: Wait, sources: list[str], total: int, nbytes: int,
                      params: tuple) -> list[tuple]:
    """A gather bucket's own ops, each with its payload: the pack of `sources` (`total` elements)
    and the launch, made before its first member's launch `first`; the wait and the grid (the
    gathered buffer viewed as [ranks, total]), made before the wait `wait_op`."""
    ranks, dtype, phase = first.group_size, first.types[0].dtype, first.phase
    pack = _compute(f"{name}_pack", sources, phase, TensorType(dtype, (total,)), "aten.cat.default")
    launch = Launch(name=name, operands=(pack.name,), phase=phase, target=first.target,
                    types=(TensorType(dtype, (ranks * total,)),), group=first.group, group_size=ranks,
                    role=first.role, nbytes=nbytes, params=params, bucket=name, prefetched=first.prefetched,
                    anchor=first.anchor)
    wait = _wait_op(launch, wait_op)
    grid = View(name=f"{name}_grid", operands=(wait[0].name,), phase=wait_op.phase, target="aten.view.default",
                types=(TensorType(dtype, (ranks, total)),))
    return [(pack, Call("aten.cat.default", ([Operand(i) for i in range(len(sources))],))),
            (launch, Call(first.target, (Operand(0), ranks, first.group))),
            wait,
            (grid, Call("aten.view.default", (Operand(0), [ranks, total])))]


def member_outputs(name: str, i: int, m: Member, offset: int, phase: Phase, dtype, ranks: int) -> list[tuple]:
    """Member i's ops after the bucket's wait, each with its payload: its band of the grid
    (columns `offset` on), the copy-out of that band and the view of it as the member's result."""
    # clone keeps the strides of a dense input only: a column band is not dense, so the copy is
    # contiguous (rank-major, as the member's own gather) and views as flat
    band = View(name=f"{name}_band{i}", operands=(f"{name}_grid",), phase=phase, target="aten.slice.Tensor",
                types=(TensorType(dtype, (ranks, m.numel)),))
    copy = CopyOut(name=f"{name}_copy{i}", operands=(band.name,), phase=phase, target="aten.clone.default",
                   bucket=name, types=(TensorType(dtype, (ranks, m.numel)),))
    out = View(name=f"{name}_out{i}", operands=(copy.name,), phase=phase, target="aten.view.default",
               types=(TensorType(dtype, m.shape),))
    return [(band, Call("aten.slice.Tensor", (Operand(0), 1, offset, offset + m.numel))),
            (copy, Call("aten.clone.default", (Operand(0),))),
            (out, Call("aten.view.default", (Operand(0), list(m.shape))))]


def _merge_reduce_scatters(program: Program, rw: Rewriter, members: list[Member], name: str) -> list[str]:
    pos = program.schedule.index
    last = program.op(max((m.launch for m in members), key=pos))
    ranks, dtype, phase = last.group_size, last.types[0].dtype, last.phase
    total = sum(m.numel for m in members)
    skip = {n for m in members for n in (m.launch, m.wait)}
    created = []
    rows = []
    for i, m in enumerate(members):
        # reshape: a gradient that is not contiguous is copied (never wrongly viewed)
        row = rw.create(View(name=f"{name}_rows{i}", operands=(m.source,), phase=phase, target="aten.reshape.default",
                             types=(TensorType(dtype, (ranks, m.numel)),)),
                        before=last.name, payload=Call("aten.reshape.default", (Operand(0), [ranks, m.numel])))
        rows.append(row.name)
    # row r of the pack: every member's chunk for rank r, in member order
    pack = rw.create(_compute(f"{name}_pack", rows, phase, TensorType(dtype, (ranks, total)), "aten.cat.default"),
                     before=last.name,
                     payload=Call("aten.cat.default", ([Operand(i) for i in range(len(rows))], 1)))
    flat = rw.create(View(name=f"{name}_flat", operands=(pack.name,), phase=phase, target="aten.view.default",
                          types=(TensorType(dtype, (ranks * total,)),)),
                     before=last.name, payload=Call("aten.view.default", (Operand(0), [ranks * total])))
    launch = rw.create(Launch(name=name, operands=(flat.name,), phase=phase, target=last.target,
                              types=(TensorType(dtype, (total,)),), group=last.group, group_size=ranks,
                              role=last.role, reduce_op=last.reduce_op, bucket=name,
                              params=tuple(p for m in members for p in program.op(m.launch).params)),
                       before=last.name, payload=Call(last.target, (Operand(0), last.reduce_op, ranks, last.group)))
    created += [*rows, pack.name, flat.name, launch.name]
    for m in members:
        rw.inherit(m.launch, launch.name, skip=skip)
    here, wait_op, wait = _wait(program, rw, members, launch)
    created.append(wait.name)
    offset = 0
    for i, m in enumerate(members):
        out = rw.create(View(name=f"{name}_out{i}", operands=(wait.name,), phase=wait_op.phase,
                             target="aten.slice.Tensor", types=(TensorType(dtype, (m.numel,)),)),
                        before=here, payload=Call("aten.slice.Tensor", (Operand(0), 0, offset, offset + m.numel)))
        created.append(out.name)
        if len(m.shape) != 1:  # a contiguous slice: it views as the member's own result
            out = rw.create(View(name=f"{name}_shape{i}", operands=(out.name,), phase=wait_op.phase,
                                 target="aten.view.default", types=(TensorType(dtype, m.shape),)),
                            before=here, payload=Call("aten.view.default", (Operand(0), list(m.shape))))
            created.append(out.name)
        rw.inherit(m.wait, out.name, skip=skip)
        rw.replace_uses(m.wait, out.name)
        offset += m.numel
    return created


def _wait(program: Program, rw: Rewriter, members: list[Member], launch: Launch) -> tuple[str, Wait, Wait]:
    """The bucket's one wait, created where its first member was waited: (that member's wait,
    its op, the new wait). What the members' waits returned is rebuilt just after it."""
    here = min((m.wait for m in members), key=program.schedule.index)
    wait_op = program.op(here)
    wait, payload = _wait_op(launch, wait_op)
    return here, wait_op, rw.create(wait, before=here, payload=payload)


def _wait_op(launch: Launch, wait_op: Wait) -> tuple[Wait, Call]:
    """The wait of a bucket's `launch`, as its member's `wait_op` (where it is made), with its payload."""
    return (Wait(name=f"{launch.name}_wait", operands=(launch.name,), phase=wait_op.phase, target=wait_op.target,
                 types=launch.types),
            Call(wait_op.target, (Operand(0),)))


def flat_source(program: Program, rw: Rewriter, source: str, name: str, phase: Phase, *, before: str) -> str:
    """`source` as a flat tensor: itself when it is one, else a reshape of it (a view when it is
    contiguous, a copy when not: never a wrong view)."""
    (t,) = program.op(source).types
    if len(t.shape) == 1:
        return source
    rw.create(View(name=name, operands=(source,), phase=phase, target="aten.reshape.default",
                   types=(TensorType(t.dtype, (t.numel,)),)),
              before=before, payload=Call("aten.reshape.default", (Operand(0), [t.numel])))
    return name


def _compute(name: str, operands: list[str], phase: Phase, type_: TensorType, target: str) -> Compute:
    return Compute(name=name, operands=tuple(operands), phase=phase, types=(type_,), target=target)
