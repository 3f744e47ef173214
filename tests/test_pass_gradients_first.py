"""gradients-first: each reduce-scatter's ancestors in its window move ahead of what it does not
need (tests/filecheck/passes/gradients-first.fxir has the hand-written cases).

Here: the rule it establishes on real graphs, that a second run moves nothing, that it never
raises the simulated step of the default pipeline after it on the built-in models, that a cap
at the input's peak leaves out the chunks over it, and that its schedules compute bitwise the
same on two gloo ranks. That the cap holds on generated graphs and IR programs, moves checked
and unchecked, is tested with the other passes' (tests/test_memory_cap.py, COMPUTE_REORDERING).
"""

from __future__ import annotations

import pytest
import torch

import fxsched
from fxsched.cost.model import CostAnalysis
from fxsched.cost.simulate import memory_profile, simulate
from fxsched.front import fsdp_joint_graph
from fxsched.ir import Barrier, Launch, Role, verify
from fxsched.ir.holds import OVER_PEAK_CAP
from fxsched.lowering import lower
from fxsched.models import build_model
from fxsched.passes import PassContext, PassManager
from fxsched.passes.memory_cap import with_cap
from fxsched.runtime import run_ranks

from ranks import WORLD, check_bitwise, rank_feeds, run_all

MODELS = [(name, mp) for name in ("encoder", "gpt", "llama") for mp in (None, torch.bfloat16)]


def _front(name, mp=None, buckets=None):
    module, inputs, model_loss = build_model(name, layers=2, width=32, seed=1)
    front = fsdp_joint_graph(module, inputs, lambda m, *xs: model_loss(m(*xs), *xs), WORLD,
                             mixed_precision=mp, buckets=buckets)
    return front, module, inputs


@pytest.fixture(scope="module")
def fronts():
    return {case: _front(*case) for case in MODELS}


def _stats(result, name="gradients-first"):
    return next(v for k, v in result.stats().items() if k.split("{")[0] == name)


def _windows_in_order(program, ms) -> bool:
    """In every window (after the previous reduce-scatter launch or barrier, up to a launch), no op
    the launch needs comes after one it does not need that costs something (`ms`: the pass's rule)."""
    names = program.schedule.names()
    pred = program.predecessors
    begin = 0
    for at, name in enumerate(names):
        op = program.op(name)
        if isinstance(op, Barrier):
            begin = at + 1
            continue
        if not (isinstance(op, Launch) and op.role is Role.REDUCE_SCATTER):
            continue
        window = names[begin:at]
        inside, needed, stack = set(window), set(), [name]
        while stack:
            for p in pred[stack.pop()]:
                if p in inside and p not in needed:
                    needed.add(p)
                    stack.append(p)
        seen_other = False
        for n in window:
            if n not in needed and not isinstance(program.op(n), Launch) and ms.get(n, 0.0) > 0:
                seen_other = True
            elif n in needed and seen_other:
                return False
        begin = at + 1
    return True


@pytest.mark.parametrize("case", MODELS)
def test_each_launch_needs_everything_before_it_in_its_window_and_a_second_run_moves_nothing(fronts, case):
    front, _, _ = fronts[case]
    program = lower(front.gm)
    ctx = PassContext()
    result = PassManager("gradients-first").run(program, ctx)
    verify(program)
    assert _stats(result)["moved"] > 0
    assert _windows_in_order(program, ctx.get(CostAnalysis, program).ms)
    assert not _windows_in_order(lower(front.gm), ctx.get(CostAnalysis, program).ms)  # the trace's order breaks it
    again = program.copy()
    second = PassManager("gradients-first").run(again, PassContext())
    assert _stats(second)["moved"] == 0 and again.schedule.names() == program.schedule.names()


@pytest.mark.parametrize("case", MODELS)
def test_the_default_after_it_is_never_slower_on_the_built_in_models(fronts, case):
    front, _, _ = fronts[case]
    plain = simulate(fxsched.schedule(front.gm, "default").program).step_ms
    first = simulate(fxsched.schedule(front.gm, "gradients-first,default").program).step_ms
    assert first <= plain + 1e-9


def test_a_cap_at_the_input_peak_leaves_out_the_chunks_over_it(fronts):
    front, _, _ = fronts[("encoder", None)]
    program = lower(front.gm)
    peak = memory_profile(program).peak_bytes
    free = program.copy()
    PassManager("gradients-first").run(free, PassContext())
    assert memory_profile(free).peak_bytes > peak  # uncapped, it raises the peak here
    capped = program.copy()
    result = PassManager(with_cap("gradients-first", max_peak_increase_gb=0.0)).run(capped, PassContext())
    stats = _stats(result)
    assert stats[OVER_PEAK_CAP] > 0 and memory_profile(capped).peak_bytes <= peak
    verify(capped)


@pytest.mark.multirank
def test_its_schedules_are_bitwise_equal_on_two_ranks(fronts):
    jobs, keys = [], []
    for case in MODELS:
        front, module, inputs = fronts[case]
        feeds = rank_feeds(front, module, inputs)
        jobs.append((front.gm, feeds))
        for text in ("gradients-first,default", "gradients-first,default,bucket,unshard"):
            done = fxsched.schedule(front.gm, text)
            assert _stats(done.result)["moved"] > 0
            jobs.append((done.graph_module, feeds))
        keys.append(case)
    check_bitwise(run_ranks(run_all, WORLD, args=(jobs,), timeout=600), keys, "gradients-first schedule", per_key=3)


def test_a_second_run_on_its_own_raised_output_swaps_nothing():
    """`unorder-reduce-scatters,gradients-first` run again on its own raised output leaves the
    order as it is. Each sweep over the windows swaps adjacent unordered pairs as a pass of a
    bubble sort does; one sweep left pairs a second run swapped (generated 1000 nodes: 28, then
    24, 16 on the raised outputs). It sweeps until nothing swaps (7 sweeps there, 88 swaps), at the
    same simulated step (1.89239 ms)."""
    from fxsched.front.generate import generate_graph

    gm = generate_graph(1000, seed=0)
    first = fxsched.schedule(gm, "unorder-reduce-scatters,gradients-first")
    assert _stats(first.result)["swapped"] > 0
    second = fxsched.schedule(first.graph_module, "unorder-reduce-scatters,gradients-first")
    assert _stats(second.result)["swapped"] == 0
    assert [n.name for n in second.graph_module.graph.nodes] == [n.name for n in first.graph_module.graph.nodes]
