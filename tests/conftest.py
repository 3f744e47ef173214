"""Shared test setup: the fxsched under test is this checkout, whatever its folder is called;
spawned ranks fill freed memory with a byte pattern; IR test files (tests/filecheck/**/*.fxir)
are collected and run like lit runs them."""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# ---- the checkout is the package: test it, whatever its folder's name ---------------------
#
# The repository root is the package `fxsched` (pyproject's package-dir), so a checkout is
# importable as `fxsched` only through a folder of that name. Left alone, pytest makes the root
# (it has an `__init__.py`) a Package and imports that file as a module named after the folder
# — `/work/wt-x` is no identifier, so as a top-level `__init__` with the root put first on
# sys.path, where fxsched's own `config`, `api` or `runtime` shadow any module of that name —
# and `import fxsched` finds whichever fxsched is installed (another checkout's, for an
# editable install), not this one.

ROOT = Path(__file__).resolve().parent.parent


def _put_this_checkout_first() -> None:
    """Make `import fxsched` (here, in spawned ranks and in subprocesses such as RUN lines) load
    this checkout: if it finds another, a `fxsched` link to the root goes in a temporary folder
    put first on sys.path and PYTHONPATH. The root itself leaves sys.path (`python -m pytest`
    run there puts it first): nothing imports fxsched's modules as top-level ones."""
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]
    spec = importlib.util.find_spec("fxsched")
    if spec is not None and spec.origin and Path(spec.origin).resolve() == ROOT / "__init__.py":
        return
    assert "fxsched" not in sys.modules, "fxsched was imported before tests/conftest.py"
    folder = tempfile.mkdtemp(prefix="fxsched-checkout-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    os.symlink(ROOT, os.path.join(folder, "fxsched"))
    sys.path.insert(0, folder)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (folder, os.environ.get("PYTHONPATH")) if p)
    importlib.invalidate_caches()


_put_this_checkout_first()


class _RootIsNotATestPackage:
    """Collect the repository root as a plain folder, not a Package (see above)."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_collect_directory(self, path, parent):
        if path.resolve() == ROOT:
            return pytest.Dir.from_parent(parent, path=path)
        return None


def pytest_configure(config):
    # a plugin object, not a conftest hook: conftest hooks only see paths below tests/
    config.pluginmanager.register(_RootIsNotATestPackage(), "fxsched-root-is-not-a-package")


def pytest_report_header(config):
    import fxsched

    return f"fxsched under test: {os.path.dirname(fxsched.__file__)}"


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
# and every lowered program is verified before the first pass, as is any other input (api.py:
# outside the tests, lowering's output is valid by construction and that check is skipped)
os.environ.setdefault("FXSCHED_VERIFY_LOWERED", "1")
