"""The `fxsched` command.

    fxsched demo                          a built-in model through the FSDP front and a pipeline
    fxsched schedule MODULE:FUNCTION      schedule the GraphModule FUNCTION() returns
    fxsched explain MODULE:FUNCTION       why each gather moved, or did not
    fxsched passes                        the passes, their options and defaults
    fxsched opt FILE -p PIPELINE          run a pipeline on IR text (see opt.py)

Exit codes: 0 ok; 1 a failed check or a pass failure; 2 bad arguments or input (unknown
pass or option, a module that does not import, a function that does not return a
GraphModule, tags the lowering cannot interpret).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import importlib
import importlib.util
import logging
import os
import sys
import time
import traceback
import warnings

from . import __version__

EXIT_OK, EXIT_USAGE, EXIT_FAILED = 0, 2, 1
LOG = logging.getLogger("fxsched.cli")

class UsageError(Exception):
    """Bad arguments or input: reported as `fxsched: <message>`, exit code 2."""


# --------------------------------------------------------------------------- progress


class Progress:
    """Stage names with elapsed seconds on stderr (when it is a terminal, or asked for)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.started = time.perf_counter()

    def stage(self, text: str) -> None:
        if self.enabled:
            print(f"fxsched [{time.perf_counter() - self.started:7.2f}s] {text}", file=sys.stderr, flush=True)


def _progress(args) -> Progress:
    return Progress(bool(getattr(args, "progress", False)) or sys.stderr.isatty())


def _progress_instrument(progress: Progress, total: int):
    from .passes import Instrument

    class ShowProgress(Instrument):
        def __init__(self):
            self.done = 0

        def before(self, p, program):
            if self.done == 0:
                progress.stage(f"lowered: {program.graph.number_of_nodes()} IR ops")
            progress.stage(f"pass {self.done + 1}/{total}: {p}")

        def after(self, p, program, result):
            self.done += 1
            if self.done == total:
                progress.stage("raising")

    return ShowProgress()


# --------------------------------------------------------------------------- loading a user's graph


def load_function(spec: str):
    """`MODULE:FUNCTION` → the callable. MODULE is a dotted module name (the current directory is
    on the path, as for `python -m`) or a path to a .py file; FUNCTION may be dotted (`Class.make`)."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"expected MODULE:FUNCTION (e.g. mypkg.graphs:build), got {spec!r}")
    try:
        if module_name.endswith(".py") or os.sep in module_name:
            if not os.path.isfile(module_name):
                raise UsageError(f"no such file: {module_name}")
            name = "_fxsched_user_" + os.path.splitext(os.path.basename(module_name))[0]
            folder = os.path.dirname(os.path.abspath(module_name))
            if folder not in sys.path:  # so it imports its siblings, as `python file.py` would
                sys.path.insert(0, folder)
            found = importlib.util.spec_from_file_location(name, module_name)
            module = importlib.util.module_from_spec(found)
            sys.modules[name] = module
            found.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except UsageError:
        raise
    except (Exception, SystemExit) as exc:
        LOG.debug("import of %s failed:\n%s", module_name, traceback.format_exc())
        raise UsageError(f"cannot import {module_name!r}: {type(exc).__name__}: {exc}") from exc
    try:
        fn = functools.reduce(getattr, attr.split("."), module)
    except AttributeError:
        raise UsageError(f"module {module_name!r} has no attribute {attr!r}") from None
    if not callable(fn):
        raise UsageError(f"{spec} is a {type(fn).__name__}, not a function")
    return fn


def load_plugins(modules: list[str]) -> None:
    """Import each `--load-pass-plugin` module (its `@register_pass` classes join PASSES)."""
    from .passes.plugins import load_module

    for spec in modules:
        try:
            load_module(spec)
        except (Exception, SystemExit) as exc:
            LOG.debug("plugin %s failed:\n%s", spec, traceback.format_exc())
            raise UsageError(f"cannot load pass plugin {spec!r}: {type(exc).__name__}: {exc}") from exc


def load_graph(spec: str):
    """Call the `MODULE:FUNCTION` of `spec` with no arguments; it must return a torch.fx.GraphModule."""
    from torch import fx

    fn = load_function(spec)
    try:
        gm = fn()
    except Exception as exc:
        LOG.debug("%s() raised:\n%s", spec, traceback.format_exc())
        raise UsageError(f"{spec}() raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(gm, fx.GraphModule):
        raise UsageError(f"{spec}() returned {type(gm).__name__}, not a torch.fx.GraphModule")
    return gm


def check_hardware(name: str) -> None:
    from .cost import hardware

    try:
        hardware(name)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


# --------------------------------------------------------------------------- commands


def _demo(args) -> int:
    import torch

    from .report import report_lines, simulate_before_after, timing_text, write_json, write_trace

    from . import schedule
    from .front import fsdp_joint_graph
    from .ir import Launch
    from .models import build_model

    check_hardware(args.hardware)
    progress = _progress(args)
    started = time.perf_counter()
    progress.stage(f"tracing {args.model} ({args.layers} layers)")
    try:
        module, inputs, model_loss = build_model(args.model, layers=args.layers, width=args.width, seed=args.seed)
    except ValueError as exc:  # a size the model cannot be built with
        raise UsageError(f"demo: {exc}") from None
    front = fsdp_joint_graph(module, inputs, lambda m, *xs: model_loss(m(*xs), *xs), args.world_size,
                             buckets="per-module" if args.buckets else None,
                             mixed_precision=torch.bfloat16 if args.bf16 else None)
    traced = time.perf_counter()
    from .passes import parse_pipeline

    instruments = [_progress_instrument(progress, len(parse_pipeline(args.pipeline)))]
    done = schedule(front.gm, args.pipeline, timing=True, instruments=instruments, cost_model=args.hardware)
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
    print("\n".join(report_lines(report)))
    print(timing_text(done.timing))
    progress.stage("simulating before/after")
    sims = simulate_before_after(front.gm, done, args.hardware, record=bool(args.trace))
    rows = {"before": sims[0]}
    from .cost import compare_table, simulate
    from .passes import PassManager

    if str(PassManager(args.pipeline)) != str(PassManager("reference")):  # compare with the reference too
        reference = schedule(front.gm, "reference", cost_model=args.hardware)
        rows["reference"] = simulate(reference.program, args.hardware)
    rows["after"] = sims[1]
    print(f"  simulated on {args.hardware} (roofline cost model; after = {done.pipeline}):")
    print("    " + compare_table(rows, baseline="before").rstrip().replace("\n", "\n    "))
    report = {**report, "simulation": {"hardware": args.hardware,
                                       **{name: sim.summary() for name, sim in rows.items()}}}
    if args.trace:
        write_trace(args.trace, *sims)
        print(f"  timeline written to {args.trace} (open in https://ui.perfetto.dev or chrome://tracing)")
    status = EXIT_OK
    if args.check:
        from .runtime import run_graph

        progress.stage(f"running before/after on {args.world_size} gloo ranks")
        data = [inputs] * args.world_size
        feeds = [front.shard_inputs(module, r, data[r]) for r in range(args.world_size)]
        before = run_graph(front.gm, feeds)
        after = run_graph(done.graph_module, feeds)
        same = all(torch.equal(a, b) for ra, rb in zip(before, after) for a, b in zip(ra, rb))
        print(f"  check on {args.world_size} gloo ranks: loss and gradients "
              f"{'bitwise equal' if same else 'DIFFER'} before/after scheduling")
        status = EXIT_OK if same else EXIT_FAILED
    if args.json:
        write_json(args.json, report)
        print(f"  report written to {args.json}")
    return status


def _schedule_graph(args, progress: Progress, instruments=(), timing=False):
    """Load the user's graph, tag it (--structural) and run the pipeline: (gm, done, structural result)."""
    from . import schedule
    from .lowering import LoweringError
    from .passes import parse_pipeline

    total = len(parse_pipeline(args.pipeline))  # a bad pipeline fails here, before any import
    progress.stage(f"loading {args.function}")
    gm = load_graph(args.function)
    LOG.info("%s: %d FX nodes", args.function, len(gm.graph.nodes))
    structural = None
    if args.structural:
        from .lowering.structural import tag_fsdp_collectives

        structural = tag_fsdp_collectives(gm)
        LOG.info("%s", structural)
    progress.stage(f"lowering {len(gm.graph.nodes)} FX nodes")
    try:
        done = schedule(gm, args.pipeline, timing=timing, cost_model=args.hardware,
                        instruments=[_progress_instrument(progress, total), *instruments])
    except LoweringError as exc:
        raise UsageError(f"cannot lower {args.function}(): {exc}") from exc
    progress.stage("done")
    for name, stats in done.report["passes"].items():
        LOG.info("pass %s: %s", name, ", ".join(f"{k}={v}" for k, v in stats.items()))
    return gm, done, structural


def _schedule(args) -> int:
    from .passes import PrintIR
    from .report import report_lines, simulate_before_after, summary_line, timing_text, write_json, write_trace

    check_hardware(args.hardware)
    progress = _progress(args)
    instruments = []
    if args.print_ir_before or args.print_ir_after or args.print_ir_after_change:
        instruments.append(PrintIR(before=args.print_ir_before,
                                   after=args.print_ir_after or args.print_ir_after_change,
                                   only_changed=args.print_ir_after_change and not args.print_ir_after))
    gm, done, structural = _schedule_graph(args, progress, instruments, timing=args.timing)
    report = done.report
    # with `--output -` stdout holds the code only: what is said goes to stderr
    say = functools.partial(print, file=sys.stderr if args.output == "-" else sys.stdout)
    say(f"fxsched schedule {args.function}: {len(gm.graph.nodes)} FX nodes, "
          f"{done.program.graph.number_of_nodes()} IR ops")
    if not args.report:  # the report starts with it
        say(f"  pipeline: {done.pipeline}")
    say(summary_line(report))
    if structural is not None:
        report = {**report, "structural": structural.as_dict()}
        say(f"  structural: {len(structural.tagged)} gathers and {len(structural.reductions)} gradient "
            f"reductions tagged, {len(structural.skipped)} not")
    elif not report["gathers"]:
        say("  no tagged FSDP gathers: nothing to schedule (untagged graph? try --structural)")
    sims = None
    if args.report or args.trace or args.json:
        progress.stage("simulating before/after")
        sims = simulate_before_after(gm, done, args.hardware, record=bool(args.trace))
        report = {**report, "simulation": {"hardware": args.hardware, "before": sims[0].summary(),
                                           "after": sims[1].summary()}}
    if args.report:
        from .cost import before_after

        say("\n".join(report_lines(report)))
        say(f"  simulated on {args.hardware} (roofline cost model):")
        say("    " + before_after(*sims).rstrip().replace("\n", "\n    "))
    if args.timing:
        say(timing_text(done.timing))
    if args.trace:
        write_trace(args.trace, *sims)
        say(f"  timeline written to {args.trace}")
    if args.json:
        write_json(args.json, report)
        say(f"  report written to {args.json}")
    if args.output:
        code = done.graph_module.code
        if args.output == "-":
            print(code)
        else:
            with open(args.output, "w") as f:
                f.write(code)
            say(f"  scheduled graph's code written to {args.output}")
    return EXIT_OK


def _explain(args) -> int:
    from .report import explain_text, write_json

    check_hardware(args.hardware)
    progress = _progress(args)
    gm, done, structural = _schedule_graph(args, progress)
    print(f"fxsched explain {args.function} ({done.pipeline}):")
    print(explain_text(done, gm))
    if args.json:
        report = done.report if structural is None else {**done.report, "structural": structural.as_dict()}
        write_json(args.json, report)
    return EXIT_OK


def _passes(args) -> int:
    from .passes import PASSES, PIPELINES
    from .passes.base import _format
    from .passes.plugins import load_entry_points

    load_entry_points()

    for name in sorted(PASSES):
        cls = PASSES[name]
        doc = ((sys.modules[cls.__module__].__doc__ or cls.__doc__ or "").strip().splitlines() or [""])[0]
        print(f"{name}: {doc.split(': ', 1)[-1]}")
        for text_name, field in cls.options().items():
            kind = cls.option_type(text_name)
            print(f"    {text_name}: {getattr(kind, '__name__', kind)} = {_format(field.default)}")
            if cls.option_help(text_name):
                print(f"        {cls.option_help(text_name)}")
    for name, text in PIPELINES.items():
        print(f"{name} pipeline: {text}")
    return EXIT_OK


# --------------------------------------------------------------------------- the parser


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line: `fxsched demo: argument --layers: ...`."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    # imports nothing of fxsched's stages: `fxsched --help` and argument errors stay instant
    common = _Parser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", help="log fxsched.* at INFO on stderr")
    common.add_argument("--progress", action="store_true",
                        help="show stages and elapsed seconds on stderr (default: only when stderr is a terminal)")
    common.add_argument("--load-pass-plugin", action="append", default=[], metavar="MODULE",
                        help="import MODULE (a dotted name or a .py path) first: the passes it registers can "
                             "be named in pipelines (repeatable)")
    pipeline = _Parser(add_help=False)
    pipeline.add_argument("--pipeline", default="default",
                          help="passes as text, e.g. 'anchor{forward-depth=2},budget,prefetch,sink', or a "
                               "named pipeline: default (the default), reference; `fxsched passes` lists passes, "
                               "their options and the named pipelines")
    pipeline.add_argument("--max-peak-gb", type=float, metavar="GIB",
                          help="hard cap on the simulated peak memory, in GiB, honoured by every pass (the "
                               "pipeline runs with memory-cap{...} first)")
    pipeline.add_argument("--max-peak-increase-gb", type=float, metavar="GIB",
                          help="hard cap as an increase over the input's simulated peak, in GiB (0: no increase; "
                               "with --max-peak-gb: the smaller)")
    pipeline.add_argument("--hardware", default="h100",
                          help="cost model profile for cost-guided passes and the simulation: h100 (default), "
                               "h200, 910b")
    user = _Parser(add_help=False)
    user.add_argument("function", metavar="MODULE:FUNCTION",
                      help="a function of no arguments returning a torch.fx.GraphModule; MODULE is a dotted "
                           "name or a .py path")
    user.add_argument("--structural", action="store_true",
                      help="first tag untagged FSDP gathers and gradient reductions found structurally "
                           "(torch.compile / SimpleFSDP / torchtitan graphs)")

    parser = _Parser(prog="fxsched", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"fxsched {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", parents=[common, pipeline],
                          help="trace a built-in model through the FSDP front and schedule it")
    demo.add_argument("--model", default="gpt", choices=["gpt", "llama", "encoder"])
    demo.add_argument("--layers", type=_positive_int, default=4)
    demo.add_argument("--width", type=_positive_int, default=64)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--world-size", type=_positive_int, default=2)
    demo.add_argument("--buckets", action="store_true", help="one gather per module")
    demo.add_argument("--bf16", action="store_true", help="mixed precision: gather bf16 shards")
    demo.add_argument("--trace", default="fxsched-demo.trace.json", metavar="FILE",
                      help="Chrome trace of the simulated schedule before/after (default %(default)s)")
    demo.add_argument("--no-trace", dest="trace", action="store_const", const=None, help="write no trace")
    demo.add_argument("--no-check", dest="check", action="store_false",
                      help="skip running before/after on gloo ranks")
    demo.add_argument("--json", metavar="FILE", help="also write the report as JSON to this file")
    demo.set_defaults(run=_demo)

    sched = sub.add_parser("schedule", parents=[common, user, pipeline],
                           help="schedule the GraphModule a user's function returns")
    sched.add_argument("--report", action="store_true",
                       help="print the report: pass statistics, each gather, notes, simulated before/after")
    sched.add_argument("--json", metavar="FILE", help="write the report as JSON to this file")
    sched.add_argument("--trace", metavar="FILE", help="write a Chrome trace of the simulated schedule before/after")
    sched.add_argument("--print-ir-before", action="store_true", help="print the IR before each pass (stderr)")
    sched.add_argument("--print-ir-after", action="store_true", help="print the IR after each pass (stderr)")
    sched.add_argument("--print-ir-after-change", action="store_true",
                       help="print the IR after each pass that changed it (stderr)")
    sched.add_argument("--timing", action="store_true", help="time each pass")
    sched.add_argument("--output", "-o", metavar="FILE", help="write the scheduled graph's code ('-': stdout)")
    sched.set_defaults(run=_schedule)

    explain = sub.add_parser("explain", parents=[common, user, pipeline],
                             help="for each gather: moved or not, where to, and why")
    explain.add_argument("--json", metavar="FILE", help="write the report as JSON to this file")
    explain.set_defaults(run=_explain)

    sub.add_parser("passes", parents=[common], help="list passes with their options and defaults").set_defaults(
        run=_passes)

    opt = sub.add_parser("opt", parents=[common], help="run a pipeline on IR text and print the IR (as mlir-opt)")
    opt.add_argument("input", nargs="?", default="-", metavar="FILE", help="IR text (default '-': stdin)")
    opt.add_argument("-p", "--pipeline", "--passes", dest="pipeline", default="",
                     help="pipeline text; named pipelines are items too, e.g. 'reference,overlap-reduce-scatter' "
                          "(default: none, only parse, verify and print)")
    opt.add_argument("-o", "--output", metavar="FILE", help="write the IR here (default '-': stdout)")
    opt.add_argument("--split-input-file", action="store_true",
                     help="treat each chunk between '// -----' lines as its own program; outputs joined the same way")
    opt.add_argument("--verify-each", dest="verify", action="store_true", default=True,
                     help="verify the input and the program after each pass (the default)")
    opt.add_argument("--no-verify", dest="verify", action="store_false", help="verify nothing")
    opt.add_argument("--verify-diagnostics", action="store_true",
                     help="print errors on stdout and succeed only if there was one (to FileCheck error messages)")
    opt.add_argument("--print-ir-before", action="store_true", help="print the IR before each pass (stderr)")
    opt.add_argument("--print-ir-after", action="store_true", help="print the IR after each pass (stderr)")
    opt.add_argument("--print-ir-after-change", action="store_true",
                     help="print the IR after each pass that changed it (stderr)")
    opt.add_argument("--timing", action="store_true", help="time each pass (stderr)")
    opt.add_argument("--pass-statistics", action="store_true",
                     help="after the IR, each pass's statistics as `// statistics PASS: key = value, ...` lines")
    opt.add_argument("--hardware", default="h100", help="cost model profile for cost-guided passes: h100 (default), "
                                                      "h200, 910b")
    opt.add_argument("--cost-table", metavar="FILE",
                     help="milliseconds per op for cost-guided passes: `KEY = MS` lines, KEY an op's %%name or a "
                          "target (aten.mm.default, or aten.mm); ops it does not list cost what --hardware says")
    opt.add_argument("--reproducer", metavar="FILE",
                     help="if a pass fails, write the IR before it and the rest of the pipeline as a .fxir "
                          "file whose RUN line reproduces the failure")
    opt.set_defaults(run=_opt)
    return parser


def _opt(args) -> int:
    from .opt import opt

    return opt(args)


def main(argv: list[str] | None = None) -> int:
    # torch warns on import when NumPy is not installed; fxsched needs no NumPy
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse printed its message (exit 2) or the help (exit 0)
        return int(exc.code or 0)
    from .logs import log_to
    from .ir.errors import InputError, InternalError

    with log_to(sys.stderr, logging.INFO) if args.verbose else contextlib.nullcontext():
        try:
            load_plugins(args.load_pass_plugin)
            if getattr(args, "max_peak_gb", None) is not None or getattr(args, "max_peak_increase_gb", None) is not None:
                from .passes.memory_cap import with_cap  # a bad value is a ConfigError: exit 2

                args.pipeline = with_cap(args.pipeline, args.max_peak_gb, args.max_peak_increase_gb)
            return args.run(args)
        except (UsageError, InputError) as exc:  # every kind of bad input (ir/errors.py): exit 2
            print(f"fxsched: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except InternalError as exc:  # a pass broke its promise (PassFailure): exit 1
            print(f"fxsched: {exc}", file=sys.stderr)
            return EXIT_FAILED
        except OSError as exc:  # an output file that cannot be written
            print(f"fxsched: {exc}", file=sys.stderr)
            return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
