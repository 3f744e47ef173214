"""prefetch: move each anchored, unheld launch chain to its legal position before its anchor.

Gathers go one at a time in launch order, so a chain placed right after a predecessor lands
ahead of chains placed there before it. A chain with no earlier legal slot gets a `hold`.
Under a peak-memory cap, a chain that would go over it there goes to the earliest slot after
that fits (and that becomes its anchor), as `budget` plans it; a `hold` only where none does.
"""

from __future__ import annotations

import dataclasses

import attrs

from ..cost.model import CostAnalysis
from ..ir import Phase, Program
from .base import ModulePass, PassContext, PassResult, register_pass
from .feeders import Feeders
from .gathers import GatherAnalysis
from .memory_cap import OVER_PEAK_CAP, headroom
from .placement import LATER_FOR_CAP, NO_EARLIER_SLOT, LaterForCap, NeedOrder, plan


@register_pass
@dataclasses.dataclass(frozen=True)
class Prefetch(ModulePass):
    name = "prefetch"
    preserves = (GatherAnalysis, Feeders, CostAnalysis)  # costs do not depend on the order
    reorders_only = True
    after = ("anchor", "hide", "budget")

    def apply(self, ctx: PassContext, program: Program) -> PassResult:
        analysis = ctx.get(GatherAnalysis, program)
        stats = {"forward": 0, "backward": 0, NO_EARLIER_SLOT: 0, "moved_nodes": 0}
        room = headroom(ctx, program)  # the joint peak-memory cap, when one is in force

        def admit(g, target: str) -> str | None:
            if room is None:
                return None
            move = room.earlier(g.chain, target)
            if move is None:
                return OVER_PEAK_CAP
            move.take()
            return None

        # over the cap at its anchor (budget, when it ran first, moved such anchors already):
        # the earliest slot after it that fits
        later = LaterForCap(room, program.schedule) if room is not None else None

        if room is not None:
            stats[OVER_PEAK_CAP] = 0
            stats[LATER_FOR_CAP] = 0
        planned, ctx.placed = ctx.placed, None
        need_order = None
        if room is None and planned is not None and planned.valid(program, analysis):
            # budget just planned these very moves on a copy (passes/budget.py, `Planned`): take them
            program.schedule.adopt(planned.order)
            moves = ((g, None, None) for g in planned.admitted)
        else:
            # after hide, what is needed after a chain moved later for the cap launches after it
            need_order = NeedOrder(program, program.schedule) if later is not None and ctx.planned is not None else None
            moves = plan(program, analysis, program.schedule, admit, later, need_order)
        for g, target, reason in moves:
            op = program.op(g.launch)
            if reason is not None:  # NO_EARLIER_SLOT, or over the peak cap: it admits everything else unheld
                stats[reason] += 1
                program.replace(attrs.evolve(op, hold=reason))
                continue
            stats["forward" if g.phase is Phase.FORWARD else "backward"] += 1
            stats["moved_nodes"] += len(g.chain)
            if later is not None and later.took(g, target):  # its anchor is where it went
                stats[LATER_FOR_CAP] += 1
                op = attrs.evolve(op, anchor=target)
            elif need_order is not None and need_order.took(g, target):
                op = attrs.evolve(op, anchor=target)
            program.replace(attrs.evolve(op, prefetched=True))
        return PassResult(stats["forward"] + stats["backward"] > 0 or stats[NO_EARLIER_SLOT] > 0
                          or stats.get(OVER_PEAK_CAP, 0) > 0, stats)
