"""Bad input: one test per row of docs/bad-input.md.

Each bad input gives a clear error that names the place (the FX node, the pipeline option, the
line and column of IR text, the config field), or a recorded conservative choice (a note in
`program.notes` and a hold reason on the gather, which stays where it is) — never a crash deep
inside or a wrong schedule.
"""

from __future__ import annotations

import math
import re
import textwrap
from types import SimpleNamespace

import pytest
import torch
from torch import fx

import fxsched
from fxsched.ir import ParseError, VerifyError, parse_program, verify
from fxsched.ir.errors import ConfigError, CostModelError
from fxsched.lowering import lower
from fxsched.lowering.fx import LoweringError
from fxsched.passes import DEFAULT_PIPELINE, PassContext, PassFailure, PassManager, PipelineError, parse_pipeline

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

REFERENCE = "anchor,budget,prefetch,sink"


@fx.node.has_side_effect
def release(tensor):
    """Stands for FSDP's reshard free (never run here)."""


class Graph:
    """A tagged joint graph by hand: x, shards s0.., then `h = mm(h, view(wait(gather(s_i))))`."""

    def __init__(self, shards: int = 4):
        self.g = fx.Graph()
        self.x = self.g.placeholder("x")
        self.shards = [self.g.placeholder(f"s{i}") for i in range(shards)]
        self.h = self.call(aten.mm.default, self.x, self.x)

    def call(self, target, *args, **meta):
        node = self.g.call_function(target, args)
        node.meta.update(meta)
        return node

    def gather(self, i: int, **meta):
        meta = {"comm_type": "fsdp_all_gather", "param_name": f"p{i}", "fsdp_unsharded_nbytes": 64, **meta}
        return self.call(c10d.all_gather_into_tensor.default, self.shards[i], 2, "0", **meta)

    def use(self, value, **meta):
        self.h = self.call(aten.mm.default, self.h, self.call(aten.view.default, value, [4, 4]), **meta)
        return self.h

    def layer(self, i: int, **meta):
        """Gather parameter i, wait, view, use it."""
        launch = self.gather(i, **meta)
        self.use(self.call(c10d.wait_tensor.default, launch))
        return launch

    def done(self) -> fx.GraphModule:
        self.g.output(self.h)
        return fx.GraphModule(torch.nn.Module(), self.g)


def plain(**meta_of_gather_2) -> fx.GraphModule:
    """Four layers; gather 2 gets extra meta. With the reference pipeline gathers 1-3 move."""
    b = Graph()
    for i in range(4):
        b.layer(i, **(meta_of_gather_2 if i == 2 else {}))
    return b.done()


def order(gm: fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes]


def row(done, launch: str) -> dict:
    return next(r for r in done.report["gathers"] if r["launch"] == launch)


def moved(done) -> set[str]:
    return {r["launch"] for r in done.report["gathers"] if r["moved"]}


def test_the_well_formed_baseline_moves_gathers_1_to_3():
    done = fxsched.schedule(plain(), REFERENCE)
    assert moved(done) == {"all_gather_into_tensor_default_1", "all_gather_into_tensor_default_2",
                           "all_gather_into_tensor_default_3"}
    assert done.program.notes == []


# ---- gathers and their waits -----------------------------------------------------------------

def test_gather_without_a_wait_names_the_node():
    b = Graph()
    b.layer(0)
    b.use(b.gather(1))  # the view reads the launch itself
    with pytest.raises(LoweringError, match=r"FSDP gather %all_gather_into_tensor_default_1 \(fsdp_all_gather\) "
                                            r"must have exactly one user, a wait_tensor; it has \['view_default_1'\]"):
        fxsched.schedule(b.done(), REFERENCE)


def test_gather_with_no_user_at_all_names_the_node():
    b = Graph()
    b.layer(0)
    b.gather(1)
    with pytest.raises(LoweringError, match=r"%all_gather_into_tensor_default_1 .* it has \[\]"):
        lower(b.done())


def test_gather_with_two_waits_names_the_node_and_its_users():
    b = Graph()
    launch = b.layer(0)
    b.use(b.call(c10d.wait_tensor.default, launch))
    with pytest.raises(LoweringError, match=r"%all_gather_into_tensor_default \(fsdp_all_gather\) must have exactly "
                                            r"one user, a wait_tensor; it has \['wait_tensor_default', "
                                            r"'wait_tensor_default_1'\]"):
        fxsched.schedule(b.done(), REFERENCE)


def test_ir_launch_without_a_wait_or_with_two_fails_verification():
    one = "%s = input\n%g = launch \"ag\"(%s) {role = fsdp_all_gather, params = [\"p\"]}\n%output = output(%g)\n"
    with pytest.raises(VerifyError, match="%g: a launch must have exactly one wait; has 0"):
        verify(parse_program(one))
    two = ("%s = input\n%g = launch \"ag\"(%s) {role = fsdp_all_gather, params = [\"p\"]}\n"
           "%w1 = wait(%g)\n%w2 = wait(%g)\n%output = output(%w1, %w2)\n")
    with pytest.raises(VerifyError, match="%g: a launch must have exactly one wait; has 2"):
        PassManager(REFERENCE).run(parse_program(two))


# ---- sizes ---------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [True, False, -64, 64.0, "64", None], ids=["true", "false", "negative", "float",
                                                                           "str", "none"])
def test_unusable_size_is_unknown_and_the_gather_stays(value):
    gm = plain(fsdp_unsharded_nbytes=value)
    done = fxsched.schedule(gm, REFERENCE)
    launch = "all_gather_into_tensor_default_2"
    assert f"%{launch}: fsdp_unsharded_nbytes={value!r} is not a non-negative int: size unknown" in done.program.notes
    assert row(done, launch)["nbytes"] is None
    assert row(done, launch)["reason"] == "unknown size" and not row(done, launch)["moved"]
    assert moved(done) == {"all_gather_into_tensor_default_1", "all_gather_into_tensor_default_3"}


def test_a_missing_size_is_unknown_too():
    b = Graph()
    for i in range(4):
        launch = b.layer(i)
    del launch.meta["fsdp_unsharded_nbytes"]
    done = fxsched.schedule(b.done(), REFERENCE)
    assert row(done, launch.name)["reason"] == "unknown size"


def test_negative_size_in_ir_text_fails_verification():
    """Lowering turns a bad size into "unknown"; hand-written IR must say so by leaving it out. A
    negative size would let the budget admit more than it holds."""
    text = ("%s = input\n%g = launch \"ag\"(%s) {role = fsdp_all_gather, nbytes = -8192, params = [\"p\"]}\n"
            "%w = wait(%g)\n%output = output(%w)\n")
    with pytest.raises(VerifyError, match=r"%g: nbytes must be a non-negative int, or absent when unknown; has -8192"):
        PassManager(REFERENCE).run(parse_program(text))


def test_a_float_size_in_ir_text_is_a_parse_error():
    text = "%s = input\n%g = launch \"ag\"(%s) {nbytes = 1.5}\n"
    with pytest.raises(ParseError, match=r"line 2, column 33: unexpected character '\.'"):
        parse_program(text)


# ---- buckets and names -----------------------------------------------------------------------

@pytest.mark.parametrize("members", [None, (), ["p2", 7]], ids=["missing", "empty", "not-names"])
def test_bucket_without_members_stays_with_a_reason(members):
    meta = {"fsdp_bucket_id": "b2"}
    if members is not None:
        meta["fsdp_bucket_members"] = members
    done = fxsched.schedule(plain(**meta), REFERENCE)
    launch = "all_gather_into_tensor_default_2"
    assert (f"%{launch}: bucket 'b2' has no valid fsdp_bucket_members ({members!r}): not moved"
            in done.program.notes)
    assert row(done, launch)["reason"] == "bucket without members" and not row(done, launch)["moved"]
    assert {"all_gather_into_tensor_default_1", "all_gather_into_tensor_default_3"} <= moved(done)


@pytest.mark.parametrize("name", [None, "", 7], ids=["missing", "empty", "int"])
def test_gather_without_a_parameter_name_stays_with_a_reason(name):
    done = fxsched.schedule(plain(param_name=name), REFERENCE)
    launch = "all_gather_into_tensor_default_2"
    assert f"%{launch}: param_name={name!r} is not a name: not moved" in done.program.notes
    assert row(done, launch)["reason"] == "no parameter name" and not row(done, launch)["moved"]


def test_free_without_a_parameter_name_is_a_barrier():
    """Without a name, nobody knows which re-gather must follow it: nothing crosses it."""
    b = Graph()
    b.layer(0)
    b.layer(1)
    free = b.call(release, b.h, comm_type="fsdp_reshard_free")  # no param_name
    b.layer(2)
    b.layer(3)
    gm = b.done()
    done = fxsched.schedule(gm, REFERENCE)
    assert f"%{free.name}: storage free without param_name (None): kept as a barrier" in done.program.notes
    new = order(done.graph_module)
    assert new.index("all_gather_into_tensor_default_2") > new.index(free.name)
    assert row(done, "all_gather_into_tensor_default_2")["reason"] == "no earlier legal slot"
    assert "all_gather_into_tensor_default_1" in moved(done)  # before the barrier, still moved


@pytest.mark.parametrize("pipeline", [REFERENCE, DEFAULT_PIPELINE, "anchor{forward-depth=3},prefetch,sink"],
                         ids=["reference", "default", "no-budget"])
@pytest.mark.parametrize("meta,reasons", [
    ({"fsdp_unsharded_nbytes": True}, {"unknown size", None}),
    ({"fsdp_bucket_id": "b2"}, {"bucket without members"}),
    ({"param_name": None}, {"no parameter name"}),
], ids=["size", "bucket", "name"])
def test_conservative_choices_hold_in_every_pipeline(pipeline, meta, reasons):
    """A malformed gather stays where it was traced whatever the pipeline (without a budget
    pass an unknown size does not hold a gather back: there is nothing to exceed)."""
    gm = plain(**meta)
    done = fxsched.schedule(gm, pipeline)
    launch = "all_gather_into_tensor_default_2"
    reason = row(done, launch)["reason"]
    if "budget" not in pipeline and reason is None:
        assert meta == {"fsdp_unsharded_nbytes": True}
        return
    assert reason in reasons - {None} and not row(done, launch)["moved"]
    before, after = order(gm), order(done.graph_module)
    previous = before[before.index(launch) - 1]
    assert after.index(launch) > after.index(previous)  # nothing that ran before it now runs after it


# ---- depths and budgets --------------------------------------------------------------------

@pytest.mark.parametrize("field", ["fsdp_forward_prefetch_depth", "fsdp_backward_prefetch_depth"])
@pytest.mark.parametrize("value", [-1, True, "2", 1.0, None])
def test_bad_depth_in_the_config_names_the_field_and_leaves_the_graph(field, value):
    gm = plain()
    before = order(gm)
    config = fxsched.PassConfig(**{field: value})
    with pytest.raises(ValueError, match=rf"config: {field} must be a non-negative integer, got {value!r}"):
        fxsched.overlap_param_gather(gm, config)
    assert order(gm) == before and "fsdp_prefetch" not in gm.meta


@pytest.mark.parametrize("text,message", [
    ("anchor{forward-depth=-1}", "anchor: forward-depth must be a non-negative integer, got -1"),
    ("anchor{backward-depth=true}", "pass 'anchor': option 'backward-depth' wants an int, got 'true'"),
    ('anchor{forward-depth="2"}', "pass 'anchor': option 'forward-depth' wants an int, got '\"2\"'"),
    ("anchor{forward-depth=2.0}", "pass 'anchor': option 'forward-depth' wants an int, got '2.0'"),
    ("anchor{forward-depth=}", "pass 'anchor': option 'forward-depth' wants an int, got ''"),
])
def test_bad_depth_in_pipeline_text_names_pass_and_option(text, message):
    with pytest.raises(PipelineError) as info:
        parse_pipeline(text)
    assert str(info.value) == message
    with pytest.raises(PipelineError):
        fxsched.schedule(plain(), text)


def test_bad_depth_given_to_the_pass_class():
    from fxsched.passes.anchor import Anchor

    with pytest.raises(ValueError, match="anchor: forward-depth must be a non-negative integer, got True"):
        Anchor(forward_depth=True)


@pytest.mark.parametrize("value", [math.nan, -1.0, math.inf, True, "1"])
def test_bad_budget_in_the_config_names_the_field(value):
    gm = plain()
    with pytest.raises(ValueError, match=rf"config: max_in_flight_gb must be a finite non-negative number of GiB, "
                                         rf"got {value!r}"):
        fxsched.overlap_param_gather(gm, fxsched.PassConfig(max_in_flight_gb=value))
    assert "fsdp_prefetch" not in gm.meta


@pytest.mark.parametrize("raw,shown", [("nan", "nan"), ("-1", "-1.0"), ("-0.5", "-0.5"), ("inf", "inf")])
def test_bad_budget_in_pipeline_text(raw, shown):
    with pytest.raises(PipelineError, match=rf"^budget: max-in-flight-gb must be a finite non-negative number of "
                                            rf"GiB, got {shown}$"):
        parse_pipeline(f"anchor,budget{{max-in-flight-gb={raw}}},prefetch,sink")


def test_budget_zero_is_valid_and_moves_nothing():
    done = fxsched.schedule(plain(), "anchor,budget{max-in-flight-gb=0},prefetch,sink")
    assert moved(done) == set()
    assert {r["reason"] for r in done.report["gathers"]} == {"first group", "over budget"}


def test_config_without_the_fields_names_them():
    with pytest.raises(ValueError, match="config SimpleNamespace lacks fsdp_allgather_prefetch, max_in_flight_gb"):
        fxsched.overlap_param_gather(plain(), SimpleNamespace())
    with pytest.raises(ValueError, match="fsdp_allgather_prefetch must be a bool, got 1"):
        fxsched.overlap_param_gather(plain(), fxsched.PassConfig(fsdp_allgather_prefetch=1))


# ---- pipelines -----------------------------------------------------------------------------

@pytest.mark.parametrize("text,message", [
    ("anchr,sink", "unknown pass 'anchr'; passes: "),
    ("anchor{depth=2}", "pass 'anchor' has no option 'depth'; options: forward-depth (default 1), "),
    ("anchor{forward-depth=1,forward-depth=2}", "pass 'anchor': option 'forward-depth' is given twice"),
    ("anchor{attention=yes}", "pass 'anchor': option 'attention' wants a bool, got 'yes'"),
    ("anchor,,sink", "cannot parse pipeline at column 8: ',sink'"),
    ("anchor,", "pipeline ends with a comma"),
    ("anchor{forward-depth=2", "cannot parse pipeline at column 1: 'anchor{forward-depth=2'"),
    ("anchor sink", "cannot parse pipeline at column 1: 'anchor sink'"),
])
def test_bad_pipeline_text_says_what_and_where(text, message):
    with pytest.raises(PipelineError) as info:
        fxsched.schedule(plain(), text)
    assert str(info.value).startswith(message)


def test_an_empty_pipeline_runs_nothing():
    gm = plain()
    done = fxsched.schedule(gm, "")
    assert order(done.graph_module) == order(gm) and done.pipeline == ""


# ---- IR text ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text,where,message", [
    ("%x = input\n%a = frob(%x)\n", (2, 6), "unknown op kind 'frob'"),
    ("%x = input\n%a = compute(%y)\n", (2, 14), "%y is not defined"),
    ("%x = input\n%x = input\n", (2, 1), "%x is already defined on line 1"),
    ("%x = input\n%a = compute(%x\n", (2, 16), "expected ',', found end of line"),
    ('%x = input\n%a = launch(%x) {nbytes = "big"}\n', (2, 27), "launch attribute 'nbytes' takes int | None"),
    ("%x = input\n%a = launch(%x) {role = gather}\n", (2, 25), "unknown role 'gather'"),
    ("%x = input\n%a = launch(%x) {bogus = 1}\n", (2, 18), "launch has no attribute 'bogus'"),
    ("%x = input\n%a = compute(%x) : f33[2]\n", (2, 20), "unknown dtype 'f33'"),
    ("%x = input\n%a = compute(%x) $\n", (2, 18), "unexpected character '$'"),
    ("hello\n", (1, 1), "expected ref, found 'hello'"),
    ("%x = input\n^backward %x\n", (2, 11), "a marker stands alone on its line"),
    ("%x = input\neffect %x -> %nope\n", (2, 14), "%nope is not defined"),
    # found by scripts/fuzz.py --examples 10000 (a KeyError in the effects before)
    ("%x = input\n%a = compute(%x) {writes = [%nope], alias = %x}\n", (2, 29), "%nope is not defined"),
    ("%x = input\n%a = compute(%x) {writes = [%x], alias = %nope}\n", (2, 42), "%nope is not defined"),
])
def test_malformed_ir_text_names_line_and_column(text, where, message):
    with pytest.raises(ParseError) as info:
        parse_program(text)
    assert (info.value.line, info.value.column) == where
    assert str(info.value).startswith(f"line {where[0]}, column {where[1]}: {message}")


CYCLE = textwrap.dedent("""\
    %x = input
    %a = compute "aten.neg"(%b)
    %b = compute "aten.neg"(%a)
    %output = output(%b)
""")


def test_a_cycle_through_forward_references_is_named_by_verify():
    program = parse_program(CYCLE)  # operands may refer forward: the cycle is verify's to find
    with pytest.raises(VerifyError) as info:
        verify(program)
    assert info.value.problems == ["cycle: %a -> %b -> %a"]


def test_a_cycle_stops_the_pipeline_before_any_pass_runs():
    with pytest.raises(VerifyError, match=r"cycle: %a -> %b -> %a") as info:
        PassManager(REFERENCE).run(parse_program(CYCLE))
    assert "pass" not in str(info.value)  # not blamed on a pass


def test_a_cycle_through_an_effect_line():
    text = "%x = input\n%a = compute(%x)\n%b = compute(%a)\n%output = output(%b)\neffect %b -> %a\n"
    with pytest.raises(VerifyError, match=r"^invalid program:\n  cycle: %a -> %b -> %a$"):
        verify(parse_program(text))


def test_a_forward_reference_without_a_cycle_is_a_schedule_error():
    text = "%x = input\n%a = compute(%b)\n%b = compute(%x)\n%output = output(%a)\n"
    with pytest.raises(VerifyError, match="%a: scheduled before %b, which it must follow by a data edge"):
        PassManager(REFERENCE).run(parse_program(text))


# ---- tags that are not what they seem --------------------------------------------------------

def test_an_untagged_graph_passes_through_unchanged():
    b = Graph()
    for i in range(3):
        b.layer(i, comm_type=None, param_name=None, fsdp_unsharded_nbytes=None)
    gm = b.done()
    done = fxsched.schedule(gm, REFERENCE)
    assert order(done.graph_module) == order(gm) and done.report["gathers"] == []


def test_a_gather_tag_on_another_collective_keeps_it_in_order():
    b = Graph()
    b.layer(0)
    rs = b.call(c10d.reduce_scatter_tensor.default, b.h, "sum", 2, "0", comm_type="fsdp_all_gather")
    b.use(b.call(c10d.wait_tensor.default, rs))
    done = fxsched.schedule(b.done(), REFERENCE)
    assert any(n.startswith(f"%{rs.name}: comm_type='fsdp_all_gather' on ") and "not a gather, kept in order" in n
               for n in done.program.notes)


def test_a_gather_tag_on_a_non_collective_is_ignored():
    b = Graph()
    b.layer(0)
    b.use(b.call(aten.neg.default, b.h, comm_type="fsdp_all_gather"))
    done = fxsched.schedule(b.done(), REFERENCE)
    assert any("not a collective: ignored" in n for n in done.program.notes)


def test_a_collective_not_waited_exactly_once_is_opaque():
    b = Graph()
    b.layer(0)
    ar = b.call(c10d.all_reduce.default, b.h, "sum", "0")
    w1 = b.call(c10d.wait_tensor.default, ar)
    w2 = b.call(c10d.wait_tensor.default, ar)
    b.use(w1)
    b.use(w2)
    b.layer(1)
    gm = b.done()
    done = fxsched.schedule(gm, REFERENCE)
    assert (f"%{ar.name}: _c10d_functional.all_reduce.default: collective not waited exactly once: kept in place, "
            "in order with group '0'") in done.program.notes
    assert any(n.startswith(f"%{w1.name}: wait on ['%{ar.name}'], not on a launch") for n in done.program.notes)
    # it and its waits keep their order; the rest of the graph is still scheduled: the next layer's
    # gather (another storage, a gather) launches ahead of it
    before, new = order(gm), order(done.graph_module)
    assert [n for n in new if n in (ar.name, w1.name, w2.name)] == [ar.name, w1.name, w2.name]
    assert new.index("all_gather_into_tensor_default_1") < new.index(ar.name) < before.index(
        "all_gather_into_tensor_default_1")


# ---- found by trying fxsched as outsiders would (issue 13) ------------------------------------

IR_GATHER = textwrap.dedent('''\
    %x = input
    %s = input
    %g = launch "ag"(%s) {role = fsdp_all_gather, nbytes = 64, params = ["p"]}
    %w = wait(%g)
    %m = compute "aten.mm"(%x, %w) {heavy}
    %output = output(%m)
''')


@pytest.mark.parametrize("edit,line,at,message", [
    (("nbytes = 64", "nbytes = " + "9" * 5000), 3, "9999", "number 99999.* is out of range"),
    (("nbytes = 64", "nbytes = 9223372036854775808"), 3, "9223372036854775808", "out of range"),
    (('%x = input', '%x = input : f32[' + "9" * 30 + ']'), 1, "999", "out of range"),
    (('"aten.mm"', r'"aten\qmm"'), 5, r"\q", r"bad string: Invalid \\escape"),
    (('"aten.mm"', '"aten\tmm"'), 5, "\t", "a raw control character"),
    (('"ag"', r'"ag\u12"'), 3, "u12", r"bad string: Invalid \\uXXXX escape"),
    (('params = ["p"]', "params = " + "[" * 40), 3, "[" * 24, "lists nest more than 16 deep"),
])
def test_numbers_strings_and_escapes_in_ir_text_are_parse_errors(edit, line, at, message):
    """The error points at the spot (`at` starts at its column) and shows a window of the line."""
    text = IR_GATHER.replace(*edit)
    with pytest.raises(ParseError, match=message) as info:
        parse_program(text)
    assert info.value.line == line
    assert text.splitlines()[line - 1][info.value.column - 1:].startswith(at)
    assert len(str(info.value).splitlines()[1]) < 120  # the line is shown around the spot, not whole


def test_a_tab_between_tokens_is_whitespace():
    program = parse_program(IR_GATHER.replace("%m = compute", "%m\t=\tcompute"))
    verify(program)


def test_use_after_free_in_ir_text_is_a_parse_error_on_the_reading_line():
    text = IR_GATHER.replace('%m = compute', '%f = free "release"(%w) {params = ["p"]}\n%m = compute')
    with pytest.raises(ParseError, match=r"%m reads storage that %f freed before it") as info:
        parse_program(text)
    assert info.value.line == 6


def test_an_anchor_that_names_no_node_fails_verification_before_any_pass():
    text = IR_GATHER.replace('params = ["p"]', 'params = ["p"], anchor = %nope')
    with pytest.raises(VerifyError, match=r"%g: anchor %nope is not a node of the program"):
        verify(parse_program(text))
    for pipeline in ("prefetch", "budget,prefetch", REFERENCE):  # not a KeyError inside prefetch
        with pytest.raises(VerifyError, match="anchor %nope"):
            PassManager(pipeline).run(parse_program(text))


@pytest.mark.parametrize("value", [1e300, 1e10, float(2**34)])
def test_a_budget_too_large_to_count_in_bytes_is_rejected(value):
    with pytest.raises(PipelineError, match=rf"budget: max-in-flight-gb must be at most .* GiB, got {re.escape(repr(value))}"):
        parse_pipeline(f"anchor,budget{{max-in-flight-gb={value!r}}},prefetch")
    with pytest.raises(ConfigError, match="config: max_in_flight_gb must be at most"):
        fxsched.overlap_param_gather(plain(), fxsched.PassConfig(max_in_flight_gb=value))
    done = fxsched.schedule(plain(), f"anchor,budget{{max-in-flight-gb={2.0**33!r}}},prefetch")  # the largest
    assert moved(done) == {"all_gather_into_tensor_default_1", "all_gather_into_tensor_default_2",
                           "all_gather_into_tensor_default_3"}


@pytest.mark.parametrize("where,meta,tag", [
    ("gather", {"barrier": True}, "barrier=True"),
    ("wait", {"barrier": True}, "barrier=True"),
    ("wait", {"comm_type": "fsdp_reshard_free"}, "comm_type='fsdp_reshard_free'"),
    ("gather", {"comm_type": "fsdp_reshard_free_backward"}, "comm_type='fsdp_reshard_free_backward'"),
])
def test_a_barrier_or_free_tag_on_a_collective_or_its_wait_names_node_and_tag(where, meta, tag):
    b = Graph()
    b.layer(0)
    launch = b.gather(1, **(meta if where == "gather" else {}))
    wait = b.call(c10d.wait_tensor.default, launch, **(meta if where == "wait" else {}))
    b.use(wait)
    node = launch if where == "gather" else wait
    kind = "launch" if where == "gather" else "wait"
    with pytest.raises(LoweringError, match=rf"%{node.name} \(.*\) is a collective {kind} tagged {re.escape(tag)}"):
        fxsched.schedule(b.done(), REFERENCE)


def test_an_unknown_comm_type_is_a_note_listing_the_known_ones():
    b = Graph()
    b.layer(0)
    launch = b.layer(1, comm_type="fsdp_all_gathr")
    done = fxsched.schedule(b.done(), REFERENCE)
    note = next(n for n in done.program.notes if n.startswith(f"%{launch.name}: unknown comm_type"))
    assert "'fsdp_all_gathr'" in note and "fsdp_all_gather, fsdp_all_gather_backward" in note
    assert launch.name not in {r["launch"] for r in done.report["gathers"]}  # a plain collective, said so


@pytest.mark.parametrize("answer,shown", [("fast", "ValueError"), (float("nan"), "gave nan ms"),
                                          (-1.0, "gave -1.0 ms"), (float("inf"), "gave inf ms")])
def test_a_cost_models_bad_answer_names_the_model_and_the_op_not_the_pass(answer, shown):
    def slow_mm(op):
        return answer if getattr(op, "target", "") == "aten.mm" else None

    with pytest.raises(CostModelError, match=rf"cost model Callback\(.*slow_mm\) .*%m \(compute 'aten.mm'\)") as info:
        PassManager(DEFAULT_PIPELINE).run(parse_program(IR_GATHER), PassContext(cost_model=slow_mm))
    assert shown in str(info.value) and not isinstance(info.value, PassFailure)


def test_a_budget_before_the_anchoring_pass_is_a_pipeline_error_naming_both():
    for text, first in (("budget{max-in-flight-gb=0.0},anchor,prefetch,sink", "anchor"),
                        ("budget{max-in-flight-gb=0.0},hide,prefetch,sink", "hide")):
        with pytest.raises(PipelineError, match=rf"pass '{first}' runs after 'budget' .* 'budget' must follow it"):
            parse_pipeline(text)
    # in the declared order a zero budget moves nothing, and the report says so
    done = fxsched.schedule(plain(), "anchor,budget{max-in-flight-gb=0.0},prefetch,sink")
    assert not moved(done) and {r["reason"] for r in done.report["gathers"][1:]} == {"over budget"}


def test_a_rerun_with_a_lower_budget_reports_the_gathers_it_left_not_moves():
    """A second run with a lower budget cannot move a launch back later: the gathers the first
    run moved stay early, and the report says so (`earlier`) instead of `moved=True` with the
    reason `over budget` (what it said before)."""
    once = fxsched.schedule(plain(), "anchor{forward-depth=2},budget,prefetch,sink")
    assert moved(once) == {f"all_gather_into_tensor_default_{i}" for i in (1, 2, 3)}
    for second in ("anchor{forward-depth=3},budget{max-in-flight-gb=0.0},prefetch,sink",
                   "hide,budget{max-in-flight-gb=0.0},prefetch,sink", "sink"):
        twice = fxsched.schedule(once.graph_module, second)
        assert moved(twice) == set(), second
        assert {r["launch"] for r in twice.report["gathers"] if r["earlier"]} >= moved(once), second
        assert fxsched.report.summary_line(twice.report).strip().startswith("4 gathers: 0 moved (none)")
    twice = fxsched.schedule(once.graph_module, "anchor{forward-depth=3},budget{max-in-flight-gb=0.0},prefetch,sink")
    last = row(twice, "all_gather_into_tensor_default_3")
    assert (last["moved"], last["earlier"], last["reason"]) == (False, True, "over budget")
    text = fxsched.explain_text(twice)
    assert "3 left where an earlier run moved them" in text
    assert ("%all_gather_into_tensor_default_3 (fwd" in text and "    stays where an earlier run moved it (no pass "
            "moves a launch later): this run: over budget: " in text)
@pytest.mark.parametrize("raw,shown", [("-1", "must be a finite non-negative number of GiB, got -1.0"),
                                       ("nan", "must be a finite non-negative number of GiB, got nan"),
                                       ("inf", "must be a finite non-negative number of GiB, got inf"),
                                       ("1e300", "must be at most 8.58993e+09 GiB, got 1e+300")])
def test_a_bad_peak_cap_names_the_option_everywhere(raw, shown, capsys):
    from fxsched.cli import main

    for option in ("max-peak-gb", "max-peak-increase-gb"):
        message = re.escape(f"memory-cap: {option} {shown}")
        with pytest.raises(PipelineError, match=message):   # pipeline text
            parse_pipeline(f"memory-cap{{{option}={raw}}},default")
        with pytest.raises(ConfigError, match=message):     # the API
            fxsched.schedule(plain(), **{option.replace("-", "_"): float(raw)})
        code = main(["schedule", "test_bad_input:well_formed", f"--{option}", raw])   # the CLI
        _, err = capsys.readouterr()
        assert code == 2 and err.startswith(f"fxsched: memory-cap: {option} ") and "Traceback" not in err, err


def test_a_peak_cap_below_the_input_peak_is_a_note_not_an_error():
    done = fxsched.schedule(plain(), "default", max_peak_gb=1e-9)
    assert any("is over the cap" in note for note in done.report["notes"])
    assert not moved(done)


def test_every_input_error_is_one_cli_line_and_exit_2(capsys, tmp_path):
    from fxsched.cli import main

    cases = [
        ["schedule", "test_bad_input:barrier_on_a_gather", "--pipeline", "reference"],
        ["schedule", "test_bad_input:well_formed", "--pipeline", "budget{max-in-flight-gb=0},anchor,prefetch"],
        ["schedule", "test_bad_input:well_formed", "--pipeline", "anchor,budget{max-in-flight-gb=1e300}"],
    ]
    for argv in cases:
        code = main(argv)
        _, err = capsys.readouterr()
        assert code == 2, (argv, err)
        assert err.startswith("fxsched: ") and "Traceback" not in err, (argv, err)


def test_raising_and_opt_errors_are_input_errors_of_the_one_family(capsys, tmp_path):
    """RaisingError (a program parsed from text cannot be raised to FX) and `fxsched opt`'s
    SourceError are InputErrors (ir/errors.py); opt prints its diagnostic and exits 2."""
    from fxsched.cli import main
    from fxsched.ir.errors import FxschedError, InputError
    from fxsched.opt import SourceError
    from fxsched.raising import RaisingError, raise_program

    with pytest.raises(InputError, match=r"not lowered from a GraphModule \(parsed from text\?\)") as info:
        raise_program(parse_program(IR_GATHER))
    assert isinstance(info.value, RaisingError) and isinstance(info.value, FxschedError)
    assert issubclass(SourceError, InputError)
    bad = tmp_path / "bad.fxir"
    bad.write_text("%x = input\n%y = compute \"aten.neg\"(%nope)\n")
    assert main(["opt", str(bad), "-p", "sink"]) == 2
    _, err = capsys.readouterr()
    assert err.startswith(f"{bad}:2:") and ": error: " in err and "Traceback" not in err


def well_formed() -> fx.GraphModule:
    return plain()


def barrier_on_a_gather() -> fx.GraphModule:
    return plain(barrier=True)
