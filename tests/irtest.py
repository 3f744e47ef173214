"""Helpers shared by the tests that write IR by hand: dedent, FileCheck, run a pipeline."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap

from fxsched.ir import parse_program
from fxsched.passes import PassManager


# three gathers after a barrier, launched in the order the graph emitted them (shared by the
# determinism and property tests)
STACK_AFTER_A_BARRIER = """\
%x = input
%s0 = input
%s1 = input
%s2 = input
%b = barrier "aten.copy_"(%x)
%m0 = compute "aten.mm"(%x, %x) {heavy}
%g1 = launch "ag"(%s1) {role = fsdp_all_gather, nbytes = 512, params = ["p1"]}
%w1 = wait(%g1)
%m1 = compute "aten.mm"(%m0, %w1) {heavy}
%g2 = launch "ag"(%s2) {role = fsdp_all_gather, nbytes = 512, params = ["p2"]}
%w2 = wait(%g2)
%m2 = compute "aten.mm"(%m1, %w2) {heavy}
%g0 = launch "ag"(%s0) {role = fsdp_all_gather, nbytes = 512, params = ["p0"]}
%w0 = wait(%g0)
%m3 = compute "aten.mm"(%m2, %w0) {heavy}
%output = output(%m3)
"""


def joint(forward: int, backward: int) -> str:
    """`forward` gathers a1.. each read by one matmul m1.., then `backward` re-gathers b_n..b1
    read by n_n..n1 (all 100 bytes)."""
    lines = ["%x = input", *(f"%w{i} = input" for i in range(1, max(forward, backward) + 1)), "^entry"]
    prev = "%x"
    for i in range(1, forward + 1):
        lines += [f'%a{i} = launch "ag"(%w{i}) {{role = fsdp_all_gather, nbytes = 100, params = ["w{i}"]}}',
                  f"%t{i} = wait(%a{i})", f'%m{i} = compute "aten.mm"({prev}, %t{i}) {{heavy}}']
        prev = f"%m{i}"
    if backward:
        lines.append("^backward")
    for i in range(backward, 0, -1):
        lines += [f'%b{i} = launch "ag"(%w{i}) {{role = fsdp_all_gather_backward, nbytes = 100, params = ["w{i}"]}}',
                  f"%u{i} = wait(%b{i})", f'%n{i} = compute "aten.mm"({prev}, %u{i}) {{heavy}}']
        prev = f"%n{i}"
    lines.append(f"%output = output({prev})")
    return "\n".join(lines) + "\n"


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
