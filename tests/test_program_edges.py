"""The IR's edges share one read-only attribute dict per kind (memory), and the graph still
behaves as a networkx DiGraph: adding an edge again changes that edge alone."""

from __future__ import annotations

import copy
import pickle

import networkx as nx
import pytest

from fxsched.front.generate import generate_graph
from fxsched.ir import DATA, EFFECT, verify
from fxsched.lowering import lower


@pytest.fixture(scope="module")
def lowered():
    return lower(generate_graph(300, seed=0))


def _edges(program, kind):
    return [(u, v, e) for u, v, e in program.graph.edges(data=True) if e["kind"] == kind]


def test_edges_of_a_kind_share_one_dict(lowered):
    data = _edges(lowered, DATA)
    assert len(data) > 300 and len({id(e) for _, _, e in data}) == 1
    frees = [e for _, _, e in _edges(lowered, EFFECT) if e["why"] == "free"]
    assert len(frees) > 1 and len({id(e) for e in frees}) == 1


def test_adding_an_edge_again_changes_only_that_edge(lowered):
    program = lowered.copy()
    (u, v, _), (x, y, _) = _edges(program, DATA)[:2]
    program.graph.add_edge(u, v, kind=EFFECT, why="test")
    assert program.graph.edges[u, v] == {"kind": EFFECT, "why": "test"}
    assert program.graph.edges[x, y] == {"kind": DATA}
    program.graph.add_edges_from([(x, y, {"note": 1})])
    assert program.graph.edges[x, y] == {"kind": DATA, "note": 1}
    assert all(e == {"kind": DATA} for a, b, e in _edges(program, DATA) if (a, b) != (x, y))


def test_editing_a_shared_dict_in_place_is_refused(lowered):
    (u, v, e), *_ = _edges(lowered, DATA)
    with pytest.raises(TypeError, match="shared with every edge of its kind"):
        lowered.graph.edges[u, v]["kind"] = EFFECT
    with pytest.raises(TypeError):
        e.update(kind=EFFECT)
    assert e == {"kind": DATA}
    verify(lowered)


def test_copies_and_pickles_are_whole_graphs(lowered):
    (u, v, _), *_ = _edges(lowered, DATA)
    for graph in (lowered.graph.copy(), copy.deepcopy(lowered.graph), pickle.loads(pickle.dumps(lowered.graph)),
                  nx.DiGraph(lowered.graph)):
        assert sorted(graph.edges(data=True)) == sorted(lowered.graph.edges(data=True))
        graph.add_edge(u, v, kind=EFFECT, why="test")  # the copy's edge, not the original's
        assert lowered.graph.edges[u, v] == {"kind": DATA}
