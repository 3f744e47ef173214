"""Gather analysis: each FSDP gather's launch chain, realization DAG and first real consumer.

Computed once from the program; membership never changes under the scheduling passes, so
they all preserve it (positions are read from the live schedule when needed).
"""

from __future__ import annotations

from itertools import compress, repeat
from operator import itemgetter

import attrs

from ..ir import DATA, Cast, CopyOut, Input, Launch, Phase, Program, View, Wait, holds
from .base import Analysis


def held_by_lowering(op: Launch) -> bool:
    """Held by lowering for malformed tags (must survive every pass); any other hold is a
    pass's, which a later run may set afresh (ir/holds.py)."""
    return holds.held_by_lowering(op.hold)


@attrs.frozen
class Gather:
    launch: str
    chain: tuple[str, ...]        # what moves with the launch, in schedule order, launch last
    realization: tuple[str, ...]  # wait, views and copy-outs, in schedule order
    first_consumer: str
    phase: Phase


@attrs.frozen
class GatherAnalysis(Analysis):
    gathers: tuple[Gather, ...]   # in schedule order of their launches
    unconsumed: tuple[str, ...]   # gather launches whose realization nobody reads

    @classmethod
    def compute(cls, program: Program, ctx=None) -> GatherAnalysis:
        # raw node and adjacency dicts, users unsorted: networkx's views and program.users' sort
        # by position cost more than the walks themselves
        node, succ = program.node_data, program.successors
        gathers, unconsumed = [], []
        pos = program.schedule.index
        names = program.schedule.names()
        ops = list(map(itemgetter("op"), map(node.__getitem__, names)))
        for name, op in compress(zip(names, ops), map(isinstance, ops, repeat(Launch))):  # launches, picked in C
            if not op.is_gather:
                continue
            waits = [u for u in _data_users(succ, name) if isinstance(node[u]["op"], Wait)]
            if len(waits) != 1:
                continue
            realization, consumers = _realize(program, waits[0], op.bucket)
            if not consumers:
                unconsumed.append(name)
                continue
            gathers.append(Gather(
                launch=name,
                chain=tuple(sorted(launch_chain(program, op), key=pos)),
                realization=tuple(sorted(realization, key=pos)),
                first_consumer=min(consumers, key=pos),
                phase=op.phase,
            ))
        return cls(tuple(gathers), tuple(unconsumed))


def _data_users(succ: dict, name: str) -> list[str]:
    """Data users of `name` in no particular order (program.users without its sort)."""
    return [u for u, e in succ[name].items() if e["kind"] == DATA]


def _realize(program: Program, wait: str, bucket: str | None) -> tuple[set[str], set[str]]:
    """The wait plus every view and own-bucket copy-out reachable from it; and their other users."""
    node, succ = program.node_data, program.successors
    realization, consumers = {wait}, set()
    stack = [wait]
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
