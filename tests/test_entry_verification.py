"""What lowering returns keeps every IR rule by construction, so `schedule` and the drop-in skip
the verifier before the first pass unless asked (api.py says why): here, the graphs where that
would not hold are refused or made safe by lowering, and the check runs exactly when asked."""

from __future__ import annotations

import pytest
import torch
from torch import fx

import fxsched
import fxsched.passes.manager as manager
from fxsched.front.generate import generate_graph
from fxsched.ir import verify
from fxsched.lowering import lower
from fxsched.lowering.fx import LoweringError

from test_bad_input import REFERENCE, Graph, plain

c10d = torch.ops._c10d_functional


def test_a_node_after_the_output_is_refused():
    gm = plain()
    graph = gm.graph
    extra = graph.create_node("call_function", torch.ops.aten.neg.default, (next(iter(graph.nodes)),))
    assert list(graph.nodes)[-1] is extra  # after the output, and FX's lint lets it be
    graph.lint()
    with pytest.raises(LoweringError, match=rf"%{extra.name} follows the graph's output %output"):
        lower(gm)


def test_an_input_reading_another_node_is_refused():
    g = fx.Graph()
    x = g.placeholder("x")
    y = g.placeholder("y")
    g.output(g.call_function(torch.ops.aten.add.Tensor, (x, y)))
    gm = fx.GraphModule(torch.nn.Module(), g)
    y.args = (x,)  # a default that is a node: FX would not generate code for it, but lint passes
    g.lint()
    with pytest.raises(LoweringError, match=r"input %y reads \['%x'\]"):
        lower(gm)


def test_a_wait_on_a_collective_and_something_else_makes_the_collective_opaque():
    # lowered as before, this launch would have no Wait (its wait reads two nodes): the verifier
    # would have refused the program; now it stays in place as an opaque collective
    b = Graph()
    b.layer(0)
    ar = b.call(c10d.all_reduce.default, b.h, "sum", "0")
    wait = b.g.call_function(c10d.wait_tensor.default, (ar,), {"extra": b.x})
    b.use(wait)
    program = lower(b.done())
    verify(program)
    assert type(program.op(ar.name)).__name__ == "Opaque"


def test_a_gather_whose_wait_reads_something_else_too_names_the_gather():
    b = Graph()
    launch = b.gather(0)
    wait = b.g.call_function(c10d.wait_tensor.default, (launch,), {"extra": b.x})
    b.use(wait)
    with pytest.raises(LoweringError, match=rf"FSDP gather %{launch.name} .* must have exactly one user"):
        lower(b.done())


@pytest.mark.parametrize("size", [300, 3000])
@pytest.mark.parametrize("seed", [0, 1])
def test_lowered_generated_graphs_verify(size, seed):
    verify(lower(generate_graph(size, seed=seed)))


def count_input_checks(monkeypatch) -> list[int]:
    calls = []
    real = manager.verify

    def counting(program, **kwargs):
        calls.append(kwargs.get("structure", True))
        return real(program, **kwargs)

    monkeypatch.setattr(manager, "verify", counting)
    return calls


@pytest.mark.parametrize("asked", [True, False])
def test_schedule_checks_the_lowered_program_exactly_when_asked(monkeypatch, asked):
    # the reference pipeline only reorders: the manager checks the moves after each pass and the
    # whole order once at the end (structure=False); a full check with structure is the entry's
    calls = count_input_checks(monkeypatch)
    fxsched.schedule(plain(), REFERENCE, verify_lowered=asked)
    assert calls.count(True) == (1 if asked else 0) and calls.count(False) == 1


@pytest.mark.parametrize("env, expected", [("1", 1), ("0", 0), (None, 0)])
def test_the_environment_asks_for_the_check(monkeypatch, env, expected):
    if env is None:
        monkeypatch.delenv("FXSCHED_VERIFY_LOWERED", raising=False)
    else:
        monkeypatch.setenv("FXSCHED_VERIFY_LOWERED", env)
    calls = count_input_checks(monkeypatch)
    fxsched.overlap_param_gather(plain(), fxsched.PassConfig())
    assert calls.count(True) == expected


def test_the_test_suite_runs_with_the_check():
    import os

    assert os.environ.get("FXSCHED_VERIFY_LOWERED") == "1"
