"""Passes over the IR (never touching FX), their registry and the pass manager."""

from . import anchor, budget, hide, overlap_reduce_scatter, prefetch, sink  # noqa: F401  (register the passes)
from .base import PASSES, Analysis, ModulePass, PassContext, PassResult, register_pass
from .gathers import Gather, GatherAnalysis
from .manager import (Instrument, PassFailure, PassManager, PipelineError, PipelineResult, PrintIR,
                      Timing, make_pass, parse_pipeline, print_pipeline)

REFERENCE_PIPELINE = "anchor,budget,prefetch,sink"

__all__ = [
    "PASSES", "REFERENCE_PIPELINE", "Analysis", "Gather", "GatherAnalysis", "Instrument",
    "ModulePass", "PassContext", "PassFailure", "PassManager", "PassResult", "PipelineError",
    "PipelineResult", "PrintIR", "Timing", "make_pass", "parse_pipeline", "print_pipeline",
    "register_pass",
]
