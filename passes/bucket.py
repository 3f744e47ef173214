"""bucket: merges gathers launched close together on one stream into one collective, and likewise gradient reduce-scatters.

Members: launches of one stream (process group and size), phase and kind (forward gathers,
re-gathers, or reduce-scatters of one reduce op) and dtype, in schedule order; buckets made by
an FSDP pass (a launch with a `bucket`) are kept as they are and never merged. A gather bucket
launches where its first member did, a reduce-scatter bucket where its last did; one wait goes
where the first member was waited (for reduce-scatters, the first waited after the bucket
launches), and its copy-outs (gathers) or slices (reduce-scatters)
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
passes/bucket_trials.py; how a bucket is built (a pack, one collective, a copy-out or slice per
member) is passes/bucket_merge.py; this file is the pass: its options, the candidates and the
greedy choice of buckets.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import attrs

from ..cost.model import CostAnalysis
from ..cost.simulate import simulate
from ..ir import DATA, Cast, Launch, Program, Role, Wait, holds
from ..ir.holds import OVER_PEAK_CAP, SAVES_TOO_LITTLE, register_hold
from ..ir.rewriter import RewriteError
from .base import ModulePass, PassContext, PassResult, check_budget, check_ms, option, register_pass
from .bucket_merge import GATHER_OP, REDUCE_SCATTER_OP, WAIT_OP, Member, merge
from .bucket_trials import Trial, Trials, settle
from .memory_cap import GIB, MemoryAnalysis, cap_bytes, rewrite_cap, rewrite_stats


MIB = 1 << 20

EFFECT_EDGE = register_hold("bucket effect edge", "bucket: joining the bucket before it would move its launch or "
                                                  "wait across an effect edge (a free, a barrier, the phase "
                                                  "boundary, or its input is not ready where the bucket launches)")
OVER_SIZE = register_hold("over bucket size", "bucket: the bucket before it would grow past max-bucket-mb")
NOT_PACKABLE = register_hold("not packable", "bucket: its shard and result are not flat tensors of known size "
                                             "(or not a functional all-gather / reduce-scatter with one wait)")



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
        analysis = ctx.get(CostAnalysis, program)
        costs = dict(analysis.ms)   # and the new ops', as buckets are made
        profile = ctx.get(MemoryAnalysis, program).profile  # (the program's until a bucket is made)
        before = simulate(program, costs=costs, profile=profile)
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
                trials = Trials(program, costs, analysis.model, None if bought else profile)
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
                        trial, best = settle(trial, best, inflight_cap, self.min_saved_ms)
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
