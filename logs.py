"""Logging helpers. fxsched logs under `fxsched.*` and is quiet by default (a NullHandler on
`fxsched`, no level set); an application turns it on with `logging` as usual, or with `log_to`.

    with fxsched.logs.log_to(sys.stderr, logging.INFO):
        fxsched.overlap_param_gather(gm, config)   # prints the summary line
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import IO

ROOT = "fxsched"
FORMAT = "%(name)s: %(message)s"

__all__ = ["FORMAT", "ROOT", "get_logger", "log_to"]


def get_logger(name: str) -> logging.Logger:
    """The logger `fxsched.<name>` (a name already under `fxsched` is used as is)."""
    return logging.getLogger(name if name == ROOT or name.startswith(ROOT + ".") else f"{ROOT}.{name}")


@contextlib.contextmanager
def log_to(stream: IO[str] | None = None, level: int = logging.INFO, fmt: str = FORMAT) -> Iterator[logging.Handler]:
    """While open, records of `fxsched.*` at `level` and above go to `stream` (stderr by default).

    The `fxsched` logger's level and handlers are restored on exit, so it nests and repeats
    (e.g. `cli.main` called many times in one process).
    """
    logger = logging.getLogger(ROOT)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(logging.Formatter(fmt))
    handler.setLevel(level)
    old_level = logger.level
    logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > level:
        logger.setLevel(level)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
