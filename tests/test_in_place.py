"""The drop-in schedules the caller's module in place: it relinks the module's own nodes into
the new order (nothing copied, meta and names kept), checks that each node follows its inputs,
and generates the code once; the torch.compile pass does the same where the passes only reordered."""

from __future__ import annotations

import attrs
import pytest
from torch import fx

import fxsched
from fxsched.front.generate import generate_graph
from fxsched.lowering import lower
from fxsched.passes import PassManager
from fxsched.raising import RaisingError, raise_in_place, reorders_only

CONFIG = fxsched.PassConfig(max_in_flight_gb=1.0, fsdp_forward_prefetch_depth=2)


def _graph():
    return generate_graph(600, seed=3, buckets=True, mixed_precision=True)


def test_drop_in_relinks_the_modules_own_nodes():
    gm = _graph()
    nodes = list(gm.graph.nodes)
    metas = {n: n.meta for n in nodes}
    graph = gm.graph
    fresh = fxsched.schedule(_graph(), fxsched.reference_pipeline(1.0, 2, 1)).graph_module
    out = fxsched.overlap_param_gather(gm, CONFIG)
    assert out is gm and gm.graph is graph
    after = list(gm.graph.nodes)
    assert set(after) == set(nodes) and len(after) == len(nodes)  # the same node objects, none added
    assert after != nodes  # and something moved
    assert all(n.meta is metas[n] for n in after)
    gm.graph.lint()
    # the same order and code as the fresh module `schedule` raises, and anchors on the moved gathers
    assert [n.name for n in after] == [n.name for n in fresh.graph.nodes]
    assert gm.code == fresh.code
    anchors = {n.name: n.meta["fsdp_prefetch_anchor"] for n in after if "fsdp_prefetch_anchor" in n.meta}
    assert anchors and anchors == {n.name: n.meta["fsdp_prefetch_anchor"] for n in fresh.graph.nodes
                                   if "fsdp_prefetch_anchor" in n.meta}
    assert sum(gm.meta["fsdp_prefetch"][k] for k in ("forward", "backward")) == len(anchors)


def test_drop_in_generates_the_code_once(monkeypatch):
    gm = _graph()
    calls = []
    real = fx.Graph.python_code

    def counting(self, *args, **kwargs):
        calls.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(fx.Graph, "python_code", counting)
    fxsched.overlap_param_gather(gm, CONFIG)
    assert calls == [gm.graph]


def test_in_place_raising_refuses_a_graph_changed_after_lowering():
    gm = _graph()
    program = lower(gm)
    order = list(gm.graph.nodes)
    with gm.graph.inserting_before(gm.graph.output_node()):
        extra = gm.graph.call_function(print, ())  # a node the program never saw
    with pytest.raises(RaisingError, match="not those of its module's graph"):
        raise_in_place(program)
    assert [n for n in gm.graph.nodes if n is not extra] == order  # nothing was relinked


def test_in_place_raising_refuses_an_order_that_runs_a_node_before_its_input():
    gm = _graph()
    program = lower(gm)
    user = next(n for n in gm.graph.nodes if n.op == "call_function" and n.all_input_nodes)
    program.schedule.move_before([user.name], user.all_input_nodes[0].name)  # unverified: breaks a data edge
    order = list(gm.graph.nodes)
    with pytest.raises(RaisingError, match=f"%{user.name} would run before its input %{user.all_input_nodes[0].name}"):
        raise_in_place(program)
    assert list(gm.graph.nodes) == order  # checked before relinking: the caller's graph is left as it was


def test_reorders_only_tells_a_reordering_from_a_rewrite():
    # the torch.compile pass relinks in place where reorders_only says the passes only reordered
    program = lower(_graph())
    PassManager(fxsched.reference_pipeline(1.0, 2, 1)).run(program)
    assert reorders_only(program)
    program = lower(_graph())
    PassManager("default,unshard,bucket").run(program)  # creates and erases ops
    assert not reorders_only(program)
    program = lower(_graph())
    user = next(n for n in program.origin.graph.nodes if n.op == "call_function" and len(n.all_input_nodes) == 1)
    other = next(n for n in program.origin.graph.nodes if n.op == "placeholder" and n not in user.all_input_nodes)
    data = program.graph._node[user.name]
    data["op"] = attrs.evolve(data["op"], operands=(other.name,))  # rewired: reads another value than its node
    assert not reorders_only(program)
