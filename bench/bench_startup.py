"""Start-up time of the `fxsched` command: what a compiler engineer waits for in an edit-test loop.

    .venv/bin/python bench/bench_startup.py              # best of 9 runs each
    .venv/bin/python bench/bench_startup.py --runs 21

Times, as separate processes (interpreter start included), `fxsched --help`,
`fxsched --version`, `fxsched opt` on a 50-line IR file (the default pipeline and none),
`python -c "import fxsched.ir"` / `"import fxsched.passes"`, and a bare `python -c pass` as the
floor; reports the best and the median wall time, the best CPU time (user + system: steadier on
a loaded machine), and whether each imported torch or NumPy. Writes
bench/out/startup.{json,md}. Goal: `fxsched --help` and `fxsched opt` on 50 lines < 0.5 s.
On a shared machine the best of many runs is the number to compare; the median shows the load.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"


def fifty_line_program() -> str:
    lines = ["%x = input", *(f"%w{i} = input" for i in range(6)), "^entry"]
    previous = "x"
    for i in range(6):
        lines += [f'%g{i} = launch "ag"(%w{i}) {{role = fsdp_all_gather, nbytes = 1024, params = ["w{i}"]}}',
                  f"%t{i} = wait(%g{i})",
                  f'%v{i} = view "aten.view"(%t{i})',
                  f'%n{i} = compute "aten.neg"(%{previous})',
                  f'%m{i} = compute "aten.mm"(%n{i}, %v{i}) {{heavy}}',
                  f'%f{i} = free "free"(%v{i}) {{params = ["w{i}"]}}',
                  f'%c{i} = compute "aten.add"(%m{i}, %x)']
        previous = f"c{i}"
    lines.append(f"%output = output(%{previous})")
    return "\n".join(lines) + "\n"


def time_command(command: list[str], runs: int) -> dict:
    """Wall and CPU (user + system) seconds of `command` as a child process; on a loaded machine the
    CPU time is the steadier number, the wall time what a person waits."""
    seconds, cpu = [], []
    for _ in range(runs):
        used = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True)
        seconds.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime - used.ru_utime + after.ru_stime - used.ru_stime)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr}")
    return {"best_s": min(seconds), "median_s": statistics.median(seconds), "best_cpu_s": min(cpu),
            "numpy_warning": "NumPy" in done.stderr}


def imports_of(code: str) -> list[str]:
    probe = code + "\nimport sys; print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    return json.loads(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                     check=True).stdout.strip().replace("'", '"'))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=9)
    args = parser.parse_args()
    python = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        program = Path(tmp) / "fifty.fxir"
        program.write_text(fifty_line_program())
        cli = "from fxsched.cli import main; import sys; sys.argv[0] = 'fxsched'; "
        cases = {
            "python -c pass (floor)": ([python, "-c", "pass"], "pass"),
            "fxsched --help": ([python, "-m", "fxsched", "--help"], cli + "main(['--help'])"),
            "fxsched --version": ([python, "-m", "fxsched", "--version"], cli + "main(['--version'])"),
            "fxsched opt 50 lines (no passes)": ([python, "-m", "fxsched", "opt", str(program)],
                                                 cli + f"main(['opt', {str(program)!r}])"),
            "fxsched opt 50 lines -p default": ([python, "-m", "fxsched", "opt", str(program), "-p", "default"],
                                                cli + f"main(['opt', {str(program)!r}, '-p', 'default'])"),
            "import fxsched.ir": ([python, "-c", "import fxsched.ir"], "import fxsched.ir"),
            "import fxsched.passes": ([python, "-c", "import fxsched.passes"], "import fxsched.passes"),
        }
        rows = {}
        for name, (command, probe) in cases.items():
            rows[name] = {**time_command(command, args.runs),
                          "imports": imports_of(f"import contextlib, io\nwith contextlib.redirect_stdout(io.StringIO()):\n"
                                                f"    try:\n        {probe}\n    except SystemExit:\n        pass")}
            row = rows[name]
            print(f"{name:<36} best {row['best_s']:.3f} s  median {row['median_s']:.3f} s  "
                  f"cpu {row['best_cpu_s']:.3f} s  "
                  f"imports {row['imports'] or 'no torch, no numpy'}", flush=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    OUT.mkdir(exist_ok=True)
    record = {"runs": args.runs, "load_average_1min": load, "cpus": os.cpu_count(), "rows": rows,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    (OUT / "startup.json").write_text(json.dumps(record, indent=1))
    table = ["| command | wall, best | wall, median | CPU, best | imports torch/numpy |",
             "| --- | ---: | ---: | ---: | --- |"]
    table += [f"| `{k}` | {v['best_s']:.3f} s | {v['median_s']:.3f} s | {v['best_cpu_s']:.3f} s | "
              f"{', '.join(v['imports']) or 'neither'} |"
              for k, v in rows.items()]
    (OUT / "startup.md").write_text("\n".join(table) + f"\n\nbest/median of {args.runs} runs, {record['date']}, "
                                    f"load average {load}\n")
    print(f"load average {load}; written to {OUT / 'startup.md'}")


if __name__ == "__main__":
    main()
