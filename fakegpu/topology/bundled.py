"""The cluster configs fakegpu ships (cluster_configs/ in a checkout, fakegpu/data/cluster_configs/
in an installed package), found by bare name: `--cluster-config dev-2node-2gpu.yaml` or
`dev-2node-2gpu` works from any directory."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional


def bundled_dirs() -> list[Path]:
    """Where the bundled configs can be: an installed wheel, then a source checkout (its
    cluster_configs/, then the verification configs the usage doc names, verification/data/)."""
    package = Path(__file__).resolve().parents[1]
    return [d for d in (package / "data" / "cluster_configs", package.parent / "cluster_configs",
                        package.parent / "verification" / "data") if d.is_dir()]


def bundled_names() -> list[str]:
    return sorted({p.name for d in bundled_dirs() for p in d.glob("*.yaml")})


def bundled_cluster_config(name: str) -> Optional[Path]:
    """The bundled config called ``name`` (with or without ``.yaml``), or None. A name with a
    directory part is a path, never a bundled name."""
    if not name or os.sep in name or (os.altsep and os.altsep in name):
        return None
    for folder in bundled_dirs():
        for candidate in (folder / name, folder / f"{name}.yaml"):
            if candidate.is_file():
                return candidate
    return None


def resolve_cluster_config(path: str) -> str:
    """``path`` itself when it exists, else the bundled config of that name, else ``path``
    unchanged (so that the error names what the user gave)."""
    if os.path.exists(path):
        return path
    found = bundled_cluster_config(path)
    return str(found) if found is not None else path
