"""Graphs users bring with other collectives and parallelisms beside FSDP (tensor, sequence, expert
and context parallelism, point-to-point sends and receives, broadcasts, several process groups),
attacked as tests/test_fronts_attack3.py does: every legal order of the lowered program (or many
random ones), and every built-in pipeline, run on gloo ranks, must compute the input's numbers
bitwise on every rank, and must not hang. A hang is caught by the harness (each order runs on a
fresh process group whose collectives time out after a few seconds), never asserted on a clock.
"""

from __future__ import annotations

import itertools
import sys
from datetime import timedelta

import networkx as nx
import pytest
import torch
import torch.distributed._functional_collectives  # noqa: F401  (registers the functional collectives' autograd)
from torch import fx

import fxsched
from fxsched.ir import Launch, Wait
from fxsched.ir.program import Schedule
from fxsched.lowering import lower
from fxsched.raising import raise_program

c10d = torch.ops._c10d_functional
aten = torch.ops.aten

PIPELINES = ("reference", "default", "rewrite", "default,unshard", "default,bucket")
HANG_SECONDS = 10  # a collective of the harness's per-order group that waits longer has hung


# --------------------------------------------------------------------------- harness


def _legal_orders(program, most: int = 400, shuffled: int = 30) -> list[list[str]]:
    """networkx's first `most` topological orders and `shuffled` seeded random ones."""
    from test_fronts_attack import _random_orders

    return [list(o) for o in itertools.islice(nx.all_topological_sorts(program.graph), most)] + \
        _random_orders(program, shuffled, 0)


def _run_orders(rank, world_size, build, groups, orders, pipelines, feeds, seed=None):
    """On one rank: its graph (`build(rank, world_size)`), run as traced, then in each of `orders`
    (schedules of its lowered program, by op name: the same on every rank) and scheduled by each of
    `pipelines`. Each run gets fresh gloo groups of all ranks, registered under the names `groups`, whose
    collectives give up after HANG_SECONDS: a run that hangs is recorded as "hang", and the next
    starts clean. `seed`: the global generator is seeded with it before each run (for graphs that
    draw). Returns the outputs of each run (or "hang")."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    gm = build(rank, world_size)
    program = lower(gm)
    modules = [gm]
    for order in orders:
        program.schedule = Schedule(order)
        modules.append(raise_program(program))
    modules += [fxsched.schedule(gm, p).graph_module for p in pipelines]
    inputs = feeds(rank)
    results = []
    for module in modules:
        dist.barrier()  # the ranks start each run together (on the default group: no short timeout)
        for group in groups:
            pg = dist.new_group(list(range(world_size)), timeout=timedelta(seconds=HANG_SECONDS))
            torch._C._distributed_c10d._register_process_group(group, pg)
        try:
            if seed is not None:
                torch.manual_seed(seed)
            with torch.no_grad():
                out = module(*[t.clone() for t in inputs])
            results.append([t.detach() for t in (out if isinstance(out, (tuple, list)) else [out])])
        except RuntimeError as exc:  # gloo's timeout: the ranks waited on each other
            results.append("hang: " + str(exc).splitlines()[0][:100])
        finally:
            for group in groups:
                torch._C._distributed_c10d._unregister_process_group(group)
    return results


def _check(results, orders, pipelines):
    """Every run equals the traced graph's bitwise on every rank, none hung; the ranks saw
    different data."""
    names = [f"order {k}" for k in range(len(orders))] + [f"pipeline {p}" for p in pipelines]
    bad = {}
    for rank, runs in enumerate(results):
        expected = runs[0]
        assert not isinstance(expected, str), f"rank {rank}: the traced graph itself failed: {expected}"
        for name, got in zip(names, runs[1:], strict=True):
            if isinstance(got, str):
                bad.setdefault(name, f"rank {rank} {got}")
            elif len(got) != len(expected) or not all(torch.equal(a, b) for a, b in zip(expected, got)):
                bad.setdefault(name, f"rank {rank}: other numbers")
    assert not bad, f"{len(bad)} of {len(names)} runs hung or differ: {bad}"
    assert any(not torch.equal(a, b) for a, b in zip(results[0][0], results[1][0]))


# --------------------------------------------------------------------------- point-to-point


def _ring(rank, world_size, steps=2, pad=True):
    """Context parallelism's ring exchange (ring attention passes K/V blocks around): each step
    posts a receive from the previous rank and a send to the next, computes on the block it holds
    meanwhile, then waits for both and passes the received block on."""
    nxt, prev = (rank + 1) % world_size, (rank - 1) % world_size
    g = fx.Graph()
    q, kv = g.placeholder("q"), g.placeholder("kv")
    acc = g.call_function(aten.mul.Tensor, (q, 0))
    for step in range(steps):
        buf = g.call_function(aten.empty_like.default, (kv,))
        recv = g.call_function(c10d.irecv.default, (buf, prev, step, "cp"))
        send = g.call_function(c10d.isend.default, (kv, nxt, step, "cp"))
        acc = g.call_function(aten.add.Tensor, (acc, g.call_function(aten.mul.Tensor, (q, kv))))
        got = g.call_function(c10d.wait_tensor.default, (recv,))
        g.call_function(c10d.wait_tensor.default, (send,))
        kv = got
    acc = g.call_function(aten.add.Tensor, (acc, g.call_function(aten.mul.Tensor, (q, kv))))
    g.output((acc, g.call_function(torch.sin, (g.call_function(torch.ones, (3,)),))) if pad else (acc,))
    return fx.GraphModule(torch.nn.Module(), g)


def _ring1(rank, world_size):
    return _ring(rank, world_size, steps=1, pad=False)


def _ring_feeds(rank):
    return [torch.arange(4.0) + 1 + rank, torch.arange(4.0) * (rank + 2)]


def _point_to_point(op) -> bool:
    return isinstance(op, Launch) and op.target.split(".")[1] in ("isend", "irecv")


def test_a_point_to_point_wait_follows_the_sends_and_receives_traced_before_it():
    """A receive's wait blocks until the peer has posted the matching send. The peer runs the same
    schedule, so a wait moved above a send traced before it (`irecv; wait; isend`) waits for a send
    no rank has posted (`irecv; wait; isend` hangs on 2 gloo ranks: the test below). Of 30 random
    legal orders of these two ring steps, 23 put a wait so. Every legal order now keeps each
    point-to-point wait after the sends and receives of its group traced before it (`p2p-order`,
    ir/effects.py). The built-in pipelines' schedules kept it already (no pass moves a wait up)."""
    program = lower(_ring(0, 2))
    traced = program.schedule.names()
    launches = [n for n in traced if _point_to_point(program.op(n))]
    waits = {n: program.op(n).launched_by for n in traced
             if isinstance(program.op(n), Wait) and _point_to_point(program.op(program.op(n).launched_by))}
    assert len(launches) == 4 and len(waits) == 4
    for order in _legal_orders(program):
        at = {n: i for i, n in enumerate(order)}
        for wait in waits:
            before = [n for n in launches if traced.index(n) < traced.index(wait)]
            assert all(at[n] < at[wait] for n in before), (
                f"{wait} runs before {[n for n in before if at[n] > at[wait]]}: {order}")


def test_a_receives_wait_follows_a_send_that_is_opaque():
    """A send whose result is also read by name besides its wait is an opaque collective (in its
    group's collective order, but no launch): the receive's wait still follows it (18 of the 50
    legal orders put it first when only launches counted)."""
    def build(g):
        x, buf = g.placeholder("x"), g.placeholder("buf")
        recv = g.call_function(c10d.irecv.default, (buf, 1, 0, "cp"))
        send = g.call_function(c10d.isend.default, (x, 1, 0, "cp"))
        other = g.call_function(aten.mul.Tensor, (x, 3))
        got = g.call_function(c10d.wait_tensor.default, (recv,))
        g.call_function(c10d.wait_tensor.default, (send,))
        g.output((g.call_function(aten.add.Tensor, (got, other)), g.call_function(aten.mul.Tensor, (send, 2))))

    g = fx.Graph()
    build(g)
    program = lower(fx.GraphModule(torch.nn.Module(), g))
    assert not isinstance(program.op("isend_default"), Launch)
    orders = list(nx.all_topological_sorts(program.graph))
    assert len(orders) > 10
    assert all(o.index("isend_default") < o.index("wait_tensor_default") for o in orders)


@pytest.mark.multirank
def test_every_legal_order_and_pipeline_of_a_ring_exchange_runs_bitwise_without_a_hang_on_two_ranks():
    """Two steps of a ring exchange (`irecv` from the previous rank, `isend` to the next, compute on
    the held block meanwhile): every legal order tried and every pipeline computes the traced
    graph's numbers on 2 gloo ranks, and none hangs. Before point-to-point waits kept their place
    after the sends and receives traced before them (`p2p-order`), 18 of the 30 random legal orders
    hung: each with the receive's wait above the send, on both ranks. (The pipelines' schedules
    did not.)"""
    from fxsched.runtime import run_ranks

    orders = _legal_orders(lower(_ring1(0, 2)), most=0)
    results = run_ranks(_run_orders, 2, args=(_ring1, ("cp",), orders, PIPELINES, _ring_feeds), timeout=1200)
    _check(results, orders, PIPELINES)


# --------------------------------------------------------------------------- tensor and sequence parallelism beside FSDP

TP, DP = "tp", "dp"


class _funcol:
    """The functional collectives on a group given by name only (torch's wrappers look the group
    up when called, and there is no process group when tracing)."""

    @staticmethod
    def all_reduce(x, op, group):
        return c10d.wait_tensor.default(c10d.all_reduce.default(x, op, group))

    @staticmethod
    def all_gather_tensor(x, dim, group):
        return c10d.wait_tensor.default(c10d.all_gather_into_tensor.default(x, 2, group))

    @staticmethod
    def reduce_scatter_tensor(x, op, dim, group):
        return c10d.wait_tensor.default(c10d.reduce_scatter_tensor.default(x.contiguous(), op, 2, group))

    @staticmethod
    def broadcast(x, src, group):
        return c10d.wait_tensor.default(c10d.broadcast.default(x, src, group))


class _ToTP(torch.autograd.Function):
    """Megatron's `f`: identity forward, all-reduce of the input gradient over TP backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _funcol.all_reduce(g, "sum", TP)


class _FromTP(torch.autograd.Function):
    """Megatron's `g`: all-reduce of the partial sums over TP forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        return _funcol.all_reduce(x, "sum", TP)

    @staticmethod
    def backward(ctx, g):
        return g


class _GatherSP(torch.autograd.Function):
    """Sequence parallelism: all-gather the sequence shards over TP (dim 0) forward,
    reduce-scatter the gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return _funcol.all_gather_tensor(x, 0, TP)

    @staticmethod
    def backward(ctx, g):
        return _funcol.reduce_scatter_tensor(g, "sum", 0, TP)


class _Broadcast(torch.autograd.Function):
    """A broadcast from TP rank 0 (a replicated value, as a dropout seed or a routing table)."""

    @staticmethod
    def forward(ctx, x):
        return _funcol.broadcast(x, 0, TP)

    @staticmethod
    def backward(ctx, g):
        return g


class _TPBlock(torch.nn.Module):
    """An MLP with column and row parallel linears and sequence-parallel norms, whose parameters
    FSDP shards over DP: collectives of two process groups in the forward and the backward."""

    def __init__(self, width=8):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x):  # x: this rank's sequence shard [s, width]
        h = _GatherSP.apply(self.norm(x))
        h = _ToTP.apply(h)
        h = torch.relu(self.up(h))
        y = _FromTP.apply(self.down(h))
        return _Broadcast.apply(y) + h.sum(-1, keepdim=True)


class _TwoBlocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = _TPBlock(), _TPBlock()

    def forward(self, x):
        y = self.a(x)
        return self.b(y[: x.shape[0]] * 0.5 + x)


def _tp_front():
    from fxsched.front import fsdp_joint_graph

    torch.manual_seed(0)
    module = _TwoBlocks()
    inputs = [torch.randn(3, 8)]
    front = fsdp_joint_graph(module, inputs, lambda m, x: (m(x) ** 2).sum(), 2, group_name=DP)
    return front, module, inputs


def _tp_build(rank, world_size):
    return _tp_front()[0].gm


def _tp_feeds(rank):
    from ranks import rank_feeds

    front, module, inputs = _tp_front()
    return rank_feeds(front, module, inputs)[rank]


@pytest.mark.multirank
def test_tensor_and_sequence_parallel_collectives_beside_fsdp_in_legal_orders_and_pipelines_are_bitwise_on_two_ranks():
    """FSDP over group `dp` (gathers, backward re-gathers, reduce-scatters, from fxsched's front)
    and, on group `tp` over the same ranks, what tensor and sequence parallelism add (Megatron's
    f/g all-reduces, a sequence all-gather and its reduce-scatter, a broadcast): 30 random legal
    orders and every pipeline (with `unorder-reduce-scatters` and `gradients-first` too) compute
    the traced step bitwise on 2 gloo ranks, and none hangs (nothing found: this pins it)."""
    from fxsched.runtime import run_ranks

    pipelines = (*PIPELINES, "unorder-reduce-scatters,gradients-first,default")
    orders = _legal_orders(lower(_tp_build(0, 2)), most=0)
    results = run_ranks(_run_orders, 2, args=(_tp_build, (DP, TP), orders, pipelines, _tp_feeds), timeout=1200)
    _check(results, orders, pipelines)


# --------------------------------------------------------------------------- expert parallelism: graphs that differ per rank


class _AllToAll(torch.autograd.Function):
    """Expert parallelism's token dispatch: `all_to_all_single` with split sizes (each rank's own:
    how many of its tokens go to each expert's rank), the reverse exchange backward."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits):
        ctx.splits = (out_splits, in_splits)
        return c10d.wait_tensor.default(c10d.all_to_all_single.default(x, out_splits, in_splits, "ep"))

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        return c10d.wait_tensor.default(c10d.all_to_all_single.default(g.contiguous(), in_splits, out_splits, "ep")), None, None


class _MoE(torch.nn.Module):
    def __init__(self, width, send, recv):
        super().__init__()
        self.inp, self.mlp = torch.nn.Linear(width, width), torch.nn.Linear(width, width)
        self.expert, self.out = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)
        self.send, self.recv = send, recv

    def forward(self, x):
        h = self.inp(x)
        t = self.out(torch.relu(self.expert(_AllToAll.apply(h, self.recv, self.send))))
        return self.mlp(_AllToAll.apply(t, self.send, self.recv) + h)


def _ep_front(rank, layers=3, width=256):
    """FSDP (group "0") around MoE layers whose all-to-alls (group "ep") route rank 0's 600 tokens
    100 to itself and 500 to rank 1, rank 1's 550 to rank 0 and 50 to itself: traced on each rank
    with its own split sizes, as make_fx of SPMD code does, so the experts' shapes differ by rank.
    The front's result, the module and the example inputs."""
    from fxsched.front import fsdp_joint_graph

    send, recv = [([100, 500], [100, 550]), ([550, 50], [500, 50])][rank]
    torch.manual_seed(0)
    module = torch.nn.Sequential(*[_MoE(width, send, recv) for _ in range(layers)])
    inputs = [torch.randn(600, width)]
    return fsdp_joint_graph(module, inputs, lambda m, x: (m(x) ** 2).sum(), 2), module, inputs


def _ep_graph(rank, layers=3, width=256):
    return _ep_front(rank, layers, width)[0].gm


def test_the_ranks_agreement_check_takes_an_all_to_all_of_other_sizes_on_each_rank_for_the_same_collective():
    """An all-to-all with split sizes (expert parallelism) receives another number of tokens on each
    rank: its result's extents are the rank's own, not a disagreement. The check counted them, so it
    raised `ScheduleMismatch` on every pair of such graphs, even where every rank issues the same
    collectives in the same order (`reference` here: the first difference it named was the
    all-to-all, `f32[650,256]` against `f32[550,256]`). An all-to-all's, a send's and a receive's
    (and `shard_dim_alltoall`'s, whose shards may be uneven) extents are left out now; their dtype
    and rank count, and every other collective's shape, still are."""
    from fxsched.runtime.agreement import collective_entries, compare_entries

    graphs = [_ep_graph(rank) for rank in range(2)]
    entries = [collective_entries(fxsched.schedule(gm, "reference").graph_module) for gm in graphs]
    assert compare_entries(entries) is None
    a2a = [e["type"] for e in entries[0] if "all_to_all" in e["kind"]]
    assert a2a and set(a2a) == {"f32[?,?]"}
    # a gather of another size on one rank is still a disagreement
    other = [dict(e) for e in entries[1]]
    at = next(i for i, e in enumerate(other) if "all_gather" in e["kind"])
    other[at]["type"] = "f32[3]"
    assert compare_entries([entries[0], other]).index == at


def test_graphs_that_differ_per_rank_in_sizes_may_be_scheduled_differently_and_the_check_says_where():
    """Scheduled each alone (no `group`: docs/bad-input.md), graphs each rank traces with its own
    sizes (expert parallelism's split sizes, traced as numbers) are priced differently by the cost
    model, and the cost-guided pipelines order the FSDP group's collectives differently on each rank
    (here `default`: 19 of 71 collectives, from the 37th, a reduce-scatter on one rank where the
    other re-gathers `1.expert.weight`): run together they would hang or exchange the wrong tensors.
    `check_ranks_agree` raises instead, naming that collective; `reference` (no cost model) agrees.
    With `group` the ranks agree on one program first (the test below). Traced with symbolic split
    sizes (torch.compile's unbacked ones) the graphs are one graph."""
    from fxsched.runtime.agreement import collective_entries, compare_entries

    graphs = [_ep_graph(rank) for rank in range(2)]
    entries = [collective_entries(fxsched.schedule(gm, "default").graph_module) for gm in graphs]
    mismatch = compare_entries(entries)
    assert mismatch is not None and mismatch.expected["kind"] != mismatch.found["kind"]
    assert "fsdp" in (mismatch.expected["role"] or "") + (mismatch.found["role"] or "")


def _ep_agree(rank, world_size, pipelines):
    """On one rank: its EP graph's collectives as each pipeline schedules it alone (`alone`) and
    with `group="world"` (`agreed`; and the drop-in with the group), the fingerprint
    `check_ranks_agree` returns for those, the outputs of the traced graph and of each (`outputs`);
    the peak memory of the rank's own program in the order `default` gives under a cap at the
    input's peak with the group, and that cap (`peak`); and what scheduling with a group says when
    rank 1's graph has a sigmoid where rank 0's has a relu (`mismatch`), and `agree_sizes` of a
    gather of other sizes on each rank (`sized`)."""
    from ranks import rank_feeds

    from fxsched.cost.model import op_costs
    from fxsched.cost.simulate import simulate
    from fxsched.ir import parse_program
    from fxsched.runtime.agreement import StructureMismatch, agree_sizes, check_ranks_agree, collective_entries

    torch.set_num_threads(1)
    front, module, inputs = _ep_front(rank)
    gm, feeds = front.gm, rank_feeds(front, module, inputs)[rank]

    def run(module):
        with torch.no_grad():
            return [t.detach() for t in module(*[t.clone() for t in feeds])]

    out = {"alone": {p: collective_entries(fxsched.schedule(gm, p).graph_module) for p in pipelines},
           "agreed": {}, "fingerprints": {}, "outputs": [run(gm)]}
    for p in pipelines:
        done = fxsched.schedule(gm, p, group="world")
        out["agreed"][p] = collective_entries(done.graph_module)
        out["fingerprints"][p] = check_ranks_agree(done.graph_module)
        out["outputs"].append(run(done.graph_module))
    capped = fxsched.schedule(gm, "default", group="world", max_peak_increase_gb=0.0)
    own = lower(gm)
    own.schedule = Schedule(list(capped.program.schedule))
    out["peak"] = (simulate(own, costs=op_costs(own)).peak_bytes, capped.report["gap"]["cap_bytes"])
    dropin = fxsched.overlap_param_gather(gm, fxsched.PassConfig(), group="world")  # in place
    out["agreed"]["drop-in"] = collective_entries(dropin)
    out["fingerprints"]["drop-in"] = check_ranks_agree(dropin)
    out["outputs"].append(run(dropin))
    if rank == 1:
        relu = next(n for n in gm.graph.nodes if n.target is aten.relu.default)
        relu.target = aten.sigmoid.default
    try:
        fxsched.schedule(gm, "default", group="world")
        out["mismatch"] = None
    except StructureMismatch as exc:
        out["mismatch"] = (str(exc), exc.ranks, exc.expected, exc.found)
    size = 8 * (rank + 1)  # a gather of 8 elements on rank 0 and 16 on rank 1 (IR text)
    gather = parse_program(f"""%w = input : f32[4]
^entry
%g = launch "_c10d_functional.all_gather_into_tensor.default"(%w) {{group = "0", role = fsdp_all_gather, nbytes = {4 * size}, params = ["w"]}} : f32[{size}]
%t = wait(%g) : f32[{size}]
%output = output(%t)
""")
    try:
        agree_sizes(gather, "world")
        out["sized"] = None
    except RuntimeError as exc:
        out["sized"] = str(exc)
    return out


@pytest.mark.multirank
def test_graphs_that_differ_per_rank_in_sizes_get_one_schedule_with_a_group_and_compute_the_same():
    """`schedule(gm, pipeline, group=...)`: every rank of the group lowers its graph, the programs
    are checked to be equal but for sizes, and each size becomes its largest over the ranks
    (`runtime.agreement.agree_sizes`; 42 ops of the EP graph differ), so the cost-guided passes see
    one program. On 2 gloo ranks, the EP graphs whose `default` schedules differ alone (19 of 71
    collectives) get one collective order under every pipeline and the drop-in
    (`check_ranks_agree` passes), and each rank's scheduled graph computes what its traced graph
    does, bitwise. A peak cap holds on each rank's own sizes (the cap at the input's peak is the
    largest rank's: rank 1's own peak in that order is 21.39 MB, its input's 21.24, the cap 23.59).
    Where the graphs differ in more than sizes the error says so on every rank, naming the op; so
    does a gather of other sizes on the ranks (they could not run it together)."""
    from fxsched.runtime import run_ranks
    from fxsched.runtime.agreement import compare_entries

    pipelines = ("reference", "default", "rewrite")
    results = run_ranks(_ep_agree, 2, args=(pipelines,), group_name="ep", timeout=1200)
    alone = compare_entries([r["alone"]["default"] for r in results])
    assert alone is not None and alone.index == 36  # without the group: the known gap
    for p in (*pipelines, "drop-in"):
        assert compare_entries([r["agreed"][p] for r in results]) is None, p
        assert results[0]["fingerprints"][p] == results[1]["fingerprints"][p], p
    for rank, r in enumerate(results):
        expected, *scheduled = r["outputs"]
        for p, got in zip((*pipelines, "drop-in"), scheduled, strict=True):
            assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(expected, got)), (rank, p)
        peak, cap = r["peak"]
        assert cap == results[0]["peak"][1] and peak <= cap, (rank, peak, cap)
    assert not torch.equal(results[0]["outputs"][0][0], results[1]["outputs"][0][0])  # the ranks' data differ
    for r in results:
        message, ranks, expected, found = r["mismatch"]
        assert ranks == [1] and "aten.relu.default" in expected and "aten.sigmoid.default" in found
        assert "differ in more than sizes" in message and "rank 1: %relu" in message, message
        assert "%g (_c10d_functional.all_gather_into_tensor.default" in r["sized"]
        assert "other sizes on the ranks" in r["sized"] and "f32[16]" in r["sized"]


# --------------------------------------------------------------------------- the functional collectives' autograd namespace

_AUTOGRAD = torch.ops._c10d_functional_autograd


def _autograd_collective_graph(op: str):
    """make_fx with `pre_dispatch=True` (torch.export's training IR keeps the same level) of code
    calling funcol's `*_autograd` collectives (torchtitan's expert parallelism calls
    `all_to_all_single_autograd`): `_c10d_functional_autograd::<op>` launches, a `wait_tensor`
    completes it. Around it: an all-reduce of the group before and after, and a write of the
    collective's input after its wait."""
    from torch.fx.experimental.proxy_tensor import make_fx

    call = {"all_to_all_single": lambda x: _AUTOGRAD.all_to_all_single.default(x, [2, 2], [2, 2], "0"),
            "all_gather_into_tensor": lambda x: _AUTOGRAD.all_gather_into_tensor.default(x, 2, "0"),
            "reduce_scatter_tensor": lambda x: _AUTOGRAD.reduce_scatter_tensor.default(x, "sum", 2, "0")}[op]

    def f(x, y):
        first = c10d.wait_tensor.default(c10d.all_reduce.default(y, "sum", "0"))
        got = c10d.wait_tensor.default(call(x))
        x.add_(1)
        last = c10d.wait_tensor.default(c10d.all_reduce.default(y * 2, "sum", "0"))
        return first, got * 1, last, x * 3, torch.sin(torch.ones(3))

    return make_fx(f, pre_dispatch=True, tracing_mode="fake")(torch.randn(4), torch.randn(4))


@pytest.mark.parametrize("op", ["all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor"])
def test_the_functional_collectives_autograd_forms_are_collectives(op):
    """`_c10d_functional_autograd::all_to_all_single` (and its all_gather_into_tensor and
    reduce_scatter_tensor) was plain compute: pure, in no collective order, its wait a wait on no
    launch, and missing from the ranks' agreement check. So a legal order could write its input
    between it and its wait, while the communication library still reads it (all_to_all_single:
    126 of 210 legal orders did; the input graph never races), or move it across the group's
    all-reduces. Now it is a launch of its group, waited by its wait, as its `_c10d_functional`
    twin is."""
    from fxsched.runtime.agreement import collective_entries

    gm = _autograd_collective_graph(op)
    program = lower(gm)
    launch = next(n for n in program.schedule.names() if op in n)
    assert isinstance(program.op(launch), Launch) and program.op(launch).group == "0"
    wait = next(iter(program.successors[launch]))
    assert isinstance(program.op(wait), Wait) and program.op(wait).launched_by == launch
    assert [e["kind"].split(".")[1] for e in collective_entries(gm)] == ["all_reduce", op, "all_reduce"]
    write = next(n for n in program.schedule.names() if n.startswith("add_"))
    orders = list(itertools.islice(nx.all_topological_sorts(program.graph), 400))
    assert len(orders) > 10
    for order in orders:
        at = {n: i for i, n in enumerate(order)}
        assert at[wait] < at[write], f"{write} writes the input of {launch} before its wait: {order}"
        reduces = sorted(at[n] for n in order if n.startswith("all_reduce"))
        assert reduces[0] < at[launch] < reduces[1]


def test_two_groups_named_otherwise_on_each_rank_get_the_same_schedule():
    """On a 2-D mesh each rank's FSDP and TP groups have names of their own, and their order as
    strings may differ from rank to rank (`dp="a"`, `tp="b"` on one, `"d"`, `"c"` on another). The
    TP/SP + FSDP step above, traced with each pair of names, is scheduled alike by each pipeline:
    the same node order, the same collectives once the names are mapped (nothing found: this pins
    it; tests/test_determinism.py renames one group)."""
    from fxsched.front import fsdp_joint_graph
    from fxsched.runtime.agreement import collective_entries

    def graph(dp, tp, monkey):
        monkey.setattr(sys.modules[__name__], "TP", tp)
        torch.manual_seed(0)
        return fsdp_joint_graph(_TwoBlocks(), [torch.randn(3, 8)], lambda m, x: (m(x) ** 2).sum(), 2,
                                group_name=dp).gm

    with pytest.MonkeyPatch.context() as monkey:
        ab, dc = graph("a", "b", monkey), graph("d", "c", monkey)
    rename = {"d": "a", "c": "b"}
    assert {e["group"] for e in collective_entries(dc)} == {"d", "c"}
    for pipeline in ("default", "rewrite", "unorder-reduce-scatters,gradients-first,default"):
        one, other = fxsched.schedule(ab, pipeline).graph_module, fxsched.schedule(dc, pipeline).graph_module
        assert [n.name for n in one.graph.nodes] == [n.name for n in other.graph.nodes]
        assert ([(e["kind"], e["group"]) for e in collective_entries(one)]
                == [(e["kind"], rename[e["group"]]) for e in collective_entries(other)])


# --------------------------------------------------------------------------- context parallelism's ring beside FSDP


class _RingStep(torch.autograd.Function):
    """One ring step of context parallelism: receive the previous rank's block, send ours to the
    next; backward sends the block's gradient back the other way."""

    @staticmethod
    def forward(ctx, x, nxt, prev):
        ctx.peers = (nxt, prev)
        recv = c10d.irecv.default(torch.empty_like(x), prev, 0, "cp")
        send = c10d.isend.default(x, nxt, 0, "cp")
        got = c10d.wait_tensor.default(recv)
        c10d.wait_tensor.default(send)
        return got

    @staticmethod
    def backward(ctx, g):
        nxt, prev = ctx.peers
        recv = c10d.irecv.default(torch.empty_like(g), nxt, 1, "cp")
        send = c10d.isend.default(g.contiguous(), prev, 1, "cp")
        got = c10d.wait_tensor.default(recv)
        c10d.wait_tensor.default(send)
        return got, None, None


class _RingAttention(torch.nn.Module):
    def __init__(self, rank, width=8):
        super().__init__()
        self.q, self.kv, self.o = (torch.nn.Linear(width, width) for _ in range(3))
        self.peers = ((rank + 1) % 2, (rank - 1) % 2)

    def forward(self, x):
        q, kv = self.q(x), self.kv(x)
        other = _RingStep.apply(kv, *self.peers)
        return self.o(torch.softmax(q @ kv.T, -1) @ kv + torch.softmax(q @ other.T, -1) @ other) + x


def _cp_front(rank):
    from fxsched.front import fsdp_joint_graph

    torch.manual_seed(0)
    module = torch.nn.Sequential(_RingAttention(rank), _RingAttention(rank))
    inputs = [torch.randn(3, 8)]
    return fsdp_joint_graph(module, inputs, lambda m, x: (m(x) ** 2).sum(), 2, group_name=DP), module, inputs


def _cp_build(rank, world_size):
    return _cp_front(rank)[0].gm


def _cp_feeds(rank):
    from ranks import rank_feeds

    front, module, inputs = _cp_front(rank)
    return rank_feeds(front, module, inputs)[rank]


@pytest.mark.multirank
def test_a_ring_exchange_beside_fsdp_in_legal_orders_and_pipelines_is_bitwise_without_a_hang_on_two_ranks():
    """Context parallelism's ring step (irecv from the previous rank, isend to the next, forward and
    backward) in each of two attention layers whose parameters fxsched's front shards over FSDP:
    each rank traces its own graph (its peers), the same shape. 30 random legal orders (the same
    names on both ranks) and every pipeline compute the traced step bitwise on 2 gloo ranks, and
    none hangs. Without `p2p-order` each of the 30 orders put some wait of the 8 sends and receives
    above a send or receive traced before it (the orders that hung in the ring test above)."""
    from fxsched.runtime import run_ranks

    pipelines = (*PIPELINES, "unorder-reduce-scatters,gradients-first,default")
    orders = _legal_orders(lower(_cp_build(0, 2)), most=0)
    results = run_ranks(_run_orders, 2, args=(_cp_build, (DP, "cp"), orders, pipelines, _cp_feeds), timeout=1200)
    _check(results, orders, pipelines)


# --------------------------------------------------------------------------- symmetric memory (async tensor parallelism)


def _symm_mem_graph(kind: str):
    """A TP all-reduce, then a symmetric-memory collective of the same group (Inductor's async-TP
    pass fuses all-gather + matmul into `symm_mem::fused_all_gather_matmul`, matmul +
    reduce-scatter into `fused_matmul_reduce_scatter`; `two_shot_all_reduce_` is one a user calls),
    then another all-reduce of the group on something the middle one does not read."""
    import operator

    import torch.distributed._symmetric_memory  # noqa: F401  (registers symm_mem::)

    symm = torch.ops.symm_mem
    g = fx.Graph()
    a, b, y = g.placeholder("a"), g.placeholder("b"), g.placeholder("y")
    first = g.call_function(c10d.wait_tensor.default, (g.call_function(c10d.all_reduce.default, (y, "sum", "tp")),))
    if kind == "fused_all_gather_matmul":
        r = g.call_function(symm.fused_all_gather_matmul.default, (a, [b], 0, "tp"))
        out = g.call_function(operator.getitem, (g.call_function(operator.getitem, (r, 1)), 0))
    elif kind == "fused_matmul_reduce_scatter":
        out = g.call_function(symm.fused_matmul_reduce_scatter.default, (a, b, "sum", 0, "tp"))
    else:
        out = g.call_function(symm.two_shot_all_reduce_.default, (a, "sum", "tp"))
    last = g.call_function(c10d.all_reduce.default, (g.call_function(aten.mul.Tensor, (y, 2)), "sum", "tp"))
    g.output((first, g.call_function(aten.mul.Tensor, (out, 1)), g.call_function(c10d.wait_tensor.default, (last,))))
    return fx.GraphModule(torch.nn.Module(), g)


@pytest.mark.parametrize("kind", ["fused_all_gather_matmul", "fused_matmul_reduce_scatter", "two_shot_all_reduce_"])
def test_symmetric_memory_collectives_are_synchronous_collectives_of_their_group(kind):
    """`symm_mem::*` collectives (async TP's fused all-gather-matmul and matmul-reduce-scatter,
    symmetric-memory all-reduces, all-to-alls) take a `group_name` and complete when called, as
    `_dtensor::shard_dim_alltoall` does. They were compute (`two_shot_all_reduce_`: a write of its
    input): in no collective order (of the 3 legal orders of the three collectives, 2 moved it
    across the group's all-reduces) and missing from the ranks' agreement check. Each is an opaque
    collective of its group now (`SYNCHRONOUS_COLLECTIVES`). (They need CUDA: structure only.)"""
    from fxsched.ir import Opaque
    from fxsched.runtime.agreement import collective_entries

    gm = _symm_mem_graph(kind)
    program = lower(gm)
    op = program.op(f"{kind}_default")
    assert isinstance(op, Opaque) and op.group == "tp" and op.reason == "synchronous collective"
    order = {(u, v) for u, v, e in program.graph.edges(data=True) if e.get("why") == "collective-order"}
    assert order == {("all_reduce_default", op.name), (op.name, "all_reduce_default_1")}
    assert [e["kind"].split(".")[1] for e in collective_entries(gm)] == ["all_reduce", kind, "all_reduce"]


#: torch-npu's fused matmul-communication ops (Ascend's async TP), registered by name and schema as
#: torch-npu registers them (torch-npu itself is never imported); their group is an HCCL comm name
_NPU = torch.library.Library("npu", "FRAGMENT")
for _schema, _impl in [
    ("npu_mm_all_reduce_base(Tensor x1, Tensor x2, str hcom, *, str reduce_op='sum', Tensor? bias=None, "
     "int comm_turn=0) -> Tensor", lambda x1, x2, hcom, **kw: x1 @ x2),
    ("npu_all_gather_base_mm(Tensor x1, Tensor x2, str hcom, int world_size, *, Tensor? bias=None, "
     "int gather_index=0, bool gather_output=True, int comm_turn=0) -> (Tensor, Tensor)",
     lambda x1, x2, hcom, world_size, **kw: (x1 @ x2, x1.clone())),
    ("npu_mm_reduce_scatter_base(Tensor x1, Tensor x2, str hcom, int world_size, *, str reduce_op='sum', "
     "Tensor? bias=None, int comm_turn=0) -> Tensor", lambda x1, x2, hcom, world_size, **kw: x1 @ x2),
]:
    _NPU.define(_schema.replace("'", '"'))
    _NPU.impl(_schema.split("(")[0], _impl, "CompositeExplicitAutograd")


@pytest.mark.parametrize("kind", ["npu_mm_all_reduce_base", "npu_all_gather_base_mm", "npu_mm_reduce_scatter_base"])
def test_ascends_fused_matmul_communication_ops_are_synchronous_collectives(kind):
    """torch-npu's `npu_mm_all_reduce_base`, `npu_all_gather_base_mm`, `npu_mm_reduce_scatter_base`
    (TP's matmul fused with its collective on Ascend) were compute: in no collective order and
    missing from the ranks' agreement check, as symm_mem's. They are synchronous collectives now;
    their group (`hcom`, an HCCL comm name, not a `group_name`) is read as unknown, so each keeps
    its order with every group's collectives."""
    import operator

    from fxsched.ir import Opaque
    from fxsched.runtime.agreement import collective_entries

    npu = torch.ops.npu
    g = fx.Graph()
    a, b, y = g.placeholder("a"), g.placeholder("b"), g.placeholder("y")
    first = g.call_function(c10d.wait_tensor.default, (g.call_function(c10d.all_reduce.default, (y, "sum", "tp")),))
    args = (a, b, "hccl_tp") if kind == "npu_mm_all_reduce_base" else (a, b, "hccl_tp", 2)
    out = g.call_function(getattr(npu, kind).default, args)
    if kind == "npu_all_gather_base_mm":
        out = g.call_function(operator.getitem, (out, 0))
    last = g.call_function(c10d.all_reduce.default, (g.call_function(aten.mul.Tensor, (y, 2)), "sum", "tp"))
    g.output((first, g.call_function(aten.mul.Tensor, (out, 1)), g.call_function(c10d.wait_tensor.default, (last,))))
    gm = fx.GraphModule(torch.nn.Module(), g)
    program = lower(gm)
    op = program.op(f"{kind}_default")
    assert isinstance(op, Opaque) and op.reason == "synchronous collective"
    order = {(u, v) for u, v, e in program.graph.edges(data=True) if e.get("why") == "collective-order"}
    assert order == {("all_reduce_default", op.name), (op.name, "all_reduce_default_1")}
    assert [e["kind"].split(".")[1] for e in collective_entries(gm)] == ["all_reduce", kind, "all_reduce"]
