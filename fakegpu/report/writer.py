"""Atomic writing of the report files: a reader never sees a half-written report,
even if the coordinator is killed while writing (temp file in the same folder + os.replace)."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Optional, Union

PathLike = Union[str, os.PathLike]


def atomic_write_text(path: PathLike, text: str) -> str:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=str(target.parent))
    try:
        # mkstemp makes the file private (0600); a report is for reading, so keep the mode a
        # previous copy had, else make it readable like any file the user writes.
        try:
            mode = target.stat().st_mode & 0o777
        except OSError:
            mode = 0o644
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return str(target)


class ReportPathError(OSError):
    """A report cannot be written at the path it was given; the message says why."""


def check_writable(path: PathLike) -> None:
    """Fail now, naming the path, when a report could not be written there later: the path is a
    directory, its folder cannot be created, or no file can be made in it (read-only, no
    permission). Writes and removes a probe file beside the target, as atomic_write_text would."""
    target = Path(path)
    if target.is_dir():
        raise ReportPathError(f"{target} is a directory")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ReportPathError(f"cannot create its directory {target.parent}: {exc.strerror or exc}") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".probe", dir=str(target.parent))
    except OSError as exc:
        raise ReportPathError(f"cannot create files in {target.parent}: {exc.strerror or exc}") from None
    os.close(fd)
    os.unlink(probe)


def default_markdown_path(json_path: PathLike) -> str:
    """``report.json`` -> ``report.md`` (``report`` -> ``report.md``)."""
    p = Path(json_path)
    return str(p.with_suffix(".md") if p.suffix.lower() == ".json" else p.with_name(p.name + ".md"))


def write_report_files(report: dict, json_path: PathLike, markdown_path: Optional[PathLike] = None,
                       trace_path: Optional[PathLike] = None) -> dict:
    from .markdown import render_markdown
    from .trace import build_trace

    written = {"json": atomic_write_text(json_path, json.dumps(report, indent=2, sort_keys=False) + "\n")}
    md = markdown_path if markdown_path is not None else default_markdown_path(json_path)
    written["markdown"] = atomic_write_text(md, render_markdown(report))
    if trace_path is not None:
        written["trace"] = atomic_write_text(trace_path, json.dumps(build_trace(report), separators=(",", ":")) + "\n")
    return written
