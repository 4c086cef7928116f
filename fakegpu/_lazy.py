"""Package attributes imported on first use (PEP 562), so that importing a package stays cheap
(fakegpu.fake must not import torch, fakegpu.report must not import jsonschema, until used)."""
from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], list[str]]:
    """``__getattr__`` and ``__all__`` for ``package``: name -> module that defines it. A name is
    imported once, then cached in the package's namespace."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__, sorted(exports)
