"""The `fxsched` command, in-process through `fxsched.cli.main` (plus one run of the console script).

The MODULE:FUNCTION targets are this file's functions (`test_cli:...`; pytest puts tests/ on
the path) or small files written to tmp_path.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed._functional_collectives  # noqa: F401
from torch.fx.experimental.proxy_tensor import make_fx

from fxsched.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, main

_C = torch.ops._c10d_functional
PIPELINE = "anchor,budget,prefetch,sink"  # spelled out: tests don't follow changes of the default


# --------------------------------------------------------------------------- graphs the commands load


@functools.lru_cache(maxsize=1)
def tagged_graph():
    """A 2-layer GPT through the FSDP front: HyperParallel-tagged (the commands never mutate it)."""
    from fxsched.front import fsdp_joint_graph
    from fxsched.models import build_model

    module, inputs, loss = build_model("gpt", layers=2, width=32, seed=0)
    return fsdp_joint_graph(module, inputs, lambda m, *xs: loss(m(*xs), *xs), 2).gm


def untagged_graph():
    """torch.compile-style: three layers gathering their shards with functional collectives, no tags."""
    def f(s1, s2, s3, x):
        for s in (s1, s2, s3):
            x = torch.tanh(x @ _C.wait_tensor(_C.all_gather_into_tensor(s, 2, "0")).view(8, 8))
        return (x,)

    return make_fx(f, tracing_mode="fake")(*[torch.randn(32) for _ in range(3)], torch.randn(4, 8))


def malformed_graph():
    gm = untagged_graph()
    gather = gm.graph.find_nodes(op="call_function", target=_C.all_gather_into_tensor.default)[0]
    gather.meta.update(comm_type="fsdp_all_gather", param_name="w")
    with gm.graph.inserting_after(gather):
        gm.graph.call_function(torch.ops.aten.clone.default, (gather,))
    return gm


def not_a_graph():
    return 42


def raises():
    raise ValueError("boom")


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# --------------------------------------------------------------------------- passes, schedule


def test_passes_lists_options(capsys):
    code, out, _ = run(capsys, "passes")
    assert code == EXIT_OK
    assert "anchor:" in out and "    forward-depth: int = 1\n" in out
    assert "reference pipeline: anchor,budget,prefetch,sink" in out and "default pipeline: " in out


def test_schedule_prints_summary_and_writes_files(capsys, tmp_path):
    report_path, code_path = tmp_path / "report.json", tmp_path / "scheduled.py"
    code, out, err = run(capsys, "schedule", "test_cli:tagged_graph", "--report", "--timing", "--pipeline", PIPELINE,
                         "--json", str(report_path), "--output", str(code_path))
    assert code == EXIT_OK, err
    assert "fxsched schedule test_cli:tagged_graph:" in out
    assert "gathers:" in out and " moved (" in out and "nodes sunk" in out
    assert "pipeline: anchor,budget,prefetch,sink" in out
    assert "before %" in out and "stays (first group)" in out  # the per-gather table
    assert "pass timing:" in out
    report = json.loads(report_path.read_text())  # plain JSON: no default= needed to write it
    assert {"pipeline", "passes", "gathers", "notes", "changed", "simulation"} <= set(report)
    assert any(row["moved"] for row in report["gathers"])
    if report["simulation"] is not None:
        assert "step ms" in out and report["simulation"]["after"]["step_ms"] > 0
    assert "def forward" in code_path.read_text()


def test_schedule_report_is_json_data():
    from fxsched import schedule

    report = schedule(tagged_graph()).report
    assert json.loads(json.dumps(report)) == json.loads(json.dumps(report, default=str))


def test_schedule_output_to_stdout_is_only_the_code(capsys):
    code, out, err = run(capsys, "schedule", "test_cli:tagged_graph", "--pipeline", "sink", "-o", "-", "--timing")
    assert code == EXIT_OK and out.lstrip().startswith("def forward") and "fxsched schedule" not in out
    compile(out, "<scheduled>", "exec")  # stdout is Python, nothing else
    assert "fxsched schedule test_cli:tagged_graph" in err and "pass timing:" in err


def test_schedule_a_file_that_imports_its_siblings(capsys, tmp_path, monkeypatch):
    (tmp_path / "helpers.py").write_text("from test_cli import tagged_graph\n")
    (tmp_path / "graphs.py").write_text("import helpers\n\ndef build():\n    return helpers.tagged_graph()\n")
    monkeypatch.chdir(os.path.dirname(__file__))  # not the file's folder
    monkeypatch.setattr(sys, "path", list(sys.path))
    code, out, err = run(capsys, "schedule", f"{tmp_path / 'graphs.py'}:build", "--pipeline", "sink")
    assert code == EXIT_OK, err


def test_print_ir_instruments(capsys):
    code, _, err = run(capsys, "schedule", "test_cli:untagged_graph", "--structural", "--pipeline",
                       "anchor,budget{max-in-flight-gb=0.0},prefetch,sink", "--print-ir-after-change")
    assert code == EXIT_OK
    printed = [line for line in err.splitlines() if line.startswith("// ----- IR after")]
    assert printed == ["// ----- IR after anchor -----", "// ----- IR after budget{max-in-flight-gb=0.0} -----"]
    code, _, err = run(capsys, "schedule", "test_cli:untagged_graph", "--pipeline", "sink", "--print-ir-before",
                       "--print-ir-after")
    assert code == EXIT_OK
    assert "// ----- IR before sink -----" in err and "// ----- IR after sink -----" in err


def test_trace_has_before_and_after(capsys, tmp_path):
    path = tmp_path / "trace.json"
    code, out, err = run(capsys, "schedule", "test_cli:tagged_graph", "--trace", str(path))
    assert code == EXIT_OK, err
    trace = json.loads(path.read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {1, 2}
    assert any(e["ph"] == "X" for e in trace["traceEvents"])
    assert trace["otherData"]["after"]["step_ms"] <= trace["otherData"]["before"]["step_ms"]


def test_structural_flag(capsys, tmp_path):
    code, out, _ = run(capsys, "schedule", "test_cli:untagged_graph")
    assert code == EXIT_OK and "0 gathers" in out and "try --structural" in out
    report_path = tmp_path / "r.json"
    code, out, _ = run(capsys, "schedule", "test_cli:untagged_graph", "--structural", "--json", str(report_path),
                       "--pipeline", PIPELINE)
    assert code == EXIT_OK and "3 gathers: 2 moved (fwd 2)" in out and "structural: 3 gathers and 0 gradient reductions tagged, 0 not" in out
    report = json.loads(report_path.read_text())
    assert [g["param_name"] for g in report["structural"]["tagged"]] == ["s1_1", "s2_1", "s3_1"]


# --------------------------------------------------------------------------- explain


def test_explain_says_where_and_why(capsys, tmp_path):
    code, out, _ = run(capsys, "explain", "test_cli:untagged_graph", "--structural", "--pipeline", PIPELINE,
                       "--json", str(tmp_path / "e.json"))
    assert code == EXIT_OK
    lines = out.splitlines()
    at = lines.index(next(line for line in lines if line.startswith("%all_gather_into_tensor (")))
    assert "stays: first group: its consumer is the first of its phase" in lines[at + 1]
    at = lines.index(next(line for line in lines if line.startswith("%all_gather_into_tensor_1 (")))
    assert "(fwd, fsdp_all_gather, s2_1, 256 B)" in lines[at]
    assert lines[at + 1].strip().startswith("moved: launches just before %mm (") and "nodes earlier" in lines[at + 1]
    assert json.loads((tmp_path / "e.json").read_text())["gathers"][1]["anchor"] == "mm"


def test_explain_budget_and_notes(capsys):
    code, out, _ = run(capsys, "explain", "test_cli:tagged_graph", "--pipeline",
                       "anchor,budget{max-in-flight-gb=0.0},prefetch,sink")
    assert code == EXIT_OK
    assert "stays: over budget: launching it early would put more unsharded bytes" in out
    assert "moved:" not in out


def test_explain_untagged_hint(capsys):
    code, out, _ = run(capsys, "explain", "test_cli:untagged_graph")
    assert code == EXIT_OK and "no FSDP gathers (untagged graph? try --structural)" in out


# --------------------------------------------------------------------------- errors and exit codes


@pytest.mark.parametrize("argv, message", [
    (["schedule", "nocolon"], "expected MODULE:FUNCTION"),
    (["schedule", "no_such_module_xyz:f"], "cannot import 'no_such_module_xyz': ModuleNotFoundError"),
    (["schedule", "test_cli:no_such_function"], "module 'test_cli' has no attribute 'no_such_function'"),
    (["schedule", "test_cli:EXIT_OK"], "is a int, not a function"),
    (["schedule", "test_cli:not_a_graph"], "test_cli:not_a_graph() returned int, not a torch.fx.GraphModule"),
    (["schedule", "test_cli:raises"], "test_cli:raises() raised ValueError: boom"),
    (["schedule", "test_cli:malformed_graph"], "cannot lower test_cli:malformed_graph(): FSDP gather"),
    (["explain", "test_cli:malformed_graph"], "must have exactly one user"),
    (["schedule", "test_cli:tagged_graph", "--pipeline", "anchor,nope"], "unknown pass 'nope'"),
    (["schedule", "test_cli:tagged_graph", "--pipeline", "anchor{depth=2}"], "pass 'anchor' has no option 'depth'"),
    (["schedule", "test_cli:tagged_graph", "--pipeline", "budget{max-in-flight-gb=x}"], "wants a float"),
    (["schedule", "test_cli:tagged_graph", "--hardware", "tpu9"], "unknown hardware profile"),
    (["explain", "test_cli:tagged_graph", "--hardware", "tpu9"], "unknown hardware profile"),
    (["schedule", "missing_file.py:f"], "no such file: missing_file.py"),
    (["schedule", "test_cli:tagged_graph", "--json", "/nonexistent-dir/r.json"], "No such file or directory"),
])
def test_bad_input_exits_2_with_a_message(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == EXIT_USAGE
    assert message in err and err.startswith("fxsched: ")
    assert "Traceback" not in err


def test_bad_pipeline_fails_before_loading(capsys):
    tagged_graph.cache_clear()
    code, _, err = run(capsys, "schedule", "test_cli:tagged_graph", "--pipeline", "nope")
    assert code == EXIT_USAGE and tagged_graph.cache_info().misses == 0


@pytest.mark.parametrize("argv, message", [
    ([], "fxsched: the following arguments are required: COMMAND"),
    (["frobnicate"], "fxsched: argument COMMAND: invalid choice: 'frobnicate'"),
    (["schedule"], "fxsched schedule: the following arguments are required: MODULE:FUNCTION"),
    (["schedule", "a:b", "--no-such-flag"], "fxsched: unrecognized arguments: --no-such-flag"),
    (["demo", "--model", "bert"], "fxsched demo: argument --model: invalid choice: 'bert'"),
    (["demo", "--layers", "0"], "fxsched demo: argument --layers: must be at least 1, got 0"),
    (["demo", "--world-size", "two"], "fxsched demo: argument --world-size: not an integer: 'two'"),
    (["demo", "--width", "-8"], "fxsched demo: argument --width: must be at least 1, got -8"),
])
def test_argument_errors_exit_2_with_one_line(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == EXIT_USAGE and out == ""
    assert err.startswith(message) and err.count("\n") == 1, err


def test_help_exits_0(capsys):
    code, out, _ = run(capsys, "schedule", "--help")
    assert code == EXIT_OK and "--print-ir-after-change" in out and "MODULE:FUNCTION" in out


def test_pass_failure_exits_1(capsys, monkeypatch):
    from fxsched.passes.sink import Sink

    def broken(self, ctx, program):
        raise RuntimeError("sink broke")

    monkeypatch.setattr(Sink, "apply", broken)
    code, _, err = run(capsys, "schedule", "test_cli:untagged_graph", "--structural", "--pipeline", PIPELINE)
    assert code == EXIT_FAILED
    assert "pass 'sink' failed: RuntimeError: sink broke" in err and "passes before it: anchor,budget,prefetch" in err


# --------------------------------------------------------------------------- logging and progress


def test_quiet_by_default_verbose_logs_info(capsys):
    code, _, err = run(capsys, "schedule", "test_cli:untagged_graph", "--structural")
    assert code == EXIT_OK and "fxsched.cli:" not in err
    code, _, err = run(capsys, "schedule", "test_cli:untagged_graph", "--structural", "--verbose",
                       "--pipeline", PIPELINE)
    assert code == EXIT_OK
    assert "fxsched.cli: test_cli:untagged_graph: 20 FX nodes" in err
    assert "fxsched.cli: pass prefetch: forward=2" in err
    assert "structural FSDP collectives: 3 gathers and 0 gradient reductions tagged" in err
    logger = logging.getLogger("fxsched")  # restored after the command
    assert logger.level == logging.NOTSET and all(isinstance(h, logging.NullHandler) for h in logger.handlers)


def test_progress_on_request(capsys):
    code, _, err = run(capsys, "schedule", "test_cli:untagged_graph", "--progress", "--pipeline", PIPELINE)
    assert code == EXIT_OK
    stages = [line.split("] ", 1)[1] for line in err.splitlines() if line.startswith("fxsched [")]
    assert stages[2].startswith("lowered: ") and stages[2].endswith(" IR ops")
    del stages[2]
    assert stages == ["loading test_cli:untagged_graph", "lowering 20 FX nodes",
                      "pass 1/4: anchor", "pass 2/4: budget", "pass 3/4: prefetch", "pass 4/4: sink", "raising",
                      "done"]
    code, _, err = run(capsys, "schedule", "test_cli:untagged_graph")
    assert "fxsched [" not in err  # captured stderr is no terminal


# --------------------------------------------------------------------------- demo and the console script


def test_demo_small(capsys, tmp_path):
    trace, report = tmp_path / "t.json", tmp_path / "r.json"
    code, out, _ = run(capsys, "demo", "--layers", "1", "--width", "32", "--no-check", "--trace", str(trace),
                       "--json", str(report))
    assert code == EXIT_OK
    assert "fxsched demo: gpt (1 layers, width 32)" in out and "pass timing:" in out
    assert "step ms" in out and "exposed ms" in out and "peak mem" in out
    assert "\n    before " in out and "\n    after " in out
    assert json.loads(trace.read_text())["traceEvents"]
    assert set(json.loads(report.read_text())["simulation"]) == {"hardware", "before", "reference", "after"}
    assert "\n    reference " in out  # the default pipeline is compared with the reference one


def test_console_script_smoke(tmp_path):
    script = os.path.join(os.path.dirname(sys.executable), "fxsched")
    graphs = tmp_path / "graphs.py"
    graphs.write_text(textwrap.dedent("""
        import torch
        import torch.distributed._functional_collectives
        from torch.fx.experimental.proxy_tensor import make_fx
        C = torch.ops._c10d_functional

        def build():
            def f(s1, s2, x):
                for s in (s1, s2):
                    x = torch.tanh(x @ C.wait_tensor(C.all_gather_into_tensor(s, 2, "0")).view(8, 8))
                return (x,)
            return make_fx(f, tracing_mode="fake")(torch.randn(32), torch.randn(32), torch.randn(4, 8))
    """))
    done = subprocess.run([script, "schedule", f"{graphs}:build", "--structural", "--report", "--pipeline", PIPELINE],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == EXIT_OK, done.stderr
    assert "2 gathers: 1 moved (fwd 1)" in done.stdout
