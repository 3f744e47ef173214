"""Dynamic shapes: torch.compile(dynamic=True) graphs, whose activations have symbolic extents.

Lowering reads a symbolic extent as unknown (`?` in the IR text, -1 in `TensorType.shape`): the
cost model and the memory profile count what they cannot size as nothing, and no pass reads a
size hint. So a dynamic graph's schedule depends on its structure alone, not on the example
sizes it was traced with — ranks whose batches differ in size (the hints differ) still compute
the same schedule, hence the same collective order. Here 2 gloo ranks compile the same
SimpleFSDP-style model with batch sizes 4 and 6 (each rank's own hint), with and without the
default pipeline as Inductor's post-grad pass, then run a second batch size on the same compiled
graph: the pass's result is bitwise the plain compile's at both sizes on both ranks, and both
ranks scheduled the same graphs into the same code.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import pytest

from fxsched.integrations.inductor import HOOK, FxschedInductorPass
from fxsched.runtime import run_ranks

from test_compile import LITE, ShardedLinear  # the SimpleFSDP-style layer (gather, checkpointed re-gather)

LAYERS, WIDTH = 3, 16


class _Recording(FxschedInductorPass):
    """The default pipeline as Inductor's pass, keeping each graph's code before and after it."""

    def __init__(self):
        super().__init__("default", on_error="raise")
        self.codes: list[tuple[str, str]] = []
        self.symbolic: list[bool] = []  # per graph: whether a placeholder is a symbolic size

    def __call__(self, graph):
        self.symbolic.append(any(isinstance(n.meta.get("val"), torch.SymInt)
                                 for n in graph.find_nodes(op="placeholder")))
        before = graph.python_code("self").src
        super().__call__(graph)
        self.codes.append((before, graph.python_code("self").src))


def _dynamic_worker(rank, world_size):
    weights = [torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(i)) for i in range(LAYERS)]
    sizes = (4, 6) if rank == 0 else (6, 4)  # each rank traces with its own first size as the hint

    def steps(options):
        torch._dynamo.reset()
        model = nn.Sequential(*[ShardedLinear(w, world_size, rank) for w in weights])
        run = torch.compile(model, backend="inductor", options=options, dynamic=True)
        out = []
        for size in sizes:
            x = torch.randn(size, WIDTH, generator=torch.Generator().manual_seed(100 * size + rank))
            loss = run(x).square().sum()
            loss.backward()
            out.append([loss.detach()] + [p.grad.detach().clone() for p in model.parameters()])
            model.zero_grad()
        return out

    plain = steps(dict(LITE))
    fx_pass = _Recording()
    scheduled = steps({**LITE, HOOK: fx_pass})
    return {"plain": plain, "scheduled": scheduled, "codes": fx_pass.codes,
            "runs": [{k: r[k] for k in ("phase", "gathers", "moved")} for r in fx_pass.runs],
            "symbolic": fx_pass.symbolic}


@pytest.mark.multirank
def test_dynamic_shape_graphs_schedule_alike_on_every_rank_and_stay_bitwise():
    results = run_ranks(_dynamic_worker, 2, timeout=600)
    for rank, r in enumerate(results):
        # one compile serves both sizes: the pass ran once per graph (forward, backward)
        assert [run["phase"] for run in r["runs"]] == ["forward", "backward"], r["runs"]
        assert all(run["gathers"] >= 1 for run in r["runs"]) and sum(run["moved"] for run in r["runs"]) >= 1, r["runs"]
        assert r["symbolic"] == [True, True], "the graphs are not dynamic"
        for size, (a, b) in enumerate(zip(r["plain"], r["scheduled"], strict=True)):
            for x, y in zip(a, b, strict=True):
                assert torch.equal(x, y), f"rank {rank}, size #{size}: the pass changed the results"
    # the ranks traced with different hints; where torch handed them the same graph, fxsched
    # made the same schedule of it
    assert [b for b, _ in results[0]["codes"]] == [b for b, _ in results[1]["codes"]]
    assert [a for _, a in results[0]["codes"]] == [a for _, a in results[1]["codes"]]
    assert any(b != a for b, a in results[0]["codes"])  # it did move something
