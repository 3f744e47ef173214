"""The gap report (`ScheduleResult.gap`, `report["gap"]`, `--report`, `fxsched explain`).

The simulated step against a lower bound read off the schedule (`cost.limits.lower_bound`:
max(compute + the exposure at the legal limit, the busiest stream, the critical path)), the peak
against the cap in force, and what each rewrite bought. The bound never exceeds the step
(a property over generated graphs and pipelines); the numbers are the simulator's.
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, note

import fxsched
from fxsched.cost import op_costs, simulate
from fxsched.cost.limits import AT_LIMIT, exposure_causes, lower_bound
from fxsched.front import fsdp_joint_graph
from fxsched.lowering import lower
from fxsched.models import build_model

from test_cli import tagged_graph
from test_properties import _graph, examples, graph_options, pipelines

EPS = 1e-9


def _front(name, layers=2):
    module, inputs, model_loss = build_model(name, layers=layers, width=32, seed=1)
    return fsdp_joint_graph(module, inputs, lambda m, *xs: model_loss(m(*xs), *xs), 2)


def _check(gap, program):
    sim = simulate(program)
    assert gap["step_ms"] == pytest.approx(sim.step_ms)
    assert gap["peak_bytes"] == sim.peak_bytes
    assert gap["compute_ms"] == pytest.approx(sim.compute_ms)
    assert gap["busiest_stream_ms"] == pytest.approx(max(sim.comm_ms_by_stream.values(), default=0.0))
    assert 0 <= gap["forced_ms"] <= sim.exposed_ms + EPS
    assert gap["plain_ms"] <= gap["bound_ms"] + EPS            # the forced exposure only adds
    assert gap["critical_ms"] <= gap["bound_ms"] + EPS
    assert gap["bound_ms"] <= gap["step_ms"] * (1 + EPS) + EPS  # a lower bound
    assert gap["gap"] >= 1 - EPS
    json.dumps(gap)


@examples(10, graphs=True)
@given(graph=graph_options(), pipeline=pipelines())
def test_the_bound_never_exceeds_the_step(graph, pipeline):
    (num_nodes, options), (text, _) = graph, pipeline
    note(f"{num_nodes} {options} {text}")
    done = fxsched.schedule(_graph(num_nodes, **options), text)
    _check(done.report["gap"], done.program)


@pytest.mark.parametrize("name", ["gpt", "llama", "encoder"])
def test_model_numbers_are_the_simulators(name):
    front = _front(name)
    for pipeline in ("reference", "default", "default,unshard{max-peak-increase-gb=1.0}"):
        done = fxsched.schedule(front.gm, pipeline)
        gap = done.gap
        _check(gap, done.program)
        costs = op_costs(done.program, None)
        assert gap["forced_ms"] == pytest.approx(exposure_causes(done.program, simulate(done.program), costs)[AT_LIMIT])
        assert gap["cap_bytes"] is None and gap["cap_set_at_bytes"] is None


def test_unshard_rows_say_what_each_parameter_bought():
    done = fxsched.schedule(_front("gpt").gm, "default,unshard{max-peak-increase-gb=1.0}")
    stats = next(v for k, v in done.report["passes"].items() if k.startswith("unshard"))
    rows = done.gap["bought"]
    assert rows and {r["what"] for r in rows} == set(stats["bought"])
    for row in rows:
        b = stats["bought"][row["what"]]
        assert row["pass"].startswith("unshard")
        assert row["step_saved_ms"] == b["step_saved_ms"] and row["bytes_added"] == b["held_bytes"] > 0
    # the steps saved, taken in turn, add up to the step the pass saved
    assert sum(r["step_saved_ms"] for r in rows) == pytest.approx(stats["step_before_ms"] - stats["step_after_ms"],
                                                                 abs=1e-5)


def test_peak_against_the_cap():
    front = _front("gpt")
    input_peak = simulate(lower(front.gm)).peak_bytes
    done = fxsched.schedule(front.gm, "default", max_peak_increase_gb=0.0)
    gap = done.gap
    assert gap["cap_bytes"] == gap["cap_set_at_bytes"] == input_peak
    assert gap["peak_bytes"] <= gap["cap_bytes"]
    loose = fxsched.schedule(front.gm, "default", max_peak_gb=1.0).gap
    assert loose["cap_bytes"] == 1 << 30 and loose["peak_bytes"] > gap["peak_bytes"]
    assert loose["step_ms"] < gap["step_ms"]   # the memory bought time


def test_lower_bound_of_a_program_with_no_communication():
    from fxsched.ir import parse_program
    program = parse_program("%x = input\n^entry\n%m = compute \"aten.mm\"(%x, %x) {heavy}\n%output = output(%m)\n")
    costs = {"m": 2.0}
    bound = lower_bound(program, simulate(program, costs=costs), costs)
    assert bound["bound_ms"] == bound["step_ms"] == 2.0 and bound["gap"] == 1.0
    assert bound["busiest_stream"] is None and bound["forced_ms"] == 0.0


# ---- the text ----------------------------------------------------------------------------

BOUND_LINE = (r"step (\d+\.\d{4}) ms, lower bound (\d+\.\d{4}) ms, step/bound (\d+\.\d{3}); bound = max\(compute "
              r"\d+\.\d{4} \+ exposed at the legal limit \d+\.\d{4}, busiest stream comm:\S+ \d+\.\d{4}, "
              r"critical path \d+\.\d{4}\) ms; "
              r"exposed \d+\.\d{4} ms")


def test_explain_shows_bound_cap_and_what_was_bought(capsys):
    from fxsched.cli import main

    assert main(["explain", "test_cli:tagged_graph", "--pipeline", "default,unshard",
                 "--max-peak-increase-gb", "0.0001"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("fxsched explain test_cli:tagged_graph (memory-cap{max-peak-increase-gb=0.0001},hide,")
    step, bound, ratio = map(float, re.fullmatch(BOUND_LINE, lines[2]).groups())
    assert bound <= step and ratio == pytest.approx(step / bound, abs=1e-3)
    assert re.fullmatch(r"peak memory \d+\.\d\d KiB, cap \d+\.\d\d KiB \(\d+(\.\d\d KiB| B) under it; "
                        r"the peak was \d+\.\d\d KiB when it was set\)", lines[3])
    bought = [line for line in lines if line.startswith("bought by unshard: ")]
    assert bought and all(re.fullmatch(r"bought by unshard: \S+: step [-+]\d+\.\d{4} ms, memory \+\d+(\.\d\d KiB| B)", b)
                          for b in bought)
    done = fxsched.schedule(tagged_graph(), "default,unshard", max_peak_increase_gb=0.0001)
    assert len(bought) == len(done.gap["bought"])


def test_schedule_report_prints_the_gap_and_json_has_it(capsys, tmp_path):
    from fxsched.cli import main

    out = tmp_path / "r.json"
    assert main(["schedule", "test_cli:tagged_graph", "--pipeline", "default", "--report", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^  " + BOUND_LINE + "$", text, re.M)
    assert re.search(r"^  peak memory \d+\.\d\d KiB, no cap$", text, re.M)
    gap = json.loads(out.read_text())["gap"]
    assert gap["bound_ms"] <= gap["step_ms"] and gap["cap_bytes"] is None
