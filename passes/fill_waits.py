"""fill-waits: move compute that is ready at an exposed wait up to just before it, so that it runs
while the compute stream would idle there.

The scheduling passes place communication around a fixed order of compute; where a wait is still
exposed (the first gather of a graph, which nothing is before; a gradient's reduce-scatter at the
end of a layer), the ops after it that do not depend on it may run in its idle time. For each wait
the simulator (the cost model's times) finds exposed, in schedule order, this pass scans the ops
after it (at most `max-scan`, never past a barrier) and takes each op whose predecessors (data
and effect edges) all sit before the wait or were taken already — never a launch, a wait or an op
after a barrier — while what it took costs no more than the exposure: the compute stream then
reaches the wait's next op no later than before. The exposures are read once, off the order the
pass starts from, and a fill changes later ones; so the pass simulates its result and, if the step
grew, puts the order back (`undone`). The taken ops keep their order; legal by construction (each
one's predecessors precede it, what it precedes follows it still).

It raises memory where a taken op's result lives longer: under a peak-memory cap (`memory-cap`)
with moves checked, each wait's ops are checked as one move (`Headroom.earlier`) and held if they
do not fit (`over peak cap`). Run it last, after the passes that place communication.
"""

from __future__ import annotations

import dataclasses

from ..cost.model import CostAnalysis
from ..cost.simulate import simulate
from ..ir import Barrier, Input, Launch, Marker, Opaque, Output, Program, Wait, waits_of
from .base import ModulePass, PassContext, PassResult, option, register_pass
from .gathers import GatherAnalysis
from .memory_cap import OVER_PEAK_CAP, headroom

_STAYS = (Launch, Wait, Barrier, Input, Marker, Output, Opaque)  # communication and fixed points stay
_EPS = 1e-12


@register_pass
@dataclasses.dataclass(frozen=True)
class FillWaits(ModulePass):
    name = "fill-waits"
    preserves = (GatherAnalysis, CostAnalysis)
    reorders_only = True

    max_scan: int = option(512, "most ops after an exposed wait looked at for compute ready there")

    def __post_init__(self):
        if self.max_scan < 0:
            raise ValueError(f"fill-waits: max-scan must be >= 0, got {self.max_scan}")

    def apply(self, ctx: PassContext, program: Program) -> PassResult:
        ms = ctx.get(CostAnalysis, program).ms
        sim = simulate(program, costs=ms)
        schedule = program.schedule
        exposed = {}  # the first wait of each exposed collective -> its exposed ms
        for launch, idle in sim.exposed_by_collective.items():
            if idle > _EPS and isinstance(program.op(launch), Launch):
                waits = waits_of(program, launch)
                if waits:
                    first = min(waits, key=schedule.index)
                    exposed[first] = exposed.get(first, 0.0) + idle
        room = headroom(ctx, program)
        before = schedule.copy()
        stats = {"filled": 0, "moved": 0, "filled_ms": 0.0, "undone": 0}
        for wait in sorted(exposed, key=schedule.index):
            taken = self._ready_after(program, wait, exposed[wait], ms)
            if not taken:
                continue
            move = room.earlier(taken, wait) if room is not None else None
            if room is not None and move is None:
                continue  # counted in room.refused
            schedule.move_before(taken, wait)
            if move is not None:
                move.take()
            stats["filled"] += 1
            stats["moved"] += len(taken)
            stats["filled_ms"] += sum(ms.get(n, 0.0) for n in taken)
        stats["filled_ms"] = round(stats["filled_ms"], 6)
        if stats["moved"] and simulate(program, costs=ms).step_ms > sim.step_ms + _EPS:
            schedule.adopt(before)  # a later wait's exposure changed under an earlier fill
            stats.update(filled=0, moved=0, filled_ms=0.0, undone=1)
        if room is not None:
            stats[OVER_PEAK_CAP] = room.refused
        return PassResult(stats["moved"] > 0, stats)

    def _ready_after(self, program: Program, wait: str, idle: float, ms) -> list[str]:
        """The ops after `wait` ready there (every predecessor before it, or taken), in order,
        costing at most `idle` in all; [] when none costs anything."""
        schedule = program.schedule
        node, pred = program.node_data, program.predecessors
        at = schedule.index(wait)
        end = min(len(schedule), at + 1 + self.max_scan)
        taken, took, budget = [], set(), idle
        for i in range(at + 1, end):
            name = schedule[i]
            op = node[name]["op"]
            if isinstance(op, Barrier):
                break  # nothing after it is ready before it
            if isinstance(op, _STAYS):
                continue
            cost = ms.get(name, 0.0)
            if cost > budget + _EPS:
                continue
            if all(schedule.index(p) < at or p in took for p in pred[name]):
                taken.append(name)
                took.add(name)
                budget -= cost
        # views and free ops alone fill nothing: only a costed op makes the move worth it
        while taken and ms.get(taken[-1], 0.0) <= 0.0:
            took.discard(taken.pop())
        return taken if any(ms.get(n, 0.0) > 0 for n in taken) else []
