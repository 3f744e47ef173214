"""FX GraphModule → IR Program (all tag reading lives here)."""

from .fx import LoweringError, lower, target_name

__all__ = ["LoweringError", "lower", "target_name"]
