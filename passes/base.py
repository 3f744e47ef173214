"""What every pass is: a frozen dataclass with a kebab-case `name`, options as fields, `apply`.

Passes are stateless between runs; what they share lives in the program and in analyses,
which a PassContext computes once and keeps until a pass that does not preserve them ran.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from typing import Any, ClassVar

import attrs

from ..ir import Program, Schedule
from ..ir.errors import ConfigError

PASSES: dict[str, type[ModulePass]] = {}


def register_pass(cls: type[ModulePass]) -> type[ModulePass]:
    if cls.name in PASSES:
        raise ValueError(f"pass {cls.name!r} is registered twice")
    PASSES[cls.name] = cls
    return cls


@attrs.define
class PassResult:
    """Whether the pass changed the program, and its statistics (counts, reasons)."""

    changed: bool
    stats: dict[str, Any] = attrs.field(factory=dict)


class Analysis:
    """Base for analyses: `compute(program, ctx)` builds one from the program as it is now."""

    @classmethod
    def compute(cls, program: Program, ctx: PassContext) -> Analysis:
        raise NotImplementedError


class PassContext:
    """Caches analyses of one program between passes; `options` holds what analyses need
    from outside the program (e.g. a cost model), the same for every pass of a run.

    `entry` is the schedule the program had when the pipeline started (the pass manager sets
    it; otherwise the first `get` does): analyses that promise an order of gathers give the
    order their launches had there — the order the reference collects them in — so that a
    pass moving launches leaves it true, and a fresh computation agrees with a kept one.

    `planned` is the order an anchoring pass planned the gathers' launches in, when it is not
    the entry order: `hide` sets it (the order the gathers are needed in, which a second run
    over the pipeline's own output sees the same); `sink` stacks realizations in it.
    `peak_cap` is the peak-memory cap in force (a `memory_cap.PeakCap`, set by the `memory-cap`
    pass; None: none), which every pass that raises memory honours.
    `placed` is what `budget` planned, for a `prefetch` right after it to take (`budget.Planned`).
    """

    def __init__(self, **options: Any):
        self._cache: dict[type[Analysis], Analysis] = {}
        self.options = options
        self.entry: Schedule | None = None
        self.planned: tuple[str, ...] | None = None
        self.peak_cap = None
        self.placed = None

    def begin(self, program: Program) -> None:
        """A pipeline starts on `program`: forget analyses of anything else, record its order."""
        self._cache.clear()
        self.entry = program.schedule.copy()
        self.planned = None
        self.peak_cap = None
        self.placed = None

    def get(self, kind: type[Analysis], program: Program):
        if self.entry is None:
            self.entry = program.schedule.copy()
        if kind not in self._cache:
            self._cache[kind] = kind.compute(program, self)
        return self._cache[kind]

    def cached(self) -> dict[type[Analysis], Analysis]:
        return dict(self._cache)

    def keep_only(self, preserved: tuple[type[Analysis], ...]) -> None:
        self._cache = {k: v for k, v in self._cache.items() if k in preserved}


@dataclasses.dataclass(frozen=True)
class ModulePass:
    name: ClassVar[str] = ""
    #: analyses still valid after this pass ran, whatever it changed
    preserves: ClassVar[tuple[type[Analysis], ...]] = ()
    #: the pass only reorders the schedule and updates op attributes (no ops or edges added,
    #: removed or rewired), so the manager re-verifies only the schedule after it
    reorders_only: ClassVar[bool] = False
    #: passes that, when the pipeline has them, must run before this one: the last run of
    #: this pass must follow the last run of each (a PipelineError names both otherwise)
    after: ClassVar[tuple[str, ...]] = ()

    def apply(self, ctx: PassContext, program: Program) -> PassResult:
        raise NotImplementedError

    # ---- options ------------------------------------------------------------------
    @classmethod
    def options(cls) -> dict[str, dataclasses.Field]:
        """Option fields by their kebab-case text name."""
        return {f.name.replace("_", "-"): f for f in dataclasses.fields(cls)}

    @classmethod
    def option_type(cls, text_name: str) -> type:
        """The option's type, from its annotation (bool, int, float or str; for an annotation
        that is not a class, such as `int | None`, the type of the default)."""
        field = cls.options()[text_name]
        hint = _annotations(cls).get(field.name)
        return hint if isinstance(hint, type) else type(field.default)

    @classmethod
    def option_help(cls, text_name: str) -> str:
        return cls.options()[text_name].metadata.get("help", "")

    def __str__(self) -> str:
        """The canonical text: options that differ from their defaults, in declaration order."""
        parts = []
        for text_name, f in self.options().items():
            value = getattr(self, f.name)
            if value != f.default:
                parts.append(f"{text_name}={_format(value)}")
        return self.name + ("{" + ",".join(parts) + "}" if parts else "")


def option(default: Any, help: str) -> Any:
    """An option field with its help, which `fxsched passes` prints:

        max_in_flight_gb: float = option(1.0, "unsharded GiB allowed in flight")
    """
    return dataclasses.field(default=default, metadata={"help": help})


@functools.cache
def _annotations(cls: type) -> dict[str, type]:
    return typing.get_type_hints(cls)


def _format(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def check_depth(owner: str, field: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{owner}: {field} must be a non-negative integer, got {value!r}")


def check_budget(owner: str, field: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{owner}: {field} must be a finite non-negative number of GiB, got {value!r}")
    # passes count bytes: value * 2**30 must be a finite float (1e300 GiB is not)
    if value > MAX_GB:
        raise ConfigError(f"{owner}: {field} must be at most {MAX_GB:g} GiB, got {value!r}")



def check_ms(owner: str, field: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{owner}: {field} must be a finite non-negative number of ms, got {value!r}")

#: the largest budget: 2**63 bytes, beyond any memory and within a float's exact-enough range
MAX_GB = float(2**33)
