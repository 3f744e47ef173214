"""The cap is never exceeded in simulation: the default pipeline with both rewriting passes, under
caps drawn below, at and above the input's peak.

tests/test_memory_cap.py draws caps between the input's simulated peak and the peak the pipeline
reaches uncapped, with bucket and unshard on the models and unshard alone on generated graphs.
The peer-cap table (bench/peer_cap.py) also sets caps below the input's peak (a peer's order
can use less memory than the graph as traced) and runs `default` with bucket and unshard on
every workload; here the same, on generated graphs and on the models: `default` followed by
bucket, unshard or both in either order, the cap an absolute `max-peak-gb` or an increase over
the input's peak, anywhere from 10% under the lower of the input's and the uncapped pipeline's
peaks to 5% over the higher. The property: the result's simulated peak is within the cap, or,
for a cap under the input's peak, no higher than the input's (passes hold back what would raise
it; the pipeline may lower it).
"""

from __future__ import annotations

import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from fxsched.cost.simulate import memory_profile, simulate
from fxsched.front import fsdp_joint_graph
from fxsched.lowering import lower
from fxsched.models import build_model
from fxsched.passes import PassContext, PassManager
from fxsched.passes.memory_cap import resolve_cap, with_cap

from ranks import GIB
from test_properties import _graph, _min_nodes, examples, graph_options

REWRITES = ("bucket", "unshard", "bucket,unshard", "unshard,bucket")


def _peak(program) -> int:
    return memory_profile(program).peak_bytes


def _check(program, rewrites: str, where: float, absolute: bool) -> None:
    text = f"default,{rewrites}"
    peak = _peak(program)
    free = program.copy()
    PassManager(text).run(free)
    low, high = 0.9 * min(peak, _peak(free)), 1.05 * max(peak, _peak(free))
    target = int(low + where * (high - low))
    if absolute or target < peak:  # an increase cannot put a cap under the input's peak
        capped, cap = with_cap(text, max_peak_gb=target / GIB), resolve_cap(target / GIB, 0.0, peak)
    else:
        increase = (target - peak) / GIB
        capped, cap = with_cap(text, max_peak_increase_gb=increase), resolve_cap(0.0, increase, peak)
    note(f"{capped}: input peak {peak}, uncapped {_peak(free)}, cap {cap}")
    result = program.copy()
    ctx = PassContext()
    PassManager(capped).run(result, ctx)   # the manager's own check raises PeakCapExceeded
    after = simulate(result).peak_bytes
    assert after == _peak(result)
    assert ctx.peak_cap is not None and ctx.peak_cap.limit_bytes == cap
    assert after <= max(cap, peak), f"peak {after} over the cap {cap} (input peak {peak})"


@examples(10, graphs=True)
@given(graph=graph_options(), rewrites=st.sampled_from(REWRITES), where=st.floats(0.0, 1.0), absolute=st.booleans())
def test_generated_graphs_with_both_rewrites_never_exceed_the_cap(graph, rewrites, where, absolute):
    num_nodes, options = graph
    shape = {k: options[k] for k in ("layers", "attention", "buckets", "mixed_precision", "barriers", "reshard",
                                     "seed")}
    _check(lower(_graph(max(num_nodes, _min_nodes(**shape)), **options)), rewrites, where, absolute)


MODEL_CASES = [(name, mp, buckets) for name in ("gpt", "llama", "encoder")
               for mp, buckets in ((False, None), (True, None), (False, "per-module"))]


@pytest.fixture(scope="module")
def model_programs():
    import torch

    out = {}
    for name, mp, buckets in MODEL_CASES:
        module, inputs, model_loss = build_model(name, layers=2, width=32, seed=1)
        front = fsdp_joint_graph(module, inputs, lambda m, *xs: model_loss(m(*xs), *xs), 2, buckets=buckets,
                                 mixed_precision=torch.bfloat16 if mp else None)
        out[(name, mp, buckets)] = lower(front.gm)
    return out


@examples(16)
@given(case=st.sampled_from(MODEL_CASES), rewrites=st.sampled_from(REWRITES), where=st.floats(0.0, 1.0),
       absolute=st.booleans())
def test_model_graphs_with_both_rewrites_never_exceed_the_cap(model_programs, case, rewrites, where, absolute):
    _check(model_programs[case], rewrites, where, absolute)
