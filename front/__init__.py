"""Fronts that produce tagged FSDP joint graphs for fxsched."""

from .fsdp import (
    DEFAULT_GROUP_NAME,
    Bucket,
    FrontResult,
    fsdp_free_storage,
    fsdp_joint_graph,
    shard_tensor,
    unshard_tensor,
)

__all__ = [
    "DEFAULT_GROUP_NAME",
    "Bucket",
    "FrontResult",
    "fsdp_free_storage",
    "fsdp_joint_graph",
    "shard_tensor",
    "unshard_tensor",
]
