"""bucket_trials: what a candidate bucket would do, priced without rewriting the program.

The `bucket` pass (passes/bucket.py) grows each bucket while the simulated step gets shorter
within its caps; this file answers, for a bucket it considers, the rewriter's checks of the
merge, the change of the simulated step, the simulated peak and the most gathered bytes in
flight, without merging anything.

A trial rewrites nothing: a `DryRun` rewriter makes the rewriter's checks of the merge, the
simulator's time rules run only over the stretch of the schedule the bucket changes (from its
first member until the program runs as without it, only later: cost/simulate.py's `Sweep`),
and its peak is its change to the live-bytes curve in a max tree. A gather bucket grows a
member at a time (`_GatherGrowth`): each member's checks, ops, prices and changes to the curve
are made once, when it joins, so a trial costs its stretch and the bucket's own ops, not a plan
of every member; the bucket taken is planned whole once and merged once. This chooses what
merging on a copy and simulating the whole program per trial chose (tests/test_pass_bucket.py
checks it). The step of a trial is passes/bucket_sweep.py's (`_SharedBaseSweep`), its merge checks
passes/bucket_dryrun.py's (`DryRun`).
"""

from __future__ import annotations

from collections import Counter

import attrs

from ..cost.model import Roofline, is_zero_cost
from ..cost.simulate import (OTHER, MemoryProfile, alloc_bytes, keeper_slots, last_kept, memory_profile, op_getter,
                             step_of, steps_of)
from ..ir import Free, Program
from .bucket_dryrun import DryRun
from .bucket_merge import Member, flat_source, gather_bucket_ops, member_outputs, merge
from .bucket_sweep import _SharedBaseSweep
from .maxtree import MaxTree


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
    #: the sweep's exact figures (step, in flight) for this trial, where `step_ms` and
    #: `inflight_bytes` are the fast path's (see `_SharedBaseSweep.quick`); None: they are exact
    exact: object = attrs.field(default=None, eq=False, repr=False)

    def exactly(self) -> Trial:
        """This trial with the sweep's exact figures (itself when it has them)."""
        if self.exact is None:
            return self
        step_ms, inflight = self.exact()
        return attrs.evolve(self, step_ms=step_ms, inflight_bytes=inflight, exact=None)


#: where a fast figure is this close to what decides (ms), the exact one decides
NEAR_MS = 1e-6


def settle(trial: Trial, best: Trial | None, inflight_cap: float, margin: float) -> tuple[Trial, Trial | None]:
    """`trial` and `best` (the bucket before it) with exact figures wherever a fast one could
    decide differently from the exact one: its in-flight bound over the cap, or its step within
    NEAR_MS of the step it must beat (`best`'s, less `margin`; 0 without a best). The fast step
    is within ~1e-9 ms of the exact one (`_SharedBaseSweep.quick`), so elsewhere both decide alike."""
    if trial.inflight_bytes > inflight_cap:
        trial = trial.exactly()
    if abs(trial.step_ms - ((best.step_ms if best else 0.0) - margin)) <= NEAR_MS:
        trial = trial.exactly()
        best = best.exactly() if best is not None else None
    return trial, best


class Trials:
    """Tries buckets of one run on the program: `evaluate` without rewriting it, `make` after
    the bucket was merged. Each trial is simulated only from its first member until the program
    runs as without it again (cost/simulate.py's Sweep; the runs before are stepped once), and its
    peak is its change to the live-bytes curve in a max tree, so a trial costs what it touches."""

    def __init__(self, program: Program, costs: dict, model, profile: MemoryProfile | None = None):
        self.program, self.costs, self.model = program, costs, model
        order = program.schedule.names()
        self.slot = {n: i for i, n in enumerate(order)}
        self.sweep = _SharedBaseSweep(order, steps_of(program, costs))
        if profile is None or profile.order != tuple(order):  # (the program's, where the caller has it)
            profile = memory_profile(program)
        self.profile = profile
        self.tree = MaxTree.of(list(profile.live))
        self.released = {buf: i for i, bufs in profile.releases.items() for buf in bufs}
        self.kept = keeper_slots(profile, op_getter(program))  # storage -> its keepers' slots
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

    def evaluate(self, members: list[Member], kind: str, name: str, known: Trial | None = None) -> Trial:
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
        if known is None:
            step_ms, inflight, exact = self.run(min(touched), max(touched), skip, steps)
        else:  # the growth tried this very bucket last (the same stretch, skips and steps)
            step_ms, inflight, exact = known.step_ms, known.inflight_bytes, known.exact
        live = tuple(_live_changes(kind, plan, members, name, slot, self.profile, self.released,
                                   self.first_free, self.kept))
        self.show(live)
        return Trial(plan, costs, skip, steps, live, step_ms, self.tree.max(0, len(slot)), inflight, exact)

    def run(self, at: int, end: int, skip, steps: dict) -> tuple[float, int, object]:
        """(step change, gathered bytes in flight, the exact figures' callable or None) of a
        trial: the sweep's quick figures where it has them, else its exact ones."""
        sweep = self.sweep
        quick = sweep.quick(at, end, skip, steps)
        if quick is None:
            step_ms, _, inflight = sweep.trial(at, end, skip, steps)
            return step_ms, inflight, None
        skip = frozenset(skip)  # (a growing bucket's skips grow on)

        def exact():
            step, _, high = sweep.trial(at, end, skip, steps)
            return step, high
        return quick[0], quick[1], exact

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
    """The trials of one bucket as it grows, each planned whole (`Trials.evaluate`): reduce-scatter
    buckets, whose launch moves to their last member (every member's rows and the pack with it)."""

    def __init__(self, trials: Trials, first: Member, kind: str, name: str):
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
    the bucket taken whole, with `Trials.evaluate`, to make it); a member waited before the bucket's wait so far
    moves every copy-out, and is planned by building the growth again (ops priced at no time
    are left out of the steps: they step no clock)."""

    def __init__(self, trials: Trials, first: Member, name: str):
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
        self.source_bytes = 0              # what the pack reads: its operands' bytes, as the cost model counts them
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
        flat = flat_source(program, dry, m.source, f"{name}_in{i}", self.phase, before=first.name)
        if flat == m.source:
            dry.check_operand(f"{name}_pack", m.source, first.name)
        self.names.update((m.launch, m.wait))
        self.sources.append(flat)
        self.source_bytes += (dry.ops.get(flat) or program.op(flat)).nbytes_out
        self.params += program.op(m.launch).params
        offset = self.total
        self.total += m.numel
        self.nbytes += m.nbytes
        self._bucket_ops()
        dry.inherit(m.launch, name, skip=self.names)
        band, copy, out = (dry.create(op, before=self.here, payload=payload) for op, payload in
                           member_outputs(name, i, m, offset, self.wait_op.phase, self.dtype, self.ranks))
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
            trials.released, trials.kept)
        self.member_live += changes
        self.hoisted_bytes += hoisted
        self.unhoisted_bytes += unhoisted

    def _bucket_ops(self) -> None:
        """The bucket's own ops for the members so far, as `_merge_gathers` makes them."""
        ops = [op for op, _ in gather_bucket_ops(self.name, self.first, self.wait_op, self.sources, self.total,
                                                 self.nbytes, self.params)]
        for op, anchor in zip(ops, (self.first.name, self.first.name, self.here, self.here)):
            self.dry.ops[op.name] = op
            self.dry.anchor[op.name] = anchor
        self.ops = tuple(ops)

    def evaluate(self, m: Member) -> Trial:
        """The bucket of the members so far and `m`; `m` stays in for the next trial (the caller
        stops growing at the first trial it refuses)."""
        if self.slot[m.wait] < self.here_slot:  # every copy-out moves: plan the members again
            self._take_back()
            self._build(self.members + [m])
        else:
            self._add(m)
        trials = self.trials
        pack, launch, wait, grid = self.ops
        costs = self._costs()
        steps = {self.first.name: self.cast_steps + self.pack_steps
                 + _timed(pack, trials, self.dry, costs) + _timed(launch, trials, self.dry, costs),
                 self.here: _timed(wait, trials, self.dry, costs) + _timed(grid, trials, self.dry, costs)
                 + self.copy_steps}
        step_ms, inflight, exact = trials.run(self.at, self.end, self.skip, steps)
        # the curve: the new members' changes, and the bucket's own in place of the trial's before
        added = self.member_live[len(self.applied):]
        bucket_live = _gather_bucket_changes(alloc_bytes(pack), alloc_bytes(launch), self.hoisted_bytes,
                                             self.unhoisted_bytes, self.at, self.here_slot)
        self._show(added, +1)
        self._show(self.bucket_live, -1)
        self._show(bucket_live, +1)
        self.applied, self.bucket_live = self.member_live[:], bucket_live
        return Trial(None, costs, frozenset(), steps, (), step_ms, trials.tree.max(0, len(self.slot)), inflight,
                     exact)

    def _costs(self) -> dict[str, float]:
        """The bucket's own ops' prices, as `Trials._cost` gives them. Under the roofline model a
        pack (a cat) costs what it reads and writes, and a gather what it gathers: a pack that
        reads one operand of the same bytes prices the same, so a trial prices them in O(1), not
        by hashing and summing over its members (most of a trial's pricing at 30k generated)."""
        trials, ops = self.trials, self.ops
        pack, launch = ops[0], ops[1]
        if type(trials.model) is not Roofline or self.source_bytes != pack.nbytes_out:
            return {op.name: trials._cost(op, self.dry) for op in ops}
        proxy = attrs.evolve(pack, operands=(pack.name,))  # (reads a tensor of its own type)
        nodes = trials.scratch.graph._node
        nodes[pack.name] = {"op": pack}
        model, scratch = trials.model, trials.scratch
        return {pack.name: model.op_ms(proxy, scratch), launch.name: model.op_ms(launch, scratch),
                ops[2].name: trials._cost(ops[2], self.dry), ops[3].name: trials._cost(ops[3], self.dry)}

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
        return trials.evaluate(members, "gather", self.name, known=best)


def _timed(op, trials: Trials, plan: DryRun, costs: dict | None = None) -> list:
    """A new op's step, as the sweep steps it: none for an op that takes no time (it moves no clock)."""
    cost = costs[op.name] if costs is not None else trials._cost(op, plan)
    step = step_of(op, cost)
    return [] if step[0] == OTHER and cost == 0.0 else [(op.name, step)]


def _kept(changes):
    return [c for c in changes if c[0] < c[1] and c[2]]


def _gather_member_changes(m: Member, copy_bytes: int, hoisted: bool, at: int, here: int, slot: dict[str, int],
                           profile: MemoryProfile, released: dict[str, int], kept: dict[str, list[int]]):
    """One gather member's part of `_live_changes`: (changes, its hoisted cast's bytes, the bytes
    of its source the pack is now the last to keep alive)."""
    alloc, end = profile.alloc, len(slot) - 1
    until = released.get(m.launch, end)
    # its gathered buffer is gone; its copy-out lives as that buffer's readers kept it, from the
    # wait on (a buffer its wait was the last to keep, nobody read: the copy-out goes at once)
    changes = [(slot[m.launch], until + 1, -alloc.get(m.launch, 0)),
               (here, (here if until <= slot[m.wait] else until) + 1, copy_bytes)]
    source = profile.root.get(m.source, m.source)
    size = alloc.get(source, 0)
    if not size or source not in released:   # a shard: an input, live throughout
        return changes, 0, 0
    if hoisted:  # a private cast: made just before the pack, which reads it and is its last reader
        changes.append((slot[source], released[source] + 1, -size))
        return changes, size, 0
    # its launch and wait kept it (`keeps_alive`); the pack reads it now, where the bucket launches
    until = max(last_kept(kept.get(source, ()), {slot[m.launch], slot[m.wait]}), at)
    if until < released[source]:
        changes.append((until + 1, released[source] + 1, -size))
    return changes, 0, size if until == at else 0


def _gather_bucket_changes(pack: int, bucket: int, hoisted: int, unhoisted: int, at: int, here: int) -> list:
    """A gather bucket's own part of `_live_changes`: its pack, which the collective reads until
    the bucket's wait (`keeps_alive`), and its buffer (released after the last copy-out); in the
    launch's slot, the pack with the hoisted casts, or the launch once every source the pack was
    the last to read is released (the bucket is at least the casts it packs). In the wait's slot
    the copy-outs, together the bucket's size, take the pack's place."""
    changes = [(at, here, pack), (at, here + 1, bucket)]
    fix = min(bucket - hoisted, unhoisted)
    if fix > 0:
        changes.append((at, at + 1, -fix))
    return changes


def _live_changes(kind: str, plan: DryRun, members: list[Member], name: str, slot: dict[str, int],
                  profile: MemoryProfile, released: dict[str, int], first_free: dict[str, int],
                  kept: dict[str, list[int]]):
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
                                                at, here, slot, profile, released, kept)
            changes += part
            hoisted, unhoisted = hoisted + h, unhoisted + u
        return _kept(changes + _gather_bucket_changes(pack, bucket, hoisted, unhoisted, at, here))
    # reduce-scatters: the pack lives until the bucket's wait (the collective reads it until
    # then); each member's reduced buffer is gone
    changes = [(at, here + 1, pack)]
    for m in members:
        changes.append((slot[m.launch], released.get(m.launch, end) + 1, -alloc.get(m.launch, 0)))
    frees = [first_free[m.launch] for m in members if m.launch in first_free]
    # the bucket lives until the last reader of a member's result (a result its wait was the
    # last to keep, nobody read), or its first free
    until = min(frees) if frees else max([here, *(u for m in members
                                                  if (u := released.get(m.launch, end)) > slot[m.wait])])
    changes.append((at, until + 1, bucket))
    # gradients: the members' launches and waits kept them (`keeps_alive`); the pack, here, reads
    # them now, and is the last to keep those nothing later keeps
    gone = {slot[n] for m in members for n in (m.launch, m.wait)}
    read_here, seen = 0, set()
    for m in members:
        root = profile.root.get(m.source, m.source)
        size = alloc.get(root, 0)
        if root in seen or not size or root not in released:
            continue
        seen.add(root)
        kept_to = max(last_kept(kept.get(root, ()), gone), at)
        if kept_to != released[root]:
            lo, hi = sorted((kept_to, released[root]))
            changes.append((lo + 1, hi + 1, size if kept_to > released[root] else -size))
        if kept_to == at:
            read_here += size
    fix = min(bucket, read_here)  # released after the pack, before the launch allocates
    if fix > 0:
        changes.append((at, at + 1, -fix))
    return _kept(changes)
