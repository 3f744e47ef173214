"""The verifier: one negative test per rule (each message names the node and the rule), and a positive one."""

from __future__ import annotations

import textwrap

import attrs
import pytest

from fxsched.ir import (BACKWARD, DATA, EFFECT, ENTRY, Phase, Schedule, VerifyError, Wait, verify_moves,
                        parse_program, verify)

VALID = textwrap.dedent('''
    %x = input "x"
    %w = input "w"
    ^entry
    %ag = launch "all_gather_into_tensor"(%w) {group = "0", role = fsdp_all_gather, nbytes = 64, params = ["w"]}
    %wt = wait "wait_tensor"(%ag)
    %sl = view "aten.slice.Tensor"(%wt)
    %v = view "aten.view.default"(%sl)
    %mm = compute "aten.mm.default"(%x, %v) {heavy}
    %relu = compute "aten.relu.default"(%mm)
    %f = free "free"(%wt) {params = ["w"]}
    %cp = barrier "aten.copy_.default"(%x, %relu) {reason = "mutation"}
    %out1 = compute "aten.neg.default"(%relu)
    ^backward
    %rag = launch "all_gather_into_tensor"(%w) {group = "0", role = fsdp_all_gather_backward, nbytes = 64, params = ["w"]}
    %rwt = wait "wait_tensor"(%rag)
    %g = compute "aten.mm.default"(%out1, %rwt) {heavy}
    %rs = launch "reduce_scatter_tensor"(%g) {group = "0", role = fsdp_reduce_scatter}
    %rsw = wait "wait_tensor"(%rs)
    %ar = launch "all_reduce"(%rsw) {group = "0"}
    %arw = wait "wait_tensor"(%ar)
    %output = output(%out1, %arw)
''').lstrip()


def valid():
    program = parse_program(VALID)
    verify(program)
    return program


def problems(program) -> list[str]:
    with pytest.raises(VerifyError) as info:
        verify(program)
    assert str(info.value).startswith("invalid program:\n  ")
    return info.value.problems


def reorder(program, name: str, *, before: str) -> None:
    """Move `name` to just before `before` without any legality check."""
    order = [n for n in program.schedule if n != name]
    order.insert(order.index(before), name)
    program.schedule = Schedule(order)


def test_valid_program_verifies():
    program = valid()
    # every rule left an edge in this program
    whys = {why for _, _, why in program.effect_edges()}
    assert whys >= {"entry", "free", "regather", "barrier", "phase", "collective-order"}
    assert program.schedule.names()[:3] == ["x", "w", ENTRY]


def test_valid_program_verifies_after_a_legal_move():
    program = valid()
    reorder(program, "f", before="relu")  # %relu reads %mm, not the gathered storage
    verify(program)
    reorder(program, "out1", before="cp")  # but nothing crosses the barrier
    assert problems(program) == ["%out1: scheduled before %cp, which it must follow by an effect edge (barrier)"]


def test_cycle():
    program = valid()
    program.graph.add_edge("relu", "mm", kind=EFFECT, why="test")
    (message,) = problems(program)
    assert message.startswith("cycle: ")
    assert "%mm -> %relu -> %mm" in message or "%relu -> %mm -> %relu" in message


def test_schedule_missing_a_node():
    program = valid()
    program.schedule = Schedule([n for n in program.schedule if n != "relu"])
    (message,) = problems(program)
    assert "schedule is not a permutation of the nodes" in message
    assert "missing ['relu']" in message


def test_schedule_repeating_a_node():
    program = valid()
    order = program.schedule.names()
    order.insert(order.index("g"), "mm")
    program.schedule = Schedule(order)
    (message,) = problems(program)
    assert "schedule is not a permutation of the nodes" in message
    assert "repeated ['mm']" in message and "missing []" in message


def test_schedule_naming_an_unknown_node():
    program = valid()
    program.schedule = Schedule([*program.schedule.names()[:-1], "ghost", "output"])
    (message,) = problems(program)
    assert "schedule is not a permutation of the nodes" in message and "unknown ['ghost']" in message


def test_schedule_breaking_a_data_edge():
    program = valid()
    reorder(program, "relu", before="mm")
    (message,) = problems(program)
    assert message == "%relu: scheduled before %mm, which it must follow by a data edge"


def test_schedule_breaking_an_effect_edge():
    program = valid()
    reorder(program, "cp", before="relu")  # barrier before the data it reads: a data edge and a barrier edge
    found = problems(program)
    assert "%cp: scheduled before %relu, which it must follow by a data edge" in found
    program = valid()
    reorder(program, "f", before="mm")  # the free overtakes a reader of the storage through views
    found = problems(program)
    assert "%f: scheduled before %mm, which it must follow by an effect edge (free)" in found


def test_schedule_breaking_the_collective_order():
    program = parse_program(textwrap.dedent('''
        %x = input
        ^entry
        %rs1 = launch "reduce_scatter_tensor"(%x) {role = fsdp_reduce_scatter}
        %w1 = wait(%rs1)
        %rs2 = launch "reduce_scatter_tensor"(%x) {role = fsdp_reduce_scatter}
        %w2 = wait(%rs2)
        %output = output(%w1, %w2)
    ''').lstrip())
    verify(program)
    reorder(program, "rs2", before="rs1")
    (message,) = problems(program)
    assert message == "%rs2: scheduled before %rs1, which it must follow by an effect edge (collective-order)"


def test_schedule_breaking_a_regather_edge():
    program = valid()
    program.graph.remove_edge(BACKWARD, "rag")  # leave only the regather edge to stop it
    reorder(program, "rag", before="f")
    program.graph.nodes["rag"]["op"] = attrs.evolve(program.op("rag"), phase=Phase.FORWARD)
    found = problems(program)
    assert "%rag: scheduled before %f, which it must follow by an effect edge (regather)" in found


def test_wait_on_something_that_is_not_a_launch():
    program = parse_program(VALID.replace('%rsw = wait "wait_tensor"(%rs)', '%rsw = wait "wait_tensor"(%g)')
                            .replace("%ar = launch \"all_reduce\"(%rsw)", "%ar = launch \"all_reduce\"(%rsw, %rs)"))
    found = problems(program)
    assert "%rsw: a wait must have exactly one operand, a launch; has ['g']" in found
    assert "%rs: a launch must have exactly one wait; has 0" in found


def test_wait_with_two_operands():
    program = parse_program(VALID.replace('%rsw = wait "wait_tensor"(%rs)', '%rsw = wait "wait_tensor"(%rs, %g)'))
    (message,) = problems(program)
    assert message == "%rsw: a wait must have exactly one operand, a launch; has ['rs', 'g']"


def test_wait_with_no_operand():
    program = parse_program(VALID.replace('%rsw = wait "wait_tensor"(%rs)', '%rsw = wait "wait_tensor"()')
                            .replace("%ar = launch \"all_reduce\"(%rsw)", "%ar = launch \"all_reduce\"(%rsw, %rs)"))
    found = problems(program)
    assert "%rsw: a wait must have exactly one operand, a launch; has []" in found


def test_launch_without_a_wait():
    program = valid()
    # cut the wait from its launch (graph mutation): the launch is left with no wait
    program.graph.remove_edge("rs", "rsw")
    program.graph.nodes["rsw"]["op"] = Wait(name="rsw", operands=("g",), target="wait_tensor",
                                           phase=Phase.BACKWARD)
    program.graph.add_edge("g", "rsw", kind=DATA)
    found = problems(program)
    assert "%rs: a launch must have exactly one wait; has 0" in found
    assert "%rsw: a wait must have exactly one operand, a launch; has ['g']" in found


def test_launch_with_two_waits():
    text = VALID.replace('%rsw = wait "wait_tensor"(%rs)\n',
                         '%rsw = wait "wait_tensor"(%rs)\n%rsw2 = wait "wait_tensor"(%rs)\n')
    program = parse_program(text.replace("%ar = launch \"all_reduce\"(%rsw)", "%ar = launch \"all_reduce\"(%rsw, %rsw2)"))
    (message,) = problems(program)
    assert message == "%rs: a launch must have exactly one wait; has 2"


def test_an_effect_edge_from_a_launch_to_another_wait_is_not_a_second_wait():
    program = parse_program(VALID + "effect %rag -> %rsw\n")
    assert ("rag", "rsw", "explicit") in program.effect_edges()
    verify(program)


def test_reader_of_freed_storage_scheduled_after_the_free():
    program = valid()
    # drop the free's ordering edges so that only the storage rule can catch the reader
    assert {(u, why) for u, v, why in program.effect_edges() if v == "f"} == {
        ("mm", "free"), ("sl", "free"), ("v", "free")}
    for reader in ("mm", "sl", "v"):
        program.graph.remove_edge(reader, "f")
    program.graph.add_edge("f", "cp", kind=EFFECT, why="barrier")  # f still precedes the barrier
    reorder(program, "f", before="mm")
    (message,) = problems(program)
    assert message == "%mm: reads storage freed by %f but is scheduled after it"


def test_reader_through_a_chain_of_views_scheduled_after_the_free():
    program = valid()
    for u, v, e in list(program.graph.in_edges("f", data=True)):
        if e["kind"] == EFFECT:
            program.graph.remove_edge(u, v)
    reorder(program, "f", before="sl")
    found = problems(program)
    assert sorted(found) == sorted(f"%{r}: reads storage freed by %f but is scheduled after it"
                                   for r in ("sl", "v", "mm"))


def test_phases_out_of_order():
    program = valid()
    # a backward op early in the schedule: the forward ops after it are out of order
    program.graph.nodes["relu"]["op"] = attrs.evolve(program.op("relu"), phase=Phase.BACKWARD)
    found = problems(program)
    assert found[0] == "%f: forward op scheduled after backward op %relu (phases out of order)"
    assert "%out1: forward op scheduled after backward op %relu (phases out of order)" in found


def test_phases_out_of_order_after_a_move():
    program = valid()
    reorder(program, "g", before="out1")
    found = problems(program)
    assert "%out1: forward op scheduled after backward op %g (phases out of order)" in found
    assert any(m.startswith("%out1: scheduled before") or m.startswith("%g: scheduled before") for m in found)


def test_structure_errors_come_before_schedule_errors():
    program = valid()
    program.graph.add_edge("relu", "mm", kind=EFFECT, why="test")
    program.schedule = Schedule(program.schedule.names()[1:])
    (message,) = problems(program)
    assert message.startswith("cycle: ")


def test_data_edges_must_match_operands():
    program = valid()
    program.graph.add_edge("x", "relu", kind=DATA)
    (message,) = problems(program)
    assert message == "%relu: data edges ['mm', 'x'] differ from operands ['mm']"


def test_data_edges_are_read_by_name_when_the_tables_are_in_another_order():
    # the structure check reads the predecessor table beside the node table when networkx
    # filled both in the same order; in any other order it looks each node up by name
    program = valid()
    program.graph._pred = dict(reversed(program.graph._pred.items()))
    verify(program)
    program.graph._pred["relu"]["x"] = program.graph._succ["x"]["relu"] = {"kind": DATA}
    (message,) = problems(program)
    assert message == "%relu: data edges ['mm', 'x'] differ from operands ['mm']"


def test_many_problems_are_listed_with_a_count():
    program = valid()
    program.schedule = Schedule(reversed(program.schedule.names()))
    with pytest.raises(VerifyError) as info:
        verify(program)
    assert len(info.value.problems) > 10
    assert f"... and {len(info.value.problems) - 10} more" in str(info.value)


def test_the_edges_alone_check_order_and_permutation_not_the_rules():
    # rules=False: the schedule against the edges only (what the pass manager runs last on
    # lowering's program, whose edges carry the free and phase rules)
    program = valid()
    verify(program, structure=False, rules=False)
    reorder(program, "relu", before="mm")
    with pytest.raises(VerifyError) as info:
        verify(program, structure=False, rules=False)
    assert info.value.problems == ["%relu: scheduled before %mm, which it must follow by a data edge"]
    program = valid()
    program.schedule = Schedule([n for n in program.schedule if n != "relu"])
    with pytest.raises(VerifyError, match="missing \\['relu'\\]"):
        verify(program, structure=False, rules=False)
    program = valid()
    program.schedule = Schedule([*program.schedule.names()[:-1], "ghost", "output"])
    with pytest.raises(VerifyError, match="unknown \\['ghost'\\]"):
        verify(program, structure=False, rules=False)
    # a reader after the free with the free's edges gone: only the rules see it
    program = valid()
    for reader in ("mm", "sl", "v"):
        program.graph.remove_edge(reader, "f")
    program.graph.add_edge("f", "cp", kind=EFFECT, why="barrier")
    reorder(program, "f", before="mm")
    verify(program, structure=False, rules=False)
    with pytest.raises(VerifyError, match="reads storage freed by %f"):
        verify(program, structure=False)


def test_verify_moves_checks_the_edges_at_what_moved():
    """Both ways verify_moves checks: a position lookup per moved node and neighbour (few moved),
    and one walk down the order (a sixth of the nodes or more moved); each names the broken edges."""
    program = valid()
    schedule = program.schedule
    assert len(program.graph) < 6 * 4  # four moved names take the walk
    schedule.move_before(["sl", "v", "mm", "relu"], "f")  # moved in place: every edge still forward
    moved = schedule.take_moved()
    verify_moves(program, moved)
    # few moved (positions), then many (the walk): each breaks the edge into %sl, and reports it alone
    for names in (["sl"], ["sl", "v", "mm", "relu", "out1"]):
        program = valid()
        program.schedule.move_before(names, "ag")
        moved = program.schedule.take_moved()
        with pytest.raises(VerifyError) as info:
            verify_moves(program, moved)
        assert "%sl: scheduled before %wt, which it must follow by a data edge" in info.value.problems
    # a moved successor that now comes first breaks the edge from an unmoved node it reads
    program = valid()
    program.schedule.move_before(["out1", "g", "relu", "cp", "f"], "x")
    with pytest.raises(VerifyError) as info:
        verify_moves(program, program.schedule.take_moved())
    assert "%relu: scheduled before %mm, which it must follow by a data edge" in info.value.problems



P2P = textwrap.dedent('''
    %x = input
    %buf = input
    ^entry
    %send = launch "_c10d_functional.isend.default"(%x) {group = "cp"}
    FIRST
    SECOND
    %output = output(%ws, %wr)
''').lstrip()
SEND_WAIT = "%ws = wait(%send)"
RECV = '%recv = launch "_c10d_functional.irecv.default"(%buf) {group = "cp"}\n%wr = wait(%recv)'


def test_schedule_breaking_the_p2p_order():
    """`isend; irecv; wait(isend)`: the send's wait follows the receive traced before it (the
    peer, running the same schedule, may need it first): checked through that edge."""
    program = parse_program(P2P.replace("FIRST", RECV).replace("SECOND", SEND_WAIT))
    verify(program)
    assert program.graph.edges["recv", "ws"]["why"] == "p2p-order"
    reorder(program, "ws", before="recv")
    (message,) = problems(program)
    assert message == "%ws: scheduled before %recv, which it must follow by an effect edge (p2p-order)"


def test_a_wait_moved_below_a_send_traced_after_it_verifies():
    """`isend; wait; irecv`: no edge orders the send's wait and the later receive, so a pass may
    schedule the wait below it. `p2p-order` read off that schedule would ask for an edge the rule
    never made (the wait follows the receive): verify derives it from no schedule, as it does
    `collective-order`, and accepts the legal program (ir/verify.py's docstring)."""
    program = parse_program(P2P.replace("FIRST", SEND_WAIT).replace("SECOND", RECV))
    verify(program)
    assert not any(e.get("why") == "p2p-order" for *_, e in program.graph.edges(data=True))
    reorder(program, "ws", before="wr")  # isend; irecv; wait(isend); wait(irecv)
    verify(program)
