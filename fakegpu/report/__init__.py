"""Cluster communication reports: the Recorder that accumulates them, and their files.

Names are imported on first use (PEP 562) so that ``python -m fakegpu.report.schema`` and
the coordinator's lazy import stay cheap.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "SCHEMA_VERSION": "fakegpu.report.cluster_report",
    "ClusterReport": "fakegpu.report.cluster_report",
    "check_report": "fakegpu.report.check",
    "load_report": "fakegpu.report.check",
    "atomic_write_text": "fakegpu.report.writer",
    "default_markdown_path": "fakegpu.report.writer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fakegpu.report' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
