"""Training-step graphs users bring beyond one forward and backward, attacked as
tests/test_fronts_attack4.py does: every (or many random) legal order(s) of the lowered program,
raised back to FX, must compute bitwise what the input graph does (outputs, and the inputs the
graph writes), and every built-in pipeline on a distributed graph, run on gloo ranks, must compute
the same numbers on every rank without a hang.

Inputs: optimizer steps traced into the graph (`torch.optim`'s foreach and fused Adam/AdamW and
single-tensor in-place updates, writing lists of parameters and states, lr as a tensor) beside
fxsched's FSDP gathers and reduce-scatters, with bf16 mixed precision; two training steps in one
graph with the optimizer between them (the second step's gathers read what the first step's
update wrote) and gradient accumulation into persistent buffers; FSDP1-style mixed precision
(persistent bf16 shard buffers written by `copy_` before each gather); activation checkpointing
compiled by torch.compile (the post-grad graphs Inductor hands its passes, with its own random
prims); Inductor's collective bucketing in random legal orders; `while_loop` bodies that return
an input. Each test that names a fix computed other numbers in some legal order before it; the
others pin what was attacked without finding a hole.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn
from torch.fx.experimental.proxy_tensor import make_fx

from fxsched.lowering import lower

from test_fronts_attack import _random_orders, assert_every_legal_order_computes_the_same

aten = torch.ops.aten


# --------------------------------------------------------------------------- Inductor's random prims


def _inductor_dropout_graph() -> fx.GraphModule:
    """What Inductor's post-grad graph makes of dropouts and `rand_like` (`replace_random`): one
    `inductor_seeds` draw, then per random op a `lookup_seed` and an `inductor_random` (or
    `inductor_randint`) given that seed, with independent work between them."""
    import torch._inductor.inductor_prims  # noqa: F401  (registers the prims)

    prims = torch.ops.prims
    g = fx.Graph()
    x = g.placeholder("x")
    seeds = g.call_function(prims.inductor_seeds.default, (3, torch.device("cpu")))
    h, outs = x, []
    for i in range(2):
        seed = g.call_function(prims.inductor_lookup_seed.default, (seeds, i))
        draw = g.call_function(prims.inductor_random.default, ([4, 8], seed, "rand"))
        h = g.call_function(aten.mul.Tensor, (g.call_function(aten.gt.Scalar, (draw, 0.3)), h))
        outs.append(g.call_function(aten.sin.default, (x,)))
    seed = g.call_function(prims.inductor_lookup_seed.default, (seeds, 2))
    ints = g.call_function(prims.inductor_randint.default, (0, 100, [4, 8], seed))
    g.output((h, ints, *outs))
    return fx.GraphModule(nn.Module(), g)


def test_inductors_random_prims_keep_their_order_as_they_draw_when_run_as_fx():
    """`prims.inductor_random` and `inductor_randint` take a seed that only Inductor's generated code
    reads: run as FX (the graph fxsched hands back, a fallback kernel) they call `torch.rand` /
    `torch.randint`, drawing from the global generator, and no tag says so. They were pure: of the
    legal orders tried (400 and 30 random) most drew other numbers (29 of 30 random orders of a
    compiled checkpointed model's forward). Now random, as `inductor_seeds` is: every order bitwise."""
    gm = _inductor_dropout_graph()
    program = lower(gm)
    assert all(program.op(n).random for n in program.schedule if "inductor_rand" in n)
    assert_every_legal_order_computes_the_same(gm, [torch.randn(4, 8)])


class _CheckpointedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        h = nn.functional.dropout(torch.relu(self.a(x)), 0.3, training=True)
        return self.b(h) + torch.rand_like(x) * 0.01


def test_a_compiled_checkpointed_models_post_grad_graphs_keep_their_draws_in_order():
    """torch.compile of two checkpointed blocks with a dropout and a `rand_like` each (Inductor's
    fallback kernels: no C++ built): the forward and backward post-grad graphs Inductor hands its
    passes (the backward recomputes the forward's masks from the seeds it saved). Before the random
    prims were random, 29 and 22 of 30 random legal orders of them computed other numbers run as FX."""
    from torch.utils.checkpoint import checkpoint

    from test_fronts_attack2 import assert_random_legal_orders_compute_the_same
    from test_fronts_attack5 import _Capture, _feeds

    torch._dynamo.reset()
    torch.manual_seed(0)
    blocks = nn.ModuleList([_CheckpointedBlock(), _CheckpointedBlock()])

    def model(x):
        for block in blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x

    capture = _Capture()
    options = {"fallback_by_default": True, "fx_graph_cache": False, "post_grad_custom_post_pass": capture}
    compiled = torch.compile(model, backend="inductor", options=options)
    compiled(torch.randn(4, 8, requires_grad=True)).square().sum().backward()
    assert len(capture.graphs) == 2
    for k, gm in enumerate(capture.graphs):
        assert any(n.target is torch.ops.prims.inductor_random.default for n in gm.graph.nodes)
        assert_random_legal_orders_compute_the_same(gm, _feeds(gm, k), count=20)


# --------------------------------------------------------------------------- optimizer steps in the graph


def _outputs_and_inputs(gm: fx.GraphModule, inputs) -> list[torch.Tensor]:
    """`gm`'s outputs on copies of `inputs`, then those copies as the graph left them (an optimizer
    step writes its parameters and states in place and may return nothing)."""
    import copy

    gm = copy.deepcopy(gm)
    torch.manual_seed(0)
    given = [t.clone() for t in inputs]
    with torch.no_grad():
        out = gm(*given)
    flat = list(out) if isinstance(out, (tuple, list)) else [out]
    while any(isinstance(t, (tuple, list)) for t in flat):
        flat = [u for t in flat for u in (t if isinstance(t, (tuple, list)) else [t])]
    return [t for t in flat if isinstance(t, torch.Tensor)] + given


def assert_random_orders_compute_the_same_outputs_and_writes(gm: fx.GraphModule, inputs, count: int) -> None:
    """`count` seeded random legal orders of `gm`'s lowered program, raised, compute its outputs and
    leave its inputs as it does, bitwise (NaN where it has NaN)."""
    from test_fronts_attack2 import _raised_in_random_orders

    def same(a, b):
        return a.dtype == b.dtype and a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())

    expected = _outputs_and_inputs(gm, inputs)
    for order, raised in _raised_in_random_orders(lower(gm), count):
        got = _outputs_and_inputs(raised, inputs)
        assert len(got) == len(expected) and all(map(same, expected, got)), (
            f"a legal order computes other numbers or writes others: {[n for n in order if not n.startswith('^')]}")


def _foreach_program(seed: int, *inputs):
    """A seeded random optimizer-like program over `inputs` (1-D, 6 elements): torch's foreach and
    fused ops writing lists of them, of views of them and of fresh tensors (`_foreach_add_`,
    `_foreach_lerp_`, `_foreach_addcdiv_`, `_foreach_copy_`, `_fused_adam_`, an `out=` list),
    `out=` writes into slices (`split_with_sizes_copy`, `_chunk_cat`, FSDP2's `fsdp.chunk_cat` and
    `fsdp.split_with_sizes_copy`), `copy_`, `index_put_`, and reads."""
    import random

    import torch.distributed.fsdp  # noqa: F401  (registers torch.ops.fsdp)

    rng = random.Random(seed)
    pool, outs = list(inputs), []

    def pick(k):
        return rng.sample(pool, min(k, len(pool)))

    for _ in range(rng.randint(6, 12)):
        kind = rng.choice(["add_", "lerp_", "addcdiv_", "copy_list", "fresh", "view", "adam", "out", "swsc", "chunk",
                           "fsdp_swsc", "fsdp_chunk", "list_out", "copy_", "index_put_", "read"])
        targets = pick(rng.randint(1, 3))
        others = [t * 0.5 + 1 for t in targets]
        flat = [t for t in targets if t.dim() == 1 and t.numel() == 6]
        if kind == "add_":
            torch._foreach_add_(targets, others, alpha=0.5)
        elif kind == "lerp_":
            torch._foreach_lerp_(targets, others, 0.1)
        elif kind == "addcdiv_":
            torch._foreach_addcdiv_(targets, others, [t.abs() + 1 for t in others], value=0.3)
        elif kind == "copy_list":
            torch._foreach_copy_(targets, [t + 1 for t in others])
        elif kind == "fresh":
            pool.extend(torch._foreach_sqrt([t.abs() for t in targets]))
        elif kind == "view":
            pool.append(targets[0][: rng.randint(1, targets[0].numel())])
        elif kind == "adam":
            moments = [torch.zeros_like(t) for t in targets]
            torch._fused_adam_(targets, others, moments, [torch.ones_like(t) for t in targets], [],
                               [torch.tensor(1.0) for _ in targets], lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.0,
                               eps=1e-8, amsgrad=False, maximize=False)
            pool.extend(moments)
        elif kind == "out":
            torch.add(others[0], 1.5, out=targets[0])
        elif kind == "list_out":
            aten._foreach_add.List_out(others, [t * 2 for t in others], alpha=2.0, out=targets)
        elif kind == "copy_":
            targets[0].copy_(others[0] * 2)
        elif kind == "index_put_" and targets[0].dim() == 1:
            targets[0].index_put_((torch.tensor([0, 0]),), others[0][:1].expand(2) * 1, accumulate=True)
        elif kind == "read":
            outs.append(sum(t.sum() for t in targets))
        elif flat and kind == "swsc":
            aten.split_with_sizes_copy.out(torch.cat([flat[0][3:], pool[0][:3]]) * 2, [3, 3], 0,
                                           out=[flat[0][:3], pool[1][3:]])
        elif flat and kind == "chunk":
            aten._chunk_cat.out([flat[0][:2] + 1, pool[0][:2] + 2], 0, 2, out=flat[0][:4].view(2, 2))
        elif flat and kind == "fsdp_chunk":
            torch.ops.fsdp.chunk_cat([flat[0][2:4] + 1, pool[0][:2] + 2], 0, 2, out=flat[0][:4].view(2, 2))
        elif flat and kind == "fsdp_swsc":
            torch.ops.fsdp.split_with_sizes_copy(torch.stack([flat[0][:3], pool[0][:3]]) * 3, [2, 1], dim=1,
                                                 out=[flat[0][:4].view(2, 2), pool[1][:2].view(2, 1)])
    return (*outs, *[t * 1 for t in pool[len(inputs):]])


def test_random_programs_of_foreach_and_fused_optimizer_ops_keep_their_numbers_and_writes():
    """Optimizer-like programs (`_foreach_program`) traced by make_fx in real and fake mode: random
    legal orders compute their outputs and leave their inputs (the parameters and states they write)
    as traced (nothing found: this pins it; 80 programs and 20 orders each were tried)."""
    import functools

    for seed in range(6):
        inputs = [torch.randn(6, generator=torch.Generator().manual_seed(seed * 4 + i)) for i in range(4)]
        for mode in ("real", "fake"):
            gm = make_fx(functools.partial(_foreach_program, seed), tracing_mode=mode)(*[t.clone() for t in inputs])
            assert_random_orders_compute_the_same_outputs_and_writes(gm, inputs, count=6)


def _optimizer_step(params, optimizer):
    def step(x, g0, g1):
        with torch.no_grad():
            params[0].grad, params[1].grad = g0, g1
            optimizer.step()
            states = [t * 1 for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
            return x * params[0].sum() + params[1].sum(), *states

    return step


def test_an_optimizer_step_with_state_make_fx_closes_over_keeps_its_numbers_and_writes():
    """make_fx of `opt.step()` after a first step (foreach Adam, fused Adam, foreach SGD with
    momentum): the parameters and states are tensors the trace closes over (get_attr constants,
    one per use, written in place by the foreach and fused ops). Nothing found: this pins it."""
    for make in (lambda ps: torch.optim.Adam(ps, lr=0.1, foreach=True), lambda ps: torch.optim.Adam(ps, lr=0.1, fused=True),
                 lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True)):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(5))]
        optimizer = make(params)
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.step()

        inputs = [torch.randn(3), torch.randn(4, 3), torch.randn(5)]
        gm = make_fx(_optimizer_step(params, optimizer))(*inputs)
        assert any(n.op == "get_attr" for n in gm.graph.nodes)
        assert_random_orders_compute_the_same_outputs_and_writes(gm, inputs, count=10)


# --------------------------------------------------------------------------- FSDP training steps with the optimizer in the graph

#: the pipelines every multirank test here runs (with `unorder-reduce-scatters`: the reduce-scatters
#: whose results the optimizer reads)
PIPELINES = ("reference", "default", "rewrite", "default,unshard", "default,bucket",
             "unorder-reduce-scatters,gradients-first,default")


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


def _adam(kind: str, n: int):
    """AdamW over `n` parameters, as make_fx traces `torch.optim.adamw`'s functional form: `fused`
    (`_fused_adamw_`, lr a tensor) or `foreach` (`_foreach_*_` ops). Takes (params, grads,
    exp_avgs, exp_avg_sqs, steps: n each, lr)."""
    from torch.optim.adam import adam

    def step(*flat):
        p, g, m, v, s = (list(flat[i * n:(i + 1) * n]) for i in range(5))
        adam(p, g, m, v, [], s, foreach=True if kind == "foreach" else None, fused=True if kind == "fused" else None,
             capturable=False, differentiable=False, grad_scale=None, found_inf=None, has_complex=False, amsgrad=False,
             beta1=0.9, beta2=0.999, lr=flat[5 * n] if kind == "fused" else 0.01, weight_decay=0.01, eps=1e-8,
             maximize=False, decoupled_weight_decay=True)

    return step


def _inline(graph: fx.Graph, gm: fx.GraphModule, env: dict, owner: nn.Module, prefix: str) -> list:
    """Copy `gm`'s nodes into `graph` (its placeholders as `env` maps them, its constants onto
    `owner`); its output's values."""
    import copy

    for node in gm.graph.nodes:
        if node.op == "output":
            return [env[a] if isinstance(a, fx.Node) else a for a in (node.args[0] or ())]
        if node.op == "get_attr":
            name = prefix + node.target.replace(".", "_")
            if not hasattr(owner, name):
                setattr(owner, name, copy.deepcopy(getattr(gm, node.target)))
            env[node] = graph.get_attr(name)
            env[node].meta = dict(node.meta)
        elif node.op != "placeholder":
            env[node] = graph.node_copy(node, env.__getitem__)
    return []


def _train(kind: str, accumulate: bool, bf16: bool):
    """Two FSDP training steps in one graph, from fxsched's front (per-parameter gathers, backward
    re-gathers, reduce-scatters; bf16 compute where `bf16`): step 1, AdamW (`kind`) writing the
    shards and its states, then step 2, whose gathers read the updated shards; or (`accumulate`) both
    steps' gradients added in place into persistent buffers, then AdamW. Returns the graph and the
    inputs of each rank (shards, each step's data, the optimizer's states, the buffers)."""
    from fxsched.front import fsdp_joint_graph

    from ranks import rank_feeds

    torch.manual_seed(0)
    module, data = _Net(), [torch.randn(3, 8)]
    front = fsdp_joint_graph(module, data, lambda m, x: (m(x) ** 2).sum(), 2, group_name="dp",
                             mixed_precision=torch.bfloat16 if bf16 else None)
    n = len(front.param_names)
    step_inputs = list(front.gm.graph.find_nodes(op="placeholder"))
    shapes = [p.meta["val"].shape for p in step_inputs[:n]]
    examples = [torch.empty(s) for _ in range(4) for s in shapes] + [torch.tensor(3.0) for _ in shapes]
    optimizer = make_fx(_adam(kind, n), tracing_mode="fake")(*examples, torch.tensor(0.01))
    optimizer_inputs = list(optimizer.graph.find_nodes(op="placeholder"))
    owner, graph = nn.Module(), fx.Graph()

    def placeholders(nodes, suffix):
        made = []
        for node in nodes:
            made.append(graph.placeholder(node.name + suffix))
            made[-1].meta = dict(node.meta)
        return made

    shards = placeholders(step_inputs[:n], "")
    data1, data2 = placeholders(step_inputs[n:], "_a"), placeholders(step_inputs[n:], "_b")
    state = placeholders(optimizer_inputs[2 * n:], "_opt")
    buffers = placeholders(step_inputs[:n], "_acc") if accumulate else []

    def accumulate_into(grads):
        for buffer, grad in zip(buffers, grads):
            graph.call_function(aten.add_.Tensor, (buffer, grad)).meta = {"autograd_backward": True}

    loss1, *grads1 = _inline(graph, front.gm, dict(zip(step_inputs, shards + data1)), owner, "s1_")
    if accumulate:
        accumulate_into(grads1)
    else:
        _inline(graph, optimizer, dict(zip(optimizer_inputs, shards + grads1 + state)), owner, "o_")
    loss2, *grads2 = _inline(graph, front.gm, dict(zip(step_inputs, shards + data2)), owner, "s2_")
    if accumulate:
        accumulate_into(grads2)
        _inline(graph, optimizer, dict(zip(optimizer_inputs, shards + buffers + state)), owner, "o_")
    graph.output((loss1, loss2, *grads1, *grads2, *shards, *state, *buffers))
    gm = fx.GraphModule(owner, graph)
    gen = torch.Generator().manual_seed(1)
    extra = [torch.rand(s, generator=gen) for _ in range(2) for s in shapes] + [torch.tensor(3.0) for _ in shapes]
    extra += [torch.tensor(0.01)] + ([torch.rand(s, generator=gen) for s in shapes] if accumulate else [])
    feeds = [first + second[n:] + extra for first, second in zip(rank_feeds(front, module, data),
                                                                  rank_feeds(front, module, [data[0] * 2 + 1]))]
    return gm, feeds


def _train_build(config, rank, world_size):
    return _train(*config)[0]


def _train_feeds(config, rank):
    return _train(*config)[1][rank]


@pytest.mark.multirank
@pytest.mark.parametrize("config", [("fused", False, True), ("foreach", True, False)],
                         ids=["two-steps-fused-adamw-bf16", "accumulated-foreach-adamw"])
def test_fsdp_steps_with_the_optimizer_in_the_graph_in_random_orders_and_pipelines_are_bitwise_on_two_ranks(config):
    """Two FSDP training steps in one graph with AdamW between them (the second step's gathers, and
    its backward re-gathers, read the shards the first step's `_fused_adamw_` wrote; bf16 casts
    before the gathers), or with both steps' gradients accumulated in place before a foreach
    AdamW: 8 random legal orders and every pipeline compute the step bitwise on 2 gloo ranks, the
    written shards and states included, and none hangs (nothing found: this pins it; 20 orders of
    each of 8 such graphs were tried, foreach / fused / single-tensor updates, per-module buckets)."""
    import functools

    from fxsched.runtime import run_ranks

    from test_fronts_attack4 import _check, _run_orders

    orders = _random_orders(lower(_train(*config)[0]), 8, 0)
    results = run_ranks(_run_orders, 2, args=(functools.partial(_train_build, config), ("dp",), orders, PIPELINES,
                                              functools.partial(_train_feeds, config)), timeout=1200)
    _check(results, orders, PIPELINES)


def _fsdp1_mixed_precision_step(w1, w2, b1, b2, x, m1, m2, mark):
    """FSDP1-style mixed precision by hand: persistent bf16 shard buffers written by `copy_` from the
    fp32 shards before each gather (forward, and again before the backward re-gather), bf16
    gradients reduce-scattered and cast to fp32, momentum SGD writing the fp32 shards and the
    momentum in place. `mark.add_(0)`: where the backward starts."""
    c10d = torch.ops._c10d_functional

    def gather(buffer, shard, shape):
        buffer.copy_(shard)
        return c10d.wait_tensor(c10d.all_gather_into_tensor(buffer, 2, "dp")).view(shape)

    first = gather(b1, w1, (16, 8))
    h = torch.relu(x @ first.t())
    y = h @ gather(b2, w2, (4, 16)).t()
    loss = y.float().square().sum()
    mark.add_(0)
    dy = 2 * y
    dh = (dy @ gather(b2, w2, (4, 16))) * (h > 0)
    grads = [dy.t() @ h, dh.t() @ x]
    out = [loss]
    for shard, momentum, grad in zip((w2, w1), (m2, m1), grads):
        g = c10d.wait_tensor(c10d.reduce_scatter_tensor(grad.reshape(-1), "sum", 2, "dp")).float() / 2
        momentum.mul_(0.9).add_(g)
        shard.add_(momentum, alpha=-0.01)
        out.append(g)
    return tuple(out)


def _fsdp1_build(rank, world_size):
    import torch.distributed._functional_collectives  # noqa: F401

    from fxsched.lowering.structural import tag_fsdp_collectives

    gm = make_fx(_fsdp1_mixed_precision_step, tracing_mode="fake")(*_fsdp1_feeds(0))
    backward = False
    for node in gm.graph.nodes:
        node.meta["autograd_backward"] = backward
        backward = backward or (node.target is aten.add_.Tensor and node.args[0].name.startswith("mark"))
    tag_fsdp_collectives(gm)
    return gm


def _fsdp1_feeds(rank):
    gen = torch.Generator().manual_seed(rank)
    return [torch.randn(64, generator=gen), torch.randn(32, generator=gen), torch.zeros(64, dtype=torch.bfloat16),
            torch.zeros(32, dtype=torch.bfloat16), torch.randn(3, 8, generator=gen).bfloat16(),
            torch.randn(64, generator=gen), torch.randn(32, generator=gen), torch.zeros(())]


@pytest.mark.multirank
def test_fsdp1_style_mixed_precision_with_shard_buffers_written_before_each_gather_is_bitwise_on_two_ranks():
    """Persistent bf16 shard buffers that `copy_` refreshes before each gather (FSDP1's mixed
    precision), and an in-place momentum update of the fp32 shards at the end: 10 random legal
    orders and every pipeline compute the step bitwise on 2 gloo ranks, none hangs (nothing found:
    this pins it; 20 orders were tried). The structural stage does not take these for FSDP gathers
    (each gathers a `copy_`'s result, not a graph input): they keep their place in the collective
    order."""
    from fxsched.runtime import run_ranks

    from test_fronts_attack4 import _check, _run_orders

    orders = _random_orders(lower(_fsdp1_build(0, 2)), 10, 0)
    results = run_ranks(_run_orders, 2, args=(_fsdp1_build, ("dp",), orders, PIPELINES, _fsdp1_feeds), timeout=1200)
    _check(results, orders, PIPELINES)


# --------------------------------------------------------------------------- Inductor's buckets, checkpointing, while_loop


def _inductor_bucket_worker(rank, world_size, mode, count):
    import fxsched
    from fxsched.integrations.structural import tag_fsdp_collectives
    from fxsched.ir.program import Schedule
    from fxsched.raising import raise_program

    from test_coalesced import _inputs
    from test_inductor_buckets import _bucketed

    torch.set_num_threads(1)
    _, bucketed, model = _bucketed(mode)
    tag_fsdp_collectives(bucketed)
    program = lower(bucketed)
    modules = [bucketed]
    for order in _random_orders(program, count, 0):
        program.schedule = Schedule(order)
        modules.append(raise_program(program))
    modules += [fxsched.schedule(bucketed, p, cost_model=model).graph_module for p in PIPELINES]
    inputs = [t.detach() for t in _inputs(rank)] + [torch.tensor(1.0)]
    runs = []
    for module in modules:
        with torch.no_grad():
            runs.append([t for t in module(*[t.clone() for t in inputs]) if t is not None])
    return runs


@pytest.mark.multirank
@pytest.mark.parametrize("mode", [None, "coalesced"], ids=["default", "coalesced"])
def test_inductors_own_buckets_in_random_legal_orders_and_every_pipeline_are_bitwise_on_two_ranks(mode):
    """After Inductor's FSDP pre-bucketing (`_pre_bucket_all_gather` packing the shards into a fresh
    buffer, an `all_gather_into_tensor_out` into it, its split; the reduce-scatters packed, or
    coalesced): 10 random legal orders and every pipeline compute Inductor's numbers bitwise on 2
    gloo ranks (tests/test_inductor_buckets.py ran `default` only; nothing found: this pins it)."""
    from fxsched.runtime import run_ranks

    results = run_ranks(_inductor_bucket_worker, 2, args=(mode, 10), timeout=900)
    for rank, runs in enumerate(results):
        for k, got in enumerate(runs[1:]):
            assert len(got) == len(runs[0]) and all(map(torch.equal, runs[0], got)), f"rank {rank}: run {k} differs"


def test_make_fx_of_checkpointed_blocks_with_dropout_keeps_its_draws_in_order():
    """make_fx (real mode) of two `torch.utils.checkpoint` blocks with a dropout and a `rand_like`
    each, forward and `autograd.grad`: the backward recomputes each block, its dropout drawing
    again (`bernoulli_`; the trace keeps no RNG state restore, so it draws new numbers, as the
    traced graph does). Random legal orders compute the traced graph's numbers (nothing found)."""
    from torch.utils.checkpoint import checkpoint

    from test_fronts_attack2 import assert_random_legal_orders_compute_the_same

    torch.manual_seed(0)
    blocks = nn.ModuleList([_CheckpointedBlock(), _CheckpointedBlock()])
    params = list(blocks.parameters())

    def step(x, *ps):
        h = x
        for block in blocks:
            h = checkpoint(block, h, use_reentrant=False)
        loss = h.square().sum()
        return (loss, *torch.autograd.grad(loss, [x, *ps]))

    gm = make_fx(step)(torch.randn(4, 8, requires_grad=True), *params)
    assert sum(n.target is aten.bernoulli_.float for n in gm.graph.nodes) == 4  # two drawn, two redrawn
    assert_random_legal_orders_compute_the_same(gm, [torch.randn(4, 8), *[p.detach() for p in params]], count=10)


def _subgraph(build, inputs: int) -> fx.GraphModule:
    g = fx.Graph()
    g.output(build(g, *[g.placeholder(f"p{i}") for i in range(inputs)]))
    return fx.GraphModule(nn.Module(), g)


def test_a_while_loop_whose_body_returns_an_input_may_alias_every_operand():
    """A hand-built `while_loop` (dynamo and make_fx refuse a body returning an input) whose body
    hands back a carried input, an additional input, or a view of one: after an iteration the
    result is that tensor. Its operands come as two tuples, so lowering cannot tell which operand an
    input is: the result `may_alias` every one (imprecise, safe), and random legal orders with writes
    of each operand and through the result compute the traced numbers."""
    import operator

    from test_fronts_attack2 import assert_random_legal_orders_compute_the_same

    condition = _subgraph(lambda g, i, y, w: g.call_function(aten.lt.Scalar, (i, 2)), 3)
    for returned in (lambda g, y, w: y, lambda g, y, w: w, lambda g, y, w: g.call_function(aten.view.default, (w, [4]))):
        root = nn.Module()
        root.cond = condition
        root.body = _subgraph(lambda g, i, y, w: (g.call_function(aten.add.Tensor, (i, 1)), returned(g, y, w)), 3)
        g = fx.Graph()
        x, w, i0 = g.placeholder("x"), g.placeholder("w"), g.placeholder("i0")
        loop = g.call_function(torch.ops.higher_order.while_loop, (g.get_attr("cond"), g.get_attr("body"), (i0, x), (w,)))
        r = g.call_function(operator.getitem, (loop, 1))
        reads = [g.call_function(aten.mul.Tensor, (r, 3))]
        g.call_function(aten.add_.Tensor, (x, 1))
        reads.append(g.call_function(aten.mul.Tensor, (r, 5)))
        g.call_function(aten.mul_.Tensor, (w, 2))
        reads.append(g.call_function(aten.sub.Tensor, (r, 1)))
        g.call_function(aten.add_.Tensor, (r, 7))
        reads += [g.call_function(aten.mul.Tensor, (x, 1)), g.call_function(aten.mul.Tensor, (w, 1))]
        g.output(tuple(reads))
        gm = fx.GraphModule(root, g)
        (op,) = [op for op in lower(gm).ops() if "while_loop" in op.name]
        assert set(op.may_alias) == {"x", "w", "i0"}
        assert_random_legal_orders_compute_the_same(gm, [torch.randn(4), torch.randn(4), torch.tensor(0)], count=30)


# --------------------------------------------------------------------------- side-effectful higher-order ops


def _control_deps_graph(body: str) -> fx.GraphModule:
    """Inductor's `control_deps(additional_deps, subgraph, *args)` (its overlap scheduler and its
    random-op chaining wrap a node so, keeping its name; torch.fx calls it side-effectful) around a
    subgraph that returns a view of its input, writes it in place (`add_`, which returns it), or
    makes fresh storage; then reads of the result, writes of the input and through the result."""
    from torch._inductor.fx_passes.control_dependencies import control_deps

    inner = fx.Graph()
    p = inner.placeholder("p0")
    inner.output(inner.call_function({"view": aten.view.default, "in place": aten.add_.Tensor,
                                      "fresh": aten.mul.Tensor}[body], (p, [4] if body == "view" else 2)))
    root = nn.Module()
    root.sub = fx.GraphModule(nn.Module(), inner)
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    dep = g.call_function(aten.mul.Tensor, (y, 3))
    r = g.call_function(control_deps, ((dep,), g.get_attr("sub"), x))
    reads = [g.call_function(aten.mul.Tensor, (r, 3))]
    g.call_function(aten.add_.Tensor, (x, 1))
    reads += [g.call_function(aten.mul.Tensor, (r, 5)), g.call_function(aten.mul.Tensor, (x, 7))]
    g.call_function(aten.add_.Tensor, (r, 2))
    reads += [g.call_function(aten.mul.Tensor, (x, 1)), g.call_function(aten.sin.default, (y,))]
    g.output(tuple(reads))
    return fx.GraphModule(root, g)


@pytest.mark.parametrize("body", ["view", "in place", "fresh"])
def test_a_side_effectful_higher_order_op_returning_its_input_is_a_barrier_whose_result_aliases_it(body):
    """A barrier (a side-effectful call: nothing crosses it) lost what its subgraph says of its result:
    `control_deps` around a view of x, or an `add_` of x, returned x's storage as fresh, so the reads
    of the result after it and the writes of x after it were unordered (59 of 60 random legal
    orders computed other numbers, for each). The barrier's result now aliases the operand the
    subgraph returns (`hop_alias`), as a pure higher-order op's does; fresh storage stays fresh."""
    gm = _control_deps_graph(body)
    (barrier,) = [op for op in lower(gm).ops() if op.name == "control_deps"]
    assert barrier.alias == (None if body == "fresh" else "x")
    from test_fronts_attack2 import assert_random_legal_orders_compute_the_same

    assert_random_legal_orders_compute_the_same(gm, [torch.randn(4), torch.randn(4)], count=60)


# --------------------------------------------------------------------------- SimpleFSDP, bf16, checkpointing, dropout, compiled


class _DropoutBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return x + self.down(nn.functional.dropout(torch.relu(self.up(self.norm(x))), 0.2, training=True))


class _CheckpointedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_DropoutBlock(), _DropoutBlock()])

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        x = x.to(torch.bfloat16)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x.float()


def _simple_fsdp_bf16(mesh):
    from torchtitan.experiments.graph_trainer import simple_fsdp

    torch.manual_seed(0)
    policy = simple_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return simple_fsdp.data_parallel(_CheckpointedModel(), mesh, mode="fully_shard", mp_policy=policy)


def _simple_fsdp_worker(rank, world_size, pipelines, orders):
    """One rank: the compiled step (SimpleFSDP, bf16 params and fp32 reductions, two checkpointed
    blocks with a dropout) as Inductor compiles it and with fxsched's pass running each pipeline;
    then its post-grad graphs as traced and in `orders` random legal orders, each run from one seed
    (the graphs draw: `inductor_seeds`, then `inductor_random` per dropout, the backward's from the
    forward's seeds)."""
    import hashlib

    from torch.distributed.device_mesh import init_device_mesh

    import test_fronts_attack5 as attack5
    from fxsched.integrations.inductor import FxschedInductorPass

    attack5._short_timeouts()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    capture = attack5._Capture()
    steps = {"traced": attack5._compiled_step(mesh, rank, capture, model=_simple_fsdp_bf16, width=8)}
    for pipeline in pipelines:
        steps[pipeline] = attack5._compiled_step(mesh, rank, FxschedInductorPass(pipeline, on_error="raise"),
                                                 model=_simple_fsdp_bf16, width=8)
    run_guarded = attack5._run_guarded

    def seeded(mesh, module, inputs):
        torch.manual_seed(0)
        return run_guarded(mesh, module, inputs)

    attack5._run_guarded = seeded
    digest = hashlib.sha256()
    graphs = [attack5._runs_in_orders(mesh, gm, attack5._feeds(gm, 1000 * i + rank), orders, digest)
              for i, gm in enumerate(capture.graphs)]
    draws = [sum(n.target is torch.ops.prims.inductor_random.default for n in gm.graph.nodes) for gm in capture.graphs]
    return {"steps": steps, "graphs": graphs, "orders": digest.hexdigest(), "draws": draws}


@pytest.mark.multirank
def test_a_compiled_simple_fsdp_step_with_bf16_checkpointing_and_dropout_is_bitwise_on_two_ranks():
    """torchtitan's SimpleFSDP (bf16 parameters cast before their gathers, fp32 reduce-scatters) over
    two checkpointed blocks with a dropout, compiled with fxsched's Inductor pass on 2 gloo ranks:
    each pipeline's step equals the compiled step bitwise, and so do 6 random legal orders of each
    post-grad graph, none hangs. Before Inductor's random prims were random, 6 of 10 orders of each
    graph computed other numbers on both ranks."""
    pytest.importorskip("torchtitan.experiments.graph_trainer.simple_fsdp")
    from fxsched.runtime import run_ranks

    pipelines, orders = ("default", "rewrite"), 6
    results = run_ranks(_simple_fsdp_worker, 2, args=(pipelines, orders), timeout=1200)
    assert results[0]["draws"] == [2, 2]  # a dropout per block, drawn in the forward, redrawn in the backward
    assert len({r["orders"] for r in results}) == 1
    for rank, r in enumerate(results):
        traced = r["steps"]["traced"]
        assert not isinstance(traced, str), traced
        for pipeline in pipelines:
            got = r["steps"][pipeline]
            assert not isinstance(got, str) and all(map(torch.equal, traced, got)), f"rank {rank}: {pipeline} differs"
        for index, runs in enumerate(r["graphs"]):
            bad = [k for k, got in enumerate(runs[1:]) if isinstance(got, str) or not all(map(torch.equal, runs[0], got))]
            assert not bad, f"rank {rank}: graph {index}: {len(bad)} of {orders} orders differ or hang"


def _tagged_copy(x, y):
    v = x.view(-1)
    a = v * 3
    x.copy_(y)  # tagged barrier below: make_fx reads x through this node from here on
    x.add_(1)
    b = v * 2
    x.mul_(2)
    return a, b, v * 5, torch.sin(torch.ones(3))


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_a_node_tagged_barrier_keeps_what_its_result_aliases(mode):
    """A user's `barrier=True` tag on an in-place op (make_fx's `x.copy_(y)`, pinning a parameter
    update): nothing crosses it, but its result, through which make_fx reads and writes x from then
    on, was fresh storage, so `x.add_(1)` (written through it) and a read of `v`, a view of x taken
    before, were unordered after the barrier: 59 of 60 random legal orders computed other numbers,
    in real and fake mode. The tagged barrier's result now aliases what the op returns (x)."""
    from test_fronts_attack2 import assert_random_legal_orders_compute_the_same

    gm = make_fx(_tagged_copy, tracing_mode=mode)(torch.randn(4), torch.randn(4))
    (copy,) = [n for n in gm.graph.nodes if n.target is aten.copy_.default]
    copy.meta["barrier"] = True
    (barrier,) = [op for op in lower(gm).ops() if op.name == copy.name]
    assert barrier.reason == "tagged barrier" and barrier.alias == "x_1"
    assert_random_legal_orders_compute_the_same(gm, [torch.randn(4), torch.randn(4)], count=60)


# --------------------------------------------------------------------------- collectives inside a higher-order op


def _send_inside(rank, world_size, module=False):
    """A ring step whose send (`isend` and its wait) is inside an `invoke_subgraph` (a region compiled
    once, `nested_compile_region`) or, `module`, a called GraphModule (`split_module`'s stage), the
    receive and its wait outside, around it as traced."""
    import operator

    import torch.distributed._functional_collectives  # noqa: F401

    c10d = torch.ops._c10d_functional
    sub = fx.Graph()
    kv = sub.placeholder("p0")
    sub.call_function(c10d.wait_tensor.default, (sub.call_function(c10d.isend.default, (kv, (rank + 1) % world_size, 0,
                                                                                          "cp")),))
    sub.output((sub.call_function(aten.mul.Tensor, (kv, 2)),))
    root = nn.Module()
    root.send_region = fx.GraphModule(nn.Module(), sub)
    g = fx.Graph()
    q, kv = g.placeholder("q"), g.placeholder("kv")
    recv = g.call_function(c10d.irecv.default, (g.call_function(aten.empty_like.default, (kv,)),
                                                (rank - 1) % world_size, 0, "cp"))
    if module:
        region = g.call_function(operator.getitem, (g.call_module("send_region", (kv,)), 0))
    else:
        region = g.call_function(torch.ops.higher_order.invoke_subgraph, (g.get_attr("send_region"), "send_region", kv))
    acc = g.call_function(aten.mul.Tensor, (q, g.call_function(operator.getitem, (region, 0))))
    out = g.call_function(aten.add.Tensor, (acc, g.call_function(c10d.wait_tensor.default, (recv,))))
    g.output((out, g.call_function(torch.sin, (g.call_function(torch.ones, (3,)),))))
    return fx.GraphModule(root, g)


def _send_inside_feeds(rank):
    return [torch.arange(4.0) + 1 + rank, torch.arange(4.0) * (rank + 2)]


@pytest.mark.multirank
@pytest.mark.parametrize("module", [False, True], ids=["invoke_subgraph", "graph-module-stage"])
def test_a_higher_order_op_with_a_send_inside_is_a_barrier_so_no_legal_order_hangs(module):
    """A higher-order op whose subgraph sends (or runs any collective) was plain compute: the
    point-to-point order (a receive's wait follows the sends traced before it) did not see the send
    inside, so a legal order could wait for the receive before the op posted its send, or run the op
    (whose send waits for the peer's receive) before the receive was posted: 11 of 12 random legal
    orders hung on 2 gloo ranks. Such an op is now a barrier (`collective inside`): 0 hang. A called
    GraphModule (taken to write what it is given, so never moved above the receive) likewise."""
    import functools

    from fxsched.runtime import run_ranks

    from test_fronts_attack4 import _check, _run_orders

    build = functools.partial(_send_inside, module=module)
    program = lower(build(0, 2))
    assert program.op("send_region" if module else "invoke_subgraph").reason == "collective inside"
    orders = _random_orders(program, 6, 0)
    results = run_ranks(_run_orders, 2, args=(build, ("cp",), orders, (), _send_inside_feeds), timeout=600)
    _check(results, orders, ())


def _freeing_region_graph() -> fx.GraphModule:
    """`invoke_subgraph` whose subgraph reads its input, then frees its storage with Inductor's
    `resize_storage_bytes_(x, 0)` (FSDP2's reshard as torch.compile traces it), with a read of x
    before it outside."""
    import operator

    import torch._inductor  # noqa: F401  (registers the inductor ops)

    sub = fx.Graph()
    p = sub.placeholder("p0")
    doubled = sub.call_function(aten.mul.Tensor, (p, 2))
    sub.call_function(torch.ops.inductor.resize_storage_bytes_.default, (p, 0))
    sub.output((doubled,))
    root = nn.Module()
    root.region = fx.GraphModule(nn.Module(), sub)
    g = fx.Graph()
    x = g.placeholder("x")
    before = g.call_function(aten.add.Tensor, (x, 1))
    region = g.call_function(torch.ops.higher_order.invoke_subgraph, (g.get_attr("region"), "region", x))
    result = g.call_function(operator.getitem, (region, 0))
    g.output((before, result, g.call_function(aten.sin.default, (result,))))
    return fx.GraphModule(root, g)


def test_a_higher_order_op_with_a_side_effect_inside_is_a_barrier():
    """A side-effectful call without declared writes inside a subgraph (`resize_storage_bytes_`
    freeing the subgraph's input) left the higher-order op plain compute writing nothing: 11 of 30
    random legal orders read x after the op had freed it (the run segfaults). Such an op is now a
    barrier (`side effect inside`), as the call is in the graph itself."""
    gm = _freeing_region_graph()
    program = lower(gm)
    assert program.op("invoke_subgraph").reason == "side effect inside"
    assert all(order.index("add_tensor") < order.index("invoke_subgraph") for order in _random_orders(program, 30, 0))
    from test_fronts_attack2 import assert_random_legal_orders_compute_the_same

    assert_random_legal_orders_compute_the_same(gm, [torch.rand(4) + 1], count=10)


def test_a_higher_order_op_reading_a_tensor_of_its_own_that_the_graph_writes_is_a_barrier():
    """A subgraph that reads a tensor attribute of its own (make_fx's constant for a buffer a branch
    closes over), the same tensor the outer graph writes through its get_attr (`buf.add_(1)`): no
    operand names what the op reads, so it crossed the write (19 of 30 random legal orders computed
    other numbers). It is now a barrier where the graph writes one of its tensors (`module state`,
    as a called module reading its state is); one whose tensors nothing writes is not."""
    import operator

    from test_fronts_attack2 import assert_random_legal_orders_compute_the_same

    for written in (True, False):
        buffer = torch.randn(4)
        holder = nn.Module()
        holder.buf = buffer
        sub = fx.Graph()
        p = sub.placeholder("p0")
        sub.output((sub.call_function(aten.mul.Tensor, (p, sub.get_attr("buf"))),))
        root = nn.Module()
        root.region, root.buf = fx.GraphModule(holder, sub), buffer
        g = fx.Graph()
        x = g.placeholder("x")
        region = g.call_function(torch.ops.higher_order.invoke_subgraph, (g.get_attr("region"), "region", x))
        outer = g.get_attr("buf")
        if written:
            g.call_function(aten.add_.Tensor, (outer, 1))
        g.output((g.call_function(operator.getitem, (region, 0)), g.call_function(aten.mul.Tensor, (outer, 2)),
                  g.call_function(aten.sin.default, (x,))))
        gm = fx.GraphModule(root, g)
        assert gm.region.buf is gm.buf
        op = lower(gm).op("invoke_subgraph")
        assert (getattr(op, "reason", None) == "module state") is written
        assert_random_legal_orders_compute_the_same(gm, [torch.randn(4)], count=30)
