"""The peer-cap table (issue 17): fxsched under a hard peak-memory cap set at each peer's peak.

For one workload and one peer (Inductor reorder-only or with its bucketing, torchtitan's joint
bucketing or its autobucketing), the peer's simulated step, peak and exposed communication;
fxsched run with `fxsched.schedule(gm, pipeline, max_peak_gb=<the peer's peak>)` under every
pipeline of `CAP_PIPELINES` (with a cap set, bucket and unshard take it as their joint cap); and
fxsched's best step among the pipelines whose simulated peak stays at or under that peak. One
row per workload × peer, with the issue's goals: fxsched's step ≤ the peer's at the peer's peak,
and, against torchtitan's joint bucketing, exposed communication ≤ torchtitan's.

A workload is one graph or several run one after the other (Inductor's forward and backward):
times add, the peak is the larger, and one pipeline schedules all of them. fxsched's result is
scored on its own program (bucket and unshard change the node set), with the same cost model
as the peers (`op_costs(program, model)` per program), and checked as the peers are: its program
verifies, and between the nodes it kept the original program's rules hold.

`bench_clients.py` and `bench_schedules.py` call `capped_runs` after their peers ran and put
`peer_rows` of it into their output (`--no-cap-table` skips it).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable
from typing import Any

from fxsched.cost import format_bytes, op_costs, simulate
from fxsched.ir import Launch, Program, VerifyError, verify
from fxsched.ir.rewriter import Rewriter

GIB = 1 << 30
# gradients-first and fill-waits reorder compute (passes/gradients_first.py, fill_waits.py): not
# in `default` (gradients-first raises the peak)
# unorder-reduce-scatters lets FSDP's reduce-scatters of a group run in any order among themselves
# (passes/unorder_reduce_scatters.py): opt-in, right where every rank runs the same pipeline
CAP_PIPELINES = ("default", "default,bucket", "default,unshard", "default,bucket,unshard",
                 "gradients-first,default,fill-waits", "gradients-first,default,bucket,unshard,fill-waits",
                 "unorder-reduce-scatters,gradients-first,default,fill-waits",
                 "unorder-reduce-scatters,gradients-first,default,bucket,unshard,fill-waits")
#: the peers a capped row is made for, in table order
CAP_PEERS = ("inductor", "inductor-bucketing", "torchtitan-autobucketing", "torchtitan")
#: the joint-bucketing peer whose exposed communication the issue's second goal compares with
TITAN = "torchtitan"


def score_scheduled(original: Program, scheduled: Program, model, broken_rules) -> dict[str, Any]:
    """Step, exposed, bound and peak of fxsched's `scheduled` program, priced by `model` as the
    peers are; legal when it verifies and keeps the original program's rules between the nodes
    both have (`broken_rules(original, names)`: bench_schedules' rule count)."""
    sim = simulate(scheduled, costs=op_costs(scheduled, model))
    # reduce-scatters a pipeline marked unordered (unorder-reduce-scatters) are held to the
    # original's rules with the same marks: its collective-order edges redone for them
    marked = [n for n in scheduled.schedule.names() if n in original.graph
              and isinstance(op := scheduled.op(n), Launch) and op.unordered]
    if marked:
        original = original.copy()
        Rewriter(original).unorder(marked)
    problems = dict(broken_rules(original, scheduled.schedule.names()))
    try:
        verify(scheduled)
    except VerifyError as error:
        problems["own program"] = len(error.problems)
    return {"step_ms": sim.step_ms, "exposed_ms": sim.exposed_ms, "bound_ms": sim.lower_bound_ms,
            "peak_bytes": sim.peak_bytes, "legal": not problems, "problems": problems}


def capped_runs(graphs: list[Callable[[str, float], tuple[Any, float]]], originals: list[Program],
                caps: Iterable[int], model, broken_rules,
                pipelines: Iterable[str] = CAP_PIPELINES) -> dict[int, dict[str, dict[str, Any]]]:
    """{cap bytes: {pipeline: score}} of one workload made of `graphs`.

    `graphs[i](pipeline, max_peak_gb)` schedules graph i (as its benchmark prepares it) and
    returns (ScheduleResult, CPU seconds); `originals[i]` is its lowered, unscheduled program.
    Scores add over the graphs (peak: the largest); a pipeline that fails is recorded as
    skipped with its error."""
    out: dict[int, dict[str, dict[str, Any]]] = {}
    for cap in sorted(set(int(c) for c in caps)):
        out[cap] = {}
        for pipeline in pipelines:
            parts, cpu = [], 0.0
            try:
                for run, original in zip(graphs, originals):
                    done, seconds = run(pipeline, cap / GIB)
                    cpu += seconds
                    parts.append(score_scheduled(original, done.program, model, broken_rules))
                    del done
                    gc.collect()
            except Exception as exc:  # noqa: BLE001 — recorded; the other pipelines stand
                out[cap][pipeline] = {"skipped": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
                continue
            problems: dict[str, int] = {}
            for p in parts:
                for k, v in p["problems"].items():
                    problems[k] = problems.get(k, 0) + v
            out[cap][pipeline] = {
                "step_ms": sum(p["step_ms"] for p in parts), "exposed_ms": sum(p["exposed_ms"] for p in parts),
                "bound_ms": sum(p["bound_ms"] for p in parts), "peak_bytes": max(p["peak_bytes"] for p in parts),
                "legal": not problems, "problems": problems, "cpu_s": cpu}
            print(f"    cap {format_bytes(cap)} {pipeline:24s} step={out[cap][pipeline]['step_ms']:9.3f}ms "
                  f"exposed={out[cap][pipeline]['exposed_ms']:8.3f}ms peak={format_bytes(out[cap][pipeline]['peak_bytes'])} "
                  f"legal={not problems} cpu={cpu:.2f}s", flush=True)
    return out


def timed(schedule: Callable[[], Any]) -> tuple[Any, float]:
    """(schedule(), the CPU seconds it took in this process)."""
    start = time.process_time()
    done = schedule()
    return done, time.process_time() - start


def peer_caps(schedules: dict[str, dict[str, Any]]) -> dict[str, int]:
    """{peer: its simulated peak in bytes} for the peers that ran on this workload."""
    return {p: int(schedules[p]["peak_bytes"]) for p in CAP_PEERS
            if p in schedules and "skipped" not in schedules[p]}


def peer_rows(workload: str, schedules: dict[str, dict[str, Any]],
              capped: dict[int, dict[str, dict[str, Any]]], uncapped: str | None = None) -> list[dict[str, Any]]:
    """One row per peer of this workload: the peer, fxsched's best pipeline at ≤ its peak, the goals.

    `uncapped`: the benchmark's own name for fxsched's default pipeline run with no cap, shown
    beside the capped runs (not counted as one of them): where its peak is within the peer's
    and its step shorter than every capped run's, the cap cost step time it did not have to."""
    rows = []
    plain = schedules.get(uncapped) if uncapped else None
    for peer, cap in peer_caps(schedules).items():
        theirs = schedules[peer]
        runs = capped.get(cap, {})
        within = {p: r for p, r in runs.items() if "skipped" not in r and r["peak_bytes"] <= cap}
        best = min(within, key=lambda p: (within[p]["step_ms"], CAP_PIPELINES.index(p)
                                          if p in CAP_PIPELINES else 99), default=None)
        row: dict[str, Any] = {
            "workload": workload, "peer": peer, "peer_step_ms": theirs["step_ms"],
            "peer_exposed_ms": theirs["exposed_ms"], "peer_peak_bytes": cap, "peer_legal": theirs["legal"],
            "peer_problems": theirs.get("problems") or {}, "peer_buckets": bool(theirs.get("node_set")),
            "runs": runs, "best": best,
        }
        if plain and "skipped" not in plain:
            row["uncapped"] = {k: plain[k] for k in ("step_ms", "exposed_ms", "peak_bytes")}
        if best is not None:
            ours = within[best]
            row.update(step_ms=ours["step_ms"], exposed_ms=ours["exposed_ms"], peak_bytes=ours["peak_bytes"],
                       legal=ours["legal"], ratio=ours["step_ms"] / theirs["step_ms"],
                       step_met=ours["step_ms"] <= theirs["step_ms"] * (1 + 1e-9))
            least = min(within, key=lambda p: within[p]["exposed_ms"])
            row["least_exposed"] = (least, within[least]["exposed_ms"])
            if peer == TITAN:
                row["exposed_met"] = ours["exposed_ms"] <= theirs["exposed_ms"] * (1 + 1e-9)
            if "uncapped" in row:
                u = row["uncapped"]
                # the benchmarks round their own rows' steps to 0.1 µs: shorter by more than that
                row["cap_cost"] = u["peak_bytes"] <= cap and u["step_ms"] < ours["step_ms"] - 1e-4
        rows.append(row)
    return rows


def _legal(ok: bool, problems: dict[str, int]) -> str:
    return "yes" if ok else "NO (" + ", ".join(f"{k} ×{v}" for k, v in problems.items()) + ")"


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| workload | peer | peer legal | peer step ms | peer peak | peer exposed ms | fxsched best at ≤ peak "
             "(pipeline) | step ms | peak | exposed ms | fxsched / peer step | goal | default, no cap: step ms (peak) |",
             "|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|---|---|"]
    for r in rows:
        head = (f"| {r['workload']} | {r['peer']}{' (buckets)' if r['peer_buckets'] else ''} | "
                f"{_legal(r['peer_legal'], r['peer_problems'])} | {r['peer_step_ms']:.3f} | "
                f"{format_bytes(r['peer_peak_bytes'])} | {r['peer_exposed_ms']:.3f} |")
        plain = ""
        if "uncapped" in r:
            u = r["uncapped"]
            flag = " **shorter, within the peak**" if r.get("cap_cost") else ""
            if r["best"] is None and u["peak_bytes"] <= r["peer_peak_bytes"]:
                flag = " **within the peak**"
            plain = f"{u['step_ms']:.3f} ({format_bytes(u['peak_bytes'])}){flag}"
        if r["best"] is None:
            why = "; ".join(f"{p}: {v.get('skipped') or 'peak ' + format_bytes(v['peak_bytes'])}"
                            for p, v in r["runs"].items())
            lines.append(f"{head} none within the peak ({why}) | | | | | MISSED | {plain} |")
            continue
        goal = "step MET" if r["step_met"] else "step MISSED"
        if "exposed_met" in r:
            goal += ", exposed " + ("MET" if r["exposed_met"] else "MISSED")
        legal = "" if r["legal"] else " (ILLEGAL)"
        lines.append(f"{head} `{r['best']}`{legal} | {r['step_ms']:.3f} | {format_bytes(r['peak_bytes'])} | "
                     f"{r['exposed_ms']:.3f} | {r['ratio']:.3f} | {goal} | {plain} |")
    return "\n".join(lines) + "\n"


def runs_markdown(rows: list[dict[str, Any]]) -> str:
    """Every capped run: workload × cap × pipeline (the cap is shared by peers of the same peak)."""
    lines = ["| workload | cap (peers) | pipeline | step ms | exposed ms | peak | legal | CPU s |",
             "|---|---|---|---:|---:|---:|---|---:|"]
    seen = set()
    for r in rows:
        key = (r["workload"], r["peer_peak_bytes"])
        if key in seen:
            continue
        seen.add(key)
        peers = ", ".join(x["peer"] for x in rows if (x["workload"], x["peer_peak_bytes"]) == key)
        for p, v in r["runs"].items():
            head = f"| {r['workload']} | {format_bytes(r['peer_peak_bytes'])} ({peers}) | `{p}` |"
            if "skipped" in v:
                lines.append(f"{head} skipped ({v['skipped']}) | | | | |")
                continue
            lines.append(f"{head} {v['step_ms']:.3f} | {v['exposed_ms']:.3f} | {format_bytes(v['peak_bytes'])} | "
                         f"{_legal(v['legal'], v['problems'])} | {v['cpu_s']:.2f} |")
    return "\n".join(lines) + "\n"


def goals(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's two peer goals, counted."""
    done = [r for r in rows if r["best"] is not None]
    met = [r for r in done if r["step_met"]]
    out = [f"- fxsched step ≤ the peer's at the peer's peak: met on {len(met)} of {len(rows)} workload × peer rows"
           + (f"; missed: " + ", ".join(f"{r['workload']} vs {r['peer']} ({r['ratio']:.3f}x)"
                                        for r in done if not r["step_met"]) if len(met) < len(done) else "")
           + ("; no fxsched schedule within the peak: " + ", ".join(f"{r['workload']} vs {r['peer']}"
                                                                   for r in rows if r["best"] is None)
              if len(done) < len(rows) else "")]
    costly = [r for r in done if r.get("cap_cost")] + [
        r for r in rows if r["best"] is None and "uncapped" in r and r["uncapped"]["peak_bytes"] <= r["peer_peak_bytes"]]
    if costly:
        out.append("- the cap cost step time: the default pipeline with no cap stays within the peer's peak and is "
                   "shorter than every capped run on " + ", ".join(
                       f"{r['workload']} vs {r['peer']} ({r['uncapped']['step_ms']:.3f} against "
                       + (f"{r['step_ms']:.3f} ms)" if r["best"] else "none within the peak)") for r in costly))
    titan = [r for r in done if "exposed_met" in r]
    if titan:
        out.append("- exposed communication ≤ torchtitan's at ≤ its peak: " + "; ".join(
            f"{r['workload']} {r['exposed_ms']:.3f} vs {r['peer_exposed_ms']:.3f} ms "
            f"({'MET' if r['exposed_met'] else 'MISSED'}"
            + (f"; least exposed within the peak: `{r['least_exposed'][0]}` {r['least_exposed'][1]:.3f} ms"
               if r["least_exposed"][0] != r["best"] else "") + ")" for r in titan))
    return out


def add_arguments(parser) -> None:
    parser.add_argument("--no-cap-table", action="store_true",
                        help="skip the peer-cap table (fxsched capped at each peer's simulated peak)")
    parser.add_argument("--cap-pipelines", nargs="*", default=list(CAP_PIPELINES),
                        help="the pipelines run under each peer's peak (bench/peer_cap.py)")


def write(rows: list[dict[str, Any]], out: str, name: str, machine: str, hardware: str) -> None:
    """bench/out/{name}_cap.{json,md}: the peer-cap rows of every workload that has them."""
    import json
    import os

    table = [r for row in rows for r in row.get("capped", [])]
    if not table:
        return
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}_cap.json"), "w") as f:
        json.dump({"machine": machine, "hardware": hardware, "pipelines": list(CAP_PIPELINES), "rows": table,
                   "goals": goals(table)}, f, indent=1, default=str)
    text = (f"Simulated on {hardware} (roofline); fxsched = `fxsched.schedule(gm, pipeline, max_peak_gb=<the "
            f"peer's simulated peak>)`, the best step among {', '.join(f'`{p}`' for p in CAP_PIPELINES)} whose "
            f"peak stays at or under it; {machine}.\n\n" + markdown(table) + "\nGoals:\n\n" + "\n".join(goals(table))
            + "\n\nEvery capped run:\n\n" + runs_markdown(table))
    with open(os.path.join(out, f"{name}_cap.md"), "w") as f:
        f.write(text)
    print(text, flush=True)
