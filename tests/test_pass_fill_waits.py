"""fill-waits: compute ready at an exposed wait moves up to fill it (tests/filecheck/passes/
fill-waits.fxir has the hand-written cases).

Here: on the built-in models it never lengthens the simulated step of the pipeline before it and
shortens some; its option is validated; its schedules compute bitwise the same on two gloo
ranks. That the peak-memory cap holds with its moves checked and unchecked is tested with the
other passes' (tests/test_memory_cap.py, COMPUTE_REORDERING).
"""

from __future__ import annotations

import pytest
import torch

import fxsched
from fxsched.cost.simulate import simulate
from fxsched.front import fsdp_joint_graph
from fxsched.ir import verify
from fxsched.models import build_model
from fxsched.passes import PipelineError, make_pass
from fxsched.runtime import run_ranks

from ranks import WORLD, check_bitwise, rank_feeds, run_all

MODELS = [(name, mp) for name in ("encoder", "gpt", "llama") for mp in (None, torch.bfloat16)]


@pytest.fixture(scope="module")
def fronts():
    out = {}
    for name, mp in MODELS:
        module, inputs, model_loss = build_model(name, layers=2, width=32, seed=1)
        front = fsdp_joint_graph(module, inputs, lambda m, *xs: model_loss(m(*xs), *xs), WORLD, mixed_precision=mp)
        out[(name, mp)] = (front, module, inputs)
    return out


def _stats(result):
    return next(v for k, v in result.stats().items() if k.split("{")[0] == "fill-waits")


def test_it_never_lengthens_the_step_and_shortens_some(fronts):
    shorter = 0
    for case in MODELS:
        front = fronts[case][0]
        for base in ("default", "gradients-first,default"):
            before = simulate(fxsched.schedule(front.gm, base).program).step_ms
            done = fxsched.schedule(front.gm, base + ",fill-waits")
            verify(done.program)
            after = simulate(done.program).step_ms
            assert after <= before + 1e-9, (case, base)
            shorter += after < before - 1e-9
    assert shorter > 0


def test_max_scan_is_validated():
    assert make_pass("fill-waits", "max-scan=3").max_scan == 3
    with pytest.raises(PipelineError, match="max-scan"):
        make_pass("fill-waits", "max-scan=-1")


@pytest.mark.multirank
def test_its_schedules_are_bitwise_equal_on_two_ranks(fronts):
    jobs, keys, moved = [], [], 0
    for case in MODELS:
        front, module, inputs = fronts[case]
        feeds = rank_feeds(front, module, inputs)
        jobs.append((front.gm, feeds))
        done = fxsched.schedule(front.gm, "default,fill-waits")
        moved += _stats(done.result)["moved"]
        jobs.append((done.graph_module, feeds))
        keys.append(case)
    assert moved > 0  # some schedule differs from default's
    check_bitwise(run_ranks(run_all, WORLD, args=(jobs,), timeout=600), keys, "fill-waits schedule")
