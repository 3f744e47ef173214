"""Multi-rank equality: every built-in model, scheduled by several pipelines and budgets, gives
bitwise the loss and gradients of the unscheduled graph on 2 gloo ranks.

Everything runs in one spawn (starting ranks costs seconds). Each rank traces the model and
schedules it itself — as real ranks do — so the ranks must also agree on every schedule:
`check_ranks_agree` runs before each scheduled graph. (Sending graphs to the ranks instead
would cost more: unpickling a traced GraphModule re-traces it.)
"""

from __future__ import annotations

import pytest
import torch
from torch import fx

import fxsched
from fxsched.front import fsdp_joint_graph
from fxsched.ir import verify
from fxsched.models import MODELS, build_model
from fxsched.passes import DEFAULT_PIPELINE, REFERENCE_PIPELINE
from fxsched.runtime import run_ranks
from fxsched.runtime.agreement import check_ranks_agree

from ranks import GIB, WORLD

# every built-in model, each with one of the front's options
MODEL_CASES = {"gpt": {"buckets": "per-module"}, "llama": {"mixed_precision": torch.bfloat16}, "encoder": {}}

PIPELINES = {
    "default": DEFAULT_PIPELINE,
    "depth 2 forward, 0 backward": "anchor{forward-depth=2,backward-depth=0},budget,prefetch,sink",
    "depth 3, no budget": "anchor{forward-depth=3,backward-depth=3},prefetch,sink",
    "budget 0": "anchor,budget{max-in-flight-gb=0.0},prefetch,sink",
    "budget 8 KiB": f"anchor{{forward-depth=2}},budget{{max-in-flight-gb={8192 / GIB!r}}},prefetch,sink",
}  # (budget 0 moves no gather: it is the sink-only schedule)
assert REFERENCE_PIPELINE not in PIPELINES.values()  # the drop-in runs the reference pipeline


def clone(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy with its own nodes (meta copied), for the drop-in, which works in place."""
    graph = fx.Graph(owning_module=gm)
    graph._codegen = gm.graph._codegen
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
    copy = fx.GraphModule(gm, graph)
    copy.meta.update(gm.meta)
    return copy


def _run(gm: fx.GraphModule, feeds) -> list[torch.Tensor]:
    with torch.no_grad():
        return [t.detach() for t in gm(*feeds)]


def _models_worker(rank, world_size, cases, pipelines, layers=2, width=32, drop_in=True):
    torch.manual_seed(0)
    results = []
    for name, options in cases.items():
        module, inputs, model_loss = build_model(name, layers=layers, width=width, seed=3)
        front = fsdp_joint_graph(module, inputs, lambda m, *xs: model_loss(m(*xs), *xs), world_size, **options)
        # each rank its own data: shift the token ids / activations by the rank
        data = tuple((x + rank) % 97 if not x.is_floating_point() else x + rank for x in inputs)
        feeds = front.shard_inputs(module, rank, data)
        original = [n.name for n in front.gm.graph.nodes]
        results.append({"model": name, "label": "unscheduled", "out": _run(front.gm, feeds), "moved": False})
        scheduled = {label: fxsched.schedule(front.gm, pipeline) for label, pipeline in pipelines.items()}
        for done in scheduled.values():
            verify(done.program)
        graphs = {label: done.graph_module for label, done in scheduled.items()}
        if drop_in:
            graphs["drop-in"] = fxsched.overlap_param_gather(clone(front.gm), fxsched.PassConfig(max_in_flight_gb=1.0))
        for label, gm in graphs.items():
            fingerprint = check_ranks_agree(gm)
            done = scheduled.get(label)
            results.append({"model": name, "label": label, "out": _run(gm, feeds), "fingerprint": fingerprint,
                            "moved": [n.name for n in gm.graph.nodes] != original,
                            "gathers_moved": sum(row["moved"] for row in done.report["gathers"]) if done else None,
                            "group_sizes": sorted({op.group_size for op in done.program.ops()
                                                   if getattr(op, "group_size", None)}) if done else None})
    return results


def test_every_built_in_model_is_covered():
    assert set(MODEL_CASES) == set(MODELS)


@pytest.mark.multirank
def test_scheduled_models_are_bitwise_equal_on_two_ranks():
    ranks = run_ranks(_models_worker, WORLD, args=(MODEL_CASES, PIPELINES), timeout=600)
    labels = [(r["model"], r["label"]) for r in ranks[0]]
    assert labels == [(r["model"], r["label"]) for r in ranks[1]]
    assert len(labels) == len(MODEL_CASES) * (len(PIPELINES) + 2)
    for rank, results in enumerate(ranks):
        reference = None
        for result in results:
            if result["label"] == "unscheduled":
                reference = result["out"]
                continue
            assert len(result["out"]) == len(reference)
            for i, (a, b) in enumerate(zip(reference, result["out"])):
                assert a.dtype == b.dtype and torch.equal(a, b), \
                    f"{result['model']}, {result['label']}, rank {rank}: output {i} differs from the unscheduled graph"
    for model in MODEL_CASES:  # not vacuous: schedules moved nodes (sinking at least) ...
        moved = {r["label"] for r in ranks[0] if r["model"] == model and r["moved"]}
        assert moved >= {"default", "depth 2 forward, 0 backward", "depth 3, no budget", "drop-in"}, model
    # ... and the ranks saw different data
    assert not torch.equal(ranks[0][0]["out"][0], ranks[1][0]["out"][0])


def _check_default_on(world_size, ranks):
    for rank, results in enumerate(ranks):
        by_model: dict[str, list] = {}
        for result in results:
            by_model.setdefault(result["model"], []).append(result)
        assert set(by_model) == set(MODEL_CASES)
        for model, (plain, done) in by_model.items():
            assert (plain["label"], done["label"]) == ("unscheduled", "default")
            assert len(done["out"]) == len(plain["out"])
            for i, (a, b) in enumerate(zip(plain["out"], done["out"], strict=True)):
                assert a.dtype == b.dtype and torch.equal(a, b), \
                    f"{model}, default, rank {rank} of {world_size}: output {i} differs from the unscheduled graph"
            # not vacuous: gathers launched early, on a group of this many ranks
            assert done["moved"] and done["gathers_moved"] > 0, model
            assert done["group_sizes"] == [world_size], model
    assert len({tuple(r["fingerprint"] for r in results if "fingerprint" in r) for results in ranks}) == 1
    assert not torch.equal(ranks[0][0]["out"][0], ranks[-1][0]["out"][0])  # the ranks saw different data


@pytest.mark.multirank
def test_default_schedule_of_models_is_bitwise_equal_on_four_ranks():
    """Every built-in model (each with its front option) traced for 4 ranks, scheduled by `default`
    on each rank, bitwise equal to the unscheduled graph on 4 gloo ranks (2 layers, width 32)."""
    ranks = run_ranks(_models_worker, 4, args=(MODEL_CASES, {"default": DEFAULT_PIPELINE}, 2, 32, False), timeout=600)
    _check_default_on(4, ranks)


@pytest.mark.multirank
@pytest.mark.slow
def test_default_schedule_of_larger_models_is_bitwise_equal_on_four_ranks():
    """The same at 4 layers, width 256 (slow: minutes on 2 CPUs)."""
    ranks = run_ranks(_models_worker, 4, args=(MODEL_CASES, {"default": DEFAULT_PIPELINE}, 4, 256, False), timeout=1800)
    _check_default_on(4, ranks)
