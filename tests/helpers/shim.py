"""Find the libnccl.so.2 under test, building it from this checkout when none exists."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from .paths import REPO_ROOT
LIB_NAME = "libnccl.so.2"


def locate_shim() -> str | None:
    """FAKEGPU_NCCL_LIBRARY, else what ``fakegpu.nccl_library_path()`` finds; None if nothing."""
    override = os.environ.get("FAKEGPU_NCCL_LIBRARY")
    if override:
        return str(Path(override).resolve()) if Path(override).is_file() else None
    import fakegpu

    try:
        return fakegpu.nccl_library_path()
    except FileNotFoundError:
        return None


def build_shim(build_dir: Path, timeout_s: float = 900) -> str:
    """Configure and build the shim with CMake into ``build_dir`` (-j2: CI has two cores)."""
    build_dir = Path(build_dir)
    steps = [
        ["cmake", "-S", str(REPO_ROOT), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=RelWithDebInfo"],
        ["cmake", "--build", str(build_dir), "-j2", "--target", "nccl"],
    ]
    for step in steps:
        proc = subprocess.run(step, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(
                f"building the shim failed: {' '.join(step)} exited {proc.returncode}\n"
                f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
            )
    library = build_dir / LIB_NAME
    if not library.is_file():
        raise RuntimeError(f"the shim build finished but {library} does not exist")
    return str(library.resolve())  # like locate_shim: the file itself, not the SONAME link
