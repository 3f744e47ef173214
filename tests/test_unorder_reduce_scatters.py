"""Unordered FSDP reduce-scatters (`Launch.unordered`, `Rewriter.unorder`, the
`unorder-reduce-scatters` pass): which `collective-order` edges exist, that the text round-trips
the fact, that the verifier holds the edges to it, and that what it does not cover stays ordered."""

from __future__ import annotations

import attrs
import pytest

from fxsched.ir import EFFECT, VerifyError, parse_program, print_program, verify
from fxsched.ir.effects import collective_order
from fxsched.ir.rewriter import Rewriter, RewriteError
from fxsched.passes import PassManager

# one group "0": three FSDP reduce-scatters, an all-reduce between the second and third, a
# reduce-scatter of unknown group after them, and one of group "0" after that; a gather of group
# "0" (free already); group "1" has its own all-reduce
TEXT = """
%x = input
%w = input
^entry
%ag = launch "ag"(%w) {group = "0", role = fsdp_all_gather, nbytes = 4, params = ["w"]}
%agw = wait(%ag)
%g1 = compute "c"(%x, %agw)
%g2 = compute "c"(%g1)
%g3 = compute "c"(%g2)
%rs1 = launch "rs"(%g1) {group = "0", role = fsdp_reduce_scatter}
%w1 = wait(%rs1)
%rs2 = launch "rs"(%g2) {group = "0", role = fsdp_reduce_scatter}
%w2 = wait(%rs2)
%ar = launch "ar"(%g3) {group = "0"}
%wa = wait(%ar)
%ar1 = launch "ar"(%g3) {group = "1"}
%wa1 = wait(%ar1)
%rs3 = launch "rs"(%g3) {group = "0", role = fsdp_reduce_scatter}
%w3 = wait(%rs3)
%rs4 = launch "rs"(%g2) {group = "0", role = fsdp_reduce_scatter}
%w4 = wait(%rs4)
%rsu = launch "rs"(%g1) {role = fsdp_reduce_scatter}
%wu = wait(%rsu)
%rs5 = launch "rs"(%g1) {group = "0", role = fsdp_reduce_scatter}
%w5 = wait(%rs5)
%output = output(%w1, %w2, %wa, %wa1, %w3, %w4, %wu, %w5)
"""


def _order_edges(program) -> set[tuple[str, str]]:
    return {(u, v) for u, v, e in program.graph.edges(data=True)
            if e["kind"] == EFFECT and e["why"] == "collective-order"}


def _unordered_text() -> str:
    return "\n".join(line.replace("role = fsdp_reduce_scatter}", "role = fsdp_reduce_scatter, unordered}")
                     if "group = \"0\"" in line else line for line in TEXT.splitlines())


def test_traced_order_without_the_fact():
    assert _order_edges(parse_program(TEXT)) == {
        ("rs1", "rs2"), ("rs2", "ar"), ("ar", "rs3"), ("rs3", "rs4"), ("rs4", "rsu"), ("ar1", "rsu"), ("rsu", "rs5")}


def test_unordered_ones_keep_their_place_among_the_others_only():
    program = parse_program(_unordered_text())
    edges = _order_edges(program)
    # rs1 and rs2 (both unordered, before the all-reduce) are free of each other, and so are rs3
    # and rs4; each follows the last ordered collective of its group, and the next ordered one
    # (the all-reduce; the reduce-scatter of unknown group) follows each of them
    assert edges == {("rs1", "ar"), ("rs2", "ar"), ("ar", "rs3"), ("ar", "rs4"), ("rs3", "rsu"), ("rs4", "rsu"),
                     ("ar1", "rsu"), ("rsu", "rs5")}
    assert not program.graph.has_edge("rs1", "rs2") and not program.graph.has_edge("rs3", "rs4")
    verify(program)
    # so rs2 may go before rs1, and rs4 before rs3, but none past the all-reduce or rsu
    program.schedule.move_before(["rs2", "w2"], "rs1")
    program.schedule.move_before(["rs4", "w4"], "rs3")
    verify(program)
    program.schedule.move_before(["rs3", "w3"], "ar")
    with pytest.raises(VerifyError, match="collective-order"):
        verify(program)


def test_text_round_trips_the_fact():
    program = parse_program(_unordered_text())
    text = print_program(program)
    assert text.count("unordered}") == 5
    again = parse_program(text)
    assert print_program(again) == text and _order_edges(again) == _order_edges(program)


def test_rewriter_gives_the_edges_derivation_gives():
    program = parse_program(TEXT)
    rewriter = Rewriter(program)
    names = ["rs1", "rs2", "rs3", "rs4", "rs5"]
    assert rewriter.unorder(names) == 5 and rewriter.unorder(names) == 0
    verify(program)
    assert _order_edges(program) == _order_edges(parse_program(_unordered_text()))
    assert all(program.op(n).unordered for n in names)


def test_pass_marks_every_known_group_reduce_scatter():
    program = parse_program(TEXT)
    result = PassManager("unorder-reduce-scatters").run(program)
    (_, done), = result.results
    assert done.stats == {"unordered": 5, "already unordered": 0, "unknown group": 1}
    assert not program.op("rsu").unordered and not program.op("ar").unordered
    assert _order_edges(program) == _order_edges(parse_program(_unordered_text()))


@pytest.mark.parametrize("name", ["ar", "rsu", "ag", "g1"])
def test_only_known_group_reduce_scatters(name):
    program = parse_program(TEXT)
    before = _order_edges(program)
    with pytest.raises(RewriteError, match="only an FSDP reduce-scatter of a known group"):
        Rewriter(program).unorder(["rs1", name])
    assert _order_edges(program) == before and not program.op("rs1").unordered  # nothing changed


@pytest.mark.parametrize("line", ['%ar = launch "ar"(%g3) {group = "0", unordered}',
                                  '%rsu = launch "rs"(%g1) {role = fsdp_reduce_scatter, unordered}'])
def test_verifier_refuses_the_fact_elsewhere(line):
    key = line.split(" =")[0]
    text = "\n".join(line if row.startswith(key + " =") else row for row in TEXT.splitlines())
    with pytest.raises(VerifyError, match="may be unordered"):
        verify(parse_program(text))


def test_verifier_holds_the_edges_to_the_facts():
    # the fact taken back without the edges: rs1 and rs2 are ordered again, and no edge says so
    program = parse_program(_unordered_text())
    program.replace(attrs.evolve(program.op("rs2"), unordered=False))
    with pytest.raises(VerifyError, match="%rs2: not ordered after %rs1"):
        verify(program)
    # an ordered pair's edge dropped: caught though the schedule keeps it
    program = parse_program(TEXT)
    program.graph.remove_edge("rs1", "rs2")
    with pytest.raises(VerifyError, match="%rs2: not ordered after %rs1"):
        verify(program)
    # ... unless another path orders them
    program.add_effect("rs1", "g3", "explicit")
    program.add_effect("g3", "rs2", "explicit")
    program.schedule.move_before(["g3"], "rs2")
    verify(program)


def test_reordering_an_ordered_one_is_refused():
    program = parse_program(TEXT)
    program.schedule.move_before(["rs2", "w2"], "rs1")
    with pytest.raises(VerifyError, match=r"%rs2: scheduled before %rs1.*collective-order"):
        verify(program)


def test_an_edge_that_also_keeps_storage_order_stays():
    # rs2 reduces into %g1's storage in place (an `out=` collective): rs1 reads it, so they stay
    # ordered by a storage edge, though both are unordered
    text = TEXT.replace('%rs2 = launch "rs"(%g2) {group = "0", role = fsdp_reduce_scatter}',
                        '%rs2 = launch "rs"(%g2, %g1) {group = "0", role = fsdp_reduce_scatter, writes = [%g1], '
                        'alias = %g1}')
    program = parse_program(text)
    assert program.graph.edges["rs1", "rs2"]["why"] == "storage"  # derived: storage first
    # the edge made by collective-order first (as a rewriter edit could leave it)
    program.graph.remove_edge("rs1", "rs2")
    program.add_effect("rs1", "rs2", "collective-order")
    Rewriter(program).unorder(["rs1", "rs2"])
    assert program.graph.edges["rs1", "rs2"]["why"] == "storage"
    verify(program)


def test_collective_order_is_linear():
    # n unordered reduce-scatters between two all-reduces: 2n edges, not n^2
    ops = parse_program(TEXT).op
    ar, rs = ops("ar"), attrs.evolve(ops("rs1"), unordered=True)
    seq = [("a0", attrs.evolve(ar, name="a0"))] + [(f"r{i}", attrs.evolve(rs, name=f"r{i}")) for i in range(50)] \
        + [("a1", attrs.evolve(ar, name="a1"))]
    edges = collective_order(seq)
    assert len(edges) == 100 and ("a0", "r7") in edges and ("r7", "a1") in edges


# ---- on real graphs: bucketed, scheduled, run on two gloo ranks ------------------------------

UNORDERED = ("unorder-reduce-scatters,gradients-first,default,fill-waits",
             "unorder-reduce-scatters,gradients-first,default,bucket,unshard,fill-waits")


def _encoder(width=32):
    import torch  # noqa: F401  (the models are torch modules)

    from fxsched.front import fsdp_joint_graph
    from fxsched.models import build_model

    module, inputs, loss = build_model("encoder", layers=2, width=width, seed=1)
    return fsdp_joint_graph(module, inputs, lambda m, *xs: loss(m(*xs), *xs), 2), module, inputs


def _reduce_scatters(program) -> list[str]:
    from fxsched.ir import Launch, Role

    return [n for n in program.schedule.names()
            if isinstance(op := program.op(n), Launch) and op.role is Role.REDUCE_SCATTER]


def _reordered(before: list[str], after: list[str]) -> bool:
    """Whether two of `before`'s reduce-scatters (present in `after`) ran the other way round."""
    at = {n: i for i, n in enumerate(after)}
    kept = [at[n] for n in before if n in at]
    return kept != sorted(kept)


def test_built_in_model_reorders_its_reduce_scatters_legally():
    import fxsched
    from fxsched.cost import Roofline, hardware
    from fxsched.lowering import lower

    front, _, _ = _encoder(1024)
    traced = _reduce_scatters(lower(front.gm))
    model = Roofline(hardware("h100"))
    for text in UNORDERED:
        done = fxsched.schedule(front.gm, text, cost_model=model)
        verify(done.program)
        assert _reordered(traced, _reduce_scatters(done.program)), text
    # without it: the traced order
    done = fxsched.schedule(front.gm, "gradients-first,default,fill-waits", cost_model=model)
    assert not _reordered(traced, _reduce_scatters(done.program))


def _schedule_on_rank(rank, world_size, pipelines):
    """On one rank: build and schedule the graph itself (as every rank of a job does), check the
    ranks agree on the collective order, run it; its outputs and fingerprints."""
    import torch

    import fxsched
    from fxsched.runtime.agreement import check_ranks_agree

    from ranks import rank_feeds

    torch.set_num_threads(1)
    front, module, inputs = _encoder()
    feeds = rank_feeds(front, module, inputs)[rank]
    out = {"outputs": [], "fingerprints": []}
    for gm in [front.gm] + [fxsched.schedule(front.gm, p).graph_module for p in pipelines]:
        out["fingerprints"].append(check_ranks_agree(gm))
        torch.manual_seed(0)
        with torch.no_grad():
            result = gm(*[t.clone() if isinstance(t, torch.Tensor) else t for t in feeds])
        out["outputs"].append([t.detach() for t in result])
    return out


def test_unordered_schedules_are_bitwise_equal_and_agreed_on_two_ranks():
    import torch

    import fxsched
    from fxsched.runtime import run_ranks

    front, _, _ = _encoder()
    traced = _reduce_scatters(fxsched.schedule(front.gm, "").program)
    for text in UNORDERED:  # the schedules the ranks run do reorder reduce-scatters
        program = fxsched.schedule(front.gm, text).program
        assert _reordered(traced, _reduce_scatters(program)), text
    # and the second buckets some of them: a bucket of unordered ones is unordered
    assert any(program.op(n).bucket and program.op(n).unordered for n in _reduce_scatters(program))
    results = run_ranks(_schedule_on_rank, 2, args=(UNORDERED,), timeout=600)
    # each rank scheduled the graph itself; they agreed (check_ranks_agree raises otherwise) on a
    # fingerprint that is the same on both and differs from the traced order's
    first = results[0]["fingerprints"]
    assert results[1]["fingerprints"] == first and first[0] not in first[1:]
    for rank, r in enumerate(results):
        reference = r["outputs"][0]
        for j, outputs in enumerate(r["outputs"][1:]):
            assert len(outputs) == len(reference)
            for a, b in zip(reference, outputs):
                assert a.dtype == b.dtype and torch.equal(a, b), f"rank {rank}: {UNORDERED[j]} differs"
    assert not torch.equal(results[0]["outputs"][0][0], results[1]["outputs"][0][0])  # different data


def test_a_bucket_of_unordered_ones_is_unordered_and_a_mixed_one_refused():
    from fxsched.passes.bucket_merge import Member, merge

    def members(program):
        return [Member(launch=f"rs{i}", wait=f"w{i}", source=f"g{i}", cast=None, numel=4, nbytes=32, shape=(4,))
                for i in (1, 2)]

    text = TEXT.replace("%g1 = compute \"c\"(%x, %agw)", "%g1 = compute \"c\"(%x, %agw) : f32[8]").replace(
        "%g2 = compute \"c\"(%g1)", "%g2 = compute \"c\"(%g1) : f32[8]").replace(
        'role = fsdp_reduce_scatter}', 'role = fsdp_reduce_scatter, group_size = 2} : f32[4]')
    program = parse_program(text)
    Rewriter(program).unorder(["rs1", "rs2", "rs3", "rs4", "rs5"])
    merge(program, members(program), "reduce-scatter", "b")
    verify(program)
    assert program.op("b").unordered and program.graph.has_edge("b", "ar")  # still before the all-reduce
    program = parse_program(text)
    Rewriter(program).unorder(["rs2"])
    with pytest.raises(RewriteError, match="differ in collective order"):
        merge(program, members(program), "reduce-scatter", "b")
