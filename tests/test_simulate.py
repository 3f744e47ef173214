"""The simulator on tiny hand-written programs with answers worked out by hand."""

from __future__ import annotations

import textwrap

import pytest

from fxsched.cost import Roofline, op_costs, simulate
from fxsched.ir import parse_program, print_program, verify
from fxsched.passes import REFERENCE_PIPELINE, PassManager

AG = '"_c10d_functional.all_gather_into_tensor.default"'


def ir(text: str):
    return parse_program(textwrap.dedent(text).lstrip("\n"))


def costs(program, **given):
    """Every op 0 ms except those named."""
    out = {name: 0.0 for name in program.schedule}
    out.update(given)
    return out


def gather_program(work_before_wait: str = "") -> str:
    return f"""
        %w = input : f32[256]
        %x = input : f32[4]
        ^entry
        %ag = launch {AG}(%w) {{group = "0", group_size = 2, role = fsdp_all_gather, nbytes = 2048, params = ["w"]}} : f32[512]
        {work_before_wait}
        %wt = wait(%ag) : f32[512]
        %mm = compute "aten.mul.Tensor"(%wt) : f32[512]
        %output = output(%mm)
    """


def test_exposed_gather():
    p = ir(gather_program())
    sim = simulate(p, costs=costs(p, ag=5.0, mm=2.0))
    # the gather runs 0..5 and the wait, reached at 0, idles the compute stream until 5
    assert sim.step_ms == pytest.approx(7.0)
    assert sim.exposed_ms == pytest.approx(5.0)
    assert sim.exposed_by_collective == {"ag": pytest.approx(5.0)}
    assert sim.compute_ms == pytest.approx(2.0) and sim.comm_ms == pytest.approx(5.0)
    # lower bound = max(compute 2, comm 5) = 5, beside the step time
    assert sim.lower_bound_ms == pytest.approx(5.0)
    assert sim.ratio == pytest.approx(7.0 / 5.0)
    # 2048 gathered bytes are in flight from the launch (0) to the end of the wait (5)
    assert sim.inflight == ((0.0, 2048), (5.0, 0))
    assert sim.max_inflight_bytes == 2048


def test_hidden_gather():
    p = ir(gather_program('%c1 = compute "aten.exp.default"(%x) : f32[4]'))
    sim = simulate(p, costs=costs(p, ag=5.0, c1=6.0, mm=2.0))
    assert sim.step_ms == pytest.approx(8.0)
    assert sim.exposed_ms == 0.0
    assert sim.lower_bound_ms == pytest.approx(8.0) and sim.ratio == pytest.approx(1.0)
    # partly hidden: 3 ms of compute hides 3 of the 5 ms
    partial = simulate(p, costs=costs(p, ag=5.0, c1=3.0, mm=2.0))
    assert partial.exposed_ms == pytest.approx(2.0) and partial.step_ms == pytest.approx(7.0)


TWO = f"""
    %w = input : f32[256]
    %u = input : f32[256]
    ^entry
    %a = launch {AG}(%w) {{group = "0", group_size = 2, role = fsdp_all_gather, nbytes = 2048, params = ["w"]}} : f32[512]
    %b = launch {AG}(%u) {{group = "GROUP", group_size = 2, role = fsdp_all_gather, nbytes = 2048, params = ["u"]}} : f32[512]
    %aw = wait(%a) : f32[512]
    %bw = wait(%b) : f32[512]
    %c = compute "aten.add.Tensor"(%aw, %bw) : f32[512]
    %output = output(%c)
"""


def test_two_groups_run_concurrently_one_group_serialises():
    p = ir(TWO)
    sim = simulate(p, costs=costs(p, a=4.0, b=4.0, c=1.0))
    # one stream per group: both run 0..4; the first wait idles 4 ms, the second none
    assert set(sim.comm_ms_by_stream) == {"comm:0", "comm:GROUP"}
    assert sim.step_ms == pytest.approx(5.0)
    assert sim.exposed_by_collective == {"a": pytest.approx(4.0), "b": 0.0}
    assert sim.lower_bound_ms == pytest.approx(4.0)   # the busiest stream, not the sum
    same = ir(TWO.replace('"GROUP"', '"0"'))
    serial = simulate(same, costs=costs(same, a=4.0, b=4.0, c=1.0))
    # one stream: b runs 4..8 after a; it is exposed 4 ms more
    assert serial.step_ms == pytest.approx(9.0)
    assert serial.exposed_by_collective == {"a": pytest.approx(4.0), "b": pytest.approx(4.0)}
    assert serial.lower_bound_ms == pytest.approx(8.0)
    assert serial.max_inflight_bytes == 4096


def freeing(free_after: str) -> str:
    lines = f"""
        %w = input : f32[256]
        ^entry
        %ag = launch {AG}(%w) {{group = "0", group_size = 2, role = fsdp_all_gather, nbytes = 2048, params = ["w"]}} : f32[512]
        %wt = wait(%ag) : f32[512]
        %v = view "aten.view.default"(%wt) : f32[16,32]
        %a = compute "aten.relu.default"(%v) : f32[512]
        %b = compute "aten.cat.default"(%a) : f32[1024]
        %output = output(%b)
    """.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith(f"%{free_after} ="))
    lines.insert(at + 1, '        %f = free "fsdp.free"(%wt) {params = ["w"]}')
    return "\n".join(lines)


def test_a_free_releases_the_gathered_storage():
    early = ir(freeing("a"))
    verify(early)
    sim = simulate(early, costs=costs(early), record=True)
    live = dict(zip(early.schedule, (m for _, m in sim.memory)))
    # w (1024) lives throughout; the gather allocates 2048 at its launch; wait and view alias it
    assert live["ag"] == live["wt"] == live["v"] == 1024 + 2048
    # relu allocates 2048; the free then releases the gathered 2048
    assert live["a"] == 1024 + 2048 + 2048
    assert live["f"] == 1024 + 2048
    # cat allocates 4096 and releases relu's output, its last reader
    assert sim.peak_bytes == 1024 + 2048 + 4096 and sim.peak_at == "b"
    # a free placed after cat keeps the gathered storage alive until then: a higher peak
    late = ir(freeing("b"))
    verify(late)
    assert simulate(late, costs=costs(late)).peak_bytes == 1024 + 2048 + 2048 + 4096


def test_views_alias_their_base_and_keep_it_alive():
    p = ir("""
        %x = input : f32[4]
        ^entry
        %a = compute "aten.exp.default"(%x) : f32[1024]
        %v = view "aten.view.default"(%a) : f32[32,32]
        %b = compute "aten.neg.default"(%x) : f32[1024]
        %c = compute "aten.add.Tensor"(%v, %b) : f32[1024]
        %output = output(%c)
    """)
    sim = simulate(p, costs=costs(p), record=True)
    # the view allocates nothing but keeps exp's 4096 alive until add reads it; add's result is returned
    assert [m for _, m in sim.memory] == [16, 16, 16 + 4096, 16 + 4096, 16 + 8192, 16 + 4096, 16 + 4096]
    assert sim.peak_bytes == 16 + 3 * 4096 and sim.peak_at == "c"


def test_unread_results_are_released_at_once_and_inputs_never():
    p = ir("""
        %x = input : f32[256]
        ^entry
        %dead = compute "aten.exp.default"(%x) : f32[1024]
        %y = compute "aten.neg.default"(%x) : f32[8]
        %output = output(%y)
    """)
    sim = simulate(p, costs=costs(p), record=True)
    assert [m for _, m in sim.memory] == [1024, 1024, 1024, 1024 + 32, 1024 + 32]
    assert sim.peak_bytes == 1024 + 4096


def test_simulate_with_a_cost_model():
    p = ir(gather_program('%c1 = compute "aten.exp.default"(%x) : f32[4]'))
    sim = simulate(p, Roofline())
    assert sim == simulate(p, costs=op_costs(p, Roofline()))
    assert sim.comm_ms == pytest.approx(Roofline().op_ms(p.op("ag"), p))


PREFETCH = f"""
    %x = input : f32[64,64]
    %w1 = input : f32[2048]
    %w2 = input : f32[2048]
    %w3 = input : f32[2048]
    ^entry
    %ag1 = launch {AG}(%w1) {{group = "0", group_size = 2, role = fsdp_all_gather, nbytes = 16384, params = ["w1"]}} : f32[4096]
    %wt1 = wait(%ag1) : f32[4096]
    %p1 = view "aten.view.default"(%wt1) : f32[64,64]
    %h1 = compute "aten.mm.default"(%x, %p1) {{heavy}} : f32[64,64]
    %f1 = free "fsdp.free"(%wt1) {{params = ["w1"]}}
    %ag2 = launch {AG}(%w2) {{group = "0", group_size = 2, role = fsdp_all_gather, nbytes = 16384, params = ["w2"]}} : f32[4096]
    %wt2 = wait(%ag2) : f32[4096]
    %p2 = view "aten.view.default"(%wt2) : f32[64,64]
    %h2 = compute "aten.mm.default"(%h1, %p2) {{heavy}} : f32[64,64]
    %f2 = free "fsdp.free"(%wt2) {{params = ["w2"]}}
    %ag3 = launch {AG}(%w3) {{group = "0", group_size = 2, role = fsdp_all_gather, nbytes = 16384, params = ["w3"]}} : f32[4096]
    %wt3 = wait(%ag3) : f32[4096]
    %p3 = view "aten.view.default"(%wt3) : f32[64,64]
    %h3 = compute "aten.mm.default"(%h2, %p3) {{heavy}} : f32[64,64]
    %f3 = free "fsdp.free"(%wt3) {{params = ["w3"]}}
    %output = output(%h3)
"""


def test_prefetching_hides_communication_and_costs_memory():
    before = ir(PREFETCH)
    after = ir(PREFETCH)
    result = PassManager(REFERENCE_PIPELINE).run(after)
    assert result.stats()["prefetch"]["forward"] > 0, print_program(after)
    model = Roofline()
    sim_before, sim_after = simulate(before, model), simulate(after, model)
    # launched earlier, a gathered buffer is live longer: the peak can only grow
    assert sim_after.peak_bytes >= sim_before.peak_bytes
    assert sim_after.peak_bytes > sim_before.peak_bytes      # here two replicas overlap
    assert sim_after.max_inflight_bytes > sim_before.max_inflight_bytes
    assert sim_after.exposed_ms < sim_before.exposed_ms
    assert sim_after.step_ms < sim_before.step_ms
    assert sim_after.lower_bound_ms == pytest.approx(sim_before.lower_bound_ms)   # same work, other order


def test_constants_cost_nothing_and_live_throughout():
    p = ir("""
        %x = input : f32[4]
        ^entry
        %c = constant "buffer" : f32[256]
        %y = compute "aten.add.Tensor"(%x, %c) : f32[4]
        %output = output(%y)
    """)
    assert Roofline().op_ms(p.op("c"), p) == 0.0
    sim = simulate(p, Roofline(), record=True)
    assert [m for _, m in sim.memory] == [16 + 1024] * 3 + [16 + 1024 + 16] * 2
