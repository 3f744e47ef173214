"""Benchmark: schedules scored by the simulator — as emitted, fxsched's reference and default
pipelines, and Inductor's overlap scheduler (reorder only, and with its FSDP pre-bucketing) —
on every built-in model and on generated graphs.

    .venv/bin/python bench/bench_schedules.py                      # models + 10k, 30k, 100k
    .venv/bin/python bench/bench_schedules.py --sizes 10000 30000 --peer-timeout 900
    .venv/bin/python bench/bench_schedules.py --no-models --sizes 10000 --traces

Writes bench/out/schedules.{md,json} (and, with --traces, Chrome traces under bench/out/traces/).

Each workload is lowered once; its cost model (Roofline on --hardware) prices every op once and
the same costs score every schedule. Each schedule is checked before it is scored: the FX graph
lints, and its order — put into the original program — passes `ir.verify` (a topological order
of data + effect edges, phases in order, frees after every reader). A schedule that breaks a
rule is still scored but marked ILLEGAL with the broken rules counted. A peer that changes the
node set (Inductor's FSDP pre-bucketing) is verified on its own lowering instead.

Peers run in a forked child with a timeout (--peer-timeout); a peer that runs out of time or
fails is recorded as "skipped (reason)". Then the peer-cap table (`cap_table`, bench/peer_cap.py):
fxsched under a hard cap at each peer's simulated peak; bench/out/schedules_cap.{md,json}.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import multiprocessing
import os
import pickle
import platform
import sys
import tempfile
import time
import traceback
from typing import Any

import torch
from torch import fx

import fxsched
from fxsched.cost.limits import CAUSES, exposure_causes
from fxsched.cost import (Roofline, Simulation, collective_kind, format_bytes, hardware, op_costs, simulate,
                          write_chrome_trace)
from fxsched.front.fsdp import fsdp_joint_graph
from fxsched.front.generate import generate_graph
from fxsched.ir import (BACKWARD, ENTRY, Cast, Compute, CopyOut, Input, Launch, Marker, Output, Phase, Program,
                        Schedule, VerifyError, verify, Barrier)
from fxsched.lowering import lower
from fxsched.lowering.targets import target_name
from fxsched.models import MODELS, build_model

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peers import INDUCTOR_OPTIONS, inductor_signature, run_inductor, setup_inductor  # noqa: E402
import peer_cap  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
WORLD = 2


# ---- workloads -------------------------------------------------------------------------

def model_workloads(args) -> list[tuple[str, Any]]:
    items = []
    for name in sorted(MODELS):
        for layers in args.layers:
            for buckets in (False, True):
                label = f"{name} L{layers}{' buckets' if buckets else ''}"

                def make(name=name, layers=layers, buckets=buckets):
                    kwargs = {"batch": args.batch, "seq": args.seq}
                    module, inputs, loss = build_model(name, layers=layers, width=args.width, seed=0, **kwargs)
                    front = fsdp_joint_graph(module, inputs, lambda m, *xs: loss(m(*xs), *xs), WORLD,
                                             buckets="per-module" if buckets else None)
                    return front.gm
                items.append((label, make))
    return items


def generated_workloads(args) -> list[tuple[str, Any]]:
    items = []
    for size in args.sizes:
        for buckets in ((False, True) if args.gen_buckets else (False,)):
            label = f"generated {size // 1000}k{' buckets' if buckets else ''}"

            def make(size=size, buckets=buckets):
                return generate_graph(size, seed=0, buckets=buckets, hidden=args.width, seq=args.seq,
                                      batch=args.batch, heads=8)
            items.append((label, make))
    return items


# ---- checking and scoring --------------------------------------------------------------

def with_markers(program: Program, names: list[str]) -> list[str]:
    """A peer's FX order with the IR's virtual markers put back: `^entry` before the first
    non-input, `^backward` before the first backward op."""
    ops = {n: program.op(n) for n in program.schedule}
    order = [n for n in names if not isinstance(ops[n], Marker)]
    if ENTRY in ops:
        at = next((i for i, n in enumerate(order) if not isinstance(ops[n], Input)), len(order))
        order.insert(at, ENTRY)
    if BACKWARD in ops:
        at = next((i for i, n in enumerate(order) if not isinstance(ops[n], (Input, Marker, Output))
                   and ops[n].phase is Phase.BACKWARD), None)
        order.insert(at if at is not None else len(order) - 1, BACKWARD)
    return order


def check_order(program: Program, names: list[str]) -> tuple[Program, list[str]]:
    """The program with `names` as its schedule, and `ir.verify`'s problems (empty = legal)."""
    candidate = program.copy()
    candidate.schedule = Schedule(with_markers(program, names))
    try:
        verify(candidate)
        return candidate, []
    except VerifyError as error:
        return candidate, error.problems


def broken_rules(program: Program, names: list[str]) -> dict[str, int]:
    """Which rules an order breaks, counted from the program's own edges (not from verify's
    wording): `data`, `effect (<why>)` per effect rule, and `phase order` for a forward op
    after a backward one. Edges to nodes missing from `names` are skipped (a peer that
    changed the node set is checked on the nodes it kept)."""
    pos = {n: i for i, n in enumerate(names)}
    counts: collections.Counter[str] = collections.Counter()
    for u, v, e in program.graph.edges(data=True):
        if u in pos and v in pos and pos[u] >= pos[v]:
            counts["data" if e["kind"] == "data" else f"effect ({e['why']})"] += 1
    seen_backward = False
    for n in names:
        op = program.op(n) if n in program.graph else None
        if op is None or isinstance(op, (Input, Marker, Output)):
            continue
        if op.phase is Phase.BACKWARD:
            seen_backward = True
        elif seen_backward:
            counts["phase order"] += 1
    return dict(counts)


def rules(program: Program, names: list[str], problems: list[str]) -> dict[str, int]:
    """The broken rules of an order `verify` rejected (`problems`); {} when it passed."""
    if not problems:
        return {}
    return broken_rules(program, names) or {"other": len(problems)}


def _compute_before(program: Program) -> dict[str, int]:
    """For each gather launch: how many computations precede it in the schedule."""
    seen, out = 0, {}
    for op in program.ops():
        if isinstance(op, (Compute, Cast, CopyOut, Barrier)):
            seen += 1
        elif isinstance(op, Launch) and collective_kind(op.target) == "all_gather":
            out[op.name] = seen
    return out


def gathers_moved(original: Program, scheduled: Program) -> int:
    """Gathers with a different number of computations before them than in the original order."""
    before, after = _compute_before(original), _compute_before(scheduled)
    return sum(1 for name, n in after.items() if name in before and before[name] != n)


def exposure_kind(op: Launch) -> str:
    if op.role is not None:
        return op.role.value
    return f"{collective_kind(op.target)} ({op.phase.value})"


def score(sim: Simulation, program: Program) -> dict[str, Any]:
    by_kind: collections.Counter[str] = collections.Counter()
    for name, ms in sim.exposed_by_collective.items():
        by_kind[exposure_kind(program.op(name))] += ms
    return {
        "step_ms": round(sim.step_ms, 4), "lower_bound_ms": round(sim.lower_bound_ms, 4),
        "ratio": round(sim.ratio, 4), "exposed_ms": round(sim.exposed_ms, 4),
        "compute_ms": round(sim.compute_ms, 4), "comm_ms": round(sim.comm_ms, 4),
        "peak_bytes": sim.peak_bytes, "max_inflight_bytes": sim.max_inflight_bytes,
        "exposed_by_kind_ms": {k: round(v, 4) for k, v in sorted(by_kind.items())},
    }


def fxsched_pipelines() -> list[tuple[str, str]]:
    """("fxsched", the reference pipeline) and, where the package has one, ("fxsched-default", its default)."""
    out = [("fxsched", fxsched.REFERENCE_PIPELINE)]
    default = getattr(fxsched, "DEFAULT_PIPELINE", None)
    if default and default != fxsched.REFERENCE_PIPELINE:
        out.append(("fxsched-default", default))
    return out


# ---- the Inductor peer, in a child process ---------------------------------------------

def _estimator(gm: fx.GraphModule, costs: dict[str, float], model: Roofline):
    """custom_runtime_estimation(node, override_size) -> ms from our cost model. Nodes the
    original program does not have (made by bucketing) are priced by lowering their graph
    once; a re-sized collective by the collective formula."""
    cache: dict[str, Any] = {"key": None, "costs": {}, "seconds": 0.0}

    def estimate(node: fx.Node, override_size: int | None) -> float | None:
        if override_size is not None and node.op == "call_function" and "_c10d_functional" in target_name(node):
            group_size = next((a for a in node.args[1:] if isinstance(a, int) and not isinstance(a, bool)), None)
            return model.collective_ms(collective_kind(target_name(node)), int(override_size), group_size)
        if node.name in costs:
            return costs[node.name]
        key = (id(node.graph), len(node.graph.nodes))
        if cache["key"] != key:
            start = time.perf_counter()
            try:
                program = lower(fx.GraphModule(gm, node.graph))
                cache["costs"] = op_costs(program, model)
            except Exception:  # noqa: BLE001 — Inductor falls back to its own roofline
                cache["costs"] = {}
            cache["key"] = key
            cache["seconds"] += time.perf_counter() - start
        return cache["costs"].get(node.name)

    estimate.cache = cache
    return estimate


def _inductor_child(gm, costs, model, options, original_names, path):
    try:
        torch.set_num_threads(1)
        setup_inductor(model.hw.hbm_gbps, model.hw.tflops("f32"))
        estimate = _estimator(gm, costs, model)
        out, seconds = run_inductor(gm, estimate, **options)
        names = [n.name for n in out.graph.nodes]
        # the clock ran while our estimator lowered bucketed graphs to price new nodes: not Inductor's time
        result: dict[str, Any] = {"seconds": seconds - estimate.cache["seconds"], "names": names,
                                  "estimator_s": estimate.cache["seconds"]}
        if set(names) != original_names:
            program = lower(out)
            try:
                verify(program)
                result["own_problems"] = []
            except VerifyError as error:
                result["own_problems"] = error.problems
            program.payload, program.origin = {}, None
            result["program"] = program
            result["collectives"] = collections.Counter(
                collective_kind(op.target) for op in program.ops() if isinstance(op, Launch))
        with open(path, "wb") as f:
            pickle.dump(result, f)
    except BaseException:  # noqa: BLE001 — reported to the parent
        with open(path, "wb") as f:
            pickle.dump({"error": traceback.format_exc(limit=4)}, f)


def run_forked(target, args: tuple, timeout: float) -> dict[str, Any]:
    """`target(*args, path)` in a forked child that pickles its result dict to `path` (or
    {"error": traceback}): the result, or {"skipped": why} when it ran over `timeout` seconds,
    died, or raised (then with its "traceback")."""
    fd, path = tempfile.mkstemp(suffix=".pkl")
    os.close(fd)
    child = multiprocessing.get_context("fork").Process(target=target, args=(*args, path))
    start = time.perf_counter()
    child.start()
    child.join(timeout)
    try:
        if child.is_alive():
            child.kill()
            child.join()
            return {"skipped": f"over {timeout:.0f} s"}
        if child.exitcode != 0:
            return {"skipped": f"child exited with {child.exitcode} after {time.perf_counter() - start:.0f} s"}
        with open(path, "rb") as f:
            result = pickle.load(f)
        if "error" in result:
            return {"skipped": "error: " + result["error"].strip().splitlines()[-1], "traceback": result["error"]}
        return result
    finally:
        os.unlink(path)


def run_peer_forked(gm, costs, model, options, timeout: float) -> dict[str, Any]:
    original_names = {n.name for n in gm.graph.nodes}
    return run_forked(_inductor_child, (gm, costs, model, options, original_names), timeout)


# ---- one workload ------------------------------------------------------------------------

def run_workload(label: str, make, args, model: Roofline) -> dict[str, Any]:
    t = time.perf_counter()
    gm = make()
    build_s = time.perf_counter() - t
    program = lower(gm)
    verify(program)
    costs = op_costs(program, model)
    gathers = sum(1 for op in program.ops() if isinstance(op, Launch) and collective_kind(op.target) == "all_gather")
    row: dict[str, Any] = {"workload": label, "nodes": len(gm.graph.nodes), "gathers": gathers,
                           "build_s": round(build_s, 2), "schedules": {}}
    traces = os.path.join(args.out, "traces") if args.traces else None

    def record(name: str, prog: Program, entry: dict[str, Any], c=costs):
        sim = simulate(prog, costs=c, record=bool(traces))
        entry.update(score(sim, prog))
        if entry.get("legal"):  # legal slots are read off the program's rules: only for orders that keep them
            entry["exposed_by_cause_ms"] = {k: round(v, 4) for k, v in exposure_causes(prog, sim, c).items()}
        if traces:
            os.makedirs(traces, exist_ok=True)
            slug = label.replace(" ", "_")
            write_chrome_trace(sim, os.path.join(traces, f"{slug}.{name}.trace.json"), label=f"{label}: {name}")
        row["schedules"][name] = entry

    # as the front emits it
    record("emitted", program, {"compile_s": 0.0, "legal": True, "moved": 0})

    # fxsched: the reference pipeline (HyperParallel's behaviour), and the default (cost-guided) one
    for name, pipeline in fxsched_pipelines():
        t = time.perf_counter()
        done = fxsched.schedule(gm, pipeline, cost_model=model)
        seconds = time.perf_counter() - t
        done.graph_module.graph.lint()
        order = done.program.schedule.names()
        scheduled, problems = check_order(program, order)
        stats = done.result.stats()
        prefetch = next((v for k, v in stats.items() if k.startswith("prefetch")), {})
        record(name, scheduled, {
            "compile_s": round(seconds, 3), "legal": not problems, "problems": rules(program, order, problems),
            "moved": gathers_moved(program, scheduled), "pipeline": str(pipeline),
            "prefetched": {"forward": prefetch.get("forward"), "backward": prefetch.get("backward")},
        })
        del done
        gc.collect()
        if args.no_verify_timing:
            t = time.perf_counter()
            fxsched.schedule(gm, pipeline, cost_model=model, verify_each=False)
            row["schedules"][name]["compile_s_no_verify"] = round(time.perf_counter() - t, 3)
            gc.collect()

    # Inductor's overlap scheduler
    for peer in args.peers:
        if row["nodes"] > args.peer_max_nodes:
            row["schedules"][peer] = {"skipped": f"over --peer-max-nodes {args.peer_max_nodes}"}
            continue
        options = dict(max_in_flight_gb=args.max_in_flight_gb,
                       pre_bucketing_fsdp_collectives=(peer == "inductor-bucketing"))
        result = run_peer_forked(gm, costs, model, options, args.peer_timeout)
        if "skipped" in result:
            row["schedules"][peer] = {k: v for k, v in result.items() if k in ("skipped", "traceback")}
            print(f"  {peer}: skipped ({result['skipped']})", flush=True)
            continue
        entry: dict[str, Any] = {"compile_s": round(result["seconds"], 3)}
        if "program" in result:
            own = result["program"]
            broken = broken_rules(program, result["names"])
            if result["own_problems"]:
                broken["own lowering"] = len(result["own_problems"])
            kept = len(set(result["names"]) & set(program.schedule))
            entry.update(legal=not broken, problems=broken, moved=None,
                         kept_nodes=kept,
                         node_set="changed (bucketing): its own lowering verified, and the original rules "
                                  "checked between the nodes it kept",
                         collectives=dict(result["collectives"]))
            record(peer, own, entry, c=op_costs(own, model))
        else:
            scheduled, problems = check_order(program, result["names"])
            entry.update(legal=not problems, problems=rules(program, result["names"], problems),
                         moved=gathers_moved(program, scheduled))
            record(peer, scheduled, entry)
    cap_table(row, gm, program, model, args)
    return row


def cap_table(row: dict[str, Any], gm: fx.GraphModule, program: Program, model: Roofline, args) -> None:
    """row["capped"]: one row per Inductor peer that ran, with fxsched's best pipeline under a hard
    cap at that peer's simulated peak (bench/peer_cap.py)."""
    caps = peer_cap.peer_caps(row["schedules"])
    if args.no_cap_table or not caps or row["nodes"] > args.cap_max_nodes:
        return

    def run(pipeline, gb):
        return peer_cap.timed(lambda: fxsched.schedule(gm, pipeline, cost_model=model, max_peak_gb=gb))
    print(f"  capped at the peers' peaks ({', '.join(f'{p} {_mem(c)}' for p, c in caps.items())}):", flush=True)
    capped = peer_cap.capped_runs([run], [program], caps.values(), model, broken_rules, args.cap_pipelines)
    row["capped"] = peer_cap.peer_rows(row["workload"], row["schedules"], capped, uncapped="fxsched-default")


# ---- report --------------------------------------------------------------------------------

def _mem(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "| workload | nodes | schedule | legal | compile s | step ms | exposed ms | step / bound | peak memory | gathers moved |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        for name, s in row["schedules"].items():
            head = f"| {row['workload']} | {row['nodes']:,} | {name} |"
            if "skipped" in s:
                lines.append(f"{head} skipped ({s['skipped']}) | | | | | | |")
                continue
            legal = "yes" if s["legal"] else "ILLEGAL: " + ", ".join(f"{k} ×{v}" for k, v in s["problems"].items())
            if s.get("node_set"):
                legal += f"; node set changed (bucketing: {_collectives(s)})"
            moved = "-" if s.get("moved") is None else f"{s['moved']}/{row['gathers']}"
            lines.append(f"{head} {legal} | {s['compile_s']:.2f} | {s['step_ms']:.3f} | {s['exposed_ms']:.3f} | "
                         f"{s['ratio']:.3f} | {_mem(s['peak_bytes'])} | {moved} |")
    return "\n".join(lines) + "\n"


def exposure_table(result: dict[str, Any]) -> str:
    """Where each schedule's exposed communication goes, by collective role (ms)."""
    kinds = sorted({k for row in result["rows"] for s in row["schedules"].values()
                    for k in s.get("exposed_by_kind_ms", {})})
    lines = ["| workload | schedule | " + " | ".join(kinds) + " |", "|---|---|" + "---:|" * len(kinds)]
    for row in result["rows"]:
        for name, s in row["schedules"].items():
            if "exposed_by_kind_ms" in s:
                by = s["exposed_by_kind_ms"]
                lines.append(f"| {row['workload']} | {name} | " +
                             " | ".join(f"{by[k]:.3f}" if k in by else "" for k in kinds) + " |")
    return "\n".join(lines) + "\n"


def causes_table(result: dict[str, Any]) -> str:
    """Where each legal schedule's exposed communication sits (`fxsched.cost.limits`), in ms."""
    lines = ["| workload | schedule | exposed | " + " | ".join(CAUSES) + " |", "|---|---|---:|" + "---:|" * len(CAUSES)]
    for row in result["rows"]:
        for name, s in row["schedules"].items():
            if "exposed_by_cause_ms" in s and name != "emitted":
                by = s["exposed_by_cause_ms"]
                lines.append(f"| {row['workload']} | {name} | {s['exposed_ms']:.3f} | " +
                             " | ".join(f"{by.get(k, 0.0):.3f}" for k in CAUSES) + " |")
    return "\n".join(lines) + "\n"


def _collectives(s: dict[str, Any]) -> str:
    c = s.get("collectives", {})
    return ", ".join(f"{v} {k}" for k, v in sorted(c.items()))


def goals(result: dict[str, Any]) -> list[str]:
    """The issue's goals, per workload and fxsched pipeline, against Inductor's reorder-only run
    (the first Inductor peer that ran)."""
    out = []
    for row in result["rows"]:
        peer_name, peer = next(((k, v) for k, v in row["schedules"].items()
                                if k.startswith("inductor") and "skipped" not in v), (None, None))
        if peer is None:
            continue
        for ours_name, ours in row["schedules"].items():
            if not ours_name.startswith("fxsched"):
                continue
            notes = []
            if row["nodes"] >= 30_000:
                speedup = peer["compile_s"] / ours["compile_s"] if ours["compile_s"] else float("inf")
                notes.append(f"compile {speedup:.1f}x faster ({'MET' if speedup >= 10 else 'MISSED'}, goal >= 10x)")
            step = ours["step_ms"] / peer["step_ms"] if peer["step_ms"] else 1.0
            peak = ours["peak_bytes"] / peer["peak_bytes"] if peer["peak_bytes"] else 1.0
            met = step <= 1.0 + 1e-9
            causes = ours.get("exposed_by_cause_ms")
            why = ""
            if not met and causes and causes["movable"] + causes["reorderable"] < 1e-6:
                why = ", every exposed ms of ours at the legal limit or behind a busy stream"
            notes.append(f"step time {step:.3f}x ({'MET' if met else 'MISSED'}{why})")
            notes.append(f"peak memory {peak:.3f}x ({'MET' if peak <= 1.0 + 1e-9 else 'MISSED'})")
            out.append(f"- {row['workload']}, {ours_name} vs {peer_name}"
                       f"{'' if peer['legal'] else ' (whose schedule breaks fxsched rules)'}: " + "; ".join(notes))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="*", default=[10_000, 30_000, 100_000],
                        help="generated graph sizes in nodes (none: skip generated graphs)")
    parser.add_argument("--no-models", action="store_true", help="skip the built-in models")
    parser.add_argument("--models", nargs="*", default=None, help="only these built-in models")
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4], help="model sizes in layers")
    parser.add_argument("--width", type=int, default=1024, help="model width / generated hidden size")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--gen-buckets", action="store_true", help="also generated graphs with buckets")
    parser.add_argument("--hardware", default="h100", help="h100, h200 or 910b")
    parser.add_argument("--peers", nargs="*", default=["inductor", "inductor-bucketing"],
                        choices=["inductor", "inductor-bucketing"],
                        help="inductor = reorder only (pre_bucketing_fsdp_collectives=False); "
                             "inductor-bucketing = Inductor's defaults (FSDP pre-bucketing on)")
    parser.add_argument("--peer-timeout", type=float, default=900.0, help="seconds per peer run")
    parser.add_argument("--peer-max-nodes", type=int, default=10**9, help="skip peers above this many nodes")
    parser.add_argument("--max-in-flight-gb", type=float, default=1.0,
                        help="Inductor's max_in_flight_gb (the reference pipeline's budget default is 1.0)")
    parser.add_argument("--no-verify-timing", action="store_true",
                        help="also time fxsched.schedule(..., verify_each=False) (verification between passes off)")
    parser.add_argument("--traces", action="store_true", help="write Chrome traces to bench/out/traces/")
    parser.add_argument("--out", default=OUT)
    peer_cap.add_arguments(parser)
    parser.add_argument("--cap-max-nodes", type=int, default=10**9, help="no peer-cap rows above this many nodes")
    args = parser.parse_args()

    model = Roofline(hardware(args.hardware))
    items = []
    if not args.no_models:
        items += [w for w in model_workloads(args) if args.models is None or w[0].split()[0] in args.models]
    items += generated_workloads(args)
    rows = []
    for label, make in items:
        print(f"{label} ...", flush=True)
        row = run_workload(label, make, args, model)
        rows.append(row)
        for name, s in row["schedules"].items():
            if "skipped" not in s:
                print(f"  {name:20s} legal={s['legal']!s:5s} compile={s['compile_s']:8.2f}s step={s['step_ms']:9.3f}ms "
                      f"exposed={s['exposed_ms']:9.3f}ms ratio={s['ratio']:.3f} peak={_mem(s['peak_bytes'])} "
                      f"moved={s.get('moved')}", flush=True)
        gc.collect()

    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}, "
                   f"torch {torch.__version__}",
        "hardware": model.hw.name, "cost_model": repr(model), "world_size": WORLD,
        "workload_shape": {"width": args.width, "seq": args.seq, "batch": args.batch, "dtype": "f32",
                           "model_layers": args.layers},
        "pipelines": dict(fxsched_pipelines()),
        "inductor": {"call": inductor_signature(), "options": dict(INDUCTOR_OPTIONS, max_in_flight_gb=args.max_in_flight_gb),
                     "timeout_s": args.peer_timeout},
        "rows": rows,
    }
    result["goals"] = goals(result)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "schedules.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    table = markdown(result)
    pipes = "; ".join(f"{n} = `{p}`" for n, p in fxsched_pipelines())
    header = (f"Simulated on {model.hw.name} (roofline, fp32, world size {WORLD}); width {args.width}, seq "
              f"{args.seq}, batch {args.batch}; {pipes}; Inductor "
              f"`schedule_overlap_bucketing` with our costs, max_in_flight_gb={args.max_in_flight_gb}, "
              f"compute_estimator=analytical; {result['machine']}.\n\n")
    with open(os.path.join(args.out, "schedules.md"), "w") as f:
        f.write(header + table + "\nGoals:\n\n" +
                "\n".join(result["goals"]) + "\n\nExposed communication by collective role (ms):\n\n" +
                exposure_table(result) + "\nExposed communication of the legal schedules by cause "
                "(ms; `fxsched.cost.limits`):\n\n" + causes_table(result))
    print(table)
    print("\n".join(result["goals"]))
    peer_cap.write(rows, args.out, "schedules", result["machine"], model.hw.name)


if __name__ == "__main__":
    main()
