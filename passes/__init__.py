"""Passes over the IR (never touching FX), their registry and the pass manager."""

from . import anchor, bucket, budget, fill_waits, gradients_first, hide, memory_cap, order_gathers, overlap_reduce_scatter, prefetch, sink, unorder_reduce_scatters, unshard  # noqa: F401  (register the passes)
from .base import PASSES, Analysis, ModulePass, PassContext, PassResult, option, register_pass
from .gathers import Gather, GatherAnalysis
from .manager import (Instrument, PassFailure, PassManager, PipelineError, PipelineResult, PrintIR,
                      Timing, make_pass, parse_pipeline, print_pipeline)

from .pipelines import DEFAULT_PIPELINE, PIPELINES, REFERENCE_PIPELINE
from .reproducer import reproducer_text

__all__ = [
    "DEFAULT_PIPELINE", "PASSES", "PIPELINES", "REFERENCE_PIPELINE", "Analysis", "Gather", "GatherAnalysis", "Instrument",
    "ModulePass", "PassContext", "PassFailure", "PassManager", "PassResult", "PipelineError",
    "PipelineResult", "PrintIR", "Timing", "make_pass", "parse_pipeline", "print_pipeline",
    "option", "register_pass", "reproducer_text",
]
