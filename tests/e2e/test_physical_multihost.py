"""verification/run_physical_multihost.py end to end: two network namespaces joined by a veth pair
are the two GPU hosts, reached through an --ssh-command that runs the controller's shell command
inside the named namespace (`ip netns exec NS sh -c CMD`) instead of sshd. The controller runs in
host A's namespace with the coordinator; each host runs its rank from a clean clone of this
checkout's HEAD. No GPU here, so both ranks run the CPU form of the worker, which the controller
must say. Needs root and iproute2 (skipped with the reason otherwise); CI runs as root.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_multihost_netns import HOST_A, HOST_B, two_hosts  # noqa: F401  (the namespace fixture)
from helpers.paths import REPO_ROOT as REPO

pytestmark = [pytest.mark.netns, pytest.mark.slow]
CASES = "ddp_all,fsdp2_bf16,mismatched_op,missing_peer"


@pytest.fixture(scope="module")
def clone(tmp_path_factory, shim_library):
    """A clean checkout of HEAD with a current shim build, as each physical host must have."""
    if shutil.which("git") is None or subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"],
                                                     capture_output=True).returncode != 0:
        pytest.skip("needs a git checkout of fakegpu and git")
    where = tmp_path_factory.mktemp("hosts") / "fakegpu"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(where)], check=True, timeout=300)
    (where / "build").mkdir()
    shutil.copy2(shim_library, where / "build" / "libnccl.so.2")
    os.utime(where / "build" / "libnccl.so.2")   # newer than every file of native/
    return where


def _netns_ssh(tmp_path: Path) -> Path:
    runner = tmp_path / "netns-ssh"
    runner.write_text('#!/bin/sh\n# netns-ssh NS COMMAND: what `ssh HOST COMMAND` does, for a namespace "host"\n'
                      'ns=$1; shift\nexec ip netns exec "$ns" sh -c "$*"\n')
    runner.chmod(0o755)
    return runner


def _controller(two_hosts, clone, tmp_path, *extra, timeout=900):  # noqa: F811
    ns_a, ns_b = two_hosts
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGPU_")}
    env["PYTHONPATH"] = str(REPO)
    nodes = []
    for name, ns, addr in (("host-a", ns_a, HOST_A), ("host-b", ns_b, HOST_B)):
        nodes += ["--node", f"name={name};ssh={ns};repo={clone};python={sys.executable};shell=posix;addr={addr}"]
    argv = ["ip", "netns", "exec", ns_a, sys.executable, str(REPO / "verification" / "run_physical_multihost.py"),
            *nodes, "--coordinator-host", HOST_A, "--ssh-command", f"sh {_netns_ssh(tmp_path)}",
            "--session", "netns-test", "--out", str(tmp_path / "out"), *extra]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=str(REPO))


def test_two_namespace_hosts_end_to_end(two_hosts, clone, tmp_path):  # noqa: F811
    done = _controller(two_hosts, clone, tmp_path, "--cases", CASES, "--timeout-ms", "4000", "--timeout", "600")
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-6000:]
    assert "no CUDA device: CPU form" in text
    out = tmp_path / "out"
    preflight = json.loads((out / "preflight.json").read_text())
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert [p["commit"] for p in preflight] == [head, head]
    assert all(p["nccl_version"] == 23007 and p["torch"] for p in preflight)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["node"] for r in ranks] == ["host-a", "host-b"]
    for r in ranks:
        assert r["ok"] and list(r["cases"]) == CASES.split(","), r
        assert r["cases"]["ddp_all"]["max_abs_err"] < 1e-5
    report = json.loads((out / "cluster-report.json").read_text())
    assert report["world_size"] == 2 and report["topology"]["node_count"] == 2
    assert (out / "cluster-report.md").read_text().strip()
    pairs = json.loads((out / "node-pairs.json").read_text())
    assert len(pairs) == 1 and all(v > 0 for v in pairs[0]["directions"].values()), pairs
    failures = json.loads((out / "failures.json").read_text())
    mismatch = failures["cases"]["mismatched_op"]
    assert {k: v["error"]["name"] for k, v in mismatch.items()} == {"rank0": "ncclInvalidUsage",
                                                                     "rank1": "ncclInvalidUsage"}
    assert failures["cases"]["missing_peer"]["rank1"]["error"]["name"] == "ncclTimeout"
    summary = (out / "summary.md").read_text()
    assert "host-a" in summary and "host-b" in summary and "Problems: none" in summary


def test_a_host_with_modified_tracked_files_stops_the_launch(two_hosts, clone, tmp_path):  # noqa: F811
    readme = clone / "README.md"
    original = readme.read_text()
    readme.write_text(original + "\nlocal edit\n")
    try:
        done = _controller(two_hosts, clone, tmp_path, "--cases", "ddp_all", timeout=300)
    finally:
        readme.write_text(original)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "preflight failed, nothing launched" in done.stderr
    assert "host-a" in done.stderr and "tracked files modified" in done.stderr and "README.md" in done.stderr
    assert not (tmp_path / "out" / "rank0.json").exists()
