"""Round trip of a traced joint forward/backward FSDP graph: lower → verify → raise.

A small transformer block is traced with aot_export_joint_simple, its parameters stored as flat
shards gathered with functional collectives for world size 1, so the graph runs in this process
on a 1-rank gloo group. The test then does what an FSDP graph pass does to it: tags the gathers
and reduce-scatters, frees each unsharded parameter after its last forward use and re-gathers it
before its first backward use. The raised graph must lint, print the same code and give bitwise
equal outputs — also after a random legal reordering of the schedule, which only stays correct if
the effect edges (frees after readers, re-gathers after frees, phases, ...) are all there.
"""

from __future__ import annotations

import random

import networkx as nx
import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives  # noqa: F401  (autograd for the functional collectives)
import torch.nn.functional as F
from torch import fx
from torch._functorch.aot_autograd import aot_export_joint_simple
from torch.utils import _pytree as pytree

from fxsched.ir import BACKWARD, ENTRY, Free, Input, Launch, Role, Schedule, verify
from fxsched.lowering import lower
from fxsched.raising import raise_program
from fxsched.runtime.gloo import GLOO_BACKEND, init_gloo

c10d = torch.ops._c10d_functional
aten = torch.ops.aten

DIM, SEQ, HEADS, BATCH = 8, 4, 2, 2
SHAPES = {
    "attn_norm.weight": (DIM,),
    "attn.q.weight": (DIM, DIM),
    "attn.k.weight": (DIM, DIM),
    "attn.v.weight": (DIM, DIM),
    "attn.o.weight": (DIM, DIM),
    "mlp.up.weight": (2 * DIM, DIM),
    "mlp.up.bias": (2 * DIM,),
    "mlp.down.weight": (DIM, 2 * DIM),
}
NAMES = list(SHAPES)


@torch.fx.node.has_side_effect
def free_unsharded(tensor: torch.Tensor) -> None:
    """Release the storage of a gathered parameter, as FSDP's reshard does."""
    tensor.untyped_storage().resize_(0)


@pytest.fixture(scope="module")
def group_name(tmp_path_factory):
    if dist.is_initialized():
        if dist.get_backend() not in ("gloo", GLOO_BACKEND) or dist.get_world_size() != 1:
            pytest.skip("another test left a process group that is not a 1-rank gloo group")
        yield dist.group.WORLD.group_name
        return
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    init_gloo(store, 0, 1)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


def block(group: str):
    def gather(shard, name):
        full = c10d.wait_tensor(c10d.all_gather_into_tensor(shard, 1, group))
        return full[: torch.Size(SHAPES[name]).numel()].view(SHAPES[name])

    def fn(x, *shards):
        p = {name: gather(shard, name) for name, shard in zip(NAMES, shards)}
        h = F.layer_norm(x, (DIM,), p["attn_norm.weight"])
        q, k, v = ((h @ p[f"attn.{n}.weight"].t()).view(BATCH, SEQ, HEADS, DIM // HEADS).transpose(1, 2)
                   for n in "qkv")
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + a.transpose(1, 2).reshape(BATCH, SEQ, DIM) @ p["attn.o.weight"].t()
        x = x + F.linear(torch.relu(F.linear(x, p["mlp.up.weight"], p["mlp.up.bias"])), p["mlp.down.weight"])
        return (x.pow(2).mean(),)

    return fn


def make_inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, SEQ, DIM, generator=gen)
    shards = [torch.randn(torch.Size(shape).numel(), generator=gen) for shape in SHAPES.values()]
    return x, shards


def _aliases(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return (schema is not None and not schema.is_mutable and bool(schema.returns)
            and schema.returns[0].alias_info is not None)


def fsdp_tag_and_reshard(gm: fx.GraphModule, group: str) -> None:
    """What an FSDP graph pass leaves: tags, a free after the last forward use, a backward re-gather."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    backward = {n for n in graph.nodes if n.meta.get("autograd_backward")}
    gathers = [n for n in graph.nodes if n.target is c10d.all_gather_into_tensor.default]
    assert len(gathers) == len(NAMES)
    for node in graph.nodes:
        if node.target is c10d.reduce_scatter_tensor.default:
            node.meta["comm_type"] = "fsdp_reduce_scatter"
    for name, ag in zip(NAMES, gathers):
        nbytes = torch.Size(SHAPES[name]).numel() * 4
        ag.meta.update(comm_type="fsdp_all_gather", param_name=name, fsdp_unsharded_nbytes=nbytes)
        (wait,) = ag.users
        realization = [wait]  # the wait and every view of it, in graph order
        for node in realization:
            realization.extend(u for u in node.users if _aliases(u) and u not in realization)
        realization.sort(key=order.__getitem__)
        readers = {u for r in realization for u in r.users} | set(realization)
        last_forward = max((r for r in readers if r not in backward), key=order.__getitem__)
        with graph.inserting_after(last_forward):
            free = graph.call_function(free_unsharded, (wait,))
        free.meta.update(comm_type="fsdp_reshard_free", param_name=name)
        uses = [(u, r) for r in realization for u in r.users if u in backward and u not in realization]
        if not uses:
            continue
        first = min((u for u, _ in uses), key=order.__getitem__)
        with graph.inserting_before(first):
            rag = graph.call_function(c10d.all_gather_into_tensor.default, ag.args)
            rwait = graph.call_function(c10d.wait_tensor.default, (rag,))
            copies = {wait: rwait}
            for r in realization[1:]:
                copies[r] = graph.node_copy(r, lambda n: copies.get(n, n))
        rag.meta.update(comm_type="fsdp_all_gather_backward", param_name=name, fsdp_unsharded_nbytes=nbytes,
                        autograd_backward=True)
        for node in (rwait, *copies.values()):
            node.meta["autograd_backward"] = True
        for user, r in uses:
            user.replace_input_with(r, copies[r])
    graph.eliminate_dead_code()  # unused view copies; frees and waits are side effects and stay
    graph.lint()
    gm.recompile()


@pytest.fixture(scope="module")
def joint(group_name):
    x, shards = make_inputs()
    gm = aot_export_joint_simple(block(group_name), [x, *[s.clone().requires_grad_() for s in shards]],
                                 trace_joint=True)
    fsdp_tag_and_reshard(gm, group_name)
    return gm


def run(gm: fx.GraphModule, seed=1):
    x, shards = make_inputs(seed)
    out = gm([x, *shards], [torch.ones(())])
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def assert_bitwise_equal(a, b):
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        assert u.dtype == v.dtype and u.shape == v.shape, i
        assert torch.equal(u, v), f"output {i} differs"


def test_the_traced_graph_is_what_an_fsdp_pass_leaves(joint):
    nodes = list(joint.graph.nodes)
    tags = [n.meta.get("comm_type") for n in nodes]
    assert tags.count("fsdp_all_gather") == len(NAMES)
    assert tags.count("fsdp_reshard_free") == len(NAMES)
    assert tags.count("fsdp_reduce_scatter") == len(NAMES)
    # every parameter but the attention norm weight (a mul) is read again in backward
    assert 5 <= tags.count("fsdp_all_gather_backward") <= len(NAMES)
    assert any(n.meta.get("autograd_backward") for n in nodes)
    # the graph runs and the reshard did not change the numbers
    loss, *grads = run(joint)
    assert loss.dim() == 0 and len(grads) == len(NAMES)


def test_lowered_program_has_every_kind_of_edge(joint):
    program = lower(joint)
    verify(program)
    assert program.notes == []
    launches = [op for op in program.ops() if isinstance(op, Launch)]
    assert sum(op.role is Role.GATHER for op in launches) == len(NAMES)
    assert sum(op.role is Role.REDUCE_SCATTER for op in launches) == len(NAMES)
    assert all(op.nbytes and op.params for op in launches if op.is_gather)
    assert sum(isinstance(op, Free) for op in program.ops()) == len(NAMES)
    assert any(op.attention for op in program.ops() if hasattr(op, "attention"))
    whys = {why for _, _, why in program.effect_edges()}
    assert {"free", "regather", "collective-order", "phase", "entry"} <= whys


def test_round_trip_keeps_code_and_numbers(joint):
    expected = run(joint)
    program = lower(joint)
    verify(program)
    raised = raise_program(program)
    raised.graph.lint()
    assert raised.code == joint.code
    assert [n.meta for n in raised.graph.nodes] == [n.meta for n in joint.graph.nodes]
    assert_bitwise_equal(run(raised), expected)


def random_legal_order(program, seed: int) -> list[str]:
    """A random topological order of the program's graph; inputs first, in their order."""
    rng = random.Random(seed)
    key = {}
    for index, name in enumerate(program.schedule):
        key[name] = (0, index) if isinstance(program.op(name), Input) else (1, rng.random())
    return list(nx.lexicographical_topological_sort(program.graph, key=key.__getitem__))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_legal_reordering_keeps_numbers(joint, seed):
    expected = run(joint)
    program = lower(joint)
    original = program.schedule.names()
    program.schedule = Schedule(random_legal_order(program, seed))
    verify(program)
    order = program.schedule.names()
    assert order != original
    assert order.index(ENTRY) == sum(isinstance(program.op(n), Input) for n in order)
    assert order.index(BACKWARD) > max(order.index(n) for n in order
                                       if getattr(program.op(n), "role", None) is Role.GATHER)
    raised = raise_program(program)  # lints
    assert [n.name for n in raised.graph.nodes] == [n for n in order if not n.startswith("^")]
    assert raised.code != joint.code
    assert_bitwise_equal(run(raised), expected)
