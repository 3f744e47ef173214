"""torchtitan's graph trainer on CPU: llama3 under SimpleFSDP, traced into one joint graph as
graph_trainer traces it, then rematerialised as its default pass list does before FSDP scheduling.

Used by the schedule benchmark (`bench_clients.py`) and by tests/test_torchtitan.py. What it
takes to run on a CPU (each point checked by running it): the device mesh is built here
(`init_device_mesh("cpu", ...)`; torchtitan's `ParallelDims` would pick "cuda"); attention is
SDPA (FlexAttention has no backward on CPU); the memory policy is "full" (the default one marks
CPU SDPA for recompute and rematerialisation then refuses it).

    model, step_inputs = build_llama3(mesh, layers=2)
    traced = trace_step(model, step_inputs)        # graph_trainer's TracedResult
    rematerialise(traced)                          # its cleanup, memory policy and remat passes
    outputs = run_step(traced, model, step_inputs) # [loss, grad of each parameter shard]
    graphs = compile_step(model, step_inputs)      # what Inductor's post-grad pass sees under torch.compile

`compile_step` compiles the same step with torch.compile instead (Inductor in fallback mode, no
C++): AOTAutograd partitions it and Inductor's post-grad pass gets a forward and a backward graph,
as graph_trainer's "jit" mode does (its `auto_bucketing` pass runs Inductor's
`schedule_overlap_bucketing` on exactly these). There are no backward re-gathers there: graph_trainer's
SimpleFSDP leaves resharding to its joint-graph passes, so the partitioner saves each gathered
parameter for the backward.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

VOCAB = 2048


def build_llama3(mesh, *, layers: int = 2, flavor: str = "debugmodel", param_dtype=torch.bfloat16,
                 reduce_dtype=torch.float32, batch: int = 2, seq: int = 64, seed: int = 0,
                 overrides: dict[str, Any] | None = None):
    """(model under SimpleFSDP fully_shard on `mesh`, the step's inputs) with `layers` transformer blocks.

    `overrides` replaces fields of the model config (e.g. `dim`) for shapes the registry lacks.
    """
    from torchtitan.experiments.graph_trainer.llama3 import model_registry
    from torchtitan.experiments.graph_trainer.llama3.parallelize import annotate_llama
    from torchtitan.experiments.graph_trainer.simple_fsdp import MixedPrecisionPolicy, data_parallel

    config = model_registry(flavor, attn_backend="sdpa").model
    config.layers = config.layers[:layers] if layers <= len(config.layers) else (
        config.layers + [config.layers[-1]] * (layers - len(config.layers)))
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    with torch.device("meta"):
        model = config.build()
    annotate_llama(model)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    model = data_parallel(model, device_mesh=mesh, mode="fully_shard", mp_policy=policy)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_states(buffer_device=None)
    model.train()
    vocab = getattr(config, "vocab_size", VOCAB)
    generator = torch.Generator().manual_seed(seed + 1 + mesh.get_local_rank())
    tokens = torch.randint(0, vocab, (batch, seq), generator=generator)
    labels = torch.randint(0, vocab, (batch, seq), generator=generator)
    positions = torch.arange(seq, dtype=torch.int32).unsqueeze(0).expand(batch, seq)
    valid = torch.tensor(batch * seq, dtype=torch.float)
    return model, (tokens, labels, valid, {"positions": positions})


def _loss():
    from torchtitan.components.loss import CrossEntropyLoss

    return CrossEntropyLoss(CrossEntropyLoss.Config())


def trace_step(model, step_inputs):
    """graph_trainer's joint forward + loss + backward trace of one step (a `TracedResult`)."""
    from torchtitan.experiments.graph_trainer.make_fx_tracer import minimal_fx_tracer
    from torchtitan.experiments.graph_trainer.trainer import make_fwd_bwd_step

    return minimal_fx_tracer(make_fwd_bwd_step(model, _loss()), module=model)(*step_inputs)


def rematerialise(traced, memory_policy: str = "full"):
    """graph_trainer's default passes up to its FSDP scheduling pass: cleanup, the memory policy's
    SAC tags, activation rematerialisation (which adds the backward re-gathers). In place."""
    from torchtitan.experiments.graph_trainer.memory_policy import tag_with_memory_policy_pass
    from torchtitan.experiments.graph_trainer.remove_noop_passes import (canonicalize_graph_pass,
                                                                          eliminate_dead_code_pass)
    from torchtitan.experiments.graph_trainer.selective_activation_remat import selective_activation_remat_pass

    config = SimpleNamespace(compile=SimpleNamespace(memory_policy=memory_policy),
                             parallelism=SimpleNamespace(fsdp_reshard_after_forward="default",
                                                         pipeline_parallel_degree=1))
    gm = traced.gm
    for fn in (eliminate_dead_code_pass, canonicalize_graph_pass):
        gm = fn(gm, traced.example_inputs)
    gm = tag_with_memory_policy_pass(gm, traced.example_inputs, config=config)
    traced.gm = selective_activation_remat_pass(gm, traced.example_inputs)
    return traced


def joint_bucketing(traced, layers: int, *, reorder: bool = True):
    """graph_trainer's own FSDP scheduling pass on `traced.gm` (in place): per-block bucketing and
    reordering of gathers and reduce-scatters, as `construct_default_graph_passes` configures it.

    `reorder=False` buckets only (its scheduler's bucketing step, without the reordering step that
    prefetches each block's bucket under the block before): torchtitan's buckets, each where the
    bucketer puts it, for a scheduler of one's own to order."""
    from torchtitan.experiments.graph_trainer.common_utils import (_MODULE_FQN, _is_backward_node,
                                                                   get_default_transformer_block_buckets)
    from torchtitan.experiments.graph_trainer.fsdp_passes import (JointManualOverlapScheduler,
                                                                  get_fsdp_param_module_order,
                                                                  joint_transformer_block_bucketing_reordering_pass)

    plans = get_default_transformer_block_buckets(layers, chunked_loss_enabled=False, moe_layer_ids=frozenset(),
                                                  split_moe_expert_buckets=False)
    order = get_fsdp_param_module_order(traced.state_fqns)
    if reorder:
        traced.gm = joint_transformer_block_bucketing_reordering_pass(
            traced.gm, traced.example_inputs, module_bucket_plans=plans, fsdp_param_module_order=order)
        return traced

    def stack(node):  # as joint_transformer_block_bucketing_reordering_pass gives it
        fqn = node.meta.get("custom", {}).get(_MODULE_FQN)
        return [(fqn, torch.nn.Module)] if fqn else []

    scheduler = JointManualOverlapScheduler(traced.gm, plans, False, is_backward_fn=_is_backward_node,
                                            module_stack_fn=stack, fsdp_param_module_order=order)
    scheduler._manual_bucket_collectives()
    traced.gm.recompile()
    return traced


def run_step(traced, model, step_inputs) -> list[torch.Tensor]:
    """Run the traced step on the live model: [loss, grad of each parameter's local shard]."""
    from torch.distributed.tensor import DTensor
    from torchtitan.experiments.graph_trainer.make_fx_tracer import run_traced

    outputs = run_traced(traced, module=model)(*step_inputs)
    return [o.to_local().detach().clone() if isinstance(o, DTensor) else o.detach().clone() for o in outputs]


def compile_step(model, step_inputs) -> dict:
    """{"forward": GraphModule, "backward": GraphModule}: the graphs Inductor's post-grad custom pass
    gets when torch.compile compiles `model`'s forward and the loss's backward (one step runs, on
    whatever process group is initialised; the fake one is enough)."""
    from simple_fsdp import post_grad_graphs

    tokens, labels, valid, extra = step_inputs
    loss_fn = _loss()

    class Step(torch.nn.Module):  # the model's forward with its keyword inputs bound
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x, **extra)

    def loss(pred, _tokens):  # as graph_trainer's step computes it (a loss, or (loss, extras))
        out = loss_fn(pred, labels, global_valid_tokens=valid)
        return out[0] if isinstance(out, tuple) else out

    return post_grad_graphs(Step(model), (tokens,), loss)
