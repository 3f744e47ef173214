"""unshard: the backward reads a parameter's forward replica, within a peak-memory cap.

Selective unsharding: instead of gathering a parameter again, the backward keeps the one the
forward gathered, where the simulated peak memory stays within a cap.

A candidate is a parameter whose forward gather is freed after the forward (a Free of its
wait) and gathered again in the backward (a launch with role REGATHER of the same shard, same
group and type). Unsharding it erases the forward free and the backward launch and wait (and
the re-gather's private cast of the shard, under mixed precision); the re-gather's views and
its backward free then read the forward wait, so the replica lives from the forward gather
to the backward free. Both gathers read the same shard, which nothing writes in between, and
nothing writes the forward replica in place (`replica written` otherwise), so the backward
computes bitwise the same.

Candidates go best first — the most exposed communication per byte held, then the most
communication per byte — and each is taken only if the program's simulated peak memory with
it stays within the cap: `max-peak-gb` when set, else the input's simulated peak plus
`max-peak-increase-gb` (both set: the smaller; neither: the joint cap of a `memory-cap` before it,
or without one the input's peak; its own options only tighten a joint cap), and only if it
shortens the simulated step (by `min-saved-ms` when set; else at all: a re-gather already
hidden would hold its replica for no time, `saves too little`). Every candidate not taken says
why in the statistics and, when its launch has no reason yet, in its `hold`. Run it after the
scheduling passes (`default,unshard{...}`), so the cap is checked on the final order.

The cap is checked on a max tree of the live bytes at each op, to which a candidate adds its
change (its replica lives on, the re-gather's buffer and cast are gone): O(log N) per candidate,
the same choices as simulating the unsharded program per candidate. Those that fit are then run
in schedule order in one sweep (cost/simulate.py's `Sweep`): each one's saving is with those
before it in the schedule unsharded too, one that saves nothing is dropped (what it would have
held only lowers the curve; a candidate the cap refused is not tried again), and the savings of
those taken (`bought`) add up to the step's change. With `min-saved-ms`, each candidate is
simulated whole, on a copy (for small graphs).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import attrs

from ..cost.model import CostAnalysis
from ..cost.simulate import MemoryProfile, Sweep, keeper_slots, last_kept, op_getter, simulate, steps_of
from ..ir import DATA, Cast, Free, Launch, Program, Role, Wait, storage_root
from ..ir.storage import storage_candidates_of
from ..ir.holds import OVER_PEAK_CAP, SAVES_TOO_LITTLE, register_hold
from ..ir.rewriter import Rewriter
from .base import ModulePass, PassContext, PassResult, check_budget, check_ms, option, register_pass
from .maxtree import MaxTree
from .memory_cap import MemoryAnalysis, cap_bytes, rewrite_cap, rewrite_stats

NO_FORWARD_REPLICA = register_hold("no forward replica", "unshard: no single forward gather of the same shard, "
                                                         "group and type whose replica the forward frees")
BUCKETED = register_hold("bucketed", "unshard: it gathers a bucket; only single-parameter re-gathers are unsharded")
SHARD_WRITTEN = register_hold("shard written", "unshard: the shard is written in place, so the forward replica may "
                                               "differ from what the re-gather would read")
REPLICA_WRITTEN = register_hold("replica written", "unshard: the forward replica is written in place, so the backward "
                                                   "would read what the forward left, not the shard gathered again")


@attrs.frozen
class Candidate:
    param: str
    regather: str          # the backward launch, erased
    regather_wait: str     # its wait, erased; its users read `forward_wait` instead
    regather_cast: str | None  # the re-gather's private cast of the shard, erased with it
    forward_wait: str      # the forward replica, kept alive
    forward_free: str      # erased
    nbytes: int            # the replica's size: what holding it costs


@register_pass
@dataclasses.dataclass(frozen=True)
class Unshard(ModulePass):
    name = "unshard"

    max_peak_gb: float = option(0.0, "cap on the simulated peak memory, in GiB (0: none; the input's "
                                     "peak plus max-peak-increase-gb applies)")
    max_peak_increase_gb: float = option(0.0, "how far, in GiB, the simulated peak may rise over the input's "
                                              "(used when max-peak-gb is 0, or with it: the smaller cap wins)")
    min_saved_ms: float = option(0.0, "take a candidate only if it shortens the simulated step by at least "
                                      "this many ms (0: every candidate that fits the cap and shortens the "
                                      "step at all)")

    def __post_init__(self):
        check_budget(self.name, "max-peak-gb", self.max_peak_gb)
        check_budget(self.name, "max-peak-increase-gb", self.max_peak_increase_gb)
        check_ms(self.name, "min-saved-ms", self.min_saved_ms)

    def apply(self, ctx: PassContext, program: Program) -> PassResult:
        costs = ctx.get(CostAnalysis, program).ms
        before = simulate(program, costs=costs, profile=ctx.get(MemoryAnalysis, program).profile)
        cap = rewrite_cap(self.max_peak_gb, self.max_peak_increase_gb, before.peak_bytes, cap_bytes(ctx))
        candidates, held = find_candidates(program)
        pos = program.schedule.index

        def merit(c: Candidate):
            per_byte = max(c.nbytes, 1)
            return (-before.exposed_by_collective.get(c.regather, 0.0) / per_byte,
                    -costs.get(c.regather, 0.0) / per_byte, pos(c.regather))

        ordered = sorted(candidates, key=merit)
        if self.min_saved_ms > 0:  # each candidate's saving depends on those taken before it
            taken, saved = self._take_simulated(program, ordered, costs, before, cap, held)
        else:
            fits = self._take_within_cap(program, ctx, ordered, cap, held)
            saved = _savings(program, costs, fits, held)
            taken = [c for c in fits if c.param in saved]
        bought: dict[str, dict[str, float]] = {}
        for c in taken:
            step, exposed = saved[c.param]
            bought[c.param] = {"exposed_saved_ms": round(exposed, 6), "step_saved_ms": round(step, 6),
                               "comm_saved_ms": round(costs.get(c.regather, 0.0), 6), "held_bytes": c.nbytes}
        for c in taken:
            unshard(program, c)
        after = simulate(program, costs=costs) if taken else before

        for launch, reason in held.items():
            op = program.op(launch)
            if op.hold is None:
                program.replace(attrs.evolve(op, hold=reason))
        stats = {
            "unsharded": len(bought),
            **Counter(held.values()),
            **rewrite_stats(before, after, cap),
            "bought": bought,
        }
        return PassResult(bool(bought), stats)

    @staticmethod
    def _take_within_cap(program: Program, ctx: PassContext, ordered: list[Candidate], cap: float,
                         held: dict[str, str]) -> list[Candidate]:
        """The candidates, best first, that keep the simulated peak within the cap: each one's
        change to the live-bytes curve (its replica lives on to the re-gather's release; the
        re-gather's buffer and cast are gone) is added to a max tree over the schedule, O(log N)."""
        profile = ctx.get(MemoryAnalysis, program).profile
        tree = MaxTree.of(list(profile.live))
        n = len(profile.order)
        slot = {name: i for i, name in enumerate(profile.order)}
        released = {buf: i for i, bufs in profile.releases.items() for buf in bufs}
        kept = keeper_slots(profile, op_getter(program))
        taken = []
        for c in ordered:
            changes = _live_changes(c, slot, profile, released, kept, program.op(c.regather).operands[0])
            for lo, hi, nbytes in changes:
                tree.add(lo, hi, nbytes)
            if tree.max(0, n) > cap:
                for lo, hi, nbytes in changes:
                    tree.add(lo, hi, -nbytes)
                held[c.regather] = OVER_PEAK_CAP
                continue
            taken.append(c)
        return taken

    def _take_simulated(self, program: Program, ordered: list[Candidate], costs, before, cap: float,
                        held: dict[str, str]) -> tuple[list[Candidate], dict[str, tuple[float, float]]]:
        """With min-saved-ms: each candidate simulated on a copy with those taken before it (a
        whole simulation per candidate: this option is for small graphs)."""
        current, taken, saved = before, [], {}
        for c in ordered:
            trial = program.copy()
            for t in taken + [c]:
                unshard(trial, t)
            after = simulate(trial, costs=costs)
            if after.peak_bytes > cap:
                held[c.regather] = OVER_PEAK_CAP
                continue
            if current.step_ms - after.step_ms < self.min_saved_ms:
                held[c.regather] = SAVES_TOO_LITTLE
                continue
            saved[c.param] = (current.step_ms - after.step_ms, current.exposed_ms - after.exposed_ms)
            taken.append(c)
            current = after
        return taken, saved


def _live_changes(c: Candidate, slot: dict[str, int], profile: MemoryProfile, released: dict[str, int],
                  kept: dict[str, list[int]], source: str) -> list[tuple[int, int, int]]:
    """How unsharding `c` changes the live bytes (as `memory_profile` counts them) at each slot
    of the schedule: (lo, hi, bytes) added over slots [lo, hi). The forward replica, released at
    the forward free, lives on to where the re-gather's buffer was released (its readers and its
    free are the replica's now); the re-gather's buffer and its cast are gone; what the re-gather
    read (`source`, a cast someone else reads too), which its launch and wait kept alive
    (`keeps_alive`), is released after its last other keeper (`kept`: each storage's keepers'
    slots). An erased op's slot keeps the bytes live just before it, which the next op's slot has
    too, so maxima are exact."""
    root, alloc, end = profile.root, profile.alloc, len(profile.order)
    replica, regathered = root[c.forward_wait], root[c.regather_wait]
    changes = []
    r = root.get(source, source)
    if r != c.regather_cast and alloc.get(r, 0) and r in released:
        until = max(last_kept(kept.get(r, ()), {slot[c.regather], slot[c.regather_wait]}), slot[r])
        if until < released[r]:
            changes.append((until + 1, released[r] + 1, -alloc[r]))
    if released.get(replica) == slot[c.forward_free]:  # else it lives on anyway (the output returns it)
        until = released.get(regathered, end - 1)
        changes.append((slot[c.forward_free] + 1, until + 1, alloc.get(replica, 0)))
    for gone in (regathered, c.regather_cast):
        if gone is not None and alloc.get(gone, 0) and gone in released:
            changes.append((slot[gone], released[gone] + 1, -alloc[gone]))
        elif gone is not None and alloc.get(gone, 0):
            changes.append((slot[gone], end, -alloc[gone]))
    return changes


def _savings(program: Program, costs, fits: list[Candidate], held: dict[str, str]) -> dict[str, tuple[float, float]]:
    """What each candidate that fits the cap saves (step, exposed ms), with those before it in
    the schedule taken too: one sweep of the schedule, each candidate run from its re-gather
    until the program runs as without it again (the savings add up to the whole change). One
    that does not shorten the step is not taken (held `saves too little`): a hidden re-gather
    would hold its replica for nothing."""
    pos = program.schedule.index
    sweep = Sweep(program.schedule.names(), steps_of(program, costs))
    saved = {}
    for c in sorted(fits, key=lambda c: pos(c.regather_cast or c.regather)):
        skip = {c.regather, c.regather_wait} | ({c.regather_cast} if c.regather_cast else set())  # a free takes no time
        step, exposed, _ = sweep.trial(pos(c.regather_cast or c.regather), pos(c.regather_wait), skip, {})
        if not step < 0:
            held[c.regather] = SAVES_TOO_LITTLE
            continue
        saved[c.param] = (-step, -exposed)
        sweep.make(skip, {})
    return saved


def unshard(program: Program, c: Candidate) -> Rewriter:
    """Rewrite one candidate in `program` (see the module docstring)."""
    rewriter = Rewriter(program)
    rewriter.erase(c.forward_free)  # first: the re-gather's readers may not follow a free of the replica
    rewriter.replace_uses(c.regather_wait, c.forward_wait)
    rewriter.erase(c.regather_wait)
    rewriter.erase(c.regather)
    if c.regather_cast is not None:
        rewriter.erase(c.regather_cast)
    return rewriter


def find_candidates(program: Program) -> tuple[list[Candidate], dict[str, str]]:
    """The re-gathers that can read their forward replica, and why each other one cannot
    (launch -> hold reason)."""
    node, succ = program.node_data, program.successors
    pos = program.schedule.index
    ops = list(program.ops())
    roots: dict[str, str] = {}
    forward_gathers: dict[tuple, list[Launch]] = {}  # (params, group) -> unbucketed forward gathers, in order
    replica_frees: dict[str, list[str]] = {}         # storage root -> the frees of it
    for op in ops:
        if isinstance(op, Launch) and op.role is Role.GATHER and op.bucket is None:
            forward_gathers.setdefault((op.params, op.group), []).append(op)
        elif isinstance(op, Free) and op.operands:
            replica_frees.setdefault(storage_root(program, op.operands[0], roots), []).append(op.name)
    # storage roots some op writes in place (a write through a result that may be another
    # storage writes it too: may_alias)
    written = storage_candidates_of(program, (w for op in ops for w in op.writes), roots)
    candidates, held = [], {}
    claimed: set[str] = set()  # forward frees a candidate erases

    def wait_of(launch: str) -> str | None:
        waits = [u for u, e in succ[launch].items() if e["kind"] == DATA and isinstance(node[u]["op"], Wait)]
        return waits[0] if len(waits) == 1 else None

    for regather in ops:
        if not isinstance(regather, Launch) or regather.role is not Role.REGATHER:
            continue
        if regather.bucket is not None or len(regather.params) != 1:
            held[regather.name] = BUCKETED
            continue
        param = regather.params[0]
        at = pos(regather.name)
        forward = [op for op in forward_gathers.get((regather.params, regather.group), ()) if pos(op.name) < at]
        forward_wait = wait_of(forward[-1].name) if forward else None
        regather_wait = wait_of(regather.name)
        source = _source(program, regather)
        if forward_wait is None or regather_wait is None or source is None or _source(program, forward[-1]) != source \
                or node[forward_wait]["op"].types != node[regather_wait]["op"].types:
            held[regather.name] = NO_FORWARD_REPLICA
            continue
        frees = replica_frees.get(forward_wait, ())
        if len(frees) != 1 or not pos(forward_wait) < pos(frees[0]) < at or frees[0] in claimed:
            held[regather.name] = NO_FORWARD_REPLICA  # (a replica serves the first re-gather after its free)
            continue
        if storage_root(program, source[0], roots) in written:
            held[regather.name] = SHARD_WRITTEN
            continue
        if storage_root(program, forward_wait, roots) in written:
            held[regather.name] = REPLICA_WRITTEN
            continue
        cast = regather.operands[0] if isinstance(node[regather.operands[0]]["op"], Cast) else None
        if cast is not None and [u for u, e in succ[cast].items() if e["kind"] == DATA] != [regather.name]:
            cast = None  # someone else reads it: it stays
        claimed.add(frees[0])
        candidates.append(Candidate(param, regather.name, regather_wait, cast, forward_wait, frees[0],
                                    node[forward_wait]["op"].nbytes_out or regather.nbytes or 0))
    return candidates, held


def _source(program: Program, launch: Launch) -> tuple | None:
    """What a gather gathers: its shard, or a cast of it (target, type, shard); None if neither."""
    if len(launch.operands) != 1:
        return None
    op = program.op(launch.operands[0])
    if isinstance(op, Cast) and len(op.operands) == 1:
        return (op.operands[0], op.target, op.types)
    return (op.name,)
