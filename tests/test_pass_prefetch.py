"""prefetch: each anchored, unheld launch chain goes to its earliest legal slot before its anchor.

Before/after cases are IR test files: tests/filecheck/passes/prefetch.fxir and prefetch-depths.fxir."""

from __future__ import annotations


import pytest

from irtest import dedent, joint, run
from fxsched.ir import parse_program, print_program, verify
from fxsched.passes import PassContext, PassManager, parse_pipeline


def order(program) -> list[str]:
    return [n for n in program.schedule if not n.startswith("w") and n != "x"]


# ---- depths -----------------------------------------------------------------------------------

@pytest.mark.parametrize("depth,expected", [
    (0, "^backward b4 u4 n4 b3 u3 n3 b2 u2 n2 b1 u1 n1 output"),
    (1, "^backward b4 b3 u4 n4 b2 u3 n3 b1 u2 n2 u1 n1 output"),
    (2, "^backward b4 b3 b2 u4 n4 b1 u3 n3 u2 n2 u1 n1 output"),
])
def test_backward_depths(depth, expected):
    program, result = run(joint(1, 4), f"anchor{{forward-depth=1,backward-depth={depth}}},prefetch,sink")
    names = order(program)
    assert " ".join(names[names.index("^backward"):]) == expected
    assert result.stats()["prefetch"]["backward"] == (3 if depth else 0)


# ---- legality --------------------------------------------------------------------------------------

def test_a_bucket_pack_chain_moves_with_its_launch():
    program, result = run('''
        %x = input
        %s1 = input
        %s2 = input
        %w0 = input
        ^entry
        %a0 = launch "ag"(%w0) {role = fsdp_all_gather, nbytes = 1, params = ["w0"]}
        %t0 = wait(%a0)
        %m0 = compute "aten.mm"(%x, %t0) {heavy}
        %n0 = compute "aten.neg"(%m0)
        %c1 = cast "prims.convert_element_type"(%s1)
        %c2 = cast "prims.convert_element_type"(%s2)
        %cat = compute "aten.cat"(%c1, %c2)
        %ab = launch "ag"(%cat) {role = fsdp_all_gather, nbytes = 2, params = ["p1", "p2"], bucket = "b0"}
        %tb = wait(%ab)
        %rows = view "aten.view"(%tb)
        %v1 = view "aten.slice"(%rows)
        %co1 = copy_out "aten.clone"(%v1) {bucket = "b0"}
        %v2 = view "aten.slice"(%rows)
        %co2 = copy_out "aten.clone"(%v2) {bucket = "b0"}
        %m1 = compute "aten.mm"(%n0, %co1) {heavy}
        %m2 = compute "aten.mm"(%m1, %co2) {heavy}
        %output = output(%m2)
    ''', "anchor,budget,prefetch")
    assert print_program(program) == dedent('''
        %x = input
        %s1 = input
        %s2 = input
        %w0 = input
        ^entry
        %a0 = launch "ag"(%w0) {role = fsdp_all_gather, nbytes = 1, params = ["w0"], hold = "first group"}
        %t0 = wait(%a0)
        %c1 = cast "prims.convert_element_type"(%s1)
        %c2 = cast "prims.convert_element_type"(%s2)
        %cat = compute "aten.cat"(%c1, %c2)
        %ab = launch "ag"(%cat) {role = fsdp_all_gather, nbytes = 2, params = ["p1", "p2"], bucket = "b0", anchor = %m0, prefetched}
        %m0 = compute "aten.mm"(%x, %t0) {heavy}
        %n0 = compute "aten.neg"(%m0)
        %tb = wait(%ab)
        %rows = view "aten.view"(%tb)
        %v1 = view "aten.slice"(%rows)
        %co1 = copy_out "aten.clone"(%v1) {bucket = "b0"}
        %v2 = view "aten.slice"(%rows)
        %co2 = copy_out "aten.clone"(%v2) {bucket = "b0"}
        %m1 = compute "aten.mm"(%n0, %co1) {heavy}
        %m2 = compute "aten.mm"(%m1, %co2) {heavy}
        %output = output(%m2)
    ''')
    assert result.stats()["prefetch"]["moved_nodes"] == 4


def test_a_pack_producer_read_elsewhere_stays_and_bounds_the_chain():
    program, _ = run('''
        %x = input
        %s1 = input
        %s2 = input
        %w0 = input
        ^entry
        %a0 = launch "ag"(%w0) {role = fsdp_all_gather, nbytes = 1, params = ["w0"]}
        %t0 = wait(%a0)
        %m0 = compute "aten.mm"(%x, %t0) {heavy}
        %c1 = cast "prims.convert_element_type"(%s1)
        %n0 = compute "aten.neg"(%m0)
        %c2 = cast "prims.convert_element_type"(%s2)
        %cat = compute "aten.cat"(%c1, %c2)
        %ab = launch "ag"(%cat) {role = fsdp_all_gather, nbytes = 2, params = ["p1", "p2"], bucket = "b0"}
        %tb = wait(%ab)
        %co = copy_out "aten.clone"(%tb) {bucket = "b0"}
        %m1 = compute "aten.mm"(%n0, %co) {heavy}
        %z = compute "aten.add"(%m1, %c1)
        %output = output(%z)
    ''', "anchor,prefetch")
    # c1 is also read by z: it stays, and the chain (c2, cat, ab) lands right after it
    assert " ".join(order(program)[:9]) == "s1 s2 ^entry a0 t0 m0 c1 c2 cat"
    assert program.op("ab").prefetched


def test_a_lone_cast_of_the_shard_moves_with_its_launch_a_shared_one_does_not():
    text = '''
        %x = input
        %w1 = input
        %w2 = input
        ^entry
        %a1 = launch "ag"(%w1) {role = fsdp_all_gather, nbytes = 1, params = ["w1"]}
        %t1 = wait(%a1)
        %m1 = compute "aten.mm"(%x, %t1) {heavy}
        %c2 = cast "prims.convert_element_type"(%w2)
        %a2 = launch "ag"(%c2) {role = fsdp_all_gather, nbytes = 1, params = ["w2"]}
        %t2 = wait(%a2)
        %m2 = compute "aten.mm"(%m1, %t2) {heavy}
        %output = output(%m2)
    '''
    program, result = run(text, "anchor,prefetch")
    assert " ".join(order(program)) == "^entry a1 t1 c2 a2 m1 t2 m2 output"
    assert result.stats()["prefetch"]["moved_nodes"] == 2
    shared = text.replace("(%m1, %t2)", "(%m1, %t2, %c2)")
    program, _ = run(shared, "anchor,prefetch")
    assert program.op("a2").hold == "no earlier legal slot"
    # a cast of a computed value is not a shard cast either
    computed = text.replace('cast "prims.convert_element_type"(%w2)', 'cast "prims.convert_element_type"(%m1)')
    program, _ = run(computed.replace("(%m1, %t2)", "(%x, %t2)"), "anchor,prefetch")
    assert program.op("a2").hold == "no earlier legal slot"


def test_a_launch_never_rises_above_its_inputs():
    program, _ = run('''
        %x = input
        %w1 = input
        %w2 = input
        ^entry
        %a1 = launch "ag"(%w1) {role = fsdp_all_gather, nbytes = 1, params = ["w1"]}
        %t1 = wait(%a1)
        %m1 = compute "aten.mm"(%x, %t1) {heavy}
        %k = compute "aten.neg"(%x)
        %k2 = compute "aten.neg"(%k)
        %a2 = launch "ag"(%k) {role = fsdp_all_gather, nbytes = 1, params = ["w2"]}
        %t2 = wait(%a2)
        %m2 = compute "aten.mm"(%m1, %t2) {heavy}
        %output = output(%m2, %k2)
    ''', "anchor,prefetch")
    assert " ".join(order(program)) == "^entry a1 t1 m1 k a2 k2 t2 m2 output"


def test_phase_start_bounds_hand_written_anchors():
    """A backward gather anchored (by hand) in the forward goes right after ^backward; a
    forward one anchored at ^entry goes right after it."""
    program, result = run('''
        %x = input
        %w1 = input
        %w2 = input
        ^entry
        %f = compute "aten.mm"(%x, %x) {heavy}
        %a1 = launch "ag"(%w1) {role = fsdp_all_gather, nbytes = 1, params = ["w1"], anchor = ^entry}
        %t1 = wait(%a1)
        %m1 = compute "aten.mm"(%f, %t1) {heavy}
        ^backward
        %g = compute "aten.neg"(%m1)
        %b2 = launch "ag"(%w2) {role = fsdp_all_gather_backward, nbytes = 1, params = ["w2"], anchor = %f}
        %u2 = wait(%b2)
        %n2 = compute "aten.mm"(%g, %u2) {heavy}
        %output = output(%n2)
    ''', "prefetch")
    assert " ".join(order(program)) == "^entry a1 f t1 m1 ^backward b2 g u2 n2 output"
    assert program.op("b2").prefetched and program.op("b2").anchor == "f"
    assert (result.stats()["prefetch"]["forward"], result.stats()["prefetch"]["backward"]) == (1, 1)


def test_held_launches_stay_and_chains_sharing_a_slot_keep_launch_order_reversed():
    """Two launches whose slot is right after the same barrier: each goes just before the node
    there, so the later-processed one ends up first (the reference's prepend-at-position)."""
    program, _ = run('''
        %x = input
        %buf = input
        %w1 = input
        %w2 = input
        %w3 = input
        %w4 = input
        ^entry
        %a1 = launch "ag"(%w1) {role = fsdp_all_gather, nbytes = 1, params = ["w1"]}
        %t1 = wait(%a1)
        %m1 = compute "aten.mm"(%x, %t1) {heavy}
        %b = barrier "aten.copy_"(%buf, %m1)
        %n = compute "aten.neg"(%m1)
        %a2 = launch "ag"(%w2) {role = fsdp_all_gather, nbytes = 1, params = ["w2"], anchor = %m1}
        %t2 = wait(%a2)
        %a3 = launch "ag"(%w3) {role = fsdp_all_gather, nbytes = 1, params = ["w3"], anchor = %m1}
        %t3 = wait(%a3)
        %a4 = launch "ag"(%w4) {role = fsdp_all_gather, nbytes = 1, params = ["w4"], anchor = %m1, hold = "over budget"}
        %t4 = wait(%a4)
        %s = compute "aten.add"(%t2, %t3)
        %m2 = compute "aten.mm"(%n, %s) {heavy}
        %m3 = compute "aten.mm"(%m2, %t4) {heavy}
        %output = output(%m3)
    ''', "prefetch")
    names = order(program)
    assert " ".join(names[names.index("b"):names.index("b") + 6]) == "b a3 a2 n t2 t3"
    assert not program.op("a4").prefetched and program.op("a4").hold == "over budget"


def test_prefetch_verifies_after_each_pass_and_is_idempotent():
    program = parse_program(joint(4, 4))
    ctx = PassContext()
    for p in parse_pipeline("anchor{forward-depth=2,backward-depth=2},budget,prefetch,sink"):
        p.apply(ctx, program)
        verify(program)
    before = print_program(program)
    again = PassManager("prefetch").run(program)
    # everything already sits at its slot: nothing moves again
    assert again.stats()["prefetch"]["forward"] + again.stats()["prefetch"]["backward"] == 0
    assert print_program(program).replace(', hold = "no earlier legal slot"', "") == before.replace(
        ', hold = "no earlier legal slot"', "")


# ---- prefetch takes the moves budget planned ------------------------------------------------------

def _generated(size=2500, seed=3):
    from fxsched.front.generate import generate_graph
    from fxsched.lowering import lower
    return lower(generate_graph(size, seed=seed))


def _count_plans(monkeypatch) -> list:
    from fxsched.passes import prefetch as prefetch_pass
    planned, real = [], prefetch_pass.plan
    monkeypatch.setattr(prefetch_pass, "plan", lambda *a, **k: planned.append(1) or real(*a, **k))
    return planned


@pytest.mark.parametrize("pipeline,handed_on", [
    ("reference", True), ("default", True), ("anchor,budget{max-in-flight-gb=0.05},prefetch,sink", True),
    ("anchor,budget,sink,prefetch", False),  # sink moved launches between them: prefetch plans again
])
def test_prefetch_taking_budgets_plan_schedules_as_planning_again(pipeline, handed_on, monkeypatch):
    from fxsched.passes import budget as budget_pass
    from fxsched.passes.pipelines import PIPELINES

    planned = _count_plans(monkeypatch)

    def run_twice():  # the second run sees the gathers the first moved
        program = _generated()
        first = PassManager(PIPELINES.get(pipeline, pipeline)).run(program)
        second = PassManager(PIPELINES.get(pipeline, pipeline)).run(program)
        return print_program(program), first.stats(), second.stats()

    taken = run_twice()
    assert (not planned) == handed_on
    monkeypatch.setattr(budget_pass.Planned, "valid", lambda self, program, analysis: False)
    assert run_twice() == taken  # planned again by prefetch: the same program and counts
    assert planned


def test_prefetch_plans_again_when_a_hold_changed_after_budget(monkeypatch):
    import attrs

    planned = _count_plans(monkeypatch)
    programs = []
    for hand_on in (True, False):
        program, ctx = _generated(), PassContext()
        budget, prefetch = parse_pipeline("anchor,budget,prefetch")[1:]
        parse_pipeline("anchor")[0].apply(ctx, program)
        budget.apply(ctx, program)
        admitted = [g.launch for g in ctx.placed.admitted]
        assert len(admitted) > 2
        held = program.op(admitted[1])  # held after budget admitted it: prefetch must leave it
        program.replace(attrs.evolve(held, hold="test"))
        if not hand_on:
            ctx.placed = None
        prefetch.apply(ctx, program)
        verify(program)
        assert not program.op(admitted[1]).prefetched and program.op(admitted[2]).prefetched
        programs.append(print_program(program))
    assert len(planned) == 2 and programs[0] == programs[1]
