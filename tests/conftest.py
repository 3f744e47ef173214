"""Shared test setup: spawned ranks fill freed memory with a byte pattern."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _perturb_freed_memory_in_ranks(request, monkeypatch):
    # glibc fills freed (and fresh) chunks with this byte in processes started with it set, so
    # a rank that reads freed memory gets wrong values, not by luck the right ones (the suite
    # compares bitwise). Ranks are spawned: they take the variable from os.environ.
    if request.node.get_closest_marker("multirank"):
        monkeypatch.setenv("MALLOC_PERTURB_", "165")
