"""order-gathers: gathers launched back to back go to their stream most urgent first.

A communication stream runs collectives in launch order, so where several gather chains sit
next to each other (after a barrier, at the start of a phase, stacked on one anchor) the
one whose first consumer comes first should launch first. Each run of adjacent gather
chains, with nothing else between them, is stably sorted by first consumer; a run with an
edge between two of its chains keeps its order. No node leaves its run, so nothing crosses
a barrier or another collective. A gather that moves ahead of another now launches early, so
it is marked `prefetched` and its bytes count against `max-in-flight-gb` from the run to its
first consumer, as `budget` counts them; a run whose reorder would go over it keeps its order.
Under a peak-memory cap, each gather moved ahead is checked (and counted) as a chain moving up
to just before the first chain it now precedes that keeps its place, which is where it runs:
the others keep their places relative to everything outside the moved chains.
A gather of unknown size, or held by lowering, stays where it is (it ends a run).
"""

from __future__ import annotations

import dataclasses
from itertools import accumulate, count

import attrs

from ..cost.model import CostAnalysis
from ..ir import Launch, Program
from .base import ModulePass, PassContext, PassResult, check_budget, option, register_pass
from .budget import MaxTree
from .feeders import Feeders
from .gathers import Gather, GatherAnalysis, held_by_lowering
from .memory_cap import OVER_PEAK_CAP, headroom


@register_pass
@dataclasses.dataclass(frozen=True)
class OrderGathers(ModulePass):
    name = "order-gathers"
    preserves = (GatherAnalysis, Feeders, CostAnalysis)  # costs do not depend on the order
    reorders_only = True
    after = ("prefetch",)

    max_in_flight_gb: float = option(1.0, "most unsharded GiB launched early and not yet consumed")

    def __post_init__(self):
        check_budget(self.name, "max-in-flight-gb", self.max_in_flight_gb)

    def apply(self, ctx: PassContext, program: Program) -> PassResult:
        analysis = ctx.get(GatherAnalysis, program)
        schedule = program.schedule
        pos = schedule.index
        owner = {n: g for g in analysis.gathers for n in g.chain}
        # each gather's launch op, read once (a lookup by name costs a cache miss or more at 100k
        # nodes): a gather's op is replaced only after its run has read it
        ops = {g.launch: program.op(g.launch) for g in analysis.gathers}
        runs = _runs(program, analysis.gathers, owner, ops)
        # early bytes in flight over the slots of this order; a run's gathers are counted from
        # the run's first slot, wherever in the run they end up
        start = {g.launch: first for run in runs for first in (pos(run[0].chain[0]),) for g in run}
        limit = int(self.max_in_flight_gb * 2**30)
        # the prefetched gathers' spans summed into the slots' totals, the tree built over them at
        # once (a range add per gather was most of this pass: thousands of walks up the tree)
        live = [0] * (len(schedule) + 2)
        for g in analysis.gathers:
            op = ops[g.launch]
            if op.prefetched and op.nbytes:
                lo, hi = start.get(g.launch, pos(g.launch)), pos(g.first_consumer)
                if lo < hi:
                    live[lo] += op.nbytes
                    live[hi] -= op.nbytes
        tree = MaxTree.of(list(accumulate(live[:-1])))
        stats = {"runs": len(runs), "reordered": 0, "moved ahead": 0, "over budget": 0}
        room = headroom(ctx, program)  # the joint peak-memory cap, when one is in force
        if room is not None:
            stats[OVER_PEAK_CAP] = 0
        for run in runs:
            urgent = sorted(run, key=lambda g: pos(g.first_consumer))  # stable: ties keep launch order
            if urgent == run or _linked(program, run, owner):
                continue
            ahead = _moved_ahead(run, urgent)
            # a gather moved ahead launches earlier: its bytes live from where it now runs
            move = room.earlier_all(_targets(urgent, ahead)) if room is not None else None
            if room is not None and move is None:
                stats[OVER_PEAK_CAP] += 1
                continue
            if move is not None:
                move.take()
            newly = [(start[g.launch], pos(g.first_consumer), ops[g.launch].nbytes)
                     for g in ahead if not ops[g.launch].prefetched]
            if newly and (limit == 0 or not _admit(tree, newly, limit)):  # 0: no early launch at all, as in budget
                stats["over budget"] += 1
                if move is not None:
                    move.undo()
                continue
            after = schedule[pos(run[-1].chain[-1]) + 1]
            schedule.move_before([n for g in urgent for n in g.chain], after)
            stats["reordered"] += 1
            stats["moved ahead"] += len(ahead)
            for g in ahead:
                program.replace(attrs.evolve(ops[g.launch], prefetched=True))
        return PassResult(stats["reordered"] > 0, stats)


def _moved_ahead(run: list[Gather], urgent: list[Gather]) -> list[Gather]:
    """The gathers that launch before some chain they followed in `run`, once in `urgent` order."""
    rank = {g.launch: i for i, g in enumerate(urgent)}
    ahead, latest = [], -1  # latest: the furthest new place among the chains before, old order
    for g in run:
        if latest > rank[g.launch]:
            ahead.append(g)
        latest = max(latest, rank[g.launch])
    return ahead


def _targets(urgent: list[Gather], ahead: list[Gather]) -> list[tuple[list[str], str]]:
    """Each gather moved ahead, as (its chain, the first op of the chain after it in `urgent`
    that is not moved ahead): the slot it runs in. The chains not moved ahead keep their order
    and their places among the rest, so a chain moved ahead runs just before the next of them;
    one always follows it (the chain it was moved ahead of is one, or follows one)."""
    moved = {g.launch for g in ahead}
    out, target = [], None
    for g in reversed(urgent):
        if g.launch in moved:
            out.append((list(g.chain), target))
        else:
            target = g.chain[0]
    return out[::-1]


def _admit(tree: MaxTree, spans: list[tuple[int, int, int]], limit: int) -> bool:
    """Add every (lo, hi, bytes) span to `tree` if all fit within `limit` together; else none."""
    added = []
    for lo, hi, nbytes in spans:
        if tree.max(lo, hi) + nbytes > limit:
            for span in added:
                tree.add(span[0], span[1], -span[2])
            return False
        tree.add(lo, hi, nbytes)
        added.append((lo, hi, nbytes))
    return True


def _runs(program: Program, gathers: tuple[Gather, ...], owner: dict[str, Gather],
          ops: dict[str, Launch]) -> list[list[Gather]]:
    """Maximal runs (two or more) of contiguous gather chains that follow each other directly."""
    pos = program.schedule.index
    runs: list[list[Gather]] = []
    run: list[Gather] = []
    end = None  # position just past the last chain of `run`
    # (each chain's first position read once, and its last only where it is another node: a
    # lookup costs a cache miss or more at 100k nodes)
    for first, _, g in sorted(zip(map(pos, [g.chain[0] for g in gathers]), count(), gathers)):
        last = first if len(g.chain) == 1 else pos(g.chain[-1])
        op = ops[g.launch]
        # a chain split by other nodes does not move as one here; a gather of unknown size or
        # held by lowering must not move early at all
        contiguous = (last - first + 1 == len(g.chain) and all(owner.get(n) is g for n in g.chain)
                      and op.nbytes is not None and not held_by_lowering(op))
        if contiguous and run and first == end:
            run.append(g)
        else:
            if len(run) > 1:
                runs.append(run)
            run = [g] if contiguous else []
        end = last + 1 if contiguous else None
    if len(run) > 1:
        runs.append(run)
    return runs


def _linked(program: Program, run: list[Gather], owner: dict[str, Gather]) -> bool:
    """Whether an edge joins two chains of `run` (then their order is not ours to change)."""
    members = {id(g) for g in run}
    for g in run:
        for n in g.chain:
            for p in program.graph.pred[n]:
                o = owner.get(p)
                if o is not None and o is not g and id(o) in members:
                    return True
    return False
