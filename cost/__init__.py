"""Cost model, schedule simulator and timelines over the IR (imports ir/ only).

    from fxsched.cost import op_costs, simulate, chrome_trace, compare_table, H100
    sim = simulate(program, "h100")            # or Roofline(H200), {target: ms}, op -> ms
    sim.step_ms, sim.exposed_ms, sim.peak_bytes, sim.lower_bound_ms
"""

from .hardware import ASCEND_910B, H100, H200, PROFILES, Hardware, hardware
from .model import (Callback, CostAnalysis, CostModel, Measured, Roofline, as_cost_model, attention_flops,
                    bytes_moved, collective_bytes, collective_kind, flops, matmul_flops, op_costs)
from .simulate import COMPUTE, Event, Simulation, simulate, stream_of
from .timeline import before_after, chrome_trace, compare_table, format_bytes, write_chrome_trace

__all__ = [
    "ASCEND_910B", "COMPUTE", "H100", "H200", "PROFILES", "Callback", "CostAnalysis", "CostModel", "Event",
    "Hardware", "Measured", "Roofline", "Simulation", "as_cost_model", "attention_flops", "before_after",
    "bytes_moved", "chrome_trace", "collective_bytes", "collective_kind", "compare_table", "flops",
    "format_bytes", "hardware", "matmul_flops", "op_costs", "simulate", "stream_of", "write_chrome_trace",
]
