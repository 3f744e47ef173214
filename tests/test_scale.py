"""The whole pipeline on a large generated graph: behaviour at scale, never its speed
(bench/bench_pipeline.py measures that). CI runs it small; FXSCHED_SCALE=100000 runs it full."""

from __future__ import annotations

import os

import pytest

import fxsched
from fxsched.front.generate import generate_graph
from fxsched.ir import verify


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", ["reference", "default"])
def test_pipeline_at_scale(pipeline):
    num_nodes = int(os.environ.get("FXSCHED_SCALE", "5000"))
    gm = generate_graph(num_nodes, seed=1, buckets=True, mixed_precision=True, missing_sizes=0.05)
    done = fxsched.schedule(gm, pipeline)
    verify(done.program)
    done.graph_module.graph.lint()
    assert len(done.graph_module.graph.nodes) == len(gm.graph.nodes)
    rows = done.report["gathers"]
    assert sum(r["moved"] for r in rows) > len(rows) // 4
    # gathers of unknown size never move early, and every gather that stays says why
    assert not any(r["moved"] and r["nbytes"] is None for r in rows)
    assert all(r["moved"] or r["reason"] for r in rows)
