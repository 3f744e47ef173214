"""budget: hold back gathers whose early launch would put too many unsharded bytes in flight.

A prefetched gather is in flight from its new launch to its first consumer. Gathers are
admitted in order; one that would push the in-flight total over `max-in-flight-gb`, or
whose size is unknown, gets a `hold`. Under a peak-memory cap, one whose early launch would go
over the cap is anchored instead at the earliest slot after its anchor where it fits (a partial
prefetch: where it was, it often launches behind collectives moved up since, and waits on them);
a `hold` only where no slot before it fits. After `hide` (the cost-guided pipelines; the reference,
anchored by `anchor`, keeps HyperParallel's hold), likewise one over the budget at its anchor goes
to the earliest slot after it where it fits the budget (`later for budget`): held where it was, it
launched behind the gathers admitted after it, needed later, and waited on all of them (a
generated graph of 10k nodes: 0.37 ms exposed on one gather, 4.5 ms at 30k). The in-flight curve
lives in a max segment tree over gap/node slots of the starting order, so each check is O(log N).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable

import attrs

from ..cost.model import CostAnalysis
from ..ir import Launch, Program, Schedule
from ..ir.holds import OVER_BUDGET, OVER_PEAK_CAP, UNKNOWN_SIZE
from .base import ModulePass, PassContext, PassResult, check_budget, option, register_pass
from .feeders import Feeders
from .gathers import Gather, GatherAnalysis
from .memory_cap import MemoryAnalysis, headroom
from .maxtree import MaxTree  # order-gathers and overlap-reduce-scatter import it from here too
from .placement import LATER_FOR_CAP, NO_EARLIER_SLOT, LaterForCap, NeedOrder, earliest_fit, plan

LATER_FOR_BUDGET = "later for budget"  # statistic: anchored over the budget, moved to the earliest slot after that fits
AFTER_MOVED_LATER = "after one moved later"  # statistic: needed after a chain moved later, launched after it


class _InFlight:
    """Slots: 2i+1 is node i of the starting order (of nodes no chain moves), 2i the gap before it.

    Budget plans on a copy, so the program's schedule stays the starting order throughout: a
    node's slot is read off its position there (less the chained nodes before it), and only
    chained nodes, whose gap changes as they are placed, are kept in a table.
    """

    def __init__(self, program: Program, analysis: GatherAnalysis, limit: int, ops: dict[str, Launch]):
        self.index = program.schedule.index
        self.ops = ops  # launch -> its op (Budget.apply's table: the bytes are read there, not by name)
        chained = {n for g in analysis.gathers for n in g.chain}
        self.chained_at = sorted(map(self.index, chained))
        # the k-th chained node, at position p, has p - k unchained nodes before it: it sits in
        # the gap before the next of them (or in the last gap, after all of them)
        self.gap: dict[str, int] = {program.schedule[p]: 2 * (p - k) for k, p in enumerate(self.chained_at)}
        end = 2 * (len(program.schedule) - len(chained))
        self.tree = MaxTree(end + 1)
        self.limit = limit
        self.program = program
        self.live: dict[str, tuple[int, int]] = {}  # launch -> its span in the tree now

    def _fixed(self, name: str) -> int:
        """The slot of an unchained node."""
        at = self.index(name)
        return 2 * (at - bisect.bisect_left(self.chained_at, at)) + 1

    def _gap(self, name: str) -> int:
        return self.gap[name] if name in self.gap else self._fixed(name) - 1

    def keep(self, g: Gather) -> None:
        """Count a gather an earlier run moved as in flight where it is now."""
        nbytes = self.ops[g.launch].nbytes
        if nbytes is not None:
            self.live[g.launch] = self.span(g, g.launch)
            self.tree.add(*self.live[g.launch], nbytes)

    def span(self, g: Gather, target: str) -> tuple[int, int]:
        # in flight from the gap its launch lands in until (not including) its first consumer
        consumer = g.first_consumer
        return self._gap(target), (self.gap[consumer] + 1 if consumer in self.gap else self._fixed(consumer))

    def admit(self, g: Gather, target: str) -> str | None:
        nbytes = self.ops[g.launch].nbytes
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

    def fits(self, g: Gather, target: str) -> bool:
        """Whether `admit(g, target)` would fit the budget (a probe: counts nothing; a gather an
        earlier run moved counts where it is too, so a probe may refuse what admit takes)."""
        nbytes = self.ops[g.launch].nbytes
        return nbytes is not None and self.tree.max(*self.span(g, target)) + nbytes <= self.limit


class LaterForBudget:
    """`plan`'s `later` for a chain over the budget at its anchor: the earliest slot after it on
    `schedule` where it fits the budget (and the peak cap, `room`, when one is in force), by a
    binary search (a later slot keeps it in flight over a sub-span); over the peak cap, as
    `LaterForCap`. `took(g, target)`: whether a chain placed at `target` went there so."""

    def __init__(self, flight: _InFlight, schedule: Schedule, cap: LaterForCap | None):
        self.flight, self.schedule, self.cap = flight, schedule, cap
        self.offered: dict[str, str] = {}

    def __call__(self, g: Gather, reason: str, lo: int, hi: int) -> int | None:
        if reason != OVER_BUDGET:
            return self.cap(g, reason, lo, hi) if self.cap is not None else None
        schedule, room = self.schedule, self.cap.room if self.cap is not None else None

        def fits(target: str) -> bool:
            return self.flight.fits(g, target) and (room is None or room.fits_earlier(g.chain, target))

        at = earliest_fit(fits, self.flight.program, schedule, lo, hi)
        if at is not None:
            self.offered[g.launch] = schedule[at]
        return at

    def took(self, g: Gather, target: str | None) -> bool:
        return target is not None and (self.offered.get(g.launch) == target
                                       or (self.cap is not None and self.cap.took(g, target)))


@register_pass
@dataclasses.dataclass(frozen=True)
class Budget(ModulePass):
    name = "budget"
    preserves = (GatherAnalysis, Feeders, MemoryAnalysis, CostAnalysis)  # it plans on a copy: the schedule stays
    reorders_only = True
    after = ("anchor", "hide")

    max_in_flight_gb: float = option(1.0, "most unsharded GiB launched early and not yet consumed")

    def __post_init__(self):
        check_budget(self.name, "max-in-flight-gb", self.max_in_flight_gb)

    def apply(self, ctx: PassContext, program: Program) -> PassResult:
        analysis = ctx.get(GatherAnalysis, program)
        limit = int(self.max_in_flight_gb * 2**30)
        stats = {"admitted": 0, OVER_BUDGET: 0, UNKNOWN_SIZE: 0, NO_EARLIER_SLOT: 0, "budget_bytes": limit}
        # each gather's launch op, read once (a lookup by name costs a cache miss or more at 100k
        # nodes; this pass read each three to five times) and kept current as it replaces them
        ops = {g.launch: program.op(g.launch) for g in analysis.gathers}
        flight = _InFlight(program, analysis, limit, ops)
        order = program.schedule.copy()  # planned on, not kept: prefetch makes the moves
        room = headroom(ctx, program, order)  # the joint peak-memory cap, when one is in force
        if room is not None:
            stats[OVER_PEAK_CAP] = 0
            stats[LATER_FOR_CAP] = 0
        for g in analysis.gathers:  # gathers moved by an earlier run stay in flight
            if ops[g.launch].prefetched:
                flight.keep(g)

        def admit(g: Gather, target: str) -> str | None:
            if limit == 0:
                return OVER_BUDGET
            move = room.earlier(g.chain, target) if room is not None else None
            if room is not None and move is None:
                return OVER_PEAK_CAP
            reason = flight.admit(g, target)
            if reason is None and move is not None:
                move.take()
            return reason

        # over the peak cap or the budget at its anchor: the earliest slot after it that fits (a
        # partial prefetch), not where it was, which is often behind the collectives moved up since
        cap_later = LaterForCap(room, order) if room is not None else None
        later = cap_later
        need_order = None
        if limit > 0 and ctx.planned is not None:  # after hide
            later = LaterForBudget(flight, order, cap_later)
            stats[LATER_FOR_BUDGET] = 0
            # and what is needed after a chain moved later launches after it (placement.NeedOrder)
            need_order = NeedOrder(program, order, ops.__getitem__)
            stats[AFTER_MOVED_LATER] = 0

        def mark(g: Gather, **changes) -> None:  # the program's op and this pass's table alike
            op = ops[g.launch] = attrs.evolve(ops[g.launch], **changes)
            program.replace(op)

        changed = False
        admitted = []
        for g, target, reason in plan(program, analysis, order, admit, later, need_order):
            stats["admitted" if reason is None else reason] += 1
            if reason is not None:
                mark(g, hold=reason)
                changed = True
            else:
                admitted.append(g)
                if later is not None and later.took(g, target):  # prefetch moves it there
                    for_cap = cap_later is not None and cap_later.took(g, target)
                    stats[LATER_FOR_CAP if for_cap else LATER_FOR_BUDGET] += 1
                    mark(g, anchor=target)
                    changed = True
                elif need_order is not None and need_order.took(g, target):  # so prefetch moves it there
                    stats[AFTER_MOVED_LATER] += 1
                    mark(g, anchor=target)
                    changed = True
        # prefetch, run next on this program, would make these very moves: hand it the plan
        # (budget moves no op of the program: its order is the one planned on)
        ctx.placed = Planned(program, analysis, program.schedule.names(), _marks(analysis, ops.__getitem__), order,
                             tuple(admitted)) if room is None else None
        return PassResult(changed, stats)


def _marks(analysis: GatherAnalysis, op_of: Callable[[str], Launch]) -> list[tuple[str | None, str | None]]:
    """What `plan` reads of each gather's launch op (`op_of(launch)`): its anchor and hold."""
    return [(op.anchor, op.hold) for op in map(op_of, (g.launch for g in analysis.gathers))]


@attrs.frozen(eq=False)
class Planned:
    """The moves budget planned, for prefetch to take instead of planning them again.

    Prefetch plans with the same `plan`, on the same order, gathers, anchors and holds (budget
    held every gather it did not admit, and prefetch skips held ones), so it would move exactly
    `admitted`, to exactly `order`, as long as nothing changed in between: `valid` checks that the
    program is the one planned on, the gather analysis the same object (a pass that rewrote the
    program dropped it), its order and every gather's anchor and hold as budget left them, and no
    peak cap in force (its headroom checks are made per move, by each pass).
    """

    program: Program
    analysis: GatherAnalysis
    before: list[str]  # the program's order when budget planned
    marks: list[tuple[str | None, str | None]]
    order: Schedule
    admitted: tuple[Gather, ...]

    def valid(self, program: Program, analysis: GatherAnalysis) -> bool:
        return (program is self.program and analysis is self.analysis
                and program.schedule.names() == self.before and _marks(analysis, program.op) == self.marks)
