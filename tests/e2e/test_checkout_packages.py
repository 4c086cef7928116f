"""The checkout launchers (`./fgpu`, build/fakegpu-coordinator) on interpreters that lack
fakegpu's Python packages (issue 32): they stop at once with one line naming the packages and
the pip command, and with only numpy and cffi (what every coordinator needs) a run without a
cluster YAML works, bfloat16 included (the coordinator never needs ml_dtypes).

The interpreters are venvs made here without pip (`python -m venv --without-pip`, a fraction of
a second): one bare, one whose only packages are this environment's numpy and cffi, reached by
a .pth file through a folder of links to just those."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers.paths import REPO_ROOT

FGPU = REPO_ROOT / "fgpu"
REQUIREMENTS = REPO_ROOT / "requirements.txt"
# numpy and cffi with what they load: the wheels' bundled libraries (numpy.libs) and pycparser
MINIMAL = ("numpy", "cffi", "_cffi_backend", "pycparser")


def _venv(where: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=60)
    return where / "bin" / "python"


def _site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                         capture_output=True, text=True, check=True, timeout=30)
    return Path(out.stdout.strip())


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> Path:
    return _venv(tmp_path_factory.mktemp("bare") / "venv")


@pytest.fixture(scope="module")
def minimal_python(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("minimal")
    python = _venv(root / "venv")
    links = root / "packages"
    links.mkdir()
    for name in MINIMAL:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            pytest.skip(f"{name} is not installed here")
        path = Path(spec.origin)
        top = path.parent if spec.submodule_search_locations else path
        for entry in [top, *top.parent.glob(f"{name}.libs")]:
            (links / entry.name).symlink_to(entry)
    (_site_packages(python) / "fakegpu-test-minimal.pth").write_text(f"{links}\n")
    return python


def _env(python: Path, shim: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("FAKEGPU_") and k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "LD_PRELOAD")}
    env.update(FAKEGPU_PYTHON=str(python), FAKEGPU_NCCL_LIBRARY=shim)
    return env


def _run(cmd, cwd, env, timeout=60):
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=timeout, start_new_session=True)


def _one_line_error(done, prog: str, what: str, packages: list[str], python: Path):
    assert done.returncode == 2, done
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    line = lines[0]
    named = ", ".join(f"'{p}'" for p in packages)
    assert line.startswith(f"{prog}: error: {what} needs the Python packages {named}, which are not installed "
                           f"for {python}: "), line
    assert f"pip install -r {REQUIREMENTS}" in line, line
    assert "Traceback" not in done.stderr


def test_imports_are_really_missing(bare_python, minimal_python):
    for python, present in ((bare_python, []), (minimal_python, ["numpy", "cffi"])):
        code = ("import importlib.util as u; print(' '.join(m for m in ('numpy', 'cffi', 'ml_dtypes', 'yaml', "
                "'jsonschema', 'psutil', 'torch') if u.find_spec(m)))")
        out = _run([python, "-c", code], REPO_ROOT, _env(python, "x"))
        assert out.stdout.split() == present, out


def test_fgpu_on_a_bare_python_stops_in_one_line(bare_python, shim_library, tmp_path):
    done = _run([FGPU, "--", "touch", "ran"], tmp_path, _env(bare_python, shim_library))
    _one_line_error(done, "fgpu", "the coordinator", ["numpy", "cffi"], bare_python)
    assert not (tmp_path / "ran").exists()   # nothing started
    # what runs without a coordinator needs none of them
    assert _run([FGPU, "--help"], tmp_path, _env(bare_python, shim_library)).returncode == 0
    done = _run([FGPU, "-q", "--dist-mode", "fake", "--", "touch", "ran"], tmp_path, _env(bare_python, shim_library))
    assert done.returncode == 0 and (tmp_path / "ran").exists(), done


@pytest.fixture(scope="module")
def coordinator_launcher(tmp_path_factory) -> Path:
    """build/fakegpu-coordinator, or the same launcher from a configure-only CMake run in a
    scratch build tree (CMake writes it at configure time; nothing is compiled)."""
    launcher = REPO_ROOT / "build" / "fakegpu-coordinator"
    if launcher.is_file():
        return launcher
    import shutil

    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed (it writes build/fakegpu-coordinator)")
    build = tmp_path_factory.mktemp("configure-only")
    subprocess.run(["cmake", "-S", str(REPO_ROOT), "-B", str(build)], check=True, capture_output=True,
                   timeout=300)
    return build / "fakegpu-coordinator"


def test_coordinator_launcher_on_a_bare_python_stops_in_one_line(bare_python, coordinator_launcher, tmp_path):
    launcher = coordinator_launcher
    done = _run([launcher, "--transport", "unix", "--address", tmp_path / "c.sock"], tmp_path,
                _env(bare_python, "unused"))
    _one_line_error(done, "fakegpu coordinator", "the coordinator", ["numpy", "cffi"], bare_python)


# Two ranks allreduce float32 and bfloat16 (uint16 bits: the job has no ml_dtypes either) and
# check the exact results.
JOB = textwrap.dedent("""
    import os, subprocess, sys
    if "RANK" not in os.environ:
        procs = [subprocess.Popen([sys.executable, __file__], env=dict(os.environ, RANK=str(r), WORLD_SIZE="2"))
                 for r in range(2)]
        sys.exit(max(p.wait(timeout=60) for p in procs))
    import numpy as np
    from fakegpu.nccl import Nccl
    rank = int(os.environ["RANK"])
    nccl = Nccl("libnccl.so.2")
    comm = nccl.comm_init_rank(2, nccl.shared_unique_id(os.path.abspath("uid"), rank), rank)
    send = np.arange(64, dtype=np.float32) * (rank + 1)
    recv = np.empty_like(send)
    comm.all_reduce(send, recv, send.size, send.dtype, "sum")
    assert np.array_equal(recv, np.arange(64, dtype=np.float32) * 3), recv
    bf16 = np.full(16, 0x3F80 if rank == 0 else 0x4000, dtype=np.uint16)   # 1.0 and 2.0
    out = np.empty_like(bf16)
    comm.all_reduce(bf16, out, bf16.size, "bfloat16", "sum")
    assert (out == 0x4040).all(), out                                    # 3.0
    comm.destroy()
    open("ok%d" % rank, "w").close()
""")


def test_fgpu_with_only_numpy_and_cffi_runs_a_job(minimal_python, shim_library, tmp_path):
    (tmp_path / "job.py").write_text(JOB)
    env = _env(minimal_python, shim_library)
    done = _run([FGPU, "-q", "--report", "r.json", "--", minimal_python, "job.py"], tmp_path, env)
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists()
    assert (tmp_path / "r.json").is_file()
    # a cluster YAML is what needs PyYAML and jsonschema
    done = _run([FGPU, "--cluster-config", "dev-2node-2gpu.yaml", "--", "touch", "ran"], tmp_path, env)
    _one_line_error(done, "fgpu", "the coordinator with a cluster config", ["pyyaml", "jsonschema"], minimal_python)
    assert not (tmp_path / "ran").exists()
