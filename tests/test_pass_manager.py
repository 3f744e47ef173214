"""The pass manager: pipeline text, option errors, verification between passes, instruments,
and the analysis cache."""

from __future__ import annotations

import dataclasses
import io

import pytest

from irtest import dedent
from fxsched.ir import Schedule, VerifyError, parse_program, print_program, verify
from fxsched.passes import (PASSES, REFERENCE_PIPELINE, Analysis, GatherAnalysis, ModulePass, PassContext,
                            PassFailure, PassManager, PassResult, PipelineError, PrintIR, Timing, make_pass,
                            parse_pipeline, print_pipeline, register_pass)
from fxsched.passes.anchor import Anchor
from fxsched.passes.budget import Budget
from fxsched.passes.prefetch import Prefetch
from fxsched.passes.sink import Sink


PROGRAM = dedent('''
    %x = input
    %w1 = input
    %w2 = input
    ^entry
    %a1 = launch "ag"(%w1) {role = fsdp_all_gather, nbytes = 100, params = ["w1"]}
    %t1 = wait(%a1)
    %m1 = compute "aten.mm"(%x, %t1) {heavy}
    %a2 = launch "ag"(%w2) {role = fsdp_all_gather, nbytes = 100, params = ["w2"]}
    %t2 = wait(%a2)
    %m2 = compute "aten.mm"(%m1, %t2) {heavy}
    %output = output(%m2)
''')


# ---- pipeline text ------------------------------------------------------------------------------

@pytest.mark.parametrize("text,canonical", [
    ("anchor{forward-depth=2},budget{max-in-flight-gb=1.5},prefetch,sink",
     "anchor{forward-depth=2},budget{max-in-flight-gb=1.5},prefetch,sink"),
    (REFERENCE_PIPELINE, "anchor,budget,prefetch,sink"),
    (" anchor { backward-depth = 0 , attention = false } ,  sink ", "anchor{backward-depth=0,attention=false},sink"),
    # defaults are left out, whatever their spelling; a bare flag means true
    ("anchor{forward-depth=1,attention},budget{max-in-flight-gb=1}", "anchor,budget"),
    ("budget{max-in-flight-gb=0},budget{max-in-flight-gb=2.5e-07}",
     "budget{max-in-flight-gb=0.0},budget{max-in-flight-gb=2.5e-07}"),
    ("anchor{attention=false,forward-depth=3}", "anchor{forward-depth=3,attention=false}"),
    ("", ""),
])
def test_pipeline_text_round_trips_to_its_canonical_form(text, canonical):
    passes = parse_pipeline(text)
    assert print_pipeline(passes) == canonical
    assert parse_pipeline(canonical) == passes
    assert print_pipeline(parse_pipeline(canonical)) == canonical
    assert str(PassManager(text)) == canonical


def test_parsed_passes_carry_their_options():
    anchor, budget, prefetch, sink = parse_pipeline("anchor{forward-depth=2,attention=false},"
                                                    "budget{max-in-flight-gb=1.5},prefetch,sink")
    assert anchor == Anchor(forward_depth=2, backward_depth=1, attention=False)
    assert budget == Budget(max_in_flight_gb=1.5)
    assert (prefetch, sink) == (Prefetch(), Sink())
    assert make_pass("anchor", "backward-depth=4") == Anchor(backward_depth=4)
    assert str(PassManager([Anchor(forward_depth=0), Sink()])) == "anchor{forward-depth=0},sink"


def test_unknown_pass_lists_the_registered_passes():
    with pytest.raises(PipelineError) as info:
        parse_pipeline("anchor,bogus,sink")
    message = str(info.value)
    assert "unknown pass 'bogus'" in message
    for name in ("anchor", "budget", "prefetch", "sink"):
        assert name in message.split("passes:")[1]


def test_unknown_option_lists_the_options_of_that_pass():
    with pytest.raises(PipelineError) as info:
        parse_pipeline("anchor{depth=2}")
    message = str(info.value)
    assert "pass 'anchor' has no option 'depth'" in message
    assert all(o in message for o in ("forward-depth", "backward-depth", "attention"))
    with pytest.raises(PipelineError, match="pass 'budget' has no option 'forward-depth'; options: max-in-flight-gb"):
        parse_pipeline("budget{forward-depth=1}")
    with pytest.raises(PipelineError, match="pass 'prefetch' has no option 'x'; options: none"):
        parse_pipeline("prefetch{x=1}")


@pytest.mark.parametrize("text,fragments", [
    ("anchor{forward-depth=-1}", ["anchor", "forward-depth", "non-negative integer", "-1"]),
    ("anchor{backward-depth=-3}", ["anchor", "backward-depth", "non-negative integer", "-3"]),
    ("anchor{forward-depth=true}", ["anchor", "forward-depth", "int", "'true'"]),
    ("anchor{backward-depth}", ["anchor", "backward-depth", "int", "'true'"]),
    ("anchor{forward-depth=1.5}", ["anchor", "forward-depth", "int", "'1.5'"]),
    ("anchor{attention=yes}", ["anchor", "attention", "bool", "'yes'"]),
    ("budget{max-in-flight-gb=nan}", ["budget", "max-in-flight-gb", "finite non-negative", "nan"]),
    ("budget{max-in-flight-gb=inf}", ["budget", "max-in-flight-gb", "finite non-negative", "inf"]),
    ("budget{max-in-flight-gb=-0.5}", ["budget", "max-in-flight-gb", "non-negative", "-0.5"]),
    ("budget{max-in-flight-gb=true}", ["budget", "max-in-flight-gb", "float", "'true'"]),
    ("anchor,", ["ends with a comma"]),
    ("anchor}", ["column 1", "anchor}"]),
    ("anchor,sink{", ["column 8", "sink{"]),
])
def test_bad_values_raise_clear_errors(text, fragments):
    with pytest.raises(PipelineError) as info:
        parse_pipeline(text)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_bad_values_in_code_raise_value_errors_naming_the_field():
    with pytest.raises(ValueError, match="forward-depth"):
        Anchor(forward_depth=True)
    with pytest.raises(ValueError, match="backward-depth"):
        Anchor(backward_depth=-1)
    with pytest.raises(ValueError, match="max-in-flight-gb"):
        Budget(max_in_flight_gb=float("nan"))


# ---- running, verifying, failing ---------------------------------------------------------------

@pytest.fixture
def extra_passes():
    """Register test passes for one test and unregister them after it."""
    added: list[str] = []

    def add(cls):
        register_pass(cls)
        added.append(cls.name)
        return cls

    yield add
    for name in added:
        PASSES.pop(name, None)


def test_a_graph_without_tags_passes_through_unchanged():
    text = dedent('''
        %x = input
        %y = input
        ^entry
        %mm = compute "aten.mm"(%x, %y) {heavy}
        %at = compute "aten._scaled_dot_product_flash_attention"(%mm) {heavy, attention}
        %v = view "aten.view"(%at)
        %b = barrier "aten.copy_"(%y, %v) {reason = "mutation"}
        %ar = launch "_c10d_functional.all_reduce"(%v) {group = "0"}
        %arw = wait(%ar)
        ^backward
        %g = compute "aten.neg"(%arw)
        %rs = launch "_c10d_functional.reduce_scatter_tensor"(%g) {group = "0", role = fsdp_reduce_scatter}
        %rsw = wait(%rs)
        %n = compute "aten.mm"(%rsw, %x) {heavy}
        %output = output(%n)
    ''')
    program = parse_program(text)
    result = PassManager("anchor{forward-depth=3},budget,prefetch,sink").run(program)
    assert not result.changed
    assert print_program(program) == text
    assert result.stats()["sink"] == {"sunk": 0, "changed": False}
    assert result.stats()["prefetch"]["forward"] == result.stats()["prefetch"]["backward"] == 0


def test_statistics_per_pass_and_repeated_passes():
    program = parse_program(PROGRAM)
    result = PassManager("anchor,budget,prefetch,sink,sink").run(program)
    assert result.changed
    assert result.stats() == {
        "anchor": {"anchored": 1, "first group": 1, "depth 0": 0, "no consumer": 0, "changed": True},
        "budget": {"admitted": 1, "over budget": 0, "unknown size": 0, "no earlier legal slot": 0,
                   "budget_bytes": 2**30, "changed": False},
        "prefetch": {"forward": 1, "backward": 0, "no earlier legal slot": 0, "moved_nodes": 1, "changed": True},
        "sink": {"sunk": 1, "changed": True},
        "sink#2": {"sunk": 0, "changed": False},
    }
    assert [str(p) for p, _ in result.results] == ["anchor", "budget", "prefetch", "sink", "sink"]


def test_pass_failure_names_the_pass_and_those_before_it(extra_passes):
    @extra_passes
    @dataclasses.dataclass(frozen=True)
    class Reverse(ModulePass):
        """Breaks the program: schedules everything backwards."""
        name = "test-reverse"

        def apply(self, ctx, program):
            program.schedule = Schedule(reversed(program.schedule.names()))
            return PassResult(True)

    @extra_passes
    @dataclasses.dataclass(frozen=True)
    class Boom(ModulePass):
        name = "test-boom"
        level: int = 0

        def apply(self, ctx, program):
            raise KeyError("no such node")

    program = parse_program(PROGRAM)
    with pytest.raises(PassFailure) as info:
        PassManager("anchor{forward-depth=2},prefetch,test-reverse,sink").run(program)
    failure = info.value
    assert "pass 'test-reverse' left an invalid program" in str(failure)
    assert "passes before it: anchor{forward-depth=2},prefetch" in str(failure)
    assert "VerifyError" in str(failure) and "scheduled before" in str(failure)
    assert isinstance(failure.failed, Reverse) and failure.before == [Anchor(forward_depth=2), Prefetch()]
    assert isinstance(failure.cause, VerifyError)

    with pytest.raises(PassFailure) as info:
        PassManager("test-boom{level=3},sink").run(parse_program(PROGRAM))
    assert "pass 'test-boom{level=3}' failed: KeyError" in str(info.value)
    assert "passes before it: (none)" in str(info.value)
    assert isinstance(info.value.cause, KeyError)
    assert "test-boom" in PASSES and "test-reverse" in PASSES


def test_registered_test_passes_are_gone_after_the_test():
    assert "test-reverse" not in PASSES and "test-boom" not in PASSES
    with pytest.raises(PipelineError, match="unknown pass 'test-reverse'"):
        parse_pipeline("test-reverse")


def test_a_pass_name_cannot_be_registered_twice():
    with pytest.raises(ValueError, match="registered twice"):
        register_pass(Sink)


def test_verify_after_each_pass_can_be_turned_off(extra_passes):
    @extra_passes
    @dataclasses.dataclass(frozen=True)
    class Swap(ModulePass):
        name = "test-swap"

        def apply(self, ctx, program):
            names = program.schedule.names()
            at = names.index("t1")
            names[at], names[at + 1] = names[at + 1], names[at]  # m1 before the wait it reads
            program.schedule = Schedule(names)
            return PassResult(True)

    program = parse_program(PROGRAM)
    result = PassManager("test-swap", verify_each=False).run(program)
    assert result.changed
    with pytest.raises(VerifyError, match="%m1: scheduled before %t1"):
        verify(program)
    with pytest.raises(PassFailure):
        PassManager("test-swap").run(parse_program(PROGRAM))


def test_a_reordering_pass_is_checked_at_what_it_moved(extra_passes):
    @extra_passes
    @dataclasses.dataclass(frozen=True)
    class Hoist(ModulePass):
        """Says it only reorders, and moves m1 above the wait it reads."""
        name = "test-hoist"
        reorders_only = True

        def apply(self, ctx, program):
            program.schedule.move_before(["m1"], "t1")
            return PassResult(True)

    with pytest.raises(PassFailure) as info:
        PassManager("sink,test-hoist,sink").run(parse_program(PROGRAM))
    assert "pass 'test-hoist' left an invalid program" in str(info.value)
    assert "%m1: scheduled before %t1, which it must follow by a data edge" in str(info.value)


def test_a_reordering_pass_that_rewires_the_graph_is_caught_at_the_end(extra_passes):
    @extra_passes
    @dataclasses.dataclass(frozen=True)
    class Rewire(ModulePass):
        """Says it only reorders, moves nothing, and turns an effect edge between unmoved nodes
        around (same node and edge counts): only the full check at the pipeline's end sees it."""
        name = "test-rewire"
        reorders_only = True

        def apply(self, ctx, program):
            u, v, e = next((u, v, e) for u, v, e in program.graph.edges(data=True) if e["kind"] == "effect")
            program.graph.remove_edge(u, v)
            program.graph.add_edge(v, u, **e)
            return PassResult(True)

    for verify_input in (True, False):  # the edges alone (verify_input off) catch it too
        with pytest.raises(PassFailure) as info:
            PassManager("test-rewire,sink", verify_input=verify_input).run(parse_program(PROGRAM))
        assert "(or one of test-rewire,sink) left an invalid program" in str(info.value)
        assert isinstance(info.value.cause, VerifyError)


@pytest.mark.parametrize("pipeline,verify_input,rules", [
    ("anchor,budget,prefetch,sink", False, False),  # lowering's program, moves only: the edges alone
    ("anchor,budget,prefetch,sink", True, True),  # a checked input: every rule
    ("anchor,test-new-order,sink", False, True),  # a pass set a new schedule (checked whole): every rule
])
def test_the_last_check_reads_the_edges_alone_only_on_an_unchecked_input_moved_only(
        extra_passes, monkeypatch, pipeline, verify_input, rules):
    @extra_passes
    @dataclasses.dataclass(frozen=True)
    class NewOrder(ModulePass):
        """Gives the program a new schedule of the same order: the manager checks it whole."""
        name = "test-new-order"
        reorders_only = True

        def apply(self, ctx, program):
            program.schedule = Schedule(program.schedule.names())
            return PassResult(True)

    import fxsched.passes.manager as manager
    calls = []
    real = manager.verify

    def spy(program, **kwargs):
        calls.append(kwargs)
        return real(program, **kwargs)

    monkeypatch.setattr(manager, "verify", spy)
    PassManager(pipeline, verify_input=verify_input).run(parse_program(PROGRAM))
    assert calls[-1] == {"structure": False, "rules": rules}



def test_the_last_pass_is_checked_by_the_final_walk_and_still_blamed(extra_passes, monkeypatch):
    """The last pass's moves are checked by the run's final check (every edge), not twice; a
    broken order is still blamed on that pass alone. Where something reads the program in
    between (an instrument, check_analyses), its own check runs as after any other pass."""
    @extra_passes
    @dataclasses.dataclass(frozen=True)
    class Hoist(ModulePass):
        """Says it only reorders, and moves m1 above the wait it reads."""
        name = "test-hoist-last"
        reorders_only = True

        def apply(self, ctx, program):
            program.schedule.move_before(["m1"], "t1")
            return PassResult(True)

    with pytest.raises(PassFailure) as info:
        PassManager("sink,test-hoist-last", check_analyses=False).run(parse_program(PROGRAM))
    assert "pass 'test-hoist-last' left an invalid program" in str(info.value)
    assert "%m1: scheduled before %t1, which it must follow by a data edge" in str(info.value)

    import fxsched.passes.manager as manager
    calls = []
    real = manager.verify_moves
    monkeypatch.setattr(manager, "verify_moves", lambda program, moved: calls.append(moved) or real(program, moved))
    PassManager(REFERENCE_PIPELINE, check_analyses=False).run(parse_program(PROGRAM))
    assert len(calls) == 3  # anchor, budget, prefetch: sink's moves by the final check
    calls.clear()
    PassManager(REFERENCE_PIPELINE, check_analyses=False, instruments=[Timing()]).run(parse_program(PROGRAM))
    assert len(calls) == 4
    calls.clear()
    PassManager(REFERENCE_PIPELINE, check_analyses=True).run(parse_program(PROGRAM))
    assert len(calls) == 4


# ---- instruments --------------------------------------------------------------------------------

def test_timing_records_every_pass():
    timing = Timing()
    PassManager("anchor,budget,prefetch,sink", instruments=[timing]).run(parse_program(PROGRAM))
    assert [name for name, _ in timing.seconds] == ["anchor", "budget", "prefetch", "sink"]
    assert all(seconds >= 0 for _, seconds in timing.seconds)
    report = timing.report()
    assert report.startswith("pass timing:") and "total" in report
    assert all(name in report for name in ("anchor", "budget", "prefetch", "sink"))


def test_print_ir_after_changes_only():
    stream = io.StringIO()
    program = parse_program(PROGRAM)
    PassManager("anchor,budget,prefetch,sink,sink",
                instruments=[PrintIR(only_changed=True, stream=stream)]).run(program)
    out = stream.getvalue()
    headers = [line for line in out.splitlines() if line.startswith("// -----")]
    # budget and the second sink changed nothing: not printed
    assert headers == ["// ----- IR after anchor -----", "// ----- IR after prefetch -----",
                       "// ----- IR after sink -----"]
    assert out.endswith(print_program(program) + "\n")
    after_prefetch = out.split("// ----- IR after prefetch -----\n")[1].split("// -----")[0]
    assert "%a2 = launch" in after_prefetch and "prefetched}" in after_prefetch


def test_print_ir_before_and_after_every_pass():
    stream = io.StringIO()
    PassManager("anchor,sink", instruments=[PrintIR(before=True, after=True, stream=stream)]).run(
        parse_program(PROGRAM))
    headers = [line for line in stream.getvalue().splitlines() if line.startswith("// -----")]
    assert headers == ["// ----- IR before anchor -----", "// ----- IR after anchor -----",
                       "// ----- IR before sink -----", "// ----- IR after sink -----"]
    first = stream.getvalue().split("// ----- IR after anchor -----")[0]
    assert first == "// ----- IR before anchor -----\n" + PROGRAM + "\n"


# ---- the analysis cache ---------------------------------------------------------------------------

class Counting(Analysis):
    computed = 0

    @classmethod
    def compute(cls, program, ctx):
        cls.computed += 1
        return cls()


def test_pass_context_caches_analyses_and_drops_those_not_preserved(extra_passes):
    @extra_passes
    @dataclasses.dataclass(frozen=True)
    class Keeps(ModulePass):
        name = "test-keeps"
        preserves = (Counting,)

        def apply(self, ctx, program):
            ctx.get(Counting, program)
            return PassResult(False)

    @extra_passes
    @dataclasses.dataclass(frozen=True)
    class Drops(ModulePass):
        name = "test-drops"

        def apply(self, ctx, program):
            ctx.get(Counting, program)
            return PassResult(True)

    @extra_passes
    @dataclasses.dataclass(frozen=True)
    class Idle(ModulePass):
        name = "test-idle"  # preserves nothing, but changes nothing either

        def apply(self, ctx, program):
            return PassResult(False)

    Counting.computed = 0
    ctx = PassContext()
    program = parse_program(PROGRAM)
    PassManager("test-keeps,test-idle,test-keeps,test-drops,test-keeps,test-keeps",
                check_analyses=False).run(program, ctx)
    # computed for the first pass, kept across test-idle (no change) and reused, dropped after
    # test-drops (it changed the program and preserves nothing), computed again
    assert Counting.computed == 2
    first = ctx.get(Counting, program)
    assert ctx.get(Counting, program) is first and Counting.computed == 2
    ctx.keep_only(())
    assert ctx.get(Counting, program) is not first and Counting.computed == 3


def test_the_gather_analysis_is_computed_once_per_pipeline(monkeypatch):
    calls = []
    original = GatherAnalysis.compute.__func__

    def counting(cls, program, ctx):
        calls.append(1)
        return original(cls, program, ctx)

    monkeypatch.setattr(GatherAnalysis, "compute", classmethod(counting))
    ctx = PassContext()
    program = parse_program(PROGRAM)
    PassManager("anchor,budget,prefetch,sink", check_analyses=False).run(program, ctx)
    assert len(calls) == 1
    assert ctx.get(GatherAnalysis, program).gathers[1].launch == "a2" and len(calls) == 1


def test_an_option_given_twice_is_an_error():
    with pytest.raises(PipelineError, match="option 'forward-depth' is given twice"):
        parse_pipeline("anchor{forward-depth=1,forward-depth=2}")


def test_unknown_option_lists_defaults_in_pipeline_syntax():
    with pytest.raises(PipelineError, match=r"attention \(default true\)"):
        parse_pipeline("anchor{nope=1}")


# ---- kept analyses are checked; the gathers' order is the entry order ------------------------------

class Lying(Analysis):
    """An analysis of the schedule's first node: it goes stale when the order changes."""

    def __init__(self, first):
        self.first = first

    def __eq__(self, other):
        return isinstance(other, Lying) and other.first == self.first

    @classmethod
    def compute(cls, program, ctx):
        return cls(program.schedule[0])


def test_check_analyses_catches_a_pass_that_keeps_a_stale_analysis(extra_passes):
    @extra_passes
    @dataclasses.dataclass(frozen=True)
    class Rotates(ModulePass):
        name = "test-rotates"
        preserves = (Lying,)  # wrongly: it changes the first node
        reorders_only = True

        def apply(self, ctx, program):
            ctx.get(Lying, program)
            names = program.schedule.names()
            program.schedule.move_before([names[0]], names[2])  # x goes after w1: both inputs
            return PassResult(True)

    program = parse_program(PROGRAM)
    # (the move breaks the entry rule too: the verifier is off to see the analysis check alone)
    PassManager("test-rotates", check_analyses=False, verify_each=False).run(program)  # unnoticed
    with pytest.raises(PassFailure, match=r"pass 'test-rotates' kept a stale analysis: StaleAnalysis: Lying"):
        PassManager("test-rotates", check_analyses=True, verify_each=False).run(parse_program(PROGRAM))


def test_check_analyses_is_on_in_the_tests():
    assert PassManager("sink").check_analyses
    assert not PassManager("sink", check_analyses=False).check_analyses


def test_the_gathers_keep_their_entry_order_after_prefetch():
    """After prefetch moved a2, the analysis, kept or fresh, lists the gathers in the order
    their launches had when the pipeline started (the reference's order, which sink walks)."""
    ctx = PassContext()
    program = parse_program(PROGRAM)
    PassManager("anchor,budget,prefetch", check_analyses=True).run(program, ctx)
    kept = ctx.get(GatherAnalysis, program)
    fresh = GatherAnalysis.compute(program, ctx)
    assert kept == fresh
    entry = [n for n in ctx.entry if n in {g.launch for g in fresh.gathers}]
    assert [g.launch for g in fresh.gathers] == entry


@pytest.mark.parametrize("text,first,second", [
    ("budget{max-in-flight-gb=0},anchor,prefetch,sink", "anchor", "budget"),
    ("budget,hide,prefetch", "hide", "budget"),
    ("anchor,prefetch,budget", "budget", "prefetch"),
    ("anchor,budget,prefetch,sink,anchor", "anchor", "budget"),
    ("anchor,budget,prefetch,order-gathers,prefetch", "prefetch", "order-gathers"),
])
def test_a_pipeline_that_runs_a_pass_before_one_it_needs_names_both(text, first, second):
    with pytest.raises(PipelineError, match=rf"pass '{first}' runs after '{second}'.*'{second}' must follow it"):
        parse_pipeline(text)
    with pytest.raises(PipelineError, match=rf"'{second}' must follow it"):  # a list of passes too
        PassManager(parse_pipeline_unchecked(text))


def parse_pipeline_unchecked(text):
    return [make_pass(item.split("{")[0], item.partition("{")[2].rstrip("}") or None) for item in text.split(",")]


@pytest.mark.parametrize("text", ["anchor,budget,prefetch,anchor,budget,prefetch,sink", "hide,anchor,budget,prefetch",
                                  "sink,anchor,budget,prefetch,sink", "overlap-reduce-scatter,hide,budget,prefetch",
                                  "anchor,prefetch", "budget,prefetch", "prefetch", "reference", "default"])
def test_pipelines_in_a_declared_order_parse(text):
    assert parse_pipeline(text)
