"""IR Program → FX: a fresh GraphModule, or the lowered one relinked in place (fx.py); and
`lint`, torch's Graph.lint at C speed where the graph passes (lint.py)."""

from .fx import RaisingError, raise_in_place, raise_program, reorders_only, unordered_launches

__all__ = ["RaisingError", "raise_in_place", "raise_program", "reorders_only", "unordered_launches"]
