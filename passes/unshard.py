"""unshard: the backward reads a parameter's forward replica, within a peak-memory cap.

Selective unsharding: instead of gathering a parameter again, the backward keeps the one the
forward gathered, where the simulated peak memory stays within a cap.

A candidate is a parameter whose forward gather is freed after the forward (a Free of its
wait) and gathered again in the backward (a launch with role REGATHER of the same shard, same
group and type). Unsharding it erases the forward free and the backward launch and wait (and
the re-gather's private cast of the shard, under mixed precision); the re-gather's views and
its backward free then read the forward wait, so the replica lives from the forward gather
to the backward free. Both gathers read the same shard, which nothing writes in between, so
the backward computes bitwise the same.

Candidates go best first — the most exposed communication per byte held, then the most
communication per byte — and each is taken only if the program's simulated peak memory with
it stays within the cap: `max-peak-gb` when set, else the input's simulated peak plus
`max-peak-increase-gb` (both set: the smaller; neither: the joint cap of a `memory-cap` before it,
or without one the input's peak; its own options only tighten a joint cap), and, with
`min-saved-ms`, only if it shortens
the simulated step by that much. Every candidate not taken says why in the
statistics and, when its launch has no reason yet, in its `hold`. Run it after the
scheduling passes (`default,unshard{...}`), so the cap is checked on the final order.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import attrs

from ..cost.model import CostAnalysis
from ..cost.simulate import simulate
from ..ir import DATA, Cast, Free, Launch, Program, Role, Wait, storage_root
from ..ir.holds import OVER_PEAK_CAP, SAVES_TOO_LITTLE, register_hold
from ..ir.rewriter import Rewriter
from .base import ModulePass, PassContext, PassResult, check_budget, check_ms, option, register_pass
from .memory_cap import cap_bytes, rewrite_cap, rewrite_stats

NO_FORWARD_REPLICA = register_hold("no forward replica", "unshard: no single forward gather of the same shard, "
                                                         "group and type whose replica the forward frees")
BUCKETED = register_hold("bucketed", "unshard: it gathers a bucket; only single-parameter re-gathers are unsharded")
SHARD_WRITTEN = register_hold("shard written", "unshard: the shard is written in place, so the forward replica may "
                                               "differ from what the re-gather would read")


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
                                      "this many ms (0: every candidate that fits the cap; a hidden "
                                      "re-gather then costs memory for no time)")

    def __post_init__(self):
        check_budget(self.name, "max-peak-gb", self.max_peak_gb)
        check_budget(self.name, "max-peak-increase-gb", self.max_peak_increase_gb)
        check_ms(self.name, "min-saved-ms", self.min_saved_ms)

    def apply(self, ctx: PassContext, program: Program) -> PassResult:
        costs = ctx.get(CostAnalysis, program).ms
        before = current = simulate(program, costs=costs)
        cap = rewrite_cap(self.max_peak_gb, self.max_peak_increase_gb, before.peak_bytes, cap_bytes(ctx))
        candidates, held = find_candidates(program)
        pos = program.schedule.index

        def merit(c: Candidate):
            per_byte = max(c.nbytes, 1)
            return (-before.exposed_by_collective.get(c.regather, 0.0) / per_byte,
                    -costs.get(c.regather, 0.0) / per_byte, pos(c.regather))

        bought: dict[str, dict[str, float]] = {}
        for c in sorted(candidates, key=merit):
            trial = program.copy()
            unshard(trial, c)
            after = simulate(trial, costs=costs)
            if after.peak_bytes > cap:
                held[c.regather] = OVER_PEAK_CAP
                continue
            if self.min_saved_ms > 0 and current.step_ms - after.step_ms < self.min_saved_ms:
                held[c.regather] = SAVES_TOO_LITTLE
                continue
            bought[c.param] = {
                "exposed_saved_ms": round(current.exposed_ms - after.exposed_ms, 6),
                "step_saved_ms": round(current.step_ms - after.step_ms, 6),
                "comm_saved_ms": round(costs.get(c.regather, 0.0), 6),
                "held_bytes": c.nbytes,
            }
            program.graph, program.schedule, program.payload = trial.graph, trial.schedule, trial.payload
            current = after

        for launch, reason in held.items():
            op = program.op(launch)
            if op.hold is None:
                program.replace(attrs.evolve(op, hold=reason))
        stats = {
            "unsharded": len(bought),
            **Counter(held.values()),
            **rewrite_stats(before, current, cap),
            "bought": bought,
        }
        return PassResult(bool(bought), stats)


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
    launches = [op for op in program.ops() if isinstance(op, Launch)]
    frees = [op for op in program.ops() if isinstance(op, Free) and op.operands]
    candidates, held = [], {}

    def wait_of(launch: str) -> str | None:
        waits = [u for u, e in succ[launch].items() if e["kind"] == DATA and isinstance(node[u]["op"], Wait)]
        return waits[0] if len(waits) == 1 else None

    for regather in launches:
        if regather.role is not Role.REGATHER:
            continue
        if regather.bucket is not None or len(regather.params) != 1:
            held[regather.name] = BUCKETED
            continue
        param = regather.params[0]
        forward = [op for op in launches if op.role is Role.GATHER and op.params == regather.params
                   and op.bucket is None and op.group == regather.group and pos(op.name) < pos(regather.name)]
        forward_wait = wait_of(forward[-1].name) if forward else None
        regather_wait = wait_of(regather.name)
        source = _source(program, regather)
        if forward_wait is None or regather_wait is None or source is None or _source(program, forward[-1]) != source \
                or node[forward_wait]["op"].types != node[regather_wait]["op"].types:
            held[regather.name] = NO_FORWARD_REPLICA
            continue
        replica_frees = [f for f in frees if storage_root(program, f.operands[0]) == forward_wait]
        if len(replica_frees) != 1 or not pos(forward_wait) < pos(replica_frees[0].name) < pos(regather.name):
            held[regather.name] = NO_FORWARD_REPLICA
            continue
        if _written(program, source[0]):
            held[regather.name] = SHARD_WRITTEN
            continue
        cast = regather.operands[0] if isinstance(node[regather.operands[0]]["op"], Cast) else None
        if cast is not None and [u for u, e in succ[cast].items() if e["kind"] == DATA] != [regather.name]:
            cast = None  # someone else reads it: it stays
        candidates.append(Candidate(param, regather.name, regather_wait, cast, forward_wait,
                                    replica_frees[0].name,
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


def _written(program: Program, shard: str) -> bool:
    """Whether any op writes the shard's storage in place (the storage effects' `writes`)."""
    root = storage_root(program, shard)
    return any(storage_root(program, w) == root for op in program.ops() for w in getattr(op, "writes", ()))
