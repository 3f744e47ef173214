"""Determinism: the schedule depends on the graph and the config only — not on the process.

Every rank runs the pass on its own; reordering collectives is safe only if all of them get the
same order. Checked across processes with different PYTHONHASHSEEDs (string hashing, so set
order, differs between them), and at run time by `runtime.agreement`: a fingerprint of the
collective order and `check_ranks_agree`, which fails with a clear error naming the ranks and
the first differing collective instead of a hang or wrong numbers.
"""

from __future__ import annotations

import json
import operator
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fxsched
from fxsched.front.generate import generate_graph
from fxsched.ir import parse_program, print_program
from fxsched.lowering import lower
from fxsched.passes import DEFAULT_PIPELINE
from fxsched.runtime import init_gloo, run_ranks
from fxsched.runtime.agreement import (ScheduleMismatch, check_ranks_agree, collective_entries, compare_entries,
                                       describe, fingerprint)

from irtest import STACK_AFTER_A_BARRIER

ROOT = Path(__file__).resolve().parent.parent

PIPELINES = [
    DEFAULT_PIPELINE,
    "anchor{forward-depth=3,backward-depth=2},budget{max-in-flight-gb=3.814697265625e-06},prefetch,sink",
    "anchor{forward-depth=2,backward-depth=0,attention=false},prefetch,sink",
    "rewrite",  # the rewrites (unshard, bucket) name and place the ops they create
    "memory-cap,gradients-first,default,unshard,bucket,fill-waits",  # compute moves, checked against a cap
    # reduce-scatters leave their traced order (gradients-first swaps them by summed costs)
    "unorder-reduce-scatters,gradients-first,default,bucket,unshard,fill-waits",
]

# Runs in a fresh interpreter; prints one JSON object: everything a schedule decides.
SCRIPT = textwrap.dedent(r'''
    import hashlib, json, sys
    import fxsched
    from fxsched.front.generate import generate_graph
    from fxsched.ir import parse_program, print_program
    from fxsched.passes import PassManager
    from fxsched.runtime.agreement import fingerprint

    def digest(text):
        return hashlib.sha256(text.encode()).hexdigest()

    pipelines, ir_text = json.loads(sys.argv[1])
    out = {"hash": hash("fxsched determinism")}
    options = dict(seed=11, layers=2, buckets=True, mixed_precision=True, missing_sizes=0.25)
    gm = generate_graph(800, **options)
    out["original"] = [n.name for n in gm.graph.nodes]
    for pipeline in pipelines:
        done = fxsched.schedule(gm, pipeline)
        report = done.report
        report.pop("seconds")
        out[pipeline] = {"order": [n.name for n in done.graph_module.graph.nodes],
                         "code": digest(done.graph_module.code), "ir": digest(print_program(done.program)),
                         "report": report, "fingerprint": fingerprint(done.graph_module)}
    config = fxsched.PassConfig(max_in_flight_gb=8192 / 2**30, fsdp_forward_prefetch_depth=2)
    drop_in = fxsched.overlap_param_gather(gm, config)  # in place: last
    out["drop-in"] = {"order": [n.name for n in drop_in.graph.nodes], "counts": drop_in.meta["fsdp_prefetch"],
                      "anchors": {n.name: n.meta["fsdp_prefetch_anchor"] for n in drop_in.graph.nodes
                                  if "fsdp_prefetch_anchor" in n.meta}}
    program = parse_program(ir_text)
    PassManager(pipelines[1]).run(program)
    out["ir text"] = print_program(program)
    print(json.dumps(out))
''')

IR_TEXT = STACK_AFTER_A_BARRIER


def test_same_schedule_under_different_hash_seeds():
    argument = json.dumps([PIPELINES, IR_TEXT])
    procs = []
    for seed in ("0", "1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-c", SCRIPT, argument], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    hashes = {r.pop("hash") for r in results}
    assert len(hashes) == 3, "the hash seeds did not take effect"
    first = results[0]
    for other in results[1:]:
        for key in first:
            assert other[key] == first[key], f"{key}: differs between hash seeds"
    # the comparison is not vacuous: the pipelines moved gathers, and differently
    assert any(r["moved"] for r in first[PIPELINES[0]]["report"]["gathers"])
    assert all(first[p]["order"] != first["original"] for p in PIPELINES)
    assert first["drop-in"]["anchors"]
    rewrite, moving = first["rewrite"]["report"]["passes"], first[PIPELINES[4]]["report"]["passes"]
    assert rewrite["bucket"]["buckets"] and rewrite["unshard"]["unsharded"]
    assert moving["gradients-first"]["moved"] and moving["fill-waits"]["moved"]
    assert first[PIPELINES[5]]["report"]["passes"]["gradients-first"]["swapped"]


def _with_tensor_parallel_all_reduces(gm: torch.fx.GraphModule, group: str) -> torch.fx.GraphModule:
    """Every third matmul's result all-reduced (and waited) on `group` before its users read it:
    a second process group's collectives, as tensor parallelism puts beside FSDP's."""
    graph, matmuls = gm.graph, (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    for i, node in enumerate(n for n in list(graph.nodes) if n.target in matmuls):
        if i % 3:
            continue
        users = list(node.users)
        with graph.inserting_after(node):
            reduced = graph.call_function(torch.ops._c10d_functional.all_reduce.default, (node, "sum", group))
        with graph.inserting_after(reduced):
            waited = graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (reduced,))
        reduced.meta, waited.meta = dict(node.meta), dict(node.meta)
        for user in users:
            user.replace_input_with(node, waited)
    graph.lint()
    gm.recompile()
    return gm


def test_same_schedule_whatever_the_process_groups_are_called():
    """On a 2-D mesh the ranks that share an FSDP group hold different tensor-parallel groups, so
    their graphs differ in a group's name (torch names groups by creation: rank 0's TP group is
    "1", rank 2's "2"). They must still order their FSDP collectives alike: nothing may sort or
    break ties by a group's name. The same graph under four namings, whose names sort either way
    round, gives one schedule (names written back to F and T)."""
    results = set()
    for fsdp, tp in (("3", "1"), ("3", "5"), ("a", "b"), ("b", "a")):
        gm = _with_tensor_parallel_all_reduces(
            generate_graph(800, seed=11, layers=2, buckets=True, group_name=fsdp), tp)
        texts = []
        for pipeline in PIPELINES:
            done = fxsched.schedule(gm, pipeline)
            text = print_program(done.program, effects=True) + done.graph_module.code
            for name, neutral in ((fsdp, "F"), (tp, "T")):
                text = text.replace(f'"{name}"', neutral).replace(f"'{name}'", neutral).replace(f"comm:{name}", neutral)
            texts.append(text)
        assert "all_reduce" in texts[0] and "group = T" in texts[0] and "group = F" in texts[0]
        results.add(tuple(texts))
    assert len(results) == 1, "a group's name changed a schedule"


# ---- fingerprints --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def graph():
    return generate_graph(800, seed=5, layers=2, buckets=True, mixed_precision=True)


def test_fingerprint_of_a_graph_its_program_and_their_text_agree(graph):
    assert fingerprint(graph) == fingerprint(lower(graph))
    done = fxsched.schedule(graph)
    assert fingerprint(done.graph_module) == fingerprint(done.program)
    assert fingerprint(parse_program(print_program(done.program))) == fingerprint(done.program)
    assert len(fingerprint(graph)) == 64 and int(fingerprint(graph), 16) >= 0


def test_fingerprint_follows_the_collective_order_only(graph):
    original = fingerprint(graph)
    assert fingerprint(fxsched.schedule(graph, "sink").graph_module) == original  # waits moved only
    reordered = fxsched.schedule(graph, "anchor{forward-depth=3},budget,prefetch,sink").graph_module
    assert fingerprint(reordered) != original
    entries = collective_entries(graph)
    assert [e["index"] for e in entries] == list(range(len(entries)))
    gathers = [e for e in entries if e["role"] == "fsdp_all_gather"]
    assert gathers[0]["params"] and gathers[0]["group"] == "0" and gathers[0]["group_size"] == 2
    assert gathers[0]["type"].startswith("bf16[")  # mixed precision: the gathered shard's type
    assert {e["role"] for e in entries} == {"fsdp_all_gather", "fsdp_all_gather_backward", "fsdp_reduce_scatter"}


def swap_two_gathers(gm: torch.fx.GraphModule) -> tuple[str, str]:
    """Launch the second forward gather whose input is a placeholder before the first one."""
    gathers = [n for n in gm.graph.nodes
               if n.meta.get("comm_type") == "fsdp_all_gather" and n.args[0].op == "placeholder"]
    first, second = gathers[0], gathers[1]
    first.prepend(second)
    gm.graph.lint()
    gm.recompile()
    return first.name, second.name


def test_fingerprint_sees_a_swap_a_group_and_a_size():
    gm = generate_graph(400, seed=2, layers=1)
    original = fingerprint(gm)
    swap_two_gathers(gm)
    assert fingerprint(gm) != original
    gm = generate_graph(400, seed=2, layers=1, group_name="tp")
    assert fingerprint(gm) != original


def test_fingerprint_counts_opaque_collectives_in_fx_in_a_program_and_in_its_text():
    """A coalesced collective is a launch (each result waited through its getitem) or, when it is
    not waited so, an opaque op (issue 12): ranks must agree on their order as on any other
    collective's, so the IR fingerprint counts both as the FX one does — waits on no launch are
    waits, not collectives."""
    from torch import fx, nn

    c10d = torch.ops._c10d_functional
    g = fx.Graph()
    a, b, s = (g.placeholder(n) for n in ("a", "b", "s"))
    ag = g.call_function(c10d.all_gather_into_tensor.default, (s, 2, "0"))
    ag.meta.update(comm_type="fsdp_all_gather", param_name="p", fsdp_unsharded_nbytes=64)
    done = g.call_function(c10d.wait_tensor.default, (ag,))
    outs = [done]
    for op, args, waited in ((c10d.all_gather_into_tensor_coalesced.default, ([a, b], 2, "0"), 2),
                             (c10d.reduce_scatter_tensor_coalesced.default, ([a, b], "sum", 2, "0"), 1)):
        coalesced = g.call_function(op, args)  # the reduce-scatter's second result is never waited: opaque
        outs += [g.call_function(c10d.wait_tensor.default, (g.call_function(operator.getitem, (coalesced, i)),))
                 for i in range(waited)]
    g.output(tuple(outs))
    gm = fx.GraphModule(nn.Module(), g)
    program = lower(gm)
    text = print_program(program)
    assert '= launch "_c10d_functional.all_gather_into_tensor_coalesced.default"' in text
    assert '= opaque "_c10d_functional.reduce_scatter_tensor_coalesced.default"' in text
    kinds = [e["kind"].split(".")[1] for e in collective_entries(parse_program(text))]
    assert kinds == ["all_gather_into_tensor", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced"]
    assert fingerprint(gm) == fingerprint(program) == fingerprint(parse_program(text))
    lines = text.splitlines()
    at = [i for i, line in enumerate(lines) if "_coalesced" in line and ("= opaque" in line or "= launch" in line)]
    lines[at[0]], lines[at[1]] = lines[at[1]], lines[at[0]]  # the two coalesced collectives swapped
    assert fingerprint(parse_program("\n".join(lines) + "\n")) != fingerprint(program)


def test_compare_entries_names_the_odd_rank_and_the_first_difference():
    gm = generate_graph(400, seed=2, layers=1)
    good = collective_entries(gm)
    first, second = swap_two_gathers(gm)
    bad = collective_entries(gm)
    assert compare_entries([good, good]) is None
    mismatch = compare_entries([good, good, bad])
    assert mismatch.ranks == [2] and mismatch.agreeing == [0, 1]
    index = next(i for i, (a, b) in enumerate(zip(good, bad)) if a != b)
    assert mismatch.index == index and mismatch.expected == good[index] and mismatch.found == bad[index]
    message = str(mismatch)
    assert message.startswith("ranks disagree on the collective schedule: rank 2 differs from ranks 0, 1 ")
    assert f"first difference at collective #{index}:" in message
    assert f"rank 0: {describe(good[index])}" in message and f"rank 2: {describe(bad[index])}" in message
    assert "would hang or exchange the wrong tensors" in message
    # a rank with fewer collectives: the difference is where its list ends
    short = compare_entries([good, good[:-1]])
    assert short.ranks == [1] and short.index == len(good) - 1 and short.found is None
    assert "rank 1: no collective (its list ends here)" in str(short)
    # two ranks against two: the side of rank 0 is the reference
    assert compare_entries([good, bad, good, bad]).ranks == [1, 3]


def test_check_ranks_agree_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="check_ranks_agree needs an initialised torch.distributed process group"):
        check_ranks_agree(generate_graph(400, seed=2, layers=1))


def test_check_ranks_agree_on_one_rank_returns_the_fingerprint():
    gm = generate_graph(400, seed=2, layers=1)
    init_gloo(dist.HashStore(), 0, 1)
    try:
        assert check_ranks_agree(gm) == fingerprint(gm)
    finally:
        dist.destroy_process_group()


def _agreement_worker(rank, world_size):
    """Both ranks schedule the same graph; then rank 1 swaps two gathers."""
    gm = generate_graph(400, seed=2, layers=1)
    done = fxsched.schedule(gm)
    out = {"agreed": check_ranks_agree(done.graph_module)}
    if rank == 1:
        swap_two_gathers(done.graph_module)
    try:
        check_ranks_agree(done.graph_module)
        out["mismatch"] = None
    except ScheduleMismatch as error:
        out["mismatch"] = {"message": str(error), "ranks": error.ranks, "index": error.index}
    out["fingerprint"] = fingerprint(done.graph_module)
    return out


@pytest.mark.multirank
def test_two_ranks_agree_and_a_swapped_schedule_is_caught():
    results = run_ranks(_agreement_worker, 2, timeout=120)
    assert results[0]["agreed"] == results[1]["agreed"]
    assert results[0]["fingerprint"] != results[1]["fingerprint"]
    for result in results:  # every rank raises, with the same verdict
        mismatch = result["mismatch"]
        assert mismatch is not None and mismatch["ranks"] == [1]
        assert mismatch["message"].startswith("ranks disagree on the collective schedule: rank 1 differs from rank 0")
        assert f"first difference at collective #{mismatch['index']}:" in mismatch["message"]
    assert results[0]["mismatch"] == results[1]["mismatch"]
