"""Timelines of simulated schedules: Chrome-trace JSON (opens in Perfetto / chrome://tracing)
and before/after text tables.

The trace has one process (pid 1) with one track (tid) per stream: compute first, then one
per communication group; ops are "X" complete events with ts/dur in microseconds, a wait
the compute stream idles on is an "X" event of category `exposed`, and the live memory and
gathered bytes in flight are "C" counter tracks. Run `simulate(..., record=True)` first.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .simulate import COMPUTE, Simulation


def chrome_trace(sim: Simulation, *, label: str = "fxsched simulation", pid: int = 1) -> dict[str, Any]:
    """A Chrome-trace object (`{"traceEvents": [...]}`) of a recorded simulation."""
    if not sim.events and sim.step_ms > 0:
        raise ValueError("the simulation has no events: run simulate(..., record=True)")
    streams = [COMPUTE] + sorted({e.stream for e in sim.events if e.stream != COMPUTE})
    tid = {s: i for i, s in enumerate(streams)}
    out: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": label}},
    ]
    for stream, i in tid.items():
        out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": i, "args": {"name": stream}})
        out.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": i, "args": {"sort_index": i}})
    for e in sim.events:
        out.append({
            "name": e.name, "cat": e.kind, "ph": "X", "pid": pid, "tid": tid[e.stream],
            "ts": round(e.start_ms * 1e3, 4), "dur": round(e.dur_ms * 1e3, 4),
            "args": {"target": e.target} if e.target else {},
        })
    last = None
    for when, live in sim.memory:
        if live != last:
            out.append({"name": "live memory (MiB)", "ph": "C", "pid": pid, "ts": round(when * 1e3, 4),
                        "args": {"MiB": round(live / 2**20, 4)}})
            last = live
    for when, level in sim.inflight:
        out.append({"name": "gathered bytes in flight (MiB)", "ph": "C", "pid": pid, "ts": round(when * 1e3, 4),
                    "args": {"MiB": round(level / 2**20, 4)}})
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"step_ms": sim.step_ms, "lower_bound_ms": sim.lower_bound_ms,
                          "exposed_ms": sim.exposed_ms, "peak_bytes": sim.peak_bytes}}


def write_chrome_trace(sim: Simulation, path: str, **kwargs: Any) -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(sim, **kwargs), f)


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def compare_table(results: Mapping[str, Simulation], baseline: str | None = None) -> str:
    """A text table, one row per schedule: step time, exposed communication, peak memory,
    the plain bound (max(total compute, busiest stream): `Simulation.lower_bound_ms`, the gap
    report's `plain_ms`; its `bound_ms` is tighter) and the step's ratio to it, and (with `baseline`, default the first) step time and peak
    memory relative to the baseline row."""
    if not results:
        return ""
    names = list(results)
    base = results[baseline if baseline is not None else names[0]]
    header = ("schedule", "step ms", "exposed ms", "peak mem", "plain bound ms", "step/plain",
              "step vs base", "peak vs base")
    rows = [header]
    for name in names:
        sim = results[name]
        rows.append((
            name, f"{sim.step_ms:.4f}", f"{sim.exposed_ms:.4f}", format_bytes(sim.peak_bytes),
            f"{sim.lower_bound_ms:.4f}", f"{sim.ratio:.3f}",
            f"{sim.step_ms / base.step_ms:.3f}x" if base.step_ms else "-",
            f"{sim.peak_bytes / base.peak_bytes:.3f}x" if base.peak_bytes else "-",
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = []
    for k, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n"


def before_after(before: Simulation, after: Simulation) -> str:
    """The two-row table of `compare_table` for a schedule before and after a pipeline."""
    return compare_table({"before": before, "after": after}, baseline="before")
