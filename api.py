"""The package face: FX → lowering → passes → raising, as one call.

`schedule` runs any pipeline and returns the new module with a report; `overlap_param_gather`
is the drop-in for the reference pass (same config, same outputs in `meta`, one log line).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from itertools import compress, repeat
from typing import Any

import attrs
from torch import fx

from .config import read_config
from .ir import Launch, Program
from .ir.gcpause import gc_paused
from .ir import tags
from .lowering import lower_in_order
from .passes import DEFAULT_PIPELINE, Instrument, PassContext, PassManager, PipelineResult, Timing
from .passes.memory_cap import with_cap
from .cost.limits import lower_bound
from .cost.model import CostAnalysis
from .cost.simulate import simulate
from .raising import raise_in_place, raise_program
from .raising.lint import lint

LOG = logging.getLogger("fxsched")


@attrs.define
class ScheduleResult:
    graph_module: fx.GraphModule
    program: Program
    pipeline: str
    result: PipelineResult
    timing: Timing | None = None
    #: gathers an earlier run had moved (lowering read their tag): the report tells them apart
    earlier: frozenset[str] = frozenset()
    context: PassContext | None = None   # the run's: its cost model, the peak cap in force
    _gap: dict[str, Any] | None = attrs.field(default=None, init=False)

    @property
    def report(self) -> dict[str, Any]:
        """Everything a person or a tool needs to see what happened, as plain data."""
        return {
            "pipeline": self.pipeline,
            "changed": self.result.changed,
            "passes": self.result.stats(),
            "gathers": gather_table(self.program, self.earlier),
            "notes": list(self.program.notes),
            "seconds": dict(self.timing.seconds) if self.timing else None,
            "gap": self.gap,
        }

    @property
    def gap(self) -> dict[str, Any]:
        """The scheduled program against its lower bound and its memory against the cap, and
        what each rewrite bought (`gap_report`; simulated once, on first use)."""
        if self._gap is None:
            self._gap = gap_report(self.program, self.context or PassContext(), self.result.stats())
        return self._gap


def gap_report(program: Program, ctx: PassContext, stats: dict[str, dict]) -> dict[str, Any]:
    """Simulated step, its lower bound (`cost.limits.lower_bound`) and step / bound; the
    simulated peak memory and the cap in force (None: none) with the peak it was set at; and one
    row per rewrite a pass reports under `bought` in its statistics (an unsharded parameter, a
    bucket): the simulated step it saved and the bytes it added (`bytes_added`; unshard's
    `held_bytes`, the replica it keeps; bucket's `peak_change_bytes`, the simulated peak's change)."""
    costs = ctx.get(CostAnalysis, program).ms
    sim = simulate(program, costs=costs)
    cap = ctx.peak_cap
    bought = [{"pass": name, "what": what, "step_saved_ms": row.get("step_saved_ms"),
               "bytes_added": next((row[k] for k in ("bytes_added", "held_bytes", "peak_change_bytes") if k in row),
                                   None)}
              for name, s in stats.items() for what, row in (s.get("bought") or {}).items()]
    return {
        **lower_bound(program, sim, costs), "exposed_ms": sim.exposed_ms,
        "peak_bytes": sim.peak_bytes, "cap_bytes": None if cap is None else int(cap.limit_bytes),
        "cap_set_at_bytes": None if cap is None else cap.set_at_bytes,
        "bought": bought,
    }


def gather_table(program: Program, earlier: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """One row per FSDP gather: moved by this run or not, where to, and why not.

    `earlier`: the gathers an earlier run had moved (`ScheduleResult.earlier`). Such a gather
    is `moved` only where this run moved it again (anchored, not held); otherwise its row says
    `earlier` and gives this run's reason — it still launches where the earlier run put it (no
    pass moves a launch later), which a lower budget on the re-run does not undo."""
    rows = []
    for op in _launches(program):
        if op.is_gather:
            before = op.name in earlier
            moved = _moved(op, earlier)
            rows.append({
                "launch": op.name, "role": op.role.value, "phase": op.phase.value,
                "params": list(op.params), "bucket": op.bucket, "nbytes": op.nbytes,
                "moved": moved, "earlier": before and not moved, "anchor": op.anchor, "reason": op.hold,
            })
    return rows


def _moved(op: Launch, earlier: frozenset[str]) -> bool:
    """`gather_table`'s `moved`: by this run (a gather an earlier run moved, only where this
    run moved it again)."""
    return op.prefetched and (op.name not in earlier or (op.hold is None and op.anchor is not None))


def _moved_unheld(program: Program, earlier: frozenset[str]) -> Iterator[Launch]:
    """The gathers `gather_table` shows moved by this run and unheld, without building the table:
    what `schedule` and the drop-in tag."""
    return (op for op in _launches(program, ordered=False)
            if op.is_gather and _moved(op, earlier) and op.hold is None)


def _launches(program: Program, ordered: bool = True) -> Iterator[Launch]:
    """The program's launches in schedule order (`ordered=False`: in the graph's own order,
    `Program.ops_of`), picked out in C (no Python test per op)."""
    if not ordered:
        return iter(program.ops_of(Launch))
    ops = list(program.ops())
    return compress(ops, map(isinstance, ops, repeat(Launch)))


def schedule(gm: fx.GraphModule, pipeline: str = DEFAULT_PIPELINE, *, verify_each: bool = True,
             timing: bool = False, instruments: list[Instrument] | None = None,
             cost_model: Any = None, verify_lowered: bool | None = None, max_peak_gb: float | None = None,
             max_peak_increase_gb: float | None = None, group: Any = None) -> ScheduleResult:
    """Lower `gm` (left untouched), run `pipeline`, and raise a fresh, linted GraphModule.

    `pipeline` is pipeline text or a name (`default`, `reference`); `cost_model` is what
    cost-guided passes price ops with (a hardware profile name such as "h200", a
    `fxsched.cost.model.CostModel`, a {target: ms} table or a function op -> ms; H100 when None).
    `verify_lowered`: verify the lowered program before the first pass as well (see `_schedule`;
    None: when FXSCHED_VERIFY_LOWERED=1, as in the tests).
    `max_peak_gb` / `max_peak_increase_gb` put a hard cap on the simulated peak memory (GiB, or
    GiB over the input's peak; both: the smaller) that every pass honours: the pipeline runs
    with `memory-cap{...}` first (`fxsched.passes.memory_cap`).
    `group`: the ranks whose schedules must agree, where each traces its own graph and the sizes
    may differ by rank (expert parallelism's split sizes traced as numbers): a ProcessGroup,
    `"world"`, or a registered group's name. Every rank of it must call `schedule` on its graph;
    the lowered programs are checked to be equal but for sizes (`StructureMismatch` names the
    first op that differs) and each size is set to its largest over the ranks before the passes
    run (`runtime.agreement.agree_sizes`), so every rank gets one order; the ranks also check that
    they were given one pipeline and cost model (`PlanMismatch`). Where one rank fails (its
    options, its lowering, a pass), every rank raises (the others `PeerFailure`, naming it and
    why): none waits for it (`runtime.agreement.Agreement`). None (the default): this graph
    alone, as every rank that traced the same graph gets anyway.
    """
    with _agreement(group) as agreement:
        pipeline = with_cap(pipeline, max_peak_gb, max_peak_increase_gb)
        return _schedule(gm, pipeline, _raise_tagged, verify_each=verify_each, timing=timing,
                         instruments=instruments, cost_model=cost_model, verify_lowered=verify_lowered,
                         agreement=agreement)


class _Alone:
    """The agreement of a schedule without a group (`_agreement(None)`): nothing to exchange."""

    def __enter__(self) -> _Alone:
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def agree(self, program: Program | None, **plan: Any) -> None:
        return None

    def settle(self) -> None:
        return None


def _agreement(group: Any):
    """What a schedule's ranks agree through: `runtime.agreement.Agreement` over `group`
    (torch.distributed is imported only then), or `_Alone`. Open it (`with`) around all of a
    rank's work on the schedule, its options read first: a rank that fails inside it tells the
    others, so none waits for it."""
    if group is None:
        return _Alone()
    from .runtime.agreement import Agreement

    return Agreement(group)


def _raise_tagged(program: Program, earlier: frozenset[str]) -> fx.GraphModule:
    """`raise_program`, tagging what this run moved as the drop-in does: lowering reads the tag
    back, so scheduling the result again counts these gathers in flight instead of overshooting
    the budget."""
    return raise_program(program, meta={op.name: {tags.PREFETCH_ANCHOR: op.anchor}
                                        for op in _moved_unheld(program, earlier) if op.anchor is not None})


def _verify_lowered_default() -> bool:
    """FXSCHED_VERIFY_LOWERED=1 verifies what lowering returned before the first pass (tests/conftest.py sets it)."""
    return os.environ.get("FXSCHED_VERIFY_LOWERED", "") not in ("", "0")


def _schedule(gm: fx.GraphModule, pipeline: str, raising, *, verify_each: bool = True, timing: bool = False,
              instruments: list[Instrument] | None = None, cost_model: Any = None,
              verify_lowered: bool | None = None, agreement: Any = None) -> ScheduleResult:
    """`schedule`, raising with `raising(program, earlier)` (a fresh module, or `gm` itself
    reordered in place; `earlier` as in ScheduleResult).

    The program the passes get is what `lower` just returned from the linted graph, and that keeps
    every rule the verifier checks by construction (so its check before the first pass, a tenth of
    a 100k-node drop-in, runs only when asked): lowering builds each op's operands, writes and
    alias from the node's own inputs, pairs a launch with its one wait or makes it opaque, and
    assigns phases forward then backward; derive_effects adds every edge from an earlier op to a
    later one of that order (the output last, inputs reading nothing: lowering refuses a graph
    otherwise) and refuses a use after free. Every pass is still verified after it runs.
    `agreement` (`_agreement(group)`, opened by the caller around its own work too; None: no
    group): the ranks' programs are given one set of sizes before the passes (only sizes change:
    what the verifier checks does not read them), and the ranks say they all ran the passes
    (`settle`) before any raises the program, so a rank whose pass failed leaves every rank with
    an error, each with its graph untouched.
    """
    if agreement is None:
        agreement = _Alone()
    if verify_lowered is None:
        verify_lowered = _verify_lowered_default()
    manager = PassManager(pipeline, verify_each=verify_each, instruments=list(instruments or []),
                          verify_input=verify_lowered)
    timer = Timing() if timing else None
    if timer:
        manager.instruments.insert(0, timer)
    ctx = PassContext(cost_model=cost_model)
    with gc_paused():  # one pause for all stages: a full collection between them scans the whole graph
        program = _lint_and_lower(gm)
        agreement.agree(program, pipeline=str(manager), cost_model=cost_model)
        earlier = frozenset(op.name for op in _launches(program, ordered=False) if op.prefetched)
        result = manager.run(program, ctx)
        agreement.settle()
        raised = raising(program, earlier)
    return ScheduleResult(raised, program, str(manager), result, timer, earlier, ctx)


def _lint_and_lower(gm: fx.GraphModule) -> Program:
    """`lint(gm.graph)` (Graph.lint, faster where the graph passes), then `lower(gm)`, with
    lowering's walk standing in for lint's tests of names and input order (`lint(lowered=True)`).
    A graph lint refuses still gets lint's error, as when lint ran first: where lowering raises,
    lint runs before its error is raised."""
    try:
        program, in_order = lower_in_order(gm)
    except Exception as exc:
        error = exc
    else:
        lint(gm.graph, lowered=in_order)
        return program
    lint(gm.graph)
    raise error


def reference_pipeline(max_in_flight_gb: float, forward_depth: int = 1, backward_depth: int = 1) -> str:
    return (f"anchor{{forward-depth={forward_depth},backward-depth={backward_depth}}},"
            f"budget{{max-in-flight-gb={max_in_flight_gb!r}}},prefetch,sink")


def overlap_param_gather(graph_module: fx.GraphModule, config, *, group: Any = None) -> fx.GraphModule:
    """Drop-in for HyperParallel's pass: schedules `graph_module` in place and returns it.

    `group`: as for `schedule` (the reference pipeline reads no costs, only the gathers' sizes;
    with a group, the ranks' graphs are also checked to be equal but for sizes, and their configs
    to be one: a rank whose config is disabled still meets the others, and where some ranks have it
    disabled and some not, each raises `PlanMismatch`).

    Sets `meta["fsdp_prefetch"] = {"forward", "backward", "sunk"}` on the module and
    `meta["fsdp_prefetch_anchor"]` on each moved gather; logs one line.
    """
    with _agreement(group) as agreement:  # a bad config on one rank leaves every rank with an error
        enabled, budget, forward, backward = read_config(config)
        if not enabled:
            agreement.agree(None, pipeline="none: the drop-in is disabled")
            return graph_module
        # the module's own nodes are relinked into the new order (nothing is copied; meta, names and
        # whatever callers hold of them stay valid), then its code is generated once
        done = _schedule(graph_module, reference_pipeline(budget, forward, backward),
                         lambda program, earlier: raise_in_place(program), agreement=agreement)
    stats = done.result.stats()
    prefetch = next(v for k, v in stats.items() if k.startswith("prefetch"))
    sink = next(v for k, v in stats.items() if k.startswith("sink"))
    # only what this run moved (an earlier run's anchors stay in the meta); the program's payload
    # is the module's own nodes
    for op in _moved_unheld(done.program, done.earlier):
        done.program.payload[op.name].meta[tags.PREFETCH_ANCHOR] = op.anchor
    graph_module.recompile()
    counts = {"forward": prefetch["forward"], "backward": prefetch["backward"], "sunk": sink["sunk"]}
    graph_module.meta[tags.PREFETCH_COUNTS] = counts
    LOG.info("FSDP parameter prefetch: forward=%d backward=%d sunk=%d budget_bytes=%d depths=(%d, %d)",
             counts["forward"], counts["backward"], counts["sunk"], int(budget * 2**30), forward, backward)
    return graph_module
