"""Run code right after a module is first imported, without importing it.

Some of torch's modules are costly to import (torch._dynamo about a second) and most
programs never import them; fakegpu adjusts them only if the program does.  ``after_import``
runs the callback at once when the module is already imported, else right after the module's
own code has run, from a finder at the front of ``sys.meta_path`` that wraps the real loader.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from typing import Callable

_lock = threading.RLock()
_waiting: dict[str, list[Callable]] = {}   # module name -> callbacks still to run
_finder = None


def after_import(name: str, callback: Callable, ready: Callable = lambda module: True) -> None:
    """``callback(module)`` once module ``name`` is imported and ``ready(module)`` (a module
    being imported is in sys.modules before its code has run)."""
    with _lock:
        module = sys.modules.get(name)
        if module is not None and ready(module):
            callback(module)
            return
        _waiting.setdefault(name, []).append(callback)
        _install()


def _install() -> None:
    global _finder
    if _finder is None:
        _finder = _AfterImport()
        sys.meta_path.insert(0, _finder)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; for a module someone waits for it wraps the real loader so the
    callbacks run right after that module has run."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _waiting:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module):
            original(module)
            with _lock:
                for callback in _waiting.pop(fullname, []):
                    callback(module)

        loader.exec_module = exec_module
        return spec
