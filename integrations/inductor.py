"""torch.compile: an Inductor custom graph pass that runs an fxsched pipeline on each compiled graph.

    import torch
    from fxsched.integrations.inductor import compile_options

    compiled = torch.compile(model, options=compile_options())            # the default pipeline
    compiled = torch.compile(model, options=compile_options("reference", cost_model="h200"))

Hook: `post_grad_custom_post_pass`. Inductor calls it once per graph it compiles: the forward
graph and the backward graph separately (after AOTAutograd partitioned the joint graph), with
the graph's `meta["val"]` filled and every call in the backward graph marked
`autograd_backward`. The joint hooks (`joint_custom_pre/post_pass`) see the joint graph
before partitioning, which rebuilds and reorders the backward graph (and decides what is
recomputed there, re-gathers included), so a schedule made there would not survive.

Each call: recognise untagged FSDP gathers and gradient reductions (`lowering.structural`), then lower → run the
pipeline → raise, and give the given `fx.Graph` the raised order in place (the same node
objects, relinked, as the drop-in does where the passes only reordered; nothing Inductor holds
is invalidated). Its `uuid()`
hashes the pipeline text, the options, fxsched's version and every source file the pass can
execute (`source_files`), so Inductor's FX graph cache keys on it (a cache hit skips the
pass: the compiled code already has its order).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import logging
import pathlib
import time
from typing import Any

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from ..ir import Program, tags
from ..lowering.structural import tag_fsdp_collectives, untag_fsdp_gathers
from ..raising import raise_in_place, reorders_only, unordered_launches
from ..raising.lint import lint
from ..passes import DEFAULT_PIPELINE, PassManager

__all__ = ["HOOK", "RECORDS", "FxschedInductorPass", "compile_options", "graph_phase", "schedule_graph_in_place"]

LOG = logging.getLogger("fxsched.integrations.inductor")
HOOK = "post_grad_custom_post_pass"
#: the last records of every FxschedInductorPass in this process (also kept per pass in `.runs`)
RECORDS: collections.deque[dict[str, Any]] = collections.deque(maxlen=256)

_PACKAGE = pathlib.Path(__file__).resolve().parent.parent
#: top-level folders of the repository that the pass never executes (every other .py counts)
_NOT_EXECUTED = frozenset({"tests", "bench", "scripts", "docs", "build", ".venv", ".git"})
_ABSENT = object()


def source_files(root: pathlib.Path = _PACKAGE) -> list[pathlib.Path]:
    """Every .py file of the package the pass can execute: all of it but tests, benchmarks and
    scripts (cost/ prices ops for `hide`, so a changed hardware number changes schedules)."""
    return sorted(p for p in root.rglob("*.py")
                  if p.relative_to(root).parts[0] not in _NOT_EXECUTED and "__pycache__" not in p.parts)


def source_hash(root: pathlib.Path = _PACKAGE) -> str:
    """A hash of the names and bytes of `source_files(root)`."""
    digest = hashlib.sha256()
    for path in source_files(root):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        data = path.read_bytes()
        digest.update(len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def _source_hash() -> str:
    """`source_hash()` of this installation, once per process."""
    return source_hash()


def graph_phase(graph: fx.Graph) -> str:
    """Which graph Inductor gave us: "backward" when it takes tangents or all its calls are backward ones.

    (Not "any call is a backward one": the partitioner may compute a few backward-region
    values, e.g. a transpose of an input, in the forward graph, and they keep the tag.)
    """
    calls = [n for n in graph.nodes if n.op == "call_function"]
    if any(n.op == "placeholder" and str(n.target).startswith("tangents") for n in graph.nodes):
        return "backward"
    return "backward" if calls and all(n.meta.get(tags.AUTOGRAD_BACKWARD) for n in calls) else "forward"


@contextlib.contextmanager
def _uniform_phase(graph: fx.Graph, phase: str | None):
    """While open, every call of `graph` reads as `phase` to lowering (`autograd_backward`); restored after."""
    if phase is None:
        yield
        return
    saved = [(n, n.meta.get(tags.AUTOGRAD_BACKWARD, _ABSENT)) for n in graph.nodes if n.op != "placeholder"]
    for node, _ in saved:
        if phase == "backward":
            node.meta[tags.AUTOGRAD_BACKWARD] = True
        else:
            node.meta.pop(tags.AUTOGRAD_BACKWARD, None)
    try:
        yield
    finally:
        for node, value in saved:
            if value is _ABSENT:
                node.meta.pop(tags.AUTOGRAD_BACKWARD, None)
            else:
                node.meta[tags.AUTOGRAD_BACKWARD] = value


def _reorder_in_place(graph: fx.Graph, order: list[str]) -> bool:
    """Relink `graph`'s nodes into `order` (names); False when `order` is not a permutation of them."""
    by_name = {n.name: n for n in graph.nodes}
    if len(order) != len(by_name) or set(order) != by_name.keys():
        return False
    output = graph.output_node()
    for name in order:
        node = by_name[name]
        if node is not output:
            output.prepend(node)
    return True


def _replace_contents(graph: fx.Graph, new: fx.Graph) -> None:
    """Make `graph` compute `new` (same placeholders, by name and order), keeping its placeholder nodes."""
    old = list(graph.nodes)
    old_inputs = [n for n in old if n.op == "placeholder"]
    new_inputs = [n for n in new.nodes if n.op == "placeholder"]
    if [n.name for n in old_inputs] != [n.name for n in new_inputs]:
        raise RuntimeError("the scheduled graph's inputs differ from the given graph's: cannot update it in place")
    env: dict[fx.Node, fx.Node] = dict(zip(new_inputs, old_inputs))
    old_output = graph.output_node()
    with graph.inserting_before(old_output):
        for node in new.nodes:
            if node.op != "placeholder":
                env[node] = graph.node_copy(node, env.__getitem__)
    graph.erase_node(old_output)
    for node in reversed(old):
        if node.op not in ("placeholder", "output"):
            graph.erase_node(node)


def schedule_graph_in_place(graph: fx.Graph, pipeline: str = DEFAULT_PIPELINE, *, structural: bool = True,
                            phase: str | None = None, verify_each: bool = True,
                            cost_model: Any = None, group: Any = None) -> dict[str, Any]:
    """Tag untagged FSDP gathers and gradient reductions (when `structural`), run `pipeline` on `graph`
    and give it the result in place.

    `phase` None reads each node's phase from its `meta["autograd_backward"]` as lowering does;
    "forward"/"backward" treats the whole graph as that phase (Inductor compiles the two apart).
    `group`: the ranks whose schedules must agree (`fxsched.schedule`'s `group`; every rank of it
    must schedule its graph here, in the same order).
    Returns a JSON-able record: the graph's phase and size, what the structural stage tagged and
    skipped, `fxsched.schedule`'s report, counts of moved gathers and sunk nodes, and seconds.
    On an error the graph is left as it was (structural tags removed) and the error propagates;
    with a `group`, where one rank fails (before the ranks agree or in a pass) every rank does, with
    its graph left as it was (`fxsched.schedule`'s `group`), so with `on_error="warn"` all ranks
    leave their graphs unscheduled alike.
    """
    from ..api import _agreement, _schedule  # the package face composes lowering → passes → raising

    with _agreement(group) as agreement:  # every rank's part in one schedule, its first step included
        return _schedule_in_place(graph, pipeline, structural, phase, verify_each, cost_model, agreement)


def _schedule_in_place(graph: fx.Graph, pipeline: str, structural: bool, phase: str | None, verify_each: bool,
                       cost_model: Any, agreement: Any) -> dict[str, Any]:
    """`schedule_graph_in_place` within the `agreement` of its group's ranks."""
    from ..api import _schedule

    started = time.perf_counter()
    owner = graph.owning_module
    if not isinstance(owner, fx.GraphModule):
        owner = fx.GraphModule(torch.nn.Module(), graph)
    structural_result = tag_fsdp_collectives(graph, phase=phase) if structural else None
    try:
        with _uniform_phase(graph, phase):
            done = _schedule(owner, pipeline, _relink_or_copy, verify_each=verify_each, cost_model=cost_model,
                             agreement=agreement)
        in_place = done.graph_module is owner
        if not in_place:
            new_graph = done.graph_module.graph
            in_place = _reorder_in_place(graph, [n.name for n in new_graph.nodes])
            if not in_place:
                _replace_contents(graph, new_graph)
        lint(graph)  # Graph.lint, faster where the graph passes
    except BaseException:
        if structural:
            untag_fsdp_gathers(graph)
        raise
    report = done.report  # (made anew on each read: its gathers table walks every op)
    anchors = {row["launch"]: row["anchor"] for row in report["gathers"] if row["moved"]}
    unordered = set(unordered_launches(done.program))  # (a copy relinked by name has not their tags)
    for node in graph.nodes:
        if node.name in anchors:
            node.meta[tags.PREFETCH_ANCHOR] = anchors[node.name]
        if node.name in unordered:
            node.meta[tags.UNORDERED] = True
    owner.recompile()
    stats = report["passes"]
    return {
        "phase": phase or graph_phase(graph),
        "nodes": len(graph.nodes),
        "pipeline": done.pipeline,
        "structural": structural_result.as_dict() if structural_result is not None else None,
        "gathers": len(report["gathers"]),
        "moved": len(anchors),
        "sunk": sum(s.get("sunk", 0) for key, s in stats.items() if key.split("{")[0].split("#")[0] == "sink"),
        "relinked": in_place,
        "report": report,
        "seconds": time.perf_counter() - started,
    }


def _relink_or_copy(program: Program, earlier: frozenset[str]) -> fx.GraphModule:
    """The given module with its own nodes relinked into the schedule where the passes only
    reordered them; else the fresh copy `fxsched.schedule` raises (its moved gathers tagged),
    which `schedule_graph_in_place` gives the graph by name (a name permutation) or node by node."""
    from ..api import _raise_tagged

    return raise_in_place(program) if reorders_only(program) else _raise_tagged(program, earlier)


class FxschedInductorPass(CustomGraphPass):
    """Inductor custom graph pass (`post_grad_custom_post_pass`) running an fxsched pipeline.

    `pipeline` is pipeline text or a name (`default`, `reference`); `cost_model` is what
    cost-guided passes price ops with (a hardware profile name, H100 when None; any other kind
    of model makes `uuid()` None, which turns Inductor's FX graph cache off for the compile, as
    the model is state the cache key cannot see). `structural` tags untagged FSDP gathers first.
    `on_error="warn"` logs a failure and leaves that graph unscheduled (compilation goes on);
    `"raise"` fails the compile. `group` (a ProcessGroup, `"world"`, or a registered group's name):
    the ranks whose schedules must agree where each traces its own graph with its own sizes
    (expert parallelism's split sizes as numbers; `fxsched.schedule`'s `group`). It is a
    collective in the pass, so every rank of the group must run the pass on every graph: `uuid()`
    is then None, which turns Inductor's FX graph cache off (a cache hit on one rank and a miss on
    another would leave the other waiting in the pass, the hang that keeps Inductor's own
    `spmd_check` off by default). Where the pass fails on one rank of the group (its lowering, a
    pass), it fails on every rank (the others with `runtime.agreement.PeerFailure`), so with
    `on_error="warn"` every rank leaves that graph unscheduled: none runs another collective order.
    Every graph's record (see `schedule_graph_in_place`) is appended to `self.runs` and to `RECORDS`.
    """

    def __init__(self, pipeline: str = DEFAULT_PIPELINE, *, cost_model: Any = None, structural: bool = True,
                 on_error: str = "warn", verify_each: bool = True, group: Any = None):
        if on_error not in ("warn", "raise"):
            raise ValueError(f"on_error must be 'warn' or 'raise', got {on_error!r}")
        self.pipeline = str(PassManager(pipeline))  # canonical text; a PipelineError here, not mid-compile
        self.cost_model = cost_model
        self.structural = structural
        self.on_error = on_error
        self.verify_each = verify_each
        self.group = group
        self.runs: list[dict[str, Any]] = []
        self._uuid: str | None = None

    def __repr__(self) -> str:
        return (f"FxschedInductorPass({self.pipeline!r}, cost_model={self.cost_model!r}, "
                f"structural={self.structural}, on_error={self.on_error!r}"
                + (f", group={self.group!r})" if self.group is not None else ")"))

    def __call__(self, graph: fx.Graph) -> None:
        phase = graph_phase(graph)
        try:
            record = schedule_graph_in_place(graph, self.pipeline, structural=self.structural, phase=phase,
                                             verify_each=self.verify_each, cost_model=self.cost_model,
                                             group=self.group)
        except Exception as exc:
            record = {"phase": phase, "nodes": len(graph.nodes), "pipeline": self.pipeline,
                      "error": f"{type(exc).__name__}: {exc}"}
            self._keep(record)
            if self.on_error == "raise":
                raise
            LOG.warning("fxsched: %s graph (%d nodes) left unscheduled: %s", record["phase"], record["nodes"],
                        record["error"])
            return
        self._keep(record)
        tagged = len(record["structural"]["tagged"]) if record["structural"] else 0
        LOG.info("fxsched inductor pass: %s graph, %d nodes: %d gathers (%d tagged structurally), %d moved, "
                 "%d sunk in %.3f s", record["phase"], record["nodes"], record["gathers"], tagged, record["moved"],
                 record["sunk"], record["seconds"])

    def _keep(self, record: dict[str, Any]) -> None:
        self.runs.append(record)
        RECORDS.append(record)

    def uuid(self) -> str | None:
        """Stable across processes and runs: the pipeline, the options, fxsched's version and sources
        (None, so no caching, when the cost model is not a profile name, or with a `group`: every
        rank must run the pass)."""
        if self.cost_model is not None and not isinstance(self.cost_model, str):
            return None
        if self.group is not None:
            return None
        if self._uuid is None:
            from .. import __version__

            key = (f"fxsched {__version__}|{self.pipeline}|cost_model={self.cost_model}|structural={self.structural}"
                   f"|on_error={self.on_error}|verify_each={self.verify_each}|{_source_hash()}")
            self._uuid = hashlib.sha256(key.encode()).hexdigest()
        return self._uuid


def compile_options(pipeline: str = DEFAULT_PIPELINE, *, keep_existing: bool = True,
                    **kwargs: Any) -> dict[str, Any]:
    """`torch.compile(..., options=compile_options(...))`: the fxsched pass on Inductor's post-grad hook.

    With `keep_existing`, a pass already configured on that hook runs first. Extra keyword
    arguments go to `FxschedInductorPass`.
    """
    from torch._inductor import config
    from torch._inductor.custom_graph_pass import get_custom_graph_passes

    ours = FxschedInductorPass(pipeline, **kwargs)
    existing = get_custom_graph_passes(getattr(config, HOOK)) if keep_existing else ()
    return {HOOK: [*existing, ours] if existing else ours}
