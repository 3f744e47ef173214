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

A trial rewrites nothing: a `DryRun` rewriter makes the rewriter's checks of the merge, the
simulator's time rules run only over the stretch of the schedule the bucket changes (from its
first member until the program runs as without it, only later: cost/simulate.py's `Sweep`),
and its peak is its change to the live-bytes curve in a max tree. The bucket taken is merged
once. This chooses what merging on a copy and simulating the whole program per trial chose
(tests/test_pass_bucket.py checks it), at a cost per trial of the members and the stretch, not
of the program; a bucket of K members is still tried K times over.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import attrs

from ..cost.model import CostAnalysis, Roofline, is_zero_cost
from ..cost.simulate import MemoryProfile, Sweep, alloc_bytes, memory_profile, simulate, step_of, steps_of
from ..ir import DATA, EFFECT, Cast, Compute, CopyOut, Free, Launch, Phase, Program, Role, TensorType, View, Wait, holds
from ..ir.effects import storage_readers, storage_root
from ..ir.holds import OVER_PEAK_CAP, SAVES_TOO_LITTLE, register_hold
from ..ir.rewriter import Call, Operand, RewriteError, Rewriter
from .base import ModulePass, PassContext, PassResult, check_budget, check_ms, option, register_pass
from .maxtree import MaxTree
from .memory_cap import GIB, cap_bytes, rewrite_cap, rewrite_stats

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
                trials = _Trials(program, costs, analysis.model)
                start = 0
                while start < len(run):
                    members, best, end = [run[start]], None, start + 1
                    while end < len(run):
                        trial_members = members + [run[end]]
                        if sum(m.nbytes for m in trial_members) > self.max_bucket_mb * MIB:
                            held[run[end].launch] = OVER_SIZE
                            break
                        try:
                            trial = trials.evaluate(trial_members, kind, names.fresh(kind))
                        except RewriteError:
                            held[run[end].launch] = EFFECT_EDGE
                            break
                        reason = self.refusal(trial, best, cap, inflight_cap)
                        if reason is not None:
                            held[run[end].launch] = reason
                            trials.show(best.live if best else ())
                            break
                        members, best = trial_members, trial
                        end += 1
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


# ---- trials ------------------------------------------------------------------------------

@attrs.frozen
class Trial:
    """A bucket tried on the program as it is: what it changes (`plan`, the new ops' `costs`,
    its `skip`ped names and new `steps` for the sweep, its `live` changes for the tree) and what
    it does: the change of the simulated step, the simulated peak, the most gathered bytes in
    flight while it runs differently."""

    plan: DryRun
    costs: dict
    skip: frozenset
    steps: dict
    live: tuple
    step_ms: float
    peak_bytes: int
    inflight_bytes: int


class _Trials:
    """Tries buckets of one run on the program: `evaluate` without rewriting it, `make` after
    the bucket was merged. Each trial is simulated only from its first member until the program
    runs as without it again (cost/simulate.py's Sweep; the runs before are stepped once), and its
    peak is its change to the live-bytes curve in a max tree, so a trial costs what it touches."""

    def __init__(self, program: Program, costs: dict, model):
        self.program, self.costs, self.model = program, costs, model
        order = program.schedule.names()
        self.slot = {n: i for i, n in enumerate(order)}
        self.sweep = Sweep(order, steps_of(program, costs))
        self.profile = profile = memory_profile(program)
        self.tree = MaxTree.of(list(profile.live))
        self.released = {buf: i for i, bufs in profile.releases.items() for buf in bufs}
        self.first_free: dict[str, int] = {}  # storage root -> the slot of its first free
        nodes = program.graph.nodes
        for i, n in enumerate(order):
            op = nodes[n]["op"]
            if isinstance(op, Free) and op.operands:
                self.first_free.setdefault(profile.root.get(op.operands[0], op.operands[0]), i)
        self.peak_without = self.tree.max(0, len(order))
        self.cache: dict = {}
        self.op_ms: dict = {}
        self.shown: Counter = Counter()  # the changes of the trial the tree holds on top of the made buckets
        self.scratch = Program()

    def evaluate(self, members: list[Member], kind: str, name: str) -> Trial:
        program, slot = self.program, self.slot
        plan = DryRun(program, self.cache)
        merge(program, members, kind, name, plan)  # raises RewriteError where it would
        costs = {name: self._cost(op, plan) for name, op in plan.ops.items()}
        skip = frozenset({n for m in members for n in (m.launch, m.wait)} | set(plan.hoisted))
        steps: dict[str, list] = {}
        for cast, anchor in plan.hoisted.items():
            steps.setdefault(anchor, []).append((cast, self.sweep.steps[cast]))
        for anchor, ops in plan.before.items():
            steps.setdefault(anchor, []).extend((op.name, step_of(op, costs[op.name])) for op, _ in ops)
        touched = [slot[n] for n in skip | set(plan.before)]
        step_ms, _, inflight = self.sweep.trial(min(touched), max(touched), skip, steps)
        live = tuple(_live_changes(kind, plan, members, name, slot, self.profile, self.released,
                                   self.first_free))
        self.show(live)
        return Trial(plan, costs, skip, steps, live, step_ms, self.tree.max(0, len(slot)), inflight)

    def show(self, live) -> None:
        """Make the tree hold the made buckets and `live` (a trial's changes): only what differs
        from the trial shown before is added or taken back (a growing bucket adds a member)."""
        new = Counter(live)
        for (lo, hi, nbytes), k in (new - self.shown).items():
            self.tree.add(lo, hi, nbytes * k)
        for (lo, hi, nbytes), k in (self.shown - new).items():
            self.tree.add(lo, hi, -nbytes * k)
        self.shown = new

    def _cost(self, op, plan: DryRun) -> float:
        """The cost model's price of a new op (the same op is priced once per run: a growing
        bucket re-creates its members' copy-outs as they were)."""
        if is_zero_cost(op) and type(self.model) is Roofline:  # views and waits: most new ops
            return 0.0
        operands = [plan.ops.get(o) or self.program.op(o) for o in op.operands]
        key = (op, tuple(o.types for o in operands))  # what the model reads of the operands: their types
        cost = self.op_ms.get(key)
        if cost is None:
            nodes = self.scratch.graph._node
            for operand in operands:
                nodes[operand.name] = {"op": operand}
            nodes[op.name] = {"op": op}
            cost = self.op_ms[key] = self.model.op_ms(op, self.scratch)
        return cost

    def make(self, trial: Trial) -> None:
        """The bucket `trial` (the one shown) is made."""
        self.show(trial.live)
        self.shown = Counter()
        self.sweep.make(set(trial.skip), trial.steps)
        self.costs.update(trial.costs)
        self.peak_without = trial.peak_bytes


def _live_changes(kind: str, plan: DryRun, members: list[Member], name: str, slot: dict[str, int],
                  profile: MemoryProfile, released: dict[str, int], first_free: dict[str, int]):
    """How merging `members` changes the live bytes (as `memory_profile` counts them) at each
    slot of the schedule: (lo, hi, bytes) added over slots [lo, hi). New ops share the slot of
    the op they are created before; where several allocate and release in one slot, the change
    there is what makes the slot's largest value right. (An erased op's slot keeps the bytes
    live just before it, which the next op's slot has too.)"""
    alloc, end = profile.alloc, len(slot) - 1
    new = plan.ops
    pack, bucket = alloc_bytes(new[f"{name}_pack"]), alloc_bytes(new[name])
    at = slot[plan.anchor[name]]             # where the bucket launches (pack, launch)
    here = slot[plan.anchor[f"{name}_wait"]]  # where it is waited (copy-outs or slices)
    changes = [(at, at + 1, pack)]
    for m in members:  # each member's gathered or reduced buffer is gone
        changes.append((slot[m.launch], released.get(m.launch, end) + 1, -alloc.get(m.launch, 0)))
    if kind == "gather":
        changes.append((at, here + 1, bucket))  # released after the last copy-out
        for i, m in enumerate(members):  # a copy-out lives as its member's buffer did, from the wait on
            until = released.get(m.launch, end)
            changes.append((here, (here if until == slot[m.launch] else until) + 1,
                            alloc_bytes(new[f"{name}_copy{i}"])))
        hoisted = unhoisted = 0  # private casts: the pack reads them now and is their last reader
        for m in members:
            size = alloc.get(m.cast, 0) if m.cast is not None else 0
            if not size or m.cast not in released:
                continue
            if m.cast in plan.hoisted:
                changes.append((slot[m.cast], released[m.cast] + 1, -size))
                hoisted += size
            else:
                changes.append((at + 1, released[m.cast] + 1, -size))
                unhoisted += size
        # in the launch's slot: the pack with the hoisted casts, or the launch once every cast is
        # released (the bucket is at least the casts it packs)
        fix = min(bucket - hoisted, unhoisted)
    else:
        frees = [first_free[m.launch] for m in members if m.launch in first_free]
        until = min(frees) if frees else max(released.get(m.launch, end) for m in members)
        changes.append((at, until + 1, bucket))
        read_here, seen = 0, set()  # gradients: the pack, here, is their last reader if none is later
        for m in members:
            root = profile.root.get(m.source, m.source)
            size = alloc.get(root, 0)
            if root in seen or not size or root not in released:
                continue
            seen.add(root)
            if released[root] < at:
                changes.append((released[root] + 1, at + 1, size))
            if released[root] <= at:
                read_here += size
        fix = min(bucket, read_here)  # released after the pack, before the launch allocates
    if fix > 0:
        changes.append((at, at + 1, -fix))
    return [c for c in changes if c[0] < c[1] and c[2]]


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


class DryRun:
    """The rewriter's checks of a merge without the rewrite: what `merge` would create (`before`:
    anchor -> [op], in order), hoist and erase, raising RewriteError where the rewriter would.

    New ops sit just before an existing anchor, so an existing op is before a new one exactly
    when it is before its anchor; a hoisted op sits before them all."""

    def __init__(self, program: Program, cache: dict | None = None):
        self.program = program
        self.pos = program.schedule.index
        # storage roots and readers of existing ops, shared by the trials of one run (the ops a
        # trial reads are its members', which no other bucket of the run touches)
        self.cache = {} if cache is None else cache
        self.anchor: dict[str, str] = {}           # new op -> the existing op it is created before
        self.before: dict[str, list] = {}          # anchor -> [(op, payload)]
        self.hoisted: dict[str, str] = {}          # op -> the anchor it moves before
        self.erased: list[str] = []
        self.ops: dict[str, object] = {}           # new op name -> op
        self.readers: dict[str, tuple] = {}        # new storage -> (first free, last other read) of it

    def _at(self, name: str) -> float:
        """A position to compare with an existing op's: a new or hoisted op's is just before its anchor."""
        if name in self.anchor:
            return self.pos(self.anchor[name]) - 0.5
        if name in self.hoisted:
            return self.pos(self.hoisted[name]) - 0.75
        return self.pos(name)

    def create(self, op, *, before: str, payload=None):
        program = self.program
        for operand in op.operands:
            if operand not in self.anchor and operand not in program.graph:
                raise RewriteError(f"create(%{op.name}): operand %{operand} is not defined")
            if operand in self.anchor and self.pos(self.anchor[operand]) > self.pos(before):
                raise RewriteError(f"create(%{op.name}): operand %{operand} is not scheduled before %{before}")
            if operand not in self.anchor and self._at(operand) >= self.pos(before):
                raise RewriteError(f"create(%{op.name}): operand %{operand} is not scheduled before %{before}")
            if operand not in self.anchor:  # a read of existing storage after a free of it
                for a in self._frees_of(operand):
                    if self._at(a) < self.pos(before):
                        raise RewriteError(f"%{op.name} would read storage that %{a} frees before it")
        self.anchor[op.name] = before
        self.ops[op.name] = op
        self.before.setdefault(before, []).append((op, payload))
        return op

    def hoist(self, name: str, *, before: str) -> None:
        program = self.program
        if not program.op(name).MOVABLE:
            raise RewriteError(f"hoist(%{name}): {program.op(name).KIND} ops do not move")
        if self.pos(name) < self.pos(before):
            return
        for p, e in program.graph._pred[name].items():
            if self._at(p) >= self.pos(before):
                raise RewriteError(f"hoist(%{name}) before %{before}: it follows %{p}")
        self.hoisted[name] = before

    def inherit(self, old: str, new: str, *, skip=frozenset()) -> None:
        graph, at = self.program.graph, self._at(new)
        for p, e in graph._pred[old].items():
            if e["kind"] == EFFECT and p not in skip and p != new and self._at(p) >= at:
                raise RewriteError(f"%{new} would run before %{p}, which %{old} follows ({e['why']})")
        for s_, e in graph._succ[old].items():
            if e["kind"] == EFFECT and s_ not in skip and s_ != new and self._at(s_) <= at:
                raise RewriteError(f"%{new} would run after %{s_}, which follows %{old} ({e['why']})")

    def replace_uses(self, old: str, new: str) -> None:
        """The users of `old` read `new`: they come after it, and no free of `new`'s storage (a
        free of any storage that now is `new`'s) comes before another of its readers."""
        program = self.program
        at = self._at(new)
        key = ("users", old)
        if key not in self.cache:
            self.cache[key] = program.users(old)
        for user in self.cache[key]:
            if at >= self.pos(user):
                raise RewriteError(f"replace_uses(%{old}, %{new}): %{new} is not scheduled before %{user}")
        root = new
        while root in self.ops and isinstance(self.ops[root], (View, Wait)) and self.ops[root].operands:
            root = self.ops[root].operands[0]
        first_free, last_read = self.readers.get(root, (math.inf, -math.inf))
        for a in self._readers(old):
            if isinstance(program.op(a), Free):
                first_free = min(first_free, self.pos(a))
            else:
                last_read = max(last_read, self.pos(a))
        self.readers[root] = (first_free, last_read)
        if first_free < last_read:
            raise RewriteError(f"a reader of %{new} would follow a free of its storage")

    def erase(self, name: str) -> None:
        self.erased.append(name)

    def _readers(self, name: str) -> set[str]:
        key = ("readers", name)
        if key not in self.cache:
            self.cache[key] = storage_readers(self.program, name)
        return self.cache[key]

    def _frees_of(self, name: str) -> list[str]:
        """The frees of `name`'s storage."""
        key = ("frees", name)
        if key not in self.cache:
            program = self.program
            root = storage_root(program, name)
            self.cache[key] = [a for a in storage_readers(program, root)
                               if isinstance(program.op(a), Free) and _frees(program, a, root)]
        return self.cache[key]


def _frees(program: Program, name: str, root: str) -> bool:
    op = program.op(name)
    return bool(op.operands) and storage_root(program, op.operands[0]) == root


def _merge_gathers(program: Program, rw: Rewriter, members: list[Member], name: str) -> list[str]:
    first = program.op(members[0].launch)
    ranks, dtype, phase = first.group_size, first.types[0].dtype, first.phase
    total = sum(m.numel for m in members)
    skip = {n for m in members for n in (m.launch, m.wait)}
    # every member's shard (or its private cast) is ready where the first member launches
    for m in members[1:]:
        if m.cast is not None:
            rw.hoist(m.cast, before=first.name)
    flats = [_flat(program, rw, m.source, f"{name}_in{i}", phase, before=first.name) for i, m in enumerate(members)]
    pack = rw.create(_compute(f"{name}_pack", flats, phase, TensorType(dtype, (total,)), "aten.cat.default"),
                     before=first.name,
                     payload=Call("aten.cat.default", ([Operand(i) for i in range(len(members))],)))
    launch = rw.create(Launch(name=name, operands=(pack.name,), phase=phase, target=first.target,
                              types=(TensorType(dtype, (ranks * total,)),), group=first.group, group_size=ranks,
                              role=first.role, nbytes=sum(m.nbytes for m in members),
                              params=tuple(p for m in members for p in program.op(m.launch).params),
                              bucket=name, prefetched=first.prefetched, anchor=first.anchor),
                       before=first.name, payload=Call(first.target, (Operand(0), ranks, first.group)))
    for m in members:
        rw.inherit(m.launch, launch.name, skip=skip)
    # the copy-outs of every member follow the bucket's one wait
    here, wait_op, wait = _wait(program, rw, members, launch)
    grid = rw.create(View(name=f"{name}_grid", operands=(wait.name,), phase=wait_op.phase, target="aten.view.default",
                          types=(TensorType(dtype, (ranks, total)),)),
                     before=here, payload=Call("aten.view.default", (Operand(0), [ranks, total])))
    sources = {m.source for m in members}
    created = [*(f for f in flats if f not in sources), pack.name, launch.name, wait.name,
               grid.name]
    offset = 0
    for i, m in enumerate(members):
        band = rw.create(View(name=f"{name}_band{i}", operands=(grid.name,), phase=wait_op.phase,
                              target="aten.slice.Tensor", types=(TensorType(dtype, (ranks, m.numel)),)),
                         before=here, payload=Call("aten.slice.Tensor", (Operand(0), 1, offset, offset + m.numel)))
        # clone keeps the strides of a dense input only: a column band is not dense, so the
        # copy is contiguous (rank-major, as the member's own gather) and views as flat
        copy = rw.create(CopyOut(name=f"{name}_copy{i}", operands=(band.name,), phase=wait_op.phase,
                                 target="aten.clone.default", bucket=name,
                                 types=(TensorType(dtype, (ranks, m.numel)),)),
                         before=here, payload=Call("aten.clone.default", (Operand(0),)))
        flat = rw.create(View(name=f"{name}_out{i}", operands=(copy.name,), phase=wait_op.phase,
                              target="aten.view.default", types=(TensorType(dtype, m.shape),)),
                         before=here, payload=Call("aten.view.default", (Operand(0), list(m.shape))))
        rw.inherit(m.wait, flat.name, skip=skip)
        rw.replace_uses(m.wait, flat.name)
        created += [band.name, copy.name, flat.name]
        offset += m.numel
    return created


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
    wait = rw.create(Wait(name=f"{launch.name}_wait", operands=(launch.name,), phase=wait_op.phase,
                          target=wait_op.target, types=launch.types),
                     before=here, payload=Call(wait_op.target, (Operand(0),)))
    return here, wait_op, wait


def _flat(program: Program, rw: Rewriter, source: str, name: str, phase: Phase, *, before: str) -> str:
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
