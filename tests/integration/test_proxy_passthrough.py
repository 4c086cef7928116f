"""FAKEGPU_DIST_MODE=passthrough and proxy, against a stand-in for NVIDIA's NCCL.

native/tests/stand_in_nccl.c is built as a libnccl.so.2 that counts its calls and computes
host-memory results for ranks held by one process. The shim loads it as "the real NCCL"
(FAKEGPU_REAL_NCCL_PATH, or found as site-packages/nvidia/nccl/lib/libnccl.so.2 on PYTHONPATH),
forwards every communicator and call to it, and in passthrough mode writes a per-rank report;
in proxy mode every communicator is also mirrored on a real coordinator.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.paths import REPO_ROOT as REPO

NATIVE = REPO / "native"

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")

# One process holding 3 ranks: every collective kind, PreMulSum (host and "device" scalar),
# send/recv, AlltoAll (the stand-in lacks ncclAlltoAll: the shim's send/recv form), a split.
WORKER = textwrap.dedent(r"""
    import ctypes, json, os, sys
    import numpy as np
    from fakegpu.nccl import Nccl, RedOp
    n = 3
    nccl = Nccl(sys.argv[1])
    comms = nccl.comm_init_all(n)
    assert [c.rank for c in comms] == [0, 1, 2] and all(c.size == n for c in comms)
    f32 = np.float32
    x = [np.arange(12, dtype=f32) + 100 * r for r in range(n)]
    y = [np.zeros(12, f32) for _ in range(n)]
    with nccl.group():
        for r, c in enumerate(comms):
            c.all_reduce(x[r], y[r], 12, f32, RedOp.sum)
    for r in range(n):
        np.testing.assert_array_equal(y[r], sum(x))
    # PreMulSum, host immediate and "device" residence (read when the call runs).
    scal = [np.array([0.0], f32) for _ in range(n)]
    ops = [c.create_premul_sum(scal[r], f32, device_scalar=True) for r, c in enumerate(comms)]
    for s in scal:
        s[0] = 0.25
    with nccl.group():
        for r, c in enumerate(comms):
            c.all_reduce(x[r], y[r], 12, f32, ops[r])
    for r, c in enumerate(comms):
        np.testing.assert_array_equal(y[r], sum(x) * f32(0.25))
        c.destroy_op(ops[r])
    # AllGather, ReduceScatter, Broadcast, Reduce(max).
    g = [np.zeros(36, f32) for _ in range(n)]
    with nccl.group():
        for r, c in enumerate(comms):
            c.all_gather(x[r], g[r], 12, f32)
    for r in range(n):
        np.testing.assert_array_equal(g[r], np.concatenate(x))
    rs = [np.zeros(4, f32) for _ in range(n)]
    with nccl.group():
        for r, c in enumerate(comms):
            c.reduce_scatter(x[r], rs[r], 4, f32, RedOp.sum)
    for r in range(n):
        np.testing.assert_array_equal(rs[r], sum(x)[4 * r:4 * r + 4])
    with nccl.group():
        for r, c in enumerate(comms):
            c.broadcast(x[r], y[r], 12, f32, 2)
    for r in range(n):
        np.testing.assert_array_equal(y[r], x[2])
    with nccl.group():
        for r, c in enumerate(comms):
            c.reduce(x[r], y[r], 12, f32, RedOp.max, 1)
    np.testing.assert_array_equal(y[1], x[2])
    # AlltoAll and a ring of send/recv.
    a = [np.arange(6, dtype=f32) + 10 * r for r in range(n)]
    b = [np.zeros(6, f32) for _ in range(n)]
    with nccl.group():
        for r, c in enumerate(comms):
            c.all_to_all(a[r], b[r], 2, f32)
    for r in range(n):
        np.testing.assert_array_equal(b[r], np.concatenate([a[p][2 * r:2 * r + 2] for p in range(n)]))
    with nccl.group():
        for r, c in enumerate(comms):
            c.send(x[r], 12, f32, (r + 1) % n)
            c.recv(y[r], 12, f32, (r - 1) % n)
    for r in range(n):
        np.testing.assert_array_equal(y[r], x[(r - 1) % n])
    # Split: ranks 0 and 2 together (key reverses their order), rank 1 alone.
    with nccl.group():
        subs = [c.split(r % 2, -r) for r, c in enumerate(comms)]
    assert [s.size for s in subs] == [2, 1, 2] and [s.rank for s in subs] == [1, 0, 0], \
        [(s.rank, s.size) for s in subs]
    z = [np.zeros(12, f32) for _ in range(n)]
    with nccl.group():
        for r in (0, 2):
            subs[r].all_reduce(x[r], z[r], 12, f32, RedOp.sum)
    np.testing.assert_array_equal(z[0], x[0] + x[2])
    with nccl.group():
        nocolor = [c.split(-1 if r == 1 else 0, r) for r, c in enumerate(comms)]
    assert nocolor[1] is None and nocolor[0].size == 2
    for s in subs + [nocolor[0], nocolor[2]]:
        s.destroy()
    for c in comms:
        c.destroy()
    lib = ctypes.CDLL(os.environ["STANDIN"])
    lib.standin_calls.restype = ctypes.c_long
    calls = {k: lib.standin_calls(("nccl" + k).encode()) for k in
             ("AllReduce", "Send", "Recv", "CommSplit", "CommInitRankConfig", "GetUniqueId",
              "RedOpCreatePreMulSum", "RedOpDestroy", "CommDestroy", "GroupEnd")}
    print("CALLS", json.dumps(calls))
""")


@pytest.fixture(scope="module")
def standin(tmp_path_factory) -> Path:
    """The stand-in, installed like the nvidia-nccl wheel under <root>/nvidia/nccl/lib."""
    root = tmp_path_factory.mktemp("standin")
    lib = root / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
    lib.parent.mkdir(parents=True)
    cmd = ["cc", "-std=c11", "-D_DEFAULT_SOURCE", "-O1", "-Wall", "-shared", "-fPIC", "-fvisibility=hidden",
           f"-I{NATIVE / 'include'}", "-Wl,-soname,libnccl.so.2", "-o", str(lib),
           str(NATIVE / "tests" / "stand_in_nccl.c"), "-pthread"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"building stand_in_nccl.c failed:\n{proc.stderr}"
    return lib


def run_worker(shim: str, env_extra: dict, tmp_path: Path, standin: Path, script: str = WORKER):
    env = dict(os.environ)
    env.pop("FAKEGPU_REAL_NCCL_PATH", None)
    env.update({"PYTHONPATH": os.pathsep.join([str(REPO), str(standin.parents[3])]), "STANDIN": str(standin),
                "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                "FAKEGPU_CLUSTER_REPORT_PATH": str(tmp_path / "report.json")})
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", script, shim], env=env, capture_output=True, text=True,
                          timeout=120, cwd=str(tmp_path))


def check_calls(stdout: str) -> None:
    line = next(l for l in stdout.splitlines() if l.startswith("CALLS "))
    calls = json.loads(line[6:])
    assert calls["GetUniqueId"] == 1            # ncclCommInitAll took the real library's id
    assert calls["CommInitRankConfig"] == 3
    assert calls["AllReduce"] == 3 * 2 + 2     # sum, premulsum, split allreduce on 2 ranks
    assert calls["Send"] == 3 * 3 + 3 and calls["Recv"] == 3 * 3 + 3  # AlltoAll as send/recv + the ring
    assert calls["CommSplit"] == 6
    assert calls["RedOpCreatePreMulSum"] == 3 and calls["RedOpDestroy"] == 3
    assert calls["CommDestroy"] == 3 + 3 + 2


def test_passthrough_forwards_and_reports(shim_library, tmp_path, standin):
    proc = run_worker(shim_library, {"FAKEGPU_DIST_MODE": "passthrough", "FAKEGPU_REAL_NCCL_PATH": str(standin)},
                      tmp_path, standin)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check_calls(proc.stdout)
    report = json.loads((tmp_path / "report.json.rank0").read_text())
    assert report["mode"] == "passthrough" and report["real_nccl"]["path"] == str(standin)
    assert report["real_nccl"]["version"] == 22999
    comms = report["communicators"]
    assert len(comms) == 3 + 3 + 2 and all(c["state"] == "destroyed" for c in comms)
    world = [c for c in comms if c["parent"] == -1]
    assert sorted(c["rank"] for c in world) == [0, 1, 2]
    r0 = next(c for c in world if c["rank"] == 0)
    assert r0["ops"]["AllReduce"] == {"calls": 2, "bytes": 2 * 48, "failed": 0}
    assert r0["ops"]["AllGather"]["bytes"] == 3 * 48 and r0["ops"]["AlltoAll"]["bytes"] == 6 * 4
    assert r0["ops"]["Send"]["calls"] == 1 and r0["ops"]["Recv"]["calls"] == 1
    total = report["totals"]
    assert total["AllReduce"]["calls"] == 8 and total["ReduceScatter"]["calls"] == 3


def test_passthrough_finds_the_wheel_on_pythonpath(shim_library, tmp_path, standin):
    proc = run_worker(shim_library, {"FAKEGPU_DIST_MODE": "passthrough"}, tmp_path, standin)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "report.json.rank0").read_text())
    assert report["real_nccl"]["path"] == str(standin)


def test_missing_real_nccl_is_a_clear_error(shim_library, tmp_path, standin):
    script = ("import sys\nfrom fakegpu.nccl import Nccl, NcclError\n"
              "try:\n    Nccl(sys.argv[1]).get_unique_id()\nexcept NcclError as e:\n    print('ERR', e)\n")
    proc = run_worker(shim_library, {"FAKEGPU_DIST_MODE": "passthrough",
                                     "FAKEGPU_REAL_NCCL_PATH": str(tmp_path / "nope" / "libnccl.so.2")},
                      tmp_path, standin, script)
    assert proc.returncode == 0, proc.stderr
    assert "ERR" in proc.stdout and "NVIDIA's libnccl.so.2" in proc.stdout and "nope" in proc.stdout


def test_proxy_mirrors_communicators_on_the_coordinator(shim_library, tmp_path, standin, start_coordinator):
    report = tmp_path / "coordinator-report.json"
    coordinator = start_coordinator("unix", extra_env={"FAKEGPU_CLUSTER_REPORT_PATH": str(report)})
    env = dict(coordinator.client_env, FAKEGPU_DIST_MODE="proxy", FAKEGPU_REAL_NCCL_PATH=str(standin))
    proc = run_worker(shim_library, env, tmp_path, standin)
    assert proc.returncode == 0, proc.stdout + proc.stderr + coordinator.log()
    check_calls(proc.stdout)
    rank_report = json.loads((tmp_path / "report.json.rank0").read_text())
    assert rank_report["mode"] == "proxy"
    coordinator.stop()
    # The coordinator mirrored the world and both splits (membership in split-key order).
    comms = json.loads(report.read_text())["communicators"]
    shapes = sorted((c["parent_id"] is not None, c["size"], tuple(c["members"])) for c in comms)
    assert shapes == [(False, 3, (0, 1, 2)), (True, 1, (1,)), (True, 2, (0, 2)), (True, 2, (2, 0))], comms


def test_passthrough_reports_the_real_librarys_async_errors(shim_library, tmp_path, standin):
    """torch's watchdog polls ncclCommGetAsyncError: a failure inside the real library must show."""
    script = textwrap.dedent(r"""
        import ctypes, os, sys
        from fakegpu.nccl import Nccl
        nccl = Nccl(sys.argv[1])
        comms = nccl.comm_init_all(2)
        assert [c.get_async_error() for c in comms] == [0, 0]
        ctypes.CDLL(os.environ["STANDIN"]).standin_inject_async_error(6)  # ncclRemoteError
        print("ASYNC", [c.get_async_error() for c in comms])
        for c in comms:
            c.abort()
    """)
    proc = run_worker(shim_library, {"FAKEGPU_DIST_MODE": "passthrough", "FAKEGPU_REAL_NCCL_PATH": str(standin)},
                      tmp_path, standin, script)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ASYNC [6, 6]" in proc.stdout
    report = json.loads((tmp_path / "report.json.rank0").read_text())
    assert [c["state"] for c in report["communicators"]] == ["aborted", "aborted"]


# Two ranks held by one process in proxy mode: three allreduces and a send/recv exchange are
# checked and accounted by the coordinator (ACCOUNT), then a count mismatch is refused before
# the real library sees it.
ACCOUNT_WORKER = textwrap.dedent(r"""
    import ctypes, json, os, sys
    import numpy as np
    from fakegpu.nccl import Nccl, NcclError, RedOp
    nccl = Nccl(sys.argv[1])
    comms = nccl.comm_init_all(2)
    f32 = np.float32
    x = [np.arange(12, dtype=f32) + 100 * r for r in range(2)]
    y = [np.zeros(12, f32) for _ in range(2)]
    for _ in range(3):
        with nccl.group():
            for r, c in enumerate(comms):
                c.all_reduce(x[r], y[r], 12, f32, RedOp.sum)
        for r in range(2):
            np.testing.assert_array_equal(y[r], x[0] + x[1])
    with nccl.group():
        for r, c in enumerate(comms):
            c.send(x[r], 12, f32, 1 - r)
            c.recv(y[r], 12, f32, 1 - r)
    for r in range(2):
        np.testing.assert_array_equal(y[r], x[1 - r])
    lib = ctypes.CDLL(os.environ["STANDIN"])
    lib.standin_calls.restype = ctypes.c_long
    before = lib.standin_calls(b"ncclAllReduce")
    try:
        with nccl.group():
            comms[0].all_reduce(x[0], y[0], 12, f32, RedOp.sum)
            comms[1].all_reduce(x[1], y[1], 8, f32, RedOp.sum)
        print("NOERROR")
    except NcclError as e:
        print("MISMATCH", json.dumps({"result": e.result, "detail": e.detail,
                                      "comm": [nccl.last_error(c) for c in comms],
                                      "forwarded": lib.standin_calls(b"ncclAllReduce") - before}))
    for c in comms:
        c.destroy()
""")


def test_proxy_checks_and_accounts_every_call(shim_library, tmp_path, standin, start_coordinator):
    report = tmp_path / "coordinator-report.json"
    coordinator = start_coordinator("unix", extra_env={"FAKEGPU_CLUSTER_REPORT_PATH": str(report)})
    env = dict(coordinator.client_env, FAKEGPU_DIST_MODE="proxy", FAKEGPU_REAL_NCCL_PATH=str(standin))
    proc = run_worker(shim_library, env, tmp_path, standin, ACCOUNT_WORKER)
    assert proc.returncode == 0, proc.stdout + proc.stderr + coordinator.log()
    line = next((l for l in proc.stdout.splitlines() if l.startswith("MISMATCH ")), None)
    assert line is not None, proc.stdout + proc.stderr
    got = json.loads(line[len("MISMATCH "):])
    assert got["result"] == 5, got                      # ncclInvalidUsage
    assert got["forwarded"] == 0, got                   # refused before real NCCL saw it
    for text in [got["detail"], *got["comm"]]:
        assert "count=12" in text and "count=8" in text, got
    coordinator.stop()
    data = json.loads(report.read_text())
    allreduce = data["collectives"]["AllReduce"]
    assert allreduce["calls"] == 3, allreduce
    assert allreduce["logical_bytes"] == 3 * 48, allreduce
    assert allreduce["errors"] == 1 and allreduce["socket_bytes"] == 0, allreduce   # the refused call
    p2p = data["point_to_point"]
    assert p2p["operations"] == 2 and p2p["bytes"] == 2 * 48 and p2p["socket_bytes"] == 0, p2p


def test_passthrough_report_is_valid_json_for_any_path(shim_library, tmp_path, standin):
    """The report writes strings with the shim's one JSON writer (fake::json_string): a library
    path with quotes, backslashes and control characters comes back exactly (the old writer
    dropped control characters)."""
    odd = tmp_path / 'a"b\\c\td\x01e'
    lib = odd / "libnccl.so.2"
    odd.mkdir()
    shutil.copy(standin, lib)
    proc = run_worker(shim_library, {"FAKEGPU_DIST_MODE": "passthrough", "FAKEGPU_REAL_NCCL_PATH": str(lib)},
                      tmp_path, standin)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "report.json.rank0").read_text())
    assert report["real_nccl"]["path"] == str(lib)
    assert report["rank"] == 0 and report["world_size"] == 1
