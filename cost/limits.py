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

`lower_bound` bounds the step of the schedule's compute order from below; `critical_ms` is the
part of it that follows each collective's queue on its stream (see there).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from itertools import accumulate

from ..ir import Cast, Launch, Program, View, Wait, waits_of
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


def critical_ms(program: Program, costs: Mapping[str, float]) -> float:
    """A lower bound of the step of every schedule that keeps this one's order of the ops that
    are not communication and moves only the communication: each launch with the views and casts
    that feed only it (`private_feeders`), each wait with the views of its result.

    Sweeping the order, the compute stream reaches a kept op no earlier than the one before it
    finished, nor than any moving op it follows could have finished: a launch is issued no
    earlier than its inputs (and the collectives it follows) are ready, plus the casts that feed
    it; a wait returns no earlier than its launch's issue plus the collective's time. And where a
    wait must come before a kept op (the first kept op its wait or the wait's views precede), its
    collective has ended by then: the collectives of one stream that have so ended ran one at a
    time after their issues, so they end no earlier than max over r of (r + the time of those
    issued at r or later) — the single-machine bound with release times, which the greedy fold
    over issues in order gives. Each step either takes a legal schedule's constraint or drops
    one (the costs of moving casts are left off the kept ops' clock; streams may run collectives
    in any order), so the result never exceeds that of any such schedule, this one included.
    Unlike the `at legal limit` exposure, it counts a collective queued behind others that the
    rules place no later (a burst of reduce-scatters before a barrier, the gathers at the start).
    """
    schedule = program.schedule
    names = schedule.names()
    node, pred, succ = program.node_data, program.predecessors, program.successors
    pos = schedule.index
    moving: set[str] = set()
    travels: dict[str, set[str]] = {}  # launch -> its waits and their views
    launch_of: dict[str, str] = {}     # wait -> its launch
    for name in names:
        if not isinstance(node[name]["op"], Launch):
            continue
        moving |= program.private_feeders(name, (View, Cast))
        travel = travels[name] = set()
        for wait in waits_of(program, name):
            launch_of[wait] = name
            travel.add(wait)
            stack = [wait]
            while stack:
                for s in succ[stack.pop()]:
                    if s not in travel and isinstance(node[s]["op"], View):
                        travel.add(s)
                        stack.append(s)
        moving |= travel
    # each collective has ended before the first kept op its wait (or the wait's views) precede
    due: dict[int, list[str]] = {}
    for name, travel in travels.items():
        at = min((pos(s) for n in travel for s in succ[n] if s not in moving), default=len(names))
        due.setdefault(at, []).append(name)
    ready: dict[str, float] = {}   # a moving op: no earlier than this it has run (launch: issued)
    finish: dict[str, float] = {}  # a kept op: no earlier than this it has run
    queues: dict[str, tuple[list[float], list[float], list[float]]] = {}  # stream -> issues, times, fold
    clock = 0.0

    def ended(launch: str) -> float:
        """The stream's ended-by bound once `launch` joins the collectives that have ended."""
        issues, times, fold = queues.setdefault(stream_of(node[launch]["op"]), ([], [], []))
        r, d = ready[launch], costs.get(launch, 0.0)
        i = bisect.bisect_right(issues, r)
        issues.insert(i, r)
        times.insert(i, d)
        del fold[i:]
        last = fold[-1] if fold else 0.0
        for r, d in zip(issues[i:], times[i:]):
            last = (last if last > r else r) + d
            fold.append(last)
        return last

    for at, name in enumerate(names):
        op = node[name]["op"]
        if name in moving:
            start = _inputs(pred[name], finish, ready)
            if name in launch_of:  # a wait: its collective has run
                launch = launch_of[name]
                start = max(start, ready[launch] + costs.get(launch, 0.0))
            ready[name] = start + (0.0 if isinstance(op, Launch) else costs.get(name, 0.0))
            continue
        arrive = max(clock, _inputs(pred[name], finish, ready))
        for launch in due.pop(at, ()):
            arrive = max(arrive, ended(launch))
        clock = arrive + costs.get(name, 0.0)
        finish[name] = clock
    for launch in (n for rest in due.values() for n in rest):
        clock = max(clock, ended(launch))
    return max(clock, max(ready.values(), default=0.0))


def _inputs(preds, finish: dict[str, float], ready: dict[str, float]) -> float:
    return max((finish[p] if p in finish else ready[p] for p in preds), default=0.0)


def lower_bound(program: Program, sim: Simulation, costs: Mapping[str, float]) -> dict[str, float | str | None]:
    """A lower bound of `sim`'s step, and what it is made of.

    The schedule runs all its compute and, on each stream, all its collectives; and its compute
    stream also idles where communication is exposed `at legal limit` (launched at its earliest
    legal slot, waited at its latest: no move of that collective hides it), and where a wait must
    come before compute that its collective's queue on its stream reaches only later
    (`critical_ms`). So the step is at least max(compute + that exposure, the busiest stream, the
    critical path), never more than `sim.step_ms` (the exposure at the limit is a part of the
    exposure; the critical path bounds every placement of the communication, this one's too).
    Read off this schedule's compute order (another order of compute may do better), so it
    bounds this schedule's step. `forced_ms` is that exposure; `critical_ms` the critical path;
    `plain_ms` the bound without either (as `Simulation.lower_bound_ms`).
    """
    forced = exposure_causes(program, sim, costs)[AT_LIMIT] if sim.exposed_ms > 0 else 0.0
    busiest = max(sim.comm_ms_by_stream.items(), key=lambda kv: (kv[1], kv[0]), default=(None, 0.0))
    critical = critical_ms(program, costs) if sim.exposed_ms > 0 else 0.0
    bound = max(sim.compute_ms + forced, busiest[1], critical)
    return {
        "bound_ms": bound, "plain_ms": sim.lower_bound_ms, "compute_ms": sim.compute_ms, "forced_ms": forced,
        "critical_ms": critical, "busiest_stream": busiest[0], "busiest_stream_ms": busiest[1],
        "step_ms": sim.step_ms, "gap": sim.step_ms / bound if bound > 0 else 1.0,
    }
