"""memory-cap: one hard cap on the simulated peak memory, honoured by every pass that raises it.

`memory-cap{max-peak-gb=X}` caps the peak at X GiB; `memory-cap{max-peak-increase-gb=Y}` at the
peak of the program where it runs plus Y GiB; both: the smaller; neither: that peak itself (no
pass may raise it). It changes nothing in the program: it records the cap in the PassContext,
for every pass after it. The API's `schedule(..., max_peak_gb=, max_peak_increase_gb=)` and the
CLI's `--max-peak-gb` / `--max-peak-increase-gb` put it first in the pipeline.

"Peak" is `cost.simulate`'s: live bytes after each op's allocation, in schedule order
(`memory_profile`, which needs no costs). Passes consult the cap in one of two ways:

- **incrementally**, for passes that move ops: `headroom(ctx, program)` is the live-bytes curve
  of the order the pass started from in a max segment tree; `earlier(nodes, target)` (a launch
  chain moving up: its results are live from the target on) and `later(node, target)` (an op
  moving down: its result is live later, and what it is the last to keep alive stays live
  until there — for a wait, its collective's inputs and results, by the simulator's own rule
  `keeps_alive`) check a move in O(log N) and count it when taken. The counts never under-estimate
  (a read moved earlier still counts its storage as released where it was), so what fits here
  fits in simulation (`earlier_all`: several chains, each to its own target, at once); a move that does not fit the counts is checked again against the exact
  curve of the order as it is then (a refresh: O(N), a few per pass).
- **exactly**, for rewrites: `over_cap(ctx, trial)` simulates a rewritten copy's memory.

A move or rewrite that would go over the cap is held, with the hold reason `over peak cap`
(ir/holds.py). The PassManager checks the simulated peak after every pass that changed the
program while a cap is in force, and fails (naming the pass) if it is over the cap and over
the peak the program had when the cap was set (an input already over the cap is a note, not an
error: passes then only hold back what would raise the peak further where it is over).

**Final peak first** (`try-unchecked`, on by default): a pass mid-pipeline sees the memory of
the order as it is then, before later passes (sink, overlap-reduce-scatter) lower it, so a
checked move can be held that the final schedule would fit. So the PassManager first runs the
passes after `memory-cap` with their moves unchecked (`PeakCap.checks_moves` False: `headroom`
gives None and no pass's result is checked; rewrites still check the cap exactly, as they see
the whole program) and keeps that result when its final simulated peak is within the cap:
then the capped schedule is the uncapped one wherever that fits, and no move is held for the
cap. Otherwise it restores the program as `memory-cap` left it and runs them again with every
move checked (keeping the first result only when both end over the cap and it is the lower).
"""

from __future__ import annotations

import dataclasses
import math

import attrs

from ..cost.model import STATIC
from ..cost.simulate import MemoryProfile, keeps_alive, memory_profile, op_getter
from ..ir import Program, Schedule
from ..ir.holds import OVER_PEAK_CAP  # noqa: F401  (passes import the reason from here too)
from .base import Analysis, ModulePass, PassContext, PassResult, check_budget, option, register_pass
from .maxtree import MaxTree

GIB = 1 << 30


@attrs.frozen
class MemoryAnalysis(Analysis):
    """The memory profile of the program's schedule (a pass that moves nothing preserves it)."""

    profile: MemoryProfile

    @classmethod
    def compute(cls, program: Program, ctx=None) -> MemoryAnalysis:
        return cls(memory_profile(program))


@attrs.frozen
class PeakCap:
    """The cap in force: `limit_bytes`, and the simulated peak when it was set (`set_at_bytes`)."""

    limit_bytes: float
    set_at_bytes: int
    given_by: str   # the memory-cap pass's text, for messages
    # False while the manager tries the passes after memory-cap with their moves unchecked (the
    # final peak decides); rewrites check the cap either way
    checks_moves: bool = True


def resolve_cap(max_peak_gb: float, max_peak_increase_gb: float, peak_bytes: int) -> float:
    """The cap in bytes: max_peak_gb when set, else or also (the smaller) peak + increase."""
    cap = max_peak_gb * GIB if max_peak_gb > 0 else math.inf
    if max_peak_gb == 0 or max_peak_increase_gb > 0:
        cap = min(cap, peak_bytes + max_peak_increase_gb * GIB)
    return cap


def rewrite_cap(max_peak_gb: float, max_peak_increase_gb: float, input_peak: int, joint: float | None) -> float:
    """The peak a rewriting pass (bucket, unshard) may reach: its own cap, or the joint one
    (`memory-cap`) in force when its own options are unset; its own options only tighten a joint cap."""
    own = resolve_cap(max_peak_gb, max_peak_increase_gb, input_peak)
    if joint is None:
        return own
    return joint if max_peak_gb == 0 and max_peak_increase_gb == 0 else min(own, joint)


def rewrite_stats(before, after, cap: float) -> dict:
    """A rewriting pass's statistics from the simulations before and after it: peak, cap, step, exposed."""
    return {
        "peak_before_bytes": before.peak_bytes, "peak_after_bytes": after.peak_bytes,
        "cap_bytes": cap if cap != float("inf") else None,
        "step_before_ms": round(before.step_ms, 6), "step_after_ms": round(after.step_ms, 6),
        "exposed_before_ms": round(before.exposed_ms, 6), "exposed_after_ms": round(after.exposed_ms, 6),
    }


@register_pass
@dataclasses.dataclass(frozen=True)
class MemoryCap(ModulePass):
    name = "memory-cap"
    reorders_only = True

    max_peak_gb: float = option(0.0, "cap on the simulated peak memory of every later pass's result, in GiB "
                                     "(0: none; the peak here plus max-peak-increase-gb applies)")
    max_peak_increase_gb: float = option(0.0, "how far, in GiB, later passes may raise the simulated peak over "
                                              "its value here (with max-peak-gb too: the smaller cap wins)")
    try_unchecked: bool = option(True, "run the later passes first with their moves unchecked against the cap "
                                       "(rewrites still check it) and keep that result when its final peak fits; "
                                       "only otherwise run them again with every move checked")

    def __post_init__(self):
        check_budget(self.name, "max-peak-gb", self.max_peak_gb)
        check_budget(self.name, "max-peak-increase-gb", self.max_peak_increase_gb)

    def apply(self, ctx: PassContext, program: Program) -> PassResult:
        peak = ctx.get(MemoryAnalysis, program).profile.peak_bytes
        limit = resolve_cap(self.max_peak_gb, self.max_peak_increase_gb, peak)
        ctx.peak_cap = PeakCap(limit, peak, str(self))
        if peak > limit:
            program.notes.append(f"the simulated peak memory here ({peak} B) is over the cap ({int(limit)} B, "
                                 f"{self}): passes hold back what would raise it further")
        return PassResult(False, {"cap_bytes": int(limit), "peak_bytes": peak})


def cap_bytes(ctx: PassContext | None) -> float | None:
    """The joint cap in force, in bytes (None: no cap)."""
    cap = getattr(ctx, "peak_cap", None)
    return None if cap is None else cap.limit_bytes


def over_cap(ctx: PassContext | None, trial: Program) -> bool:
    """Whether `trial` (a rewritten copy) simulates to a peak over the joint cap (never, without one)."""
    limit = cap_bytes(ctx)
    return limit is not None and memory_profile(trial).peak_bytes > limit


def check_peak(ctx: PassContext, program: Program) -> str | None:
    """What is wrong with `program`'s simulated peak under the cap in force (None: nothing)."""
    cap = getattr(ctx, "peak_cap", None)
    if cap is None or not cap.checks_moves:   # the final peak decides (`try-unchecked`)
        return None
    profile = ctx.get(MemoryAnalysis, program).profile
    if profile.peak_bytes > max(cap.limit_bytes, cap.set_at_bytes):
        return (f"simulated peak memory {profile.peak_bytes} B (at %{profile.peak_at}) is over the cap of "
                f"{int(cap.limit_bytes)} B ({cap.given_by}; {cap.set_at_bytes} B when it was set)")
    return None


def headroom(ctx: PassContext, program: Program, schedule: Schedule | None = None) -> Headroom | None:
    """The incremental check over the order the pass moves ops on: `schedule` (the program's
    own, unless the pass plans on a fresh copy of it), as it is now (None: no cap in force, or
    moves unchecked while the manager tries the final peak first)."""
    cap = getattr(ctx, "peak_cap", None)
    if cap is None or not cap.checks_moves:
        return None
    return Headroom(program, ctx.get(MemoryAnalysis, program).profile, cap.limit_bytes, schedule)


class Headroom:
    """Live bytes over the slots of an order, checked and raised per move.

    Slot i is the i-th op of the order the curve was read off; an op a move placed just before
    `target` sits in target's slot from then on (between the slot before and target's: what is
    live there is bounded by the slot before's count plus the move's own). Every move the pass
    makes must go through `earlier`, `earlier_all`, `later` or `later_all`, and be made in the schedule before the
    next check: a move that does not fit the counted curve is checked once more against the
    exact curve of the order as it is then (its counts over-estimate, e.g. a read moved earlier
    releases its storage earlier), at most once per few moves taken, so the work stays
    O(N) per refresh and a few refreshes per pass.
    """

    def __init__(self, program: Program, profile: MemoryProfile, limit: float, schedule: Schedule | None = None):
        self.program, self.limit, self.schedule = program, limit, schedule or program.schedule
        self._op_of = op_getter(program)
        self.refused = 0  # moves that did not fit
        self.taken = 0    # moves counted since the curve was read
        self.taken_in_all = 0
        self.refreshes = 0
        self._read(profile)

    def _read(self, profile: MemoryProfile) -> None:
        self.profile = profile
        self.tree = MaxTree.of(list(profile.live))
        self._pos = {n: i for i, n in enumerate(profile.order)}
        self.at: dict[str, int] = {}
        # the slot after which each storage is released (what its last reader or its free set)
        self.release = {root: i for i, roots in profile.releases.items() for root in roots}

    def slot(self, name: str) -> int:
        at = self.at.get(name)
        return self._pos[name] if at is None else at

    def earlier(self, names, target: str) -> Move | None:
        """`names` (a launch chain) moving up to just before `target`: each one's result is live
        from target's slot on instead of from its own. The move if it fits, else None."""
        return self._checked(lambda: self._earlier(names, target))

    def _earlier(self, names, target: str) -> Move:
        lo = self.slot(target)
        alloc = self.profile.alloc
        ranges = [(lo, self.slot(n), alloc[n]) for n in names if alloc.get(n, 0) > 0]
        return Move(self, {n: lo for n in names}, ranges)

    def earlier_all(self, chains) -> Move | None:
        """Several launch chains moving up at once, each `(names, target)` to just before its
        own target (order-gathers reordering a run): checked and counted together."""
        return self._checked(lambda: self._earlier_all(chains))

    def _earlier_all(self, chains) -> Move:
        slots, ranges = {}, []
        for names, target in chains:
            move = self._earlier(names, target)
            slots.update(move.slots)
            ranges += move.ranges
        return Move(self, slots, ranges)

    def fits_earlier(self, names, target: str) -> bool:
        """Whether `earlier(names, target)` fits the curve as counted now (counts nothing, reads
        no exact curve): a cheap probe for searching slots, each taken move checked by `earlier`."""
        return self._fits(self._earlier(names, target).ranges)

    def later(self, name: str, target: str) -> Move | None:
        """`name` moving down to just before `target`: its result is live from there on, and a
        storage it is the last to keep alive (`cost.simulate.keeps_alive`: an op its operands, a
        wait its collective's inputs and results) stays live until there. The move if it fits,
        else None."""
        return self._checked(lambda: self._later({name: target}))

    def later_all(self, targets: dict[str, str]) -> Move | None:
        """Several ops moving down at once, each to just before its target (a coalesced
        launch's waits: they keep the same inputs, live until the last of them)."""
        return self._checked(lambda: self._later(targets))

    def _later(self, targets: dict[str, str]) -> Move:
        root, alloc = self.profile.root, self.profile.alloc
        ranges, released, slots = [], {}, {}
        until: dict[str, int] = {}   # storage -> the latest slot a moved op keeps it alive to
        for name, target in targets.items():
            lo, hi = self.slot(name), self.slot(target)
            slots[name] = hi
            own = alloc.get(name, 0)
            if own and lo < hi - 1:
                ranges.append((lo, hi - 1, -own))
            for kept in keeps_alive(self.program.op(name), self._op_of):
                r = root.get(kept, kept)
                if until.get(r, -1) < hi:
                    until[r] = hi
        for r, hi in until.items():
            at = self.release.get(r)   # None: never released (a static, a returned result)
            if at is not None and at + 1 < hi and alloc.get(r, 0) > 0:
                ranges.append((at + 1, hi, alloc[r]))
                released[r] = hi - 1
        return Move(self, slots, ranges, released)

    def _checked(self, make) -> Move | None:
        move = make()
        if self._fits(move.ranges):
            return move
        if self.taken and self.refreshes < 4 + self.taken_in_all // 8:
            # the counts over-estimate: read the exact curve of the order as it is now
            self.refreshes += 1
            self._read(memory_profile(self.program, self.schedule.names()))
            self.taken = 0
            move = make()
            if self._fits(move.ranges):
                return move
        self.refused += 1
        return None

    def _fits(self, ranges) -> bool:
        """Whether the curve plus every range's bytes stays within the cap (ranges may overlap)."""
        if not ranges:
            return True
        cuts = sorted({c for lo, hi, _ in ranges for c in (lo, hi)})
        for a, b in zip(cuts, cuts[1:]):
            extra = sum(d for lo, hi, d in ranges if lo <= a and b <= hi)
            if extra > 0 and self.tree.max(a, b) + extra > self.limit:
                return False
        return True


@attrs.define
class Move:
    """A checked move: `take()` counts its bytes over its ranges and puts its ops in their slots."""

    room: Headroom
    slots: dict[str, int]                # each moved op -> the slot it sits in from then on
    ranges: list[tuple[int, int, int]]   # (lo, hi, bytes added over [lo, hi))
    released: dict[str, int] = attrs.Factory(dict)   # storage -> its new release slot
    _old: tuple | None = None   # (slots, release slots) before take

    def take(self) -> None:
        room = self.room
        for lo, hi, nbytes in self.ranges:
            if lo < hi:
                room.tree.add(lo, hi, nbytes)
        self._old = ({n: room.at.get(n) for n in self.slots}, {r: room.release.get(r) for r in self.released})
        room.at.update(self.slots)
        room.release.update(self.released)
        room.taken += 1
        room.taken_in_all += 1

    def undo(self) -> None:
        """Take it back (after `take`, before any other check)."""
        room = self.room
        for lo, hi, nbytes in self.ranges:
            if lo < hi:
                room.tree.add(lo, hi, -nbytes)
        at, release = self._old or ({}, {})
        for n, slot in at.items():
            if slot is None:
                room.at.pop(n, None)
            else:
                room.at[n] = slot
        room.release.update(release)
        room.taken = max(room.taken - 1, 0)   # a refresh in between already dropped it
        room.taken_in_all -= 1


def with_cap(pipeline: str, max_peak_gb: float | None = None, max_peak_increase_gb: float | None = None) -> str:
    """`pipeline` with a `memory-cap` first when either is given (the API's and CLI's options;
    a bad value is a ConfigError naming the option)."""
    if max_peak_gb is None and max_peak_increase_gb is None:
        return pipeline
    cap = MemoryCap(max_peak_gb=0.0 if max_peak_gb is None else max_peak_gb,
                    max_peak_increase_gb=0.0 if max_peak_increase_gb is None else max_peak_increase_gb)
    return f"{cap},{pipeline}"
