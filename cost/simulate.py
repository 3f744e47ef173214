"""Simulate a program's schedule: one compute stream, one communication stream per group.

The compute stream runs every op in schedule order for its cost. A collective launch is
issued when the compute stream reaches it and runs on its group's stream after the
collectives launched before it there. A wait blocks the compute stream until its collective
ends; that idle time is the collective's exposed communication.

Memory, in schedule order: each op that is not an alias allocates its results when it runs
(a collective's output at its launch); views and waits alias their base's storage; a buffer
is released after its last (non-alias) reader runs, or at a free of it (whose readers a legal
schedule has already run); a buffer no one reads is released right after its op; inputs,
constants and what the output returns live to the end. The peak is taken after each op's allocation, before its releases.

One pass over the schedule and the edges, plus a sort of the gather intervals: O(N log N).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from ..ir.gcpause import gc_paused
from ..ir import Free, Launch, Output, Program, View, Wait
from .model import STATIC, as_cost_model, collective_kind, op_costs

COMPUTE = "compute"


def stream_of(op: Launch) -> str:
    """The communication stream a collective runs on: one per process group."""
    return f"comm:{op.group if op.group is not None else 'default'}"


@attrs.frozen
class Event:
    """A span on a stream: an op running, or (kind `exposed`) the compute stream idle on a wait."""

    name: str
    stream: str
    start_ms: float
    dur_ms: float
    kind: str          # op kind keyword, or "exposed"
    target: str = ""


@attrs.frozen
class Simulation:
    step_ms: float
    compute_ms: float                           # total busy time of the compute stream
    comm_ms: float                              # total busy time of all communication streams
    comm_ms_by_stream: Mapping[str, float]
    exposed_ms: float                           # compute idle on waits, total
    exposed_by_collective: Mapping[str, float]  # launch name -> its exposed ms (every collective)
    peak_bytes: int
    peak_at: str | None                         # the op at which memory peaked
    inflight: tuple[tuple[float, int], ...]     # (ms, gathered bytes launched and not yet waited) steps
    max_inflight_bytes: int
    issued_ms: Mapping[str, float] = attrs.field(factory=dict)   # launch -> compute time it was issued
    started_ms: Mapping[str, float] = attrs.field(factory=dict)  # launch -> time its stream started it
    events: tuple[Event, ...] = ()              # with record=True
    memory: tuple[tuple[float, int], ...] = ()  # with record=True: (ms, live bytes) after each op

    @property
    def lower_bound_ms(self) -> float:
        """max(total compute, total communication of the busiest stream)."""
        return max(self.compute_ms, max(self.comm_ms_by_stream.values(), default=0.0))

    @property
    def ratio(self) -> float:
        """step time / lower bound (1.0 = nothing exposed that could have been hidden)."""
        bound = self.lower_bound_ms
        return self.step_ms / bound if bound > 0 else 1.0

    def summary(self) -> dict[str, Any]:
        return {
            "step_ms": self.step_ms, "lower_bound_ms": self.lower_bound_ms, "ratio": self.ratio,
            "compute_ms": self.compute_ms, "comm_ms": self.comm_ms,
            "comm_ms_by_stream": dict(self.comm_ms_by_stream), "exposed_ms": self.exposed_ms,
            "peak_bytes": self.peak_bytes, "peak_at": self.peak_at,
            "max_inflight_bytes": self.max_inflight_bytes,
        }


def _alias_base(op) -> bool:
    return isinstance(op, (View, Wait)) and bool(op.operands)


def simulate(program: Program, model: Any = None, *, costs: Mapping[str, float] | None = None,
             record: bool = False) -> Simulation:
    """Simulate `program.schedule` with `model` (anything `as_cost_model` takes) or given
    per-op `costs` in ms. `record` keeps per-op events and the memory curve (for timelines)."""
    with gc_paused():
        return _simulate(program, model, costs, record)


def _simulate(program: Program, model: Any, costs: Mapping[str, float] | None, record: bool) -> Simulation:
    if costs is None:
        costs = op_costs(program, as_cost_model(model))
    graph = program.graph
    nodes = graph.nodes
    order = program.schedule.names()
    ops = {n: nodes[n]["op"] for n in order}

    # ---- time ---------------------------------------------------------------------------
    t = 0.0
    compute_busy = 0.0
    stream_free: dict[str, float] = {}
    stream_busy: dict[str, float] = {}
    coll_end: dict[str, float] = {}
    issued: dict[str, float] = {}
    started: dict[str, float] = {}
    waited: dict[str, float] = {}
    exposed: dict[str, float] = {}
    events: list[Event] = []
    times: list[float] = [] if record else None  # compute time after each op
    for name in order:
        op = ops[name]
        cost = costs.get(name, 0.0)
        if isinstance(op, Launch):
            stream = stream_of(op)
            start = max(t, stream_free.get(stream, 0.0))
            end = start + cost
            stream_free[stream] = end
            stream_busy[stream] = stream_busy.get(stream, 0.0) + cost
            coll_end[name] = end
            issued[name] = t
            started[name] = start
            exposed[name] = 0.0
            if record:
                events.append(Event(name, stream, start, cost, op.KIND, op.target))
        elif isinstance(op, Wait) and op.launched_by in coll_end:  # a coalesced launch's result: its launch
            launch = op.launched_by
            end = coll_end[launch]
            if end > t:
                exposed[launch] += end - t
                if record:
                    events.append(Event(f"wait {name}", COMPUTE, t, end - t, "exposed", op.target))
                t = end
            waited[launch] = t
            t += cost
            compute_busy += cost
        else:
            if record and cost > 0:
                events.append(Event(name, COMPUTE, t, cost, op.KIND, getattr(op, "target", "")))
            t += cost
            compute_busy += cost
        if record:
            times.append(t)
    step = max(t, max(stream_free.values(), default=0.0))

    # ---- memory -------------------------------------------------------------------------
    profile = _memory(order, ops)
    alloc = profile.alloc
    memory: list[tuple[float, int]] = []
    if record:
        live = profile.statics
        for i, name in enumerate(order):
            if not isinstance(ops[name], STATIC):
                live += alloc.get(name, 0)
            for gone in profile.releases.get(i, ()):
                live -= alloc[gone]
            memory.append((times[i], live))
    peak, peak_at = profile.peak_bytes, profile.peak_at

    # ---- gathered bytes in flight ---------------------------------------------------------
    steps: list[tuple[float, int]] = []
    for launch, start in issued.items():
        op = ops[launch]
        if collective_kind(op.target) != "all_gather":
            continue
        size = alloc.get(launch, 0)
        steps.append((start, size))
        steps.append((waited.get(launch, step), -size))
    steps.sort(key=lambda s: (s[0], s[1]))   # at equal times, finish before starting
    inflight: list[tuple[float, int]] = []
    level = max_level = 0
    for when, delta in steps:
        level += delta
        max_level = max(max_level, level)
        if inflight and inflight[-1][0] == when:
            inflight[-1] = (when, level)
        else:
            inflight.append((when, level))

    return Simulation(
        step_ms=step, compute_ms=compute_busy, comm_ms=sum(stream_busy.values()),
        comm_ms_by_stream=stream_busy, exposed_ms=sum(exposed.values()), exposed_by_collective=exposed,
        peak_bytes=peak, peak_at=peak_at, inflight=tuple(inflight), max_inflight_bytes=max_level,
        issued_ms=issued, started_ms=started,
        events=tuple(events), memory=tuple(memory),
    )


@attrs.frozen
class MemoryProfile:
    """Live bytes along a schedule, as `simulate` counts them (no costs needed).

    `live[i]` is what is live just after op i allocated its results, before its releases (the
    peak is the largest of these, or of the inputs and constants alone); `alloc` the bytes each
    allocating op holds; `root` each op's storage (a view's or wait's base, followed); `order`
    the schedule it was taken on."""

    order: tuple[str, ...]
    live: tuple[int, ...]
    peak_bytes: int
    peak_at: str | None
    alloc: Mapping[str, int]
    root: Mapping[str, str]
    statics: int
    releases: Mapping[int, list[str]]


def alloc_bytes(op) -> int:
    """What an op holds once it ran: its results' bytes (a gather of unknown type: its tagged
    unsharded size); views and waits alias their base and hold nothing."""
    if _alias_base(op):
        return 0
    size = op.nbytes_out
    if not size and isinstance(op, Launch):
        size = op.nbytes or 0
    return max(size or 0, 0)


def memory_profile(program: Program, order: list[str] | None = None) -> MemoryProfile:
    """The memory half of `simulate`, O(N + edges): live bytes after each op of the schedule
    (or of `order`, a permutation of it)."""
    with gc_paused():
        order = program.schedule.names() if order is None else order
        nodes = program.graph.nodes
        return _memory(order, {n: nodes[n]["op"] for n in order})


def _memory(order: list[str], ops: Mapping[str, Any]) -> MemoryProfile:
    pos = {n: i for i, n in enumerate(order)}
    root: dict[str, str] = {}
    for name in order:
        op = ops[name]
        base = op.operands[0] if _alias_base(op) else None
        root[name] = root.get(base, base) if base is not None else name
    release_at: dict[str, int] = {}   # storage root -> position after which it is released
    freed_at: dict[str, int] = {}
    returned: set[str] = set()        # storage the output returns: live to the end
    for name in order:
        op = ops[name]
        if _alias_base(op):
            continue
        if isinstance(op, Output):
            returned.update(root[o] for o in op.operands)
            continue
        i = pos[name]
        for operand in op.operands:
            r = root[operand]
            if release_at.get(r, -1) < i:
                release_at[r] = i
        if isinstance(op, Free) and op.operands:
            r = root[op.operands[0]]
            freed_at.setdefault(r, i)
    releases: dict[int, list[str]] = {}
    alloc: dict[str, int] = {}
    for name in order:
        op = ops[name]
        size = alloc_bytes(op)
        if size <= 0:
            continue
        alloc[name] = size
        if isinstance(op, STATIC) or (name in returned and name not in freed_at):
            continue  # inputs and constants live throughout, results the graph returns to its end
        i = pos[name]
        at = freed_at.get(name, release_at.get(name, i))
        releases.setdefault(max(at, i), []).append(name)
    statics = live = sum(alloc[n] for n in order if isinstance(ops[n], STATIC) and n in alloc)
    peak, peak_at = live, None
    curve: list[int] = []
    for i, name in enumerate(order):
        op = ops[name]
        if not isinstance(op, STATIC):
            live += alloc.get(name, 0)
        curve.append(live)
        if live > peak:
            peak, peak_at = live, name
        for gone in releases.get(i, ()):
            live -= alloc[gone]
    return MemoryProfile(tuple(order), tuple(curve), peak, peak_at, alloc, root, statics, releases)
