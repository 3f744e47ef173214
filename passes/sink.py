"""sink: move each gather's waits, views and copy-outs down to just before their first use.

After `hide`, the wait of a gather nobody reads goes down to the first op an effect edge orders
after it (without hide, as in the reference pipeline, it stays: HyperParallel's pass leaves it).

Latest first, each realization node with users goes just before the earliest of its
successors (data and effect: barriers, the phase marker and frees bound it through their
edges) and of the realization node after it, so independent branches keep their order.

Realizations that land before the same node stack in the order the gathers are walked:
`order=launch` (the reference's) walks them in the order their launches had when the
pipeline started; `order=wait` in the order their waits are now. After `hide`, both walk in
the order hide planned the launches in — the order the gathers are needed in (first consumer,
then name), which no scheduling pass changes — because the other two are not fixed points:
prefetch and order-gathers change the launch order, and sink itself the order of waits, so a
second run over the pipeline's own output would restack realizations (same places, another
order) where a stack holds realization nodes of gathers whose order changed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from operator import itemgetter

from ..cost.model import CostAnalysis
from ..ir import DATA, Program, Wait, waits_of
from ..ir.errors import ConfigError
from .base import ModulePass, PassContext, PassResult, option, register_pass
from .feeders import Feeders
from .gathers import GatherAnalysis
from .memory_cap import OVER_PEAK_CAP, Headroom, headroom


@register_pass
@dataclasses.dataclass(frozen=True)
class Sink(ModulePass):
    name = "sink"
    preserves = (GatherAnalysis, Feeders, CostAnalysis)  # costs do not depend on the order
    reorders_only = True

    order: str = option("launch", "stack realizations before one node in launch order (the reference's) "
                                  "or in wait order; after hide, in hide's plan (a fixed point) either way")

    def __post_init__(self):
        if self.order not in ("launch", "wait"):
            raise ConfigError(f"sink: order must be launch or wait, got {self.order!r}")

    def apply(self, ctx: PassContext, program: Program) -> PassResult:
        analysis = ctx.get(GatherAnalysis, program)
        pos = program.schedule.index
        gathers = analysis.gathers
        if ctx.planned is not None:  # after hide
            rank = {name: i for i, name in enumerate(ctx.planned)}
            gathers = sorted(gathers, key=lambda g: rank.get(g.launch, len(rank)))
        elif self.order == "wait":
            gathers = sorted(gathers, key=lambda g: min(map(pos, g.realization)))
        room = headroom(ctx, program)  # the joint peak-memory cap: a copy-out sunk keeps its bucket alive
        sunk = sum(sink_in_order(program, g.realization, room) for g in gathers)
        if ctx.planned is not None:
            # after hide, a gather nobody reads (torchtitan's traces gather the embedding twice):
            # its wait would stall the compute where it is for nothing (the reference's sink,
            # like HyperParallel's, leaves it)
            sunk += sum(sink_in_order(program, waits_of(program, name), room, unread=True)
                        for name in analysis.unconsumed)
        stats = {"sunk": sunk} if room is None else {"sunk": sunk, OVER_PEAK_CAP: room.refused}
        return PassResult(sunk > 0, stats)


def sink_in_order(program: Program, nodes: Iterable[str], room: Headroom | None = None,
                  unread: bool = False) -> int:
    """Sink `nodes` (in any order), latest first, each to just before the earliest of its
    successors and of the next node that was sunk; nodes nobody reads stay (with `unread`, a wait
    nobody reads goes before its earliest successor), and so do nodes whose move would go over
    the peak cap (`room`). Returns the count."""
    schedule = program.schedule
    pos = schedule.index
    succ = program.successors  # the raw adjacency: networkx's views cost more than this loop
    sunk = 0
    after = later = None  # the node handled before (the next in the order), and its position now
    # Each node's position is read once, here: a move takes a node later than every node still
    # to come, which so keep theirs; and the node handled before is where it was left, or just
    # before the target it went to. (A position is a lookup in two tables of every name, a cache
    # miss or more each at 100k nodes: read again per node, they were most of this loop.)
    for here, name in sorted(zip(map(pos, nodes), nodes), reverse=True):
        nbrs = succ[name]
        if DATA not in map(_KIND, nbrs.values()):  # nobody reads it
            # a wait nobody reads (a gather whose result is unused) only stalls the compute where
            # it is: it goes down to the first op an effect edge orders after it (the phase
            # marker, a barrier, a free, the output); anything else stays
            if not (unread and nbrs and isinstance(program.op(name), Wait)):
                continue
        at, target = min(zip(map(pos, nbrs), nbrs))  # (positions differ: names are never compared)
        if after is not None and later < at:
            target, at = after, later
        if at > here + 1:
            move = room.later(name, target) if room is not None else None
            if room is None or move is not None:
                schedule.move_before([name], target)
                sunk += 1
                if move is not None:
                    move.take()
                after, later = name, at - 1  # (the target moved up one as it left)
                continue
        after, later = name, here
    return sunk


_KIND = itemgetter("kind")
