"""Benchmark: which pipeline should be the default? Candidates under the default cap, every workload.

    .venv/bin/python bench/bench_default.py                          # everything (~1 h on 2 shared CPUs)
    .venv/bin/python bench/bench_default.py --only models compile   # some kinds of workload
    .venv/bin/python bench/bench_default.py --sizes 10000 --timeout 300

Writes bench/out/default.{json,md}. Each candidate pipeline (`--pipelines`; by default `default`,
`default,bucket`, `default,unshard`, `default,bucket,unshard` and `default,unshard,bucket`) runs
with nothing set for the cap: bucket and unshard then take the default cap, the simulated peak of
the program they get (neither may raise it). Per workload × candidate: the simulated step, the
gap report's lower bound and step / bound (`fxsched.schedule(...).gap`; the bound is read off the
candidate's own program, so a rewrite that removes communication lowers it too), exposed
communication, the simulated peak, and the CPU seconds of `fxsched.schedule` (lowering, passes
with verification after each, raising). Each run is a forked child with a time limit
(`--timeout`): a candidate that runs out of it is recorded as such. Costs: H100 roofline.

Workloads: the built-in models gpt / llama / encoder at widths 32 and 1024, 2 layers, with and
without per-module buckets (fxsched's FSDP front, world size 2); the torch.compile graphs of
`bench_clients.py` (forward + backward, their steps add); torchtitan's graphs (debug L2/L4, 1B
L2; needs torchtitan); generated graphs (`--sizes`, width 1024). Each workload says whether its
communication is at most its computation (the input's busiest communication stream against its
total compute, simulated): there the issue's goal is step / bound ≤ 1.02 with the default cap.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import sys
import time
import traceback
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fxsched  # noqa: E402
from fxsched.cost import Roofline, format_bytes, hardware, op_costs, simulate  # noqa: E402
from fxsched.lowering import lower  # noqa: E402

from bench_schedules import run_forked  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
CANDIDATES = ("default", "default,bucket", "default,unshard", "default,bucket,unshard", "default,unshard,bucket")
GOAL = 1.02


# ---- workloads: each a list of (graph module, how to prepare it) ---------------------------------

def _joint(gm):
    return [(gm, nullcontext)]


def model_workloads(args):
    from fxsched.front.fsdp import fsdp_joint_graph
    from fxsched.models import build_model

    for name in args.models:
        for width in args.widths:
            for buckets in (False, True):
                def make(name=name, width=width, buckets=buckets):
                    module, inputs, loss = build_model(name, layers=2, width=width, seed=0, batch=2, seq=256)
                    return _joint(fsdp_joint_graph(module, inputs, lambda m, *xs: loss(m(*xs), *xs), 2,
                                                   buckets="per-module" if buckets else None).gm)
                yield f"{name} L2 w{width}{' buckets' if buckets else ''}", make


def compile_workloads(args):
    import bench_clients
    from simple_fsdp import post_grad_graphs, simple_fsdp

    from fxsched.lowering.structural import tag_fsdp_collectives, untag_fsdp_gathers
    from fxsched.models import build_model

    @contextmanager
    def prepared(gm, phase):
        with bench_clients.uniform_phase(gm, phase):
            untag_fsdp_gathers(gm)
            tag_fsdp_collectives(gm, phase=phase)
            yield

    bench_clients._fake_group()
    for name in ("gpt", "llama"):
        for dtype in ("fp32", "bf16"):
            def make(name=name, dtype=dtype):
                module, inputs, loss = build_model(name, layers=2, width=1024, seed=0, seq=256, batch=2)
                simple_fsdp(module, 2, 0, param_dtype=torch.bfloat16 if dtype == "bf16" else None)
                graphs = post_grad_graphs(module, inputs, loss)
                return [(gm, lambda gm=gm, phase=phase: prepared(gm, phase)) for phase, gm in graphs.items()]
            yield f"compile {name} L2 {dtype}", make


def titan_workloads(args):
    try:
        import torchtitan.experiments.graph_trainer  # noqa: F401
    except ImportError as exc:
        print(f"torchtitan workloads skipped: {exc}", flush=True)
        return
    import bench_clients
    from titan import build_llama3, rematerialise, trace_step
    from torch.distributed.device_mesh import init_device_mesh

    bench_clients._fake_group()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
    for flavor, layers in (("debugmodel", 2), ("debugmodel", 4), ("1B", 2)):
        def make(flavor=flavor, layers=layers):
            module, inputs = build_llama3(mesh, flavor=flavor, layers=layers, batch=2, seq=2048)
            gm = rematerialise(trace_step(module, inputs)).gm
            from fxsched.lowering.structural import tag_fsdp_collectives
            tag_fsdp_collectives(gm)
            return _joint(gm)
        yield f"titan llama3-{'debug' if flavor == 'debugmodel' else flavor} L{layers}", make


def generated_workloads(args):
    from fxsched.front.generate import generate_graph

    for size in args.sizes:
        def make(size=size):
            return _joint(generate_graph(size, seed=0, buckets=False, hidden=1024, seq=256, batch=2, heads=8))
        yield f"generated {size // 1000}k", make


KINDS = {"models": model_workloads, "compile": compile_workloads, "titan": titan_workloads,
         "generated": generated_workloads}


# ---- one candidate, in a forked child ----------------------------------------------------------

def _child(graphs, pipeline, model, path):
    try:
        torch.set_num_threads(1)
        parts = []
        for gm, prepare in graphs:
            with prepare():
                start = time.process_time()
                done = fxsched.schedule(gm, pipeline, cost_model=model)
                cpu = time.process_time() - start
            gap = done.gap
            parts.append({"step_ms": gap["step_ms"], "bound_ms": gap["bound_ms"], "exposed_ms": gap["exposed_ms"],
                          "peak_bytes": gap["peak_bytes"], "cpu_s": cpu, "cap_bytes": gap["cap_bytes"],
                          "bought": len(gap["bought"])})
        result = {"step_ms": sum(p["step_ms"] for p in parts), "bound_ms": sum(p["bound_ms"] for p in parts),
                  "exposed_ms": sum(p["exposed_ms"] for p in parts), "peak_bytes": max(p["peak_bytes"] for p in parts),
                  "cpu_s": sum(p["cpu_s"] for p in parts), "rewrites": sum(p["bought"] for p in parts)}
        result["gap"] = result["step_ms"] / result["bound_ms"] if result["bound_ms"] else 1.0
    except BaseException:  # noqa: BLE001 — reported to the parent
        result = {"error": traceback.format_exc(limit=3)}
    with open(path, "wb") as f:
        pickle.dump(result, f)


def run_candidate(graphs, pipeline, model, timeout) -> dict[str, Any]:
    return run_forked(_child, (graphs, pipeline, model), timeout)


def input_balance(graphs, model) -> dict[str, float]:
    """The unscheduled input's total compute and busiest communication stream (summed over graphs)."""
    compute = comm = 0.0
    for gm, prepare in graphs:
        with prepare():
            program = lower(gm)
        sim = simulate(program, costs=op_costs(program, model))
        compute += sim.compute_ms
        comm += max(sim.comm_ms_by_stream.values(), default=0.0)
    return {"compute_ms": compute, "comm_ms": comm, "comm_bound": comm > compute}


# ---- report ------------------------------------------------------------------------------------

def markdown(rows, pipelines) -> str:
    lines = ["| workload | nodes | comm / compute | pipeline | step ms | bound ms | step / bound | exposed ms | "
             "peak | CPU s | goal (≤ 1.02 where comm ≤ compute) |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        bal = row["balance"]
        for p in pipelines:
            r = row["runs"].get(p)
            head = f"| {row['workload']} | {row['nodes']:,} | {bal['comm_ms'] / bal['compute_ms']:.2f} | `{p}` |"
            if r is None or "skipped" in r:
                lines.append(f"{head} skipped ({(r or {}).get('skipped', 'not run')}) | | | | | | |")
                continue
            goal = "n/a (comm-bound)" if bal["comm_bound"] else ("MET" if r["gap"] <= GOAL else "MISSED")
            lines.append(f"{head} {r['step_ms']:.3f} | {r['bound_ms']:.3f} | {r['gap']:.4f} | {r['exposed_ms']:.3f} | "
                         f"{format_bytes(r['peak_bytes'])} | {r['cpu_s']:.2f} | {goal} |")
    return "\n".join(lines) + "\n"


def summary(rows, pipelines) -> list[str]:
    out = []
    for p in pipelines:
        ran = [r for r in rows if "skipped" not in r["runs"].get(p, {"skipped": 1})]
        eligible = [r for r in ran if not r["balance"]["comm_bound"]]
        met = [r for r in eligible if r["runs"][p]["gap"] <= GOAL]
        best = [r for r in ran if r["runs"][p]["step_ms"] <= min(
            x["step_ms"] for x in r["runs"].values() if "skipped" not in x) * (1 + 1e-9)]
        base = [r["runs"][p]["step_ms"] / r["runs"]["default"]["step_ms"] for r in ran
                if "skipped" not in r["runs"].get("default", {"skipped": 1})]
        cpu = sum(r["runs"][p]["cpu_s"] for r in ran)
        skipped = [f"{r['workload']} ({r['runs'][p]['skipped']})" for r in rows if "skipped" in r["runs"].get(p, {})]
        out.append(f"- `{p}`: goal met on {len(met)} of {len(eligible)} workloads where comm ≤ compute"
                   f"{' (missed: ' + ', '.join(r['workload'] for r in eligible if r not in met) + ')' if len(met) < len(eligible) else ''}; "
                   f"best step (or tied) on {len(best)} of {len(ran)}; step vs `default` "
                   f"{min(base, default=1):.3f}–{max(base, default=1):.3f}x; CPU {cpu:.1f} s in all"
                   + (f"; not finished: {', '.join(skipped)}" if skipped else ""))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--models", nargs="*", default=["gpt", "llama", "encoder"])
    parser.add_argument("--widths", type=int, nargs="*", default=[32, 1024])
    parser.add_argument("--sizes", type=int, nargs="*", default=[10_000, 30_000, 100_000])
    parser.add_argument("--pipelines", nargs="*", default=list(CANDIDATES))
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per workload × candidate")
    parser.add_argument("--hardware", default="h100")
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args()

    torch.set_num_threads(1)
    model = Roofline(hardware(args.hardware))
    rows = []
    for kind in args.only:
        for label, make in KINDS[kind](args):
            print(f"{label} ...", flush=True)
            t = time.perf_counter()
            graphs = make()
            build = time.perf_counter() - t
            row = {"workload": label, "kind": kind, "build_s": build,
                   "nodes": sum(len(gm.graph.nodes) for gm, _ in graphs), "balance": input_balance(graphs, model),
                   "runs": {}}
            for p in args.pipelines:
                r = row["runs"][p] = run_candidate(graphs, p, model, args.timeout)
                if "skipped" in r:
                    print(f"  {p:26s} skipped ({r['skipped']})", flush=True)
                else:
                    print(f"  {p:26s} step={r['step_ms']:9.3f}ms bound={r['bound_ms']:9.3f}ms gap={r['gap']:.4f} "
                          f"exposed={r['exposed_ms']:8.3f}ms peak={format_bytes(r['peak_bytes'])} cpu={r['cpu_s']:.2f}s",
                          flush=True)
            rows.append(row)
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}, "
                         f"torch {torch.__version__}", "hardware": model.hw.name, "default": fxsched.DEFAULT_PIPELINE,
              "pipelines": args.pipelines, "rows": rows, "summary": summary(rows, args.pipelines)}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "default.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    text = (f"Simulated on {model.hw.name} (roofline); `default` = `{fxsched.DEFAULT_PIPELINE}`; no cap set (bucket "
            f"and unshard keep the peak of the program they get); CPU s = `fxsched.schedule` in this process; "
            f"{result['machine']}.\n\n" + markdown(rows, args.pipelines) + "\n" + "\n".join(result["summary"]) + "\n")
    with open(os.path.join(args.out, "default.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
