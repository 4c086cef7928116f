"""An installed fakegpu (`pip install .`) carries everything users need at run time.

Checks the installed distribution's file list: the shim at fakegpu/lib/libnccl.so.2, the
header, the cluster configurations and report schema under fakegpu/data/, and the `fgpu`
command. Skips when fakegpu is only importable from a source tree (not pip-installed).
"""
from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from helpers.paths import REPO_ROOT



@pytest.fixture(scope="module")
def distribution():
    try:
        return metadata.distribution("fakegpu")
    except metadata.PackageNotFoundError:
        pytest.skip("fakegpu is not pip-installed in this environment (`pip install .`)")


@pytest.fixture(scope="module")
def installed_files(distribution) -> set[str]:
    return {str(f).replace(os.sep, "/") for f in (distribution.files or [])}


def test_shim_and_header_are_inside_the_package(installed_files):
    assert "fakegpu/lib/libnccl.so.2" in installed_files
    assert "fakegpu/include/nccl.h" in installed_files


def test_installed_header_is_the_source_header(distribution):
    installed = Path(distribution.locate_file("fakegpu/include/nccl.h"))
    assert installed.read_bytes() == (REPO_ROOT / "native" / "include" / "nccl.h").read_bytes()


def test_runtime_data_is_inside_the_package(installed_files):
    configs = sorted(p.name for p in (REPO_ROOT / "cluster_configs").glob("*.y*ml"))
    missing = [name for name in configs if f"fakegpu/data/cluster_configs/{name}" not in installed_files]
    assert missing == [], "cluster configurations missing from the installed package"
    if (REPO_ROOT / "cluster_report.schema.json").is_file():
        assert "fakegpu/data/cluster_report.schema.json" in installed_files


def test_fgpu_command_is_installed(distribution):
    scripts = {ep.name: ep.value for ep in distribution.entry_points if ep.group == "console_scripts"}
    assert scripts.get("fgpu") == "fakegpu.cli.run:console_main"


def test_installed_package_finds_its_shim_from_anywhere(distribution, tmp_path):
    """Run from a directory outside the repository so the source tree cannot shadow the install."""
    env = {k: v for k, v in os.environ.items() if k not in ("FAKEGPU_NCCL_LIBRARY", "PYTHONPATH")}
    out = subprocess.run([sys.executable, "-c", "import fakegpu; print(fakegpu.nccl_library_path())"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    path = Path(out.stdout.strip())
    assert path.is_absolute() and path.is_file()
    assert path == Path(distribution.locate_file("fakegpu/lib/libnccl.so.2")).resolve()
