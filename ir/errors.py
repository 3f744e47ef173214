"""The error family: every error fxsched raises on purpose is an `FxschedError`.

Two kinds, told apart by who has to act:

- `InputError` — what the user gave is wrong: IR text (`ParseError`), a program that breaks
  an IR rule before any pass ran (`VerifyError`, `EffectError`), a pipeline text
  (`PipelineError`), FX tags (`LoweringError`), a configuration or option value
  (`ConfigError`), a cost model's answer (`CostModelError`), a program raising cannot turn
  back into FX (`RaisingError`: parsed from text, or lowered from another module), a chunk
  `fxsched opt` was given (`SourceError`). The message names the place (line and column,
  node, field, pass and option). The CLI prints one `fxsched: …` line for these and exits 2
  (`fxsched opt` prints a `FILE:LINE:COLUMN: error: …` diagnostic instead, as mlir-opt does).
- `InternalError` — fxsched broke its own promise: a pass raised or left an invalid program
  (`PassFailure`), a kept analysis differs from a fresh one. A bug to report; exit 1.

The input kinds stay `ValueError`s, as callers caught them before the family existed. The
classes live next to the code that raises them (ir/text.py, ir/verify.py, passes/manager.py,
lowering/fx.py, raising/fx.py, opt.py) and derive from these roots; this module imports
nothing, so every stage can use it.
"""

from __future__ import annotations


class FxschedError(Exception):
    """Root of every error fxsched raises on purpose."""


class InputError(FxschedError, ValueError):
    """The user's input is wrong; the message says where."""


class InternalError(FxschedError, RuntimeError):
    """fxsched broke its own promise (a pass, an analysis): a bug, not the input's fault."""


class ConfigError(InputError):
    """A configuration field or option value is out of range or of the wrong type."""


class CostModelError(InputError):
    """A cost model gave an unusable value; names the cost model and the op."""
