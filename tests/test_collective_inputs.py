"""A collective reads its input until its wait (issue 17): what writes or frees that input
follows the wait, and the memory model holds the input until then.

The launch of an async collective only enqueues it; the communication library reads the
input while it runs, up to the wait. The storage effects used to order a write or free of the
input after the launch only, so a pass could sink the wait below it: `default` moved a gather's
wait past a `copy_` into its shard, and on 2 gloo ranks the gather then sent the new values
(below, with a large all-reduce queued ahead on the group's one worker thread, so the gather
runs after the write). IR-level cases first, then graphs as users build them, then gloo.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

import fxsched
from fxsched.cost.simulate import memory_profile
from fxsched.front.fsdp import fsdp_free_storage
from fxsched.ir import VerifyError, parse_program, verify
from fxsched.lowering import lower
from fxsched.passes import DEFAULT_PIPELINE, REFERENCE_PIPELINE

from irtest import dedent

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
AG = c10d.all_gather_into_tensor.default
RS = c10d.reduce_scatter_tensor.default
WAIT = c10d.wait_tensor.default
PIPELINES = {"reference": REFERENCE_PIPELINE, "default": DEFAULT_PIPELINE}


def edges(program, why):
    return {(u, v) for u, v, w in program.effect_edges() if w == why}


# ---- IR: the edges ---------------------------------------------------------------------------

AFTER_THE_WAIT = """
    %x = input : f32[4]
    ^entry
    %grad = compute "aten.exp.default"(%x) : f32[1024]
    %rs = launch "rs"(%grad) {group = "0", group_size = 2, role = fsdp_reduce_scatter} : f32[512]
    %c = compute "aten.neg.default"(%x) : f32[1024]
    %w = wait(%rs) : f32[512]
    %z = compute "aten.zero_.default"(%grad) {writes = [%grad], alias = %grad} : f32[1024]
    %d = compute "aten.neg.default"(%x) : f32[1024]
    %f = free "fsdp.free"(%grad) {params = ["g"]}
    %output = output(%w, %c, %d)
"""
ZERO = '    %z = compute "aten.zero_.default"(%grad) {writes = [%grad], alias = %grad} : f32[1024]\n'
WAIT_LINE = "    %w = wait(%rs) : f32[512]\n"
assert ZERO in AFTER_THE_WAIT and WAIT_LINE in AFTER_THE_WAIT


def test_a_write_of_an_opaque_collectives_input_follows_its_waits():
    """A collective waited twice is opaque (kept in place); its waits are waits on no launch.
    They complete it all the same: a later write of its input follows them, not only it."""
    p = parse_program(dedent("""
        %x = input : f32[4]
        %buf = input : f32[1024]
        ^entry
        %ag = opaque "ag"(%buf) {group = "0", reason = "collective not waited exactly once"} : f32[2048]
        %w1 = opaque "wait_tensor"(%ag) {reason = "wait on no launch", writes = [%ag]} : f32[2048]
        %c = compute "aten.neg.default"(%x) : f32[1024]
        %w2 = opaque "wait_tensor"(%ag) {reason = "wait on no launch", writes = [%ag]} : f32[2048]
        %z = compute "aten.zero_.default"(%buf) {writes = [%buf], alias = %buf} : f32[1024]
        %output = output(%w1, %w2, %c, %z)
    """))
    assert {("ag", "z"), ("w1", "z"), ("w2", "z")} <= edges(p, "storage")
    verify(p)


def test_a_write_of_a_collectives_input_follows_its_wait_not_only_its_launch():
    p = parse_program(dedent(AFTER_THE_WAIT))
    assert ("w", "z") in edges(p, "storage") and p.notes == []
    verify(p)
    p.schedule.move_before(["w"], "d")  # the wait below the write: the collective reads zeros
    with pytest.raises(VerifyError, match=r"effect edge \(storage\)"):
        verify(p)


def test_a_free_of_a_collectives_input_follows_its_wait():
    p = parse_program(dedent(AFTER_THE_WAIT.replace(ZERO, "")))
    assert ("w", "f") in edges(p, "free")
    p.schedule.move_before(["w"], "output")  # the wait below the free: the collective reads freed memory
    with pytest.raises(VerifyError, match=r"effect edge \(free\)"):
        verify(p)


def test_a_coalesced_collectives_every_wait_reads_its_inputs():
    p = parse_program(dedent("""
        %x = input : f32[4]
        ^entry
        %a = compute "aten.exp.default"(%x) : f32[1024]
        %b = compute "aten.exp.default"(%x) : f32[256]
        %rs = launch "rs_coalesced"(%a, %b) {group = "0", group_size = 2, reduce_op = "sum"} : (f32[512], f32[128])
        %g0 = view "_operator.getitem"(%rs) : f32[512]
        %w0 = wait(%g0) {launch = %rs} : f32[512]
        %g1 = view "_operator.getitem"(%rs) : f32[128]
        %w1 = wait(%g1) {launch = %rs} : f32[128]
        %z = compute "aten.zero_.default"(%b) {writes = [%b], alias = %b} : f32[256]
        %output = output(%w0, %w1, %z)
    """))
    assert {("w0", "z"), ("w1", "z")} <= edges(p, "storage")


def test_an_input_that_writes_or_frees_before_the_wait_keeps_its_order_with_a_note():
    """The input graph races with its own collective: kept as it is (the write stays between
    launch and wait), said in a note; a free there is no use-after-free error."""
    text = AFTER_THE_WAIT.replace(WAIT_LINE, "")
    p = parse_program(dedent(text.replace("    %d = compute", WAIT_LINE + "    %d = compute")))
    assert {("rs", "z"), ("z", "w")} <= edges(p, "storage")
    assert p.notes == ["%z writes storage the collective %rs reads until its wait %w: kept before the wait "
                       "as in the input"]
    verify(p)
    p = parse_program(dedent(text.replace(ZERO, "").replace("    %output", WAIT_LINE + "    %output")))
    assert p.notes == ["%f frees storage the collective %rs reads until its wait %w: kept before the wait "
                       "as in the input (counted live until the wait)"]
    verify(p)


def test_an_in_place_collectives_wait_already_wrote_its_buffer_no_note():
    p = parse_program(dedent("""
        %x = input : f32[4]
        ^entry
        %y = compute "aten.exp.default"(%x) : f32[1024]
        %ar = launch "all_reduce_"(%y) {group = "0", reduce_op = "sum", writes = [%y], alias = %y} : f32[1024]
        %w = wait(%ar) {writes = [%ar], alias = %ar} : f32[1024]
        %z = compute "aten.zero_.default"(%y) {writes = [%y], alias = %y} : f32[1024]
        %output = output(%z)
    """))
    assert ("w", "z") in edges(p, "storage") and p.notes == []


# ---- memory: a free before the wait releases at the wait ----------------------------------------

def test_a_collectives_input_freed_before_its_wait_is_released_at_the_wait():
    p = parse_program(dedent("""
        %x = input : f32[4]
        ^entry
        %grad = compute "aten.exp.default"(%x) : f32[1024]
        %rs = launch "rs"(%grad) {group = "0", group_size = 2, role = fsdp_reduce_scatter} : f32[512]
        %f = free "fsdp.free"(%grad) {params = ["g"]}
        %c = compute "aten.neg.default"(%x) : f32[1024]
        %w = wait(%rs) : f32[512]
        %d = compute "aten.neg.default"(%x) : f32[1024]
        %output = output(%w, %c, %d)
    """))
    verify(p)
    live = dict(zip(*(lambda m: (m.order, m.live))(memory_profile(p))))
    # the gradient (4096) is read by the reduce-scatter until the wait: live at %c (was released at %f)
    assert live["c"] == 16 + 4096 + 2048 + 4096
    assert live["d"] == 16 + 2048 + 4096 + 4096
    # with the free after the wait, at the free
    order = ["x", "^entry", "grad", "rs", "c", "w", "f", "d", "output"]
    live = dict(zip(order, memory_profile(p, order).live))
    assert live["c"] == 16 + 4096 + 2048 + 4096 and live["d"] == 16 + 2048 + 4096 + 4096


# ---- graphs as users build them --------------------------------------------------------------------

N = 64


def written_after_the_wait(write: str) -> fx.GraphModule:
    """A large all-reduce, then a gather of shard `s` whose wait comes before `write` into `s`
    (copy_ or zero_) or a reduce-scatter of a gradient freed (FSDP's free) after its wait."""
    g = fx.Graph()
    x, s, b = g.placeholder("x"), g.placeholder("s"), g.placeholder("b")
    big = g.call_function(c10d.all_reduce.default, (b, "sum", "0"))
    h = g.call_function(aten.mm.default, (x, x))
    if write == "free":
        grad = g.call_function(aten.mm.default, (h, x))
        rs = g.call_function(RS, (grad, "sum", 2, "0"))
        rs.meta.update(comm_type="fsdp_reduce_scatter")
        waited = g.call_function(WAIT, (rs,))
        free = g.call_function(fsdp_free_storage, (grad,))
        free.meta.update(comm_type="fsdp_reshard_free_backward", param_name="g")
        tail = g.call_function(aten.mm.default, (h, x))
        g.output((tail, waited, g.call_function(WAIT, (big,))))
        return fx.GraphModule(nn.Module(), g)
    ag = g.call_function(AG, (s, 2, "0"))
    ag.meta.update(comm_type="fsdp_all_gather", param_name="p", fsdp_unsharded_nbytes=4 * 2 * N * N)
    waited = g.call_function(WAIT, (ag,))
    if write == "copy_":
        g.call_function(aten.copy_.default, (s, g.call_function(aten.view.default, (x, [-1]))))
    else:
        g.call_function(aten.zero_.default, (s,))
    h2 = g.call_function(aten.mm.default, (h, x))
    tail = g.call_function(aten.add.Tensor, (h2, g.call_function(aten.sum.default, (s,))))
    g.output((tail, waited, g.call_function(WAIT, (big,))))
    return fx.GraphModule(nn.Module(), g)


WRITES = ["copy_", "zero_", "free"]


def _order(gm):
    return [n.name for n in gm.graph.nodes]


@pytest.mark.parametrize("write", WRITES)
@pytest.mark.parametrize("pipeline", list(PIPELINES))
def test_no_pipeline_sinks_a_wait_below_a_write_or_free_of_its_collectives_input(write, pipeline):
    gm = written_after_the_wait(write)
    target = {"copy_": aten.copy_.default, "zero_": aten.zero_.default, "free": fsdp_free_storage}[write]
    kind = AG if write != "free" else RS
    done = _order(fxsched.schedule(gm, PIPELINES[pipeline]).graph_module)
    first = {n.target: n.name for n in reversed(gm.graph.nodes)}
    wait = next(n.name for n in gm.graph.nodes if n.target is WAIT and n.args[0].target is kind)
    assert done.index(wait) < done.index(first[target])
    assert lower(gm).notes == []


@pytest.mark.multirank
def test_scheduled_graphs_whose_collective_inputs_are_written_after_the_wait_are_bitwise_equal():
    """On 2 gloo ranks (one worker thread: the all-reduce of 16 MiB runs first, so the gather or
    reduce-scatter is still queued when the compute stream reaches the write): each pipeline's
    schedule computes what the unscheduled graph does. Before the wait read its collective's
    inputs, `default` put the `copy_` before the gather's wait and rank 0's output differed."""
    from fxsched.runtime import run_ranks
    from ranks import check_bitwise, run_all

    feeds = []
    for r in range(2):
        gen = torch.Generator().manual_seed(10 + r)
        feeds.append([torch.randn(N, N, generator=gen), torch.randn(N * N, generator=gen),
                      torch.randn(4 << 20, generator=gen)])
    jobs = []
    for write in WRITES:
        gm = written_after_the_wait(write)
        jobs.append((gm, feeds))
        jobs += [(fxsched.schedule(gm, pipeline).graph_module, feeds) for pipeline in PIPELINES.values()]
    results = run_ranks(run_all, 2, args=(jobs,), group_name="0")
    check_bitwise(results, WRITES, "the scheduled graph", per_key=3)
