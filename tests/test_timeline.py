"""Timelines: the Chrome-trace JSON of a simulated schedule, and the before/after table."""

from __future__ import annotations

import json
import textwrap

import pytest

from fxsched.cost import before_after, chrome_trace, compare_table, format_bytes, simulate, write_chrome_trace
from fxsched.ir import parse_program

PROGRAM = textwrap.dedent("""
    %w = input : f32[256]
    %u = input : f32[256]
    %x = input : f32[4]
    ^entry
    %a = launch "_c10d_functional.all_gather_into_tensor.default"(%w) {group = "0", group_size = 2, role = fsdp_all_gather, nbytes = 2048, params = ["w"]} : f32[512]
    %b = launch "_c10d_functional.all_gather_into_tensor.default"(%u) {group = "tp", group_size = 2} : f32[512]
    %c = compute "aten.exp.default"(%x) : f32[4]
    %aw = wait(%a) : f32[512]
    %bw = wait(%b) : f32[512]
    %d = compute "aten.add.Tensor"(%aw, %bw) : f32[512]
    %output = output(%d, %c)
""").lstrip("\n")


def recorded(**costs):
    p = parse_program(PROGRAM)
    given = {n: 0.0 for n in p.schedule}
    given.update(costs)
    return simulate(p, costs=given, record=True)


def test_chrome_trace_structure():
    sim = recorded(a=4.0, b=1.0, c=1.0, d=2.0)
    trace = json.loads(json.dumps(chrome_trace(sim, label="toy")))   # plain JSON
    events = trace["traceEvents"]
    meta = [e for e in events if e["ph"] == "M"]
    threads = {e["tid"]: e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    # one track per stream: compute first, then one per communication group
    assert threads == {0: "compute", 1: "comm:0", 2: "comm:tp"}
    assert any(e["name"] == "process_name" and e["args"]["name"] == "toy" for e in meta)
    spans = [e for e in events if e["ph"] == "X"]
    for e in spans:
        assert {"name", "ph", "pid", "tid", "ts", "dur"} <= set(e) and e["pid"] == 1
    by_name = {e["name"]: e for e in spans}
    # ts and dur in microseconds
    assert by_name["a"]["tid"] == 1 and by_name["a"]["ts"] == 0 and by_name["a"]["dur"] == pytest.approx(4000)
    assert by_name["b"]["tid"] == 2 and by_name["b"]["dur"] == pytest.approx(1000)
    assert by_name["c"]["tid"] == 0 and by_name["c"]["ts"] == 0 and by_name["c"]["dur"] == pytest.approx(1000)
    # the compute stream idles on %a's wait from 1 ms to 4 ms
    idle = by_name["wait aw"]
    assert idle["cat"] == "exposed" and idle["tid"] == 0
    assert idle["ts"] == pytest.approx(1000) and idle["dur"] == pytest.approx(3000)
    assert "wait bw" not in by_name                 # %b ended at 1 ms: nothing exposed
    assert by_name["d"]["ts"] == pytest.approx(4000)
    # counters: live memory and gathered bytes in flight
    counters = {e["name"] for e in events if e["ph"] == "C"}
    assert counters == {"live memory (MiB)", "gathered bytes in flight (MiB)"}
    assert trace["otherData"]["step_ms"] == pytest.approx(6.0)


def test_trace_needs_a_recorded_simulation(tmp_path):
    p = parse_program(PROGRAM)
    sim = simulate(p, costs={n: 1.0 for n in p.schedule})
    with pytest.raises(ValueError, match="record=True"):
        chrome_trace(sim)
    path = tmp_path / "toy.trace.json"
    write_chrome_trace(recorded(a=1.0), str(path))
    assert json.loads(path.read_text())["traceEvents"]


def test_before_after_table():
    before = recorded(a=4.0, b=1.0, c=1.0, d=2.0)
    after = recorded(a=1.0, b=1.0, c=1.0, d=2.0)
    table = before_after(before, after)
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["schedule", "step", "ms"]
    assert lines[2].startswith("before") and lines[3].startswith("after")
    assert "6.0000" in lines[2] and "3.0000" in lines[2]       # step, exposed
    assert "3.0000" in lines[3] and "0.500x" in lines[3]        # after: step 3 ms, half the baseline's
    assert "1.500" in lines[2]                                   # ratio to the lower bound 4 ms
    three = compare_table({"x": before, "y": after, "z": before}, baseline="y")
    assert len(three.splitlines()) == 5 and "2.000x" in three.splitlines()[2]


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(2048) == "2.00 KiB"
    assert format_bytes(3 * 2**30) == "3.00 GiB"
