"""fxsched: schedule the collectives of FSDP training graphs in torch.fx.

FX joint graph → lowering → IR (dataflow + effects, a schedule) → passes → raising → FX.
"""

import logging

from .api import ScheduleResult, gather_table, overlap_param_gather, reference_pipeline, schedule
from .config import PassConfig
from .passes import DEFAULT_PIPELINE, PIPELINES, REFERENCE_PIPELINE

logging.getLogger("fxsched").addHandler(logging.NullHandler())

__all__ = ["DEFAULT_PIPELINE", "PIPELINES", "REFERENCE_PIPELINE", "PassConfig", "ScheduleResult", "gather_table", "overlap_param_gather",
           "reference_pipeline", "schedule"]
__version__ = "0.1.0"
