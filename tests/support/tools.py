"""Importing a tool of `tools/` (scripts, not a package) in a test."""

import functools
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


@functools.cache
def load(name):
    """The module `tools/<name>.py`, imported once."""
    spec = importlib.util.spec_from_file_location(
        name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
