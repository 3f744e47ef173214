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

Where two reduce-scatters in a row are both `unordered` (`unorder-reduce-scatters`: their order
is free), the later one goes first, with its ancestors, where by the cost model's times their
collectives, queued on one stream, end sooner so (a bias's small gradient, traced after the
matmul of its weight's: its reduce-scatter no longer queues behind the large one at the end;
`swapped`; it sweeps until no pair swaps, so that a second run leaves the order as it is).
The region between the stop before the pair and the later launch is reordered as
the later one's ancestors, it, the earlier one's other ancestors, it, the rest: legal as the
windows are.

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
            moved = swapped = sweeps = 0
            # sweeps until no pair swaps (one sweep is one pass of a bubble sort: a second run
            # on its own output would swap pairs the first sweep made adjacent), at most as many
            # sweeps as stops: whether a pair swaps depends on what lies between them, so this
            # bounds it where the comparison is not an order
            for sweeps in range(1, len(stops) + 1):
                took_sweep = swap_sweep = 0
                for at in range(len(stops)):
                    took, swap = _step(program, stops, at, ms)
                    took_sweep, swap_sweep = took_sweep + took, swap_sweep + swap
                moved, swapped = moved + took_sweep, swapped + swap_sweep
                if not swap_sweep:
                    break
            return PassResult(moved + swapped > 0, {"moved": moved, "swapped": swapped, "sweeps": sweeps})
        # checked: chunks of windows on a scratch order, each kept only if its peak fits
        limit = max(cap.limit_bytes, memory_profile(program).peak_bytes)  # an input over it may stay so
        size = max(1, math.ceil(len(stops) / CHUNKS))
        moved = swapped = refused = 0
        for at in range(0, len(stops), size):
            trial, trial_stops = program.copy(), list(stops)
            took = swap = 0
            for i in range(at, min(at + size, len(stops))):
                t, w = _step(trial, trial_stops, i, ms)
                took, swap = took + t, swap + w
            if not took + swap:
                continue
            if memory_profile(trial).peak_bytes > limit:
                refused += took + swap
                continue
            program.schedule.adopt(trial.schedule)
            stops[:] = trial_stops
            moved, swapped = moved + took, swapped + swap
        return PassResult(moved + swapped > 0, {"moved": moved, "swapped": swapped, OVER_PEAK_CAP: refused})


def _step(program: Program, stops: list[str], at: int, ms) -> tuple[int, int]:
    """Stop `at`'s window (`_first`), then, where it and the stop before it are unordered
    reduce-scatters, the two in whichever order ends their collectives sooner (`_swap`: `stops`
    is updated). Returns (moved, swapped)."""
    moved = _first(program, stops[at], ms)
    swapped = 0
    if at and _swap(program, stops[at - 2] if at >= 2 else None, stops[at - 1], stops[at], ms):
        stops[at - 1], stops[at] = stops[at], stops[at - 1]
        swapped = 1
    return moved, swapped


def _swap(program: Program, start: str | None, a: str, b: str, ms) -> bool:
    """Launch reduce-scatter `b` before `a` (the stop before it), with `b`'s ancestors after
    `start` (the stop before `a`, or None: the beginning) ahead of `a`'s, where both are
    `unordered` (their order is free: `unorder-reduce-scatters`), `b` does not need `a`, and by
    the cost model's times their collectives, queued on one stream, end sooner so: a trace often
    computes a layer's last weight gradient (a matmul) before a small one (a bias's sum) whose
    reduce-scatter then queues behind the large one's, exposed. Legal as `_first` is: the
    region from `start` to `b` is reordered as `b`'s ancestors in it, `b`, `a`'s other
    ancestors, `a`, the rest, each closed under its predecessors in the region and in its order.
    Returns whether it moved them."""
    node, pred, schedule = program.node_data, program.predecessors, program.schedule
    op_a, op_b = node[a]["op"], node[b]["op"]
    if not (isinstance(op_a, Launch) and isinstance(op_b, Launch) and op_a.unordered and op_b.unordered):
        return False
    begin = schedule.index(start) + 1 if start is not None else 0
    end = schedule.index(b)
    region = [schedule[i] for i in range(begin, end + 1)]
    fixed = [i for i, n in enumerate(region) if not node[n]["op"].MOVABLE]  # inputs, markers, opaque ops
    if fixed:  # the region starts after the last (what it orders stays on its side)
        region = region[fixed[-1] + 1:]
        if a not in region:
            return False
    inside = set(region)
    of_b = _ancestors_within(pred, b, inside)
    if a in of_b:
        return False
    all_of_a = _ancestors_within(pred, a, inside)
    of_a = all_of_a - of_b

    def cost(names):  # summed in the region's order (a set's order is the hash seed's: ranks must agree)
        names = set(names)
        return sum(ms.get(n, 0.0) for n in region if n in names and not isinstance(node[n]["op"], Launch))

    # now: a launches after its ancestors (overlap-reduce-scatter hoists each launch to its
    # latest predecessor), b after what precedes a and b's own ancestors after a
    t_a, t_b = ms.get(a, 0.0), ms.get(b, 0.0)
    launch_a = cost(all_of_a)
    at_a = region.index(a)
    launch_b_now = cost(region[:at_a]) + cost(n for n in region[at_a + 1:] if n in of_b)
    now = max(launch_a + t_a, launch_b_now) + t_b
    launch_b = cost(of_b)
    swapped = max(launch_b + t_b, launch_b + cost(of_a)) + t_a
    if swapped >= now:
        return False
    first = [n for n in region if n in of_b] + [b] + [n for n in region if n in of_a] + [a]
    rest = [n for n in region if n not in of_a and n not in of_b and n not in (a, b)]
    if region == first + rest:
        return False
    schedule.move_before(first + rest, schedule[end + 1])  # b is never last: its wait follows it
    return True


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
    ancestors = _ancestors_within(pred, stop, set(window))
    first = [n for n in window if n in ancestors]
    rest = [n for n in window if n not in ancestors]
    # nothing to gain unless the launch would issue earlier: a costed op now before it that it does not need
    if not any(ms.get(n, 0.0) > 0 and not isinstance(node[n]["op"], Launch) for n in rest):
        return 0
    if window[:len(first)] == first:
        return 0
    schedule.move_before(rest, schedule[end + 1])  # a launch is never last: its wait follows it
    return 1


def _ancestors_within(pred, of: str, inside: set[str]) -> set[str]:
    """The ancestors of `of` (over data and effect edges) that lie in `inside`, reached through
    `inside` only: what must move with it in a window or region."""
    found, stack = set(), [of]
    while stack:
        for p in pred[stack.pop()]:
            if p in inside and p not in found:
                found.add(p)
                stack.append(p)
    return found
