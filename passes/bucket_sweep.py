"""bucket_sweep: the simulated step of a bucket's trials, stepped only where a trial changes it.

The trials of one bucket share one run of the program as it is (`_SharedBaseSweep`:
the base is stepped once per bucket, not once per trial) and step only the ops that can move a
clock. A trial runs only to the last op it touches (`_SharedBaseSweep.quick`): from there the
program is the base's, and the clock's rules are max-plus linear, so the step is read off
tails that one backward pass per run computes (what the compute time, each stream and each
pending collective add to the step from each slot on); where that figure is within NEAR_MS of
what decides, the exact run (on until trial and base run the same) decides (bucket_trials.py's `settle`). Up to
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

from ..cost.simulate import LAUNCH, OTHER, WAIT, Clock, Sweep
from .bucket_pieces import _compose, _Piece, _Scan


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
            if todo:
                t, exposed, level, peak, last = _step(todo, t, exposed, level, peak, last, free, pending, own, shared,
                                                      None)
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
            if todo:  # (a wait on what a run or a jumped piece launched: read there)
                t, _, level, peak, last = _step(todo, t, 0.0, level, peak, last, free, pending, own, shared,
                                                self if self.runs or self.jumped else None)
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


def _step(todo, t: float, exposed: float, level: int, peak: int, last: float, free: dict, pending: dict,
          own: dict, shared, walk: _Walk | None) -> tuple[float, float, int, int, float]:
    """`Clock.step`'s rules over the steps `todo` ((name, step) pairs) of one slot, on the
    caller's state (`_SharedBaseSweep.trial`'s and `_Walk.walk`'s locals: a method call per op
    on a Clock was most of a trial): returns the new (t, exposed, level, peak, last); `free`,
    `pending` and `own` (what it launched, and their ends) are updated in place, and a wait reads
    its launch's end in `own`, else in `shared`, else (`walk`) where one of the walk's runs or
    jumped pieces launched it. The same operations in the same order as `Clock.step`."""
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
            elif walk is not None:
                done, gathered = walk._wait_in_run(extra)
                if done is None:
                    done, gathered = walk._wait_in_piece(extra)
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
    return t, exposed, level, peak, last


def _in_flight(clock, name: str, s: tuple, at: int, launched: dict, waited: dict) -> None:
    """Record where stepping `name` at slot `at` launches a collective, or waits one `clock` has in flight."""
    if s[0] == LAUNCH:
        launched[name] = at
    elif s[0] == WAIT and s[3] in clock.pending:
        waited[s[3]] = at
