"""raise_program's node copy (raising/fx.py `_copier`): what create_node would have built.

Raising copies nodes without torch's create_node (whose walk of every argument for symbolic
scalars was a third of raising at 100k nodes); these tests hold the copy to what create_node
keeps: names and their namespace, the lookup table behind `find_nodes`, the node count, the
module's create-node hooks; and raising's check of the new graph to what `Graph.lint` refuses.
"""

from __future__ import annotations

import operator
import random

import pytest
import torch
from torch import fx

from fxsched.front.generate import generate_graph
from fxsched.lowering import lower
from fxsched.raising import raise_program


def _copy_by_fx(gm: fx.GraphModule) -> fx.Graph:
    graph, env = fx.Graph(), {}
    for node in gm.graph.nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
    return graph


def test_copy_is_what_create_node_builds():
    gm = generate_graph(600, seed=1)
    raised = raise_program(lower(gm)).graph
    by_fx = _copy_by_fx(gm)
    # lowering then raising with no pass keeps the order: node for node what graph_copy builds
    assert [(n.name, n.op, n.target, str(n.args), str(n.kwargs), n.type) for n in raised.nodes] == \
        [(n.name, n.op, n.target, str(n.args), str(n.kwargs), n.type) for n in by_fx.nodes]
    assert len(raised.nodes) == len(by_fx.nodes) == len(list(raised.nodes))
    source = {n.name: n for n in gm.graph.nodes}
    for node in raised.nodes:
        assert node.graph is raised
        assert node.meta == source[node.name].meta
        assert [u.name for u in node.users] == [u.name for u in source[node.name].users]
        if node.op == "call_function":
            assert node in raised.find_nodes(op="call_function", target=node.target)
    raised.lint()
    # the namespace and lookup table as create_node leaves them (names kept by `_keep_name`,
    # buckets found once per target)
    ours, theirs = raised._graph_namespace, by_fx._graph_namespace
    assert ours._used_names == theirs._used_names and ours._base_count == theirs._base_count
    assert sorted(ours._obj_to_name.values()) == sorted(theirs._obj_to_name.values())
    assert all(ours._obj_to_name[n] is n.name for n in raised.nodes)
    # (empty buckets aside: find_nodes makes one for what it is asked, and raising's check asks)
    assert [(k, [n.name for n in v]) for k, v in raised._find_nodes_lookup_table.table.items() if v] == \
        [(k, [n.name for n in v]) for k, v in by_fx._find_nodes_lookup_table.table.items() if v]


def test_kept_names_are_what_create_name_gives():
    # `_keep_name` stands in for torch's create_name where a name is kept: on names of every
    # shape (numbered, taken, builtin, keyword, invalid, non-ASCII digits or letters), in one
    # namespace after another, the same names and the same namespace state
    from torch.fx.graph import _Namespace

    from fxsched.raising.fx import _keep_name

    rng = random.Random(0)
    atoms = ["a", "b", "_", "1", "2", "0", "x_", "_3", "sum", "input", "def", "é", "٣", "-", "mm"]
    for _ in range(200):
        theirs, ours = _Namespace(), _Namespace()
        for _ in range(30):
            name = "".join(rng.choice(atoms) for _ in range(rng.randint(1, 4)))
            expected = theirs.create_name(name, None)
            got = name if _keep_name(name, ours._used_names, ours._base_count) else ours.create_name(name, None)
            assert got == expected, name
            assert ours._used_names == theirs._used_names and ours._base_count == theirs._base_count, name


def test_copy_keeps_the_namespace():
    gm = generate_graph(300, seed=2)
    raised = raise_program(lower(gm))
    graph = raised.graph
    taken = next(n for n in graph.nodes if n.op == "call_function")
    output = next(n for n in graph.nodes if n.op == "output")
    with graph.inserting_before(output):
        fresh = graph.create_node("call_function", operator.getitem, (taken, 0), name=taken.name)
    assert fresh.name != taken.name  # the copied names are taken in the new graph's namespace
    taken._rename("renamed")  # what graph passes use to rename: the namespace knows the copied node
    assert taken.name == "renamed"
    assert len({n.name for n in graph.nodes}) == len(graph.nodes)
    graph.lint()


def test_copy_runs_the_modules_create_node_hooks():
    gm = generate_graph(300, seed=3)
    seen = []
    gm._register_create_node_hook(seen.append)
    raised = raise_program(lower(gm))
    assert [n.name for n in seen] == [n.name for n in raised.graph.nodes]


class _WithBufferAndLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("w", torch.ones(3))
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(x + self.w)


def test_raising_still_refuses_what_lint_refuses_in_targets():
    # raising checks only what its copy does not make true by construction (get_attr and
    # call_module targets); what it leaves to lint must still fail as lint fails
    gm = fx.symbolic_trace(_WithBufferAndLinear())
    program = lower(gm)
    raise_program(program).graph.lint()
    gm.w = None  # the buffer's name still resolves, to None: lint calls that nonexistent
    with pytest.raises(RuntimeError, match="nonexistent attribute w"):
        raise_program(program)
    gm = fx.symbolic_trace(_WithBufferAndLinear())
    program = lower(gm)
    del gm.lin
    gm.lin = 3  # a call_module target that is no module
    with pytest.raises(RuntimeError, match="does not reference an nn.Module"):
        raise_program(program)


def test_meta_tags_the_named_nodes():
    gm = generate_graph(300, seed=4)
    program = lower(gm)
    names = [n.name for n in gm.graph.nodes if n.op == "call_function"][:3]
    raised = raise_program(program, meta={name: {"tag": i} for i, name in enumerate(names)})
    assert {n.name: n.meta["tag"] for n in raised.graph.nodes if "tag" in n.meta} == \
        {name: i for i, name in enumerate(names)}
    assert not any("tag" in n.meta for n in gm.graph.nodes)  # the source's meta is not touched


def test_an_op_rewritten_to_read_another_raised_node_reads_it():
    # raising copies each node reading its FX inputs' copies and checks the op still reads
    # those; where a pass made it read another node raised before it (its old input raised
    # too), the copy is made to read that one: users and the lookup table follow
    from fxsched.ir.rewriter import Rewriter

    class M(torch.nn.Module):
        def forward(self, x):
            a, b = torch.relu(x), torch.neg(x)
            return a + 1, b

    gm = fx.symbolic_trace(M())
    program = lower(gm)
    assert Rewriter(program).replace_uses("relu", "neg", only={"add"}) == ["add"]
    raised = raise_program(program).graph
    nodes = {n.name: n for n in raised.nodes}
    assert nodes["add"].args == (nodes["neg"], 1)
    assert nodes["add"].all_input_nodes == [nodes["neg"]]
    assert not nodes["relu"].users and set(nodes["neg"].users) == {nodes["add"], nodes["output"]}
    assert nodes["add"] in raised.find_nodes(op="call_function", target=operator.add)
    raised.lint()
    # the user's module is left as it was
    assert [n.name for n in gm.graph.find_nodes(op="call_function", target=operator.add)[0].all_input_nodes] == ["relu"]
