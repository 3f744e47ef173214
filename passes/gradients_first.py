"""gradients-first: compute each reduce-scatter's gradient as early as the rules allow, so that
the collective runs under the compute that does not feed it.

The other passes move communication only and keep the traced order of compute. A trace often
computes a layer's gradients interleaved with work they do not need (the input gradients that
feed the next layer's backward), and the reduce-scatters of one process group keep their order
(`collective-order`; after `unorder-reduce-scatters` only against the group's other
collectives, and a launch's ancestors then hold no reduce-scatter before it), so where the first of a layer's reduce-scatters waits for a gradient the
trace computes last, every later one queues behind it at the end of the layer, exposed (in the
generated graphs, before each barrier, which nothing crosses). This pass reorders compute:
walking the reduce-scatter launches in order, it moves the ops between the previous one (or the
last barrier) and this launch that the launch depends on (its ancestors over data and effect
edges) ahead of those it does not, keeping the order within each group. Legal by construction:
an ancestor's own predecessors are ancestors too (moved with it, in order) or sit before the
window; what moves later loses no predecessor. It adds nothing and removes nothing.

A window moves only where something after the launch's ancestors has a cost (the cost model's
times: otherwise the launch would issue no earlier). It runs first, so that the passes after it
place the gathers for the compute order it leaves. It raises memory where the work it delays
holds what it reads longer; under a peak-memory cap (`memory-cap`) with moves checked, the
windows are taken in sixteen chunks and a chunk whose result simulates over the cap is left out
(`over peak cap`: windows left where they were).
"""

from __future__ import annotations

import dataclasses
import math
from operator import itemgetter

from ..cost.model import CostAnalysis
from ..cost.simulate import memory_profile
from ..ir import Barrier, Launch, Program, Role
from .base import ModulePass, PassContext, PassResult, register_pass
from .gathers import GatherAnalysis
from .memory_cap import OVER_PEAK_CAP

CHUNKS = 16  # under a checked cap: exact peak checks per run (each O(N))


@register_pass
@dataclasses.dataclass(frozen=True)
class GradientsFirst(ModulePass):
    name = "gradients-first"
    preserves = (GatherAnalysis, CostAnalysis)  # membership and costs do not depend on the order
    reorders_only = True

    def apply(self, ctx: PassContext, program: Program) -> PassResult:
        ms = ctx.get(CostAnalysis, program).ms
        names = program.schedule.names()
        ops = list(map(itemgetter("op"), map(program.node_data.__getitem__, names)))
        # the launches that bound windows, and where a barrier restarts one (nothing crosses it)
        stops = [n for n, op in zip(names, ops)
                 if (isinstance(op, Launch) and op.role is Role.REDUCE_SCATTER) or isinstance(op, Barrier)]
        cap = getattr(ctx, "peak_cap", None)
        if cap is None or not cap.checks_moves:
            moved = sum(_first(program, stop, ms) for stop in stops)
            return PassResult(moved > 0, {"moved": moved})
        # checked: chunks of windows on a scratch order, each kept only if its peak fits
        limit = max(cap.limit_bytes, memory_profile(program).peak_bytes)  # an input over it may stay so
        size = max(1, math.ceil(len(stops) / CHUNKS))
        moved = refused = 0
        for at in range(0, len(stops), size):
            trial = program.copy()
            took = sum(_first(trial, stop, ms) for stop in stops[at:at + size])
            if not took:
                continue
            if memory_profile(trial).peak_bytes > limit:
                refused += took
                continue
            program.schedule.adopt(trial.schedule)
            moved += took
        return PassResult(moved > 0, {"moved": moved, OVER_PEAK_CAP: refused})


def _first(program: Program, stop: str, ms) -> int:
    """Move the ancestors of `stop` (a reduce-scatter launch) in its window — after the previous
    window's end — ahead of the rest of the window; returns 1 if it moved them. A barrier's
    window is left as it is (it only ends one)."""
    schedule = program.schedule
    node, pred = program.node_data, program.predecessors
    if isinstance(node[stop]["op"], Barrier):
        return 0
    end = schedule.index(stop)
    begin = end - 1
    while begin >= 0:  # back to the previous stop
        op = node[schedule[begin]]["op"]
        if (isinstance(op, Launch) and op.role is Role.REDUCE_SCATTER) or isinstance(op, Barrier):
            break
        begin -= 1
    window = [schedule[i] for i in range(begin + 1, end)]
    inside = set(window)
    ancestors, stack = set(), [stop]
    while stack:
        for p in pred[stack.pop()]:
            if p in inside and p not in ancestors:
                ancestors.add(p)
                stack.append(p)
    first = [n for n in window if n in ancestors]
    rest = [n for n in window if n not in ancestors]
    # nothing to gain unless the launch would issue earlier: a costed op now before it that it does not need
    if not any(ms.get(n, 0.0) > 0 and not isinstance(node[n]["op"], Launch) for n in rest):
        return 0
    if window[:len(first)] == first:
        return 0
    schedule.move_before(rest, schedule[end + 1])  # a launch is never last: its wait follows it
    return 1
