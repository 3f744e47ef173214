"""`fxsched opt`: IR text in, a pipeline over it, IR text out (as `mlir-opt` / `xdsl-opt`).

    fxsched opt prog.fxir -p 'anchor,budget{max-in-flight-gb=0.5},prefetch,sink'
    fxsched opt - -p reference,sink < prog.fxir          # stdin; named pipelines are items too
    fxsched opt tests.fxir --split-input-file -p sink     # chunks separated by `// -----`

This is what the IR test files under tests/filecheck/ run (`// RUN: fxsched opt %s -p sink |
filecheck %s`). It reads and writes text only: no FX, so no torch import.
"""

from __future__ import annotations

import os
import re
import sys

SPLIT = "// -----"
_SPLIT_LINE = re.compile(r"^//\s*-----\s*$")


from .ir.errors import InputError


class SourceError(InputError):
    """A chunk of the input does not parse or is not a valid program. The message is a
    diagnostic as mlir-opt prints them, `FILE:LINE:COLUMN: error: …` (a test can FileCheck it
    with --verify-diagnostics), so opt prints it as it is, not as `fxsched: …`; exit 2."""


def split_input(text: str, split: bool) -> list[str]:
    """The chunks of `text` (one without `split`). Each chunk keeps the lines before it as blank
    lines, so the line numbers in an error are the file's."""
    if not split:
        return [text]
    chunks, lines, start = [], text.splitlines(), 0
    for i, line in enumerate(lines + [SPLIT]):
        if _SPLIT_LINE.match(line.strip()) or i == len(lines):
            chunks.append("\n" * start + "\n".join(lines[start:i]) + "\n")
            start = i + 1
    return chunks


def run_chunk(text: str, source: str, args, instruments) -> str:
    """Parse one chunk, run the pipeline on it, and return the printed result.

    Raises SourceError for bad text or an invalid input program, PassFailure when a pass fails."""
    from .ir import ParseError, parse_program, print_program, verify
    from .passes import PassContext, PassManager

    try:
        program = parse_program(text)
    except ParseError as exc:
        pointer = "".join(f"\n{line}" for line in str(exc).splitlines()[1:])
        raise SourceError(f"{source}:{exc.line}:{exc.column}: error: {exc.message}{pointer}") from None
    except ValueError as exc:  # the order breaks a rule no schedule could keep (EffectError)
        raise SourceError(f"{source}: error: {exc}") from None
    if args.verify:
        try:
            verify(program)
        except ValueError as exc:
            raise SourceError(f"{source}: error: {exc}") from None
    manager = PassManager(args.pipeline_passes, verify_each=args.verify, instruments=instruments,
                          reproducer=bool(args.reproducer))
    result = manager.run(program, PassContext(cost_model=args.cost_model))
    text = print_program(program)
    if args.pass_statistics:  # as comments, so the output still parses
        for name, stats in result.stats().items():
            text += f"// statistics {name}: " + ", ".join(f"{k} = {_stat(v)}" for k, v in stats.items()) + "\n"
    return text


def _stat(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_stat(v)}" for k, v in sorted(value.items())) + "}"
    return str(value)


def rerun_line(args, pipeline: str) -> str:
    """The `fxsched opt` arguments that rerun `pipeline` as this run did (for reproducers)."""
    parts = [f"-p '{pipeline}'"]
    if args.hardware != "h100":
        parts.append(f"--hardware {args.hardware}")
    if args.cost_table:
        parts.append(f"--cost-table {os.path.abspath(args.cost_table)}")
    if not args.verify:
        parts.append("--no-verify")
    parts += [f"--load-pass-plugin {os.path.abspath(m) if m.endswith('.py') or os.sep in m else m}"
              for m in args.load_pass_plugin]
    return " ".join(parts)


def opt(args) -> int:
    """The `opt` command; returns the exit code (see cli.py)."""
    from .cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, UsageError, check_hardware
    from .passes import PassFailure, PrintIR, Timing, parse_pipeline, print_pipeline

    check_hardware(args.hardware)
    args.pipeline_passes = parse_pipeline(args.pipeline)
    args.cost_model = args.hardware
    if args.cost_table:
        from .cost.model import Roofline, parse_cost_table
        from .cost import hardware

        try:
            with open(args.cost_table) as f:
                table = f.read()
        except OSError as exc:
            raise UsageError(f"cannot read {args.cost_table}: {exc.strerror}") from None
        args.cost_model = parse_cost_table(table, args.cost_table, Roofline(hardware(args.hardware)))
    source = "<stdin>" if args.input == "-" else args.input
    try:
        text = sys.stdin.read() if args.input == "-" else open(args.input).read()
    except OSError as exc:
        raise UsageError(f"cannot read {source}: {exc.strerror}") from None
    timing = Timing() if args.timing else None
    instruments = [timing] if timing else []
    if args.print_ir_before or args.print_ir_after or args.print_ir_after_change:
        instruments.append(PrintIR(before=args.print_ir_before,
                                   after=args.print_ir_after or args.print_ir_after_change,
                                   only_changed=args.print_ir_after_change and not args.print_ir_after))
    outputs, status = [], EXIT_OK
    # diagnostics go to stdout with --verify-diagnostics, so a test can FileCheck them; the
    # run then succeeds exactly when a diagnostic was expected and given
    errors = sys.stdout if args.verify_diagnostics else sys.stderr
    for chunk in split_input(text, args.split_input_file):
        try:
            outputs.append(run_chunk(chunk, source, args, instruments))
        except SourceError as exc:
            print(exc, file=errors)
            status = max(status, EXIT_USAGE)
        except PassFailure as exc:
            print(f"{source}: error: {exc}", file=errors)
            if args.reproducer and exc.ir_before is not None:
                _write_reproducer(args.reproducer, exc, rerun_line(args, print_pipeline(exc.remaining)))
                print(f"fxsched: reproducer written to {args.reproducer}", file=sys.stderr)
            status = max(status, EXIT_FAILED)
    if timing is not None:
        print(timing.report(), file=sys.stderr, end="")
    result = f"{SPLIT}\n".join(outputs)
    if args.output in (None, "-"):
        sys.stdout.write(result)
    else:
        with open(args.output, "w") as f:
            f.write(result)
    if args.verify_diagnostics:
        if status == EXIT_OK:
            print("fxsched: --verify-diagnostics: no error was reported", file=sys.stderr)
            return EXIT_FAILED
        return EXIT_OK
    return status


def _write_reproducer(path: str, failure, rerun: str) -> None:
    from .passes import reproducer_text

    with open(path, "w") as f:
        f.write(reproducer_text(failure, rerun))
