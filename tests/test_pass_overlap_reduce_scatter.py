"""overlap-reduce-scatter through the API: where each wait goes, by the cost model's clock.

Each reduce-scatter's wait moves down only as far as hides its collective, so its gradient
(live until the wait: the simulator's `keeps_alive`) leaves the budget and the memory as soon
as it can; where the gradients in flight are over the budget, the waits whose collectives end
soonest go back first. Before/after IR: tests/filecheck/passes/overlap-reduce-scatter.fxir."""

from __future__ import annotations

from textwrap import dedent

from fxsched.cost import simulate
from fxsched.ir import parse_program, print_program
from fxsched.passes import PassContext, PassManager

# ms per target: every "c" is 1 ms of compute, a reduce-scatter 3 ms
COSTS = {"c": 1.0, "rs": 3.0}
KIB5 = 5 * 1024 / 2**30   # a budget of 5 KiB: one 4000-byte gradient in flight, not two


def run(text: str, pipeline: str):
    """The program after `pipeline` (one pass), that pass's statistics, and its simulation."""
    program = parse_program(dedent(text))
    (stats,) = PassManager(pipeline).run(program, PassContext(cost_model=COSTS)).stats().values()
    return program, stats, simulate(program, COSTS)


# rd1 (launched at 1 ms) ends at 4 ms; rd2, launched after d2, at 8 ms
ONE_AFTER_THE_OTHER = '''
    %x = input
    ^entry
    %d1 = compute "c"(%x) : f32[1000]
    %rd1 = launch "rs"(%d1) {group = "0", role = fsdp_reduce_scatter} : f32[500]
    %wd1 = wait(%rd1)
    %h1 = compute "c"(%d1)
    %h2 = compute "c"(%h1)
    %h3 = compute "c"(%h2)
    %d2 = compute "c"(%h3) : f32[1000]
    %rd2 = launch "rs"(%d2) {group = "0", role = fsdp_reduce_scatter} : f32[500]
    %wd2 = wait(%rd2)
    %h4 = compute "c"(%d2)
    %h5 = compute "c"(%h4)
    %h6 = compute "c"(%h5)
    %output = output(%h6, %wd1, %wd2)
'''


def test_a_wait_held_only_until_its_collective_ends_leaves_the_budget_to_the_next():
    """Held down to its first use (the output), rd1's 4000 bytes would stay in flight under
    rd2's launch, and a 5 KiB budget would keep rd2's wait in place, exposed for its 3 ms."""
    program, stats, sim = run(ONE_AFTER_THE_OTHER, f"overlap-reduce-scatter{{max-in-flight-gb={KIB5!r}}}")
    order = program.schedule.names()
    assert order.index("h3") < order.index("wd1") < order.index("d2")   # where rd1 has ended
    assert stats["overlapped"] == 2
    assert stats["over budget"] == 0
    assert sim.exposed_ms == 0 and sim.step_ms == 8.0


def test_a_wait_held_only_until_its_collective_ends_frees_its_gradient_there():
    """rd1's gradient is live until its wait: put back at 4 ms, it is gone before the 16000-byte
    %big is made; held to the output it would be live beside it."""
    text = ONE_AFTER_THE_OTHER.replace('%h4 = compute "c"(%d2)', '%h4 = compute "c"(%d2) : f32[4000]')
    program, _, sim = run(text, "overlap-reduce-scatter")
    late = parse_program(print_program(program))   # the same, but wd1 sunk to its first use
    late.schedule.move_before(["wd1"], "output")
    assert sim.exposed_ms == 0 and simulate(late, COSTS).exposed_ms == 0
    assert sim.peak_bytes == simulate(late, COSTS).peak_bytes - 4000


# rd1 ends at 4 ms; rd2, launched at 3 ms while rd1 runs, waits on the stream until then
OVERLAPPING = '''
    %x = input
    ^entry
    %g1 = compute "c"(%x) : f32[1000]
    %r1 = launch "rs"(%g1) {group = "0", role = fsdp_reduce_scatter} : f32[500]
    %w1 = wait(%r1)
    %c1 = compute "c"(%g1)
    %g2 = compute "c"(%c1) : f32[1000]
    %r2 = launch "rs"(%g2) {group = "0", role = fsdp_reduce_scatter} : f32[500]
    %w2 = wait(%r2)
    %c3 = compute "c"(%g2)
    %c4 = compute "c"(%c3)
    %c5 = compute "c"(%c4)
    %c6 = compute "c"(%c5)
    %output = output(%c6, %w1, %w2)
'''


def test_over_the_budget_the_wait_whose_collective_ends_soonest_goes_back():
    """Both gradients in flight are over a 5 KiB budget once r2 launches. Keeping the first
    admitted (launch order) would leave w2 in place, exposed 4 ms; putting back w1, whose
    collective ends soonest, exposes it 2 ms and hides r2 under the compute after it."""
    program, stats, sim = run(OVERLAPPING, f"overlap-reduce-scatter{{max-in-flight-gb={KIB5!r}}}")
    order = program.schedule.names()
    assert order.index("w1") < order.index("g2") < order.index("r2") < order.index("c5") < order.index("w2")
    assert stats["over budget"] == 1
    assert sim.exposed_by_collective == {"r1": 2.0, "r2": 0.0} and sim.step_ms == 9.0


def test_its_own_output_is_a_fixed_point():
    for text, budget in ((ONE_AFTER_THE_OTHER, KIB5), (OVERLAPPING, KIB5), (OVERLAPPING, 1.0)):
        pipeline = f"overlap-reduce-scatter{{max-in-flight-gb={budget!r}}}"
        once, _, _ = run(text, pipeline)
        twice, stats, _ = run(print_program(once), pipeline)
        assert twice.schedule.names() == once.schedule.names()
        assert not stats["changed"]


def test_the_feeders_hide_found_serve_it(monkeypatch):
    """What travels with each reduce-scatter is read off the edges once per pipeline (the
    `Feeders` analysis): hide asks, overlap-reduce-scatter takes the kept answers; a check of
    the kept analysis (the tests' check_analyses) finds them again afresh."""
    from fxsched.ir import Program
    asked = []
    original = Program.private_feeders
    monkeypatch.setattr(Program, "private_feeders", lambda self, name, kinds: asked.append(name) or original(self, name, kinds))
    program = parse_program(dedent(ONE_AFTER_THE_OTHER))
    PassManager("hide,overlap-reduce-scatter", check_analyses=False).run(program, PassContext(cost_model=COSTS))
    assert sorted(asked) == ["rd1", "rd2"]
    asked.clear()
    PassManager("hide,overlap-reduce-scatter", check_analyses=True).run(parse_program(dedent(ONE_AFTER_THE_OTHER)),
                                                                           PassContext(cost_model=COSTS))
    assert sorted(set(asked)) == ["rd1", "rd2"] and len(asked) > 2


# two unordered reduce-scatters whose gradients are ready at the same op (%d): both hoist there
SAME_SLOT = '''
    %x = input
    ^entry
    %d = compute "c"(%x) : f32[1000]
    %h1 = compute "c"(%d)
    %ra = launch "rs"(%d) {group = "0", role = fsdp_reduce_scatter, unordered} : f32[500]
    %h2 = compute "c"(%h1)
    %rb = launch "rs"(%d) {group = "0", role = fsdp_reduce_scatter, unordered} : f32[500]
    %h3 = compute "c"(%h2)
    %wa = wait(%ra)
    %wb = wait(%rb)
    %output = output(%h3, %wa, %wb)
'''


def test_unordered_launches_hoisted_to_one_slot_keep_their_order_so_a_second_run_moves_nothing():
    """Both launches go to just after %d, in the order they had: each went to the slot right after
    its latest predecessor, so the second landed before the first and every run swapped them back
    (generated 1000 nodes, `unorder-reduce-scatters,gradients-first,default` re-run on its raised
    output: 158, 110, 78 positions differed run to run; now none)."""
    once, stats, _ = run(SAME_SLOT, "overlap-reduce-scatter")
    order = once.schedule.names()
    assert stats["hoisted"] == 2
    assert order.index("d") < order.index("ra") < order.index("rb") < order.index("h1")
    twice, stats, _ = run(print_program(once), "overlap-reduce-scatter")
    assert twice.schedule.names() == order
    assert not stats["changed"]


def test_the_full_unordered_pipeline_is_a_fixed_point_on_its_raised_output():
    """`unorder-reduce-scatters,gradients-first,default` run on what it raised leaves the order as
    it is (gradients-first sweeps until no pair swaps; overlap-reduce-scatter keeps the order of
    launches hoisted to one slot)."""
    import fxsched
    from fxsched.front.generate import generate_graph

    pipeline = "unorder-reduce-scatters,gradients-first,default"
    first = fxsched.schedule(generate_graph(1000, seed=0), pipeline).graph_module
    second = fxsched.schedule(first, pipeline).graph_module
    assert [n.name for n in second.graph.nodes] == [n.name for n in first.graph.nodes]
