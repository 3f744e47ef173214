"""PassConfig: the reference pass's configuration, validated as docs/design.md says."""

from __future__ import annotations

import attrs

from .ir.errors import ConfigError
from .passes.base import check_budget, check_depth


@attrs.define
class PassConfig:
    fsdp_allgather_prefetch: bool = True
    max_in_flight_gb: float = 1.0
    fsdp_forward_prefetch_depth: int = 1
    fsdp_backward_prefetch_depth: int = 1


def read_config(config) -> tuple[bool, float, int, int]:
    """Read and validate any object with PassConfig's attributes (the depths are optional)."""
    missing = [a for a in ("fsdp_allgather_prefetch", "max_in_flight_gb") if not hasattr(config, a)]
    if missing:
        raise ConfigError(f"config {type(config).__name__} lacks {', '.join(missing)}")
    enabled = config.fsdp_allgather_prefetch
    if not isinstance(enabled, bool):
        raise ConfigError(f"fsdp_allgather_prefetch must be a bool, got {enabled!r}")
    forward = getattr(config, "fsdp_forward_prefetch_depth", 1)
    backward = getattr(config, "fsdp_backward_prefetch_depth", 1)
    check_depth("config", "fsdp_forward_prefetch_depth", forward)
    check_depth("config", "fsdp_backward_prefetch_depth", backward)
    check_budget("config", "max_in_flight_gb", config.max_in_flight_gb)
    return enabled, float(config.max_in_flight_gb), forward, backward
