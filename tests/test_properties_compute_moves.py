"""Property tests for the passes that reorder compute (`gradients-first`, `fill-waits`).

Every other pass moves communication around a fixed order of compute; these two move compute
itself, legal only as far as the IR's data and effect edges are right: an in-place write, a
random op, a free, an opaque call or a barrier that the edges missed would let them reorder what
the input relies on. So the same graphs as tests/test_properties.py (generated FX joint graphs,
IR text programs with in-place writes of temporaries, gathered weights and shards, random ops,
barriers, other collectives and bucketed gathers) go through pipelines that put the two passes
around the drawn communication passes, with and without a peak-memory cap, and the result is
checked by code that reads the rules off the graph itself (FX edges and storage identity, IR
operands), not off the effect edges: `check_fx_schedule` / `check_ir_schedule` with
`compute_moves` (a compute move is not a prefetch, so their budget sweep does not apply).
"""

from __future__ import annotations

from hypothesis import event, given, note
from hypothesis import strategies as st

import fxsched
from fxsched.ir import Launch, parse_program, print_program, verify
from fxsched.lowering import lower
from fxsched.passes import PassManager
from fxsched.passes.memory_cap import with_cap

from reproducers import reproducer_on_failure
from test_properties import (check_fx_schedule, check_ir_schedule, examples, graph_options, ir_programs,
                             pipelines, _graph)


@st.composite
def compute_moving(draw) -> str:
    """A drawn pipeline of tests/test_properties.py with gradients-first before it and/or
    fill-waits after it, sometimes under a peak-memory cap (the passes then check their moves),
    sometimes after `unorder-reduce-scatters` (the checks then let two unordered reduce-scatters
    of one group swap, and no other pair of collectives)."""
    middle, _ = draw(pipelines())
    where = draw(st.sampled_from(["first", "last", "both"]))
    text = ",".join((["gradients-first"] if where != "last" else []) + [middle]
                    + (["fill-waits"] if where != "first" else []))
    if draw(st.integers(0, 2)) == 0:  # FSDP's reduce-scatters free among themselves (gradients-first swaps them)
        text = "unorder-reduce-scatters," + text
    if draw(st.integers(0, 2)) == 0:
        text = with_cap(text, max_peak_increase_gb=0.0)
    return text


def swapped(stats: dict[str, dict]) -> bool:
    return any(s.get("swapped", 0) for name, s in stats.items() if name.split("#")[0].split("{")[0] == "gradients-first")


def moved_compute(stats: dict[str, dict]) -> bool:
    return any(s.get("moved", 0) for name, s in stats.items() if name.split("#")[0].split("{")[0] in ("gradients-first", "fill-waits"))


@examples(8, graphs=True)
@given(graph=graph_options(), text=compute_moving())
def test_generated_graphs_keep_every_rule_when_compute_moves(graph, text):
    num_nodes, options = graph
    note(f"generate_graph({num_nodes}, **{options}); pipeline {text!r}")
    original = _graph(num_nodes, **options)
    with reproducer_on_failure("generated_graphs_compute_moves", lambda: print_program(lower(original)), text):
        done = fxsched.schedule(original, text)
        verify(done.program)
        unordered = {n for n in done.program.schedule.names()
                     if isinstance(op := done.program.op(n), Launch) and op.unordered}
        check_fx_schedule(original, done.graph_module, None, compute_moves=True, unordered=unordered)
    event(f"compute moved: {moved_compute(done.result.stats())}")
    event(f"reduce-scatters swapped: {swapped(done.result.stats())}")


@examples(120)
@given(text=ir_programs(), pipeline=compute_moving())
def test_ir_programs_keep_every_rule_when_compute_moves(text, pipeline):
    note(f"pipeline {pipeline!r}\n{text}")
    before = parse_program(text)
    verify(before)
    after = parse_program(text)
    with reproducer_on_failure("ir_programs_compute_moves", lambda: text, pipeline):
        result = PassManager(pipeline, reproducer=True).run(after)
        check_ir_schedule(before, after, None, compute_moves=True)
    event(f"compute moved: {moved_compute(result.stats())}")
    event(f"reduce-scatters swapped: {swapped(result.stats())}")
