"""Benchmark: the rewriting passes (`bucket`, `unshard`) after the default pipeline — their CPU
time against the default pipeline's own, and what they buy (simulated step and peak).

    .venv/bin/python bench/bench_rewrite.py [--sizes 10000 30000 100000] [--models] [--passes bucket] [--profile PASS]

Writes each row as it is measured to bench/out/rewrite.json (`--out`), a JSON list.

Per graph: the default pipeline runs once on the lowered program (CPU seconds, verify after each
pass, as `fxsched.schedule` does); then each rewriting pass runs on its own copy of that result
(CPU seconds of the pass alone, then the manager's verify after it), with a hash of the schedule
it made. Generated graphs come from
front/generate.py (as bench/bench_pipeline.py's); `--models` adds the built-in models (2 layers,
widths 32 and 1024, world 2). `--profile PASS` prints a cProfile of that pass at each size.
Goal (issue 17): each rewriting pass <= ~20% of the default pipeline's time at 100k nodes.

Last runs (generated 10k / 30k / 100k, one run each, ratio = pass CPU / default CPU in the same
process; 2 cores shared with 3 other sessions, load ~6; the same schedule hashes in both):
  before the quick trial's walk (8aa6a58, 2026-12-03 21:55-22:50 UTC):
    bucket 1.43 / 9.21 / 98.6 s = 5.8x / 11.0x / 28.7x; unshard 0.28 / 1.20 / 4.79 s = 1.1x / 1.4x / 1.4x
  after it (1842cc0 = f9c653e on main, 2026-12-03 23:18-23:24 UTC, with an IR-hash check and tests of ours running):
    bucket 1.33 / 6.90 / 49.0 s = 3.5x / 6.7x / 15.3x; unshard 0.30 / 1.01 / 3.42 s = 0.8x / 1.0x / 1.1x
    (default 0.38 / 1.03 / 3.21 s: the 10k row's default ran slow; bucket alone at 10k, 22:59 UTC: 5.9x)
  bucket + unshard at 100k: 16.4x the default's CPU (the switch rule asks <= ~2x).
  2026-12-04 13:49-13:55 UTC, load 3-6, one run each, the default pipeline now faster (0.19 /
  0.70 / 2.9-3.7 s), so the same pass times are larger ratios:
    before kept scans and composed chains (9c05b08): bucket 1.08 / 5.37 / 61.0 s = 5.7x / 7.7x /
    16.3x; unshard 0.25 / 0.96 / 4.91 s = 1.3x / 1.4x / 1.3x; bucket + unshard at 100k 17.6x
    after (370af45): bucket 1.24 / 4.94 / 17.7 s = 6.1x / 6.7x / 6.1x; unshard 0.23 / 1.09 / 3.85 s
    = 1.1x / 1.5x / 1.3x; bucket + unshard at 100k 7.4x (an earlier pair, 13:24-13:47 UTC, load
    4-6: bucket at 100k 54.5 -> 26.3 s, 19.5x -> 9.7x). At 10k the two are within the noise of a
    loaded machine (best of 4 in one process: 0.84-1.19 s either way); the gain grows with the
    bucket sizes: the generated forward launches hundreds of gathers back to back, or one per
    wait, so its buckets' trials were K^2 jumps and rescans.
At 100k, before the base's step was taken once per make (f9c653e), 30 of bucket's 45 s were its
quick trials, half of that the base walked again from each bucket's first slot (3606 first slots
for 707 buckets). Since then a trial jumps its last trial's chain of stretches as one map, and
pieces go on from kept scans (also across makes) or are made at once from each launch to a slot
asked for twice; what is left is spread (cProfile at 100k, 32.6 s profiled, before the last of
those, which cut the slots scanned from 5.8M to 3.3M): the quick trials 10.9 s (5.3 of it
scanning pieces; their own walks, each trial sorting its K slots), the merges through the
rewriter 6.2 s, each run's setup 4.8 s (three runs: a memory profile, keeper slots, steps, tails
and stretches each), the reduce-scatter trials' whole plans 3.8 s, the max tree 1.7 s, the
simulations before and after 1.4 s, the manager's verify 0.7 s.
The generated graphs are communication-bound (10k: default step 14.9 ms, compute 4.4 ms; bucket
takes it to 6.6 ms), so an early exit where the step already equals the compute stream's busy
time would never be taken on them, nor on the built-in models (llama L2: 0.951 ms against 0.931
of compute, and bucket changes nothing there; gpt and encoder are communication-bound) or on a
generated graph made compute-bound (hidden 4096, seq 1024, batch 4: 3642.5 ms against 3627.4
of compute); it is not implemented.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import io
import json
import os
import pstats
import time

from fxsched.cost.simulate import simulate
from fxsched.lowering import lower
from fxsched.passes import DEFAULT_PIPELINE, PassManager, parse_pipeline

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
REWRITES = {"bucket": "bucket", "unshard": "unshard{max-peak-increase-gb=1.0}"}


def cpu(fn):
    gc.collect()
    start = time.process_time()
    out = fn()
    return time.process_time() - start, out


def _program(gm):
    return lower(gm)


def measure(label: str, gm, rewrites: dict[str, str], profile: str | None) -> dict:
    program = _program(gm)
    t_default, _ = cpu(lambda: PassManager(DEFAULT_PIPELINE).run(program))
    base = simulate(program)
    row = {"graph": label, "ops": len(program.schedule), "default_s": round(t_default, 3),
           "default_step_ms": round(base.step_ms, 4), "default_peak_mib": round(base.peak_bytes / 2**20, 3)}
    for key, text in rewrites.items():
        trial = program.copy()
        (p,) = parse_pipeline(text)
        manager = PassManager([p], verify_input=False)
        if profile == key:
            prof = cProfile.Profile()
            prof.enable()
        t, result = cpu(lambda: manager.run(trial))
        if profile == key:
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(25)
            print(f"---- profile {key} on {label}\n{out.getvalue()}")
        sim = simulate(trial)
        stats = result.results[0][1].stats
        row[key] = {"s": round(t, 3), "ratio": round(t / t_default, 3), "step_ms": round(sim.step_ms, 4),
                    "peak_mib": round(sim.peak_bytes / 2**20, 3),
                    "count": stats.get("buckets", stats.get("unsharded")),
                    # the schedule it made: a change of speed must not change it
                    "hash": hashlib.sha1("\n".join(trial.schedule.names()).encode()).hexdigest()[:12]}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="*", default=[10_000, 30_000, 100_000])
    parser.add_argument("--models", action="store_true")
    parser.add_argument("--passes", nargs="+", default=list(REWRITES), choices=list(REWRITES))
    parser.add_argument("--profile", choices=list(REWRITES))
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "rewrite.json")

    def record(row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)

    rewrites = {k: REWRITES[k] for k in args.passes}
    rows = []
    if args.models:
        from fxsched.front import fsdp_joint_graph
        from fxsched.models import MODELS, build_model
        for name in sorted(MODELS):
            for width in (32, 1024):
                module, inputs, loss = build_model(name, layers=2, width=width, seed=1)
                front = fsdp_joint_graph(module, inputs, lambda m, *xs: loss(m(*xs), *xs), 2)
                record(measure(f"{name} L2 w{width}", front.gm, rewrites, args.profile))
    from fxsched.front.generate import generate_graph
    for size in args.sizes:
        gm = generate_graph(size, seed=0)
        record(measure(f"generated {size}", gm, rewrites, args.profile))
        del gm


if __name__ == "__main__":
    main()
