"""sink: waits, views and copy-outs move down to just before their first use, latest first."""

from __future__ import annotations


from irtest import dedent, filecheck
from fxsched.ir import parse_program, print_program, verify
from fxsched.passes import PassContext, PassManager, parse_pipeline


def run(text: str, pipeline: str = "sink"):
    program = parse_program(dedent(text))
    result = PassManager(pipeline).run(program)
    return program, result


def test_branching_views_keep_their_order_and_other_frees_are_crossed():
    """v2 is read first, yet v1 stays ahead of it (independent branches keep their order).
    t1 is held where it is by %dead, an unused view that is still its user; views without
    users do not move. r2 crosses the free of w1 (another parameter's storage)."""
    program, result = run('''
        %x = input
        %w1 = input
        %w2 = input
        ^entry
        %a1 = launch "ag"(%w1) {role = fsdp_all_gather, nbytes = 1, params = ["w1"]}
        %t1 = wait(%a1)
        %v1 = view "aten.slice"(%t1)
        %v2 = view "aten.slice"(%t1)
        %dead = view "aten.t"(%t1)
        %n1 = compute "aten.neg"(%x)
        %a2 = launch "ag"(%w2) {role = fsdp_all_gather, nbytes = 1, params = ["w2"]}
        %t2 = wait(%a2)
        %r2 = view "aten.view"(%t2)
        %n2 = compute "aten.neg"(%n1)
        %m1 = compute "aten.mm"(%n2, %v2) {heavy}
        %m2 = compute "aten.mm"(%m1, %v1) {heavy}
        %f1 = free "free"(%v1) {params = ["w1"]}
        %n3 = compute "aten.neg"(%m2)
        %m3 = compute "aten.mm"(%n3, %r2) {heavy}
        %output = output(%m3)
    ''')
    assert print_program(program) == dedent('''
        %x = input
        %w1 = input
        %w2 = input
        ^entry
        %a1 = launch "ag"(%w1) {role = fsdp_all_gather, nbytes = 1, params = ["w1"]}
        %t1 = wait(%a1)
        %dead = view "aten.t"(%t1)
        %n1 = compute "aten.neg"(%x)
        %a2 = launch "ag"(%w2) {role = fsdp_all_gather, nbytes = 1, params = ["w2"]}
        %n2 = compute "aten.neg"(%n1)
        %v1 = view "aten.slice"(%t1)
        %v2 = view "aten.slice"(%t1)
        %m1 = compute "aten.mm"(%n2, %v2) {heavy}
        %m2 = compute "aten.mm"(%m1, %v1) {heavy}
        %f1 = free "free"(%v1) {params = ["w1"]}
        %n3 = compute "aten.neg"(%m2)
        %t2 = wait(%a2)
        %r2 = view "aten.view"(%t2)
        %m3 = compute "aten.mm"(%n3, %r2) {heavy}
        %output = output(%m3)
    ''')
    assert result.stats() == {"sink": {"sunk": 4, "changed": True}}


def test_copy_outs_sharing_a_consumer_keep_their_order():
    program, result = run('''
        %x = input
        %w = input
        ^entry
        %ab = launch "ag"(%w) {role = fsdp_all_gather, nbytes = 2, params = ["p1", "p2"], bucket = "b0"}
        %tb = wait(%ab)
        %rows = view "aten.view"(%tb)
        %s1 = view "aten.slice"(%rows)
        %co1 = copy_out "aten.clone"(%s1) {bucket = "b0"}
        %s2 = view "aten.slice"(%rows)
        %co2 = copy_out "aten.clone"(%s2) {bucket = "b0"}
        %other = copy_out "aten.clone"(%rows) {bucket = "b9"}
        %n = compute "aten.neg"(%x)
        %n2 = compute "aten.neg"(%n)
        %sum = compute "aten.add"(%co2, %co1)
        %m = compute "aten.mm"(%n2, %sum, %other) {heavy}
        %output = output(%m)
    ''')
    # %other copies out for another bucket: a consumer, not part of the realization
    filecheck(print_program(program), '''
        CHECK:      %ab = launch
        CHECK-NEXT: %tb = wait(%ab)
        CHECK-NEXT: %rows = view
        CHECK-NEXT: %other = copy_out
        CHECK-NEXT: %n = compute
        CHECK-NEXT: %n2 = compute
        CHECK-NEXT: %s1 = view
        CHECK-NEXT: %co1 = copy_out
        CHECK-NEXT: %s2 = view
        CHECK-NEXT: %co2 = copy_out
        CHECK-NEXT: %sum = compute
    ''')
    assert result.stats()["sink"]["sunk"] == 4  # co2, s2, co1, s1; rows is held by %other


def test_sinking_stops_before_a_barrier():
    program, result = run('''
        %x = input
        %buf = input
        %w = input
        ^entry
        %a = launch "ag"(%w) {role = fsdp_all_gather, nbytes = 1, params = ["w"]}
        %t = wait(%a)
        %v = view "aten.view"(%t)
        %n = compute "aten.neg"(%x)
        %b = barrier "aten.copy_"(%buf, %n) {reason = "mutation"}
        %n2 = compute "aten.neg"(%n)
        %m = compute "aten.mm"(%n2, %v) {heavy}
        %output = output(%m)
    ''')
    filecheck(print_program(program), '''
        CHECK:      %a = launch
        CHECK-NEXT: %n = compute
        CHECK-NEXT: %t = wait(%a)
        CHECK-NEXT: %v = view
        CHECK-NEXT: %b = barrier
        CHECK-NEXT: %n2 = compute
        CHECK-NEXT: %m = compute
    ''')
    assert result.stats()["sink"]["sunk"] == 2


def test_sinking_stops_before_the_backward_phase():
    program, _ = run('''
        %x = input
        %w = input
        ^entry
        %a = launch "ag"(%w) {role = fsdp_all_gather, nbytes = 1, params = ["w"]}
        %t = wait(%a)
        %v = view "aten.view"(%t)
        %n = compute "aten.neg"(%x)
        %n2 = compute "aten.neg"(%n)
        ^backward
        %g = compute "aten.neg"(%n2)
        %m = compute "aten.mm"(%g, %v) {heavy}
        %output = output(%m)
    ''')
    filecheck(print_program(program), '''
        CHECK:      %n2 = compute
        CHECK-NEXT: %t = wait(%a)
        CHECK-NEXT: %v = view
        CHECK-NEXT: ^backward
        CHECK-NEXT: %g = compute
    ''')


def test_backward_realizations_sink_inside_the_backward():
    program, result = run('''
        %x = input
        %w = input
        ^entry
        %f = compute "aten.neg"(%x)
        ^backward
        %b = launch "ag"(%w) {role = fsdp_all_gather_backward, nbytes = 1, params = ["w"]}
        %u = wait(%b)
        %g = compute "aten.neg"(%f)
        %g2 = compute "aten.neg"(%g)
        %n = compute "aten.mm"(%g2, %u) {heavy}
        %output = output(%n)
    ''')
    assert " ".join(program.schedule.names()[-5:]) == "g g2 u n output"
    assert result.stats()["sink"]["sunk"] == 1


def test_the_free_of_the_same_storage_bounds_sinking():
    """The free reads the realization: it is a user, so nothing sinks past it."""
    program, result = run('''
        %x = input
        %w = input
        ^entry
        %a = launch "ag"(%w) {role = fsdp_all_gather, nbytes = 1, params = ["w"]}
        %t = wait(%a)
        %v = view "aten.view"(%t)
        %f = free "free"(%v) {params = ["w"]}
        %n = compute "aten.neg"(%x)
        %output = output(%n)
    ''')
    assert not result.changed
    assert program.schedule.names()[3:7] == ["a", "t", "v", "f"]


def test_nothing_to_sink_is_no_change_and_verified_throughout():
    text = '''
        %x = input
        %w = input
        ^entry
        %a = launch "ag"(%w) {role = fsdp_all_gather, nbytes = 1, params = ["w"]}
        %t = wait(%a)
        %m = compute "aten.mm"(%x, %t) {heavy}
        %output = output(%m)
    '''
    program, result = run(text)
    assert result.stats() == {"sink": {"sunk": 0, "changed": False}}
    assert print_program(program) == dedent(text)
    program = parse_program(dedent(text).replace("%m = compute", '%n = compute "aten.neg"(%x)\n%m = compute'))
    ctx = PassContext()
    for p in parse_pipeline("anchor{forward-depth=0},budget,prefetch,sink"):
        p.apply(ctx, program)
        verify(program)
    assert program.schedule.names()[3:6] == ["a", "n", "t"]  # sinking runs even with prefetch off
