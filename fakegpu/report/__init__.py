"""Cluster communication reports: the Recorder that accumulates them, and their files.

Names are imported on first use (PEP 562) so that ``python -m fakegpu.report.schema`` and
the coordinator's lazy import stay cheap.
"""
from __future__ import annotations

from fakegpu._lazy import lazy_exports

_EXPORTS = {
    "SCHEMA_VERSION": "fakegpu.report.cluster_report",
    "ClusterReport": "fakegpu.report.cluster_report",
    "check_report": "fakegpu.report.check",
    "load_report": "fakegpu.report.check",
    "atomic_write_text": "fakegpu.report.writer",
    "default_markdown_path": "fakegpu.report.writer",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
