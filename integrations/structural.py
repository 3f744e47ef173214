"""Structural recognition of FSDP gathers and gradient reductions in untagged graphs (re-exported from
`fxsched.lowering.structural`, where the FX-level tagging stage lives)."""

from ..lowering.structural import (STRUCTURAL_TAG, StructuralGather, StructuralReduction, StructuralResult,
                                   find_fsdp_gathers, find_gradient_reductions, tag_fsdp_collectives,
                                   tag_fsdp_gathers, untag_fsdp_gathers)

__all__ = ["STRUCTURAL_TAG", "StructuralGather", "StructuralReduction", "StructuralResult", "find_fsdp_gathers",
           "find_gradient_reductions", "tag_fsdp_collectives", "tag_fsdp_gathers", "untag_fsdp_gathers"]
