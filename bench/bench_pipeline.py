"""Benchmark: the whole pipeline (lower, passes, verify after each, raise) on generated
graphs, against FX's own graph copy + lint + recompile of the same graph. Both the
reference and the default pipeline are timed.

    .venv/bin/python bench/bench_pipeline.py [--sizes 10000 30000 100000] [--repeat 3]

Writes bench/out/pipeline.{json,md}. Goals (issue 4): time(100k)/time(10k) <= 12 and the
pipeline at 100k within 3x of FX's copy + lint + recompile, measured in the same run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import time

from torch import fx

import fxsched
from fxsched.front.generate import generate_graph
from fxsched.ir import verify
from fxsched.lowering import lower
from fxsched.passes import DEFAULT_PIPELINE, REFERENCE_PIPELINE, PassManager
from fxsched.raising import raise_program

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


def best_of(repeat: int, fn) -> float:
    best = float("inf")
    for _ in range(repeat):
        gc.collect()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def fx_copy(gm: fx.GraphModule) -> None:
    graph = fx.Graph()
    graph.graph_copy(gm.graph, {})
    graph.lint()
    fx.GraphModule(gm, graph)  # recompiles


def stages(gm: fx.GraphModule) -> dict[str, float]:
    """One run split by stage (verification counted apart from the passes)."""
    out = {}
    t = time.perf_counter()
    program = lower(gm)
    out["lower"] = time.perf_counter() - t
    t = time.perf_counter()
    verify(program)
    out["verify (one)"] = time.perf_counter() - t
    t = time.perf_counter()
    PassManager(REFERENCE_PIPELINE, verify_each=False).run(program)
    out["passes"] = time.perf_counter() - t
    t = time.perf_counter()
    raise_program(program)
    out["raise"] = time.perf_counter() - t
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 30_000, 100_000])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for size in args.sizes:
        gm = generate_graph(size, seed=0)
        repeat = args.repeat if size < 100_000 else max(1, args.repeat - 1)
        baseline = best_of(repeat, lambda: fx_copy(gm))
        pipeline = best_of(repeat, lambda: fxsched.schedule(gm, REFERENCE_PIPELINE))
        default = best_of(repeat, lambda: fxsched.schedule(gm, DEFAULT_PIPELINE))
        done = fxsched.schedule(gm, REFERENCE_PIPELINE)
        stats = done.result.stats()
        rows.append({
            "nodes": len(gm.graph.nodes), "fx_copy_lint_recompile_s": round(baseline, 3),
            "pipeline_s": round(pipeline, 3), "ratio_to_fx": round(pipeline / baseline, 2),
            "default_pipeline_s": round(default, 3), "default_ratio_to_fx": round(default / baseline, 2),
            "stages_s": {k: round(v, 3) for k, v in stages(gm).items()},
            "moved_forward": stats["prefetch"]["forward"], "moved_backward": stats["prefetch"]["backward"],
            "sunk": stats["sink"]["sunk"],
        })
        print(json.dumps(rows[-1]), flush=True)
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} cpus", "pipeline": REFERENCE_PIPELINE,
              "default_pipeline": DEFAULT_PIPELINE, "rows": rows}
    small, large = rows[0], rows[-1]
    if len(rows) > 1:
        result["growth"] = {"sizes": [small["nodes"], large["nodes"]],
                            "time_ratio": round(large["pipeline_s"] / small["pipeline_s"], 2),
                            "goal": "<= 12 for 10k -> 100k"}
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "pipeline.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = ["| nodes | FX copy+lint+recompile (s) | reference pipeline (s) | ratio (goal <= 3) | default pipeline (s) | ratio | lower | verify (one) | passes | raise | moved fwd/bwd | sunk |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        s = r["stages_s"]
        lines.append(f"| {r['nodes']} | {r['fx_copy_lint_recompile_s']} | {r['pipeline_s']} | {r['ratio_to_fx']} | "
                     f"{r['default_pipeline_s']} | {r['default_ratio_to_fx']} | "
                     f"{s['lower']} | {s['verify (one)']} | {s['passes']} | {s['raise']} | "
                     f"{r['moved_forward']}/{r['moved_backward']} | {r['sunk']} |")
    if "growth" in result:
        g = result["growth"]
        lines.append(f"\ntime({g['sizes'][1]}) / time({g['sizes'][0]}) = {g['time_ratio']} (goal <= 12 for 10k -> 100k)")
    table = "\n".join(lines) + "\n"
    with open(os.path.join(OUT, "pipeline.md"), "w") as f:
        f.write(f"Reference `{REFERENCE_PIPELINE}` and default `{DEFAULT_PIPELINE}` pipelines "
                f"(verify after each pass), best of {args.repeat}; "
                f"{result['machine']}.\n\n{table}")
    print(table)


if __name__ == "__main__":
    main()
