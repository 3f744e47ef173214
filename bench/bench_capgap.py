"""Benchmark: the `default` pipeline capped against uncapped, on the 24 built-in configurations
(gpt, llama, encoder; width 32 and 1024; FSDP per-module buckets or none; fp32 or bf16 mixed
precision; 2 layers, world 2) — the comparison docs/design.md ("The peak-memory cap") quotes.

    .venv/bin/python bench/bench_capgap.py [--out bench/out/capgap.json]

Per configuration, simulated step ms, simulated peak bytes, CPU seconds and which run
`memory-cap` kept (`unchecked` / `checked`) for: `default` uncapped; capped at the input's
simulated peak (`max-peak-increase-gb=0`); capped at max(uncapped peak, input's peak). A row is a
miss where a capped peak is over its cap, or where the cap fits the uncapped result and the
capped step is longer than the uncapped one. Writes the rows and the miss count as JSON, and a
markdown table beside it (`.md`).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from fxsched.cost.simulate import memory_profile, simulate
from fxsched.front import fsdp_joint_graph
from fxsched.lowering import lower
from fxsched.models import build_model
from fxsched.passes import PassContext, PassManager
from fxsched.passes.memory_cap import with_cap

GIB = 1 << 30
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "capgap.json")


def run(base, pipeline: str) -> dict:
    program = base.copy()
    start = time.process_time()
    result = PassManager(pipeline).run(program, PassContext())
    cpu = time.process_time() - start
    sim = simulate(program)
    kept = next((v.get("kept") for k, v in result.stats().items() if k.startswith("memory-cap")), None)
    return {"step_ms": sim.step_ms, "peak_bytes": sim.peak_bytes, "cpu_s": cpu, "kept": kept}


def configurations():
    for name in ("gpt", "llama", "encoder"):
        for width in (32, 1024):
            for buckets in (None, "per-module"):
                for bf16 in (False, True):
                    yield name, width, buckets, bf16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args()
    rows, misses = [], 0
    for name, width, buckets, bf16 in configurations():
        module, inputs, loss = build_model(name, layers=2, width=width, seed=1)
        gm = fsdp_joint_graph(module, inputs, lambda m, *xs: loss(m(*xs), *xs), 2, buckets=buckets,
                              mixed_precision=torch.bfloat16 if bf16 else None).gm
        base = lower(gm)
        input_peak = memory_profile(base).peak_bytes
        free = run(base, "default")
        at_input = run(base, with_cap("default", max_peak_increase_gb=0.0))
        cap = max(free["peak_bytes"], input_peak)
        at_max = run(base, with_cap("default", max_peak_gb=cap / GIB))
        # within the cap always; no longer than uncapped where the uncapped result fits the cap
        ok_input = at_input["peak_bytes"] <= input_peak and (
            free["peak_bytes"] > input_peak or at_input["step_ms"] <= free["step_ms"] + 1e-9)
        ok_max = at_max["peak_bytes"] <= cap and at_max["step_ms"] <= free["step_ms"] + 1e-9
        misses += (not ok_input) + (not ok_max)
        row = {"model": name, "width": width, "buckets": buckets or "none", "dtype": "bf16" if bf16 else "fp32",
               "input_peak_bytes": input_peak, "uncapped": free, "cap_at_input": at_input | {"ok": ok_input},
               "cap_at_max": at_max | {"cap_bytes": cap, "ok": ok_max}}
        rows.append(row)
        print(f"{name} w{width} {row['buckets']} {row['dtype']}: uncapped {free['step_ms']:.4f} ms "
              f"{free['peak_bytes']} B; at input's peak {at_input['step_ms']:.4f} {at_input['kept']} "
              f"{'ok' if ok_input else 'MISS'}; at max {at_max['step_ms']:.4f} {at_max['kept']} "
              f"{'ok' if ok_max else 'MISS'}", flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "misses": misses}, f, indent=1)
    lines = ["| config | input peak | uncapped ms / peak | at input's peak ms (run kept) | at max(uncapped, input) ms (run kept) |",
             "|---|---:|---|---|---|"]
    for r in rows:
        u, a, m = r["uncapped"], r["cap_at_input"], r["cap_at_max"]
        lines.append(f"| {r['model']} w{r['width']} {r['buckets']} {r['dtype']} | {r['input_peak_bytes']:,} | "
                     f"{u['step_ms']:.4f} / {u['peak_bytes']:,} | {a['step_ms']:.4f} ({a['kept']}){'' if a['ok'] else ' MISS'} | "
                     f"{m['step_ms']:.4f} ({m['kept']}){'' if m['ok'] else ' MISS'} |")
    lines.append(f"\nmisses: {misses}")
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("misses:", misses)


if __name__ == "__main__":
    main()
