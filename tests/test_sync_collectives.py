"""Collectives outside the functional namespaces that complete when called (no wait):
`_dtensor::shard_dim_alltoall`, DTensor's Shard(i) -> Shard(j) redistribution. Read as compute,
it kept only its data order: a pass could move it across another collective of its group on one
rank's graph and not another's (the order of a group's collectives is what every rank must share),
and the ranks' agreement check did not list it. It is an opaque collective of its group now. (gloo
has no all-to-all, and DTensor's CPU path gathers instead: these check structure, not numbers.)"""

from __future__ import annotations

import torch
import torch.distributed.tensor  # noqa: F401  (registers the _dtensor ops)
from torch import fx

import fxsched
from fxsched.ir import Opaque
from fxsched.lowering import lower
from fxsched.runtime.agreement import collective_entries

c10d = torch.ops._c10d_functional
A2A = torch.ops._dtensor.shard_dim_alltoall.default


def _graph(a2a_group: str) -> fx.GraphModule:
    """all_reduce(x) on g0, then an all-to-all of y on `a2a_group`, then an all_reduce on g0 of
    something computed from y alone: nothing but the collective order ties the three together."""
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    first = g.call_function(c10d.wait_tensor.default, (g.call_function(c10d.all_reduce.default, (x, "sum", "g0")),))
    moved = g.call_function(A2A, (y, 0, 1, a2a_group))
    last = g.call_function(c10d.all_reduce.default, (g.call_function(torch.ops.aten.mul.Tensor, (y, 2)), "sum", "g0"))
    g.output((first, g.call_function(torch.ops.aten.add.Tensor, (moved, 1)), g.call_function(c10d.wait_tensor.default, (last,))))
    return fx.GraphModule(torch.nn.Module(), g)


def _collective_order(program) -> set[tuple[str, str]]:
    return {(u, v) for u, v, e in program.graph.edges(data=True) if e.get("why") == "collective-order"}


def test_an_all_to_all_is_an_opaque_collective_of_its_group():
    program = lower(_graph("g0"))
    op = program.op("shard_dim_alltoall_default")
    assert isinstance(op, Opaque) and op.group == "g0" and op.reason == "synchronous collective"
    assert _collective_order(program) == {("all_reduce_default", "shard_dim_alltoall_default"),
                                          ("shard_dim_alltoall_default", "all_reduce_default_1")}


def test_an_all_to_all_of_another_group_is_not_ordered_with_this_ones():
    program = lower(_graph("g1"))
    assert program.op("shard_dim_alltoall_default").group == "g1"
    assert _collective_order(program) == {("all_reduce_default", "all_reduce_default_1")}


def test_the_ranks_agreement_lists_it_where_every_pipeline_keeps_it():
    gm = _graph("g0")
    kinds = ["_c10d_functional.all_reduce.default", "_dtensor.shard_dim_alltoall.default",
             "_c10d_functional.all_reduce.default"]
    assert [e["kind"] for e in collective_entries(gm)] == kinds
    assert [e["kind"] for e in collective_entries(lower(gm))] == kinds
    for pipeline in ("reference", "default", "rewrite"):
        assert [e["kind"] for e in collective_entries(fxsched.schedule(gm, pipeline).graph_module)] == kinds
