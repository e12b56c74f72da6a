"""Exports loaded on first use (PEP 562), so that importing a light submodule — e.g. for a
command's ``--help`` — does not import torch."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_exports(package: str, where: dict[str, str]) -> Callable[[str], object]:
    """A module-level ``__getattr__`` for ``package`` that imports ``where[name]`` (a module path) on
    first access of ``name``, caches the value in the package and returns it."""

    def __getattr__(name: str) -> object:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
