"""Graphs of a 2-D mesh (data parallel x tensor parallel) attacked as tests/test_fronts_attack4.py
does: FSDP on the mesh's `dp` dimension and tensor + sequence parallelism on `tp`, as users write
them with DTensor (torch's `parallelize_module` plans, torchtitan's SimpleFSDP `data_parallel`
over the same mesh), on 4 gloo ranks. Each rank is in two groups, and their names differ from
rank to rank (rank 0: dp "1", tp "3"; rank 1: dp "2", tp "3"; rank 2: dp "1", tp "4"; ...).

Routes: torch.compile with fxsched's Inductor pass (the post-grad forward and backward graphs that
AOTAutograd partitions, every built-in pipeline run on them as the pass runs it), those same
graphs in seeded random legal orders, and make_fx of DTensor redistributions. Each must compute
bitwise what the graph as traced does on every rank and must not hang; a hang is caught by the
harness (the groups' collectives time out after HANG_SECONDS, recorded as "hang"), never asserted
on a clock.
"""

from __future__ import annotations

import copy
import os
from datetime import timedelta

import pytest
import torch
from torch import fx, nn

import fxsched  # the checkout under test, imported before torchtitan

HANG_SECONDS = 20  # a collective that waits longer has hung (4 ranks share 2 cores: generous)
WORLD, WIDTH = 4, 8
ALL_PIPELINES = ("reference", "default", "rewrite", "default,unshard", "default,bucket",
                 "unorder-reduce-scatters,gradients-first,default")

torchtitan_simple_fsdp = pytest.importorskip("torchtitan.experiments.graph_trainer.simple_fsdp")


# --------------------------------------------------------------------------- the model


class _Block(nn.Module):
    """A norm, an up and a down projection, a residual."""

    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):  # x: this rank's sequence shard [s, WIDTH]
        return x + self.down(torch.relu(self.up(self.norm(x))))


def _mesh():
    """The 2-D mesh (dp x tp) of 4 ranks: dp groups {0,2} {1,3}, tp groups {0,1} {2,3}."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _model(mesh):
    """Two blocks, each parallel on `tp` as users plan it, then SimpleFSDP's `fully_shard` on `dp`
    (each parameter a 2-D DTensor, gathered over dp before its use). The first is Megatron's tensor
    parallel on the whole sequence (its input, the model's, gathered over tp; `up` column-parallel:
    an all-reduce of its input's gradient, `f`; `down` row-parallel: an all-reduce of its output,
    `g`); the second sequence parallel (the norm's input and the block's output sharded on the
    sequence: an all-gather before `up`, a reduce-scatter after `down`, so the backward gathers the
    loss's gradient). The tp gathers of the model's input and of that gradient read graph inputs,
    as FSDP's gathers do: the structural stage takes the model input's for a parameter's gather
    (a plain input, as a lifted parameter is), not the gradient's (an AOTAutograd tangent)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block())
    parallelize_module(model[0], mesh["tp"], PrepareModuleInput(input_layouts=Shard(0), desired_input_layouts=Replicate(),
                                                                use_local_output=True))
    parallelize_module(model[0], mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    parallelize_module(model[1], mesh["tp"], {"norm": SequenceParallel(sequence_dim=0),
                                              "up": ColwiseParallel(input_layouts=Shard(0)),
                                              "down": RowwiseParallel(output_layouts=Shard(0))})
    return torchtitan_simple_fsdp.data_parallel(model, mesh["dp"], mode="fully_shard")


def _grads(model):
    return [p.grad.to_local().detach().clone() if hasattr(p.grad, "to_local") else p.grad.detach().clone()
            for p in model.parameters()]


class _Capture:
    """A post-grad pass that keeps a copy of each graph Inductor hands it (meta included)."""

    def __init__(self):
        self.graphs: list[fx.GraphModule] = []

    def __call__(self, graph):
        self.graphs.append(fx.GraphModule(nn.Module(), copy.deepcopy(graph)))

    def uuid(self):
        return None


def _compiled_step(mesh, rank, post_grad_pass, model=None, width=None):
    """One compiled forward + backward of `model(mesh)` (`_model` by default; Inductor's fallback
    kernels: no C++ built), run on fresh short-timeout groups: [loss, each parameter's local
    gradient], or "hang: ..." when a collective gave up waiting."""
    import torch.distributed as dist

    torch._dynamo.reset()
    module = (model or _model)(mesh)
    options = {"fallback_by_default": True, "fx_graph_cache": False, "post_grad_custom_post_pass": post_grad_pass}
    compiled = torch.compile(module, backend="inductor", options=options)
    x = torch.randn(4, width or WIDTH, generator=torch.Generator().manual_seed(100 + rank))
    dist.barrier()
    restore = _fresh_groups(mesh)
    try:
        loss = compiled(x).square().sum()
        loss.backward()
        return [loss.detach()] + _grads(module)
    except RuntimeError as exc:
        return "hang: " + str(exc).splitlines()[0][:100]
    finally:
        restore()


# --------------------------------------------------------------------------- harness


def _short_timeouts():
    """Groups made from here on (the mesh's) time out after HANG_SECONDS: a hang is an error."""
    import torch.distributed.distributed_c10d as c10d_module

    c10d_module.default_pg_timeout = timedelta(seconds=HANG_SECONDS)


def _fresh_groups(mesh):
    """New groups for each of the mesh's dimensions (every rank makes each subgroup, in one order),
    registered under this rank's names for them, with short timeouts; returns a function that puts
    the mesh's own groups back."""
    import torch.distributed as dist

    registry = torch._C._distributed_c10d
    mine = {}
    for dim, name in enumerate(mesh.mesh_dim_names):
        groups = mesh.mesh.transpose(dim, -1).reshape(-1, mesh.mesh.size(dim)).tolist()
        for ranks in groups:
            pg = dist.new_group(ranks, timeout=timedelta(seconds=HANG_SECONDS))
            if dist.get_rank() in ranks:
                mine[mesh.get_group(name).group_name] = (pg, mesh.get_group(name))
    for group_name, (pg, _) in mine.items():
        registry._unregister_process_group(group_name)
        registry._register_process_group(group_name, pg)

    def restore():
        for group_name, (_, original) in mine.items():
            registry._unregister_process_group(group_name)
            registry._register_process_group(group_name, original)

    return restore


def _feeds(gm, seed):
    """Seeded inputs shaped as the graph's placeholders' vals (floats random, ints small); an
    opaque input (the device mesh DTensor's compiled code takes) is the object traced."""
    from torch._library.fake_class_registry import FakeScriptObject

    gen = torch.Generator().manual_seed(seed)
    out = []
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta["val"]
        if isinstance(val, FakeScriptObject):
            out.append(object.__getattribute__(val, "real_obj"))
        elif not isinstance(val, torch.Tensor):  # make_fx keeps the mesh itself
            out.append(val)
        elif val.dtype.is_floating_point:
            out.append(torch.randn(val.shape, generator=gen, dtype=val.dtype))
        elif val.dtype == torch.bool:
            out.append(torch.randint(0, 2, val.shape, generator=gen).bool())
        else:
            out.append(torch.randint(0, 3, val.shape, generator=gen, dtype=val.dtype))
    return out


def _run_guarded(mesh, module, inputs):
    """`module(*inputs)` on fresh short-timeout groups: its outputs, or "hang: ..." when a
    collective gave up waiting."""
    import torch.distributed as dist

    dist.barrier()  # the ranks start each run together (on the default group: no short timeout)
    restore = _fresh_groups(mesh)
    try:
        with torch.no_grad():
            out = module(*[t.clone() if isinstance(t, torch.Tensor) else t for t in inputs])
        return [t.detach() for t in out if isinstance(t, torch.Tensor)]
    except RuntimeError as exc:
        return "hang: " + str(exc).splitlines()[0][:100]
    finally:
        restore()


def _orders_of(gm, count):
    from test_fronts_attack import _random_orders

    from fxsched.lowering import lower

    program = lower(gm)
    return program, _random_orders(program, count, 0)


def _runs_in_orders(mesh, gm, inputs, count, digest):
    """`gm` on `inputs` as traced, then in `count` seeded random legal orders of its lowered program
    (`_orders_of`), each run by `_run_guarded`; `digest` takes the order of the collectives and
    waits in each order run (the same on every rank, or the ranks would not run them together)."""
    from fxsched.ir import Launch, Wait
    from fxsched.ir.program import Schedule
    from fxsched.raising import raise_program

    program, orders = _orders_of(gm, count)
    runs = [_run_guarded(mesh, gm, inputs)]
    for order in orders:
        digest.update(repr([n for n in order if isinstance(program.op(n), (Launch, Wait))]).encode())
        program.schedule = Schedule(order)
        runs.append(_run_guarded(mesh, raise_program(program), inputs))
    return runs


def _compiled_worker(rank, world_size, pipelines, orders):
    """On one rank of the 2-D mesh: the compiled step as Inductor compiles it, then with fxsched's
    pass running each of `pipelines`; then each post-grad graph (forward, backward) on seeded
    inputs as traced and in `orders` seeded random legal orders. Returns {"steps": {name: [loss,
    grads]}, "graphs": [[outputs of each run]], "orders": a digest of the order of the collectives and
    waits in the orders run, which must be the same on every rank (the backward graph differs by
    rank: each picks its own chunk of a replicated gradient), "groups"}."""
    import hashlib

    from fxsched.integrations.inductor import FxschedInductorPass

    _short_timeouts()
    mesh = _mesh()
    capture = _Capture()
    steps = {"traced": _compiled_step(mesh, rank, capture)}
    records = {}
    for pipeline in pipelines:
        fx_pass = FxschedInductorPass(pipeline, on_error="raise")
        steps[pipeline] = _compiled_step(mesh, rank, fx_pass)
        records[pipeline] = [(run["phase"], run["gathers"], run["moved"]) for run in fx_pass.runs]
    graphs, digest = [], hashlib.sha256()
    for index, gm in enumerate(capture.graphs):
        inputs = _feeds(gm, 1000 * index + rank)
        graphs.append(_runs_in_orders(mesh, gm, inputs, orders, digest))
    groups = {name: mesh.get_group(name).group_name for name in mesh.mesh_dim_names}
    return {"steps": steps, "graphs": graphs, "orders": digest.hexdigest(), "groups": groups, "records": records}


def _check_compiled(results, pipelines, orders):
    bad = {}
    for rank, r in enumerate(results):
        traced = r["steps"]["traced"]
        for pipeline in pipelines:
            got = r["steps"][pipeline]
            if isinstance(got, str):
                bad.setdefault(f"pipeline {pipeline}", f"rank {rank} {got}")
            elif not all(torch.equal(a, b) for a, b in zip(traced, got, strict=True)):
                bad.setdefault(f"pipeline {pipeline}", f"rank {rank}: other loss or gradients")
        for index, runs in enumerate(r["graphs"]):
            expected = runs[0]
            assert not isinstance(expected, str), f"rank {rank}: graph {index} as traced failed: {expected}"
            for k, got in enumerate(runs[1:]):
                name = f"graph {index} order {k}"
                if isinstance(got, str):
                    bad.setdefault(name, f"rank {rank} {got}")
                elif len(got) != len(expected) or not all(torch.equal(a, b) for a, b in zip(expected, got)):
                    bad.setdefault(name, f"rank {rank}: other numbers")
    total = len(pipelines) + sum(len(runs) - 1 for runs in results[0]["graphs"])
    assert not bad, f"{len(bad)} of {total} runs hung or differ: {bad}"
    assert len({r["orders"] for r in results}) == 1, "the ranks' orders run their collectives otherwise"
    assert len(results[0]["graphs"]) == 2 and all(len(runs) == orders + 1 for runs in results[0]["graphs"])
    losses = [r["steps"]["traced"][0] for r in results]
    assert not torch.equal(losses[0], losses[2])  # the dp ranks saw their own data (tp ranks share the loss)


@pytest.mark.multirank
def test_a_compiled_two_d_mesh_step_under_every_pipeline_and_in_random_orders_is_bitwise_on_four_ranks():
    """FSDP (SimpleFSDP over dp) and tensor + sequence parallelism (over tp) on a 2x2 mesh of 4
    gloo ranks, compiled by torch.compile with fxsched's Inductor pass: the pass's schedule
    under each of two pipelines computes the compiled step's loss and gradients bitwise on every
    rank, and so do 4 random legal orders of each post-grad graph; none hangs. (The full sweep is
    the slow test below.) The forward's gathers are the 12 parameters' and the tp gather of the
    model's input (a plain graph input, as a lifted parameter is: docs/bad-input.md); the
    backward's tp gather of the loss's gradient (a tangent) is no parameter's re-gather (until
    2026-12-05 it was taken for one)."""
    from fxsched.runtime import run_ranks

    pipelines, orders = ("reference", "default"), 4
    results = run_ranks(_compiled_worker, WORLD, args=(pipelines, orders), timeout=1200)
    _check_compiled(results, pipelines, orders)
    for r in results:
        assert [(phase, gathers) for phase, gathers, _ in r["records"]["default"]] == [("forward", 13), ("backward", 0)]
    assert [r["groups"] for r in results] == [{"dp": "1", "tp": "3"}, {"dp": "2", "tp": "3"},
                                              {"dp": "1", "tp": "4"}, {"dp": "2", "tp": "4"}]


@pytest.mark.multirank
@pytest.mark.slow
def test_every_pipeline_and_many_random_orders_of_a_compiled_two_d_mesh_step_are_bitwise_on_four_ranks():
    """As above with every built-in pipeline and FXSCHED_ATTACK_ORDERS (20 by default) random legal
    orders of each post-grad graph."""
    from fxsched.runtime import run_ranks

    orders = int(os.environ.get("FXSCHED_ATTACK_ORDERS", "20"))
    results = run_ranks(_compiled_worker, WORLD, args=(ALL_PIPELINES, orders), timeout=3000)
    _check_compiled(results, ALL_PIPELINES, orders)


# --------------------------------------------------------------------------- the ranks' agreement check on a 2-D mesh


def _two_group_graph(dp: str, tp: str, swap: bool = False) -> fx.GraphModule:
    """FSDP's gather of a shard over `dp`, a TP all-reduce over `tp`, a gradient reduce-scatter over
    `dp`: the collectives of one rank of a 2-D mesh, its groups named as that rank names them
    (`swap`: the two dp collectives in the other order, a real disagreement)."""
    c10d = torch.ops._c10d_functional
    g = fx.Graph()
    shard, x = g.placeholder("shard"), g.placeholder("x")

    def gather():
        return g.call_function(c10d.wait_tensor.default,
                               (g.call_function(c10d.all_gather_into_tensor.default, (shard, 2, dp)),))

    def scatter(t):
        return g.call_function(c10d.wait_tensor.default,
                               (g.call_function(c10d.reduce_scatter_tensor.default, (t, "sum", 2, dp)),))

    if swap:
        grad = scatter(g.call_function(torch.ops.aten.mul.Tensor, (shard, 2)))
        w = gather()
    else:
        w = gather()
    y = g.call_function(c10d.wait_tensor.default,
                        (g.call_function(c10d.all_reduce.default, (g.call_function(torch.ops.aten.mul.Tensor, (x, w)), "sum", tp)),))
    if not swap:
        grad = scatter(g.call_function(torch.ops.aten.mul.Tensor, (shard, 2)))
    g.output((y, grad))
    gm = fx.GraphModule(nn.Module(), g)
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    FakeTensorProp(gm, mode).propagate(mode.from_tensor(torch.zeros(4)), mode.from_tensor(torch.zeros(8)))
    return gm


def _agreement_worker(rank, world_size):
    """Each rank's graph, its groups named by the mesh; `check_ranks_agree` over the world, over the
    rank's dp group and over its tp group: "agreed" or the error's first line. Then the same with
    rank 3's two dp collectives swapped (a schedule that would hang)."""
    from fxsched.runtime.agreement import ScheduleMismatch, check_ranks_agree

    mesh = _mesh()
    dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
    out = {}
    for case, swap in (("same", False), ("swapped", rank == 3)):
        gm = _two_group_graph(dp.group_name, tp.group_name, swap)
        for where, group in (("world", None), ("dp", dp), ("tp", tp)):
            try:
                check_ranks_agree(gm, group)
                out[case, where] = "agreed"
            except ScheduleMismatch as exc:
                out[case, where] = str(exc).splitlines()[0]
    return out


@pytest.mark.multirank
def test_the_ranks_agreement_check_on_a_two_d_mesh_compares_groups_by_their_place_in_the_mesh():
    """On a 2-D mesh each rank names its two groups otherwise (rank 0: dp "1", tp "3"; rank 1: "2",
    "3"; rank 2: "1", "4"; rank 3: "2", "4"). `check_ranks_agree` compared the group names, so it
    raised `ScheduleMismatch` on every call of every rank over the world, its dp group and its tp
    group alike, for the same schedule on every rank (12 of 12 calls). A group is compared by its
    place in the mesh now (its size and the steps between its ranks, where those tell the rank's
    groups apart): the same schedule agrees, and rank 3's dp collectives in the other order is
    still found by every check that includes rank 3."""
    from fxsched.runtime import run_ranks

    results = run_ranks(_agreement_worker, WORLD, timeout=600)
    for rank, out in enumerate(results):
        for where in ("world", "dp", "tp"):
            assert out["same", where] == "agreed", (rank, where, out["same", where])
            in_check = where == "world" or rank == 3 or (where == "dp" and rank == 1) or (where == "tp" and rank == 2)
            assert (out["swapped", where] != "agreed") == in_check, (rank, where, out["swapped", where])


def test_groups_named_by_their_place_keep_their_names_where_the_place_does_not_tell_them_apart():
    """`in_mesh_terms` names a group by its place (size, steps between its ranks) only where that
    tells it from the rank's other groups: two groups over the same ranks (the 2-rank tests' dp and
    tp) keep their names, so a rank that swaps their collectives still differs; a group whose
    ranks are unknown keeps its name."""
    from fxsched.runtime.agreement import collective_entries, compare_entries, in_mesh_terms

    mesh = {"1": [0, 2], "2": [1, 3], "3": [0, 1], "4": [2, 3], "dp": [0, 1], "tp": [0, 1]}
    rank0, rank3 = (collective_entries(_two_group_graph(dp, tp)) for dp, tp in (("1", "3"), ("2", "4")))
    assert compare_entries([rank0, rank3]) is not None  # by name: they differ
    named = [in_mesh_terms(e, mesh.get) for e in (rank0, rank3)]
    assert compare_entries(named) is None
    assert [e["group"] for e in named[0]] == ["<2 ranks, step 2>", "<2 ranks, step 1>", "<2 ranks, step 2>"]
    same_ranks = [in_mesh_terms(collective_entries(_two_group_graph(dp, tp)), mesh.get)
                  for dp, tp in (("dp", "tp"), ("tp", "dp"))]
    assert [e["group"] for e in same_ranks[0]] == ["dp", "tp", "dp"]
    assert compare_entries(same_ranks) is not None
    unknown = in_mesh_terms(rank0, {"1": [0, 2]}.get)
    assert [e["group"] for e in unknown] == ["<2 ranks, step 2>", "3", "<2 ranks, step 2>"]


# --------------------------------------------------------------------------- DTensor redistributions traced by make_fx


def _redistributions(mesh):
    """A function redistributing DTensors over the mesh as DTensor lowers each step (on gloo):
    Shard(1) -> Replicate (all-gather, split, cat), then a write of the shard it read; Partial ->
    Shard(1) (split, cat, reduce-scatter); Shard(0) -> Shard(1) (gloo has no all-to-all: an
    all-gather and this rank's chunk); a 2-D [Partial, Shard(0)] -> [Replicate, Replicate] (a tp
    gather, then a dp all-reduce of its result); the local tensor of a DTensor made from z (a view
    of z) written after that gather read z; Replicate -> Shard(0) on dp (a local chunk);
    [Partial, Partial] -> full tensor (two all-reduces in a row)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    tp = mesh["tp"]

    def f(x, y, z):
        a = DTensor.from_local(x, tp, [Shard(1)], run_check=False).redistribute(tp, [Replicate()]).to_local()
        x.mul_(2)
        b = DTensor.from_local(y, tp, [Partial()], run_check=False).redistribute(tp, [Shard(1)]).to_local()
        c = DTensor.from_local(x, tp, [Shard(0)], run_check=False).redistribute(tp, [Shard(1)]).to_local()
        y.add_(1)
        d = DTensor.from_local(z, mesh, [Partial(), Shard(0)], run_check=False).redistribute(
            mesh, [Replicate(), Replicate()]).to_local()
        DTensor.from_local(z, tp, [Shard(0)], run_check=False).to_local().add_(1)
        e = DTensor.from_local(z, mesh, [Replicate(), Replicate()], run_check=False).redistribute(
            mesh, [Shard(0), Replicate()]).to_local()
        e.mul_(3)
        g = DTensor.from_local(y * 1, mesh, [Partial(), Partial()], run_check=False).full_tensor()
        return a, b, c, d, e, g, x * 1, y * 1, z * 1

    return f


def _dtensor_graph(mesh):
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(_redistributions(mesh), tracing_mode="fake")(*(torch.zeros(4, 6) for _ in range(3)))


def _dtensor_worker(rank, world_size, count, pipelines):
    """On one rank: its trace of the redistributions, run as traced, in `count` seeded random legal
    orders and as each of `pipelines` schedules it; also which collectives (and waits) each order
    runs in which order, which must be the same on every rank (each rank's graph is its own: it
    picks its own chunk)."""
    import hashlib

    _short_timeouts()
    mesh = _mesh()
    gm = _dtensor_graph(mesh)
    gen = torch.Generator().manual_seed(rank)
    inputs = [torch.randn(4, 6, generator=gen) for _ in range(3)]
    digest = hashlib.sha256()
    runs = _runs_in_orders(mesh, gm, inputs, count, digest)
    for pipeline in pipelines:
        runs.append(_run_guarded(mesh, fxsched.schedule(_dtensor_graph(mesh), pipeline).graph_module, inputs))
    return {"runs": runs, "collectives": digest.hexdigest()}


def _check_runs(results, names):
    bad = {}
    for rank, r in enumerate(results):
        expected = r["runs"][0]
        assert not isinstance(expected, str), f"rank {rank}: the graph as traced failed: {expected}"
        for name, got in zip(names, r["runs"][1:], strict=True):
            if isinstance(got, str):
                bad.setdefault(name, f"rank {rank} {got}")
            elif len(got) != len(expected) or not all(torch.equal(a, b) for a, b in zip(expected, got)):
                bad.setdefault(name, f"rank {rank}: other numbers")
    assert not bad, f"{len(bad)} of {len(names)} runs hung or differ: {bad}"
    assert len({r["collectives"] for r in results}) == 1, "the ranks' orders run their collectives otherwise"
    assert len({tuple(float(t.sum()) for t in r["runs"][0]) for r in results}) == WORLD


@pytest.mark.multirank
def test_dtensor_redistributions_traced_by_make_fx_in_random_legal_orders_and_pipelines_are_bitwise_on_four_ranks():
    """make_fx of DTensor redistributions over a 2x2 mesh (`_redistributions`: all-gathers with
    split/cat, a reduce-scatter of a split-and-cat, the all-gather-and-chunk gloo does for
    Shard(0) -> Shard(1), a dp all-reduce of a tp gather's result, writes of a tensor a collective
    read, directly and through the local view DTensor.from_local makes of it): 30 seeded random
    legal orders and the built-in pipelines compute the traced numbers bitwise on every rank of 4
    gloo ranks, none hangs."""
    from fxsched.runtime import run_ranks

    count, pipelines = 30, ("reference", "default", "rewrite")
    results = run_ranks(_dtensor_worker, WORLD, args=(count, pipelines), timeout=1200)
    _check_runs(results, [f"order {k}" for k in range(count)] + [f"pipeline {p}" for p in pipelines])


# --------------------------------------------------------------------------- torchtitan's joint graph of the 2-D step


def _joint_graph(mesh):
    """torchtitan graph_trainer's make_fx tracer on the 2-D model's step (forward, loss, backward:
    one joint graph of plain tensors, DTensor's redistributions traced into functional collectives)."""
    from torchtitan.experiments.graph_trainer.make_fx_tracer import minimal_fx_tracer

    model = _model(mesh)

    def step(x):
        loss = model(x).square().sum()
        loss.backward()
        return [loss] + [p.grad for p in model.parameters()]

    return minimal_fx_tracer(step, module=model)(torch.zeros(4, WIDTH)).gm


def _joint_worker(rank, world_size, count, pipelines):
    """As `_dtensor_worker`, on torchtitan's joint graph: seeded inputs, `count` random legal orders,
    and each of `pipelines` run as graph_trainer runs fxsched (`integrations.torchtitan.fxsched_pass`)."""
    import hashlib

    from fxsched.integrations.torchtitan import fxsched_pass

    _short_timeouts()
    mesh = _mesh()
    gm = _joint_graph(mesh)
    inputs = _feeds(gm, rank)
    digest = hashlib.sha256()
    runs = _runs_in_orders(mesh, gm, inputs, count, digest)
    for pipeline in pipelines:
        scheduled = fxsched_pass(pipeline)(_joint_graph(mesh))
        runs.append(_run_guarded(mesh, scheduled, inputs))
    return {"runs": runs, "collectives": digest.hexdigest()}


@pytest.mark.multirank
def test_torchtitans_joint_graph_of_a_two_d_mesh_step_in_random_orders_and_pipelines_is_bitwise_on_four_ranks():
    """torchtitan's make_fx tracer on the SimpleFSDP (dp) + tensor/sequence parallel (tp) step over
    a 2x2 mesh: 6 seeded random legal orders of the joint graph and fxsched's pass (as graph_trainer
    runs it) under `default` compute the traced step bitwise on 4 gloo ranks, none hangs. (More
    orders and every pipeline: the slow test below.)"""
    from fxsched.runtime import run_ranks

    count, pipelines = 6, ("default",)
    results = run_ranks(_joint_worker, WORLD, args=(count, pipelines), timeout=1200)
    _check_runs(results, [f"order {k}" for k in range(count)] + [f"pipeline {p}" for p in pipelines])


@pytest.mark.multirank
@pytest.mark.slow
def test_torchtitans_joint_graph_of_a_two_d_mesh_step_in_many_orders_and_every_pipeline_is_bitwise_on_four_ranks():
    from fxsched.runtime import run_ranks

    count = int(os.environ.get("FXSCHED_ATTACK_ORDERS", "20"))
    results = run_ranks(_joint_worker, WORLD, args=(count, ALL_PIPELINES), timeout=3000)
    _check_runs(results, [f"order {k}" for k in range(count)] + [f"pipeline {p}" for p in ALL_PIPELINES])


# --------------------------------------------------------------------------- uneven shards


UNEVEN = 5  # a width no dp world size divides: DTensor pads the smaller shards before gathering


def _uneven_model(mesh):
    """SimpleFSDP over a 1-D mesh of 2 ranks, parameters of odd sizes (5, 11): rank 0 holds 3 (6) rows
    of each, rank 1 2 (5), which DTensor pads by a row (`constant_pad_nd`) before each all-gather
    and the gathered tensor is cut back (`slice`) after: the ranks' graphs differ."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.LayerNorm(UNEVEN), nn.Linear(UNEVEN, 2 * UNEVEN + 1), nn.ReLU(),
                                          nn.Linear(2 * UNEVEN + 1, UNEVEN)) for _ in range(2)])
    return torchtitan_simple_fsdp.data_parallel(model, mesh, mode="fully_shard")


def _uneven_worker(rank, world_size):
    """The uneven model's compiled step as Inductor compiles it (its post-grad graphs kept); each
    pipeline's schedule of those graphs (the order of their collectives and waits, by name, the
    collectives as the ranks' agreement check lists them, and that check run across the ranks on
    each graph: its fingerprint, or the mismatch it raised); the compiled step with fxsched's pass
    running each pipeline; what the structural stage recognised."""
    from torch.distributed.device_mesh import init_device_mesh

    from fxsched.integrations.inductor import FxschedInductorPass
    from fxsched.runtime.agreement import ScheduleMismatch, check_ranks_agree, collective_entries

    _short_timeouts()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    capture = _Capture()
    steps, recognised, orders, entries, agreed = ({"traced": _compiled_step(mesh, rank, capture, _uneven_model, UNEVEN)},
                                                  {}, {}, {}, {})
    for pipeline in ALL_PIPELINES:
        fx_pass = FxschedInductorPass(pipeline, on_error="raise")
        graphs = [copy.deepcopy(gm) for gm in capture.graphs]
        for gm in graphs:
            fx_pass(gm.graph)
        recognised[pipeline] = [(run["phase"], len(run["structural"]["tagged"]), len(run["structural"]["reductions"]))
                                for run in fx_pass.runs]
        orders[pipeline] = [[n.name for n in gm.graph.nodes if "all_gather" in n.name or "reduce_scatter" in n.name
                             or "wait_tensor" in n.name] for gm in graphs]
        entries[pipeline] = [collective_entries(gm) for gm in graphs]
        agreed[pipeline] = []
        for gm in graphs:
            try:
                agreed[pipeline].append(check_ranks_agree(gm))
            except ScheduleMismatch as exc:
                agreed[pipeline].append(f"mismatch: {exc}")
    for pipeline in ALL_PIPELINES:
        steps[pipeline] = _compiled_step(mesh, rank, FxschedInductorPass(pipeline, on_error="raise"), _uneven_model, UNEVEN)
    return {"steps": steps, "recognised": recognised, "orders": orders, "entries": entries, "agreed": agreed}


@pytest.mark.multirank
def test_uneven_shards_padded_before_their_gathers_are_scheduled_alike_on_every_rank():
    """SimpleFSDP pads a rank's smaller shard of a parameter whose rows no world size divides
    (`constant_pad_nd` then the all-gather: torchtitan, DTensor), so on 2 ranks rank 1's gathers read
    a pad of the graph input, rank 0's the input itself. The structural stage took only rank 0's
    for FSDP gathers (12 of 12 forward gathers on rank 0, 0 of 12 on rank 1: a pad is no cast or
    view), so the pipelines moved gathers on rank 0 only: every pipeline (6 of 6) launched and
    waited the forward graph's collectives in another order on each rank (rank 0 moved 14 or 16
    gathers, rank 1 none): with a second group's collectives between them, ranks that wait in
    other orders can hang. A pad at the end of a shard's first dim now passes the shard through as
    a cast does (structural), and lowers as one (it moves with its gather): both ranks recognise
    the same gathers.

    `bucket` (`rewrite`, `default,bucket`) still priced each rank's graph with its own pads: rank
    1's pads took compute time and held a padded copy of the shard until the gather's wait, rank
    0 had none, and the simulated steps differed (0.063 ms exposed on rank 0, 0.030 on rank 1), so
    rank 0 packed 6 forward gathers into one bucket, rank 1 4 (the agreement check named an
    all-gather of other sizes; run together, gloo aborted: "Received data size doesn't match
    expected size"). A shard's pad before its gather is now the shard itself to the IR (a cast
    with `alias`: no time, no storage of its own, the shard read until the wait), so every rank's
    graph prices as rank 0's (whose shards are whole): every pipeline places every collective and
    wait alike on both ranks, `check_ranks_agree` passes, and the compiled step computes bitwise
    what the traced one does on both ranks, no hang."""
    from fxsched.runtime import run_ranks
    from fxsched.runtime.agreement import compare_entries

    results = run_ranks(_uneven_worker, 2, timeout=1200)
    assert results[0]["recognised"] == results[1]["recognised"]
    assert results[0]["recognised"]["default"] == [("forward", 12, 0), ("backward", 0, 12)]
    differ = [p for p in ALL_PIPELINES if results[0]["orders"][p] != results[1]["orders"][p]]
    assert differ == [], differ
    for pipeline in ALL_PIPELINES:
        for graph in range(2):
            assert compare_entries([r["entries"][pipeline][graph] for r in results]) is None, (pipeline, graph)
        assert results[0]["agreed"][pipeline] == results[1]["agreed"][pipeline], pipeline
        assert not any(a.startswith("mismatch") for a in results[0]["agreed"][pipeline]), results[0]["agreed"][pipeline]
    # the bucket pipelines bucket: forward gathers packed into fewer collectives than traced
    for pipeline in ("rewrite", "default,bucket"):
        assert len(results[0]["entries"][pipeline][0]) < len(results[0]["entries"]["reference"][0]), pipeline
    bad = {}
    for rank, r in enumerate(results):
        traced = r["steps"]["traced"]
        assert not isinstance(traced, str), traced
        for pipeline in ALL_PIPELINES:
            got = r["steps"][pipeline]
            if isinstance(got, str):
                bad.setdefault(pipeline, f"rank {rank} {got}")
            elif not all(torch.equal(a, b) for a, b in zip(traced, got, strict=True)):
                bad.setdefault(pipeline, f"rank {rank}: other loss or gradients")
    assert not bad, f"{len(bad)} of {len(ALL_PIPELINES)} pipelines hung or differ: {bad}"
    assert not torch.equal(results[0]["steps"]["traced"][0], results[1]["steps"]["traced"][0])


@pytest.mark.parametrize("pad, recognised", [([0, 0, 0, 1], True), ([0, 0, 0, 0], True), ([0, 1, 0, 0], False),
                                             ([0, 0, 1, 0], False), ([0, 1], False)])
def test_a_pad_at_the_end_of_a_shards_first_dim_passes_the_shard_through(pad, recognised):
    """The pad DTensor adds to a smaller shard (rows at the end of its first dim) sits between a
    graph input and its gather as a cast does; a pad of another dim, or at the start, is compute
    (the gather is an activation's)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxsched.lowering.structural import tag_fsdp_collectives

    c10d = torch.ops._c10d_functional

    def f(shard, x):
        padded = torch.ops.aten.constant_pad_nd.default(shard, pad, 0.0)
        return (x @ c10d.wait_tensor.default(c10d.all_gather_into_tensor.default(padded, 2, "0")).T,)

    gm = make_fx(f, tracing_mode="fake")(torch.randn(2, 5), torch.randn(3, 5 + pad[1]))
    result = tag_fsdp_collectives(gm.graph, phase="forward")
    assert [g.param_name for g in result.tagged] == (["shard_1"] if recognised else [])


def _uneven_linears(rank):
    """A stack of linears (5 -> 11 -> 5 -> 11 -> 5) as SimpleFSDP gathers them on 2 ranks, traced
    with fake tensors: rank 0's shards are whole (3 and 6 rows), rank 1's are short (2 and 5) and
    padded by a row before each gather; the gathered weight is cut back to its rows."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxsched.lowering.structural import tag_fsdp_collectives

    c10d = torch.ops._c10d_functional
    dims = [5, 11, 5, 11, 5]

    def f(*args):
        *shards, x = args
        for i, shard in enumerate(shards):
            rows, whole = dims[i + 1], -(-dims[i + 1] // 2)
            if shard.shape[0] < whole:
                shard = torch.ops.aten.constant_pad_nd.default(shard, [0, 0, 0, whole - shard.shape[0]], 0.0)
            weight = c10d.wait_tensor.default(c10d.all_gather_into_tensor.default(shard, 2, "0"))
            x = torch.relu(x @ torch.ops.aten.slice.Tensor(weight, 0, 0, rows).T)
        return (x,)

    shards = [torch.randn(-(-n // 2) if rank == 0 else n // 2, d) for d, n in zip(dims, dims[1:])]
    gm = make_fx(f, tracing_mode="fake")(*shards, torch.randn(64, 5))
    tag_fsdp_collectives(gm.graph, phase="forward")
    return gm


@pytest.mark.parametrize("pipeline", ["default,bucket", "rewrite"])
def test_a_shards_pad_before_its_gather_prices_as_the_whole_shard_so_bucket_packs_alike_on_every_rank(pipeline):
    """Rank 1 pads each short shard before gathering it, rank 0 does not: priced as written (the
    pads' time on rank 1, their padded copies held until the waits), `bucket` packed the 1st and
    2nd gathers on rank 0, the 2nd and 3rd on rank 1 (gloo aborts such ranks). The pad is the
    shard itself to the IR now (a cast with `alias`): it costs nothing and holds nothing, the shard
    input counts as the padded bytes, and both ranks' programs price, peak and bucket alike."""
    from fxsched.cost.model import op_costs
    from fxsched.cost.simulate import memory_profile
    from fxsched.ir import Cast
    from fxsched.lowering import lower
    from fxsched.runtime.agreement import collective_entries, compare_entries

    done = [fxsched.schedule(_uneven_linears(rank), pipeline) for rank in (0, 1)]
    bought = [d.report["passes"]["bucket"]["bought"] for d in done]
    assert bought[0] == bought[1] and len(bought[0]) == 1, bought
    assert compare_entries([collective_entries(d.graph_module) for d in done]) is None

    programs = [lower(_uneven_linears(rank)) for rank in (0, 1)]
    pads = [op for op in programs[1].ops() if isinstance(op, Cast)]
    assert len(pads) == 4 and all(op.alias == op.operands[0] for op in pads)
    assert not any(isinstance(op, Cast) for op in programs[0].ops())
    costs = [op_costs(p) for p in programs]
    assert all(costs[1][op.name] == 0.0 for op in pads)
    assert {n: ms for n, ms in costs[1].items() if n in costs[0]} == costs[0]
    assert memory_profile(programs[0]).peak_bytes == memory_profile(programs[1]).peak_bytes


@pytest.mark.parametrize("desc, recognised", [("tangent", False), ("tangent's local tensor", False),
                                              ("plain", True), ("parameter's local tensor", True), (None, True)])
def test_a_gather_of_a_tangent_is_no_parameters_gather(desc, recognised):
    """In the compiled 2-D step, the backward graph's tp gather of the loss's gradient (sequence
    parallel's last block gathers it) read a graph input as FSDP's re-gathers do, and was taken for
    one. AOTAutograd describes each input (`meta["desc"]`, the same on every rank): a tangent, or
    a DTensor tangent's local tensor, is no parameter's shard. A plain input (the model's input, or
    a parameter torch.compile lifts) and a parameter's local tensor still are."""
    descriptors = pytest.importorskip("torch._functorch._aot_autograd.descriptors")
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxsched.lowering.structural import tag_fsdp_collectives

    c10d = torch.ops._c10d_functional
    plain = descriptors.PlainAOTInput(0)
    descs = {"tangent": descriptors.TangentAOTInput(descriptors.PlainAOTOutput(0)),
             "tangent's local tensor": descriptors.SubclassGetAttrAOTInput(
                 descriptors.TangentAOTInput(descriptors.PlainAOTOutput(0)), "_local_tensor"),
             "plain": plain, "parameter's local tensor": descriptors.SubclassGetAttrAOTInput(plain, "_local_tensor"),
             None: None}

    def f(shard, x):
        return (x @ c10d.wait_tensor.default(c10d.all_gather_into_tensor.default(shard, 2, "0")).T,)

    gm = make_fx(f, tracing_mode="fake")(torch.randn(2, 5), torch.randn(3, 5))
    if descs[desc] is not None:
        next(iter(gm.graph.find_nodes(op="placeholder"))).meta["desc"] = descs[desc]
    result = tag_fsdp_collectives(gm.graph, phase="backward")
    assert [g.param_name for g in result.tagged] == (["shard_1"] if recognised else [])
    if not recognised:
        assert "tangent" in str(result.skipped)
