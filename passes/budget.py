"""budget: hold back gathers whose early launch would put too many unsharded bytes in flight.

A prefetched gather is in flight from its new launch to its first consumer. Gathers are
admitted in order; one that would push the in-flight total over `max-in-flight-gb`, or
whose size is unknown, gets a `hold`. The in-flight curve lives in a max segment tree over
gap/node slots of the starting order, so each check is O(log N).
"""

from __future__ import annotations

import dataclasses

import attrs

from ..ir import Launch, Program
from .base import ModulePass, PassContext, PassResult, check_budget, register_pass
from .gathers import Gather, GatherAnalysis
from .placement import NO_EARLIER_SLOT, plan

OVER_BUDGET = "over budget"
UNKNOWN_SIZE = "unknown size"


class MaxTree:
    """Range add, range max over [0, n) (bottom-up lazy segment tree)."""

    def __init__(self, n: int):
        self.n = max(1, n)
        self.h = self.n.bit_length()
        self.t = [0] * (2 * self.n)
        self.d = [0] * self.n

    def _apply(self, p: int, value: int) -> None:
        self.t[p] += value
        if p < self.n:
            self.d[p] += value

    def _build(self, p: int) -> None:
        t, d = self.t, self.d
        while p > 1:
            p >>= 1
            t[p] = max(t[2 * p], t[2 * p + 1]) + d[p]

    def _push(self, p: int) -> None:
        for s in range(self.h, 0, -1):
            i = p >> s
            if i and self.d[i]:
                self._apply(2 * i, self.d[i])
                self._apply(2 * i + 1, self.d[i])
                self.d[i] = 0

    def add(self, lo: int, hi: int, value: int) -> None:
        lo += self.n
        hi += self.n
        l0, r0 = lo, hi
        while lo < hi:
            if lo & 1:
                self._apply(lo, value)
                lo += 1
            if hi & 1:
                hi -= 1
                self._apply(hi, value)
            lo >>= 1
            hi >>= 1
        self._build(l0)
        self._build(r0 - 1)

    def max(self, lo: int, hi: int) -> int:
        lo += self.n
        hi += self.n
        self._push(lo)
        self._push(hi - 1)
        best = 0
        while lo < hi:
            if lo & 1:
                best = max(best, self.t[lo])
                lo += 1
            if hi & 1:
                hi -= 1
                best = max(best, self.t[hi])
            lo >>= 1
            hi >>= 1
        return best


class _InFlight:
    """Slots: 2i+1 is node i of the starting order (of nodes no chain moves), 2i the gap before it."""

    def __init__(self, program: Program, analysis: GatherAnalysis, limit: int):
        chains = {n for g in analysis.gathers for n in g.chain}
        self.gap: dict[str, int] = {}
        self.fixed: dict[str, int] = {}
        pending = []
        for name in program.schedule:
            if name in chains:
                pending.append(name)
            else:
                slot = 2 * len(self.fixed)
                self.fixed[name] = slot + 1
                for chained in pending:
                    self.gap[chained] = slot
                pending.clear()
                self.gap[name] = slot
        end = 2 * len(self.fixed)
        for chained in pending:
            self.gap[chained] = end
        self.tree = MaxTree(end + 1)
        self.limit = limit
        self.program = program
        self.live: dict[str, tuple[int, int]] = {}  # launch -> its span in the tree now

    def keep(self, g: Gather) -> None:
        """Count a gather an earlier run moved as in flight where it is now."""
        nbytes = self.program.op(g.launch).nbytes
        if nbytes is not None:
            self.live[g.launch] = self.span(g, g.launch)
            self.tree.add(*self.live[g.launch], nbytes)

    def span(self, g: Gather, target: str) -> tuple[int, int]:
        # in flight from the gap its launch lands in until (not including) its first consumer
        return self.gap[target], self.fixed.get(g.first_consumer, self.gap[g.first_consumer] + 1)

    def admit(self, g: Gather, target: str) -> str | None:
        nbytes = self.program.op(g.launch).nbytes
        if nbytes is None:
            return UNKNOWN_SIZE
        old = self.live.pop(g.launch, None)  # moved by an earlier run, moving again: count it once
        if old is not None:
            self.tree.add(*old, -nbytes)
        lo, hi = self.span(g, target)
        if self.tree.max(lo, hi) + nbytes > self.limit:
            if old is not None:
                self.tree.add(*old, nbytes)
                self.live[g.launch] = old
            return OVER_BUDGET
        self.tree.add(lo, hi, nbytes)
        self.live[g.launch] = (lo, hi)
        for name in g.chain:  # the chain now sits in the target's gap
            self.gap[name] = lo
        return None


@register_pass
@dataclasses.dataclass(frozen=True)
class Budget(ModulePass):
    name = "budget"
    preserves = (GatherAnalysis,)
    reorders_only = True

    max_in_flight_gb: float = 1.0

    def __post_init__(self):
        check_budget(self.name, "max-in-flight-gb", self.max_in_flight_gb)

    def apply(self, ctx: PassContext, program: Program) -> PassResult:
        analysis = ctx.get(GatherAnalysis, program)
        limit = int(self.max_in_flight_gb * 2**30)
        stats = {"admitted": 0, OVER_BUDGET: 0, UNKNOWN_SIZE: 0, NO_EARLIER_SLOT: 0, "budget_bytes": limit}
        flight = _InFlight(program, analysis, limit)
        for g in analysis.gathers:  # gathers moved by an earlier run stay in flight
            if program.op(g.launch).prefetched:
                flight.keep(g)

        def admit(g: Gather, target: str) -> str | None:
            return OVER_BUDGET if limit == 0 else flight.admit(g, target)

        changed = False
        for g, _, reason in plan(program, analysis, program.schedule.copy(), admit):
            stats["admitted" if reason is None else reason] += 1
            if reason is not None:
                program.replace(attrs.evolve(program.op(g.launch), hold=reason))
                changed = True
        return PassResult(changed, stats)
