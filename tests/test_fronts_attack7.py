"""Graphs users bring from Ascend NPUs and from torch's own fused compute-and-communicate ops,
attacked as tests/test_fronts_attack4.py and tests/test_fronts_attack6.py do: every (or many
random) legal order(s) of the lowered program, raised back to FX, must compute bitwise what the
input graph does, and every built-in pipeline on a distributed graph, run on gloo ranks, must
compute the same numbers on every rank without a hang.

torch-npu cannot be imported here (it needs Ascend's CANN libraries): its ops are recognised by
name, so each is registered below through `torch.library` in the `npu` namespace with the schema
torch-npu gives it (Ascend/op-plugin's op_plugin_functions.yaml, trimmed of arguments that change
nothing here) and a CPU implementation that behaves like the real one in the respect attacked: a
random op draws from the global generator, a fused matmul-communication op runs its collective.

Inputs: NPU random ops whose schema carries no `nondeterministic_seeded` tag (npu_fusion_attention
before torch-npu tagged it in 2026, its _v2 and _v3, npu_fused_attention_score) and other libraries'
attentions that drop (flash-attn's custom op), calls fxsched cannot see into that draw, and such
ops called by their packet (`torch.ops.npu.npu_fusion_attention(...)`, as dynamo records it) or
wrapped by `auto_functionalized_v2` in Inductor's post-grad graph; collectives run inside a
higher-order op (a functionalized symmetric-memory all-reduce, a region's subgraph); NPU ops
that run a collective inside on an HCCL group named by a string (fused matmul + all-gather / reduce-scatter /
all-to-all, MoE dispatch and combine, a barrier) beside functional collectives; torch.compile
(dynamic=True) graphs of SimpleFSDP-style layers through fxsched's Inductor pass on 2 gloo ranks
(SymInt placeholders, `sym_size` nodes, parameters of static and of symbolic size) and make_fx
(tracing_mode="symbolic") of an FSDP step with each rank's own batch size. Each test that
names a fix computed other numbers (or moved a collective across another) in some legal order
before it; the others pin what was attacked without finding a hole.
"""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx, nn

from fxsched.lowering import lower

from test_fronts_attack import assert_every_legal_order_computes_the_same

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
ALL_PIPELINES = ("reference", "default", "rewrite", "default,unshard", "default,bucket",
                 "unorder-reduce-scatters,gradients-first,default")
HANG_SECONDS = 10  # a collective of the harness's groups that waits longer has hung


# --------------------------------------------------------------------------- NPU random ops without a tag


def _attention_draw(q, k, v, keep_prob):
    """Attention whose probabilities are dropped with a mask drawn from the global generator (what
    torch-npu's kernels do with keep_prob < 1: the seed and offset they return are the generator's)."""
    p = torch.softmax(q @ k.transpose(-1, -2), -1)
    seed = torch.randint(0, 2**31 - 1, (1,)).item()
    if keep_prob < 1:
        p = p * (torch.rand(p.shape) < keep_prob) / keep_prob
    return p @ v, p.amax(-1), p.sum(-1), seed


def _fusion_attention(q, k, v, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None, scale=1.0,
                      keep_prob=1.0, *rest):
    out, mx, sm, seed = _attention_draw(q, k, v, keep_prob)
    return out, mx, sm, torch.empty(0), seed, 0, q.numel()


def _fusion_attention_v2(q, k, v, head_num, input_layout, *, keep_prob=1.0, **rest):
    return _fusion_attention(q, k, v, head_num, input_layout, keep_prob=keep_prob)


def _fusion_attention_v3(q, k, v, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None, scale=1.0,
                         keep_prob=1.0, *rest):
    out, mx, sm, seed = _attention_draw(q, k, v, keep_prob)
    return out, mx, sm, torch.empty(0), torch.tensor([seed]), torch.tensor([0])


def _fused_attention_score_fwd(q, k, v, mask, scale, keep_prob, *rest):
    out, _, sm, _ = _attention_draw(q, k, v, keep_prob)
    return out, sm, sm.clone()


_NPU = torch.library.Library("npu", "FRAGMENT")
#: torch-npu's random ops whose schema has no `nondeterministic_seeded` tag: npu_fusion_attention and
#: _v2 until op-plugin's a54a06a3 (2026-03-06, "sperate dropout_mask with fa"), _v3 and
#: npu_fused_attention_score_fwd still
_NPU_RANDOM = {
    "npu_fusion_attention": (
        "npu_fusion_attention(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, "
        "Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, float scale=1., float keep_prob=1., "
        "int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, int[]? prefix=None, "
        "int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, bool gen_mask_parallel=True, "
        "bool sync=False) -> (Tensor, Tensor, Tensor, Tensor, int, int, int)", _fusion_attention),
    "npu_fusion_attention_v2": (
        "npu_fusion_attention_v2(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, *, "
        "Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, Tensor? query_rope=None, "
        "Tensor? key_rope=None, float scale=1., float keep_prob=1., int pre_tokens=2147483647, "
        "int next_tokens=2147483647, int inner_precise=0, int[]? prefix=None, int[]? actual_seq_qlen=None, "
        "int[]? actual_seq_kvlen=None, int sparse_mode=0, bool gen_mask_parallel=True, bool sync=False, "
        "int pse_type=1, int[]? q_start_idx=None, int[]? kv_start_idx=None) -> (Tensor, Tensor, Tensor, Tensor, int, int, int)",
        _fusion_attention_v2),
    "npu_fusion_attention_v3": (
        "npu_fusion_attention_v3(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, "
        "Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, float scale=1., float keep_prob=1., "
        "int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, SymInt[]? prefix=None, "
        "Tensor? actual_seq_qlen=None, Tensor? actual_seq_kvlen=None, int sparse_mode=0, bool gen_mask_parallel=True, "
        "bool sync=False, str softmax_layout=\"\", Tensor? sink=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
        _fusion_attention_v3),
    "npu_fused_attention_score_fwd": (
        "npu_fused_attention_score_fwd(Tensor query_layer, Tensor key_layer, Tensor value_layer, "
        "Tensor attention_mask, Scalar scale, float keep_prob, bool query_transpose=False, bool key_transpose=False, "
        "bool value_transpose=False, bool dx_transpose=False) -> (Tensor, Tensor, Tensor)", _fused_attention_score_fwd),
}
for _name, (_schema, _impl) in _NPU_RANDOM.items():
    _NPU.define(_schema)
    _NPU.impl(_name, _impl, "CompositeExplicitAutograd")


def _npu_random_graph(kind: str) -> fx.GraphModule:
    """An NPU attention with keep_prob 0.9 between two torch dropouts (tagged random), each of
    independent inputs: only the generator ties the three together."""
    op = getattr(torch.ops.npu, kind).default
    g = fx.Graph()
    q, k, v, x = (g.placeholder(n) for n in "qkvx")
    first = g.call_function(aten.native_dropout.default, (x, 0.5, True))
    if kind == "npu_fused_attention_score_fwd":
        mask = g.call_function(aten.zeros_like.default, (q,))
        att = g.call_function(op, (q, k, v, mask, 1.0, 0.9))
    elif kind == "npu_fusion_attention_v2":
        att = g.call_function(op, (q, k, v, 1, "BSH"), {"keep_prob": 0.9})
    else:
        att = g.call_function(op, (q, k, v, 1, "BSH", None, None, None, 1.0, 0.9))
    out = g.call_function(operator.getitem, (att, 0))
    last = g.call_function(aten.bernoulli.p, (g.call_function(aten.sin.default, (x,)), 0.5))
    g.output((g.call_function(operator.getitem, (first, 0)), out, last))
    return fx.GraphModule(nn.Module(), g)


def _npu_random_inputs():
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(2, 4, 4, generator=gen) for _ in range(3)] + [torch.randn(16, generator=gen)]


@pytest.mark.parametrize("kind", list(_NPU_RANDOM))
def test_npu_attentions_that_drop_are_random_though_no_tag_says_so(kind):
    """torch-npu's fused attentions draw their dropout mask from the generator when keep_prob < 1
    (they return its seed and offset for the backward to replay), but npu_fusion_attention and _v2
    carried no `nondeterministic_seeded` tag until 2026-03, and _v3 and npu_fused_attention_score_fwd
    carry none: they were pure, free to swap with a torch dropout, and other orders drew other masks."""
    gm = _npu_random_graph(kind)
    program = lower(gm)
    assert program.op(f"{kind}_default").random
    assert_every_legal_order_computes_the_same(gm, _npu_random_inputs())


# --------------------------------------------------------------------------- other libraries' attentions that drop


#: flash-attn's forward as it registers it (`torch.library.custom_op("flash_attn::_flash_attn_forward",
#: mutates_args=())`: no tag), and its backward, which replays the `rng_state` the forward returned
@torch.library.custom_op("flash_attn::_flash_attn_forward", mutates_args=())
def _flash_attn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, softmax_scale: float,
                        causal: bool, window_size_left: int, window_size_right: int, softcap: float,
                        alibi_slopes: torch.Tensor | None, return_softmax: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    out, mx, _, seed = _attention_draw(q, k, v, 1 - dropout_p)
    return out, mx, torch.empty(0), torch.tensor([seed, 0])


@_flash_attn_forward.register_fake
def _(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
      return_softmax):
    return torch.empty_like(q), q.new_empty(q.shape[:-1]), q.new_empty(0), torch.empty(2, dtype=torch.int64)


@torch.library.custom_op("flash_attn::_flash_attn_backward", mutates_args=("dq",))
def _flash_attn_backward(dout: torch.Tensor, q: torch.Tensor, dq: torch.Tensor, dropout_p: float,
                         rng_state: torch.Tensor | None = None) -> torch.Tensor:
    dq.copy_(dout * q)
    return dq.sum()


@_flash_attn_backward.register_fake
def _(dout, q, dq, dropout_p, rng_state=None):
    return dq.new_empty(())


def _flash_step(q, k, v, x):
    first = torch.nn.functional.dropout(x, 0.5)
    out = torch.ops.flash_attn._flash_attn_forward(q, k, v, 0.1, 1.0, False, -1, -1, 0.0, None, False)
    dq = torch.zeros_like(q)
    torch.ops.flash_attn._flash_attn_backward(out[0], q, dq, 0.1, out[3])
    return first, out[0], torch.bernoulli(torch.sigmoid(x)), dq


def test_a_custom_attention_op_with_a_dropout_probability_is_random():
    """flash-attn's `flash_attn::_flash_attn_forward(q, k, v, dropout_p, ...)` draws its dropout mask
    from the generator and returns the state for its backward to replay; `torch.library.custom_op`
    tags nothing, so it was pure: between two torch dropouts (make_fx, fake mode) 425 of 430 legal
    orders drew other numbers. An op outside aten and prims with a float `dropout_p` / `keep_prob`
    argument and no `rng_state` / `seed` / `offset` one is random now; its backward (given
    `rng_state`) is not."""
    from torch.fx.experimental.proxy_tensor import make_fx

    inputs = _npu_random_inputs()
    gm = make_fx(_flash_step, tracing_mode="fake")(*inputs)
    program = lower(gm)
    kinds = {program.op(n).target: program.op(n).random for n in program.schedule if "flash_attn" in n}
    assert kinds == {"flash_attn._flash_attn_forward.default": True, "flash_attn._flash_attn_backward.default": False}
    assert_every_legal_order_computes_the_same(gm, inputs)


# --------------------------------------------------------------------------- calls fxsched cannot see into that draw


def _noisy(x):
    """A user's function symbolic_trace keeps as one call (`torch.fx.wrap`): it draws."""
    return x + torch.randn_like(x)


torch.fx.wrap("_noisy")


class _Noise(nn.Module):
    """A user's module (not torch.nn's) a tracer keeps as a leaf: it draws, and holds no state."""

    def forward(self, x):
        return x * torch.rand_like(x)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.noise = _Noise()

    def forward(self, x, y):
        return _noisy(x), self.noise(y), _noisy(y * 2), torch.rand_like(x), torch.sin(x), y.cos()


class _LeafTracer(fx.Tracer):
    def is_leaf_module(self, m, name):
        return isinstance(m, _Noise) or super().is_leaf_module(m, name)


def test_calls_fxsched_cannot_see_into_keep_their_order_with_the_draws():
    """A call fxsched cannot see into (a `torch.fx.wrap`'d function, a module not from torch.nn) was
    taken to write what it is given, not to draw: two such calls drawing `randn_like` / `rand_like`
    and a `torch.rand_like` were free to swap, and 213 of 240 legal orders drew other numbers. Such a
    call is ordered with the random ops now (0 of 54)."""
    model = _Model()
    gm = fx.GraphModule(model, _LeafTracer().trace(model))
    program = lower(gm)
    assert all(program.op(n).random for n in program.schedule if n.startswith(("_noisy", "noise", "rand_like")))
    assert_every_legal_order_computes_the_same(gm, [torch.randn(4), torch.randn(4)])


# --------------------------------------------------------------------------- NPU fused matmul-communication ops


#: torch-npu's ops that communicate inside (fused matmul + all-gather / reduce-scatter / all-to-all,
#: MoE dispatch and combine across expert-parallel ranks, a barrier, attention-FFN disaggregation),
#: by their leading arguments (op-plugin's schema to the first keyword-only argument, or trimmed
#: after the group): their group is a `str hcom` / `group` / `group_ep` (an HCCL comm name)
_NPU_COMMUNICATING = {
    "npu_all_gather_quant_mm": "(Tensor self, Tensor x2, str hcom, int world_size, *, Tensor? bias=None) -> (Tensor, Tensor, Tensor)",
    "npu_quant_mm_reduce_scatter": "(Tensor self, Tensor x2, str hcom, int world_size, *, str reduce_op=\"sum\") -> (Tensor, Tensor)",
    "npu_matmul_all_to_all": "(Tensor x1, Tensor x2, str hcom, int world_size, Tensor? bias=None) -> Tensor",
    "npu_all_to_all_matmul": "(Tensor x1, Tensor x2, str hcom, int world_size, Tensor? bias=None) -> (Tensor, Tensor)",
    "npu_quant_matmul_all_to_all": "(Tensor x1, Tensor x2, str hcom, int world_size, Tensor? bias=None) -> Tensor",
    "npu_all_to_all_quant_matmul": "(Tensor x1, Tensor x2, str hcom, int world_size, *, bool all2all_out_flag=True) -> (Tensor, Tensor)",
    "npu_alltoallv_gmm": "(Tensor gmm_x, Tensor gmm_weight, str hcom, int ep_world_size, int[] send_counts, int[] recv_counts) -> (Tensor, Tensor, Tensor)",
    "npu_gmm_alltoallv": "(Tensor gmm_x, Tensor gmm_weight, str hcom, int ep_world_size, int[] send_counts, int[] recv_counts) -> (Tensor, Tensor)",
    "npu_moe_distribute_dispatch": "(Tensor x, Tensor expert_ids, str group_ep, int ep_world_size, int ep_rank_id, int moe_expert_num, *, str group_tp=\"\") -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    "npu_moe_distribute_combine": "(Tensor expand_x, Tensor expert_ids, Tensor expand_idx, Tensor ep_send_counts, Tensor expert_scales, str group_ep, int ep_world_size, int ep_rank_id, int moe_expert_num, *, str group_tp=\"\") -> Tensor",
    "_npu_distribute_barrier": "(Tensor x_ref, str group, int world_size, *, Tensor? time_out=None) -> Tensor",
}


def _npu_comm_impl(*args, **kwargs):
    """A stand-in kernel: the first tensor, as fresh storage, once per result."""
    return args[0] * 1


def _all_gather_mm(x1, x2, hcom, world_size, bias=None):
    """npu_all_gather_quant_mm's collective on CPU: all-gather x1 over the group named `hcom` (gloo
    here), then the matmul; (output, gathered x1, amax)."""
    import torch.distributed as dist

    gathered = x1.new_empty((world_size * x1.shape[0], *x1.shape[1:]))
    dist.all_gather_into_tensor(gathered, x1.contiguous(), group=torch._C._distributed_c10d._resolve_process_group(hcom))
    return gathered @ x2, gathered, gathered.abs().amax()


def _mm_reduce_scatter(x1, x2, hcom, world_size, reduce_op="sum"):
    """npu_quant_mm_reduce_scatter's on CPU: the matmul, reduce-scattered over `hcom`; (output, amax)."""
    import torch.distributed as dist

    full = (x1 @ x2).contiguous()
    out = full.new_empty((full.shape[0] // world_size, *full.shape[1:]))
    dist.reduce_scatter_tensor(out, full, group=torch._C._distributed_c10d._resolve_process_group(hcom))
    return out, out.abs().amax()


_COMMUNICATING_KERNELS = {"npu_all_gather_quant_mm": _all_gather_mm, "npu_quant_mm_reduce_scatter": _mm_reduce_scatter}
for _name, _schema in _NPU_COMMUNICATING.items():
    _NPU.define(_name + _schema)
    _returns = _schema.rsplit("->", 1)[1].strip()
    _count = _returns.count("Tensor") if _returns.startswith("(") else 1
    _NPU.impl(_name, _COMMUNICATING_KERNELS.get(_name) or (
        lambda k: (lambda *a, **kw: tuple(_npu_comm_impl(*a) for _ in range(k)) if k > 1
                   else _npu_comm_impl(*a)))(_count if _returns.startswith("(") else 0), "CompositeExplicitAutograd")


def _npu_comm_graph(kind: str) -> fx.GraphModule:
    """A TP all-reduce, the NPU op, then another all-reduce of the group on something the NPU op
    does not read: only the collective order ties the three together."""
    op = getattr(torch.ops.npu, kind).default
    schema = op._schema
    g = fx.Graph()
    a, b, y = g.placeholder("a"), g.placeholder("b"), g.placeholder("y")
    first = g.call_function(c10d.wait_tensor.default, (g.call_function(c10d.all_reduce.default, (y, "sum", "tp")),))
    args = []
    for arg in schema.arguments:
        if arg.kwarg_only or (arg.default_value is not None and len(args) >= 2) or str(arg.type) == "Optional[Tensor]":
            break
        kind_of = str(arg.type)
        args.append(a if kind_of == "Tensor" and not args else b if kind_of == "Tensor"
                    else "hccl_tp" if kind_of == "str" else [1, 1] if kind_of.startswith("List") else 2)
    out = g.call_function(op, tuple(args))
    if len(schema.returns) > 1:
        out = g.call_function(operator.getitem, (out, 0))
    last = g.call_function(c10d.all_reduce.default, (g.call_function(aten.mul.Tensor, (y, 2)), "sum", "tp"))
    g.output((first, g.call_function(aten.mul.Tensor, (out, 1)), g.call_function(c10d.wait_tensor.default, (last,))))
    return fx.GraphModule(nn.Module(), g)


@pytest.mark.parametrize("kind", list(_NPU_COMMUNICATING))
def test_npu_ops_that_communicate_keep_their_order_with_every_groups_collectives(kind):
    """torch-npu's other fused matmul-communication ops (quantised all-gather-matmul and
    matmul-reduce-scatter, matmul with all-to-all either side, grouped matmul with all-to-allv), its
    MoE dispatch and combine and its barrier run a collective on an HCCL group named by a string
    argument (`hcom`, `group`, `group_ep`). Only three of them were synchronous collectives: the
    others were compute, in no collective order (of the 3 legal orders of the op and two all-reduces
    of one group, 2 moved it across one; a pass that did so on one rank's graph and not another's
    would pair other collectives) and missing from the ranks' agreement check. Every `npu::` op
    with such an argument is a synchronous collective of unknown group now."""
    from fxsched.ir import Opaque
    from fxsched.runtime.agreement import collective_entries

    gm = _npu_comm_graph(kind)
    program = lower(gm)
    op = program.op(f"{kind}_default")
    assert isinstance(op, Opaque) and op.reason == "synchronous collective" and op.group is None
    order = {(u, v) for u, v, e in program.graph.edges(data=True) if e.get("why") == "collective-order"}
    assert order == {("all_reduce_default", op.name), (op.name, "all_reduce_default_1")}
    assert [e["kind"].split(".")[1] for e in collective_entries(gm)] == ["all_reduce", kind, "all_reduce"]


def _npu_fsdp_build(rank, world_size):
    """FSDP over group "dp" (two parameters gathered from flat shards, a gradient-like reduce-scatter
    of the output) with, on the same group, torch-npu's all-gather-matmul and matmul-reduce-scatter
    (CPU kernels that communicate over gloo) and, between them, npu_fusion_attention dropping with
    keep_prob 0.9 beside a torch dropout: the gathers may move across the NPU collectives, the
    NPU collectives keep their order with the reduce-scatter, the draws theirs."""
    npu = torch.ops.npu
    g = fx.Graph()
    x, s0, s1, a, b = (g.placeholder(n) for n in ("x", "s0", "s1", "a", "b"))

    def gather(shard):
        wait = g.call_function(c10d.wait_tensor.default, (g.call_function(c10d.all_gather_into_tensor.default,
                                                                           (shard, 2, "dp")),))
        return g.call_function(aten.view.default, (wait, [8, 8]))

    h = g.call_function(aten.mm.default, (x, gather(s0)))
    agmm = g.call_function(npu.npu_all_gather_quant_mm.default, (a, b, "dp", 2))
    tp = g.call_function(operator.getitem, (agmm, 0))
    q = g.call_function(aten.view.default, (h, [1, 4, 8]))
    att = g.call_function(operator.getitem, (g.call_function(npu.npu_fusion_attention.default,
                                                             (q, q, q, 1, "BSH", None, None, None, 1.0, 0.9)), 0))
    drop = g.call_function(operator.getitem, (g.call_function(aten.native_dropout.default, (tp, 0.5, True)), 0))
    h2 = g.call_function(aten.add.Tensor, (g.call_function(aten.view.default, (att, [4, 8])), h))
    y = g.call_function(aten.mm.default, (h2, gather(s1)))
    rs = g.call_function(operator.getitem, (g.call_function(npu.npu_quant_mm_reduce_scatter.default,
                                                            (drop, b, "dp", 2)), 0))
    red = g.call_function(c10d.wait_tensor.default, (g.call_function(
        c10d.reduce_scatter_tensor.default, (g.call_function(aten.view.default, (y, [32])), "sum", 2, "dp")),))
    g.output((red, rs, y))
    return fx.GraphModule(nn.Module(), g)


def _npu_fsdp_feeds(rank):
    gen = torch.Generator().manual_seed(20 + rank)
    return [torch.randn(4, 8, generator=gen), torch.randn(32, generator=gen), torch.randn(32, generator=gen),
            torch.randn(4, 8, generator=gen), torch.randn(8, 8, generator=gen)]


@pytest.mark.multirank
def test_npu_collectives_and_draws_beside_fsdp_in_random_orders_and_every_pipeline_are_bitwise_on_two_ranks():
    """FSDP gathers and a reduce-scatter on group "dp" with torch-npu's all-gather-matmul and
    matmul-reduce-scatter on that group (communicating over gloo) and an npu_fusion_attention that
    drops beside a torch dropout: 20 random legal orders and every pipeline compute the traced
    graph's numbers on 2 gloo ranks and none hangs. With npu_fusion_attention read as pure (before
the fix above), 8 of the 26 runs computed other numbers; nothing more found."""
    from fxsched.runtime import run_ranks

    from test_fronts_attack4 import _check, _legal_orders, _run_orders

    program = lower(_npu_fsdp_build(0, 2))
    assert program.op("npu_fusion_attention_default").random
    orders = _legal_orders(program, most=0, shuffled=20)
    results = run_ranks(_run_orders, 2, args=(_npu_fsdp_build, ("dp",), orders, ALL_PIPELINES, _npu_fsdp_feeds, 0),
                        timeout=1200)
    _check(results, orders, ALL_PIPELINES)


# --------------------------------------------------------------------------- a random op Inductor keeps functionalized


@torch.library.custom_op("fxsched_attack7::dropout_add_", mutates_args=("x",))
def _dropout_add_(x: torch.Tensor, y: torch.Tensor, dropout_p: float) -> None:
    """A user's fused in-place dropout-add (random by its `dropout_p`: `_drops`)."""
    x.add_(y * (torch.rand_like(y) >= dropout_p) / (1 - dropout_p))


@_dropout_add_.register_fake
def _(x, y, dropout_p):
    return None


def _dropout_add_model(a, b):
    h = torch.nn.functional.dropout(torch.sin(a), 0.3, training=True)
    acc = b.clone()
    torch.ops.fxsched_attack7.dropout_add_(acc, torch.cos(a), 0.2)
    return h + acc, torch.rand_like(b)


def _compiled_dropout_add_graph() -> fx.GraphModule:
    from test_fronts_attack5 import _Capture

    capture = _Capture()
    torch._dynamo.reset()
    options = {"fallback_by_default": True, "fx_graph_cache": False, "post_grad_custom_post_pass": capture}
    torch.compile(_dropout_add_model, backend="inductor", options=options)(torch.randn(4, 8), torch.randn(4, 8))
    (gm,) = capture.graphs
    return gm


def test_a_random_custom_op_that_writes_is_random_inside_auto_functionalized():
    """Inductor hands its post-grad custom passes a custom op that writes its input still wrapped:
    `auto_functionalized_v2(fxsched_attack7.dropout_add_.default, ...)` (it reinplaces and
    decomposes it after). The op draws (its `dropout_p`), but the wrapper was read as a functional
    higher-order op: not random, free to move across Inductor's `inductor_seeds` and the
    `inductor_random`s; 22 of 30 random legal orders drew other numbers run as FX (0 after). A higher-order
    op given an op that draws (`auto_functionalized`, `_v2`, `with_effects`) is random now."""
    from test_fronts_attack2 import assert_random_legal_orders_compute_the_same
    from test_fronts_attack5 import _feeds

    gm = _compiled_dropout_add_graph()
    program = lower(gm)
    (wrapped,) = [n for n in program.schedule if n.startswith("auto_functionalized")]
    assert program.op(wrapped).random
    assert_random_legal_orders_compute_the_same(gm, _feeds(gm, 0), count=30)


def _wrapped_all_reduce_graph(version: str) -> fx.GraphModule:
    """A TP all-reduce, a user's `symm_mem.two_shot_all_reduce_(a, "sum", "tp")` as Inductor's
    post-grad graph holds it (functionalized: `auto_functionalized` / `_v2`), then another
    all-reduce of the group on something it does not read."""
    import torch.distributed._symmetric_memory  # noqa: F401  (registers symm_mem::)

    hops = torch.ops.higher_order
    op = torch.ops.symm_mem.two_shot_all_reduce_.default
    g = fx.Graph()
    a, y = g.placeholder("a"), g.placeholder("y")
    first = g.call_function(c10d.wait_tensor.default, (g.call_function(c10d.all_reduce.default, (y, "sum", "tp")),))
    if version == "v1":
        wrapped = g.call_function(hops.auto_functionalized, (op,), {"input": a, "reduce_op": "sum", "group_name": "tp"})
    else:
        wrapped = g.call_function(hops.auto_functionalized_v2, (op,), {"reduce_op": "sum", "group_name": "tp",
                                                                        "_input_base_index": 0, "_all_bases": [a]})
    out = g.call_function(operator.getitem, (wrapped, 1))
    last = g.call_function(c10d.all_reduce.default, (g.call_function(aten.mul.Tensor, (y, 2)), "sum", "tp"))
    g.output((first, g.call_function(aten.mul.Tensor, (out, 1)), g.call_function(c10d.wait_tensor.default, (last,))))
    return fx.GraphModule(nn.Module(), g)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_functionalized_symmetric_memory_all_reduce_is_a_collective_of_its_group(version):
    """`symm_mem::two_shot_all_reduce_` writes its input, so torch.compile functionalizes a user's
    call of it: Inductor's post-grad custom passes see `auto_functionalized(_v2)(op, ...)`. The
    wrapper was a functional higher-order op, compute: in no collective order (between two
    all-reduces of its group, 244 of 392 legal orders moved it across one; 0 after). A higher-order op given a
    collective to run is a synchronous collective of the `group_name` it passes now. (It needs
    CUDA: structure only; the ranks' agreement check does not list it yet.)"""
    import networkx as nx

    import fxsched
    from fxsched.ir import Opaque

    program = lower(_wrapped_all_reduce_graph(version))
    (name,) = [n for n in program.schedule if n.startswith("auto_functionalized")]
    op = program.op(name)
    assert isinstance(op, Opaque) and op.group == "tp" and op.reason == "synchronous collective"
    orders = list(nx.all_topological_sorts(program.graph))
    assert all(o.index("all_reduce_default") < o.index(name) < o.index("all_reduce_default_1") for o in orders)
    assert fxsched.schedule(_wrapped_all_reduce_graph(version), "default").graph_module is not None


def _region_with_a_collective(groups: tuple[str, ...]) -> fx.GraphModule:
    """A TP all-reduce, an `invoke_subgraph` (torch.compile's nested compile region, which post-grad
    graphs keep) whose body all-reduces its input over each of `groups`, then another all-reduce
    of "tp" on something the region does not read."""
    import torch.distributed._symmetric_memory  # noqa: F401  (registers symm_mem::)

    sub = fx.Graph()
    h = sub.placeholder("a")
    for group in groups:
        if group == "wrapped":  # a functionalized symmetric-memory all-reduce of "tp" inside
            h = sub.call_function(operator.getitem, (sub.call_function(
                torch.ops.higher_order.auto_functionalized, (torch.ops.symm_mem.two_shot_all_reduce_.default,),
                {"input": h, "reduce_op": "sum", "group_name": "tp"}), 1))
        else:
            h = sub.call_function(c10d.wait_tensor.default, (sub.call_function(c10d.all_reduce.default,
                                                                               (h, "sum", group)),))
    sub.output((h,))
    root = nn.Module()
    root.body = fx.GraphModule(nn.Module(), sub)
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    first = g.call_function(c10d.wait_tensor.default, (g.call_function(c10d.all_reduce.default, (y, "sum", "tp")),))
    region = g.call_function(torch.ops.higher_order.invoke_subgraph, (g.get_attr("body"), "body", x))
    out = g.call_function(operator.getitem, (region, 0))
    last = g.call_function(c10d.all_reduce.default, (g.call_function(aten.mul.Tensor, (y, 2)), "sum", "tp"))
    g.output((first, out, g.call_function(c10d.wait_tensor.default, (last,))))
    return fx.GraphModule(root, g)


@pytest.mark.parametrize("groups", [("tp",), ("tp", "dp"), ("wrapped",)])
def test_a_region_whose_subgraph_all_reduces_keeps_its_place_among_its_groups_collectives(groups):
    """A higher-order op whose subgraph all-reduces (`invoke_subgraph` of a nested compile region)
    was compute, in no collective order: between two all-reduces of its group 232 of 392 legal
    orders moved the region across one (found here at the same time as tests/test_fronts_attack6.py
    found a send inside one hanging; its fix, a barrier, `collective inside`, keeps this order too:
    pinned here for the collective order). A region whose subgraph runs a functionalized collective
    (`auto_functionalized(symm_mem.two_shot_all_reduce_, ...)`) was still compute (the same 232 of
    392); it is such a barrier too."""
    import networkx as nx

    import fxsched

    program = lower(_region_with_a_collective(groups))
    assert program.op("invoke_subgraph").reason == "collective inside"
    orders = list(nx.all_topological_sorts(program.graph))
    assert all(o.index("all_reduce_default") < o.index("invoke_subgraph") < o.index("all_reduce_default_1")
               for o in orders)
    assert fxsched.schedule(_region_with_a_collective(groups), "default").graph_module is not None


# --------------------------------------------------------------------------- ops called by their packet


def test_random_and_communicating_ops_called_by_their_packet_are_read_as_their_one_overload():
    """Dynamo's graphs call an op as the user wrote it: `torch.ops.npu.npu_fusion_attention(...)`,
    flash-attn's `torch.ops.flash_attn._flash_attn_forward(...)` (its `_wrapped_flash_attn_forward`),
    no `.default`. Called so, the random ones were pure (no tag read: of the legal orders of
    `_npu_random_graph` with packets, 62 of 105 drew other numbers with npu_fusion_attention, 104 of
    205 with npu_fused_attention_score_fwd; 0 after) and the communicating ones compute, in no
    collective order and missing from the agreement check. A packet whose one overload is
    `default` is read as that overload for both now, as the functional collectives' were."""
    from fxsched.ir import Opaque
    from fxsched.runtime.agreement import collective_entries

    for kind in ("npu_fusion_attention", "npu_fused_attention_score_fwd"):
        gm = _npu_random_graph(kind)
        for node in gm.graph.nodes:
            if isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "npu":
                node.target = node.target.overloadpacket
        gm.recompile()
        assert lower(gm).op(f"{kind}_default").random
        assert_every_legal_order_computes_the_same(gm, _npu_random_inputs())
    g = fx.Graph()
    q, k, v = (g.placeholder(n) for n in "qkv")
    g.output((g.call_function(torch.ops.flash_attn._flash_attn_forward, (q, k, v, 0.1, 1.0, False, -1, -1, 0.0, None,
                                                                          False)),))
    assert lower(fx.GraphModule(nn.Module(), g)).op("_flash_attn_forward").random
    gm = _npu_comm_graph("npu_all_gather_quant_mm")
    node = next(n for n in gm.graph.nodes if n.target is torch.ops.npu.npu_all_gather_quant_mm.default)
    node.target = torch.ops.npu.npu_all_gather_quant_mm
    gm.recompile()
    op = lower(gm).op(node.name)
    assert isinstance(op, Opaque) and op.reason == "synchronous collective"
    assert [e["kind"].split(".")[1] for e in collective_entries(gm)] == ["all_reduce", "npu_all_gather_quant_mm", "all_reduce"]


# --------------------------------------------------------------------------- dynamic shapes


def _fresh_world(group_name: str):
    """A new group of all ranks registered as `group_name` (the graphs' collectives' group), whose
    collectives give up after HANG_SECONDS; returns a function that puts the original back."""
    from datetime import timedelta

    import torch.distributed as dist

    registry = torch._C._distributed_c10d
    original = registry._resolve_process_group(group_name)
    pg = dist.new_group(list(range(dist.get_world_size())), timeout=timedelta(seconds=HANG_SECONDS))
    registry._unregister_process_group(group_name)
    registry._register_process_group(group_name, pg)

    def restore():
        registry._unregister_process_group(group_name)
        registry._register_process_group(group_name, original)

    return restore


def _guarded(group_name, run):
    """`run()` on a fresh short-timeout group: its tensors, or "hang: ..." when a collective gave up."""
    import torch.distributed as dist

    dist.barrier()
    restore = _fresh_world(group_name)
    try:
        out = run()
        return [t.detach().clone() for t in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(t, torch.Tensor)]
    except RuntimeError as exc:
        return "hang: " + str(exc).splitlines()[0][:100]
    finally:
        restore()


def _symbolic_feeds(gm: fx.GraphModule, seed: int) -> list:
    """Inputs for a dynamic graph: each SymInt placeholder its size hint, each tensor shaped by the
    hints of its extents (floats random, ints small)."""
    gen = torch.Generator().manual_seed(seed)

    def hint(s):
        return s if isinstance(s, int) else s.node.hint

    out = []
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta["val"]
        if isinstance(val, torch.SymInt):
            out.append(hint(val))
        elif isinstance(val, torch.Tensor):
            shape = [hint(s) for s in val.shape]
            out.append(torch.randn(shape, generator=gen, dtype=val.dtype) if val.dtype.is_floating_point
                       else torch.randint(0, 3, shape, generator=gen, dtype=val.dtype))
        else:
            out.append(val)
    return out


def _dynamic_worker(rank, world_size, pipelines, orders, symbolic_parameters=False):
    """On one rank: SimpleFSDP-style layers (test_compile's ShardedLinear: a gather, a checkpointed
    re-gather, a reduce-scatter of the gradient) compiled with dynamic=True, each rank tracing with
    its own batch size as the hint, then run at a second size: plainly, and with fxsched's pass
    running each of `pipelines`; and the plain compile's post-grad graphs (SymInt sizes, sym_size
    nodes) as traced and in `orders` seeded random legal orders, at this rank's sizes."""
    import torch.distributed as dist

    from fxsched.integrations.inductor import FxschedInductorPass
    from fxsched.ir import Launch, Wait
    from fxsched.ir.program import Schedule
    from fxsched.raising import raise_program

    from test_compile import LITE, ShardedLinear
    from test_fronts_attack import _random_orders
    from test_fronts_attack5 import _Capture

    torch.set_num_threads(1)
    # dynamo sizes parameters statically unless told otherwise: then the shards, their gathers and
    # the gradients' reduce-scatters have symbolic extents too
    torch._dynamo.config.force_parameter_static_shapes = not symbolic_parameters
    group = dist.group.WORLD.group_name
    weights = [torch.randn(16, 16, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    sizes = (4, 6) if rank == 0 else (6, 4)

    def steps(post_grad):
        torch._dynamo.reset()
        model = nn.Sequential(*[ShardedLinear(w, world_size, rank) for w in weights])
        run = torch.compile(model, backend="inductor", options={**LITE, "post_grad_custom_post_pass": post_grad},
                            dynamic=True)
        out = []
        for size in sizes:
            x = torch.randn(size, 16, generator=torch.Generator().manual_seed(100 * size + rank))

            def step():
                loss = run(x).square().sum()
                loss.backward()
                return [loss] + [p.grad for p in model.parameters()]

            out.append(_guarded(group, step))
            model.zero_grad()
        return out

    capture = _Capture()
    result = {"steps": {"traced": steps(capture)}, "records": {}, "graphs": [], "orders": []}
    for pipeline in pipelines:
        fx_pass = FxschedInductorPass(pipeline, on_error="raise")
        result["steps"][pipeline] = steps(fx_pass)
        result["records"][pipeline] = [(r["phase"], r["gathers"], r["moved"]) for r in fx_pass.runs]
    result["symbolic"] = [any(isinstance(n.meta.get("val"), torch.SymInt) for n in gm.graph.find_nodes(op="placeholder"))
                          for gm in capture.graphs]
    for index, gm in enumerate(capture.graphs):
        inputs = _symbolic_feeds(gm, 1000 * index + rank)
        program = lower(gm)
        runs = [_guarded(group, lambda: gm(*[t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]))]
        for order in _random_orders(program, orders, 0):
            result["orders"].append([n for n in order if isinstance(program.op(n), (Launch, Wait))])
            program.schedule = Schedule(order)
            raised = raise_program(program)
            runs.append(_guarded(group, lambda: raised(*[t.clone() if isinstance(t, torch.Tensor) else t for t in inputs])))
        result["graphs"].append(runs)
    return result


def _check_dynamic(results, pipelines, orders):
    bad = {}
    for rank, r in enumerate(results):
        traced = r["steps"]["traced"]
        assert not any(isinstance(s, str) for s in traced), f"rank {rank}: the plain compile failed: {traced}"
        for pipeline in pipelines:
            for size, (want, got) in enumerate(zip(traced, r["steps"][pipeline], strict=True)):
                if isinstance(got, str) or not all(torch.equal(a, b) for a, b in zip(want, got, strict=True)):
                    bad.setdefault(f"pipeline {pipeline} size #{size}", f"rank {rank}: {got if isinstance(got, str) else 'differs'}")
        for index, runs in enumerate(r["graphs"]):
            assert not isinstance(runs[0], str), f"rank {rank}: graph {index} as traced failed: {runs[0]}"
            for k, got in enumerate(runs[1:]):
                if isinstance(got, str) or len(got) != len(runs[0]) or not all(map(torch.equal, runs[0], got)):
                    bad.setdefault(f"graph {index} order {k}", f"rank {rank}: {got if isinstance(got, str) else 'differs'}")
    assert not bad, f"{len(bad)} runs hung or differ: {bad}"
    assert results[0]["symbolic"] == [True, True], "the graphs are not dynamic"
    assert results[0]["orders"] == results[1]["orders"], "the ranks' orders run their collectives otherwise"
    assert all(len(runs) == orders + 1 for runs in results[0]["graphs"])
    assert not torch.equal(results[0]["steps"]["traced"][0][0], results[1]["steps"]["traced"][0][0])


@pytest.mark.multirank
@pytest.mark.parametrize("symbolic_parameters", [False, True])
def test_dynamic_shape_graphs_under_every_pipeline_and_in_random_orders_are_bitwise_on_two_ranks(symbolic_parameters):
    """torch.compile(dynamic=True) of SimpleFSDP-style layers, each rank tracing with its own batch
    size as the hint (4 and 6), then run at the other: every pipeline as fxsched's Inductor pass
    computes the plain compile's loss and gradients bitwise at both sizes on both ranks, and 8
    random legal orders of each post-grad graph (SymInt placeholders, `sym_size` nodes) compute
    them as traced, the same collective order on both ranks, no hang. With the parameters' sizes
    symbolic too (`force_parameter_static_shapes=False`: the gathers and reduce-scatters have
    symbolic extents, no size to weigh) no pipeline moved anything (docs/bad-input.md, Known gaps);
    with them static every pipeline moved a gather. Nothing found: this pins it."""
    from fxsched.runtime import run_ranks

    pipelines = ("default", "default,bucket", "unorder-reduce-scatters,gradients-first,default") \
        if symbolic_parameters else ALL_PIPELINES
    results = run_ranks(_dynamic_worker, 2, args=(pipelines, 8, symbolic_parameters), timeout=1200)
    _check_dynamic(results, pipelines, 8)
    moved = {p: sum(m for _, _, m in runs) for p, runs in results[0]["records"].items()}
    assert all(m == 0 for m in moved.values()) if symbolic_parameters else all(moved.values()), moved


def _symbolic_fsdp_step(x, s0, s1, t0):
    """SimpleFSDP-style: gather each flat shard over "dp", a small MLP on x (its batch extent
    symbolic), gradients by autograd, each reduce-scattered over "dp"; an in-place running sum of
    the loss into a buffer (`t0`) between them."""
    def gather(shard):
        return c10d.wait_tensor.default(c10d.all_gather_into_tensor.default(shard, 2, "dp")).view(8, 8)

    w0, w1 = gather(s0).detach().requires_grad_(), gather(s1).detach().requires_grad_()
    with torch.enable_grad():
        h = torch.relu(x @ w0)
        loss = (h @ w1).square().sum() / x.shape[0]
        g0, g1 = torch.autograd.grad(loss, [w0, w1])
    t0.add_(loss.detach())
    r0 = c10d.wait_tensor.default(c10d.reduce_scatter_tensor.default(g0.flatten(), "sum", 2, "dp"))
    r1 = c10d.wait_tensor.default(c10d.reduce_scatter_tensor.default(g1.flatten(), "sum", 2, "dp"))
    return loss.detach(), r0, r1, t0 * 1


def _step_feeds(rank):
    gen = torch.Generator().manual_seed(10 + rank)
    return [torch.randn(3 + 2 * rank, 8, generator=gen), torch.randn(32, generator=gen), torch.randn(32, generator=gen),
            torch.zeros(())]


def _symbolic_build(rank, world_size):
    from torch.fx.experimental.proxy_tensor import make_fx

    import torch.distributed._functional_collectives  # noqa: F401  (the collectives' autograd)

    return make_fx(_symbolic_fsdp_step, tracing_mode="symbolic")(*_step_feeds(rank))


def test_a_symbolic_make_fx_step_has_symbolic_sizes_and_recognised_gathers():
    """make_fx(tracing_mode="symbolic") of a SimpleFSDP-style step: `sym_size` nodes feed the
    loss's scale; both gathers are FSDP gathers, both reductions reduce-scatters."""
    import fxsched

    gm = _symbolic_build(0, 2)
    assert any(n.target is torch.ops.aten.sym_size.int for n in gm.graph.nodes)
    result = fxsched.schedule(_symbolic_build(0, 2), "default")
    assert sum(1 for n in result.graph_module.graph.nodes if n.target is c10d.all_gather_into_tensor.default) == 2


@pytest.mark.multirank
def test_a_symbolic_make_fx_step_in_random_orders_and_every_pipeline_is_bitwise_on_two_ranks():
    """The symbolic step traced on each rank with its own batch size (3 and 5: the same graph, other
    hints), 20 random legal orders and every pipeline, on 2 gloo ranks at those sizes: bitwise, no
    hang (nothing found: this pins it)."""
    from fxsched.runtime import run_ranks

    from test_fronts_attack4 import _check, _legal_orders, _run_orders

    orders = _legal_orders(lower(_symbolic_build(0, 2)), most=0, shuffled=20)
    results = run_ranks(_run_orders, 2, args=(_symbolic_build, ("dp",), orders, ALL_PIPELINES, _step_feeds),
                        timeout=1200)
    _check(results, orders, ALL_PIPELINES)
