"""Where each anchored launch chain goes, decided one gather at a time on a live schedule.

Shared by `budget` (which plans on a scratch copy to decide what fits) and `prefetch`
(which applies the plan). A chain goes just before the later of its anchor and the slot
after its latest predecessor — legality is read off the graph's edges, nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from ..ir import Launch, Program, Schedule
from ..ir.holds import NO_EARLIER_SLOT  # noqa: F401  (budget and prefetch import it from here)
from .gathers import Gather, GatherAnalysis



def plan(program: Program, analysis: GatherAnalysis, schedule: Schedule,
         admit: Callable[[Gather, str], str | None] = lambda g, t: None
         ) -> Iterator[tuple[Gather, str | None, str | None]]:
    """Move anchored, unheld chains on `schedule`; yield (gather, target, reason it stayed)."""
    node, pred = program.node_data, program.predecessors  # raw dicts: views cost more here
    pos = schedule.index
    for g in analysis.gathers:
        op: Launch = node[g.launch]["op"]
        if op.anchor is None or op.hold is not None:
            continue
        chain = set(g.chain)
        # just before the anchor, and after everything the chain reads or must follow
        outside = [p for name in g.chain for p in pred[name] if p not in chain]
        position = max(pos(op.anchor), max(map(pos, outside), default=-1) + 1)
        if position >= min(map(pos, g.chain)):
            yield g, None, NO_EARLIER_SLOT
            continue
        target = schedule[position]
        reason = admit(g, target)
        if reason is None:
            schedule.move_before(list(g.chain), target)
        yield g, target, reason
