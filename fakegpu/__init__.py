"""fakegpu: run multi-rank NCCL jobs without the cluster, with exact results and a cost report."""
from __future__ import annotations

import os
from pathlib import Path

__version__ = "0.1.0"

_LIB_NAME = "libnccl.so.2"


def nccl_library_path() -> str:
    """Absolute path of the fakegpu ``libnccl.so.2`` shim.

    ``FAKEGPU_NCCL_LIBRARY`` overrides; otherwise the copy installed inside the package,
    then a development build in ``build/`` of a source checkout.
    """
    override = os.environ.get("FAKEGPU_NCCL_LIBRARY")
    if override:
        return str(Path(override).resolve())
    here = Path(__file__).resolve().parent
    candidates = [here / "lib" / _LIB_NAME, here.parent / "build" / _LIB_NAME]
    candidates.extend(_installed_copies())
    for candidate in candidates:
        if candidate.is_file():
            return str(candidate)
    raise FileNotFoundError(
        f"fakegpu's {_LIB_NAME} was not found (looked in: {', '.join(map(str, candidates))}); "
        "install the package with `pip install .` or build it with "
        "`cmake -S . -B build && cmake --build build`"
    )


def _installed_copies() -> list[Path]:
    """The shim inside an installed distribution, for when a source tree shadows it on sys.path."""
    try:
        from importlib import metadata

        files = metadata.distribution("fakegpu").files or []
    except Exception:  # not installed
        return []
    return [Path(f.locate()).resolve() for f in files if str(f).endswith("lib/" + _LIB_NAME)]


def data_path(*parts: str) -> Path:
    """A bundled data file (cluster_configs/..., cluster_report.schema.json).

    Installed wheels carry them under fakegpu/data/; a source checkout has them at its root.
    """
    here = Path(__file__).resolve().parent
    for base in (here / "data", here.parent):
        candidate = base.joinpath(*parts)
        if candidate.exists():
            return candidate
    raise FileNotFoundError(f"fakegpu data file {'/'.join(parts)} is not installed")
