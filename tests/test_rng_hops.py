"""Higher-order ops that draw from the RNG keep their order with the other random ops.

Activation checkpointing with functionalized RNG puts `run_and_save_rng_state(op, ...)` in the
forward: it returns the global RNG state and runs its random op on it, advancing the state; the
backward replays the op with `run_with_rng_state(state, op, ...)`, which sets the given state and
puts the global one back. The first has no schema and no tags, so lowering read it as plain
compute: `fill-waits` then moved a later `aten.rand_like` ahead of it, and both drew other numbers
than in the input. Lowering now names it (and `graphsafe_run_with_rng_state`, which advances a
generator it is given) random; `run_with_rng_state` draws from no shared state and stays free.
Likewise a higher-order op given a subgraph that draws (`invoke_subgraph` with a dropout inside).
"""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx, nn
from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import fxsched
from fxsched.ir import Compute
from fxsched.ir import tags
from fxsched.lowering import lower

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
AG = c10d.all_gather_into_tensor.default
WAIT = c10d.wait_tensor.default
ROWS, COLS = 256, 512


def test_lowering_reads_run_and_save_rng_state_as_random_and_run_with_rng_state_as_not():
    def f(x):
        state, y = run_and_save_rng_state(aten.rand.default, [4], device=torch.device("cpu"))
        z = torch.rand(4)
        again = run_with_rng_state(state, aten.rand.default, [4], device=torch.device("cpu"))
        return x + y + z + again

    program = lower(make_fx(f)(torch.ones(4)))
    random = {op.name: op.random for op in program.ops() if isinstance(op, Compute)}
    assert random["run_and_save_rng_state"] and random["rand"] and not random["run_with_rng_state"]
    assert program.graph.has_edge("run_and_save_rng_state", "rand")  # rng-order


@pytest.mark.parametrize("draws", [True, False])
def test_a_higher_order_op_whose_subgraph_draws_is_random(draws):
    """`invoke_subgraph` (a nested compile region) with a dropout inside draws from the RNG as the
    dropout does; with none, it is plain compute."""
    from torch._higher_order_ops.invoke_subgraph import invoke_subgraph

    def body(x):
        return (torch.nn.functional.dropout(x, 0.5, True) if draws else x.sin(),)

    sub = make_fx(body)(torch.ones(4))

    def f(x):
        return invoke_subgraph(sub, "sub0", x)[0] + torch.rand_like(x)

    program = lower(make_fx(f)(torch.ones(4)))
    assert program.op("invoke_subgraph").random is draws
    assert program.graph.has_edge("invoke_subgraph", "rand_like") is draws  # rng-order


def saved_state_then_rand() -> fx.GraphModule:
    """all-gather w (exposed: nothing before it); m = x @ w; run_and_save_rng_state(rand_like, m),
    which waits for m; then rand_like(x), which needs only an input: ready at the wait, where
    fill-waits looks for compute to move up."""
    g = fx.Graph()
    x, s = g.placeholder("x"), g.placeholder("s")
    ag = g.call_function(AG, (s, 2, "0"))
    ag.meta.update({tags.COMM_TYPE: tags.ALL_GATHER, tags.PARAM_NAME: "p", tags.UNSHARDED_NBYTES: 2 * ROWS * COLS * 4})
    m = g.call_function(aten.mm.default, (x, g.call_function(WAIT, (ag,))))
    saved = g.call_function(run_and_save_rng_state, (aten.rand_like.default, m))
    drawn = g.call_function(operator.getitem, (saved, 1))
    z = g.call_function(aten.rand_like.default, (x,))  # of an input (not of a size: a module sent
    # to a rank is traced again from its code, where a call on no proxy runs once, to a constant)
    g.output((g.call_function(aten.add.Tensor, (m, drawn)), z))
    gm = fx.GraphModule(nn.Module(), g)
    with FakeTensorMode() as mode:
        FakeTensorProp(gm, mode).propagate(torch.empty(COLS, 2 * ROWS), torch.empty(ROWS, COLS))
    return gm


def _order(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.target in (run_and_save_rng_state, aten.rand_like.default)]


def test_fill_waits_keeps_a_rand_after_run_and_save_rng_state():
    gm = saved_state_then_rand()
    done = fxsched.schedule(gm, "fill-waits")
    assert _order(done.graph_module) == [run_and_save_rng_state, aten.rand_like.default]
    done.graph_module.graph.lint()


def run_seeded(rank, world_size, jobs):
    """Each graph from the same RNG state (ranks.run_all seeds once, for graphs without RNG)."""
    out = []
    for gm, feeds in jobs:
        torch.manual_seed(0)
        with torch.no_grad():
            out.append([t.detach() for t in gm(*[t.clone() for t in feeds[rank]])])
    return out


@pytest.mark.multirank
def test_fill_waits_around_run_and_save_rng_state_is_bitwise_equal_on_two_ranks():
    from fxsched.runtime import run_ranks
    from ranks import check_bitwise

    gm = saved_state_then_rand()
    done = fxsched.schedule(gm, "fill-waits")
    feeds = []
    for r in range(2):
        gen = torch.Generator().manual_seed(40 + r)
        feeds.append([torch.randn(COLS, 2 * ROWS, generator=gen), torch.randn(ROWS, COLS, generator=gen)])
    results = run_ranks(run_seeded, 2, args=([(gm, feeds), (done.graph_module, feeds)],), group_name="0")
    check_bitwise(results, ["run_and_save_rng_state then rand"], "the fill-waits graph")
