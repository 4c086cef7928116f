"""fakegpu.import_hooks: callbacks after a module's first import, without importing it."""
from __future__ import annotations

import sys

from fakegpu.import_hooks import after_import


def test_runs_at_once_for_an_imported_module():
    seen = []
    after_import("json", seen.append)
    assert seen == [sys.modules["json"]]


def test_runs_after_the_module_has_run(tmp_path, monkeypatch):
    (tmp_path / "fakegpu_hook_probe_mod.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    after_import("fakegpu_hook_probe_mod", lambda module: seen.append(module.VALUE))
    assert seen == []                       # not imported by asking
    assert "fakegpu_hook_probe_mod" not in sys.modules
    import fakegpu_hook_probe_mod  # noqa: F401

    assert seen == [42]                     # once, with the module's own code run
    import importlib

    importlib.reload(fakegpu_hook_probe_mod)
    assert seen == [42]
    del sys.modules["fakegpu_hook_probe_mod"]


def test_a_module_not_ready_yet_waits_for_its_import(tmp_path, monkeypatch):
    (tmp_path / "fakegpu_hook_probe_ready.py").write_text("READY = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    placeholder = type(sys)("fakegpu_hook_probe_ready")   # half-imported: no READY yet
    monkeypatch.setitem(sys.modules, "fakegpu_hook_probe_ready", placeholder)
    seen = []
    after_import("fakegpu_hook_probe_ready", lambda module: seen.append(module.READY),
                 ready=lambda module: hasattr(module, "READY"))
    assert seen == []
    del sys.modules["fakegpu_hook_probe_ready"]
    import fakegpu_hook_probe_ready  # noqa: F401

    assert seen == [True]
    del sys.modules["fakegpu_hook_probe_ready"]
