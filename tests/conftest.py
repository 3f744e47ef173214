"""Shared test setup: spawned ranks fill freed memory with a byte pattern; IR test files
(tests/filecheck/**/*.fxir) are collected and run like lit runs them."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _perturb_freed_memory_in_ranks(request, monkeypatch):
    # glibc fills freed (and fresh) chunks with this byte in processes started with it set, so
    # a rank that reads freed memory gets wrong values, not by luck the right ones (the suite
    # compares bitwise). Ranks are spawned: they take the variable from os.environ.
    if request.node.get_closest_marker("multirank"):
        monkeypatch.setenv("MALLOC_PERTURB_", "165")


# ---- IR test files: tests/filecheck/**/*.fxir, run as lit runs them ----------------------

def pytest_collect_file(file_path, parent):
    if file_path.suffix == ".fxir":
        return FxirFile.from_parent(parent, path=file_path)
    return None


class FxirFile(pytest.File):
    def collect(self):
        yield FxirItem.from_parent(self, name=self.path.name)


class FxirItem(pytest.Item):
    def runtest(self):
        from filecheck_runner import run_file

        run_file(str(self.path))

    def repr_failure(self, excinfo):
        from filecheck_runner import RunFailure

        if isinstance(excinfo.value, RunFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, 0, f"fxir: {self.name}"


# every PassManager in the tests recomputes each analysis it keeps across a pass and fails on
# a difference (passes/manager.py): a kept analysis must never change a result
os.environ.setdefault("FXSCHED_CHECK_ANALYSES", "1")
