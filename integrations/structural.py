"""Structural recognition of FSDP gathers in untagged graphs (re-exported from `fxsched.lowering.structural`,
where the FX-level tagging stage lives)."""

from ..lowering.structural import (STRUCTURAL_TAG, StructuralGather, StructuralResult, find_fsdp_gathers,
                                   tag_fsdp_gathers, untag_fsdp_gathers)

__all__ = ["STRUCTURAL_TAG", "StructuralGather", "StructuralResult", "find_fsdp_gathers", "tag_fsdp_gathers",
           "untag_fsdp_gathers"]
