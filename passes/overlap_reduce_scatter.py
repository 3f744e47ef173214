"""overlap-reduce-scatter: let gradient reduce-scatters run under the backward compute after them.

Each reduce-scatter launches as soon as its gradient is ready: the launch, with the views that
feed only it, rises to just after its latest predecessor (its gradient's producer, or the
collective before it in its group's order: reduce-scatters keep their traced order, unless
`unorder-reduce-scatters` marked them, when each may rise past the others; `hoist=false` leaves
launches where they are).
Then what follows each reduce-scatter's wait — its views (a bucket's per-parameter slices), casts
(a bf16 gradient cast to fp32 for the output) and single-operand arithmetic — sinks to its
uses, so that none of it pins the wait.

Then each wait moves down only as far as hides its collective (`reduce_scatter_waits.plan_waits`: one walk down the order
with the simulator's clock, `cost.simulate.Clock`, on the cost model's times): to before the
first op the compute stream reaches once the collective has ended, or, if it ends later still,
before the wait's earliest successor (its users, or the barrier, free or output an effect edge
orders after it). Its collective's input and result (the gradient: the simulator counts them
live until the wait, `keeps_alive`) are so held for the least time that hides it — the same
step as a wait sunk to its first use, with less in flight and a lower peak. It times the order
it is given, so it runs last (after `order-gathers`).

`max-in-flight-gb` bounds the gradient bytes of the reduce-scatters launched and not yet waited;
where holding waits would go over it, those whose collectives end soonest go back first (the
least exposed time for the bytes freed; `over budget`). Under a peak-memory cap (`memory-cap`)
each wait's move is checked against the simulated peak too (`over peak cap`): the budget is then
a second, flat bound on the same bytes (1 GiB by default; a larger one leaves only the cap).
"""

from __future__ import annotations

import dataclasses

from ..cost.model import CostAnalysis
from ..ir import Cast, Compute, Launch, Program, Role, View, waits_of
from .base import ModulePass, PassContext, PassResult, check_budget, option, register_pass
from .feeders import Feeders
from .gathers import GatherAnalysis
from .memory_cap import OVER_PEAK_CAP, Headroom, headroom
from .reduce_scatter_waits import launches_and_waits, plan_waits
from .sink import sink_in_order


@register_pass
@dataclasses.dataclass(frozen=True)
class OverlapReduceScatter(ModulePass):
    name = "overlap-reduce-scatter"
    preserves = (GatherAnalysis, Feeders, CostAnalysis)
    reorders_only = True

    max_in_flight_gb: float = option(1.0, "most gradient GiB in flight between reduce-scatter launches and their waits "
                                          "(beyond it, waits go back in, those whose collectives end soonest first)")
    hoist: bool = option(True, "launch each reduce-scatter as soon as its gradient is ready (false: where it is)")

    def __post_init__(self):
        check_budget(self.name, "max-in-flight-gb", self.max_in_flight_gb)

    def apply(self, ctx: PassContext, program: Program) -> PassResult:
        schedule = program.schedule
        # the launches and waits (what the walk below steps by a rule of its own), picked out in
        # C: a Python step per op of the order was a fifth of this pass at 100k nodes; the
        # reduce-scatters among them, in schedule order
        collectives = launches_and_waits(program)
        launches = sorted((n for n, op in collectives.items() if isinstance(op, Launch) and op.role is Role.REDUCE_SCATTER),
                          key=schedule.index)  # in schedule order
        # the joint peak-memory cap: a hoisted launch holds its result earlier, a sunk cast keeps
        # what it reads alive longer, a held wait its collective's input and result
        room = headroom(ctx, program)
        # what travels with each launch and trails each wait is read off the graph's edges,
        # which moves leave as they are: each is found once, for the moves and for the walk
        found = ctx.get(Feeders, program)
        feeders = {name: found.of(name) for name in launches}
        placed: set[str] = set()  # what this run hoisted so far (`_hoist`)
        hoisted = sum(_hoist(program, name, room, feeders[name], placed) for name in launches) if self.hoist else 0
        # views of each result (a bucket's per-parameter slices) and casts of it (to the
        # gradient's dtype) go down to their uses first, so that the wait can follow them
        tail_sunk = 0  # moves too, even where no wait follows them
        tails: dict[str, set[str]] = {}  # wait -> what trails it
        for name in launches:
            for wait in sorted(waits_of(program, name), key=schedule.index):
                tail = tails[wait] = _tail_of(program, wait)
                tail_sunk += sink_in_order(program, tail, room)
        # what the other passes put right before or after its anchor or use (a gather's chain and
        # realization, a reduce-scatter's launch with its views, a reduced gradient's views and
        # casts): a wait never goes back in beside one, so that a second run finds each where it
        # put it, and moves nothing
        gathers = ctx.get(GatherAnalysis, program)
        travelling = {n for g in gathers.gathers for n in (*g.chain, *g.realization)}
        travelling.update(w for name in gathers.unconsumed for w in waits_of(program, name))
        for name in launches:
            travelling |= feeders[name]
        for tail in tails.values():
            travelling |= tail
        plan, stats = plan_waits(program, ctx.get(CostAnalysis, program).ms, launches, travelling,
                                 int(self.max_in_flight_gb * 2**30), collectives)
        before = schedule.names()
        for wait, target in plan:  # in the order the walk put them back: waits before one target stack so
            if schedule.index(target) == schedule.index(wait) + 1:
                continue  # where it is
            move = room.later(wait, target) if room is not None else None
            if room is not None and move is None:
                continue  # counted in room.refused
            schedule.move_before([wait], target)
            if move is not None:
                move.take()
        stats = {"hoisted": hoisted, **stats}
        if room is not None:
            stats[OVER_PEAK_CAP] = room.refused
        return PassResult(hoisted + tail_sunk > 0 or schedule.names() != before, stats)


def _hoist(program: Program, launch: str, room: Headroom | None, members: set[str], placed: set[str]) -> bool:
    """Move `launch` and the views that feed only it (`members`: `launch` too) to just after
    their latest other predecessor and the launches this run already put there (`placed`, which
    it extends), if that fits under the peak cap (`room`). Returns whether it moved.

    After those put there: two `unordered` launches (no edge between them) with the same latest
    predecessor keep their order, so that a second run finds each where the first put it (each
    went to the slot right after it, so the second landed before the first, and every run
    swapped them back)."""
    schedule = program.schedule
    pred = program.predecessors  # the raw dict: networkx's view costs more per lookup
    at = max((schedule.index(p) for n in members for p in pred[n] if p not in members), default=-1) + 1
    placed.update(members)
    while schedule[at] in placed and schedule[at] not in members:
        at += 1
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
