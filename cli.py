"""The `fxsched` command: `demo` (a built-in model through the front and a pipeline) and `passes`."""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time

EXIT_OK, EXIT_USAGE, EXIT_FAILED = 0, 2, 1


def _demo(args) -> int:
    import torch

    from . import schedule
    from .front import fsdp_joint_graph
    from .ir import Launch
    from .models import build_model

    started = time.perf_counter()
    module, inputs, model_loss = build_model(args.model, layers=args.layers, width=args.width, seed=args.seed)
    front = fsdp_joint_graph(module, inputs, lambda m, *xs: model_loss(m(*xs), *xs), args.world_size,
                             buckets="per-module" if args.buckets else None,
                             mixed_precision=torch.bfloat16 if args.bf16 else None)
    traced = time.perf_counter()
    done = schedule(front.gm, args.pipeline, timing=True)
    program = done.program
    kinds = collections.Counter(op.KIND for op in program.ops())
    effects = collections.Counter(why for _, _, why in program.effect_edges())
    roles = collections.Counter(op.role.value for op in program.ops() if isinstance(op, Launch) and op.role)
    report = done.report
    print(f"fxsched demo: {args.model} ({args.layers} layers, width {args.width}), world size {args.world_size}"
          f"{', per-module buckets' if args.buckets else ''}{', bf16' if args.bf16 else ''}")
    print(f"  traced in {traced - started:.1f} s: {len(front.gm.graph.nodes)} FX nodes, "
          f"{len(front.param_names)} parameters")
    print(f"  IR: {program.graph.number_of_nodes()} nodes, "
          f"{sum(1 for *_, e in program.graph.edges(data='kind') if e == 'data')} data edges, "
          f"{sum(effects.values())} effect edges")
    print("  ops:      " + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())))
    print("  effects:  " + ", ".join(f"{k} {v}" for k, v in sorted(effects.items())))
    print("  collectives: " + ", ".join(f"{k} {v}" for k, v in sorted(roles.items())))
    print(f"  pipeline: {done.pipeline}")
    for name, stats in report["passes"].items():
        shown = ", ".join(f"{k}={v}" for k, v in stats.items() if k != "changed")
        print(f"    {name:<40} {shown}")
    print(timing_text(done.timing))
    print("  gathers:")
    for row in report["gathers"]:
        where = f"before %{row['anchor']}" if row["moved"] else f"stays ({row['reason']})"
        print(f"    %{row['launch']:<28} {row['phase']} {','.join(row['params'])[:40]:<40} {where}")
    for note in report["notes"]:
        print(f"  note: {note}")
    if args.check:
        from .runtime import run_graph

        data = [inputs] * args.world_size
        feeds = [front.shard_inputs(module, r, data[r]) for r in range(args.world_size)]
        before = run_graph(front.gm, feeds)
        after = run_graph(done.graph_module, feeds)
        same = all(torch.equal(a, b) for ra, rb in zip(before, after) for a, b in zip(ra, rb))
        print(f"  check on {args.world_size} gloo ranks: loss and gradients "
              f"{'bitwise equal' if same else 'DIFFER'} before/after scheduling")
        if not same:
            return EXIT_FAILED
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"  report written to {args.json}")
    return EXIT_OK


def timing_text(timing) -> str:
    return "  " + timing.report().replace("\n", "\n  ").rstrip() if timing else ""


def _passes(args) -> int:
    from .passes import PASSES, REFERENCE_PIPELINE

    for name in sorted(PASSES):
        cls = PASSES[name]
        doc = (sys.modules[cls.__module__].__doc__ or "").strip().splitlines()[0]
        print(f"{name}: {doc.split(': ', 1)[-1]}")
        for text_name, field in cls.options().items():
            print(f"    {text_name} (default {field.default!r})")
    print(f"reference pipeline: {REFERENCE_PIPELINE}")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    from .passes import REFERENCE_PIPELINE

    parser = argparse.ArgumentParser(prog="fxsched", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="trace a built-in model through the FSDP front and schedule it")
    demo.add_argument("--model", default="gpt", choices=["gpt", "llama", "encoder"])
    demo.add_argument("--layers", type=int, default=4)
    demo.add_argument("--width", type=int, default=64)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--world-size", type=int, default=2)
    demo.add_argument("--buckets", action="store_true", help="one gather per module")
    demo.add_argument("--bf16", action="store_true", help="mixed precision: gather bf16 shards")
    demo.add_argument("--pipeline", default=REFERENCE_PIPELINE)
    demo.add_argument("--no-check", dest="check", action="store_false",
                      help="skip running before/after on gloo ranks")
    demo.add_argument("--json", help="also write the report as JSON to this file")
    demo.set_defaults(run=_demo)
    sub.add_parser("passes", help="list passes with their options and defaults").set_defaults(run=_passes)
    args = parser.parse_args(argv)
    from .passes import PipelineError

    try:
        return args.run(args)
    except PipelineError as exc:
        print(f"fxsched: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
