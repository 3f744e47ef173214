"""raising/lint.py: `lint(graph)` is `Graph.lint()`, faster where the graph passes.

Its fast test must be sufficient: every graph it passes, Graph.lint passes (the generated and
traced graphs below), and every graph Graph.lint refuses, the fast test refuses too, so that
Graph.lint itself runs and raises its own error (one corruption per check lint makes).
"""

from __future__ import annotations

import operator
import re

import pytest
import torch
from torch import fx

import fxsched
from fxsched.front.generate import generate_graph
from fxsched.lowering import lower_in_order
from fxsched.raising import lint as fast


class _Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("w", torch.ones(3))
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        return torch.relu(self.lin(x + self.w)) * 2


def _graphs():
    return [generate_graph(400, seed=5).graph, fx.symbolic_trace(_Small()).graph]


def test_graphs_that_lint_pass_the_fast_test():
    for graph in _graphs():
        graph.lint()
        assert fast._passes(graph)
        fast.lint(graph)
    assert fast._passes(fx.Graph())


def _call(graph):
    return next(n for n in graph.nodes if n.op == "call_function" and n.all_input_nodes)


def _unknown_op(gm):
    object.__setattr__(_call(gm.graph), "op", "bogus")  # behind the lookup table's back, as lint's test is


def _foreign_input(gm):
    other = fx.Graph()
    stranger = other.placeholder("stranger")
    node = _call(gm.graph)
    node.args = (stranger, *node.args[1:])


def _foreign_namesake(gm):  # lowering, which reads inputs by name, takes it for the input x
    stranger = fx.Graph().placeholder("x")
    node = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is operator.add)
    node.args = (stranger, *node.args[1:])


def _input_after_user(gm):
    node = _call(gm.graph)
    node.all_input_nodes[0].prepend(node)  # the node now runs before its first input


def _duplicate_name(gm):
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    object.__setattr__(nodes[1], "name", nodes[0].name)


def _out_of_the_table(gm):
    gm.graph._find_nodes_lookup_table.remove(_call(gm.graph))


def _target_changed_behind_the_table(gm):
    node = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.mul)
    object.__setattr__(node, "target", operator.mul)


def _target_not_callable(gm):
    node = _call(gm.graph)
    table = gm.graph._find_nodes_lookup_table
    table.remove(node)
    object.__setattr__(node, "target", 3)
    table.insert(node)


def _get_attr_gone(gm):
    gm.w = None


def _call_module_not_a_module(gm):
    del gm.lin
    gm.lin = 3


CORRUPTIONS = [_unknown_op, _foreign_input, _foreign_namesake, _input_after_user, _duplicate_name, _out_of_the_table,
               _target_changed_behind_the_table, _target_not_callable, _get_attr_gone, _call_module_not_a_module]


@pytest.mark.parametrize("corrupt", CORRUPTIONS)
def test_what_lint_refuses_the_fast_test_refuses_and_lint_says_why(corrupt):
    gm = fx.symbolic_trace(_Small())
    corrupt(gm)
    with pytest.raises(Exception) as torch_says:
        gm.graph.lint()
    assert not fast._passes(gm.graph)
    with pytest.raises(type(torch_says.value), match=re.escape(str(torch_says.value)[:200])):
        fast.lint(gm.graph)


@pytest.mark.parametrize("corrupt", CORRUPTIONS)
def test_the_package_face_gives_lints_error_though_lowering_tests_names_and_order(corrupt):
    """fxsched.schedule and the drop-in leave lint's tests of names and input order to lowering's
    walk (`lint(lowered=True)`), and run lint before raising what lowering raised: a graph lint
    refuses still gets lint's own error, whatever lowering makes of it."""
    gm = fx.symbolic_trace(_Small())
    corrupt(gm)
    with pytest.raises(Exception) as torch_says:
        gm.graph.lint()
    with pytest.raises(type(torch_says.value), match=re.escape(str(torch_says.value)[:200])):
        fxsched.schedule(gm)


def test_lowering_says_whether_inputs_are_nodes_listed_before():
    gm = fx.symbolic_trace(_Small())
    assert lower_in_order(gm)[1]
    _foreign_namesake(gm)
    assert not lower_in_order(gm)[1]
