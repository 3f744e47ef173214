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
  moving down: what it reads stays live until there) check a move in O(log N) and count it
  when taken. Both over-estimate (a moved op's old allocation stays counted), so what fits
  here fits in simulation.
- **exactly**, for rewrites: `over_cap(ctx, trial)` simulates a rewritten copy's memory.

A move or rewrite that would go over the cap is held, with the hold reason `over peak cap`
(ir/holds.py). The PassManager checks the simulated peak after every pass that changed the
program while a cap is in force, and fails (naming the pass) if it is over the cap and over
the peak the program had when the cap was set (an input already over the cap is a note, not an
error: passes then only hold back what would raise the peak further where it is over).
"""

from __future__ import annotations

import dataclasses
import math

import attrs

from ..cost.model import STATIC
from ..cost.simulate import MemoryProfile, memory_profile
from ..ir import Program, View, Wait
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
    if cap is None:
        return None
    profile = ctx.get(MemoryAnalysis, program).profile
    if profile.peak_bytes > max(cap.limit_bytes, cap.set_at_bytes):
        return (f"simulated peak memory {profile.peak_bytes} B (at %{profile.peak_at}) is over the cap of "
                f"{int(cap.limit_bytes)} B ({cap.given_by}; {cap.set_at_bytes} B when it was set)")
    return None


def headroom(ctx: PassContext, program: Program) -> Headroom | None:
    """The incremental check over `program`'s schedule as it is now (None: no cap in force)."""
    limit = cap_bytes(ctx)
    if limit is None:
        return None
    return Headroom(program, ctx.get(MemoryAnalysis, program).profile, limit)


class Headroom:
    """Live bytes over the slots of the order a pass started from, checked and raised per move.

    Slot i is the i-th op of that order; an op a move placed just before `target` sits in
    target's slot from then on. Every move the pass makes must go through `earlier`, `later`
    or `moved`, so that slots stay where the ops are.
    """

    def __init__(self, program: Program, profile: MemoryProfile, limit: float):
        self.program, self.profile, self.limit = program, profile, limit
        self.tree = MaxTree.of(list(profile.live))
        self._pos = {n: i for i, n in enumerate(profile.order)}
        self.at: dict[str, int] = {}
        self.refused = 0  # moves that did not fit

    def slot(self, name: str) -> int:
        at = self.at.get(name)
        return self._pos[name] if at is None else at

    def fits(self, lo: int, hi: int, nbytes: int) -> bool:
        return nbytes <= 0 or lo >= hi or self.tree.max(lo, hi) + nbytes <= self.limit

    def earlier(self, names, target: str) -> Move | None:
        """`names` (a launch chain) moving up to just before `target`: their results are live
        from target's slot through their old ones. The move if it fits, else None."""
        lo = self.slot(target)
        hi = max(map(self.slot, names)) + 1
        alloc = self.profile.alloc
        move = Move(self, tuple(names), lo, hi, sum(alloc.get(n, 0) for n in names), lo)
        return self._checked(move)

    def later(self, name: str, target: str) -> Move | None:
        """`name` moving down to just before `target`: the storage it reads (a view or wait
        reads nothing, as in the simulator) stays live from its slot to target's."""
        lo, hi = self.slot(name), self.slot(target)
        op = self.program.op(name)
        nbytes = 0
        if not isinstance(op, (View, Wait)):
            root, alloc = self.profile.root, self.profile.alloc
            roots = {root.get(o, o) for o in op.operands}
            nbytes = sum(alloc.get(r, 0) for r in roots if not isinstance(self.program.op(r), STATIC))
        return self._checked(Move(self, (name,), lo, hi, nbytes, hi))

    def _checked(self, move: Move) -> Move | None:
        if self.fits(move.lo, move.hi, move.nbytes):
            return move
        self.refused += 1
        return None

    def moved(self, names, target: str) -> None:
        """Record a move that adds nothing live (a wait)."""
        at = self.slot(target)
        for n in names:
            self.at[n] = at


@attrs.define
class Move:
    """A checked move: `take()` counts its bytes over [lo, hi) and puts its ops in `to`."""

    room: Headroom
    names: tuple[str, ...]
    lo: int
    hi: int
    nbytes: int
    to: int
    _old: dict[str, int | None] | None = None

    def take(self) -> None:
        if self.nbytes > 0 and self.lo < self.hi:
            self.room.tree.add(self.lo, self.hi, self.nbytes)
        self._old = {n: self.room.at.get(n) for n in self.names}
        for n in self.names:
            self.room.at[n] = self.to

    def undo(self) -> None:
        """Take it back (after `take`)."""
        if self.nbytes > 0 and self.lo < self.hi:
            self.room.tree.add(self.lo, self.hi, -self.nbytes)
        for n, at in (self._old or {}).items():
            if at is None:
                self.room.at.pop(n, None)
            else:
                self.room.at[n] = at


def with_cap(pipeline: str, max_peak_gb: float | None = None, max_peak_increase_gb: float | None = None) -> str:
    """`pipeline` with a `memory-cap` first when either is given (the API's and CLI's options;
    a bad value is a ConfigError naming the option)."""
    if max_peak_gb is None and max_peak_increase_gb is None:
        return pipeline
    cap = MemoryCap(max_peak_gb=0.0 if max_peak_gb is None else max_peak_gb,
                    max_peak_increase_gb=0.0 if max_peak_increase_gb is None else max_peak_increase_gb)
    return f"{cap},{pipeline}"
