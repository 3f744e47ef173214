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
and its peak is its change to the live-bytes curve in a max tree. A gather bucket grows a
member at a time (`_GatherGrowth`): each member's checks, ops, prices and changes to the curve
are made once, when it joins, so a trial costs its stretch and the bucket's own ops, not a plan
of every member; the bucket taken is planned whole once and merged once. This chooses what
merging on a copy and simulating the whole program per trial chose (tests/test_pass_bucket.py
checks it). What is left is the stretch: a bucket of K members simulates its stretch K times
(the stretch grows with K), and where gathers are launched long before their waits (the
generated graphs prefetch the whole forward), each trial's stretch is that long.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import attrs

from ..cost.model import CostAnalysis, Roofline, is_zero_cost
from ..cost.simulate import OTHER, MemoryProfile, Sweep, alloc_bytes, memory_profile, simulate, step_of, steps_of
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

    def grow(self, first: Member, kind: str, name: str):
        """Trials of the bucket that starts with `first`, each one member more than the one before."""
        return _GatherGrowth(self, first, name) if kind == "gather" else _Growth(self, first, kind, name)

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


class _Growth:
    """The trials of one bucket as it grows, each planned whole (`_Trials.evaluate`): reduce-scatter
    buckets, whose launch moves to their last member (every member's rows and the pack with it)."""

    def __init__(self, trials: _Trials, first: Member, kind: str, name: str):
        self.trials, self.members, self.kind, self.name = trials, [first], kind, name

    def evaluate(self, m: Member) -> Trial:
        """The bucket of the members so far and `m` (raises RewriteError where it would cross an
        effect edge); `m` stays in for the next trial (the caller stops growing at the first
        trial it refuses)."""
        self.members.append(m)
        return self.trials.evaluate(self.members, self.kind, self.name)

    def close(self, best: Trial | None, members: list[Member]) -> Trial | None:
        """Done growing: the tree shows `best` (the last trial taken; None: none) and it is returned,
        ready to be made."""
        self.trials.show(best.live if best else ())
        return best


class _GatherGrowth:
    """The trials of one gather bucket as it grows, a member at a time, without planning each
    trial whole: a member's rewriter checks, its ops (reshape into the pack, band, copy-out and
    view of the result), their prices and its changes to the live-bytes curve are made once, when
    it joins; each trial re-creates only the bucket's own ops (pack, launch, wait, grid) and simulates its
    stretch. (A member's checks see the members before it, and more members only skip more
    edges, so each check decides as it does in a whole plan.) So a trial costs
    its stretch and the steps at its two anchors, not a plan of every member. The checks, ops,
    steps and curve are those `merge` with a `DryRun` makes for the same members (`close` plans
    the bucket taken whole, with `_Trials.evaluate`, to make it); a member waited before the bucket's wait so far
    moves every copy-out, and is planned by building the growth again (ops priced at no time
    are left out of the steps: they step no clock)."""

    def __init__(self, trials: _Trials, first: Member, name: str):
        self.trials, self.name = trials, name
        self._build([first])

    def _build(self, members: list[Member]) -> None:
        trials, program = self.trials, self.trials.program
        self.program, self.slot = program, trials.slot
        self.first = first = program.op(members[0].launch)
        self.ranks, self.dtype, self.phase = first.group_size, first.types[0].dtype, first.phase
        self.here = min((m.wait for m in members), key=self.slot.__getitem__)
        self.wait_op = program.op(self.here)
        self.at, self.here_slot = self.slot[first.name], self.slot[self.here]
        self.dry = DryRun(program, trials.cache)
        self.members: list[Member] = []
        self.names: set[str] = set()       # members' launches and waits: what `inherit` skips
        self.skip: set[str] = set()        # and the hoisted casts: what the sweep skips
        self.cast_steps: list = []         # hoisted casts, stepped before the bucket's launch
        self.pack_steps: list = []         # reshapes into the pack that take time
        self.copy_steps: list = []         # bands, copy-outs and views after the wait that take time
        self.sources: list[str] = []       # the pack's operands
        self.params: tuple = ()
        self.total = self.nbytes = 0
        self.end = self.here_slot          # the last slot a trial touches
        self.member_live: list = []        # the members' changes to the live-bytes curve
        self.hoisted_bytes = self.unhoisted_bytes = 0
        self.bucket_live: list = []        # the bucket's own changes, as the tree holds them now
        self.applied: list = []            # members' changes the tree holds
        for m in members:
            self._add(m)

    def _add(self, m: Member) -> None:
        """`m` joins: the checks and ops `merge` makes for it, in the order it makes them."""
        dry, program, name, first, i = self.dry, self.program, self.name, self.first, len(self.members)
        if i and m.cast is not None:
            # (what it changes for the members before it: none of their launches or waits can
            # precede a cast hoisted before the first launch, or `hoist` refuses it)
            dry.hoist(m.cast, before=first.name)
        flat = _flat(program, dry, m.source, f"{name}_in{i}", self.phase, before=first.name)
        if flat == m.source:
            dry.check_operand(f"{name}_pack", m.source, first.name)
        self.names.update((m.launch, m.wait))
        self.sources.append(flat)
        self.params += program.op(m.launch).params
        offset = self.total
        self.total += m.numel
        self.nbytes += m.nbytes
        self._bucket_ops()
        dry.inherit(m.launch, name, skip=self.names)
        band, copy, out = (dry.create(op, before=self.here, payload=payload) for op, payload in
                           _member_outputs(name, i, m, offset, self.wait_op.phase, self.dtype, self.ranks))
        dry.inherit(m.wait, out.name, skip=self.names)
        dry.replace_uses(m.wait, out.name)
        # it joins: its steps and its changes to the curve
        trials, slot = self.trials, self.slot
        self.members.append(m)
        if m.cast in dry.hoisted:
            self.cast_steps.append((m.cast, trials.sweep.steps[m.cast]))
            self.skip.add(m.cast)
            self.end = max(self.end, slot[m.cast])
        self.skip.update((m.launch, m.wait))
        self.end = max(self.end, slot[m.launch], slot[m.wait])
        if flat != m.source:
            self.pack_steps += _timed(dry.ops[flat], trials, dry)
        for op in (band, copy, out):
            self.copy_steps += _timed(op, trials, dry)
        changes, hoisted, unhoisted = _gather_member_changes(
            m, alloc_bytes(copy), m.cast in dry.hoisted, self.at, self.here_slot, slot, trials.profile,
            trials.released)
        self.member_live += changes
        self.hoisted_bytes += hoisted
        self.unhoisted_bytes += unhoisted

    def _bucket_ops(self) -> None:
        """The bucket's own ops for the members so far (`_merge_gathers` and `_wait` make them so)."""
        dry, name, first, ranks, dtype = self.dry, self.name, self.first, self.ranks, self.dtype
        pack = _compute(f"{name}_pack", self.sources, self.phase, TensorType(dtype, (self.total,)), "aten.cat.default")
        launch = Launch(name=name, operands=(pack.name,), phase=self.phase, target=first.target,
                        types=(TensorType(dtype, (ranks * self.total,)),), group=first.group, group_size=ranks,
                        role=first.role, nbytes=self.nbytes, params=self.params, bucket=name,
                        prefetched=first.prefetched, anchor=first.anchor)
        wait = Wait(name=f"{name}_wait", operands=(name,), phase=self.wait_op.phase, target=self.wait_op.target,
                    types=launch.types)
        grid = View(name=f"{name}_grid", operands=(wait.name,), phase=self.wait_op.phase, target="aten.view.default",
                    types=(TensorType(dtype, (ranks, self.total)),))
        for op, anchor in ((pack, first.name), (launch, first.name), (wait, self.here), (grid, self.here)):
            dry.ops[op.name] = op
            dry.anchor[op.name] = anchor
        self.ops = (pack, launch, wait, grid)

    def evaluate(self, m: Member) -> Trial:
        """The bucket of the members so far and `m`; `m` stays in for the next trial (the caller
        stops growing at the first trial it refuses)."""
        if self.slot[m.wait] < self.here_slot:  # every copy-out moves: plan the members again
            self._take_back()
            self._build(self.members + [m])
        else:
            self._add(m)
        trials, name = self.trials, self.name
        pack, launch, wait, grid = self.ops
        costs = {op.name: trials._cost(op, self.dry) for op in self.ops}
        steps = {self.first.name: self.cast_steps + self.pack_steps
                 + _timed(pack, trials, self.dry, costs) + _timed(launch, trials, self.dry, costs),
                 self.here: _timed(wait, trials, self.dry, costs) + _timed(grid, trials, self.dry, costs)
                 + self.copy_steps}
        step_ms, _, inflight = trials.sweep.trial(self.at, self.end, self.skip, steps)
        # the curve: the new members' changes, and the bucket's own in place of the trial's before
        added = self.member_live[len(self.applied):]
        bucket_live = _gather_bucket_changes(alloc_bytes(pack), alloc_bytes(launch), self.hoisted_bytes,
                                             self.unhoisted_bytes, self.at, self.here_slot)
        self._show(added, +1)
        self._show(self.bucket_live, -1)
        self._show(bucket_live, +1)
        self.applied, self.bucket_live = self.member_live[:], bucket_live
        return Trial(None, costs, frozenset(), steps, (), step_ms, trials.tree.max(0, len(self.slot)), inflight)

    def _show(self, changes, sign: int) -> None:
        """Add (+1) or take back (-1) `changes` in the tree and in what it is said to show."""
        shown, tree = self.trials.shown, self.trials.tree
        for c in _kept(changes):
            tree.add(c[0], c[1], sign * c[2])
            shown[c] += sign

    def _take_back(self) -> None:
        self._show(self.applied, -1)
        self._show(self.bucket_live, -1)
        self.applied, self.bucket_live = [], []

    def close(self, best: Trial | None, members: list[Member]) -> Trial | None:
        """Done growing: the tree shows only the made buckets, and the bucket of `members` (when
        `best`, the last trial taken, is not None) is planned whole, shown and returned."""
        trials = self.trials
        trials.shown = +trials.shown
        trials.show(())
        if best is None:
            return None
        return trials.evaluate(members, "gather", self.name)


def _timed(op, trials: _Trials, plan: DryRun, costs: dict | None = None) -> list:
    """A new op's step, as the sweep steps it: none for an op that takes no time (it moves no clock)."""
    cost = costs[op.name] if costs is not None else trials._cost(op, plan)
    step = step_of(op, cost)
    return [] if step[0] == OTHER and cost == 0.0 else [(op.name, step)]


def _kept(changes):
    return [c for c in changes if c[0] < c[1] and c[2]]


def _gather_member_changes(m: Member, copy_bytes: int, hoisted: bool, at: int, here: int, slot: dict[str, int],
                           profile: MemoryProfile, released: dict[str, int]):
    """One gather member's part of `_live_changes`: (changes, its hoisted cast's bytes, its unhoisted one's)."""
    alloc, end = profile.alloc, len(slot) - 1
    until = released.get(m.launch, end)
    # its gathered buffer is gone; its copy-out lives as that buffer did, from the wait on
    changes = [(slot[m.launch], until + 1, -alloc.get(m.launch, 0)),
               (here, (here if until == slot[m.launch] else until) + 1, copy_bytes)]
    size = alloc.get(m.cast, 0) if m.cast is not None else 0
    if not size or m.cast not in released:
        return changes, 0, 0
    if hoisted:  # private casts: the pack reads them now and is their last reader
        changes.append((slot[m.cast], released[m.cast] + 1, -size))
        return changes, size, 0
    changes.append((at + 1, released[m.cast] + 1, -size))
    return changes, 0, size


def _gather_bucket_changes(pack: int, bucket: int, hoisted: int, unhoisted: int, at: int, here: int) -> list:
    """A gather bucket's own part of `_live_changes`: its pack and buffer (released after the last
    copy-out); in the launch's slot, the pack with the hoisted casts, or the launch once every cast
    is released (the bucket is at least the casts it packs)."""
    changes = [(at, at + 1, pack), (at, here + 1, bucket)]
    fix = min(bucket - hoisted, unhoisted)
    if fix > 0:
        changes.append((at, at + 1, -fix))
    return changes


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
    if kind == "gather":
        changes, hoisted, unhoisted = [], 0, 0
        for i, m in enumerate(members):
            part, h, u = _gather_member_changes(m, alloc_bytes(new[f"{name}_copy{i}"]), m.cast in plan.hoisted,
                                                at, here, slot, profile, released)
            changes += part
            hoisted, unhoisted = hoisted + h, unhoisted + u
        return _kept(changes + _gather_bucket_changes(pack, bucket, hoisted, unhoisted, at, here))
    # reduce-scatters: each member's reduced buffer is gone
    changes = [(at, at + 1, pack)]
    for m in members:
        changes.append((slot[m.launch], released.get(m.launch, end) + 1, -alloc.get(m.launch, 0)))
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
    return _kept(changes)


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
        for operand in op.operands:
            self.check_operand(op.name, operand, before)
        self.anchor[op.name] = before
        self.ops[op.name] = op
        self.before.setdefault(before, []).append((op, payload))
        return op

    def check_operand(self, name: str, operand: str, before: str) -> None:
        """What `create` checks of each operand of a new op `name` created before `before`."""
        if operand not in self.anchor and operand not in self.program.graph:
            raise RewriteError(f"create(%{name}): operand %{operand} is not defined")
        if operand in self.anchor and self.pos(self.anchor[operand]) > self.pos(before):
            raise RewriteError(f"create(%{name}): operand %{operand} is not scheduled before %{before}")
        if operand not in self.anchor and self._at(operand) >= self.pos(before):
            raise RewriteError(f"create(%{name}): operand %{operand} is not scheduled before %{before}")
        if operand not in self.anchor:  # a read of existing storage after a free of it
            for a in self._frees_of(operand):
                if self._at(a) < self.pos(before):
                    raise RewriteError(f"%{name} would read storage that %{a} frees before it")

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
        band, copy, flat = (rw.create(op, before=here, payload=payload)
                            for op, payload in _member_outputs(name, i, m, offset, wait_op.phase, dtype, ranks))
        rw.inherit(m.wait, flat.name, skip=skip)
        rw.replace_uses(m.wait, flat.name)
        created += [band.name, copy.name, flat.name]
        offset += m.numel
    return created


def _member_outputs(name: str, i: int, m: Member, offset: int, phase: Phase, dtype, ranks: int) -> list[tuple]:
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
