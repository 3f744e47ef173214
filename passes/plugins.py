"""Passes from outside fxsched: a user's module, or an installed package's entry point.

A plugin is a module that defines passes with `@register_pass` (see docs/adding-a-pass.md).
`fxsched --load-pass-plugin MODULE` imports one by name (the current directory is on the
path) or by `.py` path; installed packages declare theirs in the entry-point group
`fxsched.passes`, which is loaded the first time a pipeline names a pass fxsched does not know:

    [project.entry-points."fxsched.passes"]
    mypasses = "mypkg.passes"
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType

GROUP = "fxsched.passes"
_entry_points_loaded = False


def load_module(spec: str) -> ModuleType:
    """Import the plugin `spec`: a dotted module name or a path to a .py file."""
    if spec.endswith(".py") or os.sep in spec:
        path = os.path.abspath(spec)
        name = "fxsched_plugin_" + os.path.splitext(os.path.basename(path))[0]
        if name in sys.modules and getattr(sys.modules[name], "__file__", None) == path:
            return sys.modules[name]
        found = importlib.util.spec_from_file_location(name, path)
        if found is None:
            raise ImportError(f"no such file: {spec}")
        module = importlib.util.module_from_spec(found)
        sys.modules[name] = module
        sys.path.insert(0, os.path.dirname(path))  # so it can import its siblings
        found.loader.exec_module(module)
        return module
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return importlib.import_module(spec)


def load_entry_points() -> list[str]:
    """Import every module of the `fxsched.passes` entry-point group, once; their names."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return []
    _entry_points_loaded = True
    from importlib.metadata import entry_points

    loaded = []
    for point in entry_points(group=GROUP):
        point.load()
        loaded.append(point.value)
    return loaded
