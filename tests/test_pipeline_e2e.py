"""End to end: every built-in model through the FSDP front and the reference, default and rewrite pipelines.

The scheduled graph lints, moves the gathers it should, and gives bitwise-identical loss and
gradients on 2 gloo ranks (all graphs run in one spawn to keep the suite fast). The `rewrite`
pipeline also runs on the graphs users hand over, bitwise on 2 ranks: a torch.compile post-grad
graph pair and torchtitan's llama3 debug joint graph (skipped without torchtitan).
"""

from __future__ import annotations

import pytest
import torch

import fxsched
from fxsched.front import fsdp_joint_graph
from fxsched.ir import Launch, verify
from fxsched.models import MODELS, build_model
from fxsched.passes import parse_pipeline
from fxsched.runtime import run_ranks

from ranks import WORLD, check_bitwise, rank_feeds, run_all

CASES = [(name, buckets) for name in sorted(MODELS) for buckets in (False, True)]
PIPELINES = ("reference", "default")
REWRITE = "rewrite"   # changes the node set: checked for legality in its own test, bitwise below


@pytest.fixture(scope="module")
def scheduled():
    cases = {}
    for name, buckets in CASES:
        module, inputs, model_loss = build_model(name, layers=2, width=32, seed=1)
        front = fsdp_joint_graph(module, inputs, lambda m, *xs: model_loss(m(*xs), *xs), WORLD,
                                 buckets="per-module" if buckets else None)
        done = {p: fxsched.schedule(front.gm, p) for p in (*PIPELINES, REWRITE)}
        cases[(name, buckets)] = (front, done, rank_feeds(front, module, inputs, WORLD))
    return cases


@pytest.mark.parametrize("pipeline", PIPELINES)
@pytest.mark.parametrize("name,buckets", CASES)
def test_schedule_is_legal_and_moves_gathers(scheduled, name, buckets, pipeline):
    front, done, _ = scheduled[(name, buckets)]
    done = done[pipeline]
    done.graph_module.graph.lint()
    verify(done.program)
    stats = done.result.stats()
    gathers = [op for op in done.program.ops() if isinstance(op, Launch) and op.is_gather]
    assert stats["prefetch"]["forward"] > 0 and stats["prefetch"]["backward"] > 0
    # every gather either moved or says why not
    assert all(op.prefetched or op.hold for op in gathers)
    # the first forward gather has nothing earlier to hide behind, and says why; the reference
    # leaves it where it is, the default's order-gathers may launch it ahead of gathers needed later
    reasons = {"reference": ("first group", "no earlier legal slot"), "default": ("cannot be hidden",)}
    assert gathers[0].hold in reasons[pipeline]
    assert pipeline == "default" or not gathers[0].prefetched
    # the node set is unchanged: only the order differs
    before = {n.name for n in front.gm.graph.nodes}
    assert {n.name for n in done.graph_module.graph.nodes} == before
    assert [n.name for n in done.graph_module.graph.nodes] != [n.name for n in front.gm.graph.nodes]


def test_the_rewrite_pipeline_is_default_then_unshard_then_bucket_and_rewrites(scheduled):
    assert [str(p) for p in parse_pipeline(REWRITE)] == [*map(str, parse_pipeline("default")), "unshard", "bucket"]
    bought = {}
    for key, (_, runs, _) in scheduled.items():
        done = runs[REWRITE]
        done.graph_module.graph.lint()
        verify(done.program)
        # each rewrite is taken only for a shorter simulated step, at no higher peak (their
        # default cap: the peak of the program they get)
        default = runs["default"].gap
        assert done.gap["step_ms"] <= default["step_ms"] and done.gap["peak_bytes"] <= default["peak_bytes"]
        bought[key] = done.gap["bought"]
    # on these comm-bound widths it buckets or unshards somewhere: the bitwise check covers a rewrite
    assert any(bought.values()), bought


@pytest.mark.multirank
def test_scheduled_graphs_are_bitwise_equal_on_two_ranks(scheduled):
    names = (*PIPELINES, REWRITE)
    jobs = []
    for front, done, feeds in scheduled.values():
        jobs.append((front.gm, feeds))
        jobs.extend((done[p].graph_module, feeds) for p in names)
    results = run_ranks(run_all, WORLD, args=(jobs,), timeout=600)
    check_bitwise(results, list(scheduled), f"scheduled graph (#1-#{len(names)}: {', '.join(names)})",
                  per_key=1 + len(names))


# ---- the rewrite pipeline on the graphs users hand over ------------------------------------------

#: `rewrite` as a user runs it: no cap set (unshard and bucket keep the peak of the program they get)
REWRITE_RUNS = (("rewrite", REWRITE, None),)


def _check_clients(results, what: str) -> int:
    """Every output of every graph bitwise equal to the unscheduled run's on both ranks; no pass
    failed; the ranks' gradients differ (so a wrong pairing would show). Returns the rewrites taken."""
    import torch

    bought = 0
    for rank, r in enumerate(results):
        for case, c in r.items():
            (outputs, records), = c["runs"].values()
            assert records and all(rec["error"] is None for rec in records), records
            assert len(outputs) == len(c["plain"])
            for i, (before, after) in enumerate(zip(c["plain"], outputs, strict=True)):
                assert len(before) == len(after), f"{what} {case} graph {i}: other outputs"
                for a, b in zip(before, after, strict=True):
                    assert a.dtype == b.dtype and torch.equal(a, b), f"{what} {case} graph {i} rank {rank}: differs"
            bought += sum(len(rec["bought"]) for rec in records)
    case = next(iter(results[0]))
    last = lambda r: r[case]["plain"][-1]  # noqa: E731 — the last graph's outputs: the gradients
    assert not all(torch.equal(a, b) for a, b in zip(last(results[0]), last(results[1])))
    return bought


@pytest.mark.multirank
def test_rewrite_on_a_torch_compile_graph_is_bitwise_equal_on_two_ranks():
    """Inductor's post-grad forward and backward graphs of a one-layer SimpleFSDP gpt (fp32,
    tests/test_capped_clients.py), each scheduled by fxsched's hook with `rewrite`: it buckets the
    forward's gathers, so a rewrite is compared, not only a reordering (llama, and gpt with bf16
    parameters, bucket nothing there without a cap: "saves too little")."""
    from test_capped_clients import _compile_worker

    results = run_ranks(_compile_worker, WORLD, args=([("gpt", None)], 1, REWRITE_RUNS), timeout=900)
    assert _check_clients(results, "torch.compile") > 0, "rewrite took nothing: only reordering was compared"


@pytest.mark.multirank
def test_rewrite_on_torchtitans_joint_graph_is_bitwise_equal_on_two_ranks():
    """graph_trainer's joint graph of llama3's debug model (2 layers, rematerialised), fxsched's
    torchtitan pass running `rewrite`. There it rewrites nothing (unshard: "no forward replica",
    torchtitan frees replicas by liveness; bucket: no bucket "saves" enough under the default cap),
    so this compares `rewrite` as users get it; tests/test_pass_bucket.py runs buckets on it."""
    from test_capped_clients import HAVE_TORCHTITAN, _titan_worker

    if not HAVE_TORCHTITAN:
        pytest.skip("torchtitan (graph_trainer) is not installed: pip install -e '.[torchtitan]' (see .ci/run)")
    results = run_ranks(_titan_worker, WORLD, args=(2, REWRITE_RUNS), timeout=900)
    _check_clients(results, "torchtitan")
