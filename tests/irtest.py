"""Helpers shared by the tests that write IR by hand: dedent, FileCheck, run a pipeline."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap

from fxsched.ir import parse_program
from fxsched.passes import PassManager


def dedent(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def filecheck(output: str, checks: str) -> None:
    """Run the `filecheck` package (a Python FileCheck) on `output` with `checks` as the check file."""
    with tempfile.NamedTemporaryFile("w", suffix=".check", delete=False) as f:
        f.write(dedent(checks))
    try:
        result = subprocess.run([sys.executable, "-m", "filecheck", f.name], input=output,
                                capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    assert result.returncode == 0, f"filecheck failed:\n{result.stdout}{result.stderr}\n--- input ---\n{output}"


def run(text: str, pipeline: str):
    """Parse hand-written IR and run `pipeline` on it: (program, PipelineResult)."""
    program = parse_program(dedent(text))
    result = PassManager(pipeline).run(program)
    return program, result
