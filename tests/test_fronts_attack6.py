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

import torch
from torch import fx, nn

from fxsched.lowering import lower

from test_fronts_attack import _random_orders, assert_every_legal_order_computes_the_same  # noqa: F401

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
