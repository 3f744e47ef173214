"""IR Program → fresh FX GraphModule."""

from .fx import RaisingError, raise_in_place, raise_program

__all__ = ["RaisingError", "raise_in_place", "raise_program"]
