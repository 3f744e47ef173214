"""SimpleFSDP-style models and the graphs torch.compile gives Inductor's post-grad pass for them.

`simple_fsdp(module, world_size, rank)` makes every parameter of `module` rank `rank`'s flat
dim-0 shard (zero padded) and registers a parametrization that gathers it for each use, as
torchtitan's SimpleFSDP does: `shard.to(param_dtype)` → functional all-gather → `[:numel]` →
`view(shape)`, under selective activation checkpointing that recomputes the gather and its
wait (so the backward re-gathers). Its backward is the gradient reduce-scatter, then the cast
back to the shard's dtype (fp32 for a bf16 `param_dtype`).

`post_grad_graphs(module, inputs, loss_fn)` compiles one training step with Inductor in
fallback mode (ATen kernels, no C++) on whatever process group is initialised (the "fake"
backend is enough: the values are not looked at) and returns copies of the forward and
backward graphs exactly as Inductor's `post_grad_custom_post_pass` sees them, node meta
included.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import fx, nn
from torch.nn.utils import parametrize
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

_C = torch.ops._c10d_functional

__all__ = ["post_grad_graphs", "simple_fsdp"]


def _recompute_gathers(ctx, func, *args, **kwargs):
    if func in (_C.all_gather_into_tensor.default, _C.wait_tensor.default):
        return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.PREFER_SAVE


def _unshard(shard: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype | None, group: str) -> torch.Tensor:
    piece = shard if dtype is None else shard.to(dtype)
    full = funcol.all_gather_tensor(piece, 0, group)
    return full[: math.prod(shape)].view(shape)


class _Gather(nn.Module):
    def __init__(self, shape, dtype, group):
        super().__init__()
        self.shape, self.dtype, self.group = tuple(shape), dtype, group

    def forward(self, shard):
        return checkpoint(_unshard, shard, self.shape, self.dtype, self.group, use_reentrant=False,
                          context_fn=functools.partial(create_selective_checkpoint_contexts, _recompute_gathers))


def simple_fsdp(module: nn.Module, world_size: int, rank: int, *, param_dtype: torch.dtype | None = None,
                group: str | None = None) -> nn.Module:
    """Shard every parameter of `module` in place (SimpleFSDP-style); returns `module`."""
    group = group if group is not None else dist.group.WORLD.group_name
    for owner in list(module.modules()):
        for name, param in list(owner.named_parameters(recurse=False)):
            flat = param.detach().reshape(-1)
            per = -(-flat.numel() // world_size)
            padded = torch.cat([flat, flat.new_zeros(per * world_size - flat.numel())])
            shape = param.shape
            delattr(owner, name)
            owner.register_parameter(name, nn.Parameter(padded[rank * per:(rank + 1) * per].clone()))
            parametrize.register_parametrization(owner, name, _Gather(shape, param_dtype, group), unsafe=True)
    return module


def _copy(gm_or_graph) -> fx.GraphModule:
    graph = gm_or_graph.graph if isinstance(gm_or_graph, fx.GraphModule) else gm_or_graph
    new = fx.Graph()
    out = new.graph_copy(graph, {})
    new.output(out)
    return fx.GraphModule(torch.nn.Module(), new)


def post_grad_graphs(module: nn.Module, inputs, loss_fn) -> dict[str, fx.GraphModule]:
    """{"forward": ..., "backward": ...}: the graphs Inductor's post-grad custom pass gets for one step."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    captured: list[fx.GraphModule] = []

    class Capture(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            captured.append(_copy(graph))

        def uuid(self):
            return None

    torch._dynamo.reset()
    options = {"fallback_by_default": True, "fx_graph_cache": False, "post_grad_custom_post_pass": Capture()}
    compiled = torch.compile(module, backend="inductor", options=options)
    loss_fn(compiled(*inputs), *inputs).backward()
    torch._dynamo.reset()
    if len(captured) != 2:
        raise RuntimeError(f"expected a forward and a backward graph, got {len(captured)} (graph breaks?)")
    return {"forward": captured[0], "backward": captured[1]}
