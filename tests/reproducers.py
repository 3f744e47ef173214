"""Fuzzer failures as IR test files: with FXSCHED_REPRODUCERS=DIR (scripts/fuzz.py sets it),
a failing property-test case writes DIR/NAME.fxir, a file `fxsched opt` and lit can run.

A pass that failed gives `PassFailure.ir_before` and the rest of the pipeline, so the RUN line
fails the same way; a check of the property test that failed (a schedule the pass manager
accepted) gives the program before the pipeline and the pipeline, with the failed check in a
comment: the RUN line reruns it, and CHECK lines for the expected schedule make it a test.
Hypothesis calls the test again with each smaller case it tries and last with the smallest,
so the file left is the smallest failing case.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

from fxsched.passes import PassFailure, reproducer_text


@contextlib.contextmanager
def reproducer_on_failure(name: str, program_text: Callable[[], str], pipeline: str) -> Iterator[None]:
    """Around one case: on an exception, write the reproducer (if FXSCHED_REPRODUCERS is set) and re-raise."""
    try:
        yield
    except Exception as exc:
        folder = os.environ.get("FXSCHED_REPRODUCERS")
        if folder:
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"{name}.fxir"), "w") as f:
                f.write(_text(exc, program_text, pipeline))
        raise


def _text(exc: BaseException, program_text: Callable[[], str], pipeline: str) -> str:
    failure = exc if isinstance(exc, PassFailure) else exc.__cause__
    if isinstance(failure, PassFailure) and failure.ir_before is not None:
        return reproducer_text(failure)
    message = "\n".join(f"//   {line}" for line in f"{type(exc).__name__}: {exc}".splitlines()[:20])
    return (f"// fxsched fuzzer case: the program before the pipeline. The passes ran; a check of the\n"
            f"// property test failed:\n{message}\n"
            f"// RUN: fxsched opt %s -p '{pipeline}'\n\n{program_text()}")
