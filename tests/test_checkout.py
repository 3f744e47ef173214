"""The suite tests the checkout it sits in, whatever that folder is called (tests/conftest.py):
the repository root is the package, so a checkout named `wt-x` or `fxsched-2` is not
importable as `fxsched` by itself, and pytest would make the root a test package."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = '''
import sys
from pathlib import Path

import fxsched


def test_probe():
    here = Path(__file__).resolve().parent.parent
    assert Path(fxsched.__file__).resolve() == here / "__init__.py", fxsched.__file__
    assert "__init__" not in sys.modules and here.name not in sys.modules  # the root is no test package
    assert all(Path(p or ".").resolve() != here for p in sys.path)  # nor a folder of top-level modules
'''


def test_a_checkout_in_a_folder_that_is_no_identifier_tests_itself(tmp_path):
    copy = tmp_path / "any-name.with-dash"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", "__pycache__", ".hypothesis", ".venv",
                                                              ".pytest_cache", "fuzz-reproducers"))
    (copy / "tests" / "test_probe_checkout.py").write_text(PROBE)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "tests/test_probe_checkout.py"], cwd=copy, capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT.parent)))  # another fxsched first
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "1 passed" in result.stdout
