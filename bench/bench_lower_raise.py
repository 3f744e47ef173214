"""Benchmark: fxsched's lower + raise against FX's own graph copy, on generated FSDP joint graphs.

    python bench/bench_lower_raise.py                      # 10k, 30k, 100k nodes
    python bench/bench_lower_raise.py --sizes 5000 --repeats 5 --profile

For each size, in the same process and interleaved (the machine may be shared), it times
  fxsched: `lower(gm)` (tag reading + effect derivation) then `raise_program(program)` (a fresh
           GraphModule in schedule order, linted, recompiled);
  fx:      `g = fx.Graph(); out = g.graph_copy(gm.graph, {}); g.output(out); g.lint();
           fx.GraphModule(gm, g)` — the least any raise must do;
best of 3 (2 at 100k nodes and above) each, and reports ratio = fxsched / fx. `verify` is timed once
beside it (not part of the ratio), and so is `derive_effects` alone (`effects`). The goal, recorded with the numbers: ratio <= 2.5 at 100k.

Graphs come from `fxsched.front.generate.generate_graph` when it is importable, else from a
simple local generator (a chain of tagged layers); `--generator` forces one. Results go to
bench/out/lower_raise.{json,md} and the table is printed. `--profile` adds a cProfile of lowering,
effect derivation and raising at the largest size (top functions by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import platform
import pstats
import sys
import time
from pathlib import Path

import torch
from torch import fx

from fxsched.ir import BACKWARD, ENTRY, Schedule, derive_effects, verify
from fxsched.lowering import lower
from fxsched.raising import raise_program

GOAL_RATIO = 2.5
GOAL_SIZE = 100_000
OUT = Path(__file__).resolve().parent / "out"


# ---- graphs -----------------------------------------------------------------------------------

@torch.fx.node.has_side_effect
def bench_free(tensor: torch.Tensor) -> None:
    tensor.untyped_storage().resize_(0)


def local_graph(num_nodes: int) -> fx.GraphModule:
    """A chain of tagged layers: gather → wait → slice → view → mm → relu, free; backward re-gather,
    mm, reduce-scatter. About 19 nodes a layer; meta['val'] is not filled."""
    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    per_layer = 19
    layers = max(1, (num_nodes - 3) // per_layer)
    g = fx.Graph()
    x = g.placeholder("x")
    shards = [g.placeholder(f"shard_{i}") for i in range(layers)]

    def call(target, *args, **meta):
        node = g.call_function(target, args)
        node.meta.update(meta)
        return node

    def gather(i, comm_type, **meta):
        ag = call(c10d.all_gather_into_tensor.default, shards[i], 2, "0", comm_type=comm_type,
                  param_name=f"layers.{i}.weight", fsdp_unsharded_nbytes=256 * 4, **meta)
        wt = call(c10d.wait_tensor.default, ag, **meta)
        sl = call(aten.slice.Tensor, wt, 0, 0, 256, **meta)
        return wt, call(aten.view.default, sl, [16, 16], **meta)

    h, saved = x, []
    for i in range(layers):
        wt, w = gather(i, "fsdp_all_gather")
        saved.append(h)
        h = call(aten.relu.default, call(aten.mm.default, h, w))
        call(bench_free, wt, comm_type="fsdp_reshard_free", param_name=f"layers.{i}.weight")
    grad, grads = h, []
    bwd = {"autograd_backward": True}
    for i in reversed(range(layers)):
        wt, w = gather(i, "fsdp_all_gather_backward", **bwd)
        grad = call(aten.mm.default, grad, call(aten.t.default, w, **bwd), **bwd)
        wgrad = call(aten.mm.default, call(aten.t.default, saved[i], **bwd), grad, **bwd)
        rs = call(c10d.reduce_scatter_tensor.default, call(aten.view.default, wgrad, [256], **bwd), "sum", 2, "0",
                  comm_type="fsdp_reduce_scatter", **bwd)
        grads.append(call(c10d.wait_tensor.default, rs, **bwd))
        call(bench_free, wt, comm_type="fsdp_reshard_free_backward", param_name=f"layers.{i}.weight", **bwd)
    g.output((h, *grads))
    return fx.GraphModule(torch.nn.Module(), g)


def make_graph(num_nodes: int, generator: str) -> tuple[fx.GraphModule, str]:
    if generator in ("auto", "front"):
        try:
            from fxsched.front.generate import generate_graph

            return generate_graph(num_nodes, seed=0), "front.generate"
        except Exception as exc:  # not written yet, or broken: fall back unless forced
            if generator == "front":
                raise
            print(f"front.generate unavailable ({type(exc).__name__}: {exc}); using the local generator",
                  file=sys.stderr)
    return local_graph(num_nodes), "local"


# ---- timing -----------------------------------------------------------------------------------

def fx_copy(gm: fx.GraphModule) -> fx.GraphModule:
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    graph.lint()
    return fx.GraphModule(gm, graph)


def time_fxsched(gm: fx.GraphModule) -> tuple[float, float]:
    t0 = time.perf_counter()
    program = lower(gm)
    t1 = time.perf_counter()
    raised = raise_program(program)
    t2 = time.perf_counter()
    assert len(raised.graph.nodes) == len(gm.graph.nodes)
    return t1 - t0, t2 - t1


def time_fx(gm: fx.GraphModule) -> float:
    t0 = time.perf_counter()
    copy = fx_copy(gm)
    t1 = time.perf_counter()
    assert len(copy.graph.nodes) == len(gm.graph.nodes)
    return t1 - t0


def bench_size(num_nodes: int, repeats: int, generator: str) -> dict:
    t0 = time.perf_counter()
    gm, source = make_graph(num_nodes, generator)
    build_s = time.perf_counter() - t0
    nodes = len(gm.graph.nodes)
    lowers, raises, totals, fxs = [], [], [], []
    for _ in range(repeats):  # interleaved, each after a full collection
        gc.collect()
        lower_s, raise_s = time_fxsched(gm)
        lowers.append(lower_s)
        raises.append(raise_s)
        totals.append(lower_s + raise_s)
        gc.collect()
        fxs.append(time_fx(gm))
    gc.collect()
    program = lower(gm)
    t0 = time.perf_counter()
    verify(program)
    verify_s = time.perf_counter() - t0
    effects = []  # derive_effects alone, on a lowered program stripped of its effect edges and markers
    for _ in range(repeats):
        derive = _derive_again(gm)
        gc.collect()
        t0 = time.perf_counter()
        derive()
        effects.append(time.perf_counter() - t0)
    best = min(range(repeats), key=totals.__getitem__)
    row = {
        "requested_nodes": num_nodes,
        "nodes": nodes,
        "ir_nodes": program.graph.number_of_nodes(),
        "ir_edges": program.graph.number_of_edges(),
        "generator": source,
        "build_s": round(build_s, 3),
        "repeats": repeats,
        "lower_s": round(lowers[best], 4),
        "raise_s": round(raises[best], 4),
        "fxsched_s": round(totals[best], 4),
        "fx_copy_s": round(min(fxs), 4),
        "ratio": round(totals[best] / min(fxs), 3),
        "verify_s": round(verify_s, 4),
        "effects_s": round(min(effects), 4),
        "all_fxsched_s": [round(t, 4) for t in totals],
        "all_fx_copy_s": [round(t, 4) for t in fxs],
    }
    del program, gm
    gc.collect()
    return row


def profile(num_nodes: int, generator: str, top: int) -> str:
    """cProfile of lowering (with effect derivation) and raising, and of derive_effects alone."""
    gm, _ = make_graph(num_nodes, generator)
    out = io.StringIO()
    for label, fn in (("lower + raise", lambda: raise_program(lower(gm))),
                      ("derive_effects alone (on a lowered program, edges removed)", _derive_again(gm))):
        gc.collect()
        prof = cProfile.Profile()
        prof.enable()
        fn()
        prof.disable()
        out.write(f"\n### {label}, {len(gm.graph.nodes)} nodes\n\n```\n")
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
        out.write("```\n")
    return out.getvalue()


def _derive_again(gm: fx.GraphModule):
    program = lower(gm)
    effect = [(u, v) for u, v, e in program.graph.edges(data=True) if e["kind"] != "data"]
    program.graph.remove_edges_from(effect)
    markers = {ENTRY, BACKWARD} & set(program.graph)
    program.graph.remove_nodes_from(markers)
    program.schedule = Schedule(n for n in program.schedule if n not in markers)
    return lambda: derive_effects(program)


# ---- report ------------------------------------------------------------------------------------

def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        "# lower + raise vs FX graph copy",
        "",
        f"Goal: ratio (fxsched / fx) <= {GOAL_RATIO} at {GOAL_SIZE:,} nodes. {meta['goal_status']}",
        "",
        f"{meta['python']} · torch {meta['torch']} · {meta['machine']} · best of {meta['repeats_note']} "
        "· seconds",
        "",
        "| nodes | generator | lower | raise | fxsched (lower+raise) | fx copy | ratio | verify | effects | IR edges |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(f"| {r['nodes']:,} | {r['generator']} | {r['lower_s']:.3f} | {r['raise_s']:.3f} | "
                     f"{r['fxsched_s']:.3f} | {r['fx_copy_s']:.3f} | {r['ratio']:.2f} | {r['verify_s']:.3f} | "
                     f"{r['effects_s']:.3f} | {r['ir_edges']:,} |")
    lines += ["", "effects: `derive_effects` alone (part of lower), on the lowered program with its effect edges "
              "and markers removed, best of the repeats."]
    if meta.get("note"):
        lines += ["", meta["note"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 30_000, 100_000])
    parser.add_argument("--repeats", type=int, default=None, help="default: 3, and 2 at 100k nodes and above")
    parser.add_argument("--generator", choices=["auto", "front", "local"], default="auto")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--profile", action="store_true", help="cProfile lowering/effects/raising at the largest size")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--note", default="", help="a line for the report (e.g. a before/after comparison)")
    args = parser.parse_args(argv)

    rows = []
    for size in args.sizes:
        repeats = args.repeats or (2 if size >= 100_000 else 3)
        row = bench_size(size, repeats, args.generator)
        rows.append(row)
        print(f"{row['nodes']:>7} nodes: fxsched {row['fxsched_s']:.3f}s (lower {row['lower_s']:.3f}, "
              f"raise {row['raise_s']:.3f}), fx copy {row['fx_copy_s']:.3f}s, ratio {row['ratio']:.2f}", flush=True)

    at_goal = [r for r in rows if r["nodes"] >= GOAL_SIZE * 0.99]
    if at_goal:
        worst = max(r["ratio"] for r in at_goal)
        status = f"{'MET' if worst <= GOAL_RATIO else 'NOT MET'}: ratio {worst:.2f} at {at_goal[0]['nodes']:,} nodes."
    else:
        status = f"not measured (no size >= {GOAL_SIZE:,} in this run)."
    meta = {
        "goal": {"ratio_at_most": GOAL_RATIO, "nodes": GOAL_SIZE},
        "goal_status": status,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
        "repeats_note": "3 (2 at 100k+)" if args.repeats is None else str(args.repeats),
        "note": args.note,
    }
    table = markdown(rows, meta)
    prof = profile(max(args.sizes), args.generator, args.top) if args.profile else ""
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lower_raise.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    (args.out / "lower_raise.md").write_text(table + (f"\n## Profile\n{prof}" if prof else ""))
    print()
    print(table)
    if prof:
        print(prof)
    return 0


if __name__ == "__main__":
    sys.exit(main())
