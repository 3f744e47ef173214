"""anchor: consumer lookahead per phase, attention intervals, and the hold reasons it writes.

Before/after cases are also IR test files: tests/filecheck/passes/anchor.fxir, anchor-backward.fxir."""

from __future__ import annotations


import pytest

from irtest import dedent, joint, run
from fxsched.ir import parse_program, print_program, verify
from fxsched.passes import PassContext, PassManager, parse_pipeline


def anchors(program) -> dict[str, tuple[str | None, str | None]]:
    """launch -> (anchor, hold) for every FSDP gather."""
    return {op.name: (op.anchor, op.hold) for op in program.ops() if getattr(op, "is_gather", False)}


# ---- consumer lookahead ----------------------------------------------------------------------

@pytest.mark.parametrize("depth,expected", [
    (0, {"1": (None, "depth 0"), "2": (None, "depth 0"), "3": (None, "depth 0"), "4": (None, "depth 0")}),
    (1, {"1": (None, "first group"), "2": ("1", None), "3": ("2", None), "4": ("3", None)}),
    (2, {"1": (None, "first group"), "2": ("1", None), "3": ("1", None), "4": ("2", None)}),
    (3, {"1": (None, "first group"), "2": ("1", None), "3": ("1", None), "4": ("1", None)}),
])
def test_depths_per_phase(depth, expected):
    """Group i goes before consumer max(0, i - depth); forward and backward are set apart."""
    program, _ = run(joint(4, 4), f"anchor{{forward-depth={depth},backward-depth=1}}")
    got = anchors(program)
    for i, (anchor, hold) in expected.items():
        assert got[f"a{i}"] == (anchor and f"m{anchor}", hold)
    # the backward keeps its own depth of 1: groups n4, n3, n2, n1
    assert [got[f"b{i}"] for i in (4, 3, 2, 1)] == [(None, "first group"), ("n4", None), ("n3", None), ("n2", None)]

    program, _ = run(joint(4, 4), f"anchor{{forward-depth=1,backward-depth={depth}}}")
    got = anchors(program)
    backward_consumer = {"1": "n4", "2": "n3", "3": "n2"}
    for i, (anchor, hold) in expected.items():
        assert got[f"b{5 - int(i)}"] == (anchor and backward_consumer[anchor], hold)
    assert got["a2"] == ("m1", None)


def test_gathers_with_the_same_first_consumer_form_one_group():
    program, _ = run('''
        %x = input
        %w1 = input
        %w2 = input
        %w3 = input
        ^entry
        %a1 = launch "ag"(%w1) {role = fsdp_all_gather, nbytes = 1, params = ["w1"]}
        %t1 = wait(%a1)
        %m1 = compute "aten.mm"(%x, %t1) {heavy}
        %a2 = launch "ag"(%w2) {role = fsdp_all_gather, nbytes = 1, params = ["w2"]}
        %t2 = wait(%a2)
        %a3 = launch "ag"(%w3) {role = fsdp_all_gather, nbytes = 1, params = ["w3"]}
        %t3 = wait(%a3)
        %v3 = view "aten.t"(%t3)
        %s = compute "aten.add"(%t2, %v3)
        %m2 = compute "aten.mm"(%m1, %s) {heavy}
        %output = output(%m2)
    ''', "anchor")
    assert anchors(program) == {"a1": (None, "first group"), "a2": ("m1", None), "a3": ("m1", None)}


# ---- attention intervals -----------------------------------------------------------------------

ATTENTION = '''
    %x = input
    %w1 = input
    %w2 = input
    %w3 = input
    %w4 = input
    ^entry
    %h0 = compute "aten.mm"(%x, %x) {heavy}
    %a1 = launch "ag"(%w1) {role = fsdp_all_gather, nbytes = 100, params = ["w1"]}
    %t1 = wait(%a1)
    %h1 = compute "aten.mm"(%h0, %t1) {heavy}
    %h2 = compute "aten.mm"(%h1, %x) {heavy}
    %at1 = compute "aten._scaled_dot_product_flash_attention"(%h2) {heavy, attention}
    %a2 = launch "ag"(%w2) {role = fsdp_all_gather, nbytes = 100, params = ["w2"]}
    %t2 = wait(%a2)
    %h3 = compute "aten.mm"(%at1, %t2) {heavy}
    %a3 = launch "ag"(%w3) {role = fsdp_all_gather, nbytes = 100, params = ["w3"]}
    %t3 = wait(%a3)
    %h4 = compute "aten.mm"(%h3, %t3) {heavy}
    %at2 = compute "aten._scaled_dot_product_flash_attention"(%h4) {heavy, attention}
    %a4 = launch "ag"(%w4) {role = fsdp_all_gather, nbytes = 100, params = ["w4"]}
    %t4 = wait(%a4)
    %h5 = compute "aten.mm"(%at2, %t4) {heavy}
    %output = output(%h5)
'''


def test_attention_intervals_spread_next_interval_consumers_over_heavy_nodes():
    """Interval [top, at1] has heavy h0 h1 h2 at1 (h = 4); its consumers h1 and those of the next
    interval, h3 h4 (m = 3), get heavy[0], heavy[4 // 3], heavy[8 // 3] = h0, h1, h2. Interval
    [at1, at2] has heavy at1 h3 h4 at2; the next interval's consumer h5 gets at1. An anchor is
    taken when earlier than the lookahead one: a1 (first group, consumer h1) gets h0."""
    program, _ = run(ATTENTION, "anchor")
    assert anchors(program) == {"a1": ("h0", None), "a2": ("h1", None), "a3": ("h2", None), "a4": ("at1", None)}
    program, _ = run(ATTENTION, "anchor{attention=false}")
    assert anchors(program) == {"a1": (None, "first group"), "a2": ("h1", None), "a3": ("h3", None),
                                "a4": ("h4", None)}


def test_first_group_is_prefetched_through_an_attention_anchor():
    program, result = run(ATTENTION, "anchor,budget,prefetch,sink")
    assert print_program(program) == dedent('''
        %x = input
        %w1 = input
        %w2 = input
        %w3 = input
        %w4 = input
        ^entry
        %a1 = launch "ag"(%w1) {role = fsdp_all_gather, nbytes = 100, params = ["w1"], anchor = %h0, prefetched}
        %h0 = compute "aten.mm"(%x, %x) {heavy}
        %a2 = launch "ag"(%w2) {role = fsdp_all_gather, nbytes = 100, params = ["w2"], anchor = %h1, prefetched}
        %t1 = wait(%a1)
        %h1 = compute "aten.mm"(%h0, %t1) {heavy}
        %a3 = launch "ag"(%w3) {role = fsdp_all_gather, nbytes = 100, params = ["w3"], anchor = %h2, prefetched}
        %h2 = compute "aten.mm"(%h1, %x) {heavy}
        %a4 = launch "ag"(%w4) {role = fsdp_all_gather, nbytes = 100, params = ["w4"], anchor = %at1, prefetched}
        %at1 = compute "aten._scaled_dot_product_flash_attention"(%h2) {heavy, attention}
        %t2 = wait(%a2)
        %h3 = compute "aten.mm"(%at1, %t2) {heavy}
        %t3 = wait(%a3)
        %h4 = compute "aten.mm"(%h3, %t3) {heavy}
        %at2 = compute "aten._scaled_dot_product_flash_attention"(%h4) {heavy, attention}
        %t4 = wait(%a4)
        %h5 = compute "aten.mm"(%at2, %t4) {heavy}
        %output = output(%h5)
    ''')
    assert result.stats()["prefetch"]["forward"] == 4
    assert result.stats()["sink"]["sunk"] == 1


def test_attention_anchors_in_the_backward_only_use_backward_heavy_nodes():
    """The forward's matmuls lie in the backward's first interval's index range but are not
    its heavy nodes; depth 0 in a phase turns attention anchors off there too."""
    text = '''
        %x = input
        %w1 = input
        %w2 = input
        ^entry
        %f = compute "aten.mm"(%x, %x) {heavy}
        %fa = compute "aten._scaled_dot_product_flash_attention"(%f) {heavy, attention}
        ^backward
        %g0 = compute "aten.mm"(%fa, %x) {heavy}
        %b1 = launch "ag"(%w1) {role = fsdp_all_gather_backward, nbytes = 100, params = ["w1"]}
        %u1 = wait(%b1)
        %g1 = compute "aten.mm"(%g0, %u1) {heavy}
        %ga = compute "aten._scaled_dot_product_flash_attention_backward"(%g1) {heavy, attention}
        %b2 = launch "ag"(%w2) {role = fsdp_all_gather_backward, nbytes = 100, params = ["w2"]}
        %u2 = wait(%b2)
        %g2 = compute "aten.mm"(%ga, %u2) {heavy}
        %output = output(%g2)
    '''
    # interval [top, ga]: heavy g0 g1 ga; consumers g1 (inside) and g2 (next): g0, g1
    program, _ = run(text, "anchor")
    assert anchors(program) == {"b1": ("g0", None), "b2": ("g1", None)}
    program, _ = run(text, "anchor{backward-depth=0}")
    assert anchors(program) == {"b1": (None, "depth 0"), "b2": (None, "depth 0")}


# ---- reasons and bookkeeping -----------------------------------------------------------------------

def test_no_consumer_and_lowering_holds():
    program, result = run('''
        %x = input
        %w1 = input
        %w2 = input
        %w3 = input
        ^entry
        %a1 = launch "ag"(%w1) {role = fsdp_all_gather, nbytes = 1, params = ["w1"]}
        %t1 = wait(%a1)
        %v1 = view "aten.t"(%t1)
        %m = compute "aten.mm"(%x, %x) {heavy}
        %a2 = launch "ag"(%w2) {role = fsdp_all_gather, nbytes = 1, params = ["w2"]}
        %t2 = wait(%a2)
        %m2 = compute "aten.mm"(%m, %t2) {heavy}
        %a3 = launch "ag"(%w3) {role = fsdp_all_gather, nbytes = 1, hold = "no parameter name"}
        %t3 = wait(%a3)
        %m3 = compute "aten.mm"(%m2, %t3) {heavy}
        %output = output(%m3)
    ''', "anchor")
    # a1's realization (wait, view) has no reader; a3 keeps the reason lowering gave it
    assert anchors(program) == {"a1": (None, "no consumer"), "a2": (None, "first group"),
                                "a3": (None, "no parameter name")}
    assert result.stats()["anchor"] == {"anchored": 0, "first group": 1, "depth 0": 0, "no consumer": 1,
                                        "changed": True}


def test_anchor_is_idempotent_and_clears_stale_anchors():
    program, _ = run(joint(3, 0), "anchor")
    again = PassManager("anchor").run(program)
    assert not again.changed
    # a stale anchor and hold written by hand are replaced
    text = joint(3, 0).replace('params = ["w1"]}', 'params = ["w1"], anchor = %m2, hold = "over budget"}')
    program, result = run(text, "anchor")
    assert anchors(program)["a1"] == (None, "first group")
    assert result.changed


def test_anchor_changes_no_order_and_verifies():
    program = parse_program(joint(3, 3))
    before = program.schedule.names()
    ctx = PassContext()
    for p in parse_pipeline("anchor{forward-depth=2}"):
        p.apply(ctx, program)
        verify(program)
    assert program.schedule.names() == before
