"""torch.compile integration: the Inductor custom graph pass on real compiles (2 gloo ranks) and alone.

The model is SimpleFSDP-style: each layer holds its dim-0 weight shard as the parameter,
gathers it with a functional collective right before its matmul, and (selective activation
checkpointing, MUST_RECOMPUTE on the gather and its wait) re-gathers it in the backward. The
graphs Inductor compiles carry no HyperParallel tags: the structural stage finds the gathers.

Route: `backend="inductor"` with `fallback_by_default=True` (Inductor's "lite" fallback: every
op runs as its ATen kernel, so no C++ is compiled: seconds instead of ~50 s of g++ on a cold
cache). Dynamo, AOTAutograd, the partitioner, the post-grad passes (ours among them) and
Inductor's wrapper codegen all still run. `FXSCHED_INDUCTOR_CPP=1` adds the same check with
Inductor's generated C++ kernels.
"""

from __future__ import annotations

import functools
import logging
import os
import pathlib
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from fxsched.integrations.inductor import HOOK, FxschedInductorPass, compile_options, schedule_graph_in_place
from fxsched.lowering import LoweringError
from fxsched.passes import PassManager, PipelineError
from fxsched.runtime import run_ranks

_C = torch.ops._c10d_functional
LAYERS, WIDTH = 3, 16
PIPELINE = "anchor,budget,prefetch,sink"  # spelled out: the counts below are for this pipeline
# Fallback mode keeps numerics to ATen's kernels; no FX graph cache so the pass always runs.
LITE = {"fallback_by_default": True, "fx_graph_cache": False}


# --------------------------------------------------------------------------- the model


def _recompute_gathers(ctx, func, *args, **kwargs):
    if func in (_C.all_gather_into_tensor.default, _C.wait_tensor.default):
        return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


def _gathered_matmul(x, shard, group_name):
    return x @ funcol.all_gather_tensor(shard, 0, group_name)


class ShardedLinear(nn.Module):
    """Holds rank `rank`'s dim-0 shard of `weight`; gathers it for the forward, again for the backward."""

    def __init__(self, weight: torch.Tensor, world_size: int, rank: int):
        super().__init__()
        self.shard = nn.Parameter(weight.chunk(world_size)[rank].clone())

    def forward(self, x):
        y = checkpoint(_gathered_matmul, x, self.shard, dist.group.WORLD.group_name, use_reentrant=False,
                       context_fn=functools.partial(create_selective_checkpoint_contexts, _recompute_gathers))
        return torch.tanh(y)


def _step(rank, world_size, compile_options_or_none):
    """One forward+backward of the model; [loss, grad of each shard]."""
    weights = [torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(i)) for i in range(LAYERS)]
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(100 + rank))
    model = nn.Sequential(*[ShardedLinear(w, world_size, rank) for w in weights])
    run = model if compile_options_or_none is None else torch.compile(model, backend="inductor",
                                                                       options=compile_options_or_none)
    loss = run(x).square().sum()
    loss.backward()
    return [loss.detach()] + [p.grad.detach().clone() for p in model.parameters()]


def _strip(runs):
    return [{k: v for k, v in r.items() if k != "report"} | {"gather_rows": r.get("report", {}).get("gathers")}
            for r in runs]


def _compile_worker(rank, world_size, cache_root, extra_options):
    """Eager, compiled, compiled with the pass, then again with an equal pass (an FX graph cache hit)."""
    from torch._dynamo.utils import counters

    # A fresh cache per rank: nothing from earlier runs (or the other rank) can skip the pass.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_root, f"rank{rank}")
    logging.getLogger("fxsched").setLevel(logging.INFO)
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("fxsched").addHandler(Keep())
    eager = _step(rank, world_size, None)
    torch._dynamo.reset()
    plain = _step(rank, world_size, {**LITE, **extra_options})
    torch._dynamo.reset()
    cached = {**LITE, **extra_options, "fx_graph_cache": True}
    fx_pass, equal_pass = FxschedInductorPass(PIPELINE), FxschedInductorPass(PIPELINE)
    scheduled = _step(rank, world_size, {**cached, HOOK: fx_pass})
    torch._dynamo.reset()
    counters.clear()
    again = _step(rank, world_size, {**cached, HOOK: equal_pass})
    hits = counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
    log = list(records)  # the two graphs of the first scheduled compile (the cache hit logs nothing)
    torch._dynamo.reset()
    default_pass = FxschedInductorPass("default", on_error="raise")  # the cost-guided default pipeline
    by_default = _step(rank, world_size, {**LITE, **extra_options, HOOK: default_pass})
    return {"eager": eager, "plain": plain, "scheduled": scheduled, "again": again, "runs": _strip(fx_pass.runs),
            "log": log, "hits": hits, "again_runs": len(equal_pass.runs),
            "uuids": (fx_pass.uuid(), equal_pass.uuid()), "by_default": by_default,
            "default_moved": [run["moved"] for run in default_pass.runs]}


def _check_compiled(results, *, bitwise_eager: bool):
    for rank, r in enumerate(results):
        # The pass only reorders: compiled with and without it agree bit for bit.
        for a, b in zip(r["plain"], r["scheduled"], strict=True):
            assert torch.equal(a, b), f"rank {rank}: scheduling changed the compiled results"
        for a, b in zip(r["eager"], r["scheduled"], strict=True):
            if bitwise_eager:
                assert torch.equal(a, b), f"rank {rank}: compiled differs from eager"
            else:
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        runs = {run["phase"]: run for run in r["runs"]}
        assert sorted(runs) == ["backward", "forward"], r["runs"]
        assert all("error" not in run for run in r["runs"]), r["runs"]
        fwd, bwd = runs["forward"], runs["backward"]
        # forward: one gather per layer; backward: re-gathers for the input gradients of layers 1..
        assert len(fwd["structural"]["tagged"]) == LAYERS and fwd["gathers"] == LAYERS
        assert len(bwd["structural"]["tagged"]) == LAYERS - 1 and bwd["gathers"] == LAYERS - 1
        assert {g["phase"] for g in bwd["structural"]["tagged"]} == {"backward"}
        # every layer's gradient reduce-scatter is recognised (in the backward graph only)
        assert len(bwd["structural"]["reductions"]) == LAYERS and fwd["structural"]["reductions"] == []
        assert fwd["moved"] == LAYERS - 1 and bwd["moved"] == LAYERS - 2
        assert fwd["sunk"] >= 1
        assert fwd["relinked"] and bwd["relinked"]
        assert sum("fxsched inductor pass" in line for line in r["log"]) == 2, r["log"]
        # An equal pass has the same uuid: the second compile hits the cache and does not run it.
        assert r["uuids"][0] == r["uuids"][1] and r["hits"] >= 1 and r["again_runs"] == 0
        for a, b in zip(r["scheduled"], r["again"], strict=True):
            assert torch.equal(a, b)
        for a, b in zip(r["plain"], r["by_default"], strict=True):
            assert torch.equal(a, b), f"rank {rank}: the default pipeline changed the compiled results"
        assert len(r["default_moved"]) == 2 and sum(r["default_moved"]) >= 1
    assert results[0]["uuids"] == results[1]["uuids"]  # the same on every rank: ranks compile alike


@pytest.mark.multirank
def test_compile_runs_pipeline_on_forward_and_backward_and_caches(tmp_path):
    results = run_ranks(_compile_worker, 2, args=(str(tmp_path), {}), timeout=600)
    # Fallback kernels are eager's ATen kernels, but Inductor still decomposes some ops
    # (e.g. tanh's backward into mul/sub), so equality with eager is checked to a tight tolerance.
    _check_compiled(results, bitwise_eager=False)


@pytest.mark.multirank
@pytest.mark.skipif(os.environ.get("FXSCHED_INDUCTOR_CPP") != "1",
                    reason="Inductor C++ kernels: ~1 min of g++ on a cold cache; set FXSCHED_INDUCTOR_CPP=1")
def test_compile_with_inductor_cpp_kernels(tmp_path):
    results = run_ranks(_compile_worker, 2, args=(str(tmp_path), {"fallback_by_default": False}), timeout=900)
    _check_compiled(results, bitwise_eager=False)


# --------------------------------------------------------------------------- the pass alone


def _untagged_graph(layers=3):
    def f(*args):
        *shards, x = args
        for s in shards:
            w = _C.wait_tensor(_C.all_gather_into_tensor(s, 2, "0")).view(WIDTH, WIDTH)
            x = torch.tanh(x @ w)
        return (x,)

    return make_fx(f, tracing_mode="fake")(*[torch.randn(WIDTH * WIDTH // 2) for _ in range(layers)],
                                            torch.randn(4, WIDTH))


def test_pass_reorders_given_graph_in_place():
    gm = _untagged_graph()
    nodes = list(gm.graph.nodes)
    fx_pass = FxschedInductorPass(PIPELINE)
    fx_pass(gm.graph)
    assert set(gm.graph.nodes) == set(nodes)  # same node objects, relinked
    assert [n.name for n in gm.graph.nodes] != [n.name for n in nodes]
    order = [n.name for n in gm.graph.nodes]
    assert order.index("all_gather_into_tensor_1") < order.index("mm")
    assert gm.graph.find_nodes(op="call_function", target=_C.all_gather_into_tensor.default)[1].meta[
        "fsdp_prefetch_anchor"] == "mm"
    (run,) = fx_pass.runs
    assert run["moved"] == 2 and run["phase"] == "forward" and len(run["structural"]["tagged"]) == 3
    assert "mm" in gm.code.split("all_gather_into_tensor_1 =")[1]  # recompiled


def test_pass_without_gathers_leaves_graph_alone():
    gm = make_fx(lambda x: (torch.tanh(x @ x),), tracing_mode="fake")(torch.randn(4, 4))
    before = [n.name for n in gm.graph.nodes]
    fx_pass = FxschedInductorPass()
    fx_pass(gm.graph)
    assert [n.name for n in gm.graph.nodes] == before
    assert fx_pass.runs[0]["gathers"] == 0 and not fx_pass.runs[0]["report"]["changed"]


def test_pass_error_warns_or_raises(caplog):
    gm = _untagged_graph(1)
    gather = gm.graph.find_nodes(op="call_function", target=_C.all_gather_into_tensor.default)[0]
    gather.meta.update(comm_type="fsdp_all_gather", param_name="p")  # HyperParallel tag ...
    with gm.graph.inserting_after(gather):  # ... on a gather with a second user: malformed
        gm.graph.call_function(torch.ops.aten.clone.default, (gather,))
    before = [n.name for n in gm.graph.nodes]
    with caplog.at_level(logging.WARNING, logger="fxsched"):
        FxschedInductorPass()(gm.graph)
    assert "left unscheduled" in caplog.text and "exactly one user" in caplog.text
    assert [n.name for n in gm.graph.nodes] == before
    with pytest.raises(LoweringError):
        FxschedInductorPass(on_error="raise")(gm.graph)


def test_uuid_is_stable_and_keyed_on_pipeline():
    a, b = FxschedInductorPass("anchor,budget,prefetch,sink"), FxschedInductorPass(" anchor , budget,prefetch,sink")
    assert a.uuid() == b.uuid() and isinstance(a.uuid(), str)
    assert FxschedInductorPass("anchor{forward-depth=2},budget,prefetch,sink").uuid() != a.uuid()
    assert FxschedInductorPass(structural=False).uuid() != a.uuid()
    assert pickle.loads(pickle.dumps(a)).uuid() == a.uuid()


def test_the_uuid_covers_every_source_file_the_pass_can_execute(tmp_path):
    """Changing any one byte of any module in a copy of the package changes the source hash
    (cost/ included: a hardware number changes `hide`'s schedule), and every fxsched module
    a scheduled compile has imported is one of the hashed files."""
    import shutil
    import sys

    from fxsched.integrations import inductor

    root = tmp_path / "fxsched"
    shutil.copytree(inductor._PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__", ".*", "tests", "bench"))
    files = inductor.source_files(root)
    assert {f.relative_to(root).as_posix() for f in files} >= {"cost/hardware.py", "cost/model.py", "ir/text.py",
                                                                "passes/hide.py", "api.py"}
    base = inductor.source_hash(root)
    for path in files:
        data = path.read_bytes()
        path.write_bytes(data + b"#")
        assert inductor.source_hash(root) != base, f"a change to {path.relative_to(root)} keeps the hash"
        path.write_bytes(data)
    assert inductor.source_hash(root) == base

    gm = make_fx(lambda x: (x @ x).relu())(torch.randn(4, 4))
    FxschedInductorPass()(gm.graph)
    hashed = {p.resolve() for p in inductor.source_files()}
    package = inductor._PACKAGE
    executed = {pathlib.Path(m.__file__).resolve() for name, m in list(sys.modules.items())
                if name.split(".")[0] == "fxsched" and getattr(m, "__file__", None)
                and pathlib.Path(m.__file__).resolve().is_relative_to(package)}
    assert executed and not executed - hashed, f"imported but not hashed: {sorted(executed - hashed)}"


def test_bad_pipeline_fails_when_the_pass_is_made():
    with pytest.raises(PipelineError, match="unknown pass 'nope'"):
        FxschedInductorPass("anchor,nope")
    with pytest.raises(ValueError, match="on_error"):
        FxschedInductorPass(on_error="ignore")


def test_compile_options_keeps_existing_pass():
    from torch._inductor import config

    def other(graph):
        pass

    with config.patch({HOOK: other}):
        opts = compile_options("sink")
        assert opts[HOOK][0] is other and opts[HOOK][1].pipeline == "sink"
        assert isinstance(compile_options(keep_existing=False)[HOOK], FxschedInductorPass)


def test_schedule_graph_in_place_record_is_json():
    import json

    gm = _untagged_graph()
    record = schedule_graph_in_place(gm.graph, "anchor,budget{max-in-flight-gb=0.0},prefetch,sink")
    json.dumps(record)
    assert record["moved"] == 0 and record["gathers"] == 3
    assert [row["reason"] for row in record["report"]["gathers"]] == ["first group", "over budget", "over budget"]


def test_replace_contents_when_the_node_set_changed():
    """The fallback for a pipeline that adds or drops nodes: the given graph takes the new one's nodes."""
    from fxsched.integrations.inductor import _reorder_in_place, _replace_contents

    def f(x):
        dead = x * 3  # noqa: F841  (dropped in the new graph)
        return (torch.tanh(x) + 1,)

    gm = torch.fx.symbolic_trace(f)
    new = torch.fx.symbolic_trace(f).graph
    new.eliminate_dead_code()
    placeholder = next(iter(gm.graph.nodes))
    assert not _reorder_in_place(gm.graph, [n.name for n in new.nodes])
    _replace_contents(gm.graph, new)
    gm.graph.lint()
    gm.recompile()
    assert next(iter(gm.graph.nodes)) is placeholder
    assert [n.op for n in gm.graph.nodes] == [n.op for n in new.nodes]
    x = torch.randn(3)
    assert torch.equal(gm(x)[0], torch.tanh(x) + 1)


def test_default_pipeline_and_cost_model_key_the_uuid():
    gm = _untagged_graph()
    fx_pass = FxschedInductorPass()  # the project's default pipeline, cost-guided
    fx_pass(gm.graph)
    (run,) = fx_pass.runs
    assert "error" not in run and run["gathers"] == 3 and run["moved"] >= 1
    assert fx_pass.pipeline == str(PassManager("default"))
    assert FxschedInductorPass(cost_model="h200").uuid() != fx_pass.uuid()
    assert FxschedInductorPass(cost_model=lambda op, program: 1.0).uuid() is None  # no caching on opaque state


# --------------------------------------------------------------------------- bf16 SimpleFSDP: gradient reductions


def _bf16_worker(rank, world_size):
    """A built-in Llama, SimpleFSDP-style with bf16 parameters (bench/simple_fsdp.py), compiled without and
    with the default pipeline: [loss, grads] of each, and the pass's records."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    from simple_fsdp import simple_fsdp

    from fxsched.models import build_model

    torch.set_num_threads(1)
    out = {}
    for name, options in (("plain", dict(LITE)), ("scheduled", {**LITE, HOOK: FxschedInductorPass(on_error="raise")})):
        torch._dynamo.reset()
        module, inputs, loss_fn = build_model("llama", layers=2, width=32, seed=0, seq=8)
        simple_fsdp(module, world_size, rank, param_dtype=torch.bfloat16)
        compiled = torch.compile(module, backend="inductor", options=options)
        loss = loss_fn(compiled(*inputs), *inputs)
        loss.backward()
        out[name] = [loss.detach()] + [p.grad.detach().clone() for p in module.parameters()]
        if HOOK in options:
            out["runs"] = [{"phase": run["phase"], "structural": run["structural"],
                            "overlap": run["report"]["passes"].get("overlap-reduce-scatter", {})}
                           for run in options[HOOK].runs]
    return out


@pytest.mark.multirank
def test_bf16_gradient_reduce_scatters_overlap_and_stay_bitwise():
    results = run_ranks(_bf16_worker, 2, timeout=600)
    for rank, r in enumerate(results):
        for a, b in zip(r["plain"], r["scheduled"], strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), f"rank {rank}: the default pipeline changed the results"
        runs = {run["phase"]: run for run in r["runs"]}
        reductions = runs["backward"]["structural"]["reductions"]
        # one reduce-scatter per parameter, each waited then cast back to fp32 for the output
        assert len(reductions) == len(r["plain"]) - 1
        assert all(red["kind"] == "reduce_scatter_tensor" and len(red["tail"]) >= 1 for red in reductions)
        overlap = runs["backward"]["overlap"]
        assert overlap["overlapped"] >= len(reductions) // 2, overlap


# --------------------------------------------------------------------------- expert parallelism: each rank its own sizes


class _MoE(nn.Module):
    """SimpleFSDP linears around an expert whose tokens come by `all_to_all_single_autograd` with
    split sizes of the rank's own (rank 0 receives 650 tokens, rank 1 550): dynamo specialises
    them, so each rank compiles graphs of its own sizes."""

    def __init__(self, world_size, rank, seed, send, recv):
        super().__init__()
        weights = [torch.randn(r, c, generator=torch.Generator().manual_seed(seed + i)) / c ** 0.5
                   for i, (r, c) in enumerate(((WIDTH, WIDTH), (WIDTH, 4 * WIDTH), (4 * WIDTH, WIDTH)))]
        self.inp, self.up, self.down = (ShardedLinear(w, world_size, rank) for w in weights)
        self.send, self.recv = send, recv

    def forward(self, x):
        h = self.inp(x)
        t = funcol.all_to_all_single_autograd(h, self.recv, self.send, "ep")
        t = self.down(torch.relu(self.up(t)))
        return funcol.all_to_all_single_autograd(t, self.send, self.recv, "ep") + h


class _Orders(FxschedInductorPass):
    """The pass, keeping each scheduled graph's collectives (`collective_entries`)."""

    def __call__(self, graph):
        from fxsched.runtime.agreement import collective_entries

        super().__call__(graph)
        self.orders = [*getattr(self, "orders", []), collective_entries(graph)]


def _ep_compile_worker(rank, world_size):
    """[loss, grads] of 2 MoE layers compiled without the pass and with `default` and
    `group="world"`; the scheduled graphs' collectives and the notes of each run."""
    torch.set_num_threads(1)
    send, recv = [([100, 500], [100, 550]), ([550, 50], [500, 50])][rank]
    out = {}
    fx_pass = _Orders("default", on_error="raise", group="world")
    for name, options in (("plain", dict(LITE)), ("agreed", {**LITE, HOOK: fx_pass})):
        torch._dynamo.reset()
        model = nn.Sequential(*[_MoE(world_size, rank, 10 * i, send, recv) for i in range(2)])
        x = torch.randn(600, WIDTH, generator=torch.Generator().manual_seed(100 + rank))
        loss = torch.compile(model, backend="inductor", options=options)(x).square().sum()
        loss.backward()
        out[name] = [loss.detach()] + [p.grad.detach().clone() for p in model.parameters()]
    out["orders"], out["notes"] = fx_pass.orders, [run["report"]["notes"] for run in fx_pass.runs]
    out["uuid"] = fx_pass.uuid()
    return out


@pytest.mark.multirank
def test_compile_with_a_group_gives_ranks_of_other_sizes_one_schedule():
    """`FxschedInductorPass(group="world")`: the forward and backward graphs each rank compiles
    with its own all-to-all sizes (the all-to-alls and the expert's ops differ in size: each run
    notes it) are scheduled as one program on both ranks: their collectives come in one order,
    and the compiled step computes bitwise what it does without the pass. The pass gives Inductor
    no cache key (every rank must run it)."""
    from fxsched.runtime.agreement import compare_entries

    results = run_ranks(_ep_compile_worker, 2, group_name="ep", timeout=600)
    assert len(results[0]["orders"]) == len(results[1]["orders"]) == 2
    for a, b in zip(results[0]["orders"], results[1]["orders"]):
        assert compare_entries([a, b]) is None
    for rank, r in enumerate(results):
        assert all(torch.equal(a, b) for a, b in zip(r["plain"], r["agreed"], strict=True)), rank
        assert all(any("ops differ in size between them" in n for n in notes) for notes in r["notes"]), r["notes"]
        assert r["uuid"] is None


def test_a_pass_with_a_group_has_no_cache_key_and_one_rank_agrees_with_itself():
    """With a group the pass is a collective, so Inductor may not skip it on one rank (uuid None);
    without torch.distributed, `"world"` is one rank: the schedule is the one without a group."""
    assert FxschedInductorPass(group="world").uuid() is None and FxschedInductorPass().uuid() is not None
    assert "group='world'" in repr(FxschedInductorPass(group="world"))
    import fxsched

    gm = _untagged_graph()
    from fxsched.lowering.structural import tag_fsdp_collectives

    tag_fsdp_collectives(gm.graph)
    plain, alone = fxsched.schedule(gm), fxsched.schedule(gm, group="world")
    assert [n.name for n in plain.graph_module.graph.nodes] == [n.name for n in alone.graph_module.graph.nodes]
