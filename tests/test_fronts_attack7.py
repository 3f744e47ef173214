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
before torch-npu tagged it in 2026, its _v2 and _v3, npu_fused_attention_score); NPU ops that run a
collective inside on an HCCL group named by a string (fused matmul + all-gather / reduce-scatter /
all-to-all, MoE dispatch and combine, a barrier) beside functional collectives. Each test that
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


for _name, _schema in _NPU_COMMUNICATING.items():
    _NPU.define(_name + _schema)
    _returns = _schema.rsplit("->", 1)[1].strip()
    _count = _returns.count("Tensor") if _returns.startswith("(") else 1
    _NPU.impl(_name, (lambda k: (lambda *a, **kw: tuple(_npu_comm_impl(*a) for _ in range(k)) if k > 1
                                 else _npu_comm_impl(*a)))(_count if _returns.startswith("(") else 0),
              "CompositeExplicitAutograd")


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
