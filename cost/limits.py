"""Where a schedule's exposed communication comes from, and whether moving collectives could hide it.

Each collective's exposed time (the compute stream idle at its wait) goes to one cause:

- `stream busy`: the part it spent waiting for its stream to finish collectives launched before
  it that are waited on no later than it, or must run before it (the collective order);
- `reorderable`: the part it spent queued behind a collective waited on later than it;
- `movable`: the rest, when compute runs between the launch's earliest legal slot and the launch,
  or between its wait and the wait's first successor — a pass could still move it;
- `at legal limit`: the rest, when the launch sits at its earliest legal slot and the wait at its
  latest: no legal move of communication hides more of it (only reordering compute could).

Legal slots are read off the program's edges (data and effect), the same rules `ir.verify` checks.
Views and casts read only by a launch travel with it, as the passes move them; views of a
wait's result travel with the wait.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from itertools import accumulate

from ..ir import Cast, Launch, Program, View, waits_of
from .simulate import Simulation, stream_of

BUSY, REORDERABLE, MOVABLE, AT_LIMIT = "stream busy", "reorderable", "movable", "at legal limit"
CAUSES = (AT_LIMIT, BUSY, REORDERABLE, MOVABLE)


def exposure_causes(program: Program, sim: Simulation, costs: Mapping[str, float]) -> dict[str, float]:
    """Exposed ms of `sim` (a simulation of `program.schedule` with `costs`) by cause."""
    out = dict.fromkeys(CAUSES, 0.0)
    for name, cause in classify(program, sim, costs).items():
        queued = cause["queued"]
        out[cause["queue"]] += queued
        out[cause["rest"]] += sim.exposed_by_collective[name] - queued
    return out


def classify(program: Program, sim: Simulation, costs: Mapping[str, float]) -> dict[str, dict]:
    """For each collective with exposed time: {"queued": ms, "queue": BUSY or REORDERABLE,
    "rest": AT_LIMIT or MOVABLE}."""
    schedule = program.schedule
    pos = schedule.index
    deadline = {n: min(map(pos, waits_of(program, n)), default=len(schedule)) for n in sim.started_ms}
    by_stream: dict[str, list[tuple[float, str]]] = {}
    for n, start in sim.started_ms.items():
        by_stream.setdefault(stream_of(program.op(n)), []).append((start, n))
    for runs in by_stream.values():
        runs.sort()
    # compute-stream work before each position (launches cost the compute stream nothing)
    work = [0.0, *accumulate(0.0 if isinstance(program.op(n), Launch) else costs.get(n, 0.0) for n in schedule)]
    out = {}
    for name, exposed in sim.exposed_by_collective.items():
        if exposed <= 0:
            continue
        issued, started = sim.issued_ms.get(name, 0.0), sim.started_ms.get(name, 0.0)
        queued = min(exposed, max(0.0, started - issued))
        runs = by_stream[stream_of(program.op(name))]
        ahead = runs[bisect.bisect_left(runs, (issued, "")):bisect.bisect_left(runs, (started, name))]
        ordered = not program.op(name).is_gather
        later = any(deadline[d] > deadline[name] and not (ordered and not program.op(d).is_gather)
                    for _, d in ahead)
        chain = program.private_feeders(name, (View, Cast))
        earliest = max((pos(p) + 1 for n in chain for p in program.graph.pred[n] if p not in chain), default=0)
        travelling = sum(costs.get(n, 0.0) for n in chain if earliest <= pos(n) < pos(name))
        late_launch = work[pos(name)] - work[earliest] - travelling > 1e-12
        late_wait = any(_slack_after(program, wait, work) > 1e-12 for wait in waits_of(program, name))
        out[name] = {"queued": queued, "queue": REORDERABLE if later else BUSY,
                     "rest": MOVABLE if late_launch or late_wait else AT_LIMIT}
    return out


def _slack_after(program: Program, wait: str, work: list[float]) -> float:
    """Compute between `wait` and the first successor it (with its result's views) must precede."""
    pos = program.schedule.index
    travelling, stack, bound = {wait}, [wait], len(work) - 1
    while stack:
        for s in program.graph.succ[stack.pop()]:
            if isinstance(program.op(s), View) and s not in travelling:
                travelling.add(s)
                stack.append(s)
            elif s not in travelling:
                bound = min(bound, pos(s))
    return work[bound] - work[pos(wait) + 1]


def lower_bound(program: Program, sim: Simulation, costs: Mapping[str, float]) -> dict[str, float | str | None]:
    """A lower bound of `sim`'s step, and what it is made of.

    The schedule runs all its compute and, on each stream, all its collectives; and its compute
    stream also idles where communication is exposed `at legal limit` (launched at its earliest
    legal slot, waited at its latest: no move of that collective hides it). So the step is at
    least max(compute + that exposure, the busiest stream), never more than `sim.step_ms` (the
    exposure at the limit is a part of the exposure). Read off this schedule (another placement
    of communication may leave less at the limit), so it bounds this schedule's step.
    `forced_ms` is that exposure; `plain_ms` the bound without it (as `Simulation.lower_bound_ms`).
    """
    forced = exposure_causes(program, sim, costs)[AT_LIMIT] if sim.exposed_ms > 0 else 0.0
    busiest = max(sim.comm_ms_by_stream.items(), key=lambda kv: (kv[1], kv[0]), default=(None, 0.0))
    bound = max(sim.compute_ms + forced, busiest[1])
    return {
        "bound_ms": bound, "plain_ms": sim.lower_bound_ms, "compute_ms": sim.compute_ms, "forced_ms": forced,
        "busiest_stream": busiest[0], "busiest_stream_ms": busiest[1],
        "step_ms": sim.step_ms, "gap": sim.step_ms / bound if bound > 0 else 1.0,
    }
