"""torchtitan's graph trainer: an fxsched pass pipeline, run in place of its FSDP scheduling pass.

    from fxsched.integrations import torchtitan as fxsched_torchtitan

    fxsched_torchtitan.register()            # pipeline "fxsched": fxsched's default pipeline, H100 costs
    # then train with --compile.mode aot_fx_trace --compile.pass_pipeline fxsched

torchtitan's `experiments/graph_trainer` traces forward + loss + backward into one joint FX
graph (`make_fx_tracer.minimal_fx_tracer`) and runs a list of graph passes over it
(`passes.apply_graph_passes`); which list is chosen by `--compile.pass_pipeline`, looked up in
`registry.PASS_PIPELINE_REGISTRY` (`register_pass_pipeline`). `register()` adds a pipeline that is
graph_trainer's default list (`construct_default_graph_passes`: cleanup, memory policy, activation
rematerialisation, ..., Inductor regions, cudagraphs) with its FSDP scheduling pass,
`joint_transformer_block_bucketing_reordering_pass`, replaced by `fxsched_pass(...)`
(`register(keep_bucketing=True)`: kept, with `fxsched_pass` right after it, ordering its buckets).

`fxsched_pass(...)` is a graph_trainer pass, `(gm, example_inputs) -> gm`. On the joint graph it
recognises the untagged FSDP collectives (`lowering.structural`: gathers of parameter shards,
re-gathers made by rematerialisation, gradient reduce-scatters with the casts that follow them),
names each gather's parameter by its module FQN when the traced result is known, runs the
fxsched pipeline (lower → passes → raise) and relinks the graph's own nodes into the new order,
so the meta later passes read (module FQNs, SAC tags, `autograd_backward`) stays. Buckets that
torchtitan's pass made are recognised as such (one launch per bucket, its members named by FQN).
It neither buckets nor changes the collectives: the order is all it changes, so the step computes the
same values bit for bit. Each run's record (`integrations.inductor.schedule_graph_in_place`) is
appended to the pass's `runs` list.

torchtitan is imported only when a pipeline is built or registered (`pip install fxsched[torchtitan]`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from typing import Any

from torch import fx

from ..ir import tags
from ..passes import DEFAULT_PIPELINE, PassManager
from .inductor import schedule_graph_in_place

__all__ = ["FSDP_SCHEDULING_PASSES", "PIPELINE_NAME", "fxsched_pass", "fxsched_pass_pipeline", "param_names",
           "register", "replace_fsdp_scheduling"]

LOG = logging.getLogger("fxsched.integrations.torchtitan")
PIPELINE_NAME = "fxsched"
#: graph_trainer's passes that order (and bucket) FSDP collectives: fxsched's pass takes their place
FSDP_SCHEDULING_PASSES = ("joint_transformer_block_bucketing_reordering_pass",
                          "schedule_fsdp_comms_to_dense_regions_pass")


def _pass_name(fn: Callable) -> str:
    return fn.func.__name__ if isinstance(fn, functools.partial) else getattr(fn, "__name__", repr(fn))


def param_names(traced_result: Any) -> dict[str, str]:
    """{placeholder name: parameter FQN} of a graph_trainer `TracedResult`: its leading graph inputs
    are the module state (`state_fqns`), each unwrapped into `num_tensors` plain tensors (a DTensor
    parameter's first one is its local shard)."""
    placeholders = [n.name for n in traced_result.gm.graph.nodes if n.op == "placeholder"]
    layouts = getattr(traced_result, "input_subclass_layouts", {}) or {}
    names, at = {}, 0
    for i, fqn in enumerate(traced_result.state_fqns):
        if at < len(placeholders):
            names[placeholders[at]] = fqn
        at += layouts[i].num_tensors if i in layouts else 1
    return names


def fxsched_pass(pipeline: str = DEFAULT_PIPELINE, *, cost_model: Any = None, names: dict[str, str] | None = None,
                 verify_each: bool = True, group: Any = None) -> Callable[[fx.GraphModule, Any], fx.GraphModule]:
    """A graph_trainer pass `(gm, example_inputs) -> gm` that schedules the joint graph's FSDP
    collectives with the fxsched `pipeline` (text or name) in place. `names` maps graph inputs to
    parameter FQNs (`param_names(traced_result)`), used as the gathers' `param_name`. `group`: the
    ranks whose schedules must agree where each traces its own sizes (`fxsched.schedule`'s `group`;
    every rank of it runs the pass; where it fails on one rank, it fails on every rank, the others
    with `runtime.agreement.PeerFailure`, none waiting for it)."""
    pipeline = str(PassManager(pipeline))  # a bad pipeline fails here, not mid-trace
    runs: list[dict[str, Any]] = []

    def fxsched_schedule_pass(gm: fx.GraphModule, example_inputs: Any = None) -> fx.GraphModule:
        record = schedule_graph_in_place(gm.graph, pipeline, cost_model=cost_model, verify_each=verify_each,
                                         group=group)
        if names:
            for node in gm.graph.nodes:
                if not node.meta.get(tags.STRUCTURAL):
                    continue
                if node.meta.get(tags.PARAM_NAME) in names:
                    node.meta[tags.PARAM_NAME] = names[node.meta[tags.PARAM_NAME]]
                if isinstance(members := node.meta.get(tags.BUCKET_MEMBERS), list):  # a bucket torchtitan made
                    node.meta[tags.BUCKET_MEMBERS] = [names.get(m, m) for m in members]
        runs.append(record)
        structural = record["structural"] or {}
        LOG.info("fxsched torchtitan pass: %d nodes: %d gathers and %d gradient reductions recognised, %d gathers "
                 "moved, %d nodes sunk in %.3f s", record["nodes"], len(structural.get("tagged", ())),
                 len(structural.get("reductions", ())), record["moved"], record["sunk"], record["seconds"])
        return gm

    fxsched_schedule_pass.runs = runs
    fxsched_schedule_pass.pipeline = pipeline
    return fxsched_schedule_pass


def replace_fsdp_scheduling(passes: Iterable[Callable], ours: Callable,
                            replaced: Iterable[str] = FSDP_SCHEDULING_PASSES, *, keep: bool = False) -> list[Callable]:
    """`passes` with the first FSDP scheduling pass replaced by `ours` and any other one dropped
    (`ours` is appended before Inductor's passes' place when none was there). `keep`: the first
    one stays and `ours` runs right after it (on the buckets it made)."""
    replaced = set(replaced)
    out: list[Callable] = []
    placed = False
    for fn in passes:
        if _pass_name(fn) in replaced:
            if not placed:
                out += [fn, ours] if keep else [ours]
                placed = True
            continue
        out.append(fn)
    if not placed:
        terminal = next((i for i, fn in enumerate(out) if "inductor" in _pass_name(fn) or "cudagraph" in _pass_name(fn)),
                        len(out))
        out.insert(terminal, ours)
    return out


def fxsched_pass_pipeline(traced_result: Any, config: Any, *, parallel_dims: Any = None,
                          pipeline: str = DEFAULT_PIPELINE, cost_model: Any = None,
                          base: Callable | None = None, keep_bucketing: bool = False,
                          group: Any = None) -> list[Callable]:
    """A graph_trainer pass pipeline: `base` (graph_trainer's `construct_default_graph_passes`
    when None) with its FSDP scheduling pass replaced by `fxsched_pass` (`keep_bucketing`: kept,
    and `fxsched_pass` orders its buckets after it). With a `group` every rank of it builds its list
    here (graph_trainer does, on each rank) and the ranks then meet once: where building it fails on
    one rank (`base`, a bad pipeline), every rank raises (the others `runtime.agreement.PeerFailure`),
    and ranks given other pipelines or cost models raise `PlanMismatch`, instead of meeting first in
    the pass, where the others would wait for the rank that never runs it."""
    from ..api import _agreement

    with _agreement(group) as agreement:
        if base is None:
            from torchtitan.experiments.graph_trainer.passes import construct_default_graph_passes as base
        ours = fxsched_pass(pipeline, cost_model=cost_model, names=param_names(traced_result), group=group)
        passes = replace_fsdp_scheduling(base(traced_result, config, parallel_dims=parallel_dims), ours,
                                         keep=keep_bucketing)
        agreement.agree(None, pipeline=f"torchtitan's pass list with {ours.pipeline}", cost_model=cost_model)
    return passes


def register(name: str = PIPELINE_NAME, pipeline: str = DEFAULT_PIPELINE, *, cost_model: Any = None,
             keep_bucketing: bool = False, group: Any = None) -> str:
    """Register the fxsched pass pipeline with graph_trainer under `name` (`--compile.pass_pipeline NAME`).
    `group`: as `fxsched_pass`'s (`"world"` where every rank traces one SPMD program with its own sizes)."""
    from torchtitan.experiments.graph_trainer.registry import register_pass_pipeline

    str(PassManager(pipeline))  # fail now on a bad pipeline
    register_pass_pipeline(name)(functools.partial(fxsched_pass_pipeline, pipeline=pipeline, cost_model=cost_model,
                                                   keep_bucketing=keep_bucketing, group=group))
    return name
