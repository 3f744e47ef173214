"""The report of a run as text: pass statistics, one row per gather, `explain`'s reasons,
timing, and the simulated before/after (for the `fxsched` command; the data is
`ScheduleResult.report`)."""

from __future__ import annotations

import collections
import json

from .ir.holds import explain_hold


def timing_text(timing) -> str:
    return "  " + timing.report().replace("\n", "\n  ").rstrip() if timing else ""


def _where(row: dict) -> str:
    if row["moved"]:
        return f"before %{row['anchor']}" if row["anchor"] else "moved (by an earlier run)"
    stays = "stays where an earlier run moved it" if row.get("earlier") else "stays"
    return f"{stays} ({row['reason']})" if row["reason"] else stays


def report_lines(report: dict) -> list[str]:
    """The report as a table: per-pass statistics, one row per gather, the program's notes."""
    lines = [f"  pipeline: {report['pipeline']}"]
    for name, stats in report["passes"].items():
        shown = ", ".join(f"{k}={v}" for k, v in stats.items() if k != "changed")
        lines.append(f"    {name:<40} {shown}")
    if report["gathers"]:
        lines.append("  gathers:")
        width = max(len(row["launch"]) for row in report["gathers"])
        for row in report["gathers"]:
            params = ",".join(row["params"])
            lines.append(f"    %{row['launch']:<{width}} {row['phase']} {params[:40]:<40} {_where(row)}")
    lines += [f"  note: {note}" for note in report["notes"]]
    if report.get("gap"):
        lines += ["  " + line for line in gap_lines(report["gap"])]
    return lines


def gap_lines(gap: dict) -> list[str]:
    """The simulated step against its lower bound, the peak against the cap, and what each
    rewrite bought (`ScheduleResult.gap`)."""
    lines = [f"step {gap['step_ms']:.4f} ms, lower bound {gap['bound_ms']:.4f} ms, step/bound {gap['gap']:.3f}; "
             f"bound = max(compute {gap['compute_ms']:.4f} + exposed at the legal limit {gap['forced_ms']:.4f}, "
             f"busiest stream {gap['busiest_stream'] or '-'} {gap['busiest_stream_ms']:.4f}, "
             f"critical path {gap['critical_ms']:.4f}) ms; "
             f"exposed {gap['exposed_ms']:.4f} ms"]
    peak = f"peak memory {format_size(gap['peak_bytes'])}"
    if gap["cap_bytes"] is None:
        lines.append(f"{peak}, no cap")
    else:
        room = gap["cap_bytes"] - gap["peak_bytes"]
        where = f"{format_size(room)} under it" if room >= 0 else f"{format_size(-room)} OVER it"
        lines.append(f"{peak}, cap {format_size(gap['cap_bytes'])} ({where}; the peak was "
                     f"{format_size(gap['cap_set_at_bytes'])} when it was set)")
    for row in gap["bought"]:
        saved = row["step_saved_ms"]
        added = row["bytes_added"]
        lines.append(f"bought by {row['pass']}: {row['what']}: step "
                     f"{'?' if saved is None else f'{-saved:+.4f} ms'}, memory "
                     f"{'?' if added is None else '+' + format_size(added)}")
    return lines


def summary_line(report: dict) -> str:
    rows = report["gathers"]
    phases = collections.Counter(row["phase"] for row in rows if row["moved"])
    held = collections.Counter(row["reason"] for row in rows if not row["moved"] and row["reason"])
    earlier = sum(bool(row.get("earlier")) for row in rows)
    sunk = sum(s.get("sunk", 0) for k, s in report["passes"].items() if k.split("{")[0].split("#")[0] == "sink")
    text = (f"  {len(rows)} gathers: {sum(phases.values())} moved "
            f"({', '.join(f'{p} {n}' for p, n in sorted(phases.items())) or 'none'}), {sunk} nodes sunk")
    if earlier:
        text += f"; {earlier} left where an earlier run moved them"
    if held:
        text += "; stayed: " + ", ".join(f"{r} {n}" for r, n in sorted(held.items()))
    return text


def explain_text(done, original=None) -> str:
    """What `fxsched explain` prints for a ScheduleResult: the summary, then per gather moved or
    not, where to, and why. With the GraphModule it was scheduled from, also how far each moved."""
    before = {n.name: i for i, n in enumerate(original.graph.nodes)} if original is not None else None
    after = {n.name: i for i, n in enumerate(done.graph_module.graph.nodes)}
    report = done.report
    lines = [summary_line(report).strip(), *gap_lines(report["gap"]), *explain_lines(report, before, after)]
    return "\n".join(lines)


def explain_lines(report: dict, before: dict[str, int] | None, after: dict[str, int]) -> list[str]:
    """For each gather: moved or not, where to, and why (with `before`, how far); then the program's notes."""
    lines = []
    for row in report["gathers"]:
        head = (f"%{row['launch']} ({row['phase']}, {row['role']}, {', '.join(row['params']) or 'no parameter'}"
                f"{', bucket ' + row['bucket'] if row['bucket'] else ''}, "
                f"{'size unknown' if row['nbytes'] is None else format_size(row['nbytes'])})")
        lines.append(head)
        name = row["launch"]
        if row["moved"]:
            where = f"launches just before %{row['anchor']}" if row["anchor"] else "moved by an earlier run"
            if before is not None:
                where += f" ({before.get(name, 0) - after.get(name, 0)} nodes earlier than traced)"
            lines.append(f"    moved: {where}")
        elif row.get("earlier"):
            why = f": this run: {row['reason']}: {explain_hold(row['reason'])}" if row["reason"] else ""
            lines.append(f"    stays where an earlier run moved it (no pass moves a launch later){why}")
        elif row["reason"]:
            lines.append(f"    stays: {row['reason']}: {explain_hold(row['reason'])}")
        else:
            lines.append("    stays: no pass of the pipeline anchored it")
    if not report["gathers"]:
        lines.append("no FSDP gathers (untagged graph? try --structural)")
    lines += [f"note: {note}" for note in report["notes"]]
    return lines


def format_size(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


# ---- simulation -----------------------------------------------------------------------


def simulate_before_after(gm, done, hardware: str, record: bool):
    """(before, after) Simulations of `gm` as traced and as scheduled (`done`, a ScheduleResult)."""
    from . import cost
    from .lowering import lower

    before = cost.simulate(lower(gm), hardware, record=record)
    after = cost.simulate(done.program, hardware, record=record)
    return before, after


def write_trace(path: str, before, after) -> None:
    """One Chrome trace with the schedule before (process 1) and after (process 2) the pipeline."""
    from . import cost

    first = cost.chrome_trace(before, label="before (as traced)", pid=1)
    second = cost.chrome_trace(after, label="after (scheduled)", pid=2)
    trace = {"traceEvents": first["traceEvents"] + second["traceEvents"], "displayTimeUnit": "ms",
             "otherData": {"before": first.get("otherData"), "after": second.get("otherData")}}
    with open(path, "w") as f:
        json.dump(trace, f)


def write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
