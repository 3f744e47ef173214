"""Gather analysis: each FSDP gather's launch chain, realization DAG and first real consumer.

Computed from the program and the order it entered the pipeline with: membership never
changes under the scheduling passes, and the gathers' order is the entry order, so the passes
that keep chains whole and consumers in place preserve it (`PassManager(check_analyses=True)`
recomputes it after each pass to hold them to that).
"""

from __future__ import annotations

import attrs

from ..ir import DATA, Cast, CopyOut, Input, Launch, Phase, Program, View, Wait, holds, result_views, waits_of
from .base import Analysis


def held_by_lowering(op: Launch) -> bool:
    """Held by lowering for malformed tags (must survive every pass); any other hold is a
    pass's, which a later run may set afresh (ir/holds.py)."""
    return holds.held_by_lowering(op.hold)


@attrs.frozen
class Gather:
    launch: str
    chain: tuple[str, ...]        # what moves with the launch, in entry order, launch last
    realization: tuple[str, ...]  # wait, views and copy-outs, in entry order (coalesced: getitems, waits, views)
    first_consumer: str
    phase: Phase


@attrs.frozen
class GatherAnalysis(Analysis):
    # in the order of their launches when the pipeline started (`PassContext.entry`): the
    # reference's order, which passes that move launches leave true
    gathers: tuple[Gather, ...]
    unconsumed: tuple[str, ...]   # gather launches whose realization nobody reads, same order

    @classmethod
    def compute(cls, program: Program, ctx=None) -> GatherAnalysis:
        # raw node and adjacency dicts, users unsorted: networkx's views and program.users' sort
        # by position cost more than the walks themselves
        node, succ = program.node_data, program.successors
        gathers, unconsumed = [], []
        pos = program.schedule.index
        # chains and realizations are listed in the entry order (a legal order of each: the
        # entry schedule was verified), which no pass changes; the first consumer is the first
        # in the order now (the passes that preserve this analysis move no gather's consumer:
        # check_analyses would catch one that did)
        entry = getattr(ctx, "entry", None)
        if entry is None or entry == program.schedule:
            key = pos
        else:
            at, past = entry.index, len(program.schedule)
            key = lambda n: (at(n) if n in entry else past, pos(n))  # noqa: E731  (nodes the entry lacks go last)
        # the gathers' launches in schedule order: picked out of the node table in its own
        # order (in C), then sorted by position. A lookup per name in schedule order (a cache
        # miss or two per node at 100k nodes, 40 ms) cost more than the sort of the few gathers.
        launches = [op for op in program.ops_of(Launch) if op.is_gather]
        launches.sort(key=lambda op: pos(op.name))
        for op in launches:
            name = op.name
            waits = [u for u in _data_users(succ, name) if isinstance(node[u]["op"], Wait)]
            results = [] if waits else result_views(program, name)  # a coalesced launch's getitems
            if results:
                waits = waits_of(program, name)
            elif len(waits) != 1:
                continue
            realization, consumers = _realize(program, waits, op.bucket)
            realization.update(results)
            if not consumers:
                unconsumed.append(name)
                continue
            chain = launch_chain(program, op)
            gathers.append(Gather(
                launch=name,
                # (a lone launch unsorted: its position is a lookup that costs a cache miss or
                # two at 100k nodes, and most chains are one)
                chain=tuple(chain) if len(chain) == 1 else tuple(sorted(chain, key=key)),
                realization=tuple(sorted(realization, key=key)),
                first_consumer=min(consumers, key=pos),
                phase=op.phase,
            ))
        if key is not pos:
            gathers.sort(key=lambda g: key(g.launch))
            unconsumed.sort(key=key)
        return cls(tuple(gathers), tuple(unconsumed))


def _data_users(succ: dict, name: str) -> list[str]:
    """Data users of `name` in no particular order (program.users without its sort)."""
    return [u for u, e in succ[name].items() if e["kind"] == DATA]


def _realize(program: Program, waits: list[str], bucket: str | None) -> tuple[set[str], set[str]]:
    """The waits plus every view and own-bucket copy-out reachable from them; and their other users."""
    node, succ = program.node_data, program.successors
    realization, consumers = set(waits), set()
    stack = list(waits)
    while stack:
        for user in _data_users(succ, stack.pop()):
            op = node[user]["op"]
            if isinstance(op, View) or (isinstance(op, CopyOut) and bucket is not None and op.bucket == bucket):
                if user not in realization:
                    realization.add(user)
                    stack.append(user)
            else:
                consumers.add(user)
    return realization, consumers


def launch_chain(program: Program, launch: Launch) -> list[str]:
    """A bucket's private pack DAG, or a lone cast of an input shard, plus the launch."""
    node, succ = program.node_data, program.successors
    if launch.bucket is not None:
        chain = {launch.name}
        stack = list(launch.operands)
        while stack:
            name = stack.pop()
            op = node[name]["op"]
            if name in chain or not op.MOVABLE or op.EFFECT or isinstance(op, Input):
                continue
            if all(u in chain for u in _data_users(succ, name)):
                chain.add(name)
                stack.extend(op.operands)
        return list(chain)
    if launch.operands:
        shard = node[launch.operands[0]]["op"]
        if (isinstance(shard, Cast) and shard.operands and len(_data_users(succ, shard.name)) == 1
                and all(isinstance(node[o]["op"], Input) for o in shard.operands)):
            return [shard.name, launch.name]
    return [launch.name]
