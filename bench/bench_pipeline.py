"""Benchmark: the whole pipeline (lower, passes, verify after each, raise) on generated
graphs, against FX's own graph copy + lint + recompile of the same graph. Both the
reference and the default pipeline are timed, and the peak memory of one run at the largest size.

    .venv/bin/python bench/bench_pipeline.py [--sizes 10000 30000 100000] [--repeat 3] [--no-memory]

Times are CPU seconds of this process (`time.process_time`), best of `--repeat` (one fewer at
100k nodes), the three cases interleaved in one run after a full collection each: the machine
may be shared, and wall-clock time there measures the neighbours. Memory: a fresh process per
pipeline builds the largest graph, then runs it under tracemalloc; `peak` is the most Python
memory the run held above what was allocated before it (the graph), `retained` what its
result keeps.

Each row records a hash of the two raised schedules (the order of node names), so that a
change made for speed can be checked to leave every schedule byte-identical.

Writes bench/out/pipeline.{json,md}. Goals (issue 15), measured in the same run:
reference and default pipelines at 100k nodes <= 0.75x FX's copy + lint + recompile, and
time(100k) / time(10k) <= 12 for both. Latest run (main a735866, 2026-12-05 04:00 UTC, 2-core
AMD EPYC machine, nothing else running, --no-memory --repeat 5): at 100k 0.47x (reference) and 0.62x
(default) of FX's 5.94 s, met; growth 12.6 / 13.26, not met (12.27 / 13.91 at the round's start;
the same code has read from 11.9 to 16.4: README, "Speed"; why, and history in docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
import tracemalloc

from torch import fx

import fxsched
from fxsched.front.generate import generate_graph
from fxsched.ir import verify
from fxsched.lowering import lower
from fxsched.passes import DEFAULT_PIPELINE, REFERENCE_PIPELINE, PassManager
from fxsched.raising import raise_program

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
GOAL_RATIO = 0.75  # pipeline / FX copy+lint+recompile, at 100k nodes
GOAL_GROWTH = 12  # time(100k) / time(10k)


def cpu(fn) -> float:
    """CPU seconds of `fn()`, after a full collection; its result is dropped after the clock
    stops (freeing it is the caller's later cost, and FX's graphs, full of cycles, are freed only
    by the next collection: counting the release would charge fxsched's acyclic Program alone)."""
    gc.collect()
    start = time.process_time()
    result = fn()
    elapsed = time.process_time() - start
    del result
    return elapsed


def fx_copy(gm: fx.GraphModule) -> fx.GraphModule:
    graph = fx.Graph()
    graph.graph_copy(gm.graph, {})
    graph.lint()
    return fx.GraphModule(gm, graph)  # recompiles


def schedule_hash(gm: fx.GraphModule) -> str:
    """The raised schedule, as the order of its node names (a speed change must not change it)."""
    return hashlib.sha256("\n".join(n.name for n in gm.graph.nodes).encode()).hexdigest()[:16]


def stages(gm: fx.GraphModule) -> dict[str, float]:
    """One run split by stage (verification counted apart from the passes)."""
    out = {}
    gc.collect()
    t = time.process_time()
    program = lower(gm)
    out["lower"] = time.process_time() - t
    t = time.process_time()
    verify(program)
    out["verify (one)"] = time.process_time() - t
    t = time.process_time()
    PassManager(REFERENCE_PIPELINE, verify_each=False).run(program)
    out["passes"] = time.process_time() - t
    t = time.process_time()
    raise_program(program)
    out["raise"] = time.process_time() - t
    return out


def memory_child(size: int, pipeline: str) -> None:
    """Run in a fresh process: print the tracemalloc peak and retained size of one run."""
    gm = generate_graph(size, seed=0)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    done = fxsched.schedule(gm, pipeline)
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(json.dumps({"nodes": len(gm.graph.nodes), "pipeline": pipeline,
                      "peak_mib": round((peak - before) / 2**20, 1),
                      "retained_mib": round((current - before) / 2**20, 1)}))
    del done


def memory(size: int, pipeline: str) -> dict:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--memory-child", str(size), pipeline],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 30_000, 100_000])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs")
    parser.add_argument("--memory-child", nargs=2, metavar=("SIZE", "PIPELINE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(int(args.memory_child[0]), args.memory_child[1])
        return
    rows = []
    for size in args.sizes:
        gm = generate_graph(size, seed=0)
        repeat = args.repeat if size < 100_000 else max(1, args.repeat - 1)
        cases = {"fx": lambda: fx_copy(gm), "reference": lambda: fxsched.schedule(gm, REFERENCE_PIPELINE),
                 "default": lambda: fxsched.schedule(gm, DEFAULT_PIPELINE)}
        best = dict.fromkeys(cases, float("inf"))
        for _ in range(repeat):  # interleaved
            for name, fn in cases.items():
                best[name] = min(best[name], cpu(fn))
        done = fxsched.schedule(gm, REFERENCE_PIPELINE)
        stats = done.result.stats()
        hashes = {"reference": schedule_hash(done.graph_module)}
        del done
        hashes["default"] = schedule_hash(fxsched.schedule(gm, DEFAULT_PIPELINE).graph_module)
        rows.append({
            "nodes": len(gm.graph.nodes), "fx_copy_lint_recompile_s": round(best["fx"], 3),
            "pipeline_s": round(best["reference"], 3), "ratio_to_fx": round(best["reference"] / best["fx"], 2),
            "default_pipeline_s": round(best["default"], 3),
            "default_ratio_to_fx": round(best["default"] / best["fx"], 2),
            "stages_s": {k: round(v, 3) for k, v in stages(gm).items()},
            "moved_forward": stats["prefetch"]["forward"], "moved_backward": stats["prefetch"]["backward"],
            "sunk": stats["sink"]["sunk"], "schedule_sha256": hashes,
        })
        print(json.dumps(rows[-1]), flush=True)
        del gm
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} cpus", "python": platform.python_version(),
              "clock": "CPU seconds (process_time)", "pipeline": REFERENCE_PIPELINE,
              "default_pipeline": DEFAULT_PIPELINE, "rows": rows,
              "goals": {"ratio_to_fx_at_100k": f"<= {GOAL_RATIO}", "growth_10k_to_100k": f"<= {GOAL_GROWTH}"}}
    small, large = rows[0], rows[-1]
    if len(rows) > 1:
        result["growth"] = {"sizes": [small["nodes"], large["nodes"]],
                            "reference": round(large["pipeline_s"] / small["pipeline_s"], 2),
                            "default": round(large["default_pipeline_s"] / small["default_pipeline_s"], 2)}
    if not args.no_memory:
        result["memory"] = [memory(max(args.sizes), p) for p in ("reference", "default")]
        for m in result["memory"]:
            print(json.dumps(m), flush=True)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "pipeline.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"| nodes | FX copy+lint+recompile (s) | reference pipeline (s) | ratio (goal <= {GOAL_RATIO} at 100k) | "
             "default pipeline (s) | ratio | lower | verify (one) | passes | raise | moved fwd/bwd | sunk |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        s = r["stages_s"]
        lines.append(f"| {r['nodes']} | {r['fx_copy_lint_recompile_s']} | {r['pipeline_s']} | {r['ratio_to_fx']} | "
                     f"{r['default_pipeline_s']} | {r['default_ratio_to_fx']} | "
                     f"{s['lower']} | {s['verify (one)']} | {s['passes']} | {s['raise']} | "
                     f"{r['moved_forward']}/{r['moved_backward']} | {r['sunk']} |")
    lines.append("\nschedules (sha256 of the raised node order, first 16 hex digits): " + "; ".join(
        f"{r['nodes']}: reference {r['schedule_sha256']['reference']}, default {r['schedule_sha256']['default']}"
        for r in rows))
    if "growth" in result:
        g = result["growth"]
        lines.append(f"\ntime({g['sizes'][1]}) / time({g['sizes'][0]}): reference {g['reference']}, "
                     f"default {g['default']} (goal <= {GOAL_GROWTH} for 10k -> 100k)")
    for m in result.get("memory", []):
        lines.append(f"\npeak memory of one {m['pipeline']} run at {m['nodes']} nodes (tracemalloc, above the "
                     f"graph): {m['peak_mib']} MiB; its result retains {m['retained_mib']} MiB")
    table = "\n".join(lines) + "\n"
    with open(os.path.join(OUT, "pipeline.md"), "w") as f:
        f.write(f"Reference `{REFERENCE_PIPELINE}` and default `{DEFAULT_PIPELINE}` pipelines "
                f"(verify after each pass), CPU seconds, best of {args.repeat} (one fewer at 100k), "
                f"interleaved; {result['machine']}.\n\n{table}")
    print(table)


if __name__ == "__main__":
    main()
