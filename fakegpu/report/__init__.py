"""Cluster communication reports: the Recorder that accumulates them, and their files."""
from __future__ import annotations

from .check import check_report, load_report
from .cluster_report import SCHEMA_VERSION, ClusterReport
from .writer import atomic_write_text, default_markdown_path

__all__ = [
    "SCHEMA_VERSION",
    "ClusterReport",
    "atomic_write_text",
    "check_report",
    "default_markdown_path",
    "load_report",
]
