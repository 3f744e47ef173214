"""overlap-reduce-scatter: let gradient reduce-scatters run under the backward compute after them.

Each reduce-scatter launches as soon as its gradient is ready: the launch, with the views that
feed only it, rises to just after its latest predecessor (its gradient's producer, or the
reduce-scatter before it: they keep their order; `hoist=false` leaves launches where they are).
Then what follows each reduce-scatter's wait — its views (a bucket's per-parameter slices), casts
(a bf16 gradient cast to fp32 for the output) and single-operand arithmetic — sinks to its
uses, so that none of it pins the wait, and its
wait moves down to just before its earliest successor (its users, or the barrier, free or
output that bounds it through an effect edge), so the compute between launch and wait hides it.
Gradient bytes kept alive by a delayed wait are in flight from the launch to the wait (the
collective reads its input until then: the simulator counts it live, `keeps_alive`);
reduce-scatters are admitted in launch order while the in-flight total stays within
`max-in-flight-gb` and the peak within the joint cap (`memory-cap`); the others keep their
wait where it was.
"""

from __future__ import annotations

import dataclasses
from operator import itemgetter

from ..ir import Cast, Compute, Launch, Program, Role, View, waits_of
from .base import ModulePass, PassContext, PassResult, check_budget, option, register_pass
from .budget import MaxTree
from .gathers import GatherAnalysis
from .memory_cap import OVER_PEAK_CAP, Headroom, headroom
from .sink import sink_in_order


@register_pass
@dataclasses.dataclass(frozen=True)
class OverlapReduceScatter(ModulePass):
    name = "overlap-reduce-scatter"
    preserves = (GatherAnalysis,)
    reorders_only = True

    max_in_flight_gb: float = option(1.0, "most gradient GiB in flight between reduce-scatter launches and their waits")
    hoist: bool = option(True, "launch each reduce-scatter as soon as its gradient is ready (false: where it is)")

    def __post_init__(self):
        check_budget(self.name, "max-in-flight-gb", self.max_in_flight_gb)

    def apply(self, ctx: PassContext, program: Program) -> PassResult:
        schedule = program.schedule
        limit = int(self.max_in_flight_gb * 2**30)
        names = schedule.names()
        ops = map(itemgetter("op"), map(program.node_data.__getitem__, names))  # in C: no call per name
        launches = [n for n, op in zip(names, ops) if isinstance(op, Launch) and op.role is Role.REDUCE_SCATTER]
        # in-flight bytes over the starting order's positions; a wait only moves later, so
        # positions between a launch and its new wait never shift out of order
        tree = MaxTree(len(schedule) + 1)
        stats = {"hoisted": 0, "overlapped": 0, "over budget": 0, "in place": 0}
        # the joint peak-memory cap: a hoisted launch holds its result earlier, a sunk cast keeps
        # what it reads alive longer, a delayed wait its collective's input and result
        room = headroom(ctx, program)
        if self.hoist:
            stats["hoisted"] = sum(_hoist(program, name, room) for name in launches)
        tail_sunk = 0  # moves too, even where no wait follows them
        for name in launches:
            # one wait, or a coalesced launch's wait per result: in flight until the last
            waits = sorted(waits_of(program, name), key=schedule.index)
            # views of the result (a bucket's per-parameter slices) and casts of it (to the
            # gradient's dtype) go down to their uses first, so that the wait can follow them
            for wait in waits:
                tail_sunk += sink_in_order(program, sorted(_tail_of(program, wait), key=schedule.index), room)
            targets = {}
            for wait in waits:
                succ = program.graph.succ[wait]
                if succ and schedule.index(target := min(succ, key=schedule.index)) > schedule.index(wait) + 1:
                    targets[wait] = target
            if not targets:
                stats["in place"] += 1
                continue
            op = program.op(name)
            sources = op.operands if len(op.types) > 1 else op.operands[:1]  # coalesced: every input
            nbytes = sum(program.op(o).nbytes_out for o in dict.fromkeys(sources))
            lo, hi = schedule.index(name), max(map(schedule.index, targets.values()))
            if tree.max(lo, hi) + nbytes > limit:
                stats["over budget"] += 1
                continue
            # the joint peak-memory cap: a wait moved down keeps the gradient it reduces live to there
            move = room.later_all(targets) if room is not None else None
            if room is not None and move is None:
                continue   # counted in room.refused
            tree.add(lo, hi, nbytes)
            for wait, target in targets.items():
                schedule.move_before([wait], target)
            if move is not None:
                move.take()
            stats["overlapped"] += 1
        if room is not None:
            stats[OVER_PEAK_CAP] = room.refused
        return PassResult(stats["hoisted"] + stats["overlapped"] + tail_sunk > 0, stats)


def _hoist(program: Program, launch: str, room: Headroom | None = None) -> bool:
    """Move `launch` and the views that feed only it to just after their latest other
    predecessor, if that fits under the peak cap (`room`). Returns whether it moved."""
    schedule = program.schedule
    pred = program.graph.pred
    members = program.private_feeders(launch, (View,))
    at = max((schedule.index(p) for n in members for p in pred[n] if p not in members), default=-1) + 1
    # a coalesced launch's views of several gradients: those already above `at` stay there
    chain = sorted((n for n in members if schedule.index(n) >= at), key=schedule.index)
    while chain and schedule.index(chain[0]) == at:  # already in place
        chain.pop(0)
        at += 1
    if not chain:
        return False
    move = room.earlier(chain, schedule[at]) if room is not None else None
    if room is not None and move is None:
        return False
    schedule.move_before(chain, schedule[at])
    if move is not None:
        move.take()
    return True


def _follows(op) -> bool:
    """What may trail a reduced gradient: a view, a cast, light single-operand arithmetic."""
    if isinstance(op, (View, Cast)):
        return True
    return isinstance(op, Compute) and len(op.operands) == 1 and not (op.heavy or op.random)


def _tail_of(program: Program, root: str) -> set[str]:
    tail, stack = set(), [root]
    while stack:
        for user in program.users(stack.pop()):
            if user not in tail and _follows(program.op(user)):
                tail.add(user)
                stack.append(user)
    return tail
