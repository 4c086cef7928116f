"""Keep torch.compile out of fakegpu's own Python code.

A compiled region that runs a collective calls the backend from C++ (DDP's reducer rebuilding
its buckets in the first compiled forward, a Work waited on by the reducer).  The backend is
Python here, so dynamo's frame hook sees fakegpu's frames and tries to compile them, which
fails inside torch (``UnsafeScriptObjectError`` on the ProcessGroup).  A C++ backend such as
gloo has no frames to see.  Dynamo's own skip list (``torch._dynamo.trace_rules.add``) makes it
run those frames as they are; traced user code that calls into them graph-breaks there.
The skip is per frame (the frames a skipped frame calls are looked at again), so it covers all
of fakegpu but the fake-CUDA pieces that dynamo traces inside user code, as it would the CPU
port's own calls: the device-rewrite mode and the patched tensor methods (``.cuda()``,
``.to("cuda")``), which a compiled model calls.

Importing torch._dynamo costs about a second, and most programs never compile, so the modules
are added when something else imports dynamo: a post-import hook on
``torch._dynamo.trace_rules`` (or at once, if it is already imported).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import threading

_TRACE_RULES = "torch._dynamo.trace_rules"
_pending: list[str] = []
_lock = threading.Lock()
_hooked = False


# Traced inside user code (see above): not skipped.
USER_CODE_MODULES = ("fakegpu.fake_cuda.runtime", "fakegpu.fake_cuda._patch")


def fakegpu_modules() -> list[str]:
    """fakegpu's modules and subpackages, by name (nothing is imported), less USER_CODE_MODULES:
    a package covers its directory, so those modules' packages are listed module by module."""
    import pkgutil

    import fakegpu

    def walk(package, prefix: str) -> list[str]:
        names = []
        for info in pkgutil.iter_modules(package.__path__ if hasattr(package, "__path__") else package,
                                         prefix):
            holds_user_code = any(m.startswith(info.name + ".") for m in USER_CODE_MODULES)
            if info.name in USER_CODE_MODULES:
                continue
            if holds_user_code:
                names += walk(importlib.import_module(info.name), info.name + ".")
            else:
                names.append(info.name)
        return names

    return walk(fakegpu, "fakegpu.")


def skip_fakegpu() -> None:
    """All of fakegpu that dynamo must not compile (see above)."""
    skip_in_dynamo(*fakegpu_modules())


def skip_in_dynamo(*modules: str) -> None:
    """Add ``modules`` (importable names: a package covers its directory) to dynamo's skip list,
    now or when dynamo is first imported."""
    with _lock:
        _pending.extend(m for m in modules if m not in _pending)
        rules = sys.modules.get(_TRACE_RULES)
        if rules is not None and getattr(rules, "SKIP_DIRS", None) is not None:
            _apply(rules)
        else:
            _install_hook()


def _apply(rules) -> None:
    while _pending:
        name = _pending.pop(0)
        try:
            rules.add(name)
        except Exception:  # noqa: BLE001 - a torch without this API: compile was never supported there
            pass


def _install_hook() -> None:
    global _hooked
    if _hooked:
        return
    sys.meta_path.insert(0, _AfterImport())
    _hooked = True


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; for torch._dynamo.trace_rules it wraps the real loader so the
    pending modules are added right after that module has run."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TRACE_RULES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module):
            original(module)
            with _lock:
                _apply(module)

        loader.exec_module = exec_module
        return spec
