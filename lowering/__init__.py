"""FX GraphModule → IR Program (all tag reading lives here)."""

from .fx import LoweringError, lower, lower_in_order, target_name

__all__ = ["LoweringError", "lower", "lower_in_order", "target_name"]
