"""fxsched: schedule the collectives of FSDP training graphs in torch.fx.

FX joint graph → lowering → IR (dataflow + effects, a schedule) → passes → raising → FX.

The names below are loaded on first use (module `__getattr__`), so `import fxsched.ir`,
`import fxsched.passes` and `fxsched opt` never import torch: only what touches FX does.
"""

import importlib
import logging

logging.getLogger("fxsched").addHandler(logging.NullHandler())

__version__ = "0.1.0"

# name -> the submodule that defines it
_LAZY = {
    "ScheduleResult": "api", "gather_table": "api", "overlap_param_gather": "api",
    "reference_pipeline": "api", "schedule": "api",
    "PassConfig": "config", "explain_text": "report",
    "DEFAULT_PIPELINE": "passes.pipelines", "PIPELINES": "passes.pipelines", "REFERENCE_PIPELINE": "passes.pipelines",
}

# `fxsched.lowering.lower(gm)` after a bare `import fxsched` works as it did when this file
# imported everything
_SUBMODULES = {"api", "cli", "config", "cost", "front", "integrations", "ir", "logs", "lowering", "models",
               "passes", "raising", "report", "runtime"}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fxsched' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # once: later reads do not come here
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | _SUBMODULES)
