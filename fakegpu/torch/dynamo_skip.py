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
import threading

from fakegpu.import_hooks import after_import

_TRACE_RULES = "torch._dynamo.trace_rules"
_pending: list[str] = []
_lock = threading.Lock()


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
    after_import(_TRACE_RULES, _apply, ready=lambda rules: getattr(rules, "SKIP_DIRS", None) is not None)


def _apply(rules) -> None:
    with _lock:
        while _pending:
            name = _pending.pop(0)
            try:
                rules.add(name)
            except Exception:  # noqa: BLE001 - a torch without this API: compile was never supported there
                pass
