"""The `unordered` mark survives raising: raising tags each reduce-scatter marked `unordered`
(`tags.UNORDERED`) on its raised node, whichever way it raises (a fresh module, in place, the
torch.compile pass), and lowering reads the tag back into `Launch.unordered` where the op may be
unordered, so scheduling a raised graph again keeps the freedom its schedule assumed; a tag on
anything else is ignored with a note."""

from __future__ import annotations

import pytest
import torch
from torch import fx

import fxsched
from fxsched.front.generate import generate_graph, min_nodes
from fxsched.ir import Launch, tags, verify
from fxsched.lowering import lower
from fxsched.passes import PassManager
from fxsched.raising import raise_in_place

from ranks import check_bitwise, run_all

PIPELINE = "unorder-reduce-scatters,gradients-first,default"
OPTIONS = dict(seed=1, layers=2)
C10D = torch.ops._c10d_functional


def _generated() -> fx.GraphModule:
    return generate_graph(min_nodes(**OPTIONS) + 50, **OPTIONS)


def _order_edges(program) -> set[tuple[str, str, str, str]]:
    return {(u, v, e["kind"], e.get("why")) for u, v, e in program.graph.edges(data=True)
            if e.get("why") == "collective-order"}


def _unordered(program) -> set[str]:
    return {op.name for op in program.ops() if isinstance(op, Launch) and op.unordered}


def _tagged(gm: fx.GraphModule) -> set[str]:
    return {n.name for n in gm.graph.nodes if n.meta.get(tags.UNORDERED)}


def _reduce_scatters(program) -> list[str]:
    return [name for name in program.schedule if isinstance(op := program.op(name), Launch) and op.may_unorder]


def _small_graph() -> fx.GraphModule:
    """Three FSDP reduce-scatters of group "0" with an all-reduce of that group between the second
    and third (so the unordered ones have collective-order edges to it), all waited."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    outs = []
    for i, kind in enumerate(("rs", "rs", "ar", "rs")):
        if kind == "rs":
            launch = graph.call_function(C10D.reduce_scatter_tensor.default, (x, "sum", 2, "0"))
            launch.meta.update({tags.COMM_TYPE: tags.REDUCE_SCATTER, tags.PARAM_NAME: f"p{i}"})
        else:
            launch = graph.call_function(C10D.all_reduce.default, (x, "sum", "0"))
        launch.meta[tags.AUTOGRAD_BACKWARD] = True
        wait = graph.call_function(C10D.wait_tensor.default, (launch,))
        wait.meta[tags.AUTOGRAD_BACKWARD] = True
        outs.append(wait)
    graph.output(tuple(outs))
    return fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize("make", [_generated, _small_graph], ids=["generated", "small"])
def test_raised_graph_lowers_to_the_same_marks_and_collective_order(make):
    gm = make()
    first = lower(gm)
    PassManager("unorder-reduce-scatters").run(first)  # the first program right after the pass
    done = fxsched.schedule(gm, PIPELINE)
    marked = _unordered(done.program)
    assert marked and marked == _unordered(first) == set(_reduce_scatters(first))
    assert _tagged(done.graph_module) == marked  # the raised graph says what its schedule assumed
    again = lower(done.graph_module)
    verify(again)
    assert _unordered(again) == marked
    assert _order_edges(again) == _order_edges(first) == _order_edges(done.program)
    if make is _small_graph:  # the all-reduce keeps its place against each of them
        assert len(_order_edges(first)) == 3


def test_scheduling_the_raised_graph_again_keeps_the_freedom():
    raised = fxsched.schedule(_generated(), PIPELINE).graph_module
    twice = fxsched.schedule(raised, PIPELINE)
    n = len(_reduce_scatters(twice.program))
    assert twice.result.stats()["unorder-reduce-scatters"] == {
        "unordered": 0, "already unordered": n, "unknown group": 0, "changed": False}
    # so the pass is redundant on a raised graph: a pipeline without it (the CLI on a saved graph,
    # a second torch.compile pass) schedules it as the pipeline with it does, and both leave the
    # order as the first run raised it (a fixed point: gradients-first sweeps until no unordered
    # pair swaps, overlap-reduce-scatter keeps the order of launches hoisted to one slot)
    without = fxsched.schedule(raised, "gradients-first,default")
    assert without.result.stats()["gradients-first"]["swapped"] == 0
    order = [x.name for x in raised.graph.nodes]
    assert [x.name for x in without.graph_module.graph.nodes] == [x.name for x in twice.graph_module.graph.nodes] == order
    assert _tagged(without.graph_module) == _tagged(twice.graph_module) == _unordered(twice.program)


def test_a_tag_where_no_unordering_is_allowed_is_ignored_with_a_note():
    gm = _small_graph()
    ar = next(n for n in gm.graph.nodes if n.target is C10D.all_reduce.default)
    ar.meta[tags.UNORDERED] = True
    # a reduce-scatter without FSDP's comm_type is not FSDP's gradient reduction either
    rs = next(n for n in gm.graph.nodes if n.target is C10D.reduce_scatter_tensor.default)
    rs.meta.pop(tags.COMM_TYPE)
    rs.meta[tags.UNORDERED] = True
    program = lower(gm)
    verify(program)
    assert not _unordered(program)
    notes = [note for note in program.notes if tags.UNORDERED in note]
    assert len(notes) == 2 and all("ignored" in note for note in notes), program.notes
    assert {note.split(":")[0] for note in notes} == {f"%{ar.name}", f"%{rs.name}"}
    # a gather is FSDP's, but not a reduce-scatter
    gm = _generated()
    gather = next(n for n in gm.graph.nodes if n.meta.get(tags.COMM_TYPE) == tags.ALL_GATHER)
    gather.meta[tags.UNORDERED] = True
    program = lower(gm)
    assert not _unordered(program)
    assert [note for note in program.notes if tags.UNORDERED in note and note.startswith(f"%{gather.name}:")]


def test_in_place_raisings_tag_the_callers_nodes():
    gm = _generated()
    program = lower(gm)
    PassManager("unorder-reduce-scatters,gradients-first").run(program)
    assert raise_in_place(program) is gm
    assert _tagged(gm) == _unordered(program) and _tagged(gm)
    # the torch.compile pass: the given graph's own nodes, relinked or (by name) reordered
    from fxsched.integrations.inductor import schedule_graph_in_place

    gm = _generated()
    record = schedule_graph_in_place(gm.graph, PIPELINE, structural=False)
    assert record["relinked"] and _tagged(gm) == set(_reduce_scatters(lower(_generated())))
    # ... or given the raised copy's contents (bucket creates ops): the buckets' launches tagged
    gm = generate_graph(min_nodes(seed=2, layers=3, buckets=True) + 50, seed=2, layers=3, buckets=True)
    record = schedule_graph_in_place(gm.graph, PIPELINE + ",bucket", structural=False)
    assert not record["relinked"] and record["report"]["passes"]["bucket"]["reduce-scatters bucketed"] > 0
    again = lower(gm)
    assert _tagged(gm) == _unordered(again) == set(_reduce_scatters(again))


@pytest.mark.multirank
def test_raised_and_rescheduled_graphs_compute_the_same_numbers_on_two_ranks():
    from fxsched.runtime import run_ranks

    gm = _generated()
    # marked and scheduled without gradients-first, then scheduled again without the marking pass
    # but with gradients-first: its reduce-scatters reordered as only the tag allows (on the
    # output of the whole PIPELINE it swaps nothing: that is a fixed point)
    raised = fxsched.schedule(gm, "unorder-reduce-scatters,default").graph_module
    again = fxsched.schedule(raised, "gradients-first,default")
    assert again.result.stats()["gradients-first"]["swapped"] > 0
    assert _reduce_scatters(again.program) != _reduce_scatters(lower(raised))
    feeds = []
    for rank in range(2):
        gen = torch.Generator().manual_seed(100 + rank)
        feeds.append([torch.randn(n.meta["val"].shape, dtype=n.meta["val"].dtype, generator=gen)
                      for n in gm.graph.find_nodes(op="placeholder")])
    jobs = [(gm, feeds), (raised, feeds), (again.graph_module, feeds)]
    results = run_ranks(run_all, 2, args=(jobs,), timeout=600)
    check_bitwise(results, ["generated"], "raised graph (#1), scheduled again (#2)", per_key=3)
