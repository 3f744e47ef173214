"""Peers for the schedule benchmark: Inductor's overlap scheduler, run on CPU on a copy of a graph.

`run_inductor(gm, estimate)` copies `gm` (node meta shared, names kept), runs
`torch._inductor.fx_passes.overlap_scheduling.schedule_overlap_bucketing` on the copy with
`estimate(node, override_size) -> ms` as its `custom_runtime_estimation`, and returns the
scheduled module and the seconds it took. What it needs on a CPU-only machine, set up once by
`setup_inductor(hw)`:

- a process group: the "fake" backend (`torch.testing._internal.distributed.fake_pg.FakeStore`),
  world size 2, rank 0 — the scheduler reads group names and the world size, nothing runs;
- triton is absent, so `torch._inductor.utils.get_gpu_dram_gbps` and, in
  `torch.utils._runtime_estimation`, `get_gpu_dram_gbps` / `get_device_tflops` are replaced by
  the hardware profile's constants (they are only reached for logging once a custom
  estimation is given);
- `compute_estimator="analytical"`: with "benchmark" (the default) the scheduler would time
  compute ops (it consults a persistent local cache first); "analytical" keeps the custom
  estimation for every compute node and makes no cross-rank exchange.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

_READY = False


def setup_inductor(hbm_gbps: float, tflops: float) -> None:
    """Fake process group + constant device numbers (idempotent)."""
    global _READY
    if _READY:
        return
    import torch.distributed as dist
    import torch.utils._runtime_estimation as runtime_estimation
    from torch._inductor import utils as inductor_utils
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    inductor_utils.get_gpu_dram_gbps = lambda: int(hbm_gbps)
    runtime_estimation.get_gpu_dram_gbps = lambda: int(hbm_gbps)
    runtime_estimation.get_device_tflops = lambda dtype=None: float(tflops)
    inductor_utils.get_device_tflops = lambda dtype=None: float(tflops)
    _READY = True


def copy_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule over a copy of `gm`'s graph: same node names, meta dicts copied
    shallowly (values shared), owning module shared."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    copied = fx.GraphModule(gm, graph)
    copied.meta.update(gm.meta)
    return copied


#: the options the benchmark runs the peer with (anything not listed is Inductor's default)
INDUCTOR_OPTIONS: dict[str, Any] = {
    "compute_estimator": "analytical",
    "collective_estimator": "analytical",
}


def run_inductor(gm: fx.GraphModule, estimate: Callable[[fx.Node, int | None], float | None],
                 **options: Any) -> tuple[fx.GraphModule, float]:
    """Schedule a copy of `gm` with Inductor's overlap scheduler; returns (module, seconds).

    The copy is made before the clock starts; the clock covers the scheduler call only.
    """
    from torch._inductor.fx_passes.overlap_scheduling import schedule_overlap_bucketing

    work = copy_module(gm)
    kwargs = dict(INDUCTOR_OPTIONS, **options)
    start = time.perf_counter()
    out = schedule_overlap_bucketing(work, custom_runtime_estimation=estimate, **kwargs)
    seconds = time.perf_counter() - start
    out.graph.lint()
    return out, seconds


def inductor_signature() -> str:
    import inspect

    from torch._inductor.fx_passes.overlap_scheduling import schedule_overlap_bucketing

    return f"schedule_overlap_bucketing{inspect.signature(schedule_overlap_bucketing)} (torch {torch.__version__})"
