"""The simulator on tiny hand-written programs with answers worked out by hand."""

from __future__ import annotations

import textwrap

import pytest

from fxsched.cost import Roofline, op_costs, simulate
from fxsched.cost.simulate import memory_profile
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


def test_a_given_memory_profile_is_used_only_for_its_own_schedule():
    """`simulate(..., profile=)` reads the memory figures off the caller's `memory_profile` of the
    same schedule (as taking it again gives them); one of another order is taken again."""
    before, after = ir(PREFETCH), ir(PREFETCH)
    PassManager(REFERENCE_PIPELINE).run(after)
    model = Roofline()
    for program in (before, after):
        assert simulate(program, model, profile=memory_profile(program)) == simulate(program, model)
    stale = memory_profile(before)
    assert stale.peak_bytes != simulate(after, model).peak_bytes
    assert simulate(after, model, profile=stale) == simulate(after, model)


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


RS = '"_c10d_functional.reduce_scatter_tensor.default"'


def test_a_collectives_input_lives_until_its_wait():
    """An async collective reads its input until it completes (c10d's Work holds it until the
    wait): a gradient whose only reader is the reduce-scatter's launch stays live through the
    compute between launch and wait, beside the collective's output."""
    p = ir(f"""
        %x = input : f32[4]
        ^entry
        %grad = compute "aten.exp.default"(%x) : f32[1024]
        %rs = launch {RS}(%grad) {{group = "0", group_size = 2, role = fsdp_reduce_scatter}} : f32[512]
        %c = compute "aten.neg.default"(%x) : f32[1024]
        %w = wait(%rs) : f32[512]
        %d = compute "aten.neg.default"(%x) : f32[1024]
        %output = output(%w, %c, %d)
    """)
    verify(p)
    sim = simulate(p, costs=costs(p), record=True)
    live = dict(zip(p.schedule, (m for _, m in sim.memory)))
    assert live["c"] == 16 + 4096 + 2048 + 4096          # input + output + the compute's result
    assert sim.peak_bytes == 16 + 4096 + 2048 + 4096 and sim.peak_at == "c"
    assert live["d"] == 16 + 2048 + 4096 + 4096           # released after the wait
    # the wait right after the launch: the input is gone before the compute
    early = memory_profile(p, ["x", "^entry", "grad", "rs", "w", "c", "d", "output"])
    assert dict(zip(early.order, early.live))["c"] == 16 + 2048 + 4096
    # a wait placed before its launch (no legal schedule does) extends nothing
    odd = memory_profile(p, ["x", "^entry", "grad", "w", "rs", "c", "d", "output"])
    assert dict(zip(odd.order, odd.live))["c"] == 16 + 2048 + 4096


def test_a_coalesced_collectives_inputs_live_until_its_last_wait():
    """Every wait of a coalesced launch keeps all its inputs (one Work holds them): until the last."""
    p = ir(f"""
        %x = input : f32[4]
        ^entry
        %a = compute "aten.exp.default"(%x) : f32[1024]
        %b = compute "aten.exp.default"(%x) : f32[256]
        %rs = launch "_c10d_functional.reduce_scatter_tensor_coalesced.default"(%a, %b) {{group = "0", group_size = 2, reduce_op = "sum"}} : (f32[512], f32[128])
        %g0 = view "_operator.getitem"(%rs) : f32[512]
        %w0 = wait(%g0) {{launch = %rs}} : f32[512]
        %c = compute "aten.neg.default"(%x) : f32[1024]
        %g1 = view "_operator.getitem"(%rs) : f32[128]
        %w1 = wait(%g1) {{launch = %rs}} : f32[128]
        %d = compute "aten.neg.default"(%x) : f32[1024]
        %output = output(%w0, %w1, %c, %d)
    """)
    verify(p)
    profile = memory_profile(p)
    live = dict(zip(profile.order, profile.live))
    assert live["c"] == 16 + 4096 + 1024 + 2560 + 4096     # both inputs, the results, the compute's
    assert live["d"] == 16 + 2560 + 4096 + 4096            # both inputs released after the last wait


def test_an_in_place_collectives_input_lives_until_its_wait():
    p = ir("""
        %x = input : f32[4]
        ^entry
        %y = compute "aten.exp.default"(%x) : f32[1024]
        %ar = launch "_c10d_functional.all_reduce_.default"(%y) {group = "0", reduce_op = "sum", writes = [%y], alias = %y}
        %c = compute "aten.neg.default"(%x) : f32[1024]
        %w = wait "_c10d_functional.wait_tensor.default"(%ar) {writes = [%ar], alias = %ar}
        %d = compute "aten.neg.default"(%x) : f32[1024]
        %output = output(%c, %d)
    """)
    verify(p)
    profile = memory_profile(p)
    live = dict(zip(profile.order, profile.live))
    assert live["c"] == 16 + 4096 + 4096 and live["d"] == 16 + 4096 + 4096


def test_a_collectives_unread_result_lives_until_its_wait():
    """The collective writes its result until it completes, read or not."""
    p = ir(gather_program('%c = compute "aten.neg.default"(%x) : f32[1024]').replace(
        "%mm = compute \"aten.mul.Tensor\"(%wt) : f32[512]", "%mm = compute \"aten.neg.default\"(%x) : f32[512]")
        .replace("output(%mm)", "output(%mm, %c)"))
    verify(p)
    profile = memory_profile(p)
    live = dict(zip(profile.order, profile.live))
    assert live["c"] == 1024 + 16 + 2048 + 4096 and live["mm"] == 1024 + 16 + 4096 + 2048


# ---- results that alias an operand (`alias`): no new bytes ----------------------------------------

def test_an_in_place_ops_result_shares_its_operands_storage():
    """`add_` writes its operand and returns it: no new bytes; the storage lives while any alias
    of it is read (before `alias` was counted, the add_ allocated 4096 more: peak 16 + 8192)."""
    p = ir("""
        %x = input : f32[4]
        ^entry
        %t = compute "aten.exp.default"(%x) : f32[1024]
        %t2 = compute "aten.add_.Tensor"(%t) {writes = [%t], alias = %t} : f32[1024]
        %r = compute "aten.sum.default"(%t2) : f32[1]
        %d = compute "aten.neg.default"(%x) : f32[4]
        %output = output(%r, %d)
    """)
    verify(p)
    profile = memory_profile(p)
    assert profile.live == (16, 16, 16 + 4096, 16 + 4096, 16 + 4096 + 4, 16 + 4 + 16, 16 + 4 + 16)
    assert profile.peak_bytes == 16 + 4096 + 4 and profile.peak_at == "r"
    assert profile.root["t2"] == "t" and "t2" not in profile.alloc


def test_an_in_place_collective_allocates_nothing_and_holds_its_buffer_to_its_last_reader():
    """all_reduce_ on a gradient: launch and wait alias it; it lives until the wait's reader
    (counted as fresh before: 4096 at the launch, the peak 16 + 3 * 4096)."""
    p = ir("""
        %x = input : f32[4]
        ^entry
        %y = compute "aten.exp.default"(%x) : f32[1024]
        %ar = launch "_c10d_functional.all_reduce_.default"(%y) {group = "0", reduce_op = "sum", writes = [%y], alias = %y} : f32[1024]
        %c = compute "aten.neg.default"(%x) : f32[1024]
        %w = wait "_c10d_functional.wait_tensor.default"(%ar) {writes = [%ar], alias = %ar} : f32[1024]
        %d = compute "aten.sum.default"(%w) : f32[1]
        %e = compute "aten.neg.default"(%x) : f32[1024]
        %output = output(%c, %d, %e)
    """)
    verify(p)
    profile = memory_profile(p)
    live = dict(zip(profile.order, profile.live))
    assert live["ar"] == 16 + 4096 and live["c"] == live["w"] == 16 + 4096 + 4096
    assert live["d"] == 16 + 4096 + 4096 + 4             # the buffer, read by %d through the wait
    assert live["e"] == 16 + 4096 + 4 + 4096             # released after %d
    assert profile.peak_bytes == 16 + 2 * 4096 + 4 and profile.peak_at == "d"


def test_an_out_gather_writes_its_buffer_and_still_counts_in_flight():
    """An `_out` gather fills a buffer allocated before it: no bytes of its own, but its
    gathered bytes are in flight from launch to wait as any gather's."""
    p = ir(f"""
        %w = input : f32[256]
        ^entry
        %buf = compute "aten.empty.memory_format"() : f32[512]
        %ag = launch "_c10d_functional.all_gather_into_tensor_out.default"(%w, %buf) {{group = "0", group_size = 2, role = fsdp_all_gather, nbytes = 2048, params = ["w"], writes = [%buf], alias = %buf}} : f32[512]
        %wt = wait(%ag) {{writes = [%ag], alias = %ag}} : f32[512]
        %mm = compute "aten.mul.Tensor"(%wt) : f32[512]
        %output = output(%mm, %buf)
    """)
    verify(p)
    sim = simulate(p, costs=costs(p, ag=5.0, mm=2.0))
    assert sim.peak_bytes == 1024 + 2048 + 2048            # the shard, the buffer (returned), the product
    assert sim.max_inflight_bytes == 2048 and sim.inflight == ((0.0, 2048), (5.0, 0))


def test_the_step_clock_waits_on_a_coalesced_collective_as_simulate_does():
    """`Clock`, stepped op by op (the passes that time a stretch: bucket's trials,
    overlap-reduce-scatter), takes a coalesced launch's waits as waits on it, as `simulate` does;
    they read a result view, not the launch."""
    from fxsched.cost.simulate import Clock, steps_of
    p = ir("""
        %x = input : f32[4]
        ^entry
        %a = compute "aten.exp.default"(%x) : f32[1024]
        %b = compute "aten.exp.default"(%x) : f32[256]
        %rs = launch "_c10d_functional.reduce_scatter_tensor_coalesced.default"(%a, %b) {group = "0", group_size = 2, reduce_op = "sum"} : (f32[512], f32[128])
        %g0 = view "_operator.getitem"(%rs) : f32[512]
        %w0 = wait(%g0) {launch = %rs} : f32[512]
        %g1 = view "_operator.getitem"(%rs) : f32[128]
        %w1 = wait(%g1) {launch = %rs} : f32[128]
        %output = output(%w0, %w1)
    """)
    costs = {"a": 1.0, "b": 1.0, "rs": 5.0}
    clock = Clock()
    for name, step in steps_of(p, costs).items():
        clock.step(name, step)
    whole = simulate(p, costs=costs)
    assert (clock.t, clock.exposed) == (whole.step_ms, whole.exposed_ms) == (7.0, 5.0)
