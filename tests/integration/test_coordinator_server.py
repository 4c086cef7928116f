"""The real coordinator process over real sockets: listening rules, authentication, shared
memory, connection isolation on bad input, reports on SIGTERM / SHUTDOWN / interval, and
4-byte allreduce latency through the Python client."""
from __future__ import annotations

import json
import mmap
import os
import secrets
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from fakegpu import protocol as P
from fakegpu.coordinator.client import ClientError, SyncClient
from helpers.paths import REPO_ROOT as REPO



class Coordinator:
    """`python -m fakegpu coordinator ARGS` until stopped; `.address` once listening."""

    def __init__(self, *args, env=None, expect_ready=True, timeout_s=30.0):
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH")]))
        for var in [v for v in full_env if v.startswith("FAKEGPU_")]:
            del full_env[var]
        full_env.update(env or {})
        self.proc = subprocess.Popen([sys.executable, "-m", "fakegpu", "coordinator", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=full_env, cwd=str(REPO))
        self.address = None
        self.stderr_lines: list = []
        self._err = threading.Thread(target=self._drain_err, daemon=True)
        self._err.start()
        if expect_ready:
            deadline = time.monotonic() + timeout_s
            line = ""
            while time.monotonic() < deadline:
                line = self.proc.stdout.readline()
                if line.startswith("fakegpu coordinator listening on ") or not line:
                    break
            assert line.startswith("fakegpu coordinator listening on "), self.stderr()
            self.address = line.split(" on ", 1)[1].strip()

    def _drain_err(self):
        for line in self.proc.stderr:
            self.stderr_lines.append(line)

    def stderr(self) -> str:
        self._err.join(0.2)
        return "".join(self.stderr_lines)

    def stop(self, sig=signal.SIGTERM, timeout_s=15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._err.join(2)
        return self.proc.returncode


@pytest.fixture
def coordinator(tmp_path):
    started = []

    def start(*args, **kw):
        c = Coordinator(*args, **kw)
        started.append(c)
        return c

    yield start
    for c in started:
        c.stop()


def world(address, n, token="", **kw):
    clients = [SyncClient(address) for _ in range(n)]
    for i, c in enumerate(clients):
        c.hello(token=token, global_rank=i, **kw)
    uid = secrets.token_bytes(128)
    for i, c in enumerate(clients):
        c.send(P.CommInit(uid, n, i, "world"))
    handles = []
    for c in clients:
        f = c.recv_frame()
        handles.append(P.decode_body(f.msg_type, f.body).comm_handle)
    return clients, handles


_ALLREDUCES: dict = {}   # handles -> calls made on that communicator (the match_seq the shim would use)


def allreduce(clients, handles, values):
    seq = _ALLREDUCES[tuple(handles)] = _ALLREDUCES.get(tuple(handles), 0) + 1
    for c, h, v in zip(clients, handles, values):
        arr = np.asarray(v, np.float32)
        d = P.OpDesc(comm_handle=h, kind=P.KIND_ALLREDUCE, datatype=7, total_count=arr.size,
                     step_count=arr.size, in_len=arr.nbytes, out_len=arr.nbytes, match_seq=seq)
        c.send(P.Group(ops=(d,), payload=arr.tobytes()))
    outs = []
    for c in clients:
        f = c.recv_frame()
        m = P.decode_body(f.msg_type, f.body)
        assert m.results == (0,), m.message
        outs.append(np.frombuffer(m.payload, np.float32))
    return outs


def test_unix_socket_is_private_and_removed(coordinator, tmp_path):
    path = tmp_path / "new-dir" / "c.sock"
    c = coordinator("--transport", "unix", "--address", str(path))
    assert c.address == str(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert c.stop() == 0
    assert not path.exists() and not path.parent.exists()


def test_second_coordinator_on_same_socket_is_refused(coordinator, tmp_path):
    path = str(tmp_path / "c.sock")
    coordinator("--address", path)
    second = coordinator("--address", path, expect_ready=False)
    assert second.proc.wait(30) == 1
    assert "already listening" in second.stderr()


def test_tcp_non_loopback_without_token_is_refused(coordinator):
    c = coordinator("--listen", "0.0.0.0:0", expect_ready=False)
    assert c.proc.wait(30) == 1
    assert "refusing to listen on 0.0.0.0" in c.stderr() and "token" in c.stderr()


def test_tcp_with_token_authenticates(coordinator, tmp_path):
    token_file = tmp_path / "tok"
    token_file.write_text("t0ken\n")
    c = coordinator("--listen", "127.0.0.1:0", "--token-file", str(token_file))
    host, port = c.address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    with SyncClient(c.address, "tcp") as bad:
        with pytest.raises(ClientError, match="authentication failed"):
            bad.hello(token="wrong")
    clients, handles = world(c.address, 2, token="t0ken")
    assert [o.tolist() for o in allreduce(clients, handles, [[1, 2], [3, 4]])] == [[4, 6], [4, 6]]
    assert "authentication failed" in c.stderr() or "wrong or missing token" in c.stderr()


def test_bad_frames_close_only_that_connection(coordinator, tmp_path):
    c = coordinator("--address", str(tmp_path / "c.sock"))
    clients, handles = world(c.address, 2)
    cases = [
        b"JUNK" + bytes(12),
        b"FGPU" + struct.pack("<HHII", 9, P.PING, 1, 0),
        b"FGPU" + struct.pack("<HHII", P.VERSION, 77, 1, 0),
        b"FGPU" + struct.pack("<HHII", P.VERSION, P.PING, 1, 1 << 30),
        P.encode_frame(P.CommInit(bytes(128), 2, 0), 1),   # before HELLO
    ]
    for raw in cases:
        with SyncClient(c.address) as evil:
            evil.send_raw(raw)
            with pytest.raises(ClientError):
                while True:
                    evil.recv_frame(timeout_s=10)
    # Oversize GROUP from an authenticated client.
    with SyncClient(c.address) as evil:
        evil.hello(staging_bytes=4096)
        evil.send_raw(b"FGPU" + struct.pack("<HHII", P.VERSION, P.GROUP, 3, 2 * 4096 + (16 << 20) + 1))
        with pytest.raises(ClientError, match="closed"):
            evil.recv_frame(timeout_s=10)
    assert [o.tolist() for o in allreduce(clients, handles, [[1], [2]])] == [[3], [3]]
    err = c.stderr()
    for reason in ("bad magic", "unsupported protocol version 9", "unknown message type 77",
                   "exceeds the limit", "HELLO must be the first frame"):
        assert reason in err, reason


def test_other_protocol_version_gets_an_error_naming_both_versions(coordinator, tmp_path):
    c = coordinator("--address", str(tmp_path / "c.sock"))
    with SyncClient(c.address) as old:
        old.send_raw(b"FGPU" + struct.pack("<HHII", 1, P.HELLO, 77, 0))
        frame = old.recv_frame(timeout_s=10)
        assert frame.request_id == 77
        err = P.decode_body(frame.msg_type, frame.body)
        assert f"speaks protocol version {P.VERSION}" in err.message and "sent version 1" in err.message
        with pytest.raises(ClientError, match="closed"):
            old.recv_frame(timeout_s=10)


def test_shared_memory_staging(coordinator, tmp_path):
    c = coordinator("--address", str(tmp_path / "c.sock"))
    S = 1 << 16
    name = f"/fakegpu-test-{os.getpid()}-{secrets.token_hex(4)}"
    path = "/dev/shm" + name
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    with open(path, "wb") as fh:
        fh.truncate(2 * S)
    try:
        with open(path, "r+b") as fh:
            mm = mmap.mmap(fh.fileno(), 2 * S)
        region = np.frombuffer(mm, np.uint8)
        client = SyncClient(c.address)
        ok = client.request(P.Hello(flags=P.HELLO_FLAG_SHM, global_rank=0, pid=os.getpid(),
                                    staging_bytes=S, shm_name=name, hostname="h"))
        assert ok.flags & P.HELLO_FLAG_SHM and ok.staging_bytes == S
        os.unlink(path)  # as the shim does: nothing outlives the processes
        info = client.request(P.CommInit(secrets.token_bytes(128), 1, 0))
        region[128:136] = np.frombuffer(np.array([1.25, -2], np.float32).tobytes(), np.uint8)
        d = P.OpDesc(comm_handle=info.comm_handle, kind=P.KIND_ALLREDUCE, datatype=7, total_count=2,
                     step_count=2, in_offset=128, in_len=8, out_offset=64, out_len=8)
        done = client.request(P.Group(ops=(d,)))
        assert done.results == (0,) and done.payload == b""
        assert region[S + 64:S + 72].view(np.float32).tolist() == [1.25, -2]
        client.close()
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_reports_on_sigterm_and_interval(coordinator, tmp_path):
    report = tmp_path / "r.json"
    c = coordinator("--address", str(tmp_path / "c.sock"), "--report", str(report),
                    "--report-interval", "0.3")
    clients, handles = world(c.address, 2)
    allreduce(clients, handles, [[1.0] * 4, [2.0] * 4])
    deadline = time.monotonic() + 20
    while not report.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert report.exists(), c.stderr()
    allreduce(clients, handles, [[1.0] * 4, [2.0] * 4])
    assert c.stop(signal.SIGTERM) == 0
    data = json.loads(report.read_text())
    assert data["world_size"] == 2
    assert report.with_suffix(".md").exists()
    assert "AllReduce" in json.dumps(data)


def test_ping_and_shutdown_cli(coordinator, tmp_path):
    report = tmp_path / "r.json"
    c = coordinator("--address", str(tmp_path / "c.sock"), "--token", "abc", "--report", str(report))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    ping = subprocess.run([sys.executable, "-m", "fakegpu", "coordinator", "--ping", c.address],
                          capture_output=True, text=True, env=env, timeout=60)
    # Without the token: one line, nothing about the coordinator (on main: its pid and counts).
    assert ping.returncode == 1 and ping.stdout == ""
    assert ping.stderr == f"fakegpu coordinator: {c.address} answered: authentication required\n"
    ping = subprocess.run([sys.executable, "-m", "fakegpu", "coordinator", "--ping", c.address, "--token", "abc"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert ping.returncode == 0 and json.loads(ping.stdout)["transport"] == "unix", ping.stderr
    (tmp_path / "tok").write_text(" abc\n")   # the token-file rule: whitespace at both ends is not part of it
    ping = subprocess.run([sys.executable, "-m", "fakegpu", "coordinator", "--ping", c.address,
                           "--token-file", str(tmp_path / "tok")], capture_output=True, text=True, env=env, timeout=60)
    assert ping.returncode == 0 and json.loads(ping.stdout)["clients"] == 0, ping.stderr
    bad = subprocess.run([sys.executable, "-m", "fakegpu", "coordinator", "--shutdown", c.address,
                          "--token", "nope"], capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 1 and c.proc.poll() is None
    good = subprocess.run([sys.executable, "-m", "fakegpu", "coordinator", "--shutdown", c.address,
                           "--token", "abc"], capture_output=True, text=True, env=env, timeout=60)
    assert good.returncode == 0, good.stderr
    assert c.proc.wait(30) == 0
    assert report.exists()


def test_many_small_allreduces_in_a_row(coordinator, tmp_path):
    """200 back-to-back 4-rank 4-byte allreduces through real sockets, each with its own
    inputs: every result exact and the right call's (the latency figure is the shim
    benchmark's job, not a test's)."""
    c = coordinator("--address", str(tmp_path / "c.sock"))
    clients, handles = world(c.address, 4)
    for i in range(200):
        got = allreduce(clients, handles, [[float(i)], [2.0 * i], [3.0], [0.5 * i]])
        assert all(g.tolist() == [3.5 * i + 3.0] for g in got), (i, got)


def test_cluster_config_simulate_and_report(coordinator, tmp_path):
    config = REPO / "cluster_configs" / "dev-2node-2gpu.yaml"
    if not config.exists():
        pytest.skip("cluster config not in this checkout")
    report = tmp_path / "r.json"
    c = coordinator("--address", str(tmp_path / "c.sock"), "--cluster-config", str(config),
                    "--report", str(report), "--markdown-report", str(tmp_path / "r.md"),
                    "--trace", str(tmp_path / "t.json"))
    clients, handles = world(c.address, 4)
    allreduce(clients, handles, [[1.0] * 256] * 4)
    d = P.OpDesc(comm_handle=handles[0], kind=P.KIND_ALLREDUCE, datatype=7, total_count=1 << 20,
                 step_count=1 << 20)
    est = clients[0].request(P.Simulate(ops=(d,)))
    assert isinstance(est, P.SimulateDone) and est.estimated_time_us > 0
    for cl in clients:
        cl.close()
    assert c.stop() == 0
    data = json.loads(report.read_text())
    assert data["world_size"] == 4 and data["topology"]["node_count"] == 2
    assert (tmp_path / "r.md").exists() and (tmp_path / "t.json").exists()


def test_bad_cluster_config_is_a_clear_error(coordinator, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nnodes: nope\n")
    c = coordinator("--address", str(tmp_path / "c.sock"), "--cluster-config", str(bad), expect_ready=False)
    assert c.proc.wait(30) == 2
    assert "bad.yaml" in c.stderr()


def _post_allreduce(c, handle):
    d = P.OpDesc(comm_handle=handle, kind=P.KIND_ALLREDUCE, datatype=7, total_count=1, step_count=1,
                 in_len=4, out_len=4)
    return c.send(P.Group(ops=(d,), payload=np.float32(1).tobytes()))


def test_dead_rank_fails_peers_promptly(coordinator, tmp_path):
    c = coordinator("--address", str(tmp_path / "c.sock"))
    clients, handles = world(c.address, 3)
    t0 = time.monotonic()
    for i in (0, 1):
        _post_allreduce(clients[i], handles[i])
    clients[2].close()  # the process died
    for i in (0, 1):
        f = clients[i].recv_frame(timeout_s=10)
        done = P.decode_body(f.msg_type, f.body)
        assert done.results == (P.NCCL_REMOTE_ERROR,)
        assert "rank 2" in done.message and "disconnected" in done.message
    assert time.monotonic() - t0 < 5


def test_missing_rank_times_out_within_the_timeout(coordinator, tmp_path):
    c = coordinator("--address", str(tmp_path / "c.sock"), "--timeout-ms", "500")
    clients, handles = world(c.address, 3)
    t0 = time.monotonic()
    for i in (0, 1):
        _post_allreduce(clients[i], handles[i])
    for i in (0, 1):
        f = clients[i].recv_frame(timeout_s=10)
        done = P.decode_body(f.msg_type, f.body)
        assert done.results == (P.NCCL_TIMEOUT,)
        assert "ranks [2] did not arrive within 500 ms" in done.message
    elapsed = time.monotonic() - t0
    assert 0.45 < elapsed < 3.0, elapsed
