"""IR Program → fresh FX GraphModule."""

from .fx import RaisingError, raise_in_place, raise_program, reorders_only

__all__ = ["RaisingError", "raise_in_place", "raise_program", "reorders_only"]
