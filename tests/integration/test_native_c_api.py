"""The shim's native tests, driven from pytest.

* native/tests/protocol_vectors_test.cc: the C++ wire codec against tests/vectors/protocol_vectors.json
  (the bytes the Python codec produces).
* native/tests/c_api_test.c: a C program built against native/include/nccl.h that runs
  collectives, groups, splits, PreMulSum, argument errors and simulation through the real
  shim and a real coordinator, one process per rank (and one process holding all ranks
  with ncclCommInitAll), on both staging paths and with steps cut by a tiny staging size.
* Start-up failures: no address, nothing listening, a wrong token, an unimplemented mode,
  each a clear error at init — never a hang.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from helpers.native_programs import build_c_program, run_c_ranks
from helpers.paths import VECTORS, REPO_ROOT as REPO

NATIVE = REPO / "native"

pytestmark = pytest.mark.skipif(shutil.which("cc") is None or shutil.which("c++") is None,
                                reason="needs a C and a C++ compiler")


@pytest.fixture(scope="module")
def c_api_test(shim_library, tmp_path_factory) -> Path:
    """c_api_test.c compiled against our nccl.h and linked to the shim under test."""
    return build_c_program("c_api_test.c", tmp_path_factory.mktemp("c-api") / "c_api_test",
                           shim_library)


def test_protocol_vectors(tmp_path):
    binary = tmp_path / "protocol_vectors_test"
    cmd = ["c++", "-std=c++17", "-O1", f"-I{NATIVE / 'src'}", f"-I{NATIVE / 'include'}",
           str(NATIVE / "tests" / "protocol_vectors_test.cc"), str(NATIVE / "src" / "wire" / "protocol.cc"), "-o", str(binary)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([str(binary), str(VECTORS / "protocol_vectors.json")], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "vectors OK" in proc.stdout


@pytest.mark.parametrize("nranks,extra_env", [
    pytest.param(2, {}, id="2ranks-shm"),
    pytest.param(4, {"FAKEGPU_STAGING_CHUNK_BYTES": "4096"}, id="4ranks-shm-steps"),
    pytest.param(3, {"FAKEGPU_STAGING_FORCE_SOCKET": "1", "FAKEGPU_STAGING_CHUNK_BYTES": "8192",
                     "C_API_TEST_NONBLOCKING": "1"}, id="3ranks-socket-steps-nonblocking"),
])
def test_c_api_ranks(c_api_test, start_coordinator, tmp_path, nranks, extra_env):
    coordinator = start_coordinator("unix")
    run_c_ranks(c_api_test, nranks, coordinator, tmp_path, extra_env)


def test_abort_from_another_thread_wakes_a_blocked_call(c_api_test, start_coordinator, tmp_path):
    """torch's watchdog pattern: ncclCommAbort on one thread fails the call blocked on another."""
    coordinator = start_coordinator("unix")
    run_c_ranks(c_api_test, 2, coordinator, tmp_path, {"C_API_TEST_ABORT": "1"}, timeout_s=60)


def test_c_api_over_tcp(c_api_test, start_coordinator, tmp_path):
    coordinator = start_coordinator("tcp")
    run_c_ranks(c_api_test, 2, coordinator, tmp_path, {"C_API_TEST_BIG_COUNT": "100000"})


@pytest.mark.parametrize("extra_env", [{}, {"FAKEGPU_STAGING_CHUNK_BYTES": "4096"}], ids=["plain", "steps"])
def test_c_api_init_all(c_api_test, start_coordinator, extra_env):
    coordinator = start_coordinator("unix")
    env = dict(os.environ, **coordinator.client_env, **extra_env)
    proc = subprocess.run([str(c_api_test), "--init-all", "4"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr + coordinator.log()
    assert "init-all 4: OK" in proc.stdout


def test_c_api_fork_child_gets_its_own_connection(c_api_test, start_coordinator):
    coordinator = start_coordinator("unix")
    env = dict(os.environ, **coordinator.client_env)
    proc = subprocess.run([str(c_api_test), "--fork", "3"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr + coordinator.log()
    assert "init-all 3: OK" in proc.stdout


@pytest.mark.parametrize("extra_env", [{}, {"FAKEGPU_STAGING_FORCE_SOCKET": "1"}], ids=["shm", "socket"])
def test_c_api_one_thread_per_rank(c_api_test, start_coordinator, extra_env):
    """Rank threads of one process issue calls concurrently on the one connection."""
    coordinator = start_coordinator("unix")
    env = dict(os.environ, **coordinator.client_env, **extra_env)
    proc = subprocess.run([str(c_api_test), "--threads", "3"], env=env, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr + coordinator.log()
    assert "threads 3: OK" in proc.stdout


def _init_failure(c_api_test, env_overrides, timeout_s=30):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGPU_")}
    env.update(env_overrides)
    t0 = time.monotonic()
    proc = subprocess.run([str(c_api_test), "--init-all", "2"], env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    return proc, time.monotonic() - t0


def test_no_coordinator_address_is_a_clear_error(c_api_test):
    proc, elapsed = _init_failure(c_api_test, {})
    assert proc.returncode != 0
    assert "FAKEGPU_COORDINATOR_ADDR is not set" in proc.stderr
    assert "unhandled system error" in proc.stderr  # ncclSystemError
    assert elapsed < 10


def test_unreachable_coordinator_is_a_clear_error(c_api_test, tmp_path):
    missing = tmp_path / "nobody.sock"
    proc, elapsed = _init_failure(c_api_test, {"FAKEGPU_COORDINATOR_ADDR": str(missing)})
    assert proc.returncode != 0
    assert f"cannot connect to the coordinator at unix:{missing}" in proc.stderr
    assert "FAKEGPU_COORDINATOR_ADDR" in proc.stderr
    assert elapsed < 10


def test_wrong_token_is_refused(c_api_test, start_coordinator):
    coordinator = start_coordinator("unix")
    env = dict(coordinator.client_env, FAKEGPU_COORDINATOR_TOKEN="not-the-token")
    proc, elapsed = _init_failure(c_api_test, env)
    assert proc.returncode != 0
    assert "refused this process" in proc.stderr and "authentication" in proc.stderr
    assert elapsed < 10


@pytest.mark.parametrize("variable", ["FAKEGPU_CONNECT_TIMEOUT_MS", "FAKEGPU_HELLO_ANSWER_TIMEOUT_MS"])
@pytest.mark.parametrize("value", ["soon", "0"])
def test_connect_timeouts_must_be_positive_integers(c_api_test, tmp_path, variable, value):
    proc, _ = _init_failure(c_api_test, {"FAKEGPU_COORDINATOR_ADDR": str(tmp_path / "x.sock"),
                                         variable: value})
    assert proc.returncode != 0
    assert f"{variable}='{value}' is not a positive integer" in proc.stderr


@pytest.mark.parametrize("mode", ["bogus"])  # proxy/passthrough: tests/integration/test_proxy_passthrough.py
def test_other_modes_are_refused_with_a_message(c_api_test, mode):
    proc, _ = _init_failure(c_api_test, {"FAKEGPU_DIST_MODE": mode, "FAKEGPU_COORDINATOR_ADDR": "/nonexistent"})
    assert proc.returncode != 0
    assert f"FAKEGPU_DIST_MODE={mode}" in proc.stderr
    assert "invalid usage" in proc.stderr


class _MuteServer:
    """A Unix socket that accepts connections and then either never answers or hangs up."""

    def __init__(self, path: Path, hang_up: bool):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(8)
        self.hang_up = hang_up
        self.conns = []
        self.accepted = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            if self.hang_up:
                conn.recv(65536)
                conn.close()
            else:
                self.conns.append(conn)  # read nothing, answer nothing

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.mark.parametrize("hang_up", [False, True], ids=["mute", "hangs-up"])
def test_unresponsive_coordinator_is_an_error_not_a_hang(c_api_test, tmp_path, hang_up):
    """A rank that cannot get in fails within the connect timeout, not the operation timeout
    (before: HELLO was waited on for FAKEGPU_COORDINATOR_TIMEOUT_MS plus the 30 s margin)."""
    path = tmp_path / "mute.sock"
    server = _MuteServer(path, hang_up)
    try:
        proc, elapsed = _init_failure(c_api_test, {
            "FAKEGPU_COORDINATOR_ADDR": str(path),
            "FAKEGPU_CONNECT_TIMEOUT_MS": "1500",
            "FAKEGPU_HELLO_ANSWER_TIMEOUT_MS": "1200",
        })
    finally:
        server.close()
    assert proc.returncode != 0
    assert "unhandled system error" in proc.stderr
    if hang_up:
        assert "closed the connection before answering HELLO" in proc.stderr, proc.stderr
        assert server.accepted >= 2  # tried again while the connect timeout lasted
    else:
        assert ("accepted the connection but did not answer HELLO within 1200 ms (FAKEGPU_HELLO_ANSWER_TIMEOUT_MS)"
                in proc.stderr), proc.stderr
    assert elapsed < 10


def test_coordinator_death_wakes_a_waiting_rank(c_api_test, start_coordinator, tmp_path):
    coordinator = start_coordinator("unix")
    env = dict(os.environ, **coordinator.client_env, RANK="0", WORLD_SIZE="2")
    # Rank 1 never comes: rank 0 waits in ncclCommInitRank until the coordinator goes away.
    proc = subprocess.Popen([str(c_api_test), str(tmp_path / "uid")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    time.sleep(1.5)
    assert proc.poll() is None, "rank 0 should still be waiting for rank 1"
    coordinator.stop()
    t0 = time.monotonic()
    try:
        _, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("rank 0 kept waiting after the coordinator died")
    assert proc.returncode != 0
    assert "ncclCommInitRank" in err and "fakegpu" in err
    assert time.monotonic() - t0 < 10
