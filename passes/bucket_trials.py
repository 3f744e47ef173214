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
checks it). The trials of one bucket share one run of the program as it is (`_SharedBaseSweep`:
the base is stepped once per bucket, not once per trial) and step only the ops that can move a
clock. A trial runs only to the last op it touches (`_SharedBaseSweep.quick`): from there the
program is the base's, and the clock's rules are max-plus linear, so the step is read off
tails that one backward pass per run computes (what the compute time, each stream and each
pending collective add to the step from each slot on); where that figure is within NEAR_MS of
what decides, the exact run (on until trial and base run the same) decides (`settle`). Up to
that op a trial does not step the stretch op by op either (`_Walk`): a run of launches on one
stream is stepped at once (back to back from max(compute time, stream), its ends read off
prefix sums where asked), and a stretch between two of the trial's own changes that launches
on one stream at most and waits only on what was launched before the bucket's first slot is a
max-plus map of the state before it (`_SharedBaseSweep._piece`: the compute time
max(t + a, b), the stream and each launch's end max(t + alpha, stream + beta, gamma), their
tails at once; passes/bucket_pieces.py), made once per bucket, its scan kept and gone on from
for a longer piece from the same slot (also after a make, where no make since touched it), and
made at once from each launch to one slot where a bucket's trials ask for ever shorter ones
(`_suffixes`). The stretches a trial jumps in a row are one composed map (`_compose`), kept for
the next trial from the same slot (`_chain`): the generated graphs launch a forward's gathers
back to back, or one per wait, and wait on them one by one, so a growing bucket's trial jumps
its last trial's chain and one more stretch, not K maps (a bucket's trials cost ~K maps, not
K^2). What is left: each trial still sorts its K members' slots and walks its own ops; the
program's own step, which a trial's is measured against, is still walked once per bucket made,
from its first slot to its trial's end (the step does not depend on where it is read, so once
between two makes); a stretch that launches on two streams is stepped op by op.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import Counter

import attrs

from ..cost.model import Roofline, is_zero_cost
from ..cost.simulate import (LAUNCH, OTHER, WAIT, Clock, MemoryProfile, Sweep, alloc_bytes, keeper_slots, last_kept,
                             memory_profile, op_getter, step_of, steps_of)
from ..ir import EFFECT, Free, Program, View, Wait
from ..ir.effects import storage_readers, storage_root
from ..ir.rewriter import RewriteError
from .bucket_merge import Member, flat_source, gather_bucket_ops, member_outputs, merge
from .bucket_pieces import _compose, _Piece, _Scan
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


class _SharedBaseSweep(Sweep):
    """`Sweep` whose trials between two makes share one run of the program as it is (the base).

    `Sweep.trial` steps the base and the trial side by side from the trial's first slot; the
    trials of one bucket all start there and the base does not change until a bucket is made, so
    here the base is stepped once, on demand, and its state kept at each slot a trial reads it
    (its time, exposure and streams; which collectives it has in flight, from where each was
    launched and waited). A trial then steps only its own clock, and only over the slots that can
    move it: an op that is not a collective and is priced at nothing steps no clock (`t + 0.0`),
    so it is passed over, unless a change puts steps before it. Same comparisons, same floating
    point operations in the same order: the same results as `Sweep.trial`."""

    def __init__(self, order: list[str], steps):
        super().__init__(order, steps)
        self.live = [i for i, n in enumerate(order) if steps[n][0] != OTHER or steps[n][1] != 0.0]
        self.live_names = {order[i] for i in self.live}
        self.base = None   # the shared run: its first slot and state (see `_base`)
        self.quick_base = None  # the quick trials' run of the base (see `quick`)
        self.base_step = None   # the step of the program as it is, by the tails (see `quick`)
        self.slot = {n: i for i, n in enumerate(order)}
        self.dirty = -1    # the last slot a made change touched: the tails hold after it
        self.made: list[int] = []  # the slots a made change skips or puts steps before, in order
        self.makes: list[list[int]] = []  # each make's slots, sorted, in the order made (see `_piece`)
        self.scans: dict[int, _Scan] = {}  # first slot -> the longest `_piece` scan from it (see `_piece`)
        self._tails()
        self._stretches()

    def make(self, skip: set[str], before: dict[str, list]) -> None:
        super().make(skip, before)
        self.base = self.quick_base = self.base_step = None
        self._anchor(before)
        slot = self.slot
        self.dirty = max(self.dirty, *(slot[n] for n in skip), *(slot[n] for n in before))
        slots = sorted({slot[n] for n in (*skip, *before)})
        for i in slots:
            insort(self.made, i)
        self.makes.append(slots)

    def _tails(self) -> None:
        """What each part of the state just before slot x adds to the step, by the program after
        x as it is now (a backward pass over `Clock.step`'s rules, which are max-plus linear):
        the step is the largest of t + tail_t[x], each stream's free + tail_free[x][stream]
        (0 where absent) and each pending collective's end + tail_end[it]; and the largest
        gathered bytes in flight after each slot from x on (`level_after`). Ends are one number
        per collective, as each is waited once (a collective waited twice: `quick` is off)."""
        order, steps = self.order, self.steps
        launched, waits = set(), Counter()
        level, levels, pending = 0, [], {}
        for name in order:
            kind, _, _, extra = steps[name]
            if kind == LAUNCH:
                launched.add(name)
                pending[name] = extra
                level += extra
            elif kind == WAIT and extra in launched:
                waits[extra] += 1
                level -= pending.pop(extra, 0)
            levels.append(level)
        self.quick_ok = all(k == 1 for k in waits.values())
        n = len(order)
        tail_t, tail_free, tail_end = 0.0, {}, {}
        ts, frees = [0.0] * (n + 1), [tail_free] * (n + 1)
        level_after, high = [0] * (n + 1), 0
        ninf = -math.inf
        for i in range(n - 1, -1, -1):
            name = order[i]
            kind, cost, stream, extra = steps[name]
            if kind == LAUNCH:  # start = max(t, free); end = start + cost, which free and its wait read
                g = cost + max(tail_free.get(stream, 0.0), tail_end.get(name, ninf))
                if g > tail_t:
                    tail_t = g
                tail_free = {**tail_free, stream: g}
            elif kind == WAIT and extra in launched and self.slot[extra] < i:  # t = max(t, end) + cost
                e = tail_t + cost
                if e > tail_end.get(extra, ninf):
                    tail_end[extra] = e
                tail_t = e
            else:
                tail_t = tail_t + cost
            ts[i], frees[i] = tail_t, tail_free
            if levels[i] > high:
                high = levels[i]
            level_after[i] = high
        self.tail_t, self.tail_free, self.tail_end, self.level_after = ts, frees, tail_end, level_after

    def _final(self, x: int, t: float, free: dict, pending, end_of) -> float:
        """The step of a run in state (t, free, pending, ends) just before slot x, by the tails."""
        step = t + self.tail_t[x]
        tail_free, tail_end = self.tail_free[x], self.tail_end
        for stream, f in free.items():
            f += tail_free.get(stream, 0.0)
            if f > step:
                step = f
        for n in pending:
            e = tail_end.get(n)
            if e is not None:
                e += end_of(n)
                if e > step:
                    step = e
        return step

    def _stretches(self) -> None:
        """Where a run of the schedule can be stepped at once (`_Walk.walk`): from each op that is
        not a collective, the slots until the next collective (`other_end`), over which the
        compute time only adds their costs (`other_sum`, prefix sums); from each launch, the slots
        until anything but a launch on its stream or an op priced at nothing (`launch_end`),
        which leave the compute time alone, so its stream runs them back to back from
        max(its time, the compute time) (`launch_sum`, and `gathered` bytes, prefix sums); and
        for the tails, from each launch to its run's end, the largest launch_sum after it plus
        the collective's tail (`launch_tail`: what the run's pending ends add to the step)."""
        order, steps, n = self.order, self.steps, len(self.order)
        other_sum, launch_sum, gathered = [0.0] * (n + 1), [0.0] * (n + 1), [0] * (n + 1)
        acc_o = acc_l = 0.0
        acc_g = 0
        for i, name in enumerate(order):
            kind, cost, _, extra = steps[name]
            if kind == OTHER:
                acc_o += cost
            elif kind == LAUNCH:
                acc_l += cost
                acc_g += extra
            other_sum[i + 1], launch_sum[i + 1], gathered[i + 1] = acc_o, acc_l, acc_g
        other_end, launch_end, launch_tail = [0] * n, [0] * n, [-math.inf] * n
        ninf, tail_end = -math.inf, self.tail_end
        next_busy = n       # the first slot after i that is not an op priced at nothing
        for i in range(n - 1, -1, -1):
            kind, cost, stream, _ = steps[order[i]]
            if kind == OTHER:
                other_end[i] = other_end[i + 1] if i + 1 < n and steps[order[i + 1]][0] == OTHER else i + 1
            elif kind == LAUNCH:
                k = next_busy  # (the ops priced at nothing between, then the next that is not)
                same = k < n and steps[order[k]][0] == LAUNCH and steps[order[k]][2] == stream
                launch_end[i] = launch_end[k] if same else k
                e = tail_end.get(order[i])
                mine = ninf if e is None else launch_sum[i + 1] + e
                after = launch_tail[k] if same else ninf
                launch_tail[i] = mine if mine > after else after
            if kind != OTHER or cost != 0.0:
                next_busy = i
        self.other_sum, self.launch_sum, self.gathered = other_sum, launch_sum, gathered
        self.other_end, self.launch_end, self.launch_tail = other_end, launch_end, launch_tail

    def quick(self, at: int, end: int, skip: set[str], before: dict[str, list]):
        """(step change, a bound on the most gathered bytes in flight) of a trial, or None where
        the tails do not hold (a change made at or after `end`, a collective waited twice).

        Instead of running trial and base on until they run the same (`trial`), both are run to
        just after `end` and their steps read off the tails there (`_tails`): a trial costs
        order[at:end], not the stretch until the two agree; and there it steps one op at a time
        only the ops a change touches and the waits: between them, runs of ops that are no
        collective and runs of launches on one stream are stepped at once (`_Walk`). The step
        change is the exact one up to rounding and `Clock.same`'s tolerance (~1e-9 ms; `settle`
        lets the exact one decide near a tie); in flight: the trial's own level to `end`, then
        the base's largest level after it (the two have the same collectives in flight from
        there on)."""
        if not self.quick_ok or end < self.dirty or end + 1 > len(self.order):
            return None
        self._anchor(before)
        self.advance(at)
        x = end + 1
        made = self.made
        made = made[bisect_left(made, at):bisect_left(made, x)]
        qb = self.quick_base
        if qb is None or qb.at != at:
            qb = self.quick_base = _Walk(self, self.clock, at)
        base_step = self.base_step
        if base_step is None:
            # the program as it is, run to x and read off the tails there: its step, whatever x
            # and the first slot (x past the last change made), so once between two makes (up
            # to rounding), not per bucket (most grow no further than their first member)
            if qb.at_slot > x:  # the base ran past this trial's end (an earlier, longer trial)
                return None
            qb.walk(qb.at_slot, x, (), {}, made)
            base_step = self.base_step = qb.final(x)
        slot, order, cur_before, steps = self.slot, self.order, self.before, self.steps
        trial = _Walk(self, self.clock, at)
        pieces, chains, live, launch_end = qb.pieces, qb.chains, self.live, self.launch_end
        touched = sorted({*(slot[n] for n in skip), *(slot[n] for n in before), x})
        anchors = sorted({slot[n] for n in before})
        pending = self.clock.pending
        # a chain: the stretches and touched slots since `chain[0]` (its first slot; `chain[1]`:
        # its first index in `touched`) that are jumped, not walked, as one map (`chain[2]`;
        # None: all empty so far); jumped where something is walked, and kept for the next
        # trials of this bucket from this first slot (`_chain`)
        chain = None
        lo, p = at, 0
        while True:
            i = touched[p]
            if lo < i:  # a stretch the change leaves alone: a run of launches it opens, then the rest at once
                j = bisect_left(live, lo)
                if j < len(live) and live[j] < i and steps[order[live[j]]][0] == LAUNCH:
                    if chain is not None:
                        self._chain(trial, chain, touched, p, lo, chains)
                        chain = None
                    mid = min(launch_end[live[j]], i)
                    trial.walk(lo, mid, (), {}, made)
                    lo = mid
            if chain is None:
                kept = chains.get(lo)
                if kept is not None:  # an earlier trial's chain from here: the same, where its slots are
                    bounds, comp, lo_end = kept
                    k = len(bounds)
                    # (not through x, the last slot: a slot an earlier trial skipped may be this one's x)
                    if p + k < len(touched) and touched[p:p + k] == bounds and \
                            bisect_left(anchors, lo) == bisect_left(anchors, lo_end):
                        chain = [lo, p, comp]
                        p += k
                        lo = lo_end
                        continue
            m = None
            if lo < i:
                m = pieces.get((lo, i))
                if m is None:
                    m = self._asked(qb, lo, i)
            walk_i = i != x and (order[i] in before or order[i] in cur_before or order[i] not in skip)
            if m is False or walk_i or i == x:
                if chain is not None:
                    self._chain(trial, chain, touched, p, lo, chains)
                    chain = None
                if m is False:
                    trial.walk(lo, i, (), {}, made)
                elif m is not None:
                    trial.jump(m)
                if i == x:
                    break
                if walk_i:
                    trial.walk(i, i + 1, skip, before, [i])
            elif chain is None:
                chain = [lo, p, m]
            elif m is not None:
                comp = m if chain[2] is None else _compose(chain[2], m, pending)
                if comp is None:  # launches on another stream: the chain so far is jumped
                    self._chain(trial, chain, touched, p, lo, chains)
                    chain = [lo, p, m]
                else:
                    chain[2] = comp
            lo = i + 1
            p += 1
        high = trial.peak if trial.peak > trial.level else trial.level
        return trial.final(x) - base_step, max(high, self.level_after[x])

    @staticmethod
    def _chain(trial: _Walk, chain: list, touched: list[int], p: int, lo: int, chains: dict) -> None:
        """Jump `chain` (see `quick`), which ends just before `touched[p]` at slot `lo`, and keep it
        for the next trials of the bucket (a bucket that grows a member at a time asks for the
        chain of the one before and one more stretch: with it kept, a trial jumps one map for
        what the one before jumped one stretch at a time, and its K members cost K maps, not K^2).
        A kept chain holds for a later trial (same sweep, same first slot) that touches the same
        slots after its first slot and puts no steps before one of them: its stretches are then
        the same pieces, each touched slot is skipped with nothing stepped there, and the pieces
        do not depend on the trial."""
        if chain[2] is not None:
            trial.jump(chain[2])
        first, start = chain[0], chain[1]
        if p - start > 1:
            kept = chains.get(first)
            if kept is None or len(kept[0]) < p - start:
                chains[first] = (touched[start:p], chain[2], lo)

    def _asked(self, qb: _Walk, lo: int, hi: int):
        """The piece [lo, hi) for a trial from `qb.at` (`qb.pieces` has not got it). The second
        first slot asked for one last slot makes the pieces from each slot just after a launch
        between them to it at once (`_suffixes`): a bucket whose members launch one per wait,
        well before its first member's wait, asks for [just after its last member's launch,
        that wait) in each trial, each a few launches shorter than the last (2700 slots each at
        30k nodes: most of what the pieces scanned, once kept scans went on across makes)."""
        first = qb.asked.setdefault(hi, lo)
        if first < lo and hi not in qb.suffixed:
            qb.suffixed.add(hi)
            self._suffixes(qb, lo, hi)
            m = qb.pieces.get((lo, hi))
            if m is not None:
                return m
        m = qb.pieces[(lo, hi)] = self._piece(lo, hi)
        return m

    def _suffixes(self, qb: _Walk, lo: int, hi: int) -> None:
        """The pieces [s, hi) for `lo` and each slot s in (lo, hi) just after a launch, into
        `qb.pieces`: the pieces between two of them, then each from the last, composed
        (`_compose`; its launches' ends are composed only where asked: `_Launches`). A piece
        that is False makes every one before it False, as a scan of one would stop there too
        (a wait on a collective not stepped yet, a second stream), and so does a composition
        of two on two streams. One scan of the stretch, and a composition per slot."""
        live, order, steps, cur_skip = self.live, self.order, self.steps, self.skip
        splits = [lo]
        for j in range(bisect_left(live, lo), len(live)):
            i = live[j]
            if i + 1 >= hi:
                break
            if steps[order[i]][0] == LAUNCH and order[i] not in cur_skip:
                splits.append(i + 1)
        pieces, pending = qb.pieces, self.clock.pending
        rest = pieces[(splits[-1], hi)] = self._piece(splits[-1], hi)
        for k in range(len(splits) - 2, -1, -1):
            if rest is not False:
                sub = self._piece(splits[k], splits[k + 1])
                rest = False if sub is False else _compose(sub, rest, pending, lazy=True) or False
            pieces[(splits[k], hi)] = rest

    def _piece(self, lo: int, hi: int):
        """Slots [lo, hi) of the program as it is, as maps of the state before them (`_Piece`):
        the compute time t -> max(t + a, b), and where it launches on one stream, that stream's
        time and each launch's end as max(t + alpha, stream + beta, gamma); or False where it
        launches on two streams or waits on a collective launched from the trial's first slot
        on (or never): those are walked. The same for every trial of one bucket: they start
        from the same clock.

        The scan from `lo` is kept (`scans`: the longest from each first slot) and goes on from
        where it stopped when a trial asks for the same `lo` and a later `hi`, also after a
        make: on the generated graphs a forward's gathers launch back to back and are waited
        far later, so each of a few hundred two-member buckets in a row asks for [the first
        slot after the run of launches, its members' wait) (1800 slots each at 30k nodes: most
        of the slots the pieces scanned, and a third of the pass's time at 100k). What the scan
        read is the same then: the sweep's skips and steps before in [lo, hi), where no make
        since has put any (`makes`; else it is scanned again); the ends of the collectives its
        waits wait on and whether each is in flight (the sweep's clock's, which only goes on,
        and only to a trial's first slot, before lo: an end stays as it was stepped, and a
        collective the scan waits is waited nowhere else, as `quick` runs only then, so it is
        in flight at the later first slot exactly when it was at the earlier: a scan ends
        False at a wait on a collective not stepped yet); the tails, the same for the run;
        and the slots that step something (a slot `_anchor` makes live after the scan passed it
        steps t + 0.0, which changes nothing). Going on from the kept state makes the same
        operations in the same order as a scan from `lo`: the same maps."""
        old = self.scans.get(lo)
        holds = old is not None and self._scan_holds(old)
        if holds and old.hi <= hi:
            scan = old
        else:
            scan = _Scan(lo, len(self.makes))
            if not holds or old.hi <= hi:
                self.scans[lo] = scan
        if scan.hi < hi and not scan.false:
            self._scan(scan, hi)
        if scan.false:
            return False
        return _Piece(scan.a, scan.b, tuple(scan.waited), scan.stream, scan.fa, scan.fb, scan.fc, dict(scan.launches),
                      tuple(scan.tails), scan.high, scan.rise)

    def _scan_holds(self, scan: _Scan) -> bool:
        """Whether what `scan` read still holds (see `_piece`)."""
        makes, lo, hi = self.makes, scan.lo, scan.hi
        for k in range(scan.makes, len(makes)):
            slots = makes[k]
            j = bisect_left(slots, lo)
            if j < len(slots) and slots[j] < hi:
                return False
        scan.makes = len(makes)
        return True

    def _scan(self, scan: _Scan, hi: int) -> None:
        """Step `scan` on over slots [scan.hi, hi) (see `_piece`)."""
        live, order, steps, cur_skip, cur_before = self.live, self.order, self.steps, self.skip, self.before
        shared, pending, tail_end = self.clock.ends, self.clock.pending, self.tail_end
        a, b, waited = scan.a, scan.b, scan.waited
        stream, fa, fb, fc = scan.stream, scan.fa, scan.fb, scan.fc   # the stream: max(t + fa, stream + fb, fc)
        launches, level, high, rise, tails = scan.launches, scan.level, scan.high, scan.rise, scan.tails
        for j in range(bisect_left(live, scan.hi), len(live)):
            i = live[j]
            if i >= hi:
                break
            name = order[i]
            if name in cur_before:
                todo = [*cur_before[name]]
                if name not in cur_skip:
                    todo.append((name, steps[name]))
            elif name in cur_skip:
                continue
            else:
                todo = ((name, steps[name]),)
            for step_name, (kind, cost, on, extra) in todo:
                if kind == LAUNCH:  # stream = max(t, stream) + cost
                    if stream is None:
                        stream = on
                    elif on != stream:
                        scan.false, scan.hi = True, i + 1  # (and so is every piece on from lo)
                        return
                    fa = (fa if fa > a else a) + cost
                    fb = fb + cost
                    fc = (fc if fc > b else b) + cost
                    launches[step_name] = (fa, fb, fc, extra)
                    e = tail_end.get(step_name)
                    if e is not None:  # its end + tail (max is exact: as if taken over all at the end)
                        tails[0], tails[1], tails[2] = (max(tails[0], fa + e), max(tails[1], fb + e),
                                                        max(tails[2], fc + e))
                    level += extra
                    rise += extra
                    if level > high:
                        high = level
                    continue
                if kind == WAIT:
                    e = shared.get(extra)
                    if e is None:
                        scan.false, scan.hi = True, i + 1  # (and so is every piece on from lo)
                        return
                    if e > b:
                        b = e
                    if extra in pending:
                        waited.append(extra)
                        level -= pending[extra]
                a += cost
                b += cost
        scan.hi = hi
        scan.a, scan.b, scan.stream, scan.fa, scan.fb, scan.fc = a, b, stream, fa, fb, fc
        scan.level, scan.high, scan.rise = level, high, rise

    def _anchor(self, before) -> None:
        """Slots with new steps before them are stepped, whatever their own op."""
        for name in before:
            if name not in self.live_names:
                self.live_names.add(name)
                i = self.order.index(name)
                if self.base is not None and bisect_left(self.live, i) < self.base["next"]:
                    self.base["next"] += 1  # (a slot the base passed: nothing of its own to step there)
                insort(self.live, i)

    def trial(self, at: int, end: int, skip: set[str], before: dict[str, list]) -> tuple[float, float, int]:
        self._anchor(before)
        self.advance(at)
        base = self._base(at)
        steps, cur_skip, cur_before, order, live = self.steps, self.skip, self.before, self.order, self.live
        state, start_set, launched, waited = self._state, base["start"], base["launched"], base["waited"]
        # the base's ends: an overlay on the sweep's, whose own entries (read with dict.get, not
        # the overlay's Python get) are what the base stepped
        base_ends, shared, own_get = base["clock"].ends, self.clock.ends, dict.get
        # the trial's clock (a fork of the sweep's), stepped here by `Clock.step`'s rules: the same
        # operations in the same order, on locals (a method call per op was most of a trial)
        clock = self.clock
        t, exposed, level, peak, last = clock.t, clock.exposed, clock.level, 0, clock.t
        free, pending, own = dict(clock.free), dict(clock.pending), {}
        inf = math.inf

        def same(i: int) -> bool:
            """`Clock.same` of the base just after slot `i` and the trial, without the base's
            clock: the same collectives in flight (as many, and each of the trial's in flight in
            the base, from where the base launched and waited it), each as far ahead of its
            compute time."""
            a, _, free_b, count = state(base, i)
            if count != len(pending):
                return False
            for stream in free_b.keys() | free.keys():
                if abs(max(free_b.get(stream, 0.0) - a, 0.0) - max(free.get(stream, 0.0) - t, 0.0)) > 1e-9:
                    return False
            for n in pending:
                if not (n in start_set or launched.get(n, inf) <= i) or waited.get(n, inf) <= i:
                    return False
                eb = own_get(base_ends, n)
                et = own.get(n)
                if abs(max((shared[n] if eb is None else eb) - a, 0.0)
                       - max((shared[n] if et is None else et) - t, 0.0)) > 1e-9:
                    return False
            return True

        def result(i: int, converged: bool) -> tuple[float, float, int]:
            bt, b_exposed, b_free, _ = state(base, i)
            high = max(peak, level)
            if converged:
                return t - bt, exposed - b_exposed, high
            return (max(t, max(free.values(), default=0.0)) - max(bt, max(b_free.values(), default=0.0)),
                    exposed - b_exposed, high)

        j = bisect_left(live, at)
        n_live = len(live)
        end_live = end < len(order) and order[end] in self.live_names
        while j < n_live:
            i = live[j]
            if not end_live and i > end:   # the check at `end`, an op that steps nothing
                end_live = True
                if order[end] not in cur_skip and same(end):
                    return result(end, True)
            name = order[i]
            if name in cur_before or name in before:
                todo = [*cur_before.get(name, ()), *before.get(name, ())]
                if name not in cur_skip and name not in skip:
                    todo.append((name, steps[name]))
            elif name in cur_skip or name in skip:
                todo = ()
            else:
                todo = ((name, steps[name]),)
            for step_name, (kind, cost, stream, extra) in todo:
                if kind == LAUNCH:
                    begin = free.get(stream, 0.0)
                    if begin < t:
                        begin = t
                    done = begin + cost
                    free[stream] = done
                    own[step_name] = done
                    pending[step_name] = extra
                    if extra:
                        if t != last:  # a run of equal times ended: its level counts
                            if level > peak:
                                peak = level
                            last = t
                        level += extra
                    continue
                if kind == WAIT:
                    done = own.get(extra)
                    if done is None:
                        done = shared.get(extra)
                    if done is not None:
                        if done > t:
                            exposed += done - t
                            t = done
                        gathered = pending.pop(extra, 0)
                        if gathered:
                            if t != last:
                                if level > peak:
                                    peak = level
                                last = t
                            level -= gathered
                t = t + cost
            if i >= end and name not in cur_skip and (steps[name][0] != OTHER or i == end) and same(i):
                return result(i, True)
            j += 1
        if not end_live and order[end] not in cur_skip and same(end):
            return result(end, True)
        return result(len(order) - 1, False)

    def _base(self, at: int) -> dict:
        """The shared run from slot `at` (stepped no further than a trial asked)."""
        if self.base is None or self.base["at"] != at:
            clock = self.clock.fork()
            self.base = {"at": at, "clock": clock, "next": bisect_left(self.live, at),
                         "start": set(clock.pending), "launched": {}, "waited": {}, "state": {},
                         "first": (clock.t, clock.exposed, dict(clock.free), len(clock.pending))}
        return self.base

    def _state(self, base: dict, i: int) -> tuple:
        """The base's (t, exposed, streams, collectives in flight) just after slot `i`."""
        state = base["state"]
        if i in state:
            return state[i]
        live, order, steps = self.live, self.order, self.steps
        cur_skip, cur_before, clock = self.skip, self.before, base["clock"]
        launched, waited = base["launched"], base["waited"]
        j = base["next"]
        while j < len(live) and live[j] <= i:
            k = live[j]
            name = order[k]
            for new, s in cur_before.get(name, ()):
                _in_flight(clock, new, s, k, launched, waited)
                clock.step(new, s)
            if name not in cur_skip:
                s = steps[name]
                _in_flight(clock, name, s, k, launched, waited)
                clock.step(name, s)
            state[k] = (clock.t, clock.exposed, dict(clock.free), len(clock.pending))
            j += 1
        base["next"] = j
        if i not in state:  # a slot that steps nothing: as after the last one before it that does
            k = bisect_left(live, i) - 1
            state[i] = state[live[k]] if k >= 0 and live[k] >= base["at"] else base["first"]
        return state[i]


class _Walk:
    """A run of `Clock.step`'s rules over the program as the sweep has it (its skips and steps
    before) and a change (`skip`, `before`), from the sweep's clock at slot `at`: its compute
    time `t`, streams `free`, in-flight level and peak (as `Clock` counts them), and the ends of
    what it launched: one at a time (`own`, `pending`), or a run of launches on one stream
    stepped at once (`runs`: [first slot, end slot, start, slots since waited]; the ends are the
    start plus the run's costs so far, `launch_sum`)."""

    __slots__ = ("sweep", "t", "free", "pending", "own", "shared", "runs", "level", "peak", "last", "at",
                 "at_slot", "pieces", "chains", "asked", "suffixed", "jumped")

    def __init__(self, sweep: _SharedBaseSweep, clock: Clock, at: int):
        self.sweep, self.at, self.at_slot = sweep, at, at
        self.t, self.level, self.peak, self.last = clock.t, clock.level, 0, clock.t
        self.free, self.pending, self.own, self.shared, self.runs = dict(clock.free), dict(clock.pending), {}, \
            clock.ends, []
        self.pieces: dict = {}  # (lo, hi) -> `_SharedBaseSweep._piece` of it, for the trials from `at`
        self.chains: dict = {}  # first slot -> (touched slots, map, end slot): see `_SharedBaseSweep._chain`
        self.asked: dict = {}   # last slot -> the first slot of the first piece asked for to it (see `_asked`)
        self.suffixed: set = set()  # last slots whose pieces from each launch are made (see `_suffixes`)
        self.jumped: list = []  # [piece, t before it, its stream before it, its launches since waited]

    def jump(self, piece: _Piece) -> None:
        """Step a `_Piece` at once. The in-flight level over it is bounded by its level before it
        plus the most it rises (`Clock` counts a level only where a run of equal times ends), and
        the next level counts whatever its time; its launches' ends are read where asked
        (`_wait_in_piece`, `final`)."""
        t = self.t
        v = t + piece.a
        self.t = piece.b if piece.b > v else v
        if piece.stream is not None:
            free = self.free
            f = free.get(piece.stream, 0.0)
            e = t + piece.fa
            g = f + piece.fb
            free[piece.stream] = max(e, g, piece.fc)
            self.jumped.append([piece, t, f, None])
        pending, level = self.pending, self.level
        high = level + piece.high
        if high > self.peak:
            self.peak = high
        for n in piece.waited:
            level -= pending.pop(n, 0)
        level += piece.rise
        if (level != self.level or piece.high) if piece.resets is None else piece.resets:
            self.last = math.nan
        self.level = level

    def walk(self, lo: int, hi: int, skip, before, specials: list[int]) -> None:
        """Step slots [lo, hi): `specials` (sorted slots) one op at a time, as `Sweep.trial`
        steps them (with the sweep's and the change's skips and steps before), a wait one at a
        time, and the runs between at once."""
        sweep = self.sweep
        live, order, steps, cur_skip, cur_before = sweep.live, sweep.order, sweep.steps, sweep.skip, sweep.before
        other_sum, launch_sum, gathered_sum = sweep.other_sum, sweep.launch_sum, sweep.gathered
        other_end, launch_end = sweep.other_end, sweep.launch_end
        t, level, peak, last = self.t, self.level, self.peak, self.last
        free, pending, own, shared = self.free, self.pending, self.own, self.shared
        n_live, n_sp = len(live), len(specials)
        j = bisect_left(live, lo)
        p = bisect_left(specials, lo)
        nsp = specials[p] if p < n_sp and specials[p] < hi else hi
        while j < n_live:
            i = live[j]
            if i >= hi:
                break
            while nsp < i:
                p += 1
                nsp = specials[p] if p < n_sp and specials[p] < hi else hi
            name = order[i]
            if i == nsp:
                if name in cur_before or name in before:
                    todo = [*cur_before.get(name, ()), *before.get(name, ())]
                    if name not in cur_skip and name not in skip:
                        todo.append((name, steps[name]))
                elif name in cur_skip or name in skip:
                    j += 1
                    continue
                else:
                    todo = ((name, steps[name]),)
                r = i + 1
            else:
                s = steps[name]
                kind = s[0]
                if kind == OTHER:
                    r = other_end[i]
                    if r > nsp:
                        r = nsp
                    t = t + (other_sum[r] - other_sum[i])
                    todo = ()
                elif kind == LAUNCH:
                    r = launch_end[i]
                    if r > nsp:
                        r = nsp
                    if r > i + 1:  # a run of launches on one stream, back to back from max(t, free)
                        stream = s[2]
                        begin = free.get(stream, 0.0)
                        if begin < t:
                            begin = t
                        free[stream] = begin + (launch_sum[r] - launch_sum[i])
                        extra = gathered_sum[r] - gathered_sum[i]
                        if extra:
                            if t != last:
                                if level > peak:
                                    peak = level
                                last = t
                            level += extra
                        self.runs.append([i, r, begin, None])
                        todo = ()
                    else:
                        todo = ((name, s),)
                else:
                    r = i + 1
                    todo = ((name, s),)
            for step_name, (kind, cost, stream, extra) in todo:  # Clock.step, as in `trial`
                if kind == LAUNCH:
                    begin = free.get(stream, 0.0)
                    if begin < t:
                        begin = t
                    done = begin + cost
                    free[stream] = done
                    own[step_name] = done
                    pending[step_name] = extra
                    if extra:
                        if t != last:
                            if level > peak:
                                peak = level
                            last = t
                        level += extra
                    continue
                if kind == WAIT:
                    done = own.get(extra)
                    if done is None:
                        done = shared.get(extra)
                    if done is not None:
                        if done > t:
                            t = done
                        gathered = pending.pop(extra, 0)
                    elif self.runs or self.jumped:
                        done, gathered = self._wait_in_run(extra)
                        if done is None:
                            done, gathered = self._wait_in_piece(extra)
                        if done is not None and done > t:
                            t = done
                    else:
                        gathered = 0
                    if done is not None and gathered:
                        if t != last:
                            if level > peak:
                                peak = level
                            last = t
                        level -= gathered
                t = t + cost
            j += 1
            if j < n_live and live[j] < r:
                j = bisect_left(live, r, j)
        self.t, self.level, self.peak, self.last = t, level, peak, last
        if hi > self.at_slot:
            self.at_slot = hi

    def _wait_in_run(self, launch: str) -> tuple:
        """(end, gathered bytes still in flight) of `launch` where a run stepped at once launched
        it, else (None, 0)."""
        sweep = self.sweep
        k = sweep.slot.get(launch)
        if k is None:
            return None, 0
        for run in self.runs:
            first, stop, begin, waited = run
            if first <= k < stop and sweep.steps[launch][0] == LAUNCH:
                done = begin + (sweep.launch_sum[k + 1] - sweep.launch_sum[first])
                if waited is None:
                    waited = run[3] = set()
                if k in waited:
                    return done, 0
                waited.add(k)
                return done, sweep.steps[launch][3]
        return None, 0

    def _wait_in_piece(self, launch: str) -> tuple:
        """(end, gathered bytes still in flight) of `launch` where a jumped piece launched it,
        else (None, 0)."""
        for entry in self.jumped:
            piece, t, f, waited = entry
            got = piece.launches.get(launch)
            if got is None:
                continue
            if waited is None:
                waited = entry[3] = set()
            done = max(t + got[0], f + got[1], got[2])
            if launch in waited:
                return done, 0
            waited.add(launch)
            return done, got[3]
        return None, 0

    def final(self, x: int) -> float:
        """The step of the program from this state just before slot x on, by the tails."""
        sweep = self.sweep
        own, shared = self.own, self.shared
        step = sweep._final(x, self.t, self.free, self.pending, lambda n: own[n] if n in own else shared[n])
        order, launch_sum, launch_tail, launch_end, tail_end = (sweep.order, sweep.launch_sum, sweep.launch_tail,
                                                                sweep.launch_end, sweep.tail_end)
        for first, stop, begin, waited in self.runs:
            if waited is None and stop == launch_end[first]:  # the run's largest end + tail, at once
                e = launch_tail[first] - launch_sum[first] + begin
                if e > step:
                    step = e
                continue
            for k in range(first, stop):
                if waited is not None and k in waited:
                    continue
                e = tail_end.get(order[k])
                if e is None or sweep.steps[order[k]][0] != LAUNCH:
                    continue
                e += begin + (launch_sum[k + 1] - launch_sum[first])
                if e > step:
                    step = e
        tail_end = sweep.tail_end
        for piece, t, f, waited in self.jumped:
            if waited is None:
                ta, tb, tc = piece.tails
                e = max(t + ta, f + tb, tc)
                if e > step:
                    step = e
                continue
            for name, (la, lb, lc, _) in piece.launches.items():
                e = tail_end.get(name)
                if e is None or name in waited:
                    continue
                e += max(t + la, f + lb, lc)
                if e > step:
                    step = e
        return step


def _in_flight(clock, name: str, s: tuple, at: int, launched: dict, waited: dict) -> None:
    """Record where stepping `name` at slot `at` launches a collective, or waits one `clock` has in flight."""
    if s[0] == LAUNCH:
        launched[name] = at
    elif s[0] == WAIT and s[3] in clock.pending:
        waited[s[3]] = at


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
