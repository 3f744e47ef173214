"""hide: cost-guided anchoring — launch each gather as late as it can be and still be hidden.

Usable in place of `anchor` (then budget, prefetch, sink as usual). With compute times from
the cost model, sweep each communication stream backwards from its last gather: a gather
must finish by its first consumer and before the gather after it on the stream starts (the
stream runs in launch order), and must not overlap the other collectives of the stream,
which stay where they are. Its anchor is the last node at or before that start time. A
gather already hidden where it is stays; one that cannot be hidden launches at its earliest
legal slot and says so.
"""

from __future__ import annotations

import bisect
import dataclasses
from itertools import accumulate, repeat
from operator import attrgetter

import attrs

from ..cost.model import CostAnalysis
from ..cost.simulate import stream_of
from ..ir import Launch, Program, Role
from ..ir.holds import HIDDEN, NOT_HIDDEN  # NOT_HIDDEN: still anchored, as early as legal exposes the least
from .base import ModulePass, PassContext, PassResult, register_pass
from .feeders import Feeders
from .gathers import Gather, GatherAnalysis, held_by_lowering
from .memory_cap import MemoryAnalysis



@register_pass
@dataclasses.dataclass(frozen=True)
class Hide(ModulePass):
    name = "hide"
    preserves = (GatherAnalysis, Feeders, CostAnalysis, MemoryAnalysis)  # it sets anchors, moves nothing
    reorders_only = True

    def apply(self, ctx: PassContext, program: Program) -> PassResult:
        gathers = ctx.get(GatherAnalysis, program)
        ms = ctx.get(CostAnalysis, program).ms
        schedule = program.schedule
        # compute-stream time at which each slot is reached. Launches cost the compute stream
        # nothing; what the scheduling passes move (chains' casts and packs, realizations'
        # copy-outs) is left off the clock, so that it reads the same on a second run over this
        # pipeline's own output (those ops are small next to the compute that hides gathers)
        chained = {n for g in gathers.gathers for n in (*g.chain, *g.realization)}
        gather_names = {g.launch for g in gathers.gathers}
        # the launches, picked out of the node table in its own order (in C), and the costs in
        # schedule order, read in C: a lookup of each op by name in schedule order (a cache miss
        # or two per node at 100k nodes, 40 ms) cost more than the launches' positions. Adding
        # 0.0 for an op left off the clock leaves every sum as it was
        names = schedule.names()
        get = ms.get
        all_launches = program.ops_of(Launch)
        # one lookup per name, in a copy of the costs with the ops off the clock at 0.0 (a copy
        # of a dict is a copy of its tables, no lookup per name; looking each name up in the
        # costs and then in a table of those off the clock was twice the lookups, each a cache
        # miss or two at 100k nodes)
        clock = dict(ms)
        clock.update(zip(chained, repeat(0.0)))
        clock.update(zip(map(_NAME, all_launches), repeat(0.0)))
        costs = list(map(clock.get, names, repeat(0.0)))
        # (position, name, op) of the launches that are no gather, in order
        launches = sorted((schedule.index(op.name), op.name, op) for op in all_launches if op.name not in gather_names)
        start_at = list(accumulate(costs, initial=0.0))[:-1]

        # each gather with its launch op, read once: the loop below replaces a gather's op only
        # after reading it (an op's lookup by name costs a cache miss or more at 100k nodes)
        streams: dict[str, list[tuple[Gather, Launch]]] = {}
        for g in gathers.gathers:
            op = program.op(g.launch)
            streams.setdefault(stream_of(op), []).append((g, op))
        fixed: dict[str, list[tuple[float, float]]] = {}
        for at, name, op in launches:
            if op.role is Role.REDUCE_SCATTER:
                # timed from the slot just after what it reads or follows: where
                # overlap-reduce-scatter hoists it, so a second run over this pipeline's
                # own output sees the stream busy at the same times
                at = _earliest(program, ctx.get(Feeders, program).of(name))
            begin = start_at[at]
            fixed.setdefault(stream_of(op), []).append((begin, begin + get(name, 0.0)))

        stats = {"anchored": 0, HIDDEN: 0, NOT_HIDDEN: 0, "held": 0}
        changed = False
        # launches are planned in the order the gathers are needed (first consumer, then name:
        # no scheduling pass moves a consumer), not the entry order, which prefetch changes:
        # sink stacks realizations in this order, so a second run stacks them the same way
        # (each first consumer's position read once: a lookup costs a cache miss or more at 100k nodes)
        needed = {g.launch: schedule.index(g.first_consumer) for g in gathers.gathers}
        ctx.planned = tuple(g.launch for g in sorted(gathers.gathers, key=lambda g: (needed[g.launch], g.launch)))
        for stream, members in streams.items():
            busy = sorted(fixed.get(stream, []))
            limit = float("inf")
            # latest deadline first; equal deadlines by name, which no reordering changes
            for g, op in sorted(members, key=lambda m: (needed[m[0].launch], m[0].launch), reverse=True):
                if held_by_lowering(op):
                    stats["held"] += 1  # lowering held it: leave its reason
                    continue
                duration = ms.get(g.launch, 0.0)
                finish = min(start_at[needed[g.launch]], limit)
                begin = _fit(finish - duration, duration, busy)
                earliest = start_at[_earliest_slot(program, g)]
                reason = None
                if begin < earliest:
                    begin, reason = earliest, NOT_HIDDEN
                slot = max(bisect.bisect_right(start_at, begin) - 1, 0)
                here = min(map(schedule.index, g.chain))
                # the stream is its from the launch slot it gets (the same on a second run)
                limit = start_at[min(slot, here)]
                if slot >= here:  # it stays where it is
                    anchor, hold = None, reason or HIDDEN
                    stats[reason or HIDDEN] += 1
                else:
                    anchor, hold = schedule[slot], None
                    stats["anchored"] += 1
                    stats[NOT_HIDDEN] += reason is not None  # anchored anyway: earliest exposes least
                if op.anchor != anchor or op.hold != hold:  # (a new op only where one changes)
                    program.replace(attrs.evolve(op, anchor=anchor, hold=hold))
                    changed = True
        return PassResult(changed, stats)


_NAME = attrgetter("name")


def _fit(begin: float, duration: float, busy: list[tuple[float, float]]) -> float:
    """The latest start <= `begin` at which [start, start + duration) avoids the busy spans."""
    i = bisect.bisect_right(busy, (begin + duration, float("inf")))
    while i > 0:
        lo, hi = busy[i - 1]
        if hi <= begin:
            break
        begin = lo - duration  # overlaps: finish before that collective starts
        i -= 1
    return begin


def _earliest_slot(program: Program, g: Gather) -> int:
    """The slot just after the chain's latest predecessor (what prefetch can reach at best)."""
    return _earliest(program, set(g.chain))


def _earliest(program: Program, chain: set[str]) -> int:
    """The slot just after the latest predecessor of `chain` outside it."""
    pos = program.schedule.index
    pred = program.predecessors
    return max((pos(p) + 1 for n in chain for p in pred[n] if p not in chain), default=0)
