"""Cases found by fuzzing random pipelines (any registered pass, any order, repeated, tiny
budgets and caps, several cost models) on generated graphs, built-in models and IR programs.

Each is the smallest program found that shows it, fixed where it was wrong: the `unshard` and
`bucket` cases in passes/unshard.py (one re-gather per forward replica) and ir/rewriter.py (a
launch anchored at an erased op is anchored at the op after it; a rewired user keeps the edges
of its place); the oracle case in the property tests' checker.
"""

from __future__ import annotations

import hashlib

import pytest

import fxsched
from fxsched.front import fsdp_joint_graph
from fxsched.ir import parse_program, verify
from fxsched.models import build_model
from fxsched.passes import PassManager
from fxsched.passes.base import PassContext

from test_properties import check_ir_schedule

# fill-waits moves a random op into the idle time of a reduce-scatter's wait, ahead of the next
# reduce-scatter's launch: legal (a collective does not touch the RNG; random ops keep their
# order among themselves, collectives theirs), but the checker compared one list of both kinds
RANDOM_PAST_A_COLLECTIVE = """\
%x = input "x"
%c0 = compute "aten.compute"(%x)
%rs1 = launch "reduce_scatter"(%c0) {role = fsdp_reduce_scatter}
%rw1 = wait(%rs1)
%rs2 = launch "reduce_scatter"(%c0) {role = fsdp_reduce_scatter}
%rw2 = wait(%rs2)
%r = compute "aten.random"(%c0) {random}
^backward
%output = output(%r, %rw1, %rw2)
"""


@pytest.mark.parametrize("pipeline", ["fill-waits", "hide,fill-waits"])
def test_a_random_op_may_move_past_a_collective(pipeline):
    before, after = parse_program(RANDOM_PAST_A_COLLECTIVE), parse_program(RANDOM_PAST_A_COLLECTIVE)
    PassManager(pipeline).run(after)
    order = after.schedule.names()
    assert order.index("r") < order.index("rs2")  # the case: it moved
    check_ir_schedule(before, after, None, compute_moves=True)


# a forward gather of p0 whose replica unshard keeps: the forward free it erases is another
# launch's anchor (the `anchor` pass, or `hide` under a cost model that prices frees, put it there)
ANCHORED_AT_AN_ERASED_FREE = """\
%x = input "x"
%s0 = input "shard0"
%s1 = input "shard1"
%g0 = launch "all_gather"(%s0) {role = fsdp_all_gather, params = ["p0"], nbytes = 4096}
%w0 = wait(%g0)
%c0 = compute "aten.mm"(%x, %w0) {heavy}
%g1 = launch "all_gather"(%s1) {role = fsdp_all_gather, params = ["p1"], nbytes = 4096, anchor = %f0, prefetched}
%f0 = free "release"(%w0) {params = ["p0"]}
%w1 = wait(%g1)
%c1 = compute "aten.mm"(%c0, %w1) {heavy}
%f1 = free "release"(%w1) {params = ["p1"]}
^backward
%c2 = compute "aten.mm"(%c1, %c1) {heavy}
%rg0 = launch "all_gather"(%s0) {role = fsdp_all_gather_backward, params = ["p0"], nbytes = 4096}
%rw0 = wait(%rg0)
%c4 = compute "aten.mm"(%c2, %rw0) {heavy}
%rf0 = free "release"(%rw0) {params = ["p0"]}
%output = output(%c4)
"""

# two re-gathers of p0 after its one forward free: both become candidates for the same replica
# and unshard erases the free twice (KeyError)
TWO_REGATHERS_AFTER_ONE_FREE = """\
%x = input "x"
%s = input "shard"
%g = launch "all_gather"(%s) {role = fsdp_all_gather, params = ["p"]}
%w = wait(%g)
%c0 = compute "aten.mm"(%x, %w)
%f = free "release"(%w) {params = ["p"]}
%rg1 = launch "all_gather"(%s) {role = fsdp_all_gather_backward, params = ["p"]}
%rw1 = wait(%rg1)
%c1 = compute "aten.mm"(%c0, %rw1)
%rg2 = launch "all_gather"(%s) {role = fsdp_all_gather_backward, params = ["p"]}
%rw2 = wait(%rg2)
%c2 = compute "aten.mm"(%c1, %rw2)
%output = output(%c2)
"""



@pytest.mark.parametrize("text", [ANCHORED_AT_AN_ERASED_FREE, TWO_REGATHERS_AFTER_ONE_FREE],
                         ids=["anchored at an erased free", "two re-gathers after one free"])
def test_unshard_leaves_a_valid_program(text):
    program = parse_program(text)
    verify(program)
    PassManager("unshard").run(program)
    verify(program)


def _hashed_ms(op) -> float:
    """A valid cost model (finite, non-negative) that prices every op kind, waits and frees
    too, as a measured profile may: 0 to 10 ms by a hash of the op's name, a third of them 0."""
    h = int(hashlib.md5(f"0{op.name}".encode()).hexdigest()[:8], 16)
    return (h % 1000) / 100.0 if h % 3 else 0.0



def test_bucket_leaves_no_anchor_on_an_op_it_erases():
    module, inputs, loss = build_model("encoder", layers=1, width=32, seed=13, batch=2)
    front = fsdp_joint_graph(module, inputs, lambda m, *xs: loss(m(*xs), *xs), 2, buckets="per-module")
    fxsched.schedule(front.gm, "default,bucket", cost_model=_hashed_ms)


# unshard points the re-gather's readers (here the view %v) at the forward replica %w0, and the
# view kept only that data edge: not the ^backward phase edge effects.py's rules give an op of
# the backward that reads only the forward (a reparse of the text adds it). fill-waits, filling
# the exposed wait of %g1 at the forward's end, then took %v into the forward. The rewriter now
# gives a rewired user the edges of its place; the passes move what the edges allow.
REWIRED_TO_THE_FORWARD = """\
%x = input "x"
%s0 = input "shard0"
%s1 = input "shard1"
%g0 = launch "all_gather"(%s0) {role = fsdp_all_gather, params = ["p0"]}
%w0 = wait(%g0)
%m0 = compute "aten.mm"(%x, %w0)
%g1 = launch "all_gather"(%s1) {role = fsdp_all_gather, params = ["p1"]}
%w1 = wait(%g1)
^backward
%m1 = compute "aten.mm"(%m0, %m0)
%f0 = free "release"(%w0) {params = ["p0"]}
%rg0 = launch "all_gather"(%s0) {role = fsdp_all_gather_backward, params = ["p0"]}
%rw0 = wait(%rg0)
%v = view "aten.view"(%rw0)
%output = output(%m1, %w1)
"""


def test_fill_waits_takes_nothing_across_backward_after_unshard():
    """Found under a cost model pricing every op 1 ms: 'unshard,fill-waits' left %w1 after the
    backward's %v (the rewired view had no edge from ^backward)."""
    program = parse_program(REWIRED_TO_THE_FORWARD)
    result = PassManager("unshard,fill-waits").run(program, PassContext(cost_model=lambda op: 1.0))
    assert result.stats()["unshard"]["unsharded"] == 1  # the case: %v reads the replica now
    verify(program)
    order = program.schedule.names()
    assert order.index("^backward") < order.index("v")


def test_unshard_leaves_a_rewired_reader_its_phase_edge():
    program = parse_program(REWIRED_TO_THE_FORWARD)
    PassManager("unshard").run(program)
    assert "^backward" in program.predecessors["v"]


# the same rewired view, feeding a reduce-scatter: gradients-first's window for it reached back
# over ^backward into the forward and moved %v (an ancestor, not ^backward's descendant without
# its phase edge) ahead of the forward's tail
REWIRED_FEEDS_A_REDUCE_SCATTER = """\
%x = input "x"
%s0 = input "shard0"
%s1 = input "shard1"
%g0 = launch "all_gather"(%s0) {role = fsdp_all_gather, params = ["p0"]}
%w0 = wait(%g0)
%m0 = compute "aten.mm"(%x, %w0)
%g1 = launch "all_gather"(%s1) {role = fsdp_all_gather, params = ["p1"]}
%w1 = wait(%g1)
%m2 = compute "aten.mm"(%m0, %w1) {heavy}
^backward
%m1 = compute "aten.mm"(%m2, %m2) {heavy}
%f0 = free "release"(%w0) {params = ["p0"]}
%rg0 = launch "all_gather"(%s0) {role = fsdp_all_gather_backward, params = ["p0"]}
%rw0 = wait(%rg0)
%v = view "aten.view"(%rw0)
%c = compute "aten.mul"(%v, %v)
%rs = launch "reduce_scatter"(%c) {role = fsdp_reduce_scatter}
%rsw = wait(%rs)
%output = output(%m1, %rsw)
"""


@pytest.mark.parametrize("pipeline", ["unshard,gradients-first", "unshard,gradients-first,fill-waits"])
def test_gradients_first_windows_end_at_backward_after_unshard(pipeline):
    program = parse_program(REWIRED_FEEDS_A_REDUCE_SCATTER)
    result = PassManager(pipeline).run(program, PassContext(cost_model=lambda op: 1.0))
    assert result.stats()["unshard"]["unsharded"] == 1
    verify(program)
    order = program.schedule.names()
    assert order.index("^backward") < order.index("v") < order.index("c") < order.index("rs")
