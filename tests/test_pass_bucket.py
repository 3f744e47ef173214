"""bucket: the FSDP front's models scheduled with the default pipeline then `bucket`.

The rewritten program verifies, raises to FX that lints and lowers back to the same buckets,
keeps every effect edge of the input (a property over caps and bucket sizes, with the
simulated peak within the cap), and computes bitwise the same loss and gradients as the
unscheduled graph on gloo ranks: at 2 ranks (gather and reduce-scatter buckets), and at 4
ranks for reduce-scatter buckets, where each sum has four addends and their order could
matter. Measured (torch 2.13.0, gloo on CPU, gpt and encoder at width 32): bitwise equal at 4
ranks too: gloo's reduce-scatter of the packed buffer gives every element the same sum, bit
for bit, as the member's own reduce-scatter did (same addends, in an order that does not
depend on where the chunk sits in the buffer, as far as this measures). Nothing guarantees
that for other backends or sizes; the 4-rank test says so the day it changes.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

import fxsched
from fxsched.cost.simulate import simulate
from fxsched.front import fsdp_joint_graph
from fxsched.front.generate import generate_graph, min_nodes
from fxsched.ir import CopyOut, Launch, verify
from fxsched.ir.errors import ConfigError
from fxsched.lowering import lower
from fxsched.models import MODELS, build_model
from fxsched.passes import PassManager
from fxsched.passes.bucket import Bucket
from fxsched.raising import raise_program
from fxsched.runtime import run_ranks

from ranks import GIB, check_bitwise, rank_feeds, run_all
# (model, mixed precision, FSDP buckets): bf16 gathers read a cast of each shard, hoisted with
# it; per-module buckets are kept, and the single gathers around them may still be bucketed
CASES = [(name, None, None) for name in sorted(MODELS)] + [("gpt", torch.bfloat16, None),
                                                            ("encoder", None, "per-module")]
LOOSE = "default,bucket{max-peak-increase-gb=1.0}"


def _front(name, mixed_precision, buckets, world):
    module, inputs, model_loss = build_model(name, layers=2, width=32, seed=1)
    front = fsdp_joint_graph(module, inputs, lambda m, *xs: model_loss(m(*xs), *xs), world,
                             mixed_precision=mixed_precision, buckets=buckets)
    return module, inputs, front


def _stats(done):
    return next(v for k, v in done.result.stats().items() if k.startswith("bucket"))


@pytest.fixture(scope="module")
def scheduled():
    cases = {}
    for case in CASES:
        module, inputs, front = _front(*case, world=2)
        done = fxsched.schedule(front.gm, LOOSE)
        cases[case] = (front, done, rank_feeds(front, module, inputs, 2))
    return cases


def test_options_are_checked():
    with pytest.raises(ConfigError, match="max-bucket-mb"):
        Bucket(max_bucket_mb=-1.0)
    with pytest.raises(ValueError, match="min-saved-ms"):
        Bucket(min_saved_ms=float("nan"))
    assert str(Bucket(max_bucket_mb=64.0, gathers=False)) == "bucket{max-bucket-mb=64.0,gathers=false}"


@pytest.mark.parametrize("case", CASES)
def test_buckets_verify_raise_and_lower_back(scheduled, case):
    front, done, _ = scheduled[case]
    done.graph_module.graph.lint()
    verify(done.program)
    stats = _stats(done)
    buckets = [op for op in done.program.ops() if isinstance(op, Launch) and op.bucket in stats["bought"]]
    assert len(buckets) == stats["buckets"]
    assert stats["step_after_ms"] <= stats["step_before_ms"] and stats["peak_after_bytes"] <= stats["cap_bytes"]
    # every bucket launch is a collective of its members' kind, with all their parameters
    for op in buckets:
        bought = stats["bought"][op.name]
        assert (op.is_gather) == (bought["kind"] == "gather") and len(bought["members"]) >= 2
    # the raised graph lowers back to the same buckets (tags written from the IR) and the same step
    again = lower(done.graph_module)
    relowered = {op.name: op for op in again.ops() if isinstance(op, Launch)}
    for op in buckets:
        assert relowered[op.name].role is op.role and relowered[op.name].types == op.types
        if op.is_gather:  # (lowering reads no bucket or parameters of a reduce-scatter)
            assert relowered[op.name].bucket == op.name
            assert relowered[op.name].params == op.params and relowered[op.name].nbytes == op.nbytes
            copies = [c for c in again.ops() if isinstance(c, CopyOut) and c.bucket == op.name]
            assert len(copies) == len(op.params)
    assert simulate(again).step_ms == pytest.approx(simulate(done.program).step_ms)


def test_bucketing_shortens_the_exposed_models():
    # gpt and encoder leave their first gathers exposed under `default`: packing them pays
    for name in ("gpt", "encoder"):
        module, inputs, front = _front(name, None, None, world=2)
        stats = _stats(fxsched.schedule(front.gm, LOOSE))
        assert stats["gathers bucketed"] > 0 and stats["step_after_ms"] < stats["step_before_ms"]


@pytest.fixture(scope="module")
def default_programs():
    return {case: fxsched.schedule(_front(*case, world=2)[2].gm, "default").program for case in CASES}


@settings(max_examples=25, deadline=None)
@given(case=st.sampled_from(CASES), factor=st.floats(0.9, 1.6), size_mb=st.sampled_from([0.002, 0.02, 256.0]),
       kinds=st.sampled_from(["", ",gathers=false", ",reduce-scatters=false"]))
def test_bucketing_keeps_every_effect_edge_and_the_cap(default_programs, case, factor, size_mb, kinds):
    program = default_programs[case].copy()
    cap_gb = simulate(program).peak_bytes * factor / GIB
    _check_bucketing(program, f"bucket{{max-peak-gb={cap_gb!r},max-bucket-mb={size_mb!r}{kinds}}}", cap_gb * GIB,
                     size_mb)


@settings(max_examples=15, deadline=None)
@given(layers=st.integers(1, 3), attention=st.booleans(), buckets=st.booleans(), mixed_precision=st.booleans(),
       barriers=st.booleans(), reshard=st.booleans(), seed=st.integers(0, 2**16), extra=st.integers(0, 200),
       increase_gb=st.sampled_from([0.0, 1e-5, 1.0]))
def test_generated_graphs_bucket_legally_within_the_cap(layers, attention, buckets, mixed_precision, barriers,
                                                         reshard, seed, extra, increase_gb):
    # generated graphs: barriers, FSDP buckets, mixed precision, no reshard, attention intervals
    options = dict(layers=layers, attention=attention, buckets=buckets, mixed_precision=mixed_precision,
                   barriers=barriers, reshard=reshard, seed=seed)
    program = lower(generate_graph(min_nodes(**options) + extra, **options))
    PassManager("default").run(program)
    peak = simulate(program).peak_bytes
    cap = peak + increase_gb * GIB if increase_gb > 0 else peak
    stats = _check_bucketing(program, f"bucket{{max-peak-increase-gb={increase_gb!r}}}", cap, 256.0)
    raise_program(program).graph.lint()  # every created op builds into FX
    event(f"buckets: {'some' if stats['buckets'] else 'none'}")


def _check_bucketing(program, pipeline: str, cap: float, size_mb: float) -> dict:
    """Run `pipeline` (one bucket pass) on `program`: it verifies, keeps every effect edge of the
    input between the ops still there (an erased member's edges are its bucket's), keeps the
    simulated peak within the cap (or the input's peak, if that was over it already) and each
    bucket within its size; returns the pass's statistics."""
    peak = simulate(program).peak_bytes
    edges = program.effect_edges()
    result = PassManager(pipeline).run(program)
    verify(program)
    after = simulate(program).peak_bytes
    assert after <= max(cap, peak)
    stats = next(iter(result.stats().values()))
    assert stats["peak_after_bytes"] == after
    pos = program.schedule.index
    bucket_of = {m: name for name, b in stats["bought"].items() for m in b["members"]}
    for u, v, _ in edges:
        u2, v2 = bucket_of.get(u, u), bucket_of.get(v, v)
        if u2 in program.graph and v2 in program.graph and u2 != v2:
            assert pos(u2) < pos(v2), (u, v)
    for b in stats["bought"].values():
        assert b["bytes"] <= size_mb * (1 << 20)
    assert not set(bucket_of) & set(program.graph)
    return stats


@pytest.mark.multirank
def test_bucketed_graphs_are_bitwise_equal_on_two_ranks(scheduled):
    jobs = []
    for front, done, feeds in scheduled.values():
        jobs += [(front.gm, feeds), (done.graph_module, feeds)]
    stats = _stats(scheduled[("gpt", None, None)][1])
    assert stats["gathers bucketed"] > 0 and stats["reduce-scatters bucketed"] > 0
    check_bitwise(run_ranks(run_all, 2, args=(jobs,), timeout=600), list(scheduled), "bucketed graph")


@pytest.mark.multirank
def test_reduce_scatter_buckets_are_bitwise_equal_on_four_ranks():
    jobs, keys = [], []
    for name in ("gpt", "encoder"):
        module, inputs, front = _front(name, None, None, world=4)
        done = fxsched.schedule(front.gm, "default,bucket{max-peak-increase-gb=1.0,gathers=false}")
        assert _stats(done)["reduce-scatters bucketed"] > 0
        jobs += [(front.gm, rank_feeds(front, module, inputs, 4)), (done.graph_module, rank_feeds(front, module, inputs, 4))]
        keys.append(name)
    check_bitwise(run_ranks(run_all, 4, args=(jobs,), timeout=600), keys, "reduce-scatter bucketed graph")


def _titan_worker(rank, world_size, pipeline):
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    from torch.distributed.device_mesh import init_device_mesh
    from titan import build_llama3, rematerialise, run_step, trace_step

    from fxsched.integrations.torchtitan import fxsched_pass, param_names

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
    model, inputs = build_llama3(mesh, layers=2)
    traced = rematerialise(trace_step(model, inputs))
    plain = run_step(traced, model, inputs)
    ours = fxsched_pass(pipeline, names=param_names(traced))
    traced.gm = ours(traced.gm, traced.example_inputs)
    (run,) = ours.runs
    stats = next(v for k, v in run["report"]["passes"].items() if k.startswith("bucket"))
    return {"plain": plain, "bucketed": run_step(traced, model, inputs), "gathers bucketed": stats["gathers bucketed"]}


@pytest.mark.multirank
def test_torchtitan_bucketed_step_is_bitwise_equal_on_two_ranks():
    # llama3's debug model under SimpleFSDP: bf16 casts of 2-d shards, gathered on dim 0
    pytest.importorskip("torchtitan.experiments.graph_trainer")
    # bucket first, on the traced order (32 gathers in 2 buckets), then the default pipeline: after
    # `default` nothing is left worth bucketing here (what buckets bought back was the wait of an
    # unread gather stalling the first layer, which `sink` now moves out of the way)
    results = run_ranks(_titan_worker, 2, args=("bucket{max-peak-increase-gb=1.0},default",), timeout=600)
    for rank, r in enumerate(results):
        assert r["gathers bucketed"] >= 2
        for a, b in zip(r["plain"], r["bucketed"], strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), f"rank {rank}: the bucketed step differs"


def _reference_bucket(program, p: Bucket):
    """What `bucket` makes when it merges on a copy and simulates the whole program per trial
    (its algorithm before the incremental trials): {bucket: members}, and the final simulation."""
    from fxsched.cost.model import CostAnalysis
    from fxsched.passes.base import PassContext
    from fxsched.passes.bucket import _Names, _runs, merge
    from fxsched.passes.memory_cap import GIB as _GIB
    from fxsched.passes.memory_cap import rewrite_cap

    analysis = PassContext().get(CostAnalysis, program)
    costs = dict(analysis.ms)
    current = simulate(program, costs=costs)
    cap = rewrite_cap(p.max_peak_gb, p.max_peak_increase_gb, current.peak_bytes, None)
    inflight_cap = max(p.max_in_flight_gb * _GIB, current.max_inflight_bytes)
    names, made = _Names(program), {}
    for kind in [k for k, on in (("gather", p.gathers), ("reduce-scatter", p.reduce_scatters)) if on]:
        for run in _runs(program, kind)[0]:
            start = 0
            while start < len(run):
                members, best, end = [run[start]], None, start + 1
                while end < len(run):
                    trial_members = members + [run[end]]
                    if sum(m.nbytes for m in trial_members) > p.max_bucket_mb * (1 << 20):
                        break
                    trial = program.copy()
                    try:
                        created = merge(trial, trial_members, kind, names.fresh(kind))
                    except Exception:
                        break
                    trial_costs = dict(costs)
                    trial_costs.update({n: analysis.model.op_ms(trial.op(n), trial) for n in created})
                    sim = simulate(trial, costs=trial_costs)
                    without = best[1] if best else current
                    if sim.peak_bytes > cap or sim.max_inflight_bytes > inflight_cap \
                            or not sim.step_ms < without.step_ms - p.min_saved_ms:
                        break
                    members, best = trial_members, (trial, sim, trial_costs)
                    end += 1
                if best is not None:
                    trial, current, costs = best
                    name = names.fresh(kind)
                    names.taken(name)
                    made[name] = [m.launch for m in members]
                    program.graph, program.schedule, program.payload = trial.graph, trial.schedule, trial.payload
                start = end
    return made, current


@settings(max_examples=25, deadline=None)
@given(case=st.sampled_from(CASES), increase=st.sampled_from([0.0, 1e-5, 1e-4, 1.0]),
       size_mb=st.sampled_from([0.002, 0.02, 256.0]), min_saved=st.sampled_from([0.0, 0.001]))
def test_bucketing_makes_what_simulating_each_trial_makes(default_programs, case, increase, size_mb, min_saved):
    """The incremental trials (a stretch of the schedule simulated, the peak from a live-bytes tree)
    make the buckets that merging on a copy and simulating the whole program per trial makes."""
    p = Bucket(max_peak_increase_gb=increase, max_bucket_mb=size_mb, min_saved_ms=min_saved)
    reference_program = default_programs[case].copy()
    made, reference = _reference_bucket(reference_program, p)
    program = default_programs[case].copy()
    stats = next(iter(PassManager([p]).run(program).stats().values()))
    assert {name: b["members"] for name, b in stats["bought"].items()} == made
    after = simulate(program)
    assert after.peak_bytes == reference.peak_bytes
    assert after.step_ms == pytest.approx(reference.step_ms, rel=1e-12)
    assert program.schedule.names() == reference_program.schedule.names()
    event(f"buckets: {'some' if made else 'none'}")


@settings(max_examples=15, deadline=None)
@given(layers=st.integers(1, 3), buckets=st.booleans(), mixed_precision=st.booleans(), barriers=st.booleans(),
       reshard=st.booleans(), seed=st.integers(0, 2**16), extra=st.integers(0, 200),
       increase_gb=st.sampled_from([0.0, 1e-5, 1.0]))
@example(layers=3, buckets=False, mixed_precision=False, barriers=True, reshard=False, seed=0, extra=0,
         increase_gb=0.0)  # a reduce-scatter waited before the next one launches: no bucket
def test_generated_graphs_bucket_as_simulating_each_trial_does(layers, buckets, mixed_precision, barriers, reshard,
                                                               seed, extra, increase_gb):
    options = dict(layers=layers, buckets=buckets, mixed_precision=mixed_precision, barriers=barriers,
                   reshard=reshard, seed=seed)
    program = lower(generate_graph(min_nodes(**options) + extra, **options))
    PassManager("default").run(program)
    p = Bucket(max_peak_increase_gb=increase_gb)
    reference_program = program.copy()
    made, reference = _reference_bucket(reference_program, p)
    stats = next(iter(PassManager([p]).run(program).stats().values()))
    assert {name: b["members"] for name, b in stats["bought"].items()} == made
    assert simulate(program).peak_bytes == reference.peak_bytes
    assert program.schedule.names() == reference_program.schedule.names()


@pytest.mark.parametrize("case", CASES, ids=[f"{n}-{mp or 'f32'}-{b or 'single'}" for n, mp, b in CASES])
def test_each_trials_peak_is_the_simulated_peak_of_its_merge(default_programs, case):
    """Every bucket a run could try — growing from each member, a member at a time, and the
    bucket planned whole — predicts the peak `memory_profile` gives the program merged with it,
    and a growth prices the bucket's own ops as the whole plan does.
    Each reduce-scatter is waited late here (just before its first successor): its gradient,
    and a bucket's pack, are live until the wait, where nothing else reads them. (`default`
    waits on one only once its collective ends, often before the next launch: a bucket of the two
    cannot be made, and this test would try no reduce-scatter bucket.)"""
    from fxsched.cost.model import CostAnalysis
    from fxsched.cost.simulate import memory_profile
    from fxsched.ir import Launch, Role, waits_of
    from fxsched.ir.rewriter import RewriteError
    from fxsched.passes import PassContext
    from fxsched.passes import bucket as B
    from fxsched.passes.bucket_trials import Trials
    program = default_programs[case].copy()
    pos = program.schedule.index
    for launch in [op.name for op in program.ops() if isinstance(op, Launch) and op.role is Role.REDUCE_SCATTER]:
        for wait in waits_of(program, launch):
            program.schedule.move_before([wait], min(program.successors[wait], key=pos))
    ctx = PassContext()
    analysis = ctx.get(CostAnalysis, program)
    checked = 0
    for kind in ("gather", "reduce-scatter"):
        runs, _ = B._runs(program, kind)
        for run in runs:
            trials = Trials(program, dict(analysis.ms), analysis.model)
            for start in range(len(run)):
                grow, members = trials.grow(run[start], kind, "tb"), [run[start]]
                for m in run[start + 1:start + 5]:
                    try:
                        trial = grow.evaluate(m)
                    except RewriteError:
                        break
                    members.append(m)
                    merged = program.copy()
                    B.merge(merged, members, kind, "tb")
                    assert trial.peak_bytes == memory_profile(merged).peak_bytes, [x.launch for x in members]
                    whole = trials.evaluate(members, kind, "tb")
                    assert whole.peak_bytes == trial.peak_bytes
                    # a growth prices the bucket's own ops as the whole plan does (bitwise)
                    assert {n: whole.costs[n] for n in trial.costs} == trial.costs
                    checked += 1
                    trials.show(())
                    grow = trials.grow(run[start], kind, "tb")
                    for joined in members[1:]:
                        grow.evaluate(joined)
                grow.close(None, members)
    assert checked > 0


@settings(max_examples=10, deadline=None)
@given(layers=st.integers(1, 3), buckets=st.booleans(), mixed_precision=st.booleans(), barriers=st.booleans(),
       seed=st.integers(0, 2**16), extra=st.integers(0, 400), min_saved=st.sampled_from([0.0, 0.001]))
def test_trials_sharing_one_base_run_give_what_sweep_trial_gives(layers, buckets, mixed_precision,
                                                                 barriers, seed, extra, min_saved):
    """Every trial the pass makes, answered by the sweep that steps the program as it is once per
    bucket and passes over ops that step no clock, is answered exactly (same floats) as
    `Sweep.trial`, which steps both programs side by side, answers it; a quick answer (run to the
    trial's last touched op, the rest read off the tails) is within a tenth of NEAR_MS of it, and
    its in-flight figure is no lower."""
    from fxsched.cost.simulate import Sweep
    from fxsched.passes import bucket_sweep, bucket_trials

    answers, quick = [], []

    class Both(bucket_sweep._SharedBaseSweep):
        def __init__(self, order, steps):
            super().__init__(order, steps)
            self.plain = Sweep(order, steps)

        def make(self, skip, before):
            super().make(skip, before)
            self.plain.make(skip, before)

        def trial(self, at, end, skip, before):
            got = super().trial(at, end, skip, before)
            want = self.plain.trial(at, end, skip, before)
            answers.append((got, want))
            return got

        def quick(self, at, end, skip, before):
            got = super().quick(at, end, skip, before)
            if got is not None:
                quick.append((got, self.plain.trial(at, end, skip, before)))
            return got

    options = dict(layers=layers, buckets=buckets, mixed_precision=mixed_precision, barriers=barriers, seed=seed)
    program = lower(generate_graph(min_nodes(**options) + extra, **options))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bucket_trials, "_SharedBaseSweep", Both)
        PassManager(f"default,bucket{{min-saved-ms={min_saved}}}").run(program)
    assert answers or quick
    assert all(got == want for got, want in answers), next((g, w) for g, w in answers if g != w)
    far = [(g, w) for g, w in quick if abs(g[0] - w[0]) > bucket_trials.NEAR_MS / 10 or g[1] < w[2]]
    assert not far, far[:3]


def test_a_quick_step_near_what_decides_is_settled_by_the_exact_one():
    """`settle`: a quick step within NEAR_MS of the step a trial must beat, or an in-flight bound
    over the cap, is replaced by the exact figures (and the bucket before it too), so a bucket
    that changes nothing is not taken for a rounding of -1e-12 ms."""
    from fxsched.passes.bucket_trials import Trial, settle

    def trial(step, inflight, exact):
        return Trial(None, {}, frozenset(), {}, (), step, 0, inflight, exact)

    nothing = trial(-1e-12, 10, lambda: (0.0, 10))
    settled, best = settle(nothing, None, 100, 0.0)
    assert (settled.step_ms, best) == (0.0, None)
    assert Bucket().refusal(settled, None, 1e9, 100) == "saves too little"
    assert Bucket().refusal(nothing, None, 1e9, 100) is None  # what the quick figure alone would do
    before = trial(-0.5, 10, lambda: (-0.5 + 2e-9, 10))
    settled, best = settle(trial(-0.5 + 1e-9, 10, lambda: (-0.5 + 2e-9, 10)), before, 100, 0.0)
    assert settled.step_ms == best.step_ms == -0.5 + 2e-9 and settled.exact is None and best.exact is None
    far = trial(-0.4, 10, lambda: pytest.fail("a step far from the decision needs no exact run"))
    assert settle(far, before, 100, 0.0) == (far, before)
    over = trial(-0.4, 200, lambda: (-0.4, 50))
    assert settle(over, before, 100, 0.0)[0].inflight_bytes == 50


def _random_steps(data):
    """A random schedule for the clock: compute ops, launches on two streams (some gathered, some
    in runs back to back), each waited at most once, somewhere after its launch."""
    from fxsched.cost.simulate import LAUNCH, OTHER, WAIT
    n = data.draw(st.integers(4, 60))
    order, steps, open_ = [], {}, []
    costs = st.sampled_from([0.0, 0.0, 0.25, 0.5, 1.0, 1.5, 3.0])
    kind, repeat = "other", 0
    for i in range(n):
        name = f"op{i}"
        if not repeat:  # runs of one kind (launched back to back, waited one by one)
            kind = data.draw(st.sampled_from(["other", "launch", "launch", "wait"]))
            repeat = data.draw(st.integers(1, 5))
        repeat -= 1
        if kind == "wait" and not open_:
            kind = "other"
        if kind == "launch":
            steps[name] = (LAUNCH, data.draw(costs), data.draw(st.sampled_from(["comm:a", "comm:b"])),
                           data.draw(st.sampled_from([0, 0, 64, 100])))
            open_.append(name)
        elif kind == "wait":
            launch = open_.pop(data.draw(st.integers(0, len(open_) - 1)))
            steps[name] = (WAIT, data.draw(costs), None, launch)
        else:
            steps[name] = (OTHER, data.draw(costs), None, None)
        order.append(name)
    return order, steps


def _random_change(data, order, steps, lo, tag, made=frozenset()):
    """A change as a bucket makes one from slot `lo` on: some collectives after it (none a
    change `made` skips) skipped with their waits, a new launch before the first op of the
    change and a new wait on it (with a compute op after) before a later op."""
    from fxsched.cost.simulate import LAUNCH, OTHER, WAIT
    launches = [i for i in range(lo, len(order)) if steps[order[i]][0] == LAUNCH and order[i] not in made]
    if not launches:
        return None
    at = launches[0]
    waits = {steps[n][3]: i for i, n in enumerate(order) if steps[n][0] == WAIT}
    members = [i for i in launches if data.draw(st.booleans()) or i == at]
    skip = {order[i] for i in members} | {order[waits[order[i]]] for i in members if order[i] in waits}
    touched = [order.index(n) for n in skip]
    here = data.draw(st.integers(at, max(touched)))
    new = f"{tag}_launch"
    before = {order[at]: [(new, (LAUNCH, data.draw(st.sampled_from([0.5, 2.0, 4.0])), steps[order[at]][2], 100))]}
    before.setdefault(order[here], []).extend([(f"{tag}_wait", (WAIT, 0.0, None, new)),
                                               (f"{tag}_copy", (OTHER, data.draw(st.sampled_from([0.0, 0.25])),
                                                                None, None))])
    # (a trial may say it ends later than its last touched op: it is run to there)
    return at, data.draw(st.integers(max(touched + [here]), len(order) - 1)), skip, before


@settings(max_examples=500, deadline=None)
@given(data=st.data())
def test_quick_trials_step_as_the_exact_sweep_on_random_schedules(data):
    """`_SharedBaseSweep.quick` (stretches it leaves alone stepped at once: launch runs, maps of
    the compute time; the rest read off the tails) gives the step change `Sweep.trial` (both
    programs stepped side by side until they run the same) gives, within a tenth of NEAR_MS, and
    an in-flight bound no lower than its level, on random schedules of two streams, for trials
    before and after a change is made (and through its changes), several from one first slot
    (as a bucket grows)."""
    from fxsched.cost.simulate import Sweep
    from fxsched.passes.bucket_sweep import _SharedBaseSweep
    from fxsched.passes.bucket_trials import NEAR_MS
    order, steps = _random_steps(data)
    fast, plain = _SharedBaseSweep(order, steps), Sweep(order, steps)
    lo, compared, made = 0, 0, set()
    for round_ in range(4):
        change = _random_change(data, order, steps, lo, f"b{round_}", made)
        if change is None:
            break
        at, end, skip, before = change
        for _ in range(data.draw(st.integers(1, 3))):  # trials from one slot, as a growing bucket's
            got = fast.quick(at, end, skip, before)
            want = plain.trial(at, end, skip, before)
            if got is not None:
                assert abs(got[0] - want[0]) <= NEAR_MS / 10, (got, want)
                assert got[1] >= want[2], (got, want)
                compared += 1
            more = _random_change(data, order, steps, at, f"g{round_}", made)
            if more is None or more[0] != at:
                break
            end, skip = max(end, more[1]), skip | more[2]
        if data.draw(st.booleans()):  # made: the next trials run through its waits and steps
            fast.make(set(skip), before)
            plain.make(set(skip), before)
            made |= skip
        lo = at + 1
    event(f"compared {min(compared, 3)}")


def test_a_quick_trials_launch_run_stops_at_its_own_skipped_launch():
    """Launches back to back, a bucket made of the first (its wait among the others'), then a
    trial of the second and the fourth: the run of launches stepped at once before the fourth
    stops there (it is skipped), though the next change the sweep made is further on."""
    from fxsched.cost.simulate import LAUNCH, OTHER, WAIT, Sweep
    from fxsched.passes.bucket_sweep import _SharedBaseSweep
    order = ["a", "b", "c", "d", "wa", "wb", "wc", "wd", "x"]
    steps = {n: (LAUNCH, 1.0, "comm:0", 0) for n in "abcd"}
    steps.update({f"w{n}": (WAIT, 0.0, None, n) for n in "abcd"})
    steps["x"] = (OTHER, 1.0, None, None)
    fast, plain = _SharedBaseSweep(order, steps), Sweep(order, steps)
    made = ({"a", "wa"}, {"a": [("A", (LAUNCH, 0.5, "comm:0", 0))], "wa": [("wA", (WAIT, 0.0, None, "A"))]})
    for sweep in (fast, plain):
        sweep.make(*made)
    change = (1, 7, {"b", "d", "wb", "wd"}, {"b": [("B", (LAUNCH, 1.5, "comm:0", 0))],
                                               "wb": [("wB", (WAIT, 0.0, None, "B"))]})
    got, want = fast.quick(*change), plain.trial(*change)
    assert got is not None and got[0] == pytest.approx(want[0], abs=1e-12) and want[0] < 0


def test_a_quick_trials_jump_launches_after_a_wait_on_what_was_in_flight():
    """A stretch jumped at once (`_Piece`) that waits on a collective in flight before the trial
    and then launches on another stream: that launch starts when the wait ends (not when the
    stretch starts), and its end, read off the tails after the trial, decides the step."""
    from fxsched.cost.simulate import LAUNCH, OTHER, WAIT, Sweep
    from fxsched.passes.bucket_sweep import _SharedBaseSweep
    order = ["a", "m", "wa", "c", "wm", "x1", "wc", "y"]
    steps = {"a": (LAUNCH, 5.0, "comm:0", 0), "m": (LAUNCH, 1.0, "comm:0", 0), "wa": (WAIT, 0.0, None, "a"),
             "c": (LAUNCH, 1.0, "comm:1", 0), "wm": (WAIT, 0.0, None, "m"), "x1": (OTHER, 0.0, None, None),
             "wc": (WAIT, 0.0, None, "c"), "y": (OTHER, 10.0, None, None)}
    fast, plain = _SharedBaseSweep(order, steps), Sweep(order, steps)
    change = (1, 4, {"m", "wm"}, {"m": [("B", (LAUNCH, 0.5, "comm:0", 0))], "wm": [("wB", (WAIT, 0.0, None, "B"))]})
    got, want = fast.quick(*change), plain.trial(*change)
    assert got is not None and got[0] == pytest.approx(want[0], abs=1e-12)
    assert fast.base_step == pytest.approx(16.0)  # c ends at 6, then 10 ms of compute


@pytest.mark.parametrize("seed", [0, 1])
def test_a_piece_gone_on_from_a_kept_scan_is_the_piece_scanned_afresh(seed):
    """`_SharedBaseSweep._piece` goes on from the scan it kept for the same first slot, across
    trials and makes (the generated graphs' forward launches its gathers back to back and waits
    them far later: bucket after bucket asks for a longer piece from one slot): every piece
    the pass asks for is, field by field and float for float, the piece scanned from its
    first slot afresh; and pieces do go on from kept scans, across makes."""
    from fxsched.passes import bucket_pieces, bucket_sweep, bucket_trials

    counts = {"resumed": 0, "resumed after a make": 0, "pieces": 0}
    bad = []

    class Checked(bucket_sweep._SharedBaseSweep):
        def _piece(self, lo, hi):
            old = self.scans.get(lo)
            if old is not None and old.hi <= hi:
                seen = old.makes
                holds = self._scan_holds(old)
                old.makes = seen  # (as it was: `_piece` checks it again)
                if holds:
                    counts["resumed"] += 1
                    counts["resumed after a make"] += seen < len(self.makes)
            got = super()._piece(lo, hi)
            fresh = bucket_pieces._Scan(lo, len(self.makes))
            self._scan(fresh, hi)
            want = False if fresh.false else bucket_pieces._Piece(
                fresh.a, fresh.b, tuple(fresh.waited), fresh.stream, fresh.fa, fresh.fb, fresh.fc,
                dict(fresh.launches), tuple(fresh.tails), fresh.high, fresh.rise)
            counts["pieces"] += 1
            if got != want or (got is not False and got.launches != want.launches):
                bad.append((lo, hi, got, want))
            return got

    program = lower(generate_graph(4000, seed=seed))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bucket_trials, "_SharedBaseSweep", Checked)
        PassManager("default,bucket").run(program)
    assert not bad, bad[:2]
    assert counts["resumed after a make"] > 0, counts


def test_a_make_inside_a_kept_scan_has_the_piece_scanned_again():
    """A kept scan of [2, 5) (a wait on a launch before the trials' first slot among compute),
    then a make that skips a compute op inside it: the longer piece asked for next is scanned
    afresh (the skipped op's time gone), not gone on from the kept scan; one made after it
    leaves it kept."""
    from fxsched.cost.simulate import LAUNCH, OTHER, WAIT
    from fxsched.passes.bucket_sweep import _SharedBaseSweep
    order = ["a", "x0", "x1", "wa", "x2", "x3", "x4", "x5"]
    steps = {"a": (LAUNCH, 5.0, "comm:0", 0), "wa": (WAIT, 0.0, None, "a")}
    steps.update({f"x{i}": (OTHER, 1.0 + i, None, None) for i in range(6)})
    sweep = _SharedBaseSweep(order, steps)
    sweep.advance(2)
    first = sweep._piece(2, 5)
    assert (first.a, first.b) == (2.0 + 3.0, 5.0 + 3.0)  # x1, then the wait on a (ends at 5), then x2
    sweep.make({"x5"}, {})       # after the kept scan: it holds
    assert sweep._piece(2, 6).a == 2.0 + 3.0 + 4.0 and sweep.scans[2].hi == 6
    sweep.make({"x2"}, {})       # inside it: scanned again, without x2
    again = sweep._piece(2, 7)
    assert (again.a, again.b) == (2.0 + 4.0 + 5.0, 5.0 + 4.0 + 5.0)


def test_a_bucket_growing_a_member_at_a_time_jumps_the_chain_its_last_trial_kept():
    """The stretches a growing bucket's trial jumps one after another are one map (`_compose`),
    kept for the next trial from the same slot (`_SharedBaseSweep._chain`), which jumps it and
    then its own new stretches: on a generated graph the kept chains are taken, and every quick
    trial's figures are those of the same trials without them (each stretch jumped on its own)
    up to rounding (1e-9 ms; NEAR_MS, where the exact sweep decides, is 1e-6), the in-flight
    bound exactly; and so the same buckets."""
    from fxsched.passes import bucket_sweep, bucket_trials

    class Counting(dict):
        hits = 0

        def get(self, key, default=None):
            got = super().get(key, default)
            Counting.hits += got is not None
            return got

    class Never(dict):
        def get(self, key, default=None):
            return default

    def run(chains):
        answers = []

        class Recording(bucket_sweep._SharedBaseSweep):
            def quick(self, at, end, skip, before):
                got = super().quick(at, end, skip, before)
                answers.append(got)
                return got

        class Walk(bucket_sweep._Walk):
            __slots__ = ()

            def __init__(self, *args):
                super().__init__(*args)
                self.chains = chains()

        program = lower(generate_graph(4000, seed=0))
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(bucket_trials, "_SharedBaseSweep", Recording)
            patch.setattr(bucket_sweep, "_Walk", Walk)
            result = PassManager("default,bucket").run(program)
        return answers, result.results[-1][1].stats["bought"]

    kept, bought = run(Counting)
    assert Counting.hits > 0
    plain, plain_bought = run(Never)
    assert len(kept) == len(plain) and bought.keys() == plain_bought.keys()
    for got, want in zip(kept, plain):
        assert (got is None) == (want is None)
        if got is not None:
            assert got[0] == pytest.approx(want[0], abs=1e-9) and got[1] == want[1]


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_a_composed_chain_jumps_as_its_pieces_jumped_in_turn(data):
    """`_compose`: two pieces (a stream or none, launches, waits on what was in flight, tails)
    jumped as one map leave the trial's compute time, stream, in-flight level and peak, whether
    the level moved, each launch's end and the largest end + tail as jumping one then the other
    does (up to rounding)."""
    import math

    from fxsched.cost.simulate import Clock
    from fxsched.passes.bucket_pieces import _compose, _Piece
    from fxsched.passes.bucket_sweep import _Walk

    ninf = -math.inf
    time_ = st.floats(0.0, 10.0)
    maybe = st.one_of(st.just(ninf), time_)
    pending = {f"p{i}": data.draw(st.integers(0, 4)) for i in range(4)}
    names = iter(range(100))

    def piece(free_names):
        stream = data.draw(st.sampled_from([None, "comm:0"]))
        launches = {}
        if stream is not None:
            for _ in range(data.draw(st.integers(1, 3))):
                launches[f"l{next(names)}"] = (data.draw(time_), data.draw(time_), data.draw(maybe),
                                               data.draw(st.integers(0, 3)))
        waited = tuple(n for n in free_names if data.draw(st.booleans()))
        for n in waited:
            free_names.remove(n)
        fa, fb, fc = (data.draw(time_), data.draw(time_), data.draw(maybe)) if stream else (ninf, 0.0, ninf)
        tails = tuple(data.draw(maybe) for _ in range(3)) if stream else (ninf, ninf, ninf)
        return _Piece(data.draw(time_), data.draw(maybe), waited, stream, fa, fb, fc, launches, tails,
                      data.draw(st.integers(0, 5)), sum(x[3] for x in launches.values()))

    free_names = list(pending)
    first, then = piece(free_names), piece(free_names)
    composed = _compose(first, then, pending)
    assert composed is not None

    def walk():
        clock = Clock()
        clock.t, clock.level = data.draw(time_, label="t"), 7
        clock.free = {"comm:0": data.draw(time_, label="free")}
        clock.pending = dict(pending)
        w = _Walk.__new__(_Walk)
        w.t, w.level, w.peak, w.last = clock.t, clock.level, 0, clock.t
        w.free, w.pending, w.own, w.runs, w.jumped = dict(clock.free), dict(clock.pending), {}, [], []
        return w

    one, both = walk(), None
    t0, f0 = one.t, one.free["comm:0"]
    both = walk()
    both.t, both.free = t0, {"comm:0": f0}
    one.jump(first)
    one.jump(then)
    both.jump(composed)
    assert both.t == pytest.approx(one.t, abs=1e-12)
    assert both.free["comm:0"] == pytest.approx(one.free["comm:0"], abs=1e-12)
    assert (both.level, both.peak, both.pending) == (one.level, one.peak, one.pending)
    assert math.isnan(both.last) == math.isnan(one.last)
    for name in {**first.launches, **then.launches}:
        assert both._wait_in_piece(name)[0] == pytest.approx(one._wait_in_piece(name)[0], abs=1e-12)

    def tail(w):
        return max([max(t + p.tails[0], f + p.tails[1], p.tails[2]) for p, t, f, _ in w.jumped], default=ninf)
    assert tail(both) == pytest.approx(tail(one), abs=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
def test_pieces_made_from_each_launch_to_one_slot_are_the_pieces_scanned(seed):
    """`_SharedBaseSweep._suffixes`: the pieces [s, hi) it makes at once for every slot s just
    after a launch (each the piece between two of them composed with the one from the next) are
    the pieces a scan of [s, hi) makes, up to rounding (1e-9 ms), their launches' ends too (read
    where asked, through `_Launches`); and the pass does make them on a generated graph."""
    import math

    from fxsched.passes import bucket_pieces, bucket_sweep, bucket_trials

    made, bad = [], []

    def close(x, y):
        return x == y or (math.isfinite(x) and math.isfinite(y) and abs(x - y) <= 1e-9)

    class Checked(bucket_sweep._SharedBaseSweep):
        def _suffixes(self, qb, lo, hi):
            super()._suffixes(qb, lo, hi)
            for (s, h), got in list(qb.pieces.items()):
                if h != hi or s < lo:
                    continue
                made.append((s, h))
                fresh = bucket_pieces._Scan(s, len(self.makes))
                self._scan(fresh, h)
                if fresh.false or got is False:
                    if not (fresh.false and got is False):
                        bad.append((s, h, got, "false"))
                    continue
                scalars = [(got.a, fresh.a), (got.b, fresh.b), (got.fa, fresh.fa), (got.fb, fresh.fb),
                           (got.fc, fresh.fc), *zip(got.tails, fresh.tails)]
                ends = dict(got.launches)
                same = (all(close(x, y) for x, y in scalars) and got.stream == fresh.stream
                        and got.waited == tuple(fresh.waited) and (got.high, got.rise) == (fresh.high, fresh.rise)
                        and ends.keys() == fresh.launches.keys()
                        and all(close(x, y) for n in ends for x, y in zip(ends[n], fresh.launches[n]))
                        and all(got.launches.get(n) == ends[n] for n in ends))
                if not same:
                    bad.append((s, h, got, fresh))

    program = lower(generate_graph(4000, seed=seed))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bucket_trials, "_SharedBaseSweep", Checked)
        PassManager("default,bucket").run(program)
    assert made and not bad, (len(made), bad[:2])
