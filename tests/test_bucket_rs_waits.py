"""A reduce-scatter bucket whose members were waited early: bucket's wait placement on FX graphs
and on gloo ranks.

`overlap-reduce-scatter` waits each gradient reduce-scatter as soon as its collective ends, so a
member is often waited before the last member launches. `bucket` then waits the bucket where the
first member was waited after the bucket's launch (where its last member launched); these tests
feed it such an order as a hand-built FX graph and check that the bucket computes what the three
reduce-scatters did, bitwise on 2 gloo ranks.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import fxsched
from fxsched.ir import tags

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
RS = c10d.reduce_scatter_tensor.default
WAIT = c10d.wait_tensor.default
N = 4096


def early_waited_reduce_scatters() -> fx.GraphModule:
    """Three gradients reduce-scattered in the backward: rs1, (d2), wait rs1, rs2, (d3), rs3, wait
    rs2, wait rs3 — the first wait comes before the last launch."""
    g = fx.Graph()
    x, grad = g.placeholder("x"), g.placeholder("grad")
    y = g.call_function(aten.relu.default, (x,))

    def backward(node):
        node.meta[tags.AUTOGRAD_BACKWARD] = True
        return node

    def reduce_scatter(d, name):
        rs = backward(g.call_function(RS, (d, "sum", 2, "0")))
        rs.meta.update({tags.COMM_TYPE: tags.REDUCE_SCATTER, tags.PARAM_NAME: name})
        return rs

    d1 = backward(g.call_function(aten.mul.Tensor, (grad, y)))
    rs1 = reduce_scatter(d1, "p1")
    d2 = backward(g.call_function(aten.mul.Tensor, (d1, y)))
    s1 = backward(g.call_function(WAIT, (rs1,)))
    rs2 = reduce_scatter(d2, "p2")
    d3 = backward(g.call_function(aten.mul.Tensor, (d2, y)))
    rs3 = reduce_scatter(d3, "p3")
    s2 = backward(g.call_function(WAIT, (rs2,)))
    s3 = backward(g.call_function(WAIT, (rs3,)))
    g.output((s1, s2, s3))
    gm = fx.GraphModule(nn.Module(), g)
    with FakeTensorMode() as mode:  # shapes and dtypes on every node, as a traced graph has them
        FakeTensorProp(gm, mode).propagate(torch.empty(N), torch.empty(N))
    return gm


PIPELINE = "bucket{gathers=false,max-peak-increase-gb=1.0}"


def _bucketed():
    gm = early_waited_reduce_scatters()
    done = fxsched.schedule(gm, PIPELINE)
    stats = next(v for k, v in done.result.stats().items() if k.startswith("bucket"))
    return gm, done, stats


def test_a_bucket_of_early_waited_reduce_scatters_waits_after_its_launch():
    gm, done, stats = _bucketed()
    assert stats["reduce-scatters bucketed"] == 3 and stats["buckets"] == 1
    nodes = list(done.graph_module.graph.nodes)
    launches = [n for n in nodes if n.target is RS]
    waits = [n for n in nodes if n.target is WAIT]
    assert len(launches) == 1 and len(waits) == 1
    assert nodes.index(launches[0]) < nodes.index(waits[0])
    # every gradient is computed before the one launch that reads them all
    muls = [n for n in nodes if n.target is aten.mul.Tensor]
    assert all(nodes.index(m) < nodes.index(launches[0]) for m in muls)
    done.graph_module.graph.lint()


@pytest.mark.multirank
def test_a_bucket_of_early_waited_reduce_scatters_is_bitwise_equal_on_two_ranks():
    from fxsched.runtime import run_ranks
    from ranks import check_bitwise, run_all

    gm, done, stats = _bucketed()
    assert stats["reduce-scatters bucketed"] == 3
    feeds = []
    for r in range(2):
        gen = torch.Generator().manual_seed(20 + r)
        feeds.append([torch.randn(N, generator=gen), torch.randn(N, generator=gen)])
    results = run_ranks(run_all, 2, args=([(gm, feeds), (done.graph_module, feeds)],), group_name="0")
    check_bitwise(results, ["early-waited reduce-scatters"], "the bucketed graph")
