"""gloo runners: results in rank order, failing/dying/hanging ranks reported (never a hang), graph execution."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives  # noqa: F401
from torch.fx.experimental.proxy_tensor import make_fx

from fxsched.runtime import RankFailure, graph_group_names, run_graph, run_graph_single, run_ranks

_c10d = torch.ops._c10d_functional


def _report(rank, world_size, scale):
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    gloo = dist.group.WORLD._get_backend(torch.device("cpu"))
    return {"rank": rank, "world_size": world_size, "total": total * scale, "threads": torch.get_num_threads(),
            "gloo_threads": gloo.options._threads}


def _raise_on_rank1(rank, world_size):
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # rank 0 would wait here forever without the runner killing it
    return rank


def _die_on_rank1(rank, world_size):
    if rank == 1:
        os._exit(7)
    dist.barrier()
    return rank


def _hang_on_rank1(rank, world_size):
    if rank == 1:
        time.sleep(3600)
    return rank


def _gathers_in_flight(rank, world_size, rounds, depth):
    """Launch ``depth`` functional all-gathers, compute, then wait for them all; ``rounds`` times."""
    sizes = (16, 48, 544, 1024, 7)
    shards = [torch.arange(n, dtype=torch.float32) + 1000 * rank for n in sizes]
    expected = [torch.cat([torch.arange(n, dtype=torch.float32) + 1000 * r for r in range(world_size)])
                for n in sizes]
    wrong = 0
    for _ in range(rounds):
        launched = [_c10d.all_gather_into_tensor(shards[i % len(sizes)], world_size, "0") for i in range(depth)]
        torch.randn(64, 64) @ torch.randn(64, 64)
        for i, out in enumerate(launched):
            wrong += not torch.equal(_c10d.wait_tensor(out), expected[i % len(sizes)])
    return wrong


def _gather_graph(world_size: int, group_name: str = "0"):
    def f(x):
        g = _c10d.wait_tensor(_c10d.all_gather_into_tensor(x, world_size, group_name))
        return (g * 2, x + 1)

    return make_fx(f, tracing_mode="fake")(torch.zeros(3))


@pytest.mark.multirank
def test_results_come_back_in_rank_order():
    results = run_ranks(_report, 2, args=(10.0,))
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world_size"] == 2 for r in results)
    assert all(torch.equal(r["total"], torch.tensor([30.0])) for r in results)
    assert all(r["threads"] == 1 for r in results)
    assert all(r["gloo_threads"] == 1 for r in results)  # see test_ranks_keep_functional_all_gathers_in_flight


@pytest.mark.multirank
def test_ranks_keep_functional_all_gathers_in_flight():
    # with gloo's default two worker threads this corrupted the heap and killed a rank in 5 runs
    # of 5 (torch 2.13); init_gloo gives one thread
    assert run_ranks(_gathers_in_flight, 2, args=(2000, 4)) == [0, 0]


@pytest.mark.multirank
def test_raising_rank_is_named_with_its_traceback():
    with pytest.raises(RankFailure) as info:
        run_ranks(_raise_on_rank1, 2)
    assert info.value.rank == 1
    assert "ValueError: boom on purpose" in info.value.details
    assert "rank 1" in str(info.value)


@pytest.mark.multirank
def test_dying_rank_is_named():
    with pytest.raises(RankFailure) as info:
        run_ranks(_die_on_rank1, 2)
    assert info.value.rank == 1 and info.value.exitcode == 7


@pytest.mark.multirank
def test_hanging_rank_hits_the_timeout():
    # The timeout counts from when both ranks are in the group, so start-up time is not in it.
    with pytest.raises(RankFailure, match=r"timed out after 3 s; ranks still running: \[1\]") as info:
        run_ranks(_hang_on_rank1, 2, timeout=3.0)
    assert info.value.rank == 1


@pytest.mark.multirank
def test_run_graph_two_ranks():
    gm = _gather_graph(2)
    inputs = [[torch.full((3,), 1.0)], [torch.full((3,), 5.0)]]
    out = run_graph(gm, inputs)
    gathered = torch.tensor([2.0] * 3 + [10.0] * 3)
    assert torch.equal(out[0][0], gathered) and torch.equal(out[1][0], gathered)
    assert torch.equal(out[0][1], torch.full((3,), 2.0))
    assert torch.equal(out[1][1], torch.full((3,), 6.0))


@pytest.mark.parametrize("group_name", ["0", "fsdp"])
def test_run_graph_single_in_process(group_name):
    gm = _gather_graph(1, group_name)
    out = run_graph_single(gm, [torch.arange(3.0)])
    assert torch.equal(out[0], torch.arange(3.0) * 2)
    assert not dist.is_initialized()  # the group it made is gone


def test_run_graph_single_rejects_bigger_worlds():
    with pytest.raises(ValueError, match="size 2"):
        run_graph_single(_gather_graph(2), [torch.zeros(3)])


def test_graph_group_names():
    assert graph_group_names(_gather_graph(2, "fsdp")) == {"fsdp": 2}


def test_run_ranks_rejects_bad_world_size():
    with pytest.raises(ValueError, match="world_size"):
        run_ranks(_report, 0)


def _draws_per_call(rank, world_size, gm):
    """Each call from the same seed; and what `torch.rand` draws from that seed."""
    calls = []
    for _ in range(2):
        torch.manual_seed(rank)
        calls.append(gm(torch.zeros(4)))
    torch.manual_seed(rank)
    return calls, torch.rand(4)


def _rand_and_buffer_graph():
    """x + rand([4]) and a buffer from `empty` filled in place: calls on no input, which a
    re-trace of the code (torch's way of loading a pickled GraphModule) would run once, at load."""
    from torch import fx, nn

    aten = torch.ops.aten
    g = fx.Graph()
    x = g.placeholder("x")
    drawn = g.call_function(aten.rand.default, ([4],), {"device": torch.device("cpu")})
    buffer = g.call_function(aten.empty.memory_format, ([4],), {"dtype": torch.float32, "device": torch.device("cpu")})
    g.call_function(aten.fill_.Scalar, (buffer, 3.0))
    g.output((g.call_function(aten.add.Tensor, (x, drawn)), buffer))
    return fx.GraphModule(nn.Module(), g)


@pytest.mark.multirank
def test_ranks_run_a_graphs_code_as_it_is():
    """A GraphModule sent to the ranks draws per call, as the caller's does, and each call makes
    its own buffer: before, every rank re-traced the code, which drew once at load."""
    for rank, (calls, expected) in enumerate(run_ranks(_draws_per_call, 2, args=(_rand_and_buffer_graph(),))):
        (first, first_buffer), (second, second_buffer) = calls
        assert torch.equal(first, expected) and torch.equal(second, expected), f"rank {rank}"
        assert first_buffer.data_ptr() != second_buffer.data_ptr()
