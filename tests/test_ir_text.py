"""The IR's text form: print/parse round trips, effect lines, and parse errors with positions."""

from __future__ import annotations


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from irtest import dedent, filecheck
from fxsched.ir import (BACKWARD, DTYPE_BYTES, ENTRY, OP_KINDS, Barrier, Cast, Compute, CopyOut, Free, Input,
                        Launch, Marker, Output, ParseError, Phase, Program, Role, Schedule, TensorType, View, Wait,
                        derive_effects, parse_program, print_program, verify)


# Every op kind, every attribute type: strings (targets, group, bucket, hold with escapes, reason),
# roles, ints (nbytes incl. 0 and negative), string lists (params), flags, anchors (to an op and
# to a marker), phase overrides both ways, and both markers.
EVERYTHING = dedent(r'''
    %x = input "x" : f32[2,16]
    %w = input "w" : f32[128]
    %g = input
    ^entry
    %cw = cast "prims.convert_element_type.default"(%w) : bf16[128]
    %k = constant "buf" : f32[2]
    %ag = launch "_c10d_functional.all_gather_into_tensor.default"(%cw) {group = "0", group_size = 2, role = fsdp_all_gather, nbytes = 4096, params = ["w"], anchor = %mm, prefetched}
    %wt = wait "_c10d_functional.wait_tensor.default"(%ag)
    %v = view "aten.view.default"(%wt)
    %bag = launch "ag"(%g) {role = fsdp_all_gather, nbytes = 0, params = ["a", "b"], bucket = "3", hold = "budget: \"too big\" \\ \u00e9\n"}
    %bwt = wait(%bag)
    %co = copy_out "aten.clone.default"(%bwt) {bucket = "3"}
    %mm = compute "aten.mm.default"(%x, %v) {heavy}
    %at = compute "aten._scaled_dot_product_flash_attention.default"(%mm, %co) {heavy, attention} : (f32[2,?,8], f32[?], none, i64[])
    %drop = compute "aten.native_dropout.default"(%at) {random}
    %f = free "fsdp.free"(%v) {params = ["w"]}
    %b = barrier "aten.copy_.default"(%x, %drop) {reason = "mutation"}
    %late = compute "aten.add.Tensor"(%at) {bwd}
    %ip = compute "aten.add_.Tensor"(%late, %x) {bwd, writes = [%late], alias = %late}
    %mv = view "aten.reshape.default"(%ip) {bwd, maybe}
    ^backward
    %rag = launch "ag"(%w) {role = fsdp_all_gather_backward, nbytes = 4096, params = ["w"], anchor = ^backward}
    %rwt = wait(%rag)
    %early = compute "aten.neg.default"(%rwt) {fwd} : f64[?,?]
    %rs = launch "rs"(%early) {group = "0", role = fsdp_reduce_scatter}
    %rsw = wait(%rs)
    %ar = launch "ar"(%rsw) {group = "1", nbytes = -1, hold = ""}
    %arw = wait(%ar)
    %co2 = opaque "_c10d_functional.all_reduce_coalesced_.default"(%arw) {group = "1", reason = "coalesced collective", writes = [%arw]}
    %output = output(%co2, %mv)
''')

SMALL = [
    # the ir/text.py docstring example
    dedent('''
        %x = input
        ^entry
        %ag = launch "all_gather_into_tensor"(%x) {role = fsdp_all_gather, nbytes = 4096, params = ["w"]}
        %wt = wait(%ag)
        %mm = compute "aten.mm"(%x, %wt) {heavy}
        ^backward
        %output = output(%mm)
    '''),
    # no inputs, an op with no operands, an empty operand list
    dedent('''
        ^entry
        %z = compute "aten.zeros.default"()
        %output = output(%z)
    '''),
    # a custom marker and an empty-member bucket held with a reason
    dedent('''
        %s = input "shard"
        ^entry
        ^mid
        %ag = launch "ag"(%s) {role = fsdp_all_gather, bucket = "b0", hold = "bucket without members"}
        %wt = wait(%ag)
        %output = output(%wt)
    '''),
    # explicit effect lines (to and from markers too) come after the ops
    dedent('''
        %x = input
        ^entry
        %a = compute "a"(%x)
        %b = compute "b"(%x)
        ^mid
        ^backward
        %c = compute "c"(%x)
        %output = output(%a, %b, %c)
        effect %a -> %b
        effect %b -> ^mid
        effect ^entry -> %c
        effect ^mid -> %c
    '''),
]


@pytest.mark.parametrize("text", [EVERYTHING, *SMALL], ids=["everything", *(f"small{i}" for i in range(len(SMALL)))])
def test_print_parse_is_identity(text):
    program = parse_program(text)
    assert print_program(program) == text
    again = parse_program(print_program(program))
    assert print_program(again) == text
    assert sorted(again.effect_edges()) == sorted(program.effect_edges())
    assert [again.op(n) for n in again.schedule] == [program.op(n) for n in program.schedule]


def test_everything_covers_every_kind():
    program = parse_program(EVERYTHING)
    kinds = {type(op) for op in program.ops()}
    assert kinds == set(OP_KINDS.values())


def test_parsed_attributes_have_their_types():
    p = parse_program(EVERYTHING)
    ag = p.op("ag")
    assert isinstance(ag, Launch) and ag.role is Role.GATHER and ag.is_gather
    assert (ag.target, ag.group, ag.group_size, ag.nbytes, ag.params, ag.anchor, ag.prefetched) == (
        "_c10d_functional.all_gather_into_tensor.default", "0", 2, 4096, ("w",), "mm", True)
    assert ag.types == () and p.op("x").types == (TensorType("f32", (2, 16)),)
    assert p.op("at").types == (TensorType("f32", (2, -1, 8)), TensorType("f32", (-1,)), TensorType("none"),
                                TensorType("i64", ()))
    assert p.op("at").types[0].nbytes is None and p.op("x").types[0].nbytes == 2 * 16 * 4
    assert not p.op("rag").prefetched
    bag = p.op("bag")
    assert (bag.nbytes, bag.params, bag.bucket) == (0, ("a", "b"), "3")
    assert bag.hold == 'budget: "too big" \\ é\n'
    assert p.op("co") == CopyOut(name="co", operands=("bwt",), target="aten.clone.default", bucket="3")
    assert p.op("at").heavy and p.op("at").attention
    assert p.op("mm").heavy and not p.op("mm").attention and not p.op("mm").random
    assert p.op("drop").random and not p.op("drop").heavy
    assert p.op("f").params == ("w",) and isinstance(p.op("f"), Free)
    assert p.op("b").reason == "mutation" and isinstance(p.op("b"), Barrier)
    assert p.op("rag").role is Role.REGATHER and p.op("rag").anchor == BACKWARD
    assert p.op("rs").role is Role.REDUCE_SCATTER and not p.op("rs").is_gather
    assert p.op("ar").role is None and p.op("ar").nbytes == -1 and p.op("ar").hold == ""
    assert isinstance(p.op("cw"), Cast) and isinstance(p.op("v"), View) and isinstance(p.op("wt"), Wait)
    assert p.op("x") == Input(name="x", target="x", types=[TensorType("f32", (2, 16))]) and p.op("g").target == ""
    assert isinstance(p.op("output"), Output) and p.op("output").operands == ("co2", "mv")
    assert (p.op("ip").writes, p.op("ip").alias, p.op("mv").maybe) == (("late",), "late", True)
    assert (p.op("co2").writes, p.op("co2").group, p.op("co2").reason) == (("arw",), "1", "coalesced collective")
    assert isinstance(p.op(ENTRY), Marker) and isinstance(p.op(BACKWARD), Marker)


def test_phases_follow_the_backward_marker_and_overrides():
    p = parse_program(EVERYTHING)
    assert p.op("mm").phase is Phase.FORWARD
    assert p.op("late").phase is Phase.BACKWARD  # {bwd} before ^backward
    assert p.op("rag").phase is Phase.BACKWARD  # after ^backward
    assert p.op("early").phase is Phase.FORWARD  # {fwd} after ^backward
    assert p.op(BACKWARD).phase is Phase.BACKWARD


def test_keyword_only_integers_become_strings_for_bucket_and_group():
    p = parse_program('%s = input\n^entry\n%ag = launch(%s) {group = 7, bucket = 3}\n%w = wait(%ag)\n%output = output(%w)\n')
    assert p.op("ag").group == "7" and p.op("ag").bucket == "3"
    assert '{group = "7", bucket = "3"}' in print_program(p)


def test_comments_and_blank_lines_are_ignored():
    text = "// a program\n\n%x = input   // the only input\n^entry\n\n%output = output(%x) // done\n"
    assert print_program(parse_program(text)) == "%x = input\n^entry\n%output = output(%x)\n"


def test_missing_entry_marker_is_added_after_the_inputs():
    p = parse_program("%x = input\n%y = compute(%x)\n%output = output(%y)\n")
    assert p.schedule.names() == ["x", ENTRY, "y", "output"]
    assert print_program(p) == "%x = input\n^entry\n%y = compute(%x)\n%output = output(%y)\n"
    assert p.notes == []
    late = parse_program("%y = compute()\n%x = input\n%output = output(%x, %y)\n")
    assert late.schedule.names() == ["x", ENTRY, "y", "output"]
    assert any("inputs were not all first" in note for note in late.notes)


def test_backward_marker_is_added_before_the_first_backward_op():
    p = parse_program("%x = input\n^entry\n%a = compute(%x)\n%b = compute(%a) {bwd}\n%output = output(%b)\n")
    assert p.schedule.names() == ["x", ENTRY, "a", BACKWARD, "b", "output"]
    assert "^backward\n%b = compute(%a)\n" in print_program(p)


def test_program_built_in_code_prints_and_parses_back():
    p = Program()
    p.add(Input(name="s", target="shard"))
    p.add(Input(name="x"))
    p.add(Launch(name="ag", operands=["s"], target="ag", group="g", role=Role.GATHER, nbytes=12,
                 params=["p.q", "r"], anchor="mm", hold='tab\there "quoted" /* // not a comment'))
    p.add(Wait(name="wt", operands=["ag"]))
    p.add(View(name="v", operands=["wt"], target="aten.t.default"))
    p.add(Compute(name="mm", operands=["x", "v"], target="aten.mm.default", heavy=True))
    p.add(Free(name="f", operands=["v"], params=["p.q", "r"], target="free"))
    p.add(Compute(name="g2", operands=["mm"], phase=Phase.BACKWARD))
    p.add(Output(name="output", operands=["g2"]))
    p.schedule = Schedule(["s", "x", "ag", "wt", "v", "mm", "f", "g2", "output"])
    derive_effects(p)
    p.add_effect("x", "f", "explicit")
    text = print_program(p)
    assert text.endswith("effect %x -> %f\n")
    q = parse_program(text)
    assert print_program(q) == text
    assert [q.op(n) for n in q.schedule] == [p.op(n) for n in p.schedule]
    assert sorted(q.effect_edges()) == sorted(p.effect_edges())
    verify(q)


def test_explicit_effect_lines_add_edges():
    text = dedent('''
        %x = input
        ^entry
        %a = compute "a"(%x)
        %b = compute "b"(%x)
        %output = output(%a, %b)
        effect %b -> %a
    ''')
    p = parse_program(text)
    assert ("b", "a", "explicit") in p.effect_edges()
    assert not p.graph.has_edge("a", "b")
    # the explicit edge is a real constraint: this order (a before b) now breaks it
    with pytest.raises(Exception, match=r"%a: scheduled before %b, which it must follow by an effect edge \(explicit\)"):
        verify(p)
    # an effect line duplicating a data edge adds nothing
    q = parse_program("%x = input\n^entry\n%a = compute(%x)\n%output = output(%a)\neffect %x -> %a\n")
    assert q.graph.edges["x", "a"]["kind"] == "data"
    assert "effect" not in print_program(q)


def test_explicit_edges_print_as_lines_and_derived_ones_as_comments():
    text = SMALL[3]
    p = parse_program(text)
    assert {(u, v) for u, v, why in p.effect_edges() if why == "explicit"} == {
        ("a", "b"), ("b", "^mid"), (ENTRY, "c"), ("^mid", "c")}
    out = print_program(p, effects=True)
    assert out.startswith(text)
    filecheck(out, '''
        CHECK:      %output = output(%a, %b, %c)
        CHECK-NEXT: effect %a -> %b
        CHECK-NEXT: effect %b -> ^mid
        CHECK-NEXT: effect ^entry -> %c
        CHECK-NEXT: effect ^mid -> %c
        CHECK-NOT:  (explicit)
        CHECK-DAG:  // effect ^entry -> %a (entry)
        CHECK-DAG:  // effect ^entry -> %b (entry)
        CHECK-DAG:  // effect ^backward -> %c (phase)
        CHECK-DAG:  // effect %a -> ^backward (phase)
    ''')


# ---- effect edges, checked with filecheck ----------------------------------------------------

def test_free_waits_for_every_reader_through_views():
    p = parse_program(dedent('''
        %w = input
        %x = input
        ^entry
        %ag = launch "ag"(%w) {role = fsdp_all_gather, nbytes = 64, params = ["w"]}
        %wt = wait(%ag)
        %sl = view "aten.slice.Tensor"(%wt)
        %v = view "aten.view.default"(%sl)
        %t = view "aten.t.default"(%v)
        %mm = compute "aten.mm.default"(%x, %t) {heavy}
        %n = compute "aten.neg.default"(%wt)
        %other = compute "aten.relu.default"(%x)
        %f = free "free"(%v) {params = ["w"]}
        %output = output(%mm, %n, %other)
    '''))
    out = print_program(p, effects=True)
    filecheck(out, '''
        CHECK:      %f = free "free"(%v) {params = ["w"]}
        CHECK:      // effect ^entry -> %ag (entry)
        CHECK-NEXT: // effect ^entry -> %other (entry)
        CHECK-NEXT: // effect %mm -> %f (free)
        CHECK-NEXT: // effect %n -> %f (free)
        CHECK-NEXT: // effect %sl -> %f (free)
        CHECK-NEXT: // effect %t -> %f (free)
        CHECK-NEXT: // effect %f -> %output (output)
    ''')
    assert not p.graph.has_edge("other", "f")
    assert p.graph.edges["v", "f"]["kind"] == "data"  # already ordered by data: no extra edge


def test_regather_follows_the_free_of_the_same_param():
    p = parse_program(dedent('''
        %w = input
        %u = input
        ^entry
        %ag = launch "ag"(%w) {role = fsdp_all_gather, params = ["w"]}
        %wt = wait(%ag)
        %agu = launch "ag"(%u) {role = fsdp_all_gather, params = ["u"]}
        %wtu = wait(%agu)
        %y = compute "aten.mm.default"(%wt, %wtu) {heavy}
        %f = free "free"(%wt) {params = ["w"]}
        %fu = free "free"(%wtu) {params = ["u"]}
        ^backward
        %rag = launch "ag"(%w) {role = fsdp_all_gather_backward, params = ["w"]}
        %rwt = wait(%rag)
        %g = compute "aten.mm.default"(%y, %rwt) {heavy}
        %output = output(%g)
    '''))
    out = print_program(p, effects=True)
    filecheck(out, '''
        CHECK:     ^backward
        CHECK:     %rag = launch "ag"(%w) {role = fsdp_all_gather_backward, params = ["w"]}
        CHECK:     // effect %f -> %rag (regather)
        CHECK-NOT: // effect %fu -> %rag
    ''')
    assert not p.graph.has_edge("fu", "rag")
    assert ("f", "rag", "regather") in p.effect_edges()


def test_barriers_segment_the_graph():
    p = parse_program(dedent('''
        %x = input
        ^entry
        %a = compute "a"(%x)
        %a2 = compute "a2"(%a)
        %b1 = barrier "aten.copy_.default"(%x) {reason = "mutation"}
        %c = compute "c"(%x)
        %d = compute "d"(%c)
        %b2 = barrier "print" {reason = "side effect"}
        %e = compute "e"(%a2)
        %output = output(%d, %e)
    '''))
    out = print_program(p, effects=True)
    filecheck(out, '''
        CHECK:      // effect ^entry -> %a (entry)
        CHECK-NEXT: // effect %a2 -> %b1 (barrier)
        CHECK-NEXT: // effect %b1 -> %c (barrier)
        CHECK-NEXT: // effect %b1 -> %b2 (barrier)
        CHECK-NEXT: // effect %d -> %b2 (barrier)
        CHECK-NEXT: // effect %b2 -> %e (barrier)
        CHECK-NOT:  (barrier)
    ''')
    # transitive reduction: %a reaches %b1 through %a2, %c reaches %b2 through %d
    assert not p.graph.has_edge("a", "b1") and not p.graph.has_edge("c", "b2")
    verify(p)


def test_other_collectives_keep_their_order_per_group_gathers_do_not():
    p = parse_program(dedent('''
        %x = input
        %s = input
        ^entry
        %rs1 = launch "reduce_scatter_tensor"(%x) {group = "0", role = fsdp_reduce_scatter}
        %w1 = wait(%rs1)
        %ag = launch "all_gather_into_tensor"(%s) {group = "0", role = fsdp_all_gather, params = ["s"]}
        %wg = wait(%ag)
        %ar = launch "all_reduce"(%x) {group = "1"}
        %w2 = wait(%ar)
        %rs2 = launch "reduce_scatter_tensor"(%x) {group = "0", role = fsdp_reduce_scatter}
        %w3 = wait(%rs2)
        %any = launch "all_reduce"(%x)
        %w4 = wait(%any)
        %ar2 = launch "all_reduce"(%x) {group = "1"}
        %w5 = wait(%ar2)
        %output = output(%w1, %wg, %w2, %w3, %w4, %w5)
    '''))
    out = print_program(p, effects=True)
    filecheck(out, '''
        CHECK:     // effect %rs1 -> %rs2 (collective-order)
        CHECK-NOT: %ag {{.*}}(collective-order)
    ''')
    # group 1 is its own stream; a collective of unknown group orders against every group
    assert sorted(e for e in p.effect_edges() if e[2] == "collective-order") == [
        ("any", "ar2", "collective-order"), ("ar", "any", "collective-order"), ("rs1", "rs2", "collective-order"),
        ("rs2", "any", "collective-order")]


def test_random_ops_keep_their_order():
    p = parse_program(dedent('''
        %x = input
        ^entry
        %r1 = compute "aten.rand_like.default"(%x) {random}
        %a = compute "aten.add.Tensor"(%x)
        %r2 = compute "aten.native_dropout.default"(%a) {random}
        %r3 = compute "aten.randn_like.default"(%x) {random}
        %output = output(%r1, %r2, %r3)
    '''))
    filecheck(print_program(p, effects=True), '''
        CHECK:      // effect %r1 -> %r2 (rng-order)
        CHECK-NEXT: // effect %r2 -> %r3 (rng-order)
        CHECK-NOT:  (rng-order)
    ''')
    verify(p)


def test_forward_and_backward_are_ordered_by_phase_edges():
    p = parse_program(dedent('''
        %x = input
        ^entry
        %a = compute "a"(%x)
        %b = compute "b"(%a)
        %c = compute "c"(%x)
        ^backward
        %d = compute "d"(%b)
        %e = compute "e"(%x)
        %output = output(%d, %e, %c)
    '''))
    out = print_program(p, effects=True)
    filecheck(out, '''
        CHECK:      // effect ^entry -> %a (entry)
        CHECK-NEXT: // effect ^entry -> %c (entry)
        CHECK-NEXT: // effect %b -> ^backward (phase)
        CHECK-NEXT: // effect %c -> ^backward (phase)
        CHECK-NEXT: // effect ^backward -> %d (phase)
        CHECK-NEXT: // effect ^backward -> %e (phase)
        CHECK-NOT:  (output)
    ''')
    assert not p.graph.has_edge("a", BACKWARD)  # %a reaches it through %b
    verify(p)


# ---- parse errors -----------------------------------------------------------------------------

@pytest.mark.parametrize("text, line, column, message", [
    ("%x = input\n%y = frobnicate(%x)\n", 2, 6, "unknown op kind 'frobnicate'"),
    ("%x = input\n^entry\n%y = marker\n", 3, 6, "unknown op kind 'marker'"),
    ("%x = input\n%y = compute(%x) {heavy, weight = 3}\n", 2, 26, "compute has no attribute 'weight'"),
    ("%x = input\n%y = compute(%x, %z)\n", 2, 18, "%z is not defined"),
    ("%x = input\n\n%y = compute(%x)\n%x = input\n", 4, 1, "%x is already defined on line 1"),
    ("%x = input\n%y = compute(%x) @\n", 2, 18, "unexpected character '@'"),
    ("%x = input\n%y = compute(%x) %x\n", 2, 18, "unexpected '%x' after the op"),
    ("%x = input\n%y = launch(%x) {role = fsdp_all_reduce}\n", 2, 25, "unknown role 'fsdp_all_reduce'"),
    ("%x = input\n%y = launch(%x) {params = \"w\"}\n", 2, 27, "attribute 'params' takes tuple[str, ...]"),
    ("%x = input\n%y = launch(%x) {nbytes = \"4\"}\n", 2, 27, "attribute 'nbytes' takes int | None"),
    ("%x = input\n%y = launch(%x) {nbytes}\n", 2, 18, "attribute 'nbytes' takes int | None, not true"),
    ("%x = input\n%y = compute(%x) {heavy = 1}\n", 2, 27, "attribute 'heavy' takes bool, not 1"),
    ("%x = input\n%y = compute(%x\n", 2, 16, "expected ',', found end of line"),
    ("%x = input\n%y = compute(%x) {heavy\n", 2, 24, "expected ',', found end of line"),
    ("%x = input\n^entry junk\n", 2, 8, "a marker stands alone on its line"),
    ("%x = input\neffect %x -> %nowhere\n", 2, 14, "%nowhere is not defined"),
    ("%x = input\neffect ^nowhere -> %x\n", 2, 8, "^nowhere is not defined"),
    ("%x = input\neffect %x %x\n", 2, 11, "expected arrow, found '%x'"),
    ("%x = input\neffect %x -> %x %x\n", 2, 17, "unexpected '%x' after the effect"),
    ("x = input\n", 1, 1, "expected ref, found 'x'"),
    ("%x = input : q7[3]\n", 1, 14, "unknown dtype 'q7'"),
    ("%x = input : f32[3,n]\n", 1, 20, "expected number, found 'n'"),
    ("%x = input : (f32[3], i8[2]\n", 1, 28, "expected ')', found end of line"),
    ("%x = input {types = 1}\n", 1, 13, "input has no attribute 'types'"),
])
def test_parse_errors_carry_line_and_column(text, line, column, message):
    with pytest.raises(ParseError) as info:
        parse_program(text)
    err = info.value
    assert (err.line, err.column) == (line, column), str(err)
    assert message in str(err)
    assert str(err).startswith(f"line {line}, column {column}: ")
    # the message quotes the line and points at the column
    source_line = text.splitlines()[line - 1]
    assert f"\n  {source_line}\n  {' ' * (column - 1)}^" in str(err)


def test_parse_error_is_a_value_error():
    with pytest.raises(ValueError):
        parse_program("%x = nothing\n")


# ---- property: any attribute values print and parse back -------------------------------------

dtypes = st.sampled_from(sorted(set(DTYPE_BYTES) - {"none"}))
tensor_types = st.one_of(st.just(TensorType("none")),
                         st.builds(TensorType, dtypes, st.lists(st.integers(-1, 2**40), max_size=4)))
names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.]{0,8}", fullmatch=True).filter(lambda n: n not in {"ag", "w", "c", "b", "output"})
texts = st.text(max_size=20)


@settings(max_examples=60, deadline=None)
@given(target=texts, group=st.none() | texts, role=st.none() | st.sampled_from(list(Role)),
       # IR text numbers are int64 (ir/text.py MAX_INT; larger ones are ParseErrors: test_bad_input.py)
       nbytes=st.none() | st.integers(-(2**63 - 1), 2**63 - 1), params=st.lists(texts, max_size=3),
       bucket=st.none() | texts, hold=st.none() | texts, reason=texts, heavy=st.booleans(),
       attention=st.booleans(), random=st.booleans(), prefetched=st.booleans(),
       phase=st.sampled_from(list(Phase)), param_name=names, group_size=st.none() | st.integers(1, 2**20),
       types=st.lists(tensor_types, max_size=3))
def test_any_attribute_values_round_trip(target, group, role, nbytes, params, bucket, hold, reason, heavy,
                                         attention, random, prefetched, phase, param_name, group_size, types):
    p = Program()
    p.add(Input(name=param_name, target=target, types=types))
    p.add(Launch(name="ag", operands=[param_name], target=target, group=group, group_size=group_size,
                 role=role, nbytes=nbytes, types=types,
                 params=params, bucket=bucket, hold=hold, anchor="c", prefetched=prefetched))
    p.add(Wait(name="w", operands=["ag"], target=target))
    p.add(Compute(name="c", operands=["w"], target=target, heavy=heavy, attention=attention,
                  random=random, phase=phase))
    p.add(Barrier(name="b", target=target, reason=reason, phase=phase))
    p.add(Output(name="output", operands=["c"]))
    p.schedule = Schedule([param_name, "ag", "w", "c", "b", "output"])
    derive_effects(p)
    text = print_program(p)
    q = parse_program(text)
    assert [q.op(n) for n in q.schedule] == [p.op(n) for n in p.schedule]
    assert print_program(q) == text
