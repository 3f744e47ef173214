"""FSDP front: contract tags and structure of the joint graph, and its numerics against eager autograd."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import fx

from fxsched.front import FrontResult, fsdp_free_storage, fsdp_joint_graph, shard_tensor, unshard_tensor
from fxsched.front.fsdp import _alias_closure
from fxsched.runtime import init_gloo, run_graph_single, run_ranks

_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
_WAIT = torch.ops._c10d_functional.wait_tensor.default
_RS = torch.ops._c10d_functional.reduce_scatter_tensor.default


# --------------------------------------------------------------------------- tiny models


class MLP(nn.Module):
    # Odd sizes, so several shards need padding at world size 2.
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(7, 10)
        self.norm = nn.LayerNorm(10)
        self.fc2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.fc2(F.gelu(self.norm(self.fc1(x))))


class Attention(nn.Module):
    def __init__(self, dim=8, heads=2):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).split(d, dim=-1)
        q, k, v = (y.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(o.transpose(1, 2).reshape(b, t, d))
        return self.head(x)


MODELS = {"mlp": MLP, "attn": Attention}

# Which parameters the backward reads (so get re-gathered): weights whose layer's input
# needs a gradient, and LayerNorm's weight and bias (native_layer_norm_backward takes both).
# fc1 and the biases of Linear layers are not read: x needs no gradient.
READ_IN_BACKWARD = {
    "mlp": {"norm.weight", "norm.bias", "fc2.weight"},
    "attn": {"norm.weight", "norm.bias", "qkv.weight", "proj.weight", "head.weight"},
}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]()


def make_data(name: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    if name == "mlp":
        return torch.randn(6, 7, generator=g), torch.randn(6, 5, generator=g)
    return torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 3, generator=g)


def loss_fn(module, x, y):
    return F.mse_loss(module(x), y)


CONFIGS = {
    "plain": {},
    "no-reshard": {"reshard_after_forward": False},
    "per-module": {"buckets": "per-module"},
    "explicit": {"buckets": "explicit"},  # filled per model below
    "bf16": {"mixed_precision": torch.bfloat16},
    "bf16-per-module": {"mixed_precision": torch.bfloat16, "buckets": "per-module"},
}
EXPLICIT_BUCKETS = {
    # Cross-module buckets; parameters left out are gathered alone.
    "mlp": [["fc1.weight", "fc2.weight"], ["norm.bias", "norm.weight", "fc2.bias"]],
    "attn": [["qkv.weight", "qkv.bias", "proj.weight"], ["head.weight", "head.bias"]],
}


def trace(name: str, config: str, world_size: int = 2) -> FrontResult:
    kwargs = dict(CONFIGS[config])
    if kwargs.get("buckets") == "explicit":
        kwargs["buckets"] = EXPLICIT_BUCKETS[name]
    return fsdp_joint_graph(build(name), make_data(name, 0), loss_fn, world_size, **kwargs)


CASES = [(m, c) for m in MODELS for c in CONFIGS]
CASE_IDS = [f"{m}-{c}" for m, c in CASES]


# --------------------------------------------------------------------------- contract checks


def comm(node: fx.Node) -> str | None:
    return node.meta.get("comm_type")


def nodes_of(gm: fx.GraphModule, comm_type: str) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if comm(n) == comm_type]


def check_contract(result: FrontResult) -> None:
    """Invariants the input contract (docs/design.md) promises, for any configuration."""
    gm = result.gm
    gm.graph.lint()
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    assert all("val" in n.meta for n in nodes), [n.name for n in nodes if "val" not in n.meta]

    # Phases: every forward node before every backward node.
    phases = [bool(n.meta.get("autograd_backward")) for n in nodes]
    assert phases == sorted(phases) and any(phases) and not all(phases)

    dtype = result.mixed_precision or torch.float32
    placeholders = [n for n in nodes if n.op == "placeholder"]
    members_of = {b.bucket_id: list(b.members) for b in result.buckets}
    for g in nodes_of(gm, "fsdp_all_gather") + nodes_of(gm, "fsdp_all_gather_backward"):
        assert g.target is _GATHER
        assert bool(g.meta.get("autograd_backward")) == (comm(g) == "fsdp_all_gather_backward")
        assert [u.target for u in g.users] == [_WAIT]
        assert g.args[1:] == (result.world_size, result.group_name)
        val = g.meta["val"]
        assert val.dtype == dtype
        assert g.meta["fsdp_unsharded_nbytes"] == val.numel() * val.element_size()
        bucket = g.meta.get("fsdp_bucket_id")
        if bucket is None:
            name = g.meta["param_name"]
            assert name in result.param_names
            src = g.args[0]
            if result.mixed_precision is not None:
                # A lone cast, straight from the shard placeholder, used only by the gather.
                assert src.target is torch.ops.aten._to_copy.default and len(src.users) == 1
                src = src.args[0]
            assert src is placeholders[result.param_names.index(name)]
        else:
            assert g.meta["param_name"] == bucket
            assert g.meta["fsdp_bucket_members"] == members_of[bucket]
            pack = g.args[0]
            assert pack.target is torch.ops.aten.cat.default and len(pack.users) == 1
            for part in pack.args[0]:
                # The pack DAG is private: its producers (other than the shard inputs) feed only it.
                assert part.op == "placeholder" or (len(part.users) == 1 and part.args[0].op == "placeholder")
            (wait,) = g.users
            copies = [
                n for n in _alias_closure(wait)[1:] for n in n.users if n.meta.get("fsdp_bucket_copy_out") == bucket
            ]
            assert copies and all(c.target is torch.ops.aten.clone.default for c in copies)

    if not result.reshard_after_forward:
        assert not nodes_of(gm, "fsdp_reshard_free") and not nodes_of(gm, "fsdp_reshard_free_backward")
        assert not nodes_of(gm, "fsdp_all_gather_backward")
        return

    # Every free releases storage nobody reads afterwards, in its own phase.
    for free in nodes_of(gm, "fsdp_reshard_free") + nodes_of(gm, "fsdp_reshard_free_backward"):
        assert free.target is fsdp_free_storage and free.op == "call_function"
        assert free.meta["param_name"] in result.param_names
        assert bool(free.meta["autograd_backward"]) == (comm(free) == "fsdp_reshard_free_backward")
        readers = {u for a in _alias_closure(free.args[0]) for u in [a, *a.users]} - {free}
        assert max(order[r] for r in readers) < order[free], free.name

    # A backward re-gather follows the forward frees of all its parameters.
    last_free = {}
    for free in nodes_of(gm, "fsdp_reshard_free"):
        last_free[free.meta["param_name"]] = free
    for g in nodes_of(gm, "fsdp_all_gather_backward"):
        for name in g.meta.get("fsdp_bucket_members", [g.meta["param_name"]]):
            assert order[last_free[name]] < order[g]

    # No backward node reads storage gathered in the forward (flat buffer or copy-outs).
    for g in nodes_of(gm, "fsdp_all_gather"):
        (wait,) = g.users
        flat = _alias_closure(wait)
        roots = [wait, *(u for a in flat for u in a.users if "fsdp_bucket_copy_out" in u.meta)]
        for root in roots:
            for alias in _alias_closure(root):
                assert not any(u.meta.get("autograd_backward") for u in alias.users), (g.name, alias.name)


@pytest.mark.parametrize(("model", "config"), CASES, ids=CASE_IDS)
def test_graph_meets_input_contract(model, config):
    check_contract(trace(model, config))


def _param_counts(gm: fx.GraphModule, comm_type: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for n in nodes_of(gm, comm_type):
        for name in n.meta.get("fsdp_bucket_members", [n.meta["param_name"]]):
            counts[name] = counts.get(name, 0) + 1
    return counts


@pytest.mark.parametrize("model", list(MODELS))
def test_counts_per_parameter(model):
    result = trace(model, "plain")
    gm, names = result.gm, result.param_names
    backward = READ_IN_BACKWARD[model]
    assert _param_counts(gm, "fsdp_all_gather") == dict.fromkeys(names, 1)
    assert _param_counts(gm, "fsdp_reduce_scatter") == dict.fromkeys(names, 1)
    assert _param_counts(gm, "fsdp_reshard_free") == dict.fromkeys(names, 1)
    assert _param_counts(gm, "fsdp_all_gather_backward") == dict.fromkeys(backward, 1)
    assert _param_counts(gm, "fsdp_reshard_free_backward") == dict.fromkeys(backward, 1)
    # Each parameter is gathered just before its layer runs, not all up front.
    first_gather = {n.meta["param_name"]: n for n in nodes_of(gm, "fsdp_all_gather")}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    compute = [n for n in gm.graph.nodes if n.target in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default)]
    last = names[-1]
    assert order[first_gather[last]] > order[compute[0]]


@pytest.mark.parametrize("model", list(MODELS))
def test_counts_per_bucket(model):
    result = trace(model, "per-module")
    gm = result.gm
    module = build(model)
    expected = [
        tuple(f"{prefix}.{n}" for n, _ in sub.named_parameters(recurse=False))
        for prefix, sub in module.named_modules()
        if list(sub.parameters(recurse=False))
    ]
    assert [b.members for b in result.buckets] == expected
    by_bucket = lambda t: sorted(n.meta["fsdp_bucket_id"] for n in nodes_of(gm, t))  # noqa: E731
    ids = sorted(b.bucket_id for b in result.buckets)
    assert by_bucket("fsdp_all_gather") == ids
    assert by_bucket("fsdp_reduce_scatter") == ids
    backward = READ_IN_BACKWARD[model]
    assert by_bucket("fsdp_all_gather_backward") == sorted(
        b.bucket_id for b in result.buckets if set(b.members) & backward
    )
    # One free per member, tagged with the member's name and its bucket.
    assert _param_counts(gm, "fsdp_reshard_free") == dict.fromkeys(result.param_names, 1)
    assert _param_counts(gm, "fsdp_reshard_free_backward") == dict.fromkeys(backward, 1)
    bucket_of = {m: b.bucket_id for b in result.buckets for m in b.members}
    for free in nodes_of(gm, "fsdp_reshard_free") + nodes_of(gm, "fsdp_reshard_free_backward"):
        assert free.meta["fsdp_bucket_id"] == bucket_of[free.meta["param_name"]]
        assert free.args[0].meta["fsdp_bucket_copy_out"] == free.meta["fsdp_bucket_id"]
    # Copy-outs: one per member in the forward, one per member the backward reads.
    copies = [n for n in gm.graph.nodes if "fsdp_bucket_copy_out" in n.meta]
    assert sum(not n.meta["autograd_backward"] for n in copies) == len(result.param_names)
    assert sum(bool(n.meta["autograd_backward"]) for n in copies) == len(backward)


def test_no_reshard_keeps_gathered_parameters_for_backward():
    gm = trace("mlp", "no-reshard").gm
    gathers = nodes_of(gm, "fsdp_all_gather")
    assert len(gathers) == 6 and not nodes_of(gm, "fsdp_all_gather_backward")
    readers_in_backward = {
        g.meta["param_name"]
        for g in gathers
        for a in _alias_closure(next(iter(g.users)))
        for u in a.users
        if u.meta.get("autograd_backward")
    }
    assert readers_in_backward == READ_IN_BACKWARD["mlp"]


def test_mixed_precision_gathers_and_computes_in_low_precision():
    result = trace("attn", "bf16")
    gm = result.gm
    for g in nodes_of(gm, "fsdp_all_gather") + nodes_of(gm, "fsdp_all_gather_backward"):
        assert g.meta["val"].dtype == torch.bfloat16
    for rs in nodes_of(gm, "fsdp_reduce_scatter"):
        assert rs.meta["val"].dtype == torch.bfloat16
    attention = [n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target)]
    # Attention output and its input gradients are bf16 (the logsumexp it saves stays fp32).
    assert attention and all(n.meta["val"][0].dtype == torch.bfloat16 for n in attention)
    # Gradients come back in the parameters' dtype.
    out = next(iter(reversed(gm.graph.nodes)))
    assert [v.dtype for v in out.meta["val"][1:]] == [torch.float32] * len(result.param_names)


def test_buckets_reject_bad_names():
    module, data = build("mlp"), make_data("mlp", 0)
    with pytest.raises(ValueError, match="unknown parameter 'nope'"):
        fsdp_joint_graph(module, data, loss_fn, 2, buckets=[["fc1.weight", "nope"]])
    with pytest.raises(ValueError, match="more than one bucket"):
        fsdp_joint_graph(module, data, loss_fn, 2, buckets=[["fc1.weight"], ["fc1.weight"]])
    with pytest.raises(ValueError, match="bucket 0 is empty"):
        fsdp_joint_graph(module, data, loss_fn, 2, buckets=[[]])
    with pytest.raises(ValueError, match="per-module"):
        fsdp_joint_graph(module, data, loss_fn, 2, buckets="per-layer")


@pytest.mark.parametrize("world_size", [0, -1, True, 2.0])
def test_rejects_bad_world_size(world_size):
    with pytest.raises(ValueError, match="world_size"):
        fsdp_joint_graph(build("mlp"), make_data("mlp", 0), loss_fn, world_size)


def test_rejects_bad_options():
    module, data = build("mlp"), make_data("mlp", 0)
    with pytest.raises(ValueError, match="mixed_precision"):
        fsdp_joint_graph(module, data, loss_fn, 2, mixed_precision=torch.int32)
    with pytest.raises(ValueError, match="group_name"):
        fsdp_joint_graph(module, data, loss_fn, 2, group_name="")
    with pytest.raises(TypeError, match=r"example_inputs\[1\]"):
        fsdp_joint_graph(module, (data[0], 3), loss_fn, 2)
    with pytest.raises(ValueError, match="one element"):
        fsdp_joint_graph(module, data, lambda m, x, y: m(x) - y, 2)
    with pytest.raises(ValueError, match="no parameters"):
        fsdp_joint_graph(nn.ReLU(), data, lambda m, x, y: m(x).sum(), 2)


def test_tracing_leaves_module_untouched():
    module = build("mlp")
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    trace_result = fsdp_joint_graph(module, make_data("mlp", 0), loss_fn, 2)
    assert trace_result.param_names == list(before)
    assert all(isinstance(p, nn.Parameter) for p in module.parameters())
    assert all(torch.equal(p, before[n]) for n, p in module.named_parameters())


def test_shard_round_trip():
    t = torch.arange(35.0).reshape(5, 7)
    shards = [shard_tensor(t, 3, r) for r in range(3)]
    assert [s.numel() for s in shards] == [12, 12, 12]
    assert torch.equal(shards[2][-1:], torch.zeros(1))
    assert torch.equal(unshard_tensor(shards, t.shape), t)


def test_pickled_graph_keeps_its_frees():
    # Unpickling re-traces the code with make_fx's tracer, which torch imports lazily.
    import torch._higher_order_ops.triton_kernel_wrap  # noqa: F401

    gm = trace("mlp", "plain").gm
    again = pickle.loads(pickle.dumps(gm))
    # Same ops in the same order (names are renumbered by the re-trace), frees included.
    assert [n.target for n in again.graph.nodes] == [n.target for n in gm.graph.nodes]
    assert any(n.target is fsdp_free_storage for n in again.graph.nodes)


# --------------------------------------------------------------------------- numerics


def eager_reference(module: nn.Module, data, dtype=None):
    """Plain autograd on the unsharded module: (loss, {name: grad})."""
    if dtype is not None:
        module = copy.deepcopy(module).to(dtype)
        data = tuple(x.to(dtype) for x in data)
    loss = loss_fn(module, *data)
    names, params = zip(*module.named_parameters())
    return loss.detach(), dict(zip(names, torch.autograd.grad(loss, params)))


@pytest.mark.parametrize("model", list(MODELS))
def test_world_size_one_runs_in_process(model):
    module, data = build(model), make_data(model, 0)
    result = fsdp_joint_graph(module, data, loss_fn, 1, buckets="per-module")
    check_contract(result)
    outputs = run_graph_single(result.gm, result.shard_inputs(module, 0, data))
    loss, grads = eager_reference(module, data)
    assert torch.equal(outputs[0], loss)
    full = result.unshard_grads([outputs])
    for name in result.param_names:
        torch.testing.assert_close(full[name], grads[name], rtol=1e-6, atol=1e-7)


class Tied(nn.Module):
    """Output projection sharing the embedding's weight, plus a buffer (baked in as a constant)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.mid = nn.Linear(8, 8)
        self.out = nn.Linear(8, 10, bias=False)
        self.out.weight = self.emb.weight
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, tokens):
        return self.out(torch.tanh(self.mid(self.emb(tokens))) * self.scale)


@pytest.mark.parametrize("buckets", [None, "per-module"])
def test_tied_weights_gather_once(buckets):
    torch.manual_seed(0)
    module = Tied()
    tokens, labels = torch.randint(0, 10, (3, 4)), torch.randint(0, 10, (3, 4))

    def ce(m, t, y):
        return F.cross_entropy(m(t).flatten(0, 1), y.flatten())

    result = fsdp_joint_graph(module, (tokens, labels), ce, 1, buckets=buckets)
    check_contract(result)
    assert result.param_names == ["emb.weight", "mid.weight", "mid.bias"]
    assert _param_counts(result.gm, "fsdp_all_gather") == dict.fromkeys(result.param_names, 1)
    outputs = run_graph_single(result.gm, result.shard_inputs(module, 0, (tokens, labels)))
    loss = ce(module, tokens, labels)
    grads = dict(zip(result.param_names, torch.autograd.grad(loss, list(module.parameters()))))
    assert torch.equal(outputs[0], loss.detach())
    for name, grad in result.unshard_grads([outputs]).items():
        torch.testing.assert_close(grad, grads[name], rtol=1e-6, atol=1e-7)


def test_frees_release_storage():
    module, data = build("mlp"), make_data("mlp", 0)
    result = fsdp_joint_graph(module, data, loss_fn, 1)
    freed = []

    class Watch(fx.Interpreter):
        def call_function(self, target, args, kwargs):
            out = super().call_function(target, args, kwargs)
            if target is fsdp_free_storage:
                freed.append(args[0].untyped_storage().nbytes())
            return out

    import torch.distributed as dist

    init_gloo(dist.HashStore(), 0, 1)
    try:
        Watch(result.gm).run(*result.shard_inputs(module, 0, data))
    finally:
        dist.destroy_process_group()
    assert len(freed) == len(nodes_of(result.gm, "fsdp_reshard_free")) + len(
        nodes_of(result.gm, "fsdp_reshard_free_backward")
    )
    assert freed and set(freed) == {0}


def _numerics_worker(rank: int, world_size: int, cases):
    out = {}
    for case_id, model, result in cases:
        module, data = build(model), make_data(model, rank)
        graph_out = [t.detach() for t in result.gm(*result.shard_inputs(module, rank, data))]
        out[case_id] = (graph_out, *eager_reference(module, data, result.mixed_precision))
    return out


@pytest.fixture(scope="module")
def two_rank_runs():
    """Every case traced here, executed on 2 gloo ranks in one spawn (process start-up dominates)."""
    traced = {cid: trace(m, c) for cid, (m, c) in zip(CASE_IDS, CASES)}
    cases = [(cid, m, traced[cid]) for cid, (m, c) in zip(CASE_IDS, CASES)]
    return traced, run_ranks(_numerics_worker, 2, args=(cases,))


@pytest.mark.multirank
@pytest.mark.parametrize("case_id", CASE_IDS)
def test_two_ranks_match_eager(two_rank_runs, case_id):
    traced, per_rank = two_rank_runs
    result = traced[case_id]
    outputs = [per_rank[r][case_id][0] for r in range(2)]
    # Each rank's loss is eager's loss on that rank's data slice (same kernels, bitwise).
    for r in range(2):
        assert torch.equal(outputs[r][0], per_rank[r][case_id][1]), r
    # Gradients are those of the sum of the per-rank losses: eager's per-rank gradients
    # summed (two addends, so the reduce-scatter's order of addition does not matter).
    grads = result.unshard_grads(outputs)
    for name in result.param_names:
        expected = per_rank[0][case_id][2][name] + per_rank[1][case_id][2][name]
        assert grads[name].dtype == torch.float32
        assert torch.equal(grads[name], expected.float()), name


def test_a_meta_device_module_traces_with_fake_tensors():
    """bench/llama3_8b.py's Llama-3 shape (grouped-query attention) built on the meta device: the
    front traces it for 8 ranks without the parameters' memory; every gather has its parameter's
    unsharded size and the step's collectives are tagged."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    from llama3_8b import llama3_8b_graph

    gm = llama3_8b_graph(2, dtype=torch.bfloat16, seq=16, world_size=8, dim=64, ffn=96, heads=4, kv_heads=2, vocab=80)
    gathers = [n for n in gm.graph.nodes if n.meta.get("comm_type") == "fsdp_all_gather"]
    sizes = {n.meta["param_name"]: n.meta["fsdp_unsharded_nbytes"] for n in gathers}
    assert sizes["blocks.0.wk.weight"] == 2 * 16 * 64 * 2  # kv_heads × head_dim × dim, bf16
    assert sizes["blocks.1.w1.weight"] == 96 * 64 * 2 and sizes["tok.weight"] == 80 * 64 * 2
    assert len(gathers) == 2 * 9 + 3
    from fxsched import schedule
    from fxsched.ir import verify

    verify(schedule(gm, "default").program)
