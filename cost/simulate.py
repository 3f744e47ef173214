"""Simulate a program's schedule: one compute stream, one communication stream per group.

The compute stream runs every op in schedule order for its cost. A collective launch is
issued when the compute stream reaches it and runs on its group's stream after the
collectives launched before it there. A wait blocks the compute stream until its collective
ends; that idle time is the collective's exposed communication.

Memory, in schedule order: each op that is not an alias allocates its results when it runs
(a collective's output at its launch); views, waits and the results of ops with `alias` (an
in-place op, an in-place or `out=` collective) share their base's storage and allocate nothing;
a buffer is released after the last op that keeps it alive (`keeps_alive`: an op that is no
view keeps its operands; a wait keeps what its collective touches until it completes, the
launch's inputs and results) runs, or at a free of it (whose readers a legal schedule has
already run) — but not before the wait of a collective that reads it (an input graph may free
a collective's input before its wait: the collective still reads it, ir/effects.py); a buffer
nothing keeps is released right after its op; inputs, constants and what the output returns
live to the end (an input that a cast with `alias` is, a shard's pad before its gather, holds
the cast's bytes: every rank counts its shard as gathered, lowering/fx.py). The peak is taken after each op's allocation, before its releases.

One pass over the schedule and the edges, plus a sort of the gather intervals: O(N log N).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from ..ir.gcpause import gc_paused
from ..ir import Cast, Free, Launch, Output, Program, View, Wait
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
        """The plain bound: max(total compute, total communication of the busiest stream), a bound
        over every order. The gap report's `bound_ms` (cost/limits.py `lower_bound`) is tighter:
        it adds what the schedule's compute order forces exposed and the critical path."""
        return max(self.compute_ms, max(self.comm_ms_by_stream.values(), default=0.0))

    @property
    def ratio(self) -> float:
        """step time / the plain bound (`lower_bound_ms`)."""
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


def _alias_base(op) -> str | None:
    """The operand whose storage `op`'s result shares (views and waits: their first operand;
    other ops: their `alias`), or None: a fresh storage."""
    if isinstance(op, (View, Wait)):
        return op.operands[0] if op.operands else None
    return op.alias


def keeps_alive(op, op_of) -> tuple[str, ...]:
    """The values whose storage `op` keeps alive up to its place in the schedule, for the memory
    model: the one rule `simulate` releases storage by and every pass that predicts live bytes
    (memory-cap's Headroom, bucket, unshard) mirrors. `op_of(name)` gives an op, or None where
    the name is not in the schedule.

    An op that is no view reads its operands (an in-place op too). A view keeps nothing itself (it aliases its base:
    its readers keep the base). A wait keeps what its collective touches until it completes:
    the launch's operands, which an async collective reads until then (c10d's Work holds its
    input until the wait), and the launch's results, which it writes until then. Every wait of
    a coalesced launch keeps all its operands (one Work for all of them). In a legal schedule
    the launch runs before its wait, so this only ever extends a storage's life to the wait."""
    if isinstance(op, Wait):
        launch = op_of(op.launched_by) if op.launched_by is not None else None
        return (op.launched_by, *launch.operands) if isinstance(launch, Launch) else ()
    if isinstance(op, View) and op.operands:
        return ()
    return op.operands


def simulate(program: Program, model: Any = None, *, costs: Mapping[str, float] | None = None,
             record: bool = False, profile: MemoryProfile | None = None) -> Simulation:
    """Simulate `program.schedule` with `model` (anything `as_cost_model` takes) or given
    per-op `costs` in ms. `record` keeps per-op events and the memory curve (for timelines).
    `profile`: the schedule's `memory_profile`, where the caller has it (not taken again)."""
    with gc_paused():
        return _simulate(program, model, costs, record, profile)


def _simulate(program: Program, model: Any, costs: Mapping[str, float] | None, record: bool,
              profile: MemoryProfile | None = None) -> Simulation:
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
    if profile is None or profile.order != tuple(order):
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
        size = result_bytes(op)
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


def result_bytes(op) -> int:
    """Its results' bytes (a gather of unknown type: its tagged unsharded size)."""
    size = op.nbytes_out
    if not size and isinstance(op, Launch):
        size = op.nbytes or 0
    return max(size or 0, 0)


def alloc_bytes(op) -> int:
    """What an op holds once it ran: its results' bytes (`result_bytes`); views, waits and ops
    whose result aliases an operand (`Op.alias`) share their base's storage and hold nothing."""
    return 0 if _alias_base(op) else result_bytes(op)


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
    padded: dict[str, int] = {}  # an input -> the bytes of a cast that is it (its shard's pad, as gathered)
    for name in order:
        op = ops[name]
        base = _alias_base(op)
        if base is None:
            root[name] = name
            continue
        r = root[name] = root.get(base, base)
        if type(op) is Cast and isinstance(ops.get(r), STATIC):
            # lowering takes a shard's pad for the shard (`alias`): every rank holds its shard as
            # gathered, as the rank whose shard is whole does, so ranks' peaks agree
            padded[r] = max(padded.get(r, 0), result_bytes(op))
    release_at: dict[str, int] = {}   # storage root -> position after which it is released
    freed_at: dict[str, int] = {}
    waited_at: dict[str, int] = {}    # storage root -> the last wait of a collective keeping it
    returned: set[str] = set()        # storage the output returns: live to the end
    op_of = ops.get
    for name in order:
        op = ops[name]
        if isinstance(op, Output):
            returned.update(root[o] for o in op.operands)
            continue
        i = pos[name]
        is_wait = isinstance(op, Wait)
        for kept in keeps_alive(op, op_of):
            r = root.get(kept, kept)
            if release_at.get(r, -1) < i:
                release_at[r] = i
            if is_wait:
                waited_at[r] = i
        if isinstance(op, Free) and op.operands:
            r = root[op.operands[0]]
            freed_at.setdefault(r, i)
    releases: dict[int, list[str]] = {}
    alloc: dict[str, int] = {}
    for name in order:
        op = ops[name]
        size = alloc_bytes(op)
        if padded and name in padded:
            size = max(size, padded[name])
        if size <= 0:
            continue
        alloc[name] = size
        if isinstance(op, STATIC) or (name in returned and name not in freed_at):
            continue  # inputs and constants live throughout, results the graph returns to its end
        i = pos[name]
        if name in freed_at:  # freed: released there, or at a collective's wait after it
            at = max(freed_at[name], waited_at.get(name, -1))
        else:
            at = release_at.get(name, i)
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


def op_getter(program: Program):
    """`op_of` for `keeps_alive` over a program: an op by name (None: no such node)."""
    nodes = program.graph._node
    return lambda name: (nodes.get(name) or {}).get("op")


def keeper_slots(profile: MemoryProfile, op_of) -> dict[str, list[int]]:
    """Each storage root -> the slots (of `profile.order`) of the ops that keep it alive, by
    `keeps_alive`, in order: what a rewrite that erases some of them needs to know where the
    storage is released without them (`last_kept`). O(N)."""
    root = profile.root
    slots: dict[str, list[int]] = {}
    for i, name in enumerate(profile.order):
        op = op_of(name)
        if isinstance(op, Output):
            continue
        for kept in keeps_alive(op, op_of):
            slots.setdefault(root.get(kept, kept), []).append(i)
    return slots


def last_kept(slots: list[int], without: set[int] | frozenset[int]) -> int:
    """The last of `slots` not in `without` (-1: none)."""
    for i in reversed(slots):
        if i not in without:
            return i
    return -1


# ---- stepping the time rules op by op (the rewriting passes' trials) --------------------------

LAUNCH, WAIT, OTHER = 1, 2, 0


def step_of(op, cost: float) -> tuple:
    """What the time rules of `simulate` need of one op: (kind, cost, stream, launch waited on or
    gathered bytes). A wait counts as a wait only on a launch stepped before it (as in `simulate`)."""
    if isinstance(op, Launch):
        gathered = result_bytes(op) if collective_kind(op.target) == "all_gather" else 0
        return (LAUNCH, cost, stream_of(op), gathered)
    if isinstance(op, Wait) and op.operands:  # a coalesced launch's wait reads a result view: its launch
        return (WAIT, cost, None, op.launched_by)
    return (OTHER, cost, None, None)


class Clock:
    """The time half of `simulate`, stepped one op at a time from any state, so that a pass can
    run a rewritten stretch of the schedule from where the two programs still agree and compare
    (`Clock.same`) where they agree again: from there on the rewritten one only runs `t` later.

    `t` is the compute stream's time, `free` each stream's, `ends` every stepped launch's end,
    `pending` the launches stepped and not waited (with their gathered bytes), `exposed` the
    total time waited, `level` the gathered bytes in flight and `peak_level` its largest value
    at the end of a run of equal times (as `simulate` counts `max_inflight_bytes`)."""

    __slots__ = ("t", "free", "ends", "pending", "exposed", "level", "peak_level", "_last")

    def __init__(self):
        self.t = 0.0
        self.free: dict[str, float] = {}
        self.ends: dict[str, float] = {}
        self.pending: dict[str, int] = {}
        self.exposed = 0.0
        self.level = 0
        self.peak_level = 0
        self._last = 0.0

    def fork(self) -> Clock:
        """A copy to run on (`ends` is shared read-only: what a fork steps it keeps in its own)."""
        new = Clock.__new__(Clock)
        new.t, new.exposed, new.level, new.peak_level, new._last = self.t, self.exposed, self.level, 0, self.t
        new.free, new.pending = dict(self.free), dict(self.pending)
        new.ends = _Overlay(self.ends)
        return new

    def step(self, name: str, s: tuple) -> None:
        kind, cost, stream, extra = s
        t = self.t
        if kind == LAUNCH:
            start = self.free.get(stream, 0.0)
            if start < t:
                start = t
            end = start + cost
            self.free[stream] = end
            self.ends[name] = end
            self.pending[name] = extra
            if extra:
                self._level(t, extra)
            return
        if kind == WAIT:
            end = self.ends.get(extra)
            if end is not None:
                if end > t:
                    self.exposed += end - t
                    t = end
                gathered = self.pending.pop(extra, 0)
                if gathered:
                    self._level(t, -gathered)
        self.t = t + cost

    def _level(self, when: float, delta: int) -> None:
        if when != self._last:  # a run of equal times ended: its level counts
            if self.level > self.peak_level:
                self.peak_level = self.level
            self._last = when
        self.level += delta

    def close_level(self) -> int:
        """The largest in-flight level at the end of a run of equal times, so far."""
        return max(self.peak_level, self.level)

    def same(self, other: Clock, tol: float = 1e-9) -> bool:
        """Whether the two run the same from here on, `other` later by `other.t - self.t`:
        every stream and every pending collective is as far ahead of its compute time."""
        if self.pending.keys() != other.pending.keys():
            return False
        a, b = self.t, other.t
        for stream in self.free.keys() | other.free.keys():
            if abs(max(self.free.get(stream, 0.0) - a, 0.0) - max(other.free.get(stream, 0.0) - b, 0.0)) > tol:
                return False
        return all(abs(max(self.ends.get(n) - a, 0.0) - max(other.ends.get(n) - b, 0.0)) <= tol for n in self.pending)

    def step_ms(self) -> float:
        """The step if the program ended here."""
        return max(self.t, max(self.free.values(), default=0.0))


class _Overlay(dict):
    """A dict read through to `base` where it has no key of its own."""

    __slots__ = ("base",)

    def __init__(self, base):
        super().__init__()
        self.base = base

    def get(self, key, default=None):
        if dict.__contains__(self, key):
            return dict.__getitem__(self, key)
        return self.base.get(key, default)


class Sweep:
    """`Clock` along one schedule (`order`, each name's `steps`) with changes made to it in
    schedule order, and trials of a change before it is made.

    A change skips some names and runs new steps just before others (`before`: anchor name ->
    [(name, step)]). `trial` runs the program with and without a change from `at` (where they
    start to differ; the sweep's own clock has reached it) until both ran past `end` and run
    the same again (`Clock.same`), so it costs the stretch the change touches, not the schedule."""

    def __init__(self, order: list[str], steps: Mapping[str, tuple]):
        self.order, self.steps = order, steps
        self.clock = Clock()
        self.at = 0  # the next index of `order` the clock steps
        self.skip: set[str] = set()
        self.before: dict[str, list[tuple[str, tuple]]] = {}

    def advance(self, to: int) -> None:
        """Step the clock through order[at:to] of the program as changed so far."""
        clock, steps, skip, before = self.clock, self.steps, self.skip, self.before
        for name in self.order[self.at:to]:
            for new, s in before.get(name, ()):
                clock.step(new, s)
            if name not in skip:
                clock.step(name, steps[name])
        self.at = max(self.at, to)

    def trial(self, at: int, end: int, skip: set[str], before: dict[str, list]) -> tuple[float, float, int]:
        """(step change, exposed change, largest gathered bytes in flight while they differ) of
        a change that leaves order[:at] alone and touches nothing after order[end]."""
        self.advance(at)
        base, trial = self.clock.fork(), self.clock.fork()
        steps, cur_skip, cur_before, order = self.steps, self.skip, self.before, self.order
        for i in range(at, len(order)):
            name = order[i]
            for new, s in cur_before.get(name, ()):
                base.step(new, s)
                trial.step(new, s)
            for new, s in before.get(name, ()):
                trial.step(new, s)
            if name not in cur_skip:
                s = steps[name]
                base.step(name, s)
                if name not in skip:
                    trial.step(name, s)
                # once the two run the same they stay so: look where a collective starts or ends
                if i >= end and (s[0] != OTHER or i == end) and base.same(trial):
                    return trial.t - base.t, trial.exposed - base.exposed, trial.close_level()
        return trial.step_ms() - base.step_ms(), trial.exposed - base.exposed, trial.close_level()

    def make(self, skip: set[str], before: dict[str, list]) -> None:
        """Make a change (one whose names are all at or after the clock) part of the program."""
        self.skip |= skip
        for anchor, new in before.items():
            self.before.setdefault(anchor, []).extend(new)


def steps_of(program: Program, costs: Mapping[str, float]) -> dict[str, tuple]:
    """`step_of` for every op of the program."""
    nodes = program.graph.nodes
    return {n: step_of(nodes[n]["op"], costs.get(n, 0.0)) for n in program.schedule}
