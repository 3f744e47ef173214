"""`fxsched opt` and the IR test files: what a compiler engineer's loop relies on.

The IR test files themselves (tests/filecheck/**/*.fxir) are collected by conftest.py; here:
a broken CHECK fails with a located message (pytest and lit), chunks, diagnostics, crash
reproducers, plugins by module and by entry point, and no torch import on the way.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from filecheck_runner import RunFailure, run_file

HERE = Path(__file__).parent
SINK_INPUT = """\
%x = input
%w = input
^entry
%a = launch "ag"(%w) {role = fsdp_all_gather, nbytes = 1, params = ["w"]}
%t = wait(%a)
%n = compute "aten.neg"(%x)
%m = compute "aten.mm"(%n, %t) {heavy}
%output = output(%m)
"""

# a plugin whose passes fail: one raises, one leaves the wait ahead of its launch
FAILING_PLUGIN = '''
import dataclasses
from fxsched.passes import ModulePass, PassResult, register_pass

@register_pass
@dataclasses.dataclass(frozen=True)
class Boom(ModulePass):
    name = "boom"
    def apply(self, ctx, program):
        raise RuntimeError("boom went off")

@register_pass
@dataclasses.dataclass(frozen=True)
class WaitFirst(ModulePass):
    name = "wait-first"
    reorders_only = True
    def apply(self, ctx, program):
        program.schedule.move_before(["t"], "a")
        return PassResult(True)
'''


def fxsched(*args: str, stdin: str | None = None, cwd=None, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fxsched", *args], input=stdin, capture_output=True, text=True,
                          cwd=cwd, env=env)


def test_a_broken_check_fails_with_filechecks_located_message(tmp_path):
    broken = tmp_path / "broken.fxir"
    broken.write_text("// RUN: fxsched opt %s -p sink | filecheck %s\n" + SINK_INPUT +
                      "// CHECK: %n = compute\n// CHECK-NEXT: %t = wait(%nonesuch)\n")
    with pytest.raises(RunFailure) as info:
        run_file(str(broken))
    message = str(info.value)
    assert f"{broken}:11: error" in message and "%t = wait(%nonesuch)" in message
    assert "exit status 1" in message
    # the same file with the right operand passes
    broken.write_text(broken.read_text().replace("%nonesuch", "%a"))
    assert run_file(str(broken)) == 1


def test_lit_runs_the_ir_files_and_reports_a_broken_check(tmp_path):
    pytest.importorskip("lit")
    shutil.copy(HERE / "filecheck" / "lit.cfg", tmp_path / "lit.cfg")
    (tmp_path / "good.fxir").write_text("// RUN: fxsched opt %s -p sink | filecheck %s\n" + SINK_INPUT +
                                        "// CHECK: %n = compute\n// CHECK-NEXT: %t = wait(%a)\n")
    (tmp_path / "bad.fxir").write_text("// RUN: fxsched opt %s -p sink | filecheck %s\n" + SINK_INPUT +
                                       "// CHECK: %n = compute\n// CHECK-NEXT: %m = compute\n")
    lit = subprocess.run([sys.executable, "-c", "from lit.main import main; main()", "-v", str(tmp_path)], capture_output=True, text=True)
    assert lit.returncode == 1, lit.stdout + lit.stderr
    assert "PASS: fxsched :: good.fxir" in lit.stdout and "FAIL: fxsched :: bad.fxir" in lit.stdout
    assert f"{tmp_path / 'bad.fxir'}:11: error: Couldn't match \"%m = compute\"" in lit.stdout


def test_opt_reads_stdin_runs_named_pipelines_as_items_and_writes_a_file(tmp_path):
    done = fxsched("opt", "-p", "reference,sink", "--pass-statistics", "-o", str(tmp_path / "out.fxir"),
                   stdin=SINK_INPUT)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    out = (tmp_path / "out.fxir").read_text()
    assert "// statistics anchor:" in out and "// statistics sink#2:" in out
    assert out.index("%n = compute") < out.index("%t = wait(%a)")


def test_split_input_file_keeps_file_line_numbers_in_errors_and_goes_on():
    text = SINK_INPUT + "// -----\n%x = input\n%y = compute \"aten.neg\"(%nope)\n// -----\n" + SINK_INPUT
    done = fxsched("opt", "--split-input-file", "-p", "sink", stdin=text)
    assert done.returncode == 2
    assert done.stderr.splitlines()[0] == "<stdin>:11:25: error: %nope is not defined"
    assert done.stdout.count("%output = output(%m)") == 2 and done.stdout.count("// -----\n") == 1
    checked = fxsched("opt", "--split-input-file", "--verify-diagnostics", stdin=text)
    assert checked.returncode == 0 and "<stdin>:11:25: error: %nope is not defined" in checked.stdout
    assert fxsched("opt", "--verify-diagnostics", stdin=SINK_INPUT).returncode == 1


def test_an_invalid_input_is_the_inputs_fault_unless_verification_is_off():
    wait_first = SINK_INPUT.replace('%a = launch "ag"(%w) {role = fsdp_all_gather, nbytes = 1, params = ["w"]}\n', "")
    wait_first = wait_first.replace("%t = wait(%a)\n", '%t = wait(%a)\n%a = launch "ag"(%w)\n')
    done = fxsched("opt", "-p", "sink", stdin=wait_first)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "<stdin>: error: invalid program:\n  %t: scheduled before %a, which it must follow by a data edge\n"
    unchecked = fxsched("opt", "--no-verify", stdin=wait_first)
    assert unchecked.returncode == 0 and unchecked.stdout == wait_first
    use_after_free = SINK_INPUT.replace("%n = compute", '%f = free "free"(%t) {params = ["w"]}\n%n = compute')
    done = fxsched("opt", stdin=use_after_free)
    # the effect rules name the reader and the free (their wording is ir/effects.py's); the
    # parser places it on the reader's line
    assert done.returncode == 2 and done.stderr.startswith("<stdin>:8:1: error: ") and done.stdout == ""
    assert "%m" in done.stderr and "%f" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("pipeline, failed", [("sink,boom", "boom"), ("sink,wait-first,order-gathers", "wait-first")])
def test_a_failed_pass_leaves_a_reproducer_that_fails_the_same_way(tmp_path, pipeline, failed):
    plugin = tmp_path / "failing.py"
    plugin.write_text(FAILING_PLUGIN)
    (tmp_path / "in.fxir").write_text(SINK_INPUT)
    repro = tmp_path / "repro.fxir"
    done = fxsched("opt", "in.fxir", "--load-pass-plugin", "failing.py", "-p", pipeline, "--reproducer", str(repro),
                   cwd=tmp_path)
    assert done.returncode == 1
    assert f"pass '{failed}'" in done.stderr and f"reproducer written to {repro}" in done.stderr
    text = repro.read_text()
    rest = pipeline.split(",", 1)[1]
    assert f"// RUN: fxsched opt %s -p '{rest}' --load-pass-plugin {plugin}" in text
    # the IR is the program as sink left it: the wait already sunk below %n
    ir = text[text.index("%x = input"):]
    assert ir.index("%n = compute") < ir.index("%t = wait(%a)")
    # the RUN line fails the same way, from anywhere (the plugin's path is made absolute)
    with pytest.raises(RunFailure) as info:
        run_file(str(repro))
    assert f"pass '{failed}'" in str(info.value)


def test_a_pass_from_an_installed_packages_entry_point(tmp_path):
    (tmp_path / "my_passes.py").write_text(FAILING_PLUGIN)
    dist = tmp_path / "my_passes-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-passes\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[fxsched.passes]\nmine = my_passes\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.environ.get("PYTHONPATH", ""), str(tmp_path)]))
    done = fxsched("opt", "-p", "sink,boom", stdin=SINK_INPUT, env=env)
    assert done.returncode == 1 and "pass 'boom' failed: RuntimeError: boom went off" in done.stderr
    listed = fxsched("passes", env=env)
    assert listed.returncode == 0 and "\nboom" in listed.stdout
    unknown = fxsched("opt", "-p", "boom", stdin=SINK_INPUT)  # not installed here: a usage error
    assert unknown.returncode == 2 and "unknown pass 'boom'" in unknown.stderr


def test_the_ir_and_passes_and_opt_do_not_import_torch(tmp_path):
    (tmp_path / "in.fxir").write_text(SINK_INPUT)
    script = textwrap.dedent(f"""
        import sys
        import fxsched, fxsched.ir, fxsched.passes, fxsched.cost
        from fxsched.cli import main
        assert main(["opt", {str(tmp_path / 'in.fxir')!r}, "-p", "default", "-o", {str(tmp_path / 'out')!r}]) == 0
        assert main(["passes"]) == 0
        print(sorted(m for m in sys.modules if m == "torch" or m.startswith("numpy")))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"
    assert "NumPy" not in done.stderr


TWO_GATHERS = """\
%x = input
%w1 = input
%w2 = input
^entry
%a1 = launch "ag"(%w1) {group = "0", role = fsdp_all_gather, nbytes = 1000, params = ["w1"]}
%t1 = wait(%a1)
%m1 = compute "mm"(%x, %t1)
%c1 = compute "c"(%m1)
%c2 = compute "c"(%c1)
%c3 = compute "c"(%c2)
%c4 = compute "c"(%c3)
%a2 = launch "ag"(%w2) {group = "0", role = fsdp_all_gather, nbytes = 1000, params = ["w2"]}
%t2 = wait(%a2)
%m2 = compute "mm"(%c4, %t2)
%output = output(%m2)
"""


def test_a_cost_table_prices_ops_by_target_and_by_name_and_names_its_bad_line(tmp_path):
    """`--cost-table`: by target a2 (2 ms) launches at 3 ms, before c3 (hide.fxir); an op's own
    %name wins over its target: c3 free and a2 3 ms move it to 1 ms, before c1. A bad line is
    an input error naming file and line; a reproducer reruns with the table."""
    table = tmp_path / "costs.table"
    table.write_text("# ms\nc = 1.0\nmm = 1.0\nag = 2.0\n")
    done = fxsched("opt", "-p", "hide,prefetch", "--cost-table", str(table), stdin=TWO_GATHERS)
    assert done.returncode == 0, done.stderr
    assert "anchor = %c3, prefetched}" in done.stdout
    table.write_text(table.read_text() + "%c3 = 0\n%a2 = 3.0\n")
    done = fxsched("opt", "-p", "hide,prefetch", "--cost-table", str(table), stdin=TWO_GATHERS)
    assert "anchor = %c1, prefetched}" in done.stdout
    table.write_text("c = 1.0\n\nmm = fast\n")
    done = fxsched("opt", "-p", "hide", "--cost-table", str(table), stdin=TWO_GATHERS)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith(f"fxsched: {table}:3: expected KEY = MS") and "'mm = fast'" in done.stderr
    for bad in ("c = -1", "c = nan", "c 1.0", "= 1", "c = 1\nc = 2"):
        table.write_text(bad + "\n")
        done = fxsched("opt", "-p", "hide", "--cost-table", str(table), stdin=TWO_GATHERS)
        assert done.returncode == 2 and done.stderr.startswith(f"fxsched: {table}:"), (bad, done.stderr)
    missing = fxsched("opt", "-p", "hide", "--cost-table", str(tmp_path / "none"), stdin=TWO_GATHERS)
    assert missing.returncode == 2 and "cannot read" in missing.stderr


def test_version_from_python_dash_m():
    from fxsched import __version__

    done = fxsched("--version")
    assert done.returncode == 0 and done.stdout == f"fxsched {__version__}\n"


def test_a_fuzzer_failure_becomes_an_ir_test_file(tmp_path, monkeypatch):
    from reproducers import reproducer_on_failure

    from fxsched.ir import parse_program
    from fxsched.passes import PassFailure, PassManager
    from fxsched.passes.plugins import load_module

    plugin = tmp_path / "failing.py"
    plugin.write_text(FAILING_PLUGIN)
    load_module(str(plugin))
    monkeypatch.setenv("FXSCHED_REPRODUCERS", str(tmp_path / "out"))
    # a pass that fails: the IR before it, and a RUN line that fails the same way
    with pytest.raises(PassFailure), reproducer_on_failure("case", lambda: SINK_INPUT, "sink,boom"):
        PassManager("sink,boom", reproducer=True).run(parse_program(SINK_INPUT))
    written = (tmp_path / "out" / "case.fxir").read_text()
    assert "// RUN: fxsched opt %s -p 'boom'" in written
    with pytest.raises(RunFailure) as info:
        run_file(str(tmp_path / "out" / "case.fxir"))
    assert "unknown pass 'boom'" in str(info.value)  # the RUN line names no plugin: fxsched opt's own registry
    # a check of the test that failed: the program before the pipeline, the check in a comment
    with pytest.raises(AssertionError), reproducer_on_failure("check", lambda: SINK_INPUT, "sink"):
        assert False, "a second run moved ops to other places"
    written = (tmp_path / "out" / "check.fxir").read_text()
    assert "//   AssertionError: a second run moved ops to other places" in written
    assert "// RUN: fxsched opt %s -p 'sink'" in written and written.endswith(SINK_INPUT)
    assert run_file(str(tmp_path / "out" / "check.fxir")) == 1
