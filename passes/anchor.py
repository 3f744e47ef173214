"""anchor: pick, for each gather, the node its launch should go just before.

Consumer lookahead per phase (gathers grouped by first consumer; group i launches before
consumer i − depth), then attention intervals (consumers of the next interval spread over
the heavy ops of this one) where those are earlier. Writes `anchor`, or a `hold` reason.
"""

from __future__ import annotations

import bisect
import dataclasses
from itertools import compress, repeat

import attrs

from ..ir import Phase, Program
from ..ir.holds import DEPTH_0, FIRST_GROUP, NO_CONSUMER
from .base import ModulePass, PassContext, PassResult, check_depth, option, register_pass
from .feeders import Feeders
from .gathers import Gather, GatherAnalysis, held_by_lowering
from .memory_cap import MemoryAnalysis


@register_pass
@dataclasses.dataclass(frozen=True)
class Anchor(ModulePass):
    name = "anchor"
    preserves = (GatherAnalysis, Feeders, MemoryAnalysis)  # it sets anchors, moves nothing
    reorders_only = True

    forward_depth: int = option(1, "launch each forward gather group this many consumer groups early (0: no prefetch)")
    backward_depth: int = option(1, "the same in the backward")
    attention: bool = option(True, "also anchor over the heavy ops between attention nodes")

    def __post_init__(self):
        check_depth(self.name, "forward-depth", self.forward_depth)
        check_depth(self.name, "backward-depth", self.backward_depth)

    def apply(self, ctx: PassContext, program: Program) -> PassResult:
        analysis = ctx.get(GatherAnalysis, program)
        stats = {"anchored": 0, FIRST_GROUP: 0, DEPTH_0: 0, NO_CONSUMER: len(analysis.unconsumed)}
        updates: dict[str, tuple[str | None, str | None]] = {}  # launch -> (anchor, hold)
        for name in analysis.unconsumed:
            updates[name] = (None, NO_CONSUMER)
        # the heavy ops of both phases, in one walk down the schedule (one per phase was a
        # tenth of the reference pipeline at 100k nodes)
        heavy = []
        if self.attention and (self.forward_depth or self.backward_depth):
            ops = list(program.ops())  # picked out in C: no Python step per op
            heavy = list(compress(ops, map(getattr, ops, repeat("heavy"), repeat(False))))
        for phase, depth in ((Phase.FORWARD, self.forward_depth), (Phase.BACKWARD, self.backward_depth)):
            gathers = [g for g in analysis.gathers if g.phase is phase]
            anchors = self._anchors(program, gathers, heavy, phase, depth) if depth else {}
            for g in gathers:
                if held_by_lowering(program.op(g.launch)):
                    continue  # malformed tags: leave its reason
                if depth == 0:
                    reason = DEPTH_0
                elif g.launch in anchors:
                    reason = None
                else:
                    reason = FIRST_GROUP
                stats["anchored" if reason is None else reason] += 1
                updates[g.launch] = (anchors.get(g.launch), reason)
        changed = False
        for name, (anchor, hold) in updates.items():
            op = program.op(name)
            if op.anchor != anchor or op.hold != hold:  # (the op is made only where it changes)
                program.replace(attrs.evolve(op, anchor=anchor, hold=hold))
                changed = True
        return PassResult(changed, stats)

    def _anchors(self, program: Program, gathers: list[Gather], heavy: list, phase: Phase,
                 depth: int) -> dict[str, str]:
        pos = program.schedule.index
        groups: dict[str, list[Gather]] = {}
        for g in sorted(gathers, key=lambda g: pos(g.first_consumer)):
            groups.setdefault(g.first_consumer, []).append(g)
        consumers = list(groups)
        anchors = {}
        for i, consumer in enumerate(consumers[1:], 1):
            for g in groups[consumer]:
                anchors[g.launch] = consumers[max(0, i - depth)]
        if self.attention:
            self._attention_anchors(program, groups, [op for op in heavy if op.phase is phase], anchors)
        return anchors

    def _attention_anchors(self, program: Program, groups: dict[str, list[Gather]], heavy_ops: list,
                           anchors: dict[str, str]) -> None:
        """`heavy_ops`: the phase's heavy ops, in schedule order."""
        pos = program.schedule.index
        nodes = [op.name for op in heavy_ops]
        attention = [op.name for op in heavy_ops if op.attention]
        if not attention:
            return
        consumers = list(groups)  # in schedule order
        consumer_at = [pos(c) for c in consumers]
        bounds = [-1, *(pos(n) for n in attention), len(program.schedule)]
        heavy_at = [pos(n) for n in nodes]
        start = 0
        for i in range(len(bounds) - 1):
            left, right = bounds[i], bounds[i + 1]
            while start < len(nodes) and heavy_at[start] < max(left, 0):
                start += 1
            stop = start
            while stop < len(nodes) and heavy_at[stop] <= right:
                stop += 1
            heavy = nodes[start:stop]
            if not heavy:
                continue
            end = bounds[i + 2] if i + 2 < len(bounds) else right
            # consumers in (right, end], and for the first interval also those in (left, right]
            lo = bisect.bisect_right(consumer_at, left if i == 0 else right)
            targets = consumers[lo:bisect.bisect_right(consumer_at, end)]
            for k, consumer in enumerate(targets):
                anchor = heavy[k * len(heavy) // len(targets)]
                for g in groups[consumer]:
                    if pos(anchor) < pos(anchors.get(g.launch, consumer)):
                        anchors[g.launch] = anchor

