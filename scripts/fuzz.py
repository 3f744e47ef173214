#!/usr/bin/env python3
"""Fuzz fxsched: run the property tests (tests/test_properties.py) with many random examples.

    .venv/bin/python scripts/fuzz.py --examples 2000            # thousands of IR programs, and graphs
    .venv/bin/python scripts/fuzz.py --examples 5000 --graph-examples 200 -k ir_programs
    .venv/bin/python scripts/fuzz.py --seed 1234                 # replay one run's choices

The tests: generated FX graphs and IR programs scheduled by random pipelines (legal, within
budget, stable on a second run; `hide` pipelines move nothing at all), the reference run
twice against the oracle (tests/oracle.py), and the IR parser on mutated programs (a program
or a ParseError with line and column; a valid one then runs through a pipeline with every
kept analysis checked). CI runs the same tests with a few derandomized examples each. Here
every test draws `--examples` random cases (`--graph-examples` for the tests that generate
FX graphs, ~1 s a case; default: the same number). Failures are shrunk, printed with the
graph options and the pipeline, and saved in .hypothesis/ so that the next run tries them
first; the smallest case of each failing test is also written as an IR test file,
`--reproducers DIR/NAME.fxir` (default fuzz-reproducers/), whose RUN line reruns it with
`fxsched opt` (tests/reproducers.py). Extra arguments go to pytest (e.g. `-x`, `-v`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=2000, help="random cases per property test (default 2000)")
    parser.add_argument("--graph-examples", type=int, default=None,
                        help="cases for the tests that generate FX graphs (default: --examples)")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: random)")
    parser.add_argument("--reproducers", default="fuzz-reproducers", metavar="DIR",
                        help="write each failing test's smallest case here as a .fxir file (default %(default)s)")
    parser.add_argument("-k", dest="select", default=None, help="run only the tests matching this pytest -k expression")
    args, pytest_args = parser.parse_known_args(argv)
    for name in ("examples", "graph_examples"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    env = dict(os.environ, FXSCHED_FUZZ_EXAMPLES=str(args.examples),
               FXSCHED_FUZZ_GRAPH_EXAMPLES=str(args.graph_examples or args.examples),
               FXSCHED_REPRODUCERS=os.path.abspath(args.reproducers))
    command = [sys.executable, "-m", "pytest", "-q", "--hypothesis-show-statistics",
               str(ROOT / "tests" / "test_properties.py")]
    if args.seed is not None:
        command.append(f"--hypothesis-seed={args.seed}")
    if args.select:
        command += ["-k", args.select]
    command += pytest_args
    print("+ FXSCHED_FUZZ_EXAMPLES={} FXSCHED_FUZZ_GRAPH_EXAMPLES={} {}".format(
        env["FXSCHED_FUZZ_EXAMPLES"], env["FXSCHED_FUZZ_GRAPH_EXAMPLES"], " ".join(command)), flush=True)
    return subprocess.call(command, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main())
