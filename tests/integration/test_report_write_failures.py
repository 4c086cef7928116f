"""Reports that cannot be written: a coordinator whose report directory is read-only or cannot be
created refuses to start; one whose final write fails (the disk filled up) exits non-zero; and
fgpu says so, exits non-zero and never summarises the report an earlier job left there.

The read-only and full file systems are small tmpfs mounts in a private mount namespace
(`unshare -m`, which needs root, as in CI); elsewhere the tests are skipped."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.paths import REPO_ROOT

HERE = Path(__file__).resolve()
CONFIG = REPO_ROOT / "cluster_configs" / "dev-2node-2gpu.yaml"
PY = shlex.quote(sys.executable)


def _private_mount_works() -> bool:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True, timeout=30)
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(not _private_mount_works(),
                                reason="needs root and unshare -m for a private tmpfs mount")


def _in_mount_namespace(script: str, env: dict, timeout_s: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], env=env,
                          capture_output=True, text=True, timeout=timeout_s, cwd=str(REPO_ROOT))


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGPU_") and k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    env.update(extra)
    return env


@pytest.mark.parametrize("where", ["dir/report.json", "report.json"])
def test_coordinator_refuses_a_report_path_it_cannot_write(tmp_path, where):
    mnt = tmp_path / "ro"
    mnt.mkdir()
    report = mnt / where
    script = (f"mount -t tmpfs -o size=64k,ro tmpfs {mnt} && exec timeout 60 {PY} -m fakegpu coordinator "
              f"--address {tmp_path / 'c.sock'} --report {report}")
    done = _in_mount_namespace(script, _env())
    # Before: it listened and ran the whole job (until `timeout` stopped it) with the report lost.
    assert done.returncode == 2, done.stdout + done.stderr
    assert "listening" not in done.stdout
    assert f"cannot write the report --report {report}" in done.stderr, done.stderr
    assert "Read-only file system" in done.stderr


def test_coordinator_exits_non_zero_when_the_final_write_fails(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    sock = tmp_path / "c.sock"
    script = f"""
        mount -t tmpfs -o size=256k tmpfs {mnt} || exit 90
        {PY} -m fakegpu coordinator --address {sock} --report {mnt}/report.json 2> {tmp_path}/coord.err &
        pid=$!
        n=0; while [ ! -S {sock} ]; do sleep 0.1; n=$((n+1)); [ $n -gt 300 ] && exit 91; done
        dd if=/dev/zero of={mnt}/fill bs=4096 2>/dev/null
        kill -TERM $pid; wait $pid; echo "coordinator exit $?"
    """
    done = _in_mount_namespace(script, _env())
    err = (tmp_path / "coord.err").read_text()
    assert "coordinator exit 1" in done.stdout, done.stdout + done.stderr + err     # before: exit 0
    assert "No space left on device" in err and "the final reports could not be written" in err, err


def test_fgpu_reports_a_lost_report_and_never_shows_the_previous_one(tmp_path, shim_library):
    mnt = tmp_path / "small"
    mnt.mkdir()
    report = mnt / "report.json"
    fill = f"dd if=/dev/zero of={mnt}/fill bs=4096 2>/dev/null; exit 0"
    script = f"""
        mount -t tmpfs -o size=512k tmpfs {mnt} || exit 90
        {PY} -m fakegpu run --cluster-config {CONFIG} --report {report} -- true 2> {tmp_path}/first.err
        echo "first exit $?"
        {PY} -m fakegpu run --report {report} -- sh -c {shlex.quote(fill)} 2> {tmp_path}/second.err
        echo "second exit $?"
    """
    done = _in_mount_namespace(script, _env(FAKEGPU_NCCL_LIBRARY=shim_library))
    first = (tmp_path / "first.err").read_text()
    second = (tmp_path / "second.err").read_text()
    assert "first exit 0" in done.stdout and "cluster dev-2x2" in first, done.stdout + first
    # Before: exit 0, no message, and the summary of the first job's report.
    assert "second exit 1" in done.stdout, done.stdout + second
    assert "No space left on device" in second, second
    assert f"JSON report {report} was not written by this job" in second, second
    assert "this job's reports were not written" in second, second
    assert "cluster dev-2x2" not in second, second
