"""Property tests: whatever the graph and the pipeline, a schedule is legal, within budget and stable.

Graphs are drawn two ways: tagged FX joint graphs from `front/generate.py` (layers, buckets,
casts, barriers, attention, missing sizes, resharding) and IR text programs built op by op.
Pipelines draw depths 0-3 and budgets from 0 through a few gathers' worth to 1 GiB. Every
property is checked by code written here from the graph itself — FX edges and tags, storage
identity of `meta["val"]`, IR operands — not by asking the IR's effect edges:

- the result lints and is a topological order (and `ir.verify` passes);
- no movable node changed its barrier segment or its phase;
- every reader of a freed storage precedes the free; a parameter's gathers and frees keep
  their order (a re-gather follows its free);
- non-FSDP collectives keep their relative order, and random ops theirs;
- early bytes in flight (each gather launched early, from its launch to its first consumer)
  never exceed the budget, and an early gather has a known size;
- a second run moves nothing to another place: every launch chain and realization node stays
  between the same two other nodes (see `test_second_run_can_reorder_within_a_stack` for
  the order inside such a stack).

CI runs a few examples per test, derandomized; `scripts/fuzz.py --examples 2000` (or
`FXSCHED_FUZZ_EXAMPLES=2000`) runs thousands with random seeds.
"""

from __future__ import annotations

import functools
import operator
import os
from collections import defaultdict

import pytest
import torch
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st
from torch import fx
from torch._library.utils import _RANDOM_FUNCTIONS
from torch.multiprocessing.reductions import StorageWeakRef

import fxsched
from fxsched.front.generate import generate_graph, min_nodes
from fxsched.ir import (Barrier, Compute, CopyOut, Free, Input, Launch, Marker, Output, ParseError, Phase, Role, View,
                        VerifyError, Wait, parse_program, print_program, verify)
from fxsched.lowering import lower
from fxsched.passes import DEFAULT_PIPELINE, REFERENCE_PIPELINE, PassManager

from irtest import STACK_AFTER_A_BARRIER
from ranks import GIB
from reproducers import reproducer_on_failure
from test_reference_oracle import clone, oracle, outcome
from test_reference_oracle import config as ref_config

FUZZ = int(os.environ.get("FXSCHED_FUZZ_EXAMPLES", "0") or 0)
FUZZ_GRAPHS = int(os.environ.get("FXSCHED_FUZZ_GRAPH_EXAMPLES", "0") or 0) or FUZZ


def examples(ci: int, graphs: bool = False) -> settings:
    """`ci` derandomized examples in CI; when fuzzing (scripts/fuzz.py), FXSCHED_FUZZ_EXAMPLES
    random ones (FXSCHED_FUZZ_GRAPH_EXAMPLES for tests that generate FX graphs)."""
    fuzz = FUZZ_GRAPHS if graphs else FUZZ
    return settings(max_examples=fuzz or ci, deadline=None, derandomize=not fuzz, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


GATHER_TAGS = ("fsdp_all_gather", "fsdp_all_gather_backward")
FREE_TAGS = ("fsdp_reshard_free", "fsdp_reshard_free_backward")
COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional")
CASTS = ("prims::convert_element_type", "aten::_to_copy")


# ============================================================================================
# FX: what the test itself reads off a graph
# ============================================================================================

def _schema(node: fx.Node):
    return getattr(node.target, "_schema", None) if node.op == "call_function" else None


def _collective(node: fx.Node) -> bool:
    schema = _schema(node)
    return schema is not None and schema.name.split("::")[0] in COLLECTIVE_NAMESPACES


def _wait(node: fx.Node) -> bool:
    return _collective(node) and _schema(node).name.endswith("::wait_tensor")


def _gather(node: fx.Node) -> bool:
    return (_collective(node) and _schema(node).name.endswith("::all_gather_into_tensor")
            and node.meta.get("comm_type") in GATHER_TAGS)


def _group(node: fx.Node):
    """A collective's process group name (its `group_name` argument), None if it has none."""
    for at, argument in enumerate(_schema(node).arguments):
        if argument.name == "group_name":
            return node.args[at] if at < len(node.args) else node.kwargs.get("group_name")
    return None


def _keeps_order(names: list[str], pos: dict[str, int], free) -> None:
    """Every pair of `names` (in their order before) is in that order at `pos`, unless
    `free(x, y)` (two unordered reduce-scatters of one group)."""
    for i, x in enumerate(names):
        for y in names[i + 1:]:
            assert pos[x] < pos[y] or free(x, y), f"collectives %{x} and %{y} changed their order"


def _free(node: fx.Node) -> bool:
    return node.meta.get("comm_type") in FREE_TAGS


def _view(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target is operator.getitem:
        return True
    schema = _schema(node)
    return (schema is not None and bool(schema.returns) and schema.returns[0].alias_info is not None
            and not schema.returns[0].alias_info.is_write)


def _barrier(node: fx.Node) -> bool:
    """A side-effecting call that is not a free, a functional collective or an in-place write (a
    write orders against its storage's users only: issue 12), or any node tagged `barrier`."""
    if node.meta.get("barrier"):
        return True
    if node.op not in ("call_function", "call_method", "call_module") or _free(node) or _collective(node):
        return False
    schema = _schema(node)
    python_random = node.op == "call_function" and node.target in _RANDOM_FUNCTIONS  # RNG state only
    return not (schema is not None and schema.is_mutable) and not python_random and node.is_impure(impure_random=False)


def _written(node: fx.Node) -> set:
    """The storages (val identity) of the arguments a call's schema writes."""
    schema = _schema(node)
    out = set()
    if schema is not None:
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
                if isinstance(value, fx.Node):
                    out |= _storages(value)
    return out


def _phased(node: fx.Node) -> bool:
    return node.op not in ("placeholder", "get_attr", "output")


def _params(node: fx.Node) -> tuple[str, ...]:
    members = node.meta.get("fsdp_bucket_members")
    if node.meta.get("fsdp_bucket_id") is not None or (_free(node) and members):
        return tuple(members or ())
    name = node.meta.get("param_name")
    return (name,) if isinstance(name, str) else ()


def _nbytes(node: fx.Node) -> int | None:
    value = node.meta.get("fsdp_unsharded_nbytes")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _realization(launch: fx.Node) -> set[fx.Node]:
    """The wait, the views reached from it, and (for a bucket) its own copy-outs."""
    users = list(launch.users)
    if len(users) != 1 or not _wait(users[0]):
        return set()
    bucket = launch.meta.get("fsdp_bucket_id")
    found, stack = {users[0]}, [users[0]]
    while stack:
        for user in stack.pop().users:
            copy_out = (bucket is not None and user.target is torch.ops.aten.clone.default
                        and user.meta.get("fsdp_bucket_copy_out") == bucket)
            if user not in found and (_view(user) or copy_out):
                found.add(user)
                stack.append(user)
    return found


def _chain(launch: fx.Node) -> set[fx.Node]:
    """What moves with a launch: a bucket's private pack DAG, or a lone cast of a placeholder."""
    chain = {launch}
    if launch.meta.get("fsdp_bucket_id") is not None:
        stack = list(launch.all_input_nodes)
        while stack:
            node = stack.pop()
            if node in chain or not _phased(node) or _barrier(node) or _free(node):
                continue
            if all(user in chain for user in node.users):
                chain.add(node)
                stack.extend(node.all_input_nodes)
        return chain
    source = launch.args[0]
    if (isinstance(source, fx.Node) and _schema(source) is not None and _schema(source).name in CASTS
            and len(source.users) == 1 and all(a.op == "placeholder" for a in source.all_input_nodes)):
        chain.add(source)
    return chain


def _storage(value):
    if isinstance(value, torch.Tensor):
        try:
            return StorageWeakRef(value.untyped_storage()).cdata
        except Exception:  # noqa: BLE001 - a value without storage aliases nothing
            return None
    return None


def _storages(node: fx.Node) -> set:
    value = node.meta.get("val")
    values = value if isinstance(value, (tuple, list)) else (value,)
    return {s for s in map(_storage, values) if s is not None}


class FxFacts:
    """Everything the checks need from one graph, by node name."""

    def __init__(self, gm: fx.GraphModule | fx.Graph):
        self.nodes = list(gm.graph.nodes if isinstance(gm, fx.GraphModule) else gm.nodes)
        self.by_name = {n.name: n for n in self.nodes}
        self.pos = {n.name: i for i, n in enumerate(self.nodes)}
        self.gathers = [n.name for n in self.nodes if _gather(n)]
        self.realization = {g: {n.name for n in _realization(self.by_name[g])} for g in self.gathers}
        self.chain = {g: {n.name for n in _chain(self.by_name[g])} for g in self.gathers}
        self.realized = set().union(*self.realization.values()) if self.gathers else set()
        barriers = 0
        self.segment, self.barriers = {}, []
        for n in self.nodes:
            if _barrier(n):
                barriers += 1
                self.barriers.append(n.name)
            self.segment[n.name] = barriers

    def first_consumer(self, gather: str) -> str | None:
        realization = self.realization[gather]
        users = {u.name for r in realization for u in self.by_name[r].users} - realization
        return min(users, key=self.pos.get) if users else None

    def fsdp_nodes(self) -> set[str]:
        return set().union(*self.chain.values(), *self.realization.values()) if self.gathers else set()

    def gaps(self) -> tuple[list[str], dict[str, tuple[str | None, str | None]]]:
        """The other nodes in order, and for each launch-chain/realization node the two other
        nodes it sits between."""
        movable = self.fsdp_nodes()
        fixed, between, pending, previous = [], {}, [], None
        for n in self.nodes:
            if n.name in movable:
                pending.append(n.name)
                continue
            fixed.append(n.name)
            between.update((p, (previous, n.name)) for p in pending)
            pending, previous = [], n.name
        between.update((p, (previous, None)) for p in pending)
        return fixed, between


def moved_early(before: FxFacts, after: FxFacts) -> set[str]:
    """Gathers some node went from before to after their launch — other than a realization node
    or a wait (passes sink those down, e.g. a reduce-scatter's wait under overlap-reduce-scatter)."""
    early = set()
    for g in before.gathers:
        for name, p in before.pos.items():
            if p >= before.pos[g]:
                break
            if name not in before.realized and not _wait(before.by_name[name]) and after.pos[name] > after.pos[g]:
                early.add(g)
                break
    return early


def budget_sweep(after: FxFacts, early: set[str], sizes: dict[str, int]) -> int:
    """The most early bytes in flight at once: each early gather from its launch to (not
    including) its first consumer."""
    events = []
    for g in early:
        consumer = after.first_consumer(g)
        end = after.pos[consumer] if consumer is not None else len(after.nodes)
        events += [(after.pos[g], 1, sizes[g]), (end, 0, -sizes[g])]
    peak = current = 0
    for _, _, delta in sorted(events):  # ends (0) before starts (1) at one position
        current += delta
        peak = max(peak, current)
    return peak


def check_fx_schedule(original: fx.GraphModule, scheduled: fx.GraphModule, limit: int | None,
                      prefetched: set[str] | None = None, *, compute_moves: bool = False,
                      unordered: set[str] = frozenset()) -> tuple[FxFacts, FxFacts, set[str]]:
    """Every property of a schedule of `original`; `limit`: the budget in bytes (None: no budget
    pass); `prefetched`: the gathers the program says it moved (None: unknown). `compute_moves`:
    the pipeline reorders compute (gradients-first, fill-waits), so a node that went from before a
    gather's launch to after it does not mean the gather was prefetched: the early-gather and
    budget checks are left out, every rule before them holds still. `unordered`: the
    reduce-scatters the program marked unordered (`unorder-reduce-scatters`): two of one group may
    swap (each must be an FSDP reduce-scatter of a known group)."""
    scheduled.graph.lint()
    before, after = FxFacts(original), FxFacts(scheduled)
    assert sorted(before.pos) == sorted(after.pos), "the node set changed"
    for node in after.nodes:  # a topological order, read off FX edges
        for arg in node.all_input_nodes:
            assert after.pos[arg.name] < after.pos[node.name], f"{node.name} runs before its input {arg.name}"

    # phases: every forward node before every backward one (the input was so)
    for facts in (before, after):
        forward = [facts.pos[n.name] for n in facts.nodes if _phased(n) and not n.meta.get("autograd_backward")]
        backward = [facts.pos[n.name] for n in facts.nodes if _phased(n) and n.meta.get("autograd_backward")]
        if forward and backward:
            assert max(forward) < min(backward), "a node crossed the forward/backward boundary"

    # barriers: same order, and no node changed its barrier segment
    assert before.barriers == after.barriers, "barriers changed their order"
    crossed = [n for n in before.pos if before.segment[n] != after.segment[n]]
    assert not crossed, f"nodes crossed a barrier: {crossed[:5]}"

    # frees: every reader of the freed storage (storage identity of the vals) runs before it
    for facts in (before, after):
        holders = defaultdict(list)
        for node in facts.nodes:
            for storage in _storages(node):
                holders[storage].append(node)
        for node in facts.nodes:
            if not _free(node) or not node.all_input_nodes:
                continue
            for storage in _storages(node.all_input_nodes[0]):
                readers = {u.name for holder in holders[storage] for u in holder.users} - {node.name}
                late = [r for r in readers if facts.pos[r] > facts.pos[node.name]]
                assert not late, f"{late[:3]} read the storage {node.name} freed, after the free"

    # storages: a node that writes one (val identity) keeps its order with every node touching it
    def touching(facts: FxFacts) -> dict:
        touch = defaultdict(set)
        for node in facts.nodes:
            for arg in node.all_input_nodes:
                for storage in _storages(arg):
                    touch[storage].add(node.name)
        return touch

    touched = touching(before)
    for node in before.nodes:
        for storage in _written(node):
            for other in touched[storage] - {node.name}:
                assert (before.pos[other] < before.pos[node.name]) == (after.pos[other] < after.pos[node.name]), (
                    f"{other} and {node.name}, which writes the storage it touches, changed their order")

    # a parameter's gathers and frees keep their order: a re-gather follows its free
    def lifetimes(facts: FxFacts) -> dict[str, list[str]]:
        events = defaultdict(list)
        for node in facts.nodes:
            if _gather(node) or _free(node):
                for param in _params(node):
                    events[param].append(node.name)
        return events

    assert lifetimes(before) == lifetimes(after), "a parameter's gathers and frees changed order"

    # non-FSDP collectives keep their order, and random ops theirs (they share the generator);
    # one against the other is free: a collective does not touch the RNG
    def fixed_order(facts: FxFacts) -> tuple[list[str], list[str]]:
        return ([n.name for n in facts.nodes if _collective(n) and not _wait(n) and not _gather(n)],
                [n.name for n in facts.nodes
                 if isinstance(n.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in n.target.tags])

    collectives, randoms = fixed_order(before)
    assert randoms == fixed_order(after)[1], "random ops changed their order"
    nodes = {n.name: n for n in before.nodes}
    for name in unordered:
        assert nodes[name].meta.get("comm_type") == "fsdp_reduce_scatter" and _group(nodes[name]) is not None, name
    _keeps_order(collectives, after.pos, lambda x, y: x in unordered and y in unordered
                 and _group(nodes[x]) == _group(nodes[y]))
    if compute_moves:
        return before, after, set()

    # the budget: early gathers have a known size and stay under it together
    early = moved_early(before, after)
    if prefetched is not None:
        assert early <= prefetched, f"moved early but not reported: {sorted(early - prefetched)}"
    if limit is not None:
        unknown = [g for g in early if _nbytes(before.by_name[g]) is None]
        assert not unknown, f"gathers of unknown size moved early: {unknown}"
        peak = budget_sweep(after, early, {g: _nbytes(before.by_name[g]) for g in early})
        assert peak <= limit, f"{peak} early bytes in flight, over the budget of {limit}"
    return before, after, early


def assert_same_places(once: fx.GraphModule | fx.Graph, twice: fx.GraphModule | fx.Graph) -> None:
    """A second run moved nothing to another place: the other nodes keep their order and every
    launch-chain or realization node sits between the same two of them."""
    fixed_once, gaps_once = FxFacts(once).gaps()
    fixed_twice, gaps_twice = FxFacts(twice).gaps()
    assert fixed_once == fixed_twice, "a second run changed the order of the other nodes"
    moved = {n: (gaps_once[n], gaps_twice.get(n)) for n in gaps_once if gaps_once[n] != gaps_twice.get(n)}
    assert not moved, f"a second run moved nodes to other places: {dict(list(moved.items())[:5])}"


def prefetched_launches(program) -> set[str]:
    return {op.name for op in program.ops() if isinstance(op, Launch) and op.prefetched}


# ============================================================================================
# strategies
# ============================================================================================

BUDGETS = [0, 1, 64, 1024, 2048, 4096, 4096, 8192, 16384, GIB]


@functools.lru_cache(maxsize=None)
def _min_nodes(**options) -> int:
    return min_nodes(**options)


@functools.lru_cache(maxsize=4)
def _graph(num_nodes: int, **options) -> fx.GraphModule:
    return generate_graph(num_nodes, **options)


@st.composite
def graph_options(draw) -> tuple[int, dict]:
    options = {
        "layers": draw(st.integers(1, 3)),
        "attention": draw(st.booleans()),
        "buckets": draw(st.booleans()),
        "mixed_precision": draw(st.booleans()),
        "barriers": draw(st.booleans()),
        "reshard": draw(st.booleans()),
        "missing_sizes": draw(st.sampled_from([0.0, 0.0, 0.0, 0.0, 0.25, 0.25, 1.0])),
        "seed": draw(st.integers(0, 2**16)),
    }
    shape = {k: options[k] for k in ("layers", "attention", "buckets", "mixed_precision", "barriers", "reshard",
                                     "seed")}  # the seed draws bucket sizes: it sets the minimum too
    num_nodes = _min_nodes(**shape) + draw(st.integers(0, 200))
    return num_nodes, options


@st.composite
def pipelines(draw) -> tuple[str, int | None]:
    """A pipeline text and its gather budget in bytes (None: no budget pass). Anchors come from
    `anchor` (depths, attention on or off) or from the cost-guided `hide`; some pipelines end
    with `order-gathers` and/or `overlap-reduce-scatter` (hoisting reduce-scatters or not)."""
    depths = st.sampled_from([0, 1, 1, 2, 2, 3])
    forward, backward = draw(depths), draw(depths)
    attention = draw(st.sampled_from(["", "", ",attention=false"]))
    anchor = f"anchor{{forward-depth={forward},backward-depth={backward}{attention}}}"
    if draw(st.integers(0, 4)) == 0:
        anchor = "hide"
    limit = draw(st.sampled_from([*BUDGETS, GIB, None, None]))
    budget = [] if limit is None else [f"budget{{max-in-flight-gb={limit / GIB!r}}}"]
    shape = draw(st.sampled_from(["full"] * 6 + ["no sink", "sink only"]))
    if shape == "sink only":
        return "sink", None
    sink = draw(st.sampled_from(["sink", "sink{order=wait}"]))
    passes = [anchor, *budget, "prefetch"] + ([sink] if shape == "full" else [])
    if draw(st.integers(0, 2)) == 0:  # with the budget pass's limit, as a user would set both
        passes.append("order-gathers" if limit is None else f"order-gathers{{max-in-flight-gb={limit / GIB!r}}}")
    # last: it times each wait on the order the passes before it leave
    if draw(st.integers(0, 3)) == 0:
        passes.append(draw(st.sampled_from(["overlap-reduce-scatter", "overlap-reduce-scatter{max-in-flight-gb=0.0}",
                                            f"overlap-reduce-scatter{{max-in-flight-gb={4096 / GIB!r}}}",
                                            "overlap-reduce-scatter{hoist=false}"])))
    return ",".join(passes), limit


# ============================================================================================
# properties on generated FX graphs
# ============================================================================================

@examples(10, graphs=True)
@given(graph=graph_options(), pipeline=pipelines())
def test_generated_graphs_schedule_legally_within_budget_and_stably(graph, pipeline):
    (num_nodes, options), (text, limit) = graph, pipeline
    note(f"generate_graph({num_nodes}, **{options}); pipeline {text!r}")
    original = _graph(num_nodes, **options)
    with reproducer_on_failure("generated_graphs", lambda: print_program(lower(original)), text):
        done = fxsched.schedule(original, text)
        verify(done.program)
        _, _, early = check_fx_schedule(original, done.graph_module, limit, prefetched_launches(done.program))
    event(f"gathers moved early: {'none' if not early else 'some'}")
    event(f"held over budget: {any(r['reason'] == 'over budget' for r in done.report['gathers'])}")
    if limit == 0:
        assert not prefetched_launches(done.program)

    again = fxsched.schedule(done.graph_module, text)  # the second run, on the raised graph
    check_fx_schedule(original, again.graph_module, limit)  # still within budget, counted from the start
    assert_same_places(done.graph_module, again.graph_module)  # every pipeline, `hide` included
    if fixed_point(text):  # moves nothing at all
        assert [n.name for n in again.graph_module.graph.nodes] == [n.name for n in done.graph_module.graph.nodes]


def fixed_point(pipeline: str) -> bool:
    """Pipelines whose output a second run leaves exactly as it is: those anchored by `hide`,
    with any of the other passes and options (sink stacks realizations in hide's planned
    order, which a second run sees the same)."""
    return pipeline.split(",")[0].split("{")[0] == "hide"


@examples(4, graphs=True)
@given(graph=graph_options(), forward=st.integers(0, 3), backward=st.integers(0, 3),
       limit=st.sampled_from(BUDGETS))
def test_the_reference_on_its_own_output_does_what_the_reference_does(graph, forward, backward, limit):
    """Run twice, the reference pipeline (the drop-in) gives exactly the oracle's node order,
    counts and anchors each time (tests/oracle.py: SPEC.md's reference, run twice). It need
    not be stable: chains stacked on one slot are stacked again the other way round."""
    num_nodes, options = graph
    note(f"generate_graph({num_nodes}, **{options}); budget {limit} B, depths {forward}/{backward}")
    gm = _graph(num_nodes, **options)
    expected, got = clone(gm), clone(gm)
    for run in (1, 2):
        oracle.run(expected, True, limit / GIB, forward, backward)
        fxsched.overlap_param_gather(got, ref_config(limit / GIB, forward, backward))
        assert outcome(got) == outcome(expected), f"run {run} differs from the reference's"


def test_the_default_pipeline_moves_nothing_on_its_own_output():
    """The case the fuzzer found: the second run moved two backward re-gathers (hide saw the
    reduce-scatters overlap-reduce-scatter had hoisted as busying the stream earlier)."""
    original = _graph(354, layers=3, attention=False, barriers=False, seed=0)
    once = fxsched.schedule(original, DEFAULT_PIPELINE)
    twice = fxsched.schedule(once.graph_module, DEFAULT_PIPELINE)
    assert [n.name for n in twice.graph_module.graph.nodes] == [n.name for n in once.graph_module.graph.nodes]
    assert not any(stats["changed"] for name, stats in twice.report["passes"].items()
                   if name.split("{")[0] in ("budget", "prefetch", "order-gathers"))


@examples(5, graphs=True)
@given(graph=graph_options(), forward=st.integers(0, 3), backward=st.integers(0, 3),
       limit=st.sampled_from(BUDGETS))
def test_the_drop_in_schedules_legally_within_budget_and_stably(graph, forward, backward, limit):
    num_nodes, options = graph
    config = fxsched.PassConfig(max_in_flight_gb=limit / GIB, fsdp_forward_prefetch_depth=forward,
                                fsdp_backward_prefetch_depth=backward)
    note(f"generate_graph({num_nodes}, **{options}); {config}")
    original = _graph(num_nodes, **options)
    gm = fxsched.overlap_param_gather(generate_graph(num_nodes, **options), config)
    moved = {n.name for n in gm.graph.nodes if "fsdp_prefetch_anchor" in n.meta}
    _, _, early = check_fx_schedule(original, gm, limit, moved)
    counts = gm.meta["fsdp_prefetch"]
    assert counts["forward"] + counts["backward"] == len(moved) >= len(early)
    once = gm.graph  # the drop-in swaps in a new graph: this one stays as it is
    fxsched.overlap_param_gather(gm, config)
    check_fx_schedule(original, gm, limit)
    assert_same_places(once, gm)


def test_second_run_can_reorder_within_a_stack():
    """Launch chains that land on the same slot (after a barrier) are stacked in reverse launch
    order by the first run (as the reference does: each goes just after the barrier, ahead of
    those placed there before), and a second run reverses them again. `assert_same_places`
    allows exactly this; the exact node order of a second run may differ."""
    original = _graph(900, seed=3, layers=2, buckets=True, mixed_precision=True)
    once = fxsched.schedule(original, REFERENCE_PIPELINE)
    twice = fxsched.schedule(once.graph_module, REFERENCE_PIPELINE)
    assert_same_places(once.graph_module, twice.graph_module)
    order = [n.name for n in once.graph_module.graph.nodes]
    if order == [n.name for n in twice.graph_module.graph.nodes]:
        pytest.xfail("a second run now keeps the exact order: turn this into an equality test")
    launches = [n for n in order if n in {"all_gather_into_tensor_default_4", "all_gather_into_tensor_default_9"}]
    assert launches == ["all_gather_into_tensor_default_9", "all_gather_into_tensor_default_4"]


def test_a_second_hide_run_keeps_every_gather_in_place():
    original = _graph(900, seed=3, layers=2, buckets=True, mixed_precision=True)
    once = fxsched.schedule(original, DEFAULT_PIPELINE)
    twice = fxsched.schedule(once.graph_module, DEFAULT_PIPELINE)
    check_fx_schedule(original, twice.graph_module, GIB)
    assert_same_places(once.graph_module, twice.graph_module)


# ============================================================================================
# properties on IR text programs
# ============================================================================================

@st.composite
def ir_programs(draw) -> str:
    """A valid program: inputs, forward then backward ops — computes (heavy, attention, random),
    gathers (alone, with a cast, or bucketed with copy-outs) with views, uses, frees, re-gathers,
    barriers, other collectives, in-place writes (of a temporary, a gathered weight, a shard) —
    then the output. Most steps are model-like layers: a gather,
    some compute, its use, maybe its free."""
    nparams = draw(st.integers(1, 6))
    lines = ['%x = input "x"'] + [f'%s{i} = input "shard{i}"' for i in range(nparams)]
    counter = iter(range(10**6))
    live: dict[int, str] = {}  # param -> its realized value
    outputs: list[str] = []
    sizes = st.sampled_from([None, 0, 512, 1024, 4096, 4096, 8192])
    state = {"cur": "x", "role": "fsdp_all_gather"}

    def new(prefix: str) -> str:
        return f"{prefix}{next(counter)}"

    def size_attr() -> str:
        size = draw(sizes)
        return "" if size is None else f", nbytes = {size}"

    def step(action: str) -> None:
        cur, role = state["cur"], state["role"]
        free_params = [p for p in range(nparams) if p not in live]
        if action in ("compute", "heavy", "attention", "random"):
            name = new("c")
            flags = {"compute": "", "heavy": " {heavy}", "attention": " {heavy, attention}", "random": " {random}"}
            lines.append(f'%{name} = compute "aten.{action}"(%{cur}){flags[action]}')
            state["cur"] = name
        elif action == "view":
            name = new("v")
            lines.append(f'%{name} = view "aten.view"(%{cur})')
            state["cur"] = name
        elif action == "gather" and free_params:
            p = draw(st.sampled_from(free_params))
            source = f"s{p}"
            if draw(st.booleans()):
                source = new("k")
                lines.append(f'%{source} = cast "prims.convert_element_type"(%s{p})')
            launch, wait = new("g"), new("w")
            lines.append(f'%{launch} = launch "all_gather"(%{source}) {{role = {role}, params = ["p{p}"]{size_attr()}}}')
            lines.append(f"%{wait} = wait(%{launch})")
            value = wait
            for _ in range(draw(st.integers(0, 2))):
                view = new("v")
                lines.append(f'%{view} = view "aten.view"(%{value})')
                value = view
            live[p] = value
        elif action == "bucket" and len(free_params) >= 2:
            members = draw(st.lists(st.sampled_from(free_params), min_size=2, max_size=3, unique=True))
            pack, launch, wait, rows, bucket = new("cat"), new("g"), new("w"), new("v"), new("b")
            lines.append(f'%{pack} = compute "aten.cat"({", ".join(f"%s{m}" for m in members)})')
            names = ", ".join(f'"p{m}"' for m in members)
            lines.append(f'%{launch} = launch "all_gather"(%{pack}) '
                         f'{{role = {role}, params = [{names}], bucket = "{bucket}"{size_attr()}}}')
            lines.append(f"%{wait} = wait(%{launch})")
            lines.append(f'%{rows} = view "aten.view"(%{wait})')
            for m in members:
                copy, flat = new("co"), new("v")
                lines.append(f'%{copy} = copy_out "aten.clone"(%{rows}) {{bucket = "{bucket}"}}')
                lines.append(f'%{flat} = view "aten.view"(%{copy})')
                live[m] = flat
        elif action == "use" and live:
            p = draw(st.sampled_from(sorted(live)))
            name = new("m")
            heavy = " {heavy}" if draw(st.booleans()) else ""
            lines.append(f'%{name} = compute "aten.mm"(%{cur}, %{live[p]}){heavy}')
            state["cur"] = name
        elif action == "free" and live:
            p = draw(st.sampled_from(sorted(live)))
            lines.append(f'%{new("f")} = free "release"(%{live.pop(p)}) {{params = ["p{p}"]}}')
        elif action == "barrier":
            lines.append(f'%{new("b")} = barrier "aten.copy_"(%{cur}) {{reason = "mutation"}}')
        elif action == "inplace":  # an in-place write: of the current value, a gathered weight, or a shard
            where = draw(st.sampled_from(["cur", "cur", "live", "shard"]))
            target = (live[draw(st.sampled_from(sorted(live)))] if where == "live" and live
                      else f"s{draw(st.integers(0, nparams - 1))}" if where == "shard" else cur)
            name = new("i")
            operands = f"%{target}" if target == cur else f"%{target}, %{cur}"
            lines.append(f'%{name} = compute "aten.add_"({operands}) {{writes = [%{target}], alias = %{target}}}')
            if target == cur:
                state["cur"] = name
        elif action == "collective":
            launch, wait = new("rs"), new("rw")
            tag = draw(st.sampled_from([" {role = fsdp_reduce_scatter}", ' {group = "tp"}']))
            lines.append(f'%{launch} = launch "reduce_scatter"(%{cur}){tag}')
            lines.append(f"%{wait} = wait(%{launch})")
            outputs.append(wait)

    actions = ["compute", "heavy", "attention", "random", "gather", "bucket", "use", "free", "barrier",
               "collective", "view", "inplace", "inplace"] + ["layer"] * 8
    for phase in (Phase.FORWARD, Phase.BACKWARD):
        if phase is Phase.BACKWARD:
            lines.append("^backward")
            state["role"] = "fsdp_all_gather_backward"
        for _ in range(draw(st.integers(0, 14))):
            action = draw(st.sampled_from(actions))
            if action != "layer":
                step(action)
                continue
            step(draw(st.sampled_from(["gather", "gather", "bucket"])))
            for extra in draw(st.lists(st.sampled_from(["compute", "heavy", "heavy", "attention"]), max_size=2)):
                step(extra)
            step("use")
            if draw(st.booleans()):
                step("free")
    lines.append(f"%output = output({', '.join(f'%{v}' for v in [state['cur'], *outputs])})")
    return "\n".join(lines) + "\n"


class IrFacts:
    def __init__(self, program):
        self.program = program
        self.order = program.schedule.names()
        self.pos = {n: i for i, n in enumerate(self.order)}
        self.ops = {n: program.op(n) for n in self.order}
        self.users = defaultdict(list)
        for op in self.ops.values():
            for operand in op.operands:
                self.users[operand].append(op.name)
        self.gathers = [n for n, op in self.ops.items() if isinstance(op, Launch) and op.is_gather]
        self.realization = {g: self._realize(g) for g in self.gathers}
        self.realized = set().union(*self.realization.values()) if self.gathers else set()

    def _realize(self, launch: str) -> set[str]:
        waits = [u for u in self.users[launch] if isinstance(self.ops[u], Wait)]
        bucket = self.ops[launch].bucket
        found, stack = set(waits[:1]), waits[:1]
        while stack:
            for user in self.users[stack.pop()]:
                op = self.ops[user]
                if user not in found and (isinstance(op, View) or (isinstance(op, CopyOut) and bucket is not None
                                                                     and op.bucket == bucket)):
                    found.add(user)
                    stack.append(user)
        return found

    def first_consumer(self, gather: str) -> str | None:
        realization = self.realization[gather]
        users = {u for r in realization for u in self.users[r]} - realization
        return min(users, key=self.pos.get) if users else None

    def segment(self) -> dict[str, int]:
        out, count = {}, 0
        for n in self.order:
            if isinstance(self.ops[n], Barrier):
                count += 1
            out[n] = count
        return out

    def readers_of_storage(self, name: str) -> set[str]:
        while isinstance(self.ops[name], View):
            name = self.ops[name].operands[0]
        readers, stack = set(), [name]
        while stack:
            current = stack.pop()
            for user in self.users[current]:
                if user not in readers:
                    readers.add(user)
                    if isinstance(self.ops[user], View) and self.ops[user].operands[0] == current:
                        stack.append(user)
        return readers


def _movable(op) -> bool:
    return not isinstance(op, (Barrier, Input, Marker, Output))


def check_ir_schedule(before_program, after_program, limit: int | None, *, compute_moves: bool = False) -> set[str]:
    """`check_fx_schedule`'s rules, read off IR operands (not the effect edges); `compute_moves`
    as there."""
    verify(after_program)
    before, after = IrFacts(before_program), IrFacts(after_program)
    assert sorted(before.order) == sorted(after.order)
    for name, op in after.ops.items():
        for operand in op.operands:
            assert after.pos[operand] < after.pos[name], f"%{name} before its operand %{operand}"
    for facts in (before, after):
        phased = [(facts.pos[n], op.phase) for n, op in facts.ops.items() if _movable(op) or isinstance(op, Barrier)]
        forward = [p for p, ph in phased if ph is Phase.FORWARD]
        backward = [p for p, ph in phased if ph is Phase.BACKWARD]
        if forward and backward:
            assert max(forward) < min(backward), "an op crossed the phase boundary"
    seg_before, seg_after = before.segment(), after.segment()
    assert [n for n in before.order if isinstance(before.ops[n], Barrier)] == \
           [n for n in after.order if isinstance(after.ops[n], Barrier)]
    crossed = [n for n, op in before.ops.items() if _movable(op) and seg_before[n] != seg_after[n]]
    assert not crossed, f"ops crossed a barrier: {crossed}"
    for name, op in after.ops.items():
        if isinstance(op, Free) and op.operands:
            late = [r for r in after.readers_of_storage(op.operands[0]) - {name} if after.pos[r] > after.pos[name]]
            assert not late, f"{late} read storage %{name} freed, after the free"

    # storages (views and `alias` results share their source's): an op writing one keeps its
    # order with every op touching it
    def root(facts, name):
        while True:
            op = facts.ops[name]
            source = op.operands[0] if isinstance(op, View) and op.operands else op.alias
            if source is None:
                return name
            name = source

    touching = defaultdict(set)
    for name, op in before.ops.items():
        for operand in op.operands:
            touching[root(before, operand)].add(name)
    for name, op in before.ops.items():
        for written in op.writes:
            for other in touching[root(before, written)] - {name}:
                assert (before.pos[other] < before.pos[name]) == (after.pos[other] < after.pos[name]), (
                    f"%{other} and %{name}, which writes storage it touches, changed their order")

    def lifetimes(facts):
        events = defaultdict(list)
        for n in facts.order:
            op = facts.ops[n]
            if isinstance(op, Free) or (isinstance(op, Launch) and op.is_gather):
                for param in op.params:
                    events[param].append(n)
        return events

    assert lifetimes(before) == lifetimes(after), "a parameter's gathers and frees changed order"

    def ordered(facts):  # each kind among itself (as check_fx_schedule's fixed_order)
        return ([n for n in facts.order if isinstance(facts.ops[n], Launch) and not facts.ops[n].is_gather],
                [n for n in facts.order if isinstance(facts.ops[n], Compute) and facts.ops[n].random])

    launches, randoms = ordered(before)
    assert randoms == ordered(after)[1], "random ops changed their order"
    marked = {n for n, op in after.ops.items() if isinstance(op, Launch) and op.unordered}
    for name in marked:  # only FSDP's reduce-scatters of a known group
        assert after.ops[name].role is Role.REDUCE_SCATTER and after.ops[name].group is not None, name
    _keeps_order(launches, after.pos, lambda x, y: x in marked and y in marked
                 and after.ops[x].group == after.ops[y].group)
    if compute_moves:
        return set()

    early = set()
    for g in before.gathers:
        if any(n not in before.realized and not isinstance(before.ops[n], Wait) and after.pos[n] > after.pos[g]
               for n in before.order[:before.pos[g]]):
            early.add(g)
    prefetched = {n for n, op in after.ops.items() if isinstance(op, Launch) and op.prefetched}
    assert early <= prefetched, f"moved early but not marked: {early - prefetched}"
    if limit is not None:
        assert all(after.ops[g].nbytes is not None for g in early), "a gather of unknown size moved early"
        events = []
        for g in early:
            consumer = after.first_consumer(g)
            end = after.pos[consumer] if consumer else len(after.order)
            events += [(after.pos[g], 1, after.ops[g].nbytes), (end, 0, -after.ops[g].nbytes)]
        current = peak = 0
        for _, _, delta in sorted(events):
            current += delta
            peak = max(peak, current)
        assert peak <= limit, f"{peak} early bytes in flight, over {limit}"
    return early


def ir_places(program) -> tuple[list[str], dict]:
    facts = IrFacts(program)
    movable = set(facts.realized)
    for g in facts.gathers:
        movable.add(g)
        for operand in facts.ops[g].operands:  # a cast or a pack private to the launch
            if facts.users[operand] == [g] and not isinstance(facts.ops[operand], Input):
                movable.add(operand)
    fixed, between, pending, previous = [], {}, [], None
    for n in facts.order:
        if n in movable:
            pending.append(n)
            continue
        fixed.append(n)
        between.update((p, (previous, n)) for p in pending)
        pending, previous = [], n
    between.update((p, (previous, None)) for p in pending)
    return fixed, between


def run_text(text: str, pipeline: str, limit: int | None):
    before = parse_program(text)
    verify(before)
    after = parse_program(text)
    with reproducer_on_failure("ir_programs", lambda: text, pipeline):
        PassManager(pipeline, reproducer=True).run(after)
        early = check_ir_schedule(before, after, limit)
    again_text = print_program(after)  # marks (prefetched, holds) travel in the text
    again = parse_program(again_text)
    with reproducer_on_failure("ir_programs_second_run", lambda: again_text, pipeline):
        PassManager(pipeline, reproducer=True).run(again)
        check_ir_schedule(before, again, limit)
        assert ir_places(after) == ir_places(again), "a second run moved ops to other places"
        if fixed_point(pipeline):
            assert again.schedule.names() == after.schedule.names(), "a second run of a hide pipeline moved ops"
    return after, early


@examples(120)
@given(text=ir_programs(), pipeline=pipelines(), ir_budget=st.sampled_from([0, 511, 4096, 6000, 8192, 12288, 16384, GIB]))
def test_ir_programs_schedule_legally_within_budget_and_stably(text, pipeline, ir_budget):
    pipeline_text, limit = pipeline
    if limit is not None:  # budgets at the IR programs' scale
        pipeline_text = pipeline_text.replace(f"max-in-flight-gb={limit / GIB!r}", f"max-in-flight-gb={ir_budget / GIB!r}")
        limit = ir_budget
    note(f"pipeline {pipeline_text!r}\n{text}")
    after, early = run_text(text, pipeline_text, limit)
    event(f"gathers moved early: {'none' if not early else 'some'}")
    event(f"held over budget: {any(getattr(op, 'hold', None) == 'over budget' for op in after.ops())}")
    if limit == 0:
        assert not any(isinstance(op, Launch) and op.prefetched for op in after.ops())


HAND_WRITTEN = {
    "docstring": """
        %x = input
        %w = input
        %ag = launch "all_gather_into_tensor"(%w) {role = fsdp_all_gather, nbytes = 4096, params = ["w"]}
        %wt = wait(%ag)
        %mm = compute "aten.mm"(%x, %wt) {heavy}
        %output = output(%mm)
    """,
    "stack after a barrier": STACK_AFTER_A_BARRIER,
    "re-gather after its free, across the phases": """
        %x = input
        %s = input
        %g = launch "ag"(%s) {role = fsdp_all_gather, nbytes = 64, params = ["p"]}
        %w = wait(%g)
        %v = view "aten.view"(%w)
        %m = compute "aten.mm"(%x, %v) {heavy}
        %f = free "release"(%v) {params = ["p"]}
        %n = compute "aten.neg"(%m)
        ^backward
        %k = compute "aten.neg"(%n)
        %h = compute "aten.mm"(%k, %k) {heavy}
        %rg = launch "ag"(%s) {role = fsdp_all_gather_backward, nbytes = 64, params = ["p"]}
        %rw = wait(%rg)
        %rm = compute "aten.mm"(%h, %rw) {heavy}
        %rf = free "release"(%rw) {params = ["p"]}
        %rs = launch "reduce_scatter"(%rm) {role = fsdp_reduce_scatter}
        %rsw = wait(%rs)
        %output = output(%rsw)
    """,
}


@pytest.mark.parametrize("name", sorted(HAND_WRITTEN))
@pytest.mark.parametrize("pipeline,limit", [
    ("anchor,budget,prefetch,sink", GIB),
    ("anchor{forward-depth=3,backward-depth=3},budget{max-in-flight-gb=9.5367431640625e-07},prefetch,sink", 1024),
    ("anchor{forward-depth=2,backward-depth=0},prefetch,sink", None),
    ("anchor,budget{max-in-flight-gb=0.0},prefetch,sink", 0),
    ("sink", None),
])
def test_hand_written_programs(name, pipeline, limit):
    text = "\n".join(line.strip() for line in HAND_WRITTEN[name].strip().splitlines()) + "\n"
    run_text(text, pipeline, limit)


# ============================================================================================
# the IR parser on mutated text: a program or a ParseError with a place, never anything else
# ============================================================================================

#: fragments a mutation inserts: the characters and tokens the grammar gives meaning to, and
#: what broke it before (huge numbers, escapes, raw tabs, deep lists, effects, markers)
FRAGMENTS = ["%", "%x", "%nope", "%w0", "^backward", "^entry", "^", "=", "(", ")", "{", "}", "[", "]", ",", ":",
             "?", "->", '"', "\\", '\\"', "\\q", "\\u12", "\\t", "\t", " ", "//", "-", "0", "-1", "9" * 40,
             "9" * 5000, "1.5", "nbytes = ", "anchor = %x", "anchor = %nope", "hold = \"x\"", "heavy", "bwd",
             "role = fsdp_all_gather", "params = [\"p0\"]", "f32[2,?]", "none", "[" * 30, "effect %x -> %c0",
             "\n", "\n^backward\n", "\neffect %g0 -> %x\n", "\n%f9 = free \"release\"(%x)\n", "launch", "wait",
             "free", "view", "compute", "output", "input", "\u00e9", "\x00", "\x0b", "\r"]


@st.composite
def mutated_ir_text(draw) -> str:
    """A valid program with a few edits: fragments inserted, spans deleted or repeated, lines swapped."""
    text = draw(st.one_of(ir_programs(), st.sampled_from(sorted(HAND_WRITTEN.values()))))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(text)))
        edit = draw(st.sampled_from(["insert", "insert", "delete", "repeat", "swap"]))
        if edit == "insert":
            text = text[:at] + draw(st.sampled_from(FRAGMENTS) | st.text(max_size=3)) + text[at:]
        elif edit == "delete":
            text = text[:at] + text[at + draw(st.integers(1, 12)):]
        elif edit == "repeat":
            end = min(len(text), at + draw(st.integers(1, 40)))
            text = text[:end] + text[at:end] + text[end:]
        else:
            lines = text.splitlines()
            if len(lines) > 1:
                i, j = draw(st.integers(0, len(lines) - 1)), draw(st.integers(0, len(lines) - 1))
                lines[i], lines[j] = lines[j], lines[i]
                text = "\n".join(lines) + "\n"
    return text


@examples(150)
@given(text=mutated_ir_text(), pipeline=st.sampled_from([DEFAULT_PIPELINE, REFERENCE_PIPELINE, "hide,prefetch,sink",
                                                          "prefetch,sink", "budget{max-in-flight-gb=0.0},prefetch"]))
def test_mutated_ir_text_parses_or_names_line_and_column(text, pipeline):
    """Any text: `parse_program` gives a program or a ParseError with a line and column in the
    text; a program then verifies or fails with a VerifyError; a verified one goes through a
    pipeline without any error at all (with every kept analysis checked against a fresh one)."""
    note(f"pipeline {pipeline!r}\n{text!r}")
    try:
        program = parse_program(text)
    except ParseError as exc:
        event("parse error")
        assert 1 <= exc.line <= max(1, len(text.splitlines())) and exc.column >= 1
        return
    try:
        verify(program)
    except VerifyError:
        event("verify error")
        return
    event("valid")
    PassManager(pipeline, check_analyses=True).run(program)
    verify(program)
    again = parse_program(print_program(program))  # what a pass leaves prints and parses back
    verify(again)


@pytest.mark.parametrize("sink", ["sink", "sink{order=wait}"])
@pytest.mark.parametrize("after_sink", ["", ",order-gathers", ",overlap-reduce-scatter,order-gathers"])
def test_a_hide_pipeline_with_any_sink_is_a_fixed_point_on_a_stack_prefetch_reorders(sink, after_sink):
    """Found by `scripts/fuzz.py --examples 10000 --seed 13 -k ir_programs`: prefetch moves
    g8's launch ahead of g3's, and both gathers' realizations stack before the barrier b19.
    Plain `sink` used to stack them in the entry launch order — g3, g8 on the first run, g8, g3
    on the second (w4 and co14 swapped places in the stack); it now stacks them in the order
    hide planned (by first consumer), the same on both runs."""
    pipeline = f"hide,budget{{max-in-flight-gb=4.759058356285095e-07}},prefetch,{sink}{after_sink}"
    after = parse_program(KNOWN_RESTACK)
    PassManager(pipeline).run(after)
    assert after.op("g8").prefetched  # the case: a launch moved ahead of another
    order = after.schedule.names()
    assert order.index("g8") < order.index("g3")
    assert set(order[order.index("b19") - 3:order.index("b19")]) == {"w4", "co14", "v15"}  # the stack
    again = parse_program(print_program(after))
    PassManager(pipeline).run(again)
    assert again.schedule.names() == order


KNOWN_RESTACK = """\
%x = input "x"
%s0 = input "shard0"
%s1 = input "shard1"
%s2 = input "shard2"
%s3 = input "shard3"
%s4 = input "shard4"
%g0 = launch "all_gather"(%s2) {role = fsdp_all_gather, params = ["p2"]}
%w1 = wait(%g0)
%m2 = compute "aten.mm"(%x, %w1)
%g3 = launch "all_gather"(%s3) {role = fsdp_all_gather, params = ["p3"]}
%w4 = wait(%g3)
%m5 = compute "aten.mm"(%m2, %w1)
%f6 = free "release"(%w1) {params = ["p2"]}
%cat7 = compute "aten.cat"(%s1, %s0)
%g8 = launch "all_gather"(%cat7) {role = fsdp_all_gather, params = ["p1", "p0"], bucket = "b11", nbytes = 0}
%w9 = wait(%g8)
%v10 = view "aten.view"(%w9)
%co12 = copy_out "aten.clone"(%v10) {bucket = "b11"}
%v13 = view "aten.view"(%co12)
%co14 = copy_out "aten.clone"(%v10) {bucket = "b11"}
%v15 = view "aten.view"(%co14)
%m16 = compute "aten.mm"(%m5, %v13)
%c17 = compute "aten.compute"(%m16)
%c18 = compute "aten.compute"(%c17)
%b19 = barrier "aten.copy_"(%c18) {reason = "mutation"}
%f20 = free "release"(%v15) {params = ["p0"]}
%g21 = launch "all_gather"(%s0) {role = fsdp_all_gather, params = ["p0"]}
%w22 = wait(%g21)
%m23 = compute "aten.mm"(%c18, %w22)
%c24 = compute "aten.compute"(%m23)
%c25 = compute "aten.compute"(%c24)
%c26 = compute "aten.compute"(%c25)
%c27 = compute "aten.compute"(%c26)
%c28 = compute "aten.compute"(%c27)
%g29 = launch "all_gather"(%s2) {role = fsdp_all_gather, params = ["p2"]}
%w30 = wait(%g29)
%m31 = compute "aten.mm"(%c28, %w4)
^backward
%output = output(%m31)
"""
