"""prefetch: move each anchored, unheld launch chain to its legal position before its anchor.

Gathers go one at a time in launch order, so a chain placed right after a predecessor lands
ahead of chains placed there before it. A chain with no earlier legal slot gets a `hold`.
"""

from __future__ import annotations

import dataclasses

import attrs

from ..ir import Phase, Program
from .base import ModulePass, PassContext, PassResult, register_pass
from .gathers import GatherAnalysis
from .placement import NO_EARLIER_SLOT, plan


@register_pass
@dataclasses.dataclass(frozen=True)
class Prefetch(ModulePass):
    name = "prefetch"
    preserves = (GatherAnalysis,)
    reorders_only = True
    after = ("anchor", "hide", "budget")

    def apply(self, ctx: PassContext, program: Program) -> PassResult:
        analysis = ctx.get(GatherAnalysis, program)
        stats = {"forward": 0, "backward": 0, NO_EARLIER_SLOT: 0, "moved_nodes": 0}
        for g, target, reason in plan(program, analysis, program.schedule):
            op = program.op(g.launch)
            if reason is not None:  # only NO_EARLIER_SLOT: prefetch admits everything unheld
                stats[reason] += 1
                program.replace(attrs.evolve(op, hold=reason))
                continue
            stats["forward" if g.phase is Phase.FORWARD else "backward"] += 1
            stats["moved_nodes"] += len(g.chain)
            program.replace(attrs.evolve(op, prefetched=True))
        return PassResult(stats["forward"] + stats["backward"] > 0 or stats[NO_EARLIER_SLOT] > 0, stats)
