"""The scale generator: size, determinism, contract tags per option, vals, and real execution."""

from __future__ import annotations

import math
import operator
import os
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.interpreter import Interpreter
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fxsched.front.generate import generate_graph, min_nodes, release_storage
from fxsched.runtime import init_gloo

c10d = torch.ops._c10d_functional
aten = torch.ops.aten
GATHER = c10d.all_gather_into_tensor.default
WAIT = c10d.wait_tensor.default
REDUCE_SCATTER = c10d.reduce_scatter_tensor.default
GATHER_TYPES = {"fsdp_all_gather", "fsdp_all_gather_backward"}
FREE_TYPES = {"fsdp_reshard_free", "fsdp_reshard_free_backward"}
VIEWS = {aten.view.default, aten.slice.Tensor, aten.t.default, aten.permute.default, aten.select.int, operator.getitem}

# Per transformer layer: 12 parameters, 8 of them read by the backward (not the linear biases);
# the head adds 3, all read by the backward.
PARAMS, BACKWARD_PARAMS, HEAD = 12, 8, 3


def calls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def tagged(gm, comm_type):
    return [n for n in gm.graph.nodes if n.meta.get("comm_type") == comm_type]


def layers_of(gm):
    return gm.meta["fxsched_generate"]["layers"]


def valid_size(node):
    size = node.meta.get("fsdp_unsharded_nbytes")
    return isinstance(size, int) and not isinstance(size, bool) and size >= 0


@pytest.mark.parametrize("num_nodes", [1000, 2501, 6000])
@pytest.mark.parametrize(
    "options", [{}, {"buckets": True, "mixed_precision": True}, {"attention": False, "reshard": False}]
)
def test_hits_requested_size(num_nodes, options):
    gm = generate_graph(num_nodes, **options)
    assert abs(len(gm.graph.nodes) - num_nodes) <= 1


def test_explicit_layers_pad_to_size():
    gm = generate_graph(5000, layers=3)
    assert layers_of(gm) == 3 and abs(len(gm.graph.nodes) - 5000) <= 1


def test_deterministic_and_seeded():
    a, b = generate_graph(2000, seed=5, buckets=True), generate_graph(2000, seed=5, buckets=True)
    assert a.code == b.code
    strip = lambda gm: [{k: v for k, v in n.meta.items() if k != "val"} for n in gm.graph.nodes]  # noqa: E731
    assert strip(a) == strip(b)
    assert generate_graph(2000, seed=6, buckets=True).code != a.code


def test_lints_and_every_node_has_val():
    gm = generate_graph(3000, buckets=True, mixed_precision=True)
    gm.graph.lint()
    for node in gm.graph.nodes:
        assert "val" in node.meta, node
        if node.op in ("placeholder", "call_function") and node.target is not release_storage:
            vals = node.meta["val"] if isinstance(node.meta["val"], tuple) else (node.meta["val"],)
            assert all(isinstance(v, FakeTensor) for v in vals), node
    assert len(gm.graph.output_node().meta["val"]) == len(gm.graph.output_node().args[0])


def test_frees_and_barriers_survive_dead_code_elimination():
    gm = generate_graph(1500)
    effects = lambda: [n for n in calls(gm) if n.target in (release_storage, aten.copy_.default)]  # noqa: E731
    before = len(effects())
    assert release_storage in torch.fx.node._side_effectful_functions
    gm.graph.eliminate_dead_code()
    assert len(effects()) == before > 0


def test_views_share_their_base_storage():
    gm = generate_graph(1000)
    for node in calls(gm):
        if node.target in (aten.view.default, aten.slice.Tensor, aten.t.default):
            base = node.args[0].meta["val"]
            assert node.meta["val"].untyped_storage()._cdata == base.untyped_storage()._cdata, node


def test_vals_match_fake_tensor_prop():
    gm = generate_graph(1200, world_size=3, buckets=True, mixed_precision=True)
    expected = {n: n.meta["val"] for n in gm.graph.nodes}
    placeholders = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    FakeTensorProp(gm).propagate(*placeholders)
    for node in calls(gm):
        if node.target is release_storage:
            continue
        mine, theirs = expected[node], node.meta["val"]
        mine = mine if isinstance(mine, tuple) else (mine,)
        theirs = theirs if isinstance(theirs, tuple) else (theirs,)
        for m, t in zip(mine, theirs, strict=True):
            assert (m.shape, m.stride(), m.dtype) == (t.shape, t.stride(), t.dtype), node


def check_contract(gm, world_size=2):
    """Structural facts of the input contract (docs/design.md) that hold for every option set."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    body = calls(gm)
    phases = [bool(n.meta.get("autograd_backward")) for n in body]
    assert phases == sorted(phases), "all forward nodes come before all backward nodes"
    frees = {(n.meta["param_name"], bool(n.meta.get("autograd_backward"))): n
             for n in body if n.meta.get("comm_type") in FREE_TYPES}
    for launch in (n for n in body if n.target is GATHER):
        assert launch.meta["comm_type"] in GATHER_TYPES
        assert launch.args[1:] == (world_size, "0")
        (wait,) = launch.users
        assert wait.target is WAIT
        assert bool(launch.meta.get("autograd_backward")) == (launch.meta["comm_type"] == "fsdp_all_gather_backward")
        if valid_size(launch):
            val = launch.meta["val"]
            assert launch.meta["fsdp_unsharded_nbytes"] == val.numel() * val.element_size()
    # every free follows every reader of the storage it releases (views included)
    last_read = {}
    for node in body:
        if node.target is release_storage:
            continue
        for arg in node.all_input_nodes:
            if isinstance(arg.meta.get("val"), torch.Tensor):
                storage = arg.meta["val"].untyped_storage()._cdata
                last_read[storage] = max(last_read.get(storage, -1), order[node])
    for free in frees.values():
        assert free.target is release_storage and len(free.args) == 1
        storage = free.args[0].meta["val"].untyped_storage()._cdata
        assert last_read[storage] < order[free], f"{free.meta['param_name']} is read after its free {free}"
    for rs in (n for n in body if n.target is REDUCE_SCATTER):
        assert rs.meta["comm_type"] == "fsdp_reduce_scatter" and rs.meta["autograd_backward"]
        assert [u.target for u in rs.users] == [WAIT]
    outputs = gm.graph.output_node().args[0]
    assert outputs[0].meta["val"].dim() == 0
    assert all(o.target is WAIT and o.args[0].target is REDUCE_SCATTER for o in outputs[1:])


def test_default_tags():
    gm = generate_graph(2500)
    check_contract(gm)
    L = layers_of(gm)
    assert len(tagged(gm, "fsdp_all_gather")) == PARAMS * L + HEAD
    assert len(tagged(gm, "fsdp_reshard_free")) == PARAMS * L + HEAD
    assert len(tagged(gm, "fsdp_all_gather_backward")) == BACKWARD_PARAMS * L + HEAD
    assert len(tagged(gm, "fsdp_reshard_free_backward")) == BACKWARD_PARAMS * L + HEAD
    assert len(tagged(gm, "fsdp_reduce_scatter")) == PARAMS * L + HEAD
    assert all(valid_size(n) for n in calls(gm) if n.target is GATHER)
    for launch in (n for n in calls(gm) if n.target is GATHER):
        assert launch.args[0].op == "placeholder"
        assert "fsdp_bucket_id" not in launch.meta
        # wait -> slice (padding off) -> view to the parameter's shape
        (wait,) = launch.users
        (trim,) = wait.users
        (view,) = [u for u in trim.users]
        assert (trim.target, view.target) == (aten.slice.Tensor, aten.view.default)
    targets = Counter(str(n.target) for n in calls(gm))
    assert targets["aten._scaled_dot_product_flash_attention_for_cpu.default"] == L
    assert targets["aten._scaled_dot_product_flash_attention_for_cpu_backward.default"] == L
    assert targets["aten.addmm.default"] == 4 * L and targets["aten.mm.default"] == 8 * L + 3
    barrier_layers = len(range(1, L, 4))
    assert barrier_layers >= 1
    assert targets["aten.copy_.default"] == barrier_layers
    assert sum(bool(n.meta.get("barrier")) for n in gm.graph.nodes) == barrier_layers
    copies = [n for n in calls(gm) if n.target is aten.copy_.default]
    assert all(c.args[0].op == "placeholder" and not c.meta.get("autograd_backward") for c in copies)
    assert all(n.meta.get("autograd_backward") for n in gm.graph.nodes if n.meta.get("barrier"))


def test_no_barriers_no_attention():
    gm = generate_graph(2000, barriers=False, attention=False)
    check_contract(gm)
    assert not any(n.meta.get("barrier") or n.target is aten.copy_.default for n in calls(gm))
    assert not any("attention" in str(n.target) for n in calls(gm))
    L = layers_of(gm)
    assert len(tagged(gm, "fsdp_all_gather")) == PARAMS // 2 * L + HEAD


def test_no_reshard():
    gm = generate_graph(2000, reshard=False)
    check_contract(gm)
    L = layers_of(gm)
    assert not tagged(gm, "fsdp_all_gather_backward") and not tagged(gm, "fsdp_reshard_free")
    assert len(tagged(gm, "fsdp_reshard_free_backward")) == PARAMS * L + HEAD


def test_buckets():
    gm = generate_graph(2500, buckets=True)
    check_contract(gm)
    L = layers_of(gm)
    members = Counter()
    for launch in (n for n in calls(gm) if n.target is GATHER):
        bucket = launch.meta.get("fsdp_bucket_id")
        phase = launch.meta["comm_type"]
        if bucket is None:
            members[phase] += 1
            continue
        names = launch.meta["fsdp_bucket_members"]
        assert bucket and 2 <= len(names) <= 4
        pack = launch.args[0]
        assert pack.target is aten.cat.default and list(pack.users) == [launch]
        assert all(s.op == "placeholder" for s in pack.args[0])
        copy_outs = [n for n in calls(gm) if n.meta.get("fsdp_bucket_copy_out") == bucket]
        assert len(copy_outs) == len(names) and all(c.target is aten.clone.default for c in copy_outs)
        members[phase] += len(names)
    assert sum(1 for n in calls(gm) if n.meta.get("fsdp_bucket_id")) >= 2 * L
    assert members["fsdp_all_gather"] == PARAMS * L + HEAD
    assert members["fsdp_all_gather_backward"] == BACKWARD_PARAMS * L + HEAD
    assert len(tagged(gm, "fsdp_reshard_free")) == PARAMS * L + HEAD


def test_mixed_precision():
    gm = generate_graph(2000, mixed_precision=True)
    check_contract(gm)
    cast = torch.ops.prims.convert_element_type.default
    for launch in (n for n in calls(gm) if n.target is GATHER):
        src = launch.args[0]
        assert src.target is cast and src.args[1] is torch.bfloat16
        assert list(src.users) == [launch] and src.args[0].op == "placeholder"
        assert launch.meta["val"].dtype is torch.bfloat16
    for rs in (n for n in calls(gm) if n.target is REDUCE_SCATTER):
        assert rs.meta["val"].dtype is torch.float32


@pytest.mark.parametrize("fraction", [0.0, 0.25, 1.0])
def test_missing_sizes(fraction):
    gm = generate_graph(2000, missing_sizes=fraction, buckets=True)
    gathers = [n for n in calls(gm) if n.target is GATHER]
    assert sum(not valid_size(n) for n in gathers) == round(fraction * len(gathers))


def test_padding_when_world_size_does_not_divide():
    gm = generate_graph(1500, world_size=3)
    check_contract(gm, world_size=3)
    assert any(n.target is aten.constant_pad_nd.default for n in calls(gm))


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_nodes"):
        generate_graph(0)
    with pytest.raises(ValueError, match="num_nodes"):
        generate_graph(True)
    with pytest.raises(ValueError, match="too small"):
        generate_graph(50)
    with pytest.raises(ValueError, match="too small"):
        generate_graph(1000, layers=10)
    with pytest.raises(ValueError, match="world_size"):
        generate_graph(1000, world_size=0)
    with pytest.raises(ValueError, match="missing_sizes"):
        generate_graph(1000, missing_sizes=1.5)
    with pytest.raises(ValueError, match="buckets"):
        generate_graph(1000, buckets="yes")
    with pytest.raises(ValueError, match="group_name"):
        generate_graph(1000, group_name=0)
    with pytest.raises(ValueError, match="divisible"):
        generate_graph(1000, hidden=10, heads=4)
    smallest = min_nodes(buckets=True)
    assert len(generate_graph(smallest, buckets=True).graph.nodes) == smallest
    with pytest.raises(ValueError, match="too small"):
        generate_graph(smallest - 1, buckets=True)


# ---- execution on a one-rank gloo group --------------------------------------------------

@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    """The default process group, as one gloo rank in this process; yields its name."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            pytest.skip("a multi-rank process group is already initialised")
        yield dist.group.WORLD.group_name
        return
    store = dist.FileStore(str(tmp_path_factory.mktemp("gloo") / "store"), 1)
    init_gloo(store, 0, 1)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


def random_inputs(gm, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(v.shape, dtype=v.dtype, generator=generator)
            for v in (n.meta["val"] for n in gm.graph.find_nodes(op="placeholder"))]


class MetadataChecker(Interpreter):
    """Runs the graph and checks each real output's shape, stride and dtype against its val."""

    def run_node(self, node):
        out = super().run_node(node)
        if node.op == "call_function" and node.target is not release_storage:
            real = out if isinstance(out, tuple) else (out,)
            fake = node.meta["val"] if isinstance(node.meta["val"], tuple) else (node.meta["val"],)
            for r, f in zip(real, fake, strict=True):
                assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype), node
        return out


@pytest.mark.parametrize(
    "options",
    [{}, {"buckets": True}, {"mixed_precision": True, "buckets": True}, {"reshard": False},
     {"attention": False, "barriers": False}],
    ids=["default", "buckets", "bf16-buckets", "no-reshard", "mlp-only"],
)
def test_executes_on_one_rank(one_rank_group, options):
    gm = generate_graph(900, world_size=1, group_name=one_rank_group, **options)
    inputs = random_inputs(gm)
    outputs = MetadataChecker(gm).run(*[t.clone() for t in inputs])
    assert len(outputs) == 1 + len(inputs) - 1 - sum(
        1 for n in gm.graph.find_nodes(op="placeholder") if n.name.endswith("running_mean"))
    assert all(torch.isfinite(o).all() for o in outputs)
    again = gm(*[t.clone() for t in inputs])
    assert all(torch.equal(a, b) for a, b in zip(outputs, again))


def reference_loss(gm, shards, activations):
    """The generated model in eager PyTorch, from one-rank shards (each shard = its parameter)."""
    gelus = [n.kwargs["approximate"] for n in calls(gm) if n.target is aten.gelu.default]
    hidden = activations.shape[-1]
    heads = 2
    x = activations.reshape(-1, hidden)
    b, s = activations.shape[:2]
    params = iter(shards)

    def take(*shape):
        return next(params)[: math.prod(shape)].view(shape)

    for approximate in gelus:
        ln1w, ln1b = take(hidden), take(hidden)
        qkv_w, qkv_b, proj_w, proj_b = take(3 * hidden, hidden), take(3 * hidden), take(hidden, hidden), take(hidden)
        ln2w, ln2b = take(hidden), take(hidden)
        fc1_w, fc1_b, fc2_w, fc2_b = take(4 * hidden, hidden), take(4 * hidden), take(hidden, 4 * hidden), take(hidden)
        h = F.layer_norm(x, [hidden], ln1w, ln1b, 1e-5)
        q, k, v = F.linear(h, qkv_w, qkv_b).view(b, s, 3, heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(0, 2, 1, 3).reshape(-1, hidden)
        x = x + F.linear(a, proj_w, proj_b)
        h = F.layer_norm(x, [hidden], ln2w, ln2b, 1e-5)
        x = x + F.linear(F.gelu(F.linear(h, fc1_w, fc1_b), approximate=approximate), fc2_w, fc2_b)
    norm_w, norm_b = take(hidden), take(hidden)
    head_w = next(params)
    logits = F.linear(F.layer_norm(x, [hidden], norm_w, norm_b, 1e-5), head_w.view(-1, hidden))
    return (logits * logits).mean()


@pytest.mark.parametrize("options", [{}, {"buckets": True, "reshard": False}])
def test_gradients_match_autograd(one_rank_group, options):
    """The hand-written backward is the true gradient of the forward (fp32, one rank)."""
    gm = generate_graph(800, world_size=1, group_name=one_rank_group, **options)
    activations, *shards = [t for t, n in zip(random_inputs(gm), gm.graph.find_nodes(op="placeholder"))
                            if not n.name.endswith("running_mean")]
    shards = [(s * 0.3).requires_grad_(True) for s in shards]
    buffers = [torch.zeros(16) for n in gm.graph.find_nodes(op="placeholder") if n.name.endswith("running_mean")]
    loss, *grads = gm(activations, *[s.detach() for s in shards], *buffers)
    expected_loss = reference_loss(gm, shards, activations)
    expected = torch.autograd.grad(expected_loss, shards)
    torch.testing.assert_close(loss, expected_loss.detach())
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


# ---- scale ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_scale():
    """100k nodes in a full run (FXSCHED_SCALE=100000); CI runs the default, small size."""
    num_nodes = int(os.environ.get("FXSCHED_SCALE", "5000"))
    gm = generate_graph(num_nodes, buckets=True, mixed_precision=True, missing_sizes=0.1)
    assert abs(len(gm.graph.nodes) - num_nodes) <= 1
    gm.graph.lint()
    assert all("val" in n.meta for n in gm.graph.nodes)
