"""Attributes a package imports on first use (PEP 562), so that importing the package (and the schema,
`moe_rl.config`, which reads its config module) loads no torch.

    _LAZY = {"build_model": "moe_rl.models.build"}
    __getattr__ = lazy_attributes(__name__, _LAZY)
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_attributes(package: str, modules: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: name -> the attribute of that name of `modules[name]`, imported
    on first use and then set on the package (a plain attribute from then on); AttributeError otherwise."""

    def __getattr__(name: str) -> Any:
        if name not in modules:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(modules[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
