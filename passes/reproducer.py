"""Crash reproducers: a failed pipeline run as a ready `.fxir` test file.

The file holds the IR as it was before the failed pass and a RUN line that runs the rest of
the pipeline on it with `fxsched opt`, so `lit FILE` (or pytest on it) fails the same way
until the pass is fixed; then its CHECK lines can be written and it becomes a test.
"""

from __future__ import annotations

from .manager import PassFailure, print_pipeline


def reproducer_text(failure: PassFailure, rerun: str | None = None) -> str:
    """The reproducer of `failure` (its manager must have kept reproducers: `ir_before` set).

    `rerun` is the `fxsched opt` arguments after `%s` (default: `-p 'REMAINING PIPELINE'`)."""
    if failure.ir_before is None:
        raise ValueError("this failure carries no IR: run the PassManager with reproducer=True")
    rerun = rerun or f"-p '{print_pipeline(failure.remaining)}'"
    message = "\n".join(f"// {line}" if line else "//" for line in str(failure).splitlines())
    return (f"// fxsched reproducer: the IR before the pass that failed, and the pipeline from it on.\n"
            f"{message}\n"
            f"// RUN: fxsched opt %s {rerun}\n\n"
            f"{failure.ir_before}")
