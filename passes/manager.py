"""Pipelines as text, parsed against the pass registry, and the pass manager that runs them.

`"anchor{forward-depth=2},budget{max-in-flight-gb=1.5},prefetch,sink"` → passes; printing a
pipeline gives its canonical text, and a pipeline that runs a pass before one it must follow
(`ModulePass.after`) is an error. The manager verifies after each pass, keeps analyses only
across passes that changed nothing or preserve them (`check_analyses=True` recomputes each
kept one and fails on a difference), and instruments (timing, IR printing) hook in before
and after every pass.
"""

from __future__ import annotations

import os
import re
import sys
import time
from typing import IO

import attrs

from ..ir import Program, print_program, verify, verify_moves
from ..ir.errors import InputError, InternalError
from .pipelines import PIPELINES
from .base import PASSES, ModulePass, PassContext, PassResult, _format
from .memory_cap import MemoryAnalysis, MemoryCap, check_peak
from .plugins import load_entry_points


class PipelineError(InputError):
    """A pipeline text names an unknown pass or option, gives a bad value, or orders passes
    against their declarations."""


class StaleAnalysis(InternalError):
    """An analysis kept across a pass differs from one computed afresh after it."""


class PeakCapExceeded(InternalError):
    """A pass left the simulated peak memory over the cap in force (`memory-cap`)."""


class PassFailure(InternalError):
    """A pass raised or left an invalid program; names it and the passes that ran before.

    `remaining` is the pipeline from the failed pass on; when the manager keeps reproducers,
    `ir_before` is the program's text before it (else None): together they rerun the failure
    (`fxsched.passes.reproducer_text`)."""

    def __init__(self, failed: ModulePass, before: list[ModulePass], cause: BaseException, where: str,
                 ir_before: str | None = None, remaining: list[ModulePass] | None = None):
        self.failed, self.before, self.cause = failed, before, cause
        self.ir_before, self.remaining = ir_before, list(remaining or [failed])
        ran = ",".join(str(p) for p in before) or "(none)"
        super().__init__(f"pass '{failed}' {where}: {type(cause).__name__}: {cause}\n  passes before it: {ran}")


_ITEM = re.compile(r"\s*([A-Za-z][\w-]*)\s*(?:\{([^{}]*)\})?\s*(,|$)")


def parse_pipeline(text: str) -> list[ModulePass]:
    """Parse pipeline text; a name in PIPELINES (`reference`, `default`) stands for its passes,
    alone or as an item (`reference,overlap-reduce-scatter`)."""
    passes = []
    at = 0
    text = PIPELINES.get(text.strip(), text.strip())
    while at < len(text):
        m = _ITEM.match(text, at)
        if not m:
            raise PipelineError(f"cannot parse pipeline at column {at + 1}: {text[at:]!r} "
                                "(expected name or name{opt=value,...})")
        if m.group(1) in PIPELINES and m.group(2) is None:  # a named pipeline as an item: `reference,my-pass`
            passes.extend(parse_pipeline(PIPELINES[m.group(1)]))
        else:
            passes.append(make_pass(m.group(1), m.group(2)))
        at = m.end()
        if m.group(3) == "," and at >= len(text):
            raise PipelineError("pipeline ends with a comma")
    check_order(passes)
    return passes


def check_order(passes: list[ModulePass]) -> None:
    """Each pass's last run must follow the last run of every pass it declares in `after`."""
    last = {p.name: i for i, p in enumerate(passes)}
    for i, p in enumerate(passes):
        if last[p.name] != i:
            continue
        for name in p.after:
            if last.get(name, -1) > i:
                raise PipelineError(
                    f"pass {name!r} runs after {p.name!r} (at {last[name] + 1} of {len(passes)}), but "
                    f"{p.name!r} must follow it: {p.name!r} works on what {name!r} decides; "
                    f"put {p.name!r} after {name!r}")


def make_pass(name: str, options: str | None = None) -> ModulePass:
    cls = PASSES.get(name)
    if cls is None and load_entry_points():  # an installed package's pass (fxsched.passes entry points)
        cls = PASSES.get(name)
    if cls is None:
        raise PipelineError(f"unknown pass {name!r}; passes: {', '.join(sorted(PASSES))}")
    fields = cls.options()
    kwargs = {}
    for item in filter(None, (s.strip() for s in (options or "").split(","))):
        key, sep, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        if key not in fields:
            known = ", ".join(f"{k} (default {_format(f.default)})" for k, f in fields.items()) or "none"
            raise PipelineError(f"pass {name!r} has no option {key!r}; options: {known}")
        if fields[key].name in kwargs:
            raise PipelineError(f"pass {name!r}: option {key!r} is given twice")
        kwargs[fields[key].name] = _convert(name, key, cls.option_type(key), raw if sep else "true")
    try:
        return cls(**kwargs)
    except ValueError as exc:
        raise PipelineError(str(exc)) from exc


def _convert(pass_name: str, key: str, kind: type, raw: str):
    article = "an" if kind.__name__[0] in "aeiou" else "a"
    try:
        if kind is bool:
            if raw not in ("true", "false"):
                raise ValueError
            return raw == "true"
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
        return raw
    except ValueError:
        raise PipelineError(f"pass {pass_name!r}: option {key!r} wants {article} {kind.__name__}, got {raw!r}") from None


def print_pipeline(passes: list[ModulePass]) -> str:
    return ",".join(str(p) for p in passes)


# ---- instrumentation -----------------------------------------------------------------

class Instrument:
    """Hooks around each pass; override what you need."""

    def before(self, p: ModulePass, program: Program) -> None: ...

    def after(self, p: ModulePass, program: Program, result: PassResult) -> None: ...


class Timing(Instrument):
    def __init__(self):
        self.seconds: list[tuple[str, float]] = []
        self._start = 0.0

    def before(self, p, program):
        self._start = time.perf_counter()

    def after(self, p, program, result):
        self.seconds.append((str(p), time.perf_counter() - self._start))

    def report(self) -> str:
        total = sum(s for _, s in self.seconds) or 1e-12
        rows = [f"  {s:9.4f} s  {100 * s / total:5.1f}%  {name}" for name, s in self.seconds]
        return "pass timing:\n" + "\n".join(rows) + f"\n  {total:9.4f} s  total\n"


class PrintIR(Instrument):
    """Print the IR before and/or after each pass; `only_changed` skips passes that changed nothing."""

    def __init__(self, before: bool = False, after: bool = True, only_changed: bool = False,
                 stream: IO[str] | None = None):
        self.print_before, self.print_after, self.only_changed = before, after, only_changed
        self.stream = stream

    def before(self, p, program):
        if self.print_before:
            print(f"// ----- IR before {p} -----\n{print_program(program)}", file=self.stream or sys.stderr)

    def after(self, p, program, result):
        if self.print_after and (result.changed or not self.only_changed):
            print(f"// ----- IR after {p} -----\n{print_program(program)}", file=self.stream or sys.stderr)


@attrs.define
class PipelineResult:
    results: list[tuple[ModulePass, PassResult]]

    @property
    def changed(self) -> bool:
        return any(r.changed for _, r in self.results)

    def stats(self) -> dict[str, dict]:
        """Statistics per pass, keyed by the pass's canonical text (repeated passes get #2, #3)."""
        out: dict[str, dict] = {}
        for p, r in self.results:
            key = str(p)
            n = 2
            while key in out:
                key = f"{p}#{n}"
                n += 1
            out[key] = dict(r.stats, changed=r.changed)
        return out


def _size(program: Program) -> tuple[int, int]:
    return program.size()


def _assign(program: Program, other: Program) -> None:
    """Make `program` hold `other`'s state (the caller's object stays the one it scheduled)."""
    program.graph, program.schedule, program.notes = other.graph, other.schedule, other.notes
    program.payload, program.origin = other.payload, other.origin


def _first_difference(kept, fresh) -> str:
    """Which field of two analyses differs, for the message."""
    if attrs.has(type(kept)) and type(kept) is type(fresh):
        for f in attrs.fields(type(kept)):
            a, b = getattr(kept, f.name), getattr(fresh, f.name)
            if a != b:
                if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
                    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                    show = lambda v: repr(v[at]) if at < len(v) else "(none)"  # noqa: E731
                    return f"{f.name}[{at}]: kept {show(a)}, fresh {show(b)}"
                return f"{f.name}: kept {a!r}, fresh {b!r}"
    return f"kept {kept!r}, fresh {fresh!r}"


def _check_analyses_default() -> bool:
    """FXSCHED_CHECK_ANALYSES=1 turns `check_analyses` on (the test suite does: tests/conftest.py)."""
    return os.environ.get("FXSCHED_CHECK_ANALYSES", "") not in ("", "0")


class PassManager:
    def __init__(self, pipeline: str | list[ModulePass], *, verify_each: bool = True,
                 instruments: list[Instrument] | None = None, reproducer: bool = False,
                 check_analyses: bool | None = None, verify_input: bool = True):
        self.passes = parse_pipeline(pipeline) if isinstance(pipeline, str) else list(pipeline)
        if not isinstance(pipeline, str):
            check_order(self.passes)
        self.verify_each = verify_each
        # with verify_each, verify the program before the first pass too; only a caller that
        # knows it valid by construction turns this off (api.py: what lowering just returned,
        # whose edges derive_effects made: a run of passes that only moved nodes on it is then
        # checked at its end against the edges alone, see `_run_from`)
        self.verify_input = verify_input
        # keep the program's text before each pass, so a PassFailure can carry it (costs a print per pass)
        self.reproducer = reproducer
        self.instruments = list(instruments or [])
        # recompute every analysis kept across a pass and fail on a difference (slow; tests)
        self.check_analyses = _check_analyses_default() if check_analyses is None else check_analyses

    def __str__(self) -> str:
        return print_pipeline(self.passes)

    def run(self, program: Program, ctx: PassContext | None = None) -> PipelineResult:
        ctx = ctx or PassContext()
        ctx.begin(program)
        if self.verify_each and self.verify_input:  # an invalid input is the input's fault: say so before a pass trips on it
            verify(program)
        return PipelineResult(self._run_from(0, program, ctx, [], {}))

    def _run_from(self, start: int, program: Program, ctx: PassContext, moves_only: list[int],
                  texts: dict[int, str]) -> list[tuple[ModulePass, PassResult]]:
        """Run the passes from `start` on; `moves_only`: the passes since the last full check,
        checked at the moved nodes only; `texts`: with `reproducer`, the text before each of them."""
        results = []

        def failure(i: int, exc: BaseException, where: str, failed: int | None = None) -> PassFailure:
            last = i if failed is None else failed
            return PassFailure(self.passes[last], self.passes[:last], exc, where, ir_before=texts.get(i),
                               remaining=self.passes[i:])

        counted = None  # the program's size as the last pass left it, when it was counted
        deferred = None  # (the last pass, what it moved): its moves checked by the final check
        check_size = lambda p: self.verify_each and p.reorders_only  # noqa: E731
        for i in range(start, len(self.passes)):
            p = self.passes[i]
            if self.reproducer:
                if not moves_only:
                    texts.clear()
                texts[i] = print_program(program)
            for inst in self.instruments:
                inst.before(p, program)
            # node and edge counts (a walk of every adjacency dict): only a pass that says it only
            # reorders is held to them, and the counts after one pass are those before the next
            # (instruments only look at the program)
            size = (counted if counted is not None else _size(program)) if check_size(p) else None
            counted = None
            schedule = program.schedule
            schedule.take_moved()
            try:
                result = p.apply(ctx, program)
            except InputError:
                raise  # the input's fault (a cost model's bad value, ...): it names the place
            except Exception as exc:
                raise failure(i, exc, "failed") from exc
            if result.changed:  # a pass that changed nothing keeps every analysis true
                ctx.keep_only(p.preserves)
            if self.verify_each:
                try:
                    if size is not None:
                        counted = _size(program)
                    same_size = size is not None and size == counted
                    if p.reorders_only and same_size and program.schedule is schedule:
                        # it only moved nodes on the verified order: the rules at what it moved
                        # are the only ones it can have broken
                        moved = schedule.take_moved()
                        if i + 1 == len(self.passes) and self._defers_last_check(ctx):
                            deferred = (i, moved)  # the final check below walks every edge
                        else:
                            verify_moves(program, moved)
                        moves_only.append(i)
                    else:  # it says, or its node/edge counts or a new schedule show, it did more
                        verify(program, structure=not (p.reorders_only and same_size))
                        moves_only = []
                except ValueError as exc:
                    raise failure(i, exc, "left an invalid program") from exc
            if result.changed and ctx.peak_cap is not None:  # every pass honours the joint cap: check it did
                over = check_peak(ctx, program)
                if over is not None:
                    raise failure(i, PeakCapExceeded(over), "raised the peak memory over the cap")
            if self.check_analyses:  # on the verified program: every kept analysis as if fresh
                try:
                    self._check_analyses(ctx, program)
                except StaleAnalysis as exc:
                    raise failure(i, exc, "kept a stale analysis") from exc
            for inst in self.instruments:
                inst.after(p, program, result)
            if isinstance(p, MemoryCap) and p.try_unchecked and i + 1 < len(self.passes):
                return results + self._final_peak_first(i, result, program, ctx, moves_only, texts)
            results.append((p, result))
        if moves_only:  # the whole order once more, against every rule
            # Every pass since the input moved nodes only, each checked at what it moved: on an
            # input valid by construction (verify_input off: lowering's, whose edges
            # derive_effects made, one for every free and phase rule) the edges carry every
            # rule, and the walk of the order against them is the independent check; the frees
            # and phases against the ops again (two thirds of it at 100k nodes) re-check what
            # lowering derived. With a verified input, or after a pass that changed the graph,
            # the whole check.
            derived = not self.verify_input and moves_only[0] == 0
            try:
                verify(program, structure=False, rules=not derived)
            except ValueError as exc:
                if deferred is not None:  # blame the last pass as its own check would have
                    try:
                        verify_moves(program, deferred[1])
                    except ValueError as moves:
                        raise failure(deferred[0], moves, "left an invalid program") from moves
                last = moves_only[-1]
                names = ",".join(str(self.passes[j]) for j in moves_only)
                # rerun from the first of them: the IR before it is the last one known valid
                raise failure(moves_only[0], exc, f"(or one of {names}) left an invalid program", last) from exc
        return results

    def _defers_last_check(self, ctx: PassContext) -> bool:
        """Whether the last pass's check at what it moved may wait for the final check of the
        run, which walks every edge (so every edge at what it moved): then a broken order is
        found once, not twice, and on a failure `verify_moves` runs then to blame the last pass
        as before (at 100k nodes the check after sink or overlap-reduce-scatter was 45-60 ms).
        Not where anything reads the program between the two: instruments, the joint peak
        cap's check, `check_analyses`."""
        return not self.instruments and ctx.peak_cap is None and not self.check_analyses

    def _final_peak_first(self, i: int, result: PassResult, program: Program, ctx: PassContext,
                          moves_only: list[int], texts: dict[int, str]) -> list[tuple[ModulePass, PassResult]]:
        """The passes after `memory-cap` (pass i): first with their moves unchecked, kept when the
        final peak is within the cap; else again from where memory-cap left the program, with
        every move checked (`passes/memory_cap.py`, "Final peak first")."""
        cap = ctx.peak_cap
        before, planned = program.copy(), ctx.planned
        ctx.peak_cap = attrs.evolve(cap, checks_moves=False)
        rest = self._run_from(i + 1, program, ctx, list(moves_only), dict(texts))
        unchecked = ctx.get(MemoryAnalysis, program).profile.peak_bytes
        if ctx.peak_cap is not None and not ctx.peak_cap.checks_moves:  # (else a later memory-cap's is in force)
            ctx.peak_cap = cap
        kept = lambda how: [(self.passes[i], PassResult(result.changed, dict(  # noqa: E731
            result.stats, unchecked_peak_bytes=unchecked, kept=how)))]
        if unchecked <= cap.limit_bytes:
            return kept("unchecked") + rest
        tried = Program(program.graph, program.schedule, program.notes, program.payload, program.origin)
        tried_state = ctx.planned, ctx.peak_cap
        _assign(program, before)
        ctx.keep_only(())
        ctx.planned, ctx.peak_cap = planned, cap
        checked = self._run_from(i + 1, program, ctx, moves_only, texts)
        if ctx.get(MemoryAnalysis, program).profile.peak_bytes > unchecked:
            # both over the cap (an input already over it): the lower peak is the nearer
            _assign(program, tried)
            ctx.keep_only(())
            ctx.planned, ctx.peak_cap = tried_state
            return kept("unchecked") + rest
        return kept("checked") + checked

    @staticmethod
    def _check_analyses(ctx: PassContext, program: Program) -> None:
        for kind, kept in ctx.cached().items():
            fresh = kind.compute(program, ctx)
            if fresh != kept:
                raise StaleAnalysis(f"{kind.__name__} kept across it differs from a fresh one: "
                                    f"{_first_difference(kept, fresh)}")
