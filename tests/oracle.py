"""A deliberately naive oracle for the reference behaviour, stages 1-7, on a torch.fx Graph.

Written from the description in docs/design.md ("The input fxsched expects" and "The reference
behaviour, stage by stage"),
not from fxsched's passes: no IR, no effect edges, no segment trees. The graph is a list of
nodes; every question ("where is this node now?", "what is the last barrier before it?") is
answered by re-indexing the whole graph. That is quadratic and meant to be: it is obviously
what that description says, and the differential test compares fxsched against it.

Reading choices where the description leaves room (each one is what HyperParallel's pass does
too):
- interval consumers: an interval's consumers are those after its left attention node up to
  and including its right one, (left, right]; its heavy nodes are the closed [left, right];
  the first interval starts at the top of the graph and the last one ends at its bottom.
- "the last barrier before the launch" and "the free of each of its parameters" are the latest
  such nodes before the launch in the order the stage starts from.
- barriers are tagged nodes and side-effectful calls that write no argument; an in-place call
  is no barrier (issue 12): it keeps its order with every node touching a storage it writes
  (through views), so a chain launches after the last such node before it and a realization
  node sinks no further than the next one.
- the budget counts every gather that is prefetched: moved by this run (either phase) or
  carrying `fsdp_prefetch_anchor` from an earlier run; a new launch is in flight from just
  before its target to its first consumer, an earlier one from its launch to its first consumer.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass

import torch
from torch import fx

LOG = logging.getLogger("fxsched.oracle")

GATHER_TYPES = ("fsdp_all_gather", "fsdp_all_gather_backward")
FREE_TYPES = ("fsdp_reshard_free", "fsdp_reshard_free_backward")
HEAVY = ("aten.mm", "aten.addmm", "aten.bmm", "aten.matmul", "aten.linear")
ATTENTION = ("scaled_dot_product", "flash_attention", "npu_fusion_attention")
CASTS = ("prims::convert_element_type", "aten::_to_copy")


# ---- recognising nodes (docs/design.md, "The input fxsched expects") ---------------------

def schema_of(node: fx.Node):
    if node.op != "call_function":
        return None
    return getattr(node.target, "_schema", None)


def is_functional_collective(node: fx.Node) -> bool:
    schema = schema_of(node)
    return schema is not None and schema.name.split("::")[0] in ("_c10d_functional", "c10d_functional")


def is_gather(node: fx.Node) -> bool:
    schema = schema_of(node)
    return (schema is not None and schema.name == "_c10d_functional::all_gather_into_tensor"
            and node.meta.get("comm_type") in GATHER_TYPES)


def is_wait(node: fx.Node) -> bool:
    schema = schema_of(node)
    return schema is not None and schema.name == "_c10d_functional::wait_tensor"


def is_view(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    schema = schema_of(node)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def bucket_of(launch: fx.Node):
    return launch.meta.get("fsdp_bucket_id")


def is_copy_out(node: fx.Node, bucket) -> bool:
    return (bucket is not None and node.op == "call_function" and node.target is torch.ops.aten.clone.default
            and node.meta.get("fsdp_bucket_copy_out") == bucket)


def is_free(node: fx.Node) -> bool:
    return node.meta.get("comm_type") in FREE_TYPES


def is_barrier(node: fx.Node) -> bool:
    """Unknown state: a `barrier` tag, or a side-effectful call that writes none of its arguments
    (an in-place op is no barrier: it writes its argument's storage, see `conflicts`)."""
    if node.meta.get("barrier") is True:
        return True
    if node.op != "call_function" or is_free(node) or is_functional_collective(node):
        return False
    return node.target in fx.node._side_effectful_functions and not written(node)


def written(node: fx.Node) -> list[fx.Node]:
    """The arguments a call's schema writes (`Tensor(a!)`)."""
    schema = schema_of(node)
    if schema is None:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if isinstance(value, fx.Node):
                out.append(value)
    return out


def storage(node: fx.Node) -> fx.Node:
    """The node owning the storage `node`'s value lives in: through views, and through in-place
    calls (which return what they wrote)."""
    while True:
        if is_view(node) and node.all_input_nodes:
            node = node.all_input_nodes[0]
        elif written(node) and (schema_of(node).returns or [None])[0] is not None \
                and schema_of(node).returns[0].alias_info is not None:
            node = written(node)[0]
        else:
            return node


def conflicts(a: fx.Node, b: fx.Node) -> bool:
    """The two touch one storage and at least one of them writes it (so they keep their order)."""
    reads_a = {storage(n) for n in a.all_input_nodes}
    reads_b = {storage(n) for n in b.all_input_nodes}
    writes_a = {storage(n) for n in written(a)}
    writes_b = {storage(n) for n in written(b)}
    return bool(writes_a & (reads_b | writes_b) or writes_b & reads_a)


def backward(node: fx.Node) -> bool:
    return bool(node.meta.get("autograd_backward"))


def is_attention(node: fx.Node) -> bool:
    return node.op == "call_function" and any(a in str(node.target) for a in ATTENTION)


def is_heavy(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    return is_attention(node) or str(node.target).rsplit(".", 1)[0] in HEAVY


def nbytes_of(launch: fx.Node):
    value = launch.meta.get("fsdp_unsharded_nbytes")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def params_of(launch: fx.Node) -> list | None:
    """The parameters a gather carries; None when its tags do not say (the conservative choice: then it does not move)."""
    if bucket_of(launch) is not None:
        members = launch.meta.get("fsdp_bucket_members")
        ok = isinstance(members, (list, tuple)) and members and all(isinstance(m, str) and m for m in members)
        return list(members) if ok else None
    name = launch.meta.get("param_name")
    return [name] if isinstance(name, str) and name else None


# ---- the list-of-nodes view ---------------------------------------------------------------

def nodes(graph: fx.Graph) -> list[fx.Node]:
    return list(graph.nodes)


def positions(graph: fx.Graph) -> dict[fx.Node, int]:
    """Where every node is now: the whole graph re-indexed (callers do this after every move)."""
    return {node: i for i, node in enumerate(graph.nodes)}


def move_before(graph: fx.Graph, moving: list[fx.Node], target: fx.Node) -> None:
    for node in moving:
        target.prepend(node)


# ---- stage 1: collect -------------------------------------------------------------------------

@dataclass
class Found:
    launch: fx.Node
    realization: list[fx.Node]
    consumer: fx.Node
    anchor: fx.Node | None = None
    moved: bool = False


def collect(graph: fx.Graph) -> list[Found]:
    found = []
    for launch in nodes(graph):
        if not is_gather(launch):
            continue
        users = list(launch.users)
        if len(users) != 1 or not is_wait(users[0]):
            continue
        bucket = bucket_of(launch)
        realization = [users[0]]
        consumers = []
        frontier = [users[0]]
        while frontier:
            node = frontier.pop(0)
            for user in node.users:
                if is_view(user) or is_copy_out(user, bucket):
                    if user not in realization:
                        realization.append(user)
                        frontier.append(user)
                elif user not in consumers:
                    consumers.append(user)
        if not consumers:
            continue
        pos = positions(graph)
        realization.sort(key=pos.get)
        consumers.sort(key=pos.get)
        found.append(Found(launch, realization, consumers[0]))
    return found


# ---- stages 2 and 3: anchors ----------------------------------------------------------------

def anchor_phase(graph: fx.Graph, found: list[Found], depth: int) -> None:
    if depth == 0 or not found:
        return
    order = nodes(graph)
    pos = positions(graph)
    # group by first consumer, in the order of the consumers
    consumers = []
    for f in found:
        if f.consumer not in consumers:
            consumers.append(f.consumer)
    consumers.sort(key=pos.get)
    group = {c: [f for f in found if f.consumer is c] for c in consumers}
    for i, consumer in enumerate(consumers):
        if i == 0:
            continue
        for f in group[consumer]:
            f.anchor = consumers[max(0, i - depth)]

    phase = backward(found[0].launch)
    phase_nodes = [n for n in order if n.op == "call_function" and backward(n) == phase]
    attention = [n for n in phase_nodes if is_attention(n)]
    if not attention:
        return
    # intervals: [top, a1], [a1, a2], ..., [a_last, bottom] as closed index ranges
    cuts = [0] + [pos[a] for a in attention] + [len(order) - 1]
    for k in range(len(cuts) - 1):
        left, right = cuts[k], cuts[k + 1]
        heavy = [n for n in phase_nodes if is_heavy(n) and left <= pos[n] <= right]
        targets = []
        if k == 0:
            targets += [c for c in consumers if pos[c] <= right]
        if k + 2 < len(cuts):
            nxt = cuts[k + 2]
            targets += [c for c in consumers if right < pos[c] <= nxt]
        if not heavy or not targets:
            continue
        for j, consumer in enumerate(targets):
            candidate = heavy[j * len(heavy) // len(targets)]
            for f in group[consumer]:
                current = f.anchor if f.anchor is not None else f.consumer
                if pos[candidate] < pos[current]:
                    f.anchor = candidate


# ---- stage 4: legal position --------------------------------------------------------------------

def launch_chain(graph: fx.Graph, launch: fx.Node) -> list[fx.Node]:
    order = nodes(graph)
    pos = positions(graph)
    if bucket_of(launch) is not None:
        chain = {launch}
        for node in reversed(order[:pos[launch]]):
            if node.op != "call_function" or is_barrier(node) or is_free(node):
                continue
            if node.users and all(u in chain for u in node.users):
                chain.add(node)
        return sorted(chain, key=pos.get)
    shard = launch.args[0] if launch.args else None
    if isinstance(shard, fx.Node) and shard.op == "call_function" and len(shard.users) == 1:
        schema = schema_of(shard)
        inputs = shard.all_input_nodes
        if (schema is not None and schema.name in CASTS and inputs
                and all(i.op == "placeholder" for i in inputs)):
            return [shard, launch]
    return [launch]


def earliest(graph: fx.Graph, f: Found, chain: list[fx.Node]) -> int:
    order = nodes(graph)
    pos = positions(graph)
    launch = f.launch
    where = pos[launch]
    bounds = [pos[f.anchor]]
    phase = backward(launch)
    first = next(n for n in order if n.op not in ("placeholder", "get_attr") and backward(n) == phase)
    bounds.append(pos[first])
    for node in chain:
        for inp in node.all_input_nodes:
            if inp not in chain:
                bounds.append(pos[inp] + 1)
    barriers = [i for i, n in enumerate(order[:where]) if is_barrier(n)]
    if barriers:
        bounds.append(barriers[-1] + 1)
    # and after every earlier write of a storage the chain touches (or read of one it writes)
    for i, n in enumerate(order[:where]):
        if n not in chain and any(conflicts(n, c) for c in chain):
            bounds.append(i + 1)
    for param in params_of(launch):
        frees = [i for i, n in enumerate(order[:where]) if is_free(n) and n.meta.get("param_name") == param]
        if frees:
            bounds.append(frees[-1] + 1)
    return max(bounds)


# ---- stage 5: budget ------------------------------------------------------------------------------

def fits(graph: fx.Graph, f: Found, target: fx.Node, prefetched: list[Found], limit: int) -> bool:
    size = nbytes_of(f.launch)
    if size is None:
        return False
    pos = positions(graph)
    # positions doubled so that "just before the target" is a point of its own
    start, end = 2 * pos[target] - 1, 2 * pos[f.consumer]
    spans = [(start, end, size)]
    for other in prefetched:
        if other is f:
            continue
        other_size = nbytes_of(other.launch)
        if other_size is None:
            continue  # never moved by a budgeted run
        spans.append((2 * pos[other.launch], 2 * pos[other.consumer], other_size))
    # the in-flight total over [start, end) is highest where some span begins (or at start)
    points = [start] + [lo for lo, _, _ in spans if start < lo < end]
    for point in points:
        if sum(s for lo, hi, s in spans if lo <= point < hi) > limit:
            return False
    return True


# ---- stage 6: sink ----------------------------------------------------------------------------------

def sink(graph: fx.Graph, found: list[Found]) -> int:
    sunk = 0
    for f in found:
        phase = backward(f.launch)
        later = None
        pos = positions(graph)
        for node in sorted(f.realization, key=pos.get, reverse=True):
            if not node.users:
                continue
            order, pos = nodes(graph), positions(graph)
            candidates = list(node.users) + ([later] if later is not None else [])
            target = min(candidates, key=pos.get)
            for between in order[pos[node] + 1:pos[target]]:
                if is_barrier(between) or backward(between) != phase or conflicts(between, node):
                    target = between
                    break
            if pos[target] > pos[node] + 1:
                move_before(graph, [node], target)
                sunk += 1
            later = node
    return sunk


# ---- the whole thing ---------------------------------------------------------------------------------

def run(gm: fx.GraphModule, enabled: bool = True, max_in_flight_gb: float = 1.0,
        forward_depth: int = 1, backward_depth: int = 1) -> fx.GraphModule:
    """Schedule `gm` in place as docs/design.md says; returns it with `meta["fsdp_prefetch"]` set."""
    for name, depth in (("forward", forward_depth), ("backward", backward_depth)):
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
            raise ValueError(f"fsdp_{name}_prefetch_depth must be a non-negative integer")
    if not enabled:
        return gm
    graph = gm.graph
    graph.lint()
    found = collect(graph)
    limit = int(max_in_flight_gb * 2**30)
    prefetched = [f for f in found if "fsdp_prefetch_anchor" in f.launch.meta]
    counts = {"forward": 0, "backward": 0}
    for phase, depth in ((False, forward_depth), (True, backward_depth)):
        anchor_phase(graph, [f for f in found if backward(f.launch) == phase], depth)
    for phase in (False, True):
        if limit == 0:
            break
        for f in [f for f in found if backward(f.launch) == phase]:
            if f.anchor is None or params_of(f.launch) is None:
                continue
            chain = launch_chain(graph, f.launch)
            position = earliest(graph, f, chain)
            if position >= positions(graph)[chain[0]]:
                continue
            target = nodes(graph)[position]
            if not fits(graph, f, target, prefetched, limit):
                continue
            move_before(graph, chain, target)
            f.launch.meta["fsdp_prefetch_anchor"] = f.anchor.name
            f.moved = True
            if f not in prefetched:
                prefetched.append(f)
            counts["backward" if phase else "forward"] += 1
    counts["sunk"] = sink(graph, found)
    graph.lint()
    gm.recompile()
    gm.meta["fsdp_prefetch"] = counts
    LOG.info("oracle: %s", counts)
    return gm
