"""hide (cost-guided anchoring) and overlap-reduce-scatter on hand-written IR with measured costs."""

from __future__ import annotations

from textwrap import dedent

from fxsched.ir import parse_program, print_program
from fxsched.passes import PassContext, PassManager

# ms per target: every "c" is 1 ms of compute, a gather 2 ms, a reduce-scatter 3 ms
COSTS = {"c": 1.0, "mm": 1.0, "ag": 2.0, "rs": 3.0}

TWO_GATHERS = dedent('''
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
''')


def run(text: str, pipeline: str, costs=COSTS):
    program = parse_program(text)
    result = PassManager(pipeline).run(program, PassContext(cost_model=costs))
    return program, result.stats()


def test_a_gather_launches_where_compute_just_covers_it():
    program, stats = run(TWO_GATHERS, "hide,budget,prefetch,sink")
    # a2 takes 2 ms and m2 starts at 5 ms: launch at 3 ms, just before c3
    order = program.schedule.names()
    assert order.index("a2") == order.index("c3") - 1
    assert program.op("a2").anchor == "c3" and program.op("a2").prefetched
    # a1's consumer comes first: nothing can hide it
    assert program.op("a1").hold == "cannot be hidden" and not program.op("a1").prefetched
    assert stats["hide"]["anchored"] == 1 and stats["hide"]["cannot be hidden"] == 1


def test_a_gather_already_hidden_stays():
    text = dedent('''
        %x = input
        %w2 = input
        ^entry
        %c1 = compute "c"(%x)
        %a2 = launch "ag"(%w2) {group = "0", role = fsdp_all_gather, nbytes = 1000, params = ["w2"]}
        %c2 = compute "c"(%c1)
        %c3 = compute "c"(%c2)
        %c4 = compute "c"(%c3)
        %t2 = wait(%a2)
        %m2 = compute "mm"(%c4, %t2)
        %output = output(%m2)
    ''')
    program, stats = run(text, "hide,budget,prefetch,sink")
    assert program.op("a2").hold == "hidden where it is" and program.op("a2").anchor is None
    assert stats["hide"]["hidden where it is"] == 1


def test_gathers_queue_on_their_stream():
    # two gathers for the same consumer: the second waits for the first on the stream,
    # so the pair needs 4 ms of compute in front of m2
    text = dedent('''
        %x = input
        %w2 = input
        %w3 = input
        ^entry
        %c1 = compute "c"(%x)
        %c2 = compute "c"(%c1)
        %c3 = compute "c"(%c2)
        %c4 = compute "c"(%c3)
        %c5 = compute "c"(%c4)
        %a2 = launch "ag"(%w2) {group = "0", role = fsdp_all_gather, nbytes = 1000, params = ["w2"]}
        %t2 = wait(%a2)
        %a3 = launch "ag"(%w3) {group = "0", role = fsdp_all_gather, nbytes = 1000, params = ["w3"]}
        %t3 = wait(%a3)
        %m2 = compute "mm"(%c5, %t2, %t3)
        %output = output(%m2)
    ''')
    program, _ = run(text, "hide,budget,prefetch,sink")
    order = program.schedule.names()
    # m2 starts at 5 ms: a3 (launched last) runs 3..5 ms, a2 before it 1..3 ms
    assert (program.op("a2").anchor, program.op("a3").anchor) == ("c2", "c4")
    assert order.index("a2") < order.index("c2") < order.index("a3") < order.index("c4")


def test_other_collectives_on_the_stream_are_worked_around():
    # a reduce-scatter launched at 3 ms holds the stream until 6 ms; a2 must end by 3 ms
    text = dedent('''
        %x = input
        %w2 = input
        ^entry
        %c1 = compute "c"(%x)
        %c2 = compute "c"(%c1)
        %c3 = compute "c"(%c2)
        %rs = launch "rs"(%c3) {group = "0", role = fsdp_reduce_scatter}
        %rw = wait(%rs)
        %c4 = compute "c"(%c3)
        %c5 = compute "c"(%c4)
        %c6 = compute "c"(%c5)
        %a2 = launch "ag"(%w2) {group = "0", role = fsdp_all_gather, nbytes = 1000, params = ["w2"]}
        %t2 = wait(%a2)
        %m2 = compute "mm"(%c6, %t2)
        %output = output(%m2, %rw)
    ''')
    program, _ = run(text, "hide,budget,prefetch,sink")
    # without the reduce-scatter it would launch at 4 ms (before c5); with it, by 1 ms (before c2)
    assert program.op("a2").anchor == "c2"


def test_collectives_of_another_group_run_on_their_own_stream():
    # the same reduce-scatter on its own process group (graph_trainer's reassign_collective_pgs_pass)
    # runs on its own stream: the gather need not work around it and launches at 4 ms, before c5
    text = dedent('''
        %x = input
        %w2 = input
        ^entry
        %c1 = compute "c"(%x)
        %c2 = compute "c"(%c1)
        %c3 = compute "c"(%c2)
        %rs = launch "rs"(%c3) {group = "rs", role = fsdp_reduce_scatter}
        %rw = wait(%rs)
        %c4 = compute "c"(%c3)
        %c5 = compute "c"(%c4)
        %c6 = compute "c"(%c5)
        %a2 = launch "ag"(%w2) {group = "0", role = fsdp_all_gather, nbytes = 1000, params = ["w2"]}
        %t2 = wait(%a2)
        %m2 = compute "mm"(%c6, %t2)
        %output = output(%m2, %rw)
    ''')
    program, _ = run(text, "hide,budget,prefetch,sink")
    assert program.op("a2").anchor == "c5"


def test_budget_still_applies_after_hide():
    program, stats = run(TWO_GATHERS.replace("nbytes = 1000", "nbytes = 2000000000"), "hide,budget{max-in-flight-gb=1.0},prefetch,sink")
    assert program.op("a2").hold == "over budget" and not program.op("a2").prefetched


RS = dedent('''
    %x = input
    ^entry
    %g1 = compute "c"(%x)
    %rs1 = launch "rs"(%g1) {group = "0", role = fsdp_reduce_scatter} : f32[2]
    %rw1 = wait(%rs1)
    %g2 = compute "c"(%g1)
    %rs2 = launch "rs"(%g2) {group = "0", role = fsdp_reduce_scatter}
    %rw2 = wait(%rs2)
    %g3 = compute "c"(%g2)
    %output = output(%g3, %rw1, %rw2)
''').replace('%g1 = compute "c"(%x)', '%g1 = compute "c"(%x) : f32[1000]')


def test_reduce_scatter_waits_move_to_their_first_use():
    program, stats = run(RS, "overlap-reduce-scatter")
    assert program.schedule.names()[-3:] == ["rw1", "rw2", "output"]
    assert stats["overlap-reduce-scatter"]["overlapped"] == 2


def test_reduce_scatter_over_budget_keeps_its_wait():
    program, stats = run(RS, "overlap-reduce-scatter{max-in-flight-gb=0.000001}")  # ~1 KiB: 4000 B does not fit
    order = program.schedule.names()
    assert order.index("rw1") == order.index("rs1") + 1
    (orsc,) = stats.values()
    assert orsc["over budget"] == 1


def test_untagged_program_is_unchanged():
    text = dedent('''
        %x = input
        ^entry
        %a = compute "c"(%x)
        %b = compute "c"(%a)
        %output = output(%b)
    ''')
    program, stats = run(text, "hide,budget,prefetch,sink,overlap-reduce-scatter")
    assert print_program(program) == text.lstrip("\n")
    assert not any(s["changed"] for s in stats.values())


def test_reduce_scatter_views_sink_first_so_the_wait_can_follow():
    # a bucket's gradient: one reduce-scatter whose result is sliced per parameter for the output
    text = dedent('''
        %x = input
        ^entry
        %g = compute "c"(%x) : f32[8]
        %rs = launch "rs"(%g) {group = "0", role = fsdp_reduce_scatter}
        %rw = wait(%rs)
        %s1 = view "aten.slice.Tensor"(%rw)
        %s2 = view "aten.slice.Tensor"(%rw)
        %c1 = compute "c"(%g)
        %c2 = compute "c"(%c1)
        %output = output(%c2, %s1, %s2)
    ''')
    program, stats = run(text, "overlap-reduce-scatter")
    assert program.schedule.names()[-4:] == ["rw", "s1", "s2", "output"]
    assert stats["overlap-reduce-scatter"]["overlapped"] == 1


def test_anchor_after_hide_takes_over_hides_holds_but_keeps_lowerings():
    text = TWO_GATHERS.replace('params = ["w2"]}', 'params = ["w2"], hold = "no parameter name"}')
    program, _ = run(text, "hide")
    assert program.op("a1").hold == "cannot be hidden"
    PassManager("anchor").run(program)
    # a1 is in the first consumer group: anchor's own reason replaces hide's
    assert program.op("a1").hold == "first group"
    # a hold lowering set (malformed tags) survives both passes
    assert program.op("a2").hold == "no parameter name" and program.op("a2").anchor is None


def test_reduce_scatters_launch_as_soon_as_their_gradient_is_ready():
    # the graph launches both reduce-scatters after the layer's last compute; each rises to just
    # after its own gradient (with the view that feeds only it), and they keep their order
    text = dedent('''
        %x = input
        ^entry
        %g1 = compute "c"(%x) : f32[1000]
        %c1 = compute "c"(%g1)
        %g2 = compute "c"(%c1) : f32[1000]
        %c2 = compute "c"(%g2)
        %v1 = view "aten.view.default"(%g1)
        %rs1 = launch "rs"(%v1) {group = "0", role = fsdp_reduce_scatter}
        %rs2 = launch "rs"(%g2) {group = "0", role = fsdp_reduce_scatter}
        %rw1 = wait(%rs1)
        %rw2 = wait(%rs2)
        %c3 = compute "c"(%c2)
        %output = output(%c3, %rw1, %rw2)
    ''')
    program, stats = run(text, "overlap-reduce-scatter")
    order = program.schedule.names()
    assert order[:8] == ["x", "^entry", "g1", "v1", "rs1", "c1", "g2", "rs2"]
    assert order[-3:] == ["rw1", "rw2", "output"]
    assert stats["overlap-reduce-scatter"]["hoisted"] == 2
    kept, _ = run(text, "overlap-reduce-scatter{hoist=false}")
    assert kept.schedule.names().index("rs1") == 7
