"""unshard and in-place writes: the backward may read the forward's replica only where it holds
what a re-gather would.

Unsharding erases a parameter's forward free and its backward re-gather, so the backward reads
the forward's replica. That computes the same only if nothing wrote the shard in between (the
re-gather would read the new values: `shard written`) and nothing wrote the forward replica in
place (the backward would read what the forward left, not the shard gathered again: `replica
written`). A write of the re-gather's own replica in the backward is no reason to hold: after the
rewrite it writes the forward replica, after every forward read of it. Checked on IR programs and,
for the replica written in place, on a hand-built FX graph run bitwise on 2 gloo ranks.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import fxsched
from fxsched.front.fsdp import fsdp_free_storage
from fxsched.ir import Launch, Role, parse_program, tags, verify
from fxsched.passes import PassManager

UNSHARD = "unshard{max-peak-increase-gb=1.0}"

PROGRAM = """
%x = input
%s = input
%g = launch "ag"(%s) {role = fsdp_all_gather, nbytes = 4096, params = ["p"]}
%w = wait(%g)
%m = compute "aten.mm"(%x, %w) {heavy}
FORWARD_WRITE
%f = free "release"(%w) {params = ["p"]}
%n = compute "aten.mm"(%m, %m) {heavy}
^backward
%k = compute "aten.mm"(%n, %n) {heavy}
%h = compute "aten.mm"(%k, %k) {heavy}
%rg = launch "ag"(%s) {role = fsdp_all_gather_backward, nbytes = 4096, params = ["p"]}
%rw = wait(%rg)
%rm = compute "aten.mm"(%h, %rw) {heavy}
BACKWARD_WRITE
%rf = free "release"(%rw) {params = ["p"]}
%rs = launch "reduce_scatter"(%rm) {role = fsdp_reduce_scatter}
%rsw = wait(%rs)
%output = output(%rsw)
"""

WRITES = {
    "none": ("", ""),
    "forward replica": ('%i = compute "aten.add_"(%w, %m) {writes = [%w], alias = %w}', ""),
    "shard in the forward": ('%i = compute "aten.add_"(%s, %m) {writes = [%s], alias = %s}', ""),
    "re-gather's replica": ("", '%j = compute "aten.add_"(%rw, %h) {writes = [%rw], alias = %rw}'),
}


def _unshard(where: str):
    forward, backward = WRITES[where]
    program = parse_program(PROGRAM.replace("FORWARD_WRITE", forward).replace("BACKWARD_WRITE", backward))
    verify(program)
    stats = next(iter(PassManager(UNSHARD).run(program).stats().values()))
    return program, stats


@pytest.mark.parametrize("where,taken,reason", [
    ("none", True, None),
    ("re-gather's replica", True, None),
    ("forward replica", False, "replica written"),
    ("shard in the forward", False, "shard written"),
])
def test_unshard_holds_a_regather_whose_replica_or_shard_is_written(where, taken, reason):
    program, stats = _unshard(where)
    regathers = [op for op in program.ops() if isinstance(op, Launch) and op.role is Role.REGATHER]
    assert stats["unsharded"] == int(taken)
    if taken:
        assert not regathers
    else:
        assert [op.hold for op in regathers] == [reason] and stats[reason] == 1


aten = torch.ops.aten
c10d = torch.ops._c10d_functional
AG = c10d.all_gather_into_tensor.default
WAIT = c10d.wait_tensor.default
ROWS, COLS = 4, 8  # a shard; the gathered weight is (2 * ROWS, COLS) on 2 ranks


def replica_written_in_place() -> fx.GraphModule:
    """x @ w in the forward, then w *= 2 in place (the gathered weight, before its free); the
    backward gathers the shard again and reads the fresh replica: h @ w'."""
    g = fx.Graph()
    x, s = g.placeholder("x"), g.placeholder("s")

    def tagged(node, backward=False, **meta):
        node.meta.update(meta)
        node.meta[tags.AUTOGRAD_BACKWARD] = backward
        return node

    def gather(comm_type, backward):
        ag = tagged(g.call_function(AG, (s, 2, "0")), backward, **{tags.COMM_TYPE: comm_type, tags.PARAM_NAME: "p",
                                                                   tags.UNSHARDED_NBYTES: 2 * ROWS * COLS * 4})
        return tagged(g.call_function(WAIT, (ag,)), backward)

    w = gather(tags.ALL_GATHER, False)
    m = tagged(g.call_function(aten.mm.default, (x, w)))
    tagged(g.call_function(aten.mul_.Scalar, (w, 2.0)))
    tagged(g.call_function(fsdp_free_storage, (w,)), **{tags.COMM_TYPE: tags.RESHARD_FREE, tags.PARAM_NAME: "p"})
    h = tagged(g.call_function(aten.mm.default, (m, m)), True)
    rw = gather(tags.ALL_GATHER_BACKWARD, True)
    rm = tagged(g.call_function(aten.mm.default, (h, rw)), True)
    tagged(g.call_function(fsdp_free_storage, (rw,)), True,
           **{tags.COMM_TYPE: tags.RESHARD_FREE_BACKWARD, tags.PARAM_NAME: "p"})
    g.output((m, rm))
    gm = fx.GraphModule(nn.Module(), g)
    with FakeTensorMode() as mode:
        FakeTensorProp(gm, mode).propagate(torch.empty(COLS, 2 * ROWS), torch.empty(ROWS, COLS))
    return gm


def test_unshard_holds_the_regather_of_a_replica_written_in_place_in_an_fx_graph():
    done = fxsched.schedule(replica_written_in_place(), UNSHARD)
    stats = next(iter(done.result.stats().values()))
    assert stats["unsharded"] == 0 and stats["replica written"] == 1
    assert sum(n.target is AG for n in done.graph_module.graph.nodes) == 2


@pytest.mark.multirank
def test_a_replica_written_in_place_is_bitwise_equal_on_two_ranks():
    from fxsched.runtime import run_ranks
    from ranks import check_bitwise, run_all

    gm = replica_written_in_place()
    done = fxsched.schedule(gm, UNSHARD)
    feeds = []
    for r in range(2):
        gen = torch.Generator().manual_seed(30 + r)
        feeds.append([torch.randn(COLS, 2 * ROWS, generator=gen), torch.randn(ROWS, COLS, generator=gen)])
    results = run_ranks(run_all, 2, args=([(gm, feeds), (done.graph_module, feeds)],), group_name="0")
    check_bitwise(results, ["replica written in place"], "the unshard-scheduled graph")
