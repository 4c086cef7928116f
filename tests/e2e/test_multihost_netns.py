"""Multi-host for real: two network namespaces joined by a veth pair play two hosts.

The coordinator listens on host A's address with a token; rank 0 runs on host A and rank 1 on
host B, each under `fgpu --coordinator-addr` (so fgpu's "join a running coordinator" path is
what crosses the hosts). The cluster YAML puts the ranks on two nodes whose `host` fields are
the two addresses, and the report must show the traffic between them.

Needs root, `ip` (iproute2: `apt-get install -y iproute2`) and permission to create network
namespaces; otherwise the tests are skipped with the reason. The namespaces and the veth pair
are always removed afterwards.

Also here: the usage doc's single-host TCP bandwidth command, end to end.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading

import pytest

from fakegpu import launcher
from helpers.paths import REPO_ROOT

pytestmark = pytest.mark.netns

HOST_A = "10.213.7.1"
HOST_B = "10.213.7.2"
PORT = 29591

# One rank: allreduce through the preloaded shim, exact check, result to OUT_DIR/rank<r>.json.
RANK = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    from fakegpu.nccl import Nccl, NcclError
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out_dir = os.environ["OUT_DIR"]
    nccl = Nccl("libnccl.so.2")
    uid = nccl.shared_unique_id(os.path.join(out_dir, "uid"), rank)
    try:
        comm = nccl.comm_init_rank(world, uid, rank)
    except NcclError as exc:
        print("rank %d: init failed: %s" % (rank, exc), file=sys.stderr)
        sys.exit(3)
    count = int(os.environ.get("COUNT", str(1 << 18)))
    iters = int(os.environ.get("ITERS", "4"))
    send = (np.arange(count, dtype=np.float32) % 1013) + rank
    recv = np.empty_like(send)
    for _ in range(iters):
        comm.all_reduce(send, recv, count, send.dtype, "sum")
    expected = 2 * (np.arange(count, dtype=np.float32) % 1013) + sum(range(world))
    exact = bool(np.array_equal(recv, expected))
    comm.destroy()
    json.dump({"exact": exact, "addr": os.environ.get("FAKEGPU_COORDINATOR_ADDR")},
              open(os.path.join(out_dir, "rank%d.json" % rank), "w"))
    sys.exit(0 if exact else 1)
""")

CLUSTER_YAML = textwrap.dedent(f"""
    version: 1
    cluster:
      name: netns-two-hosts
      default_backend: nccl
    nodes:
      - id: host-a
        host: {HOST_A}
        ranks: [0]
        gpus: [{{profile: a100}}]
      - id: host-b
        host: {HOST_B}
        ranks: [1]
        gpus: [{{profile: a100}}]
    fabric:
      intra_node: {{type: nvlink, bandwidth_gbps: 300, latency_us: 3}}
      inter_node: {{type: ethernet, bandwidth_gbps: 25, latency_us: 20}}
""")


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


@pytest.fixture(scope="module")
def two_hosts():
    """(ns_a, ns_b): namespaces with HOST_A / HOST_B on the two ends of one veth pair."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces (CI runs as root)")
    if shutil.which("ip") is None:
        pytest.skip("the `ip` command is missing: apt-get install -y iproute2")
    tag = f"{os.getpid() % 100000}"
    ns_a, ns_b = f"fgpu-a-{tag}", f"fgpu-b-{tag}"
    veth_a, veth_b = f"fgva{tag}", f"fgvb{tag}"  # interface names are limited to 15 characters
    created = []
    try:
        for ns in (ns_a, ns_b):
            done = _ip("netns", "add", ns, check=False)
            if done.returncode != 0:
                pytest.skip(f"cannot create a network namespace here: {done.stderr.strip()}")
            created.append(ns)
        steps = [
            ("link", "add", veth_a, "type", "veth", "peer", "name", veth_b),
            ("link", "set", veth_a, "netns", ns_a),
            ("link", "set", veth_b, "netns", ns_b),
            ("-n", ns_a, "addr", "add", f"{HOST_A}/24", "dev", veth_a),
            ("-n", ns_b, "addr", "add", f"{HOST_B}/24", "dev", veth_b),
            ("-n", ns_a, "link", "set", veth_a, "up"),
            ("-n", ns_b, "link", "set", veth_b, "up"),
            ("-n", ns_a, "link", "set", "lo", "up"),
            ("-n", ns_b, "link", "set", "lo", "up"),
        ]
        for step in steps:
            done = _ip(*step, check=False)
            if done.returncode != 0:
                pytest.skip(f"cannot set up the veth pair (`ip {' '.join(step)}`): {done.stderr.strip()}")
        yield ns_a, ns_b
    finally:
        for ns in created:
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", veth_a, check=False)  # only exists if moving it failed


def _env(shim: str, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGPU_")}
    env["FAKEGPU_NCCL_LIBRARY"] = shim
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


class NetnsCoordinator:
    """`python -m fakegpu coordinator --listen` inside a namespace."""

    def __init__(self, ns: str, address: str, args: list[str], env: dict, timeout_s: float = 120):
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-m", "fakegpu", "coordinator", "--listen", address, *args],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(timeout_s):
            status = self.proc.poll()
            self.stop()
            pytest.fail(f"the coordinator did not start listening within {timeout_s:g} s "
                        f"(exit status {status}):\n" + self.output())

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if launcher.READY_MARKER in line:
                self.ready.set()

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait(self, timeout_s: float) -> int:
        return self.proc.wait(timeout=timeout_s)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def _outputs(procs: list, timeout_s: float, kill_group: bool = False) -> list[str]:
    """Wait for every process (at most ``timeout_s`` each) and return their outputs; one that
    overruns is killed (its whole session with ``kill_group``) and its output says so."""
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=timeout_s)[0])
        except subprocess.TimeoutExpired:
            if kill_group:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
            outputs.append(proc.communicate()[0] + "\n(timed out)")
    return outputs


def _shutdown_from(ns: str, address: str, token, shim_library: str, coordinator) -> None:
    """`coordinator --shutdown` run on host `ns`: the coordinator writes its reports and exits 0."""
    stop = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-m", "fakegpu", "coordinator",
                           "--shutdown", address, "--token-file", str(token)],
                          env=_env(shim_library), capture_output=True, text=True, timeout=60)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert coordinator.wait(60) == 0, coordinator.output()


def _node_pair(report: dict, a: str, b: str) -> dict:
    """The report's node_pairs entry for nodes a and b."""
    for pair in report["node_pairs"]:
        if sorted(pair["nodes"]) == sorted([a, b]):
            return pair
    raise AssertionError(f"no node pair {a} <-> {b} in the report: {report['node_pairs']}")


def test_two_hosts_allreduce_over_tcp(two_hosts, shim_library, tmp_path):
    ns_a, ns_b = two_hosts
    token = tmp_path / "token"
    launcher.write_token_file(token)
    (tmp_path / "cluster.yaml").write_text(CLUSTER_YAML)
    (tmp_path / "rank.py").write_text(RANK)
    (tmp_path / "out").mkdir()
    report, markdown = tmp_path / "cluster.json", tmp_path / "cluster.md"
    address = f"{HOST_A}:{PORT}"
    coordinator = NetnsCoordinator(ns_a, address, [
        "--token-file", str(token), "--cluster-config", str(tmp_path / "cluster.yaml"),
        "--report", str(report), "--markdown-report", str(markdown), "--timeout-ms", "60000"],
        _env(shim_library))
    try:
        ranks = []
        for rank, ns in enumerate((ns_a, ns_b)):
            ranks.append(subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, "-m", "fakegpu", "run", "-q",
                 "--coordinator-addr", address, "--token-file", str(token), "--",
                 sys.executable, str(tmp_path / "rank.py")],
                env=_env(shim_library, RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", OUT_DIR=str(tmp_path / "out")),
                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = _outputs(ranks, 180)
        for rank, proc in enumerate(ranks):
            assert proc.returncode == 0, f"rank {rank} failed:\n{outputs[rank]}\n--- coordinator ---\n{coordinator.output()}"
            result = json.loads((tmp_path / "out" / f"rank{rank}.json").read_text())
            assert result["exact"] and result["addr"] == address

        # Host B stops the coordinator on host A; the coordinator writes the reports and exits.
        _shutdown_from(ns_b, address, token, shim_library, coordinator)
    finally:
        coordinator.stop()

    data = json.loads(report.read_text())
    assert markdown.is_file()
    if (REPO_ROOT / "fakegpu" / "cli" / "report.py").exists():
        check = subprocess.run([sys.executable, "-m", "fakegpu", "report", "check", str(report),
                                "--expect-world-size", "2", "--expect-node-count", "2",
                                "--expect-collective", "AllReduce"],
                               env=_env(shim_library), capture_output=True, text=True, timeout=120)
        assert check.returncode == 0, check.stdout + check.stderr
    # 4 allreduces of 1 MiB (2**18 float32) between two single-rank nodes: in a 2-rank ring each
    # rank sends 2(n-1)/n = 1 times the payload per call, so each direction carries exactly 4 MiB.
    payload = (1 << 18) * 4
    pair = _node_pair(data, "host-a", "host-b")
    assert sorted(pair["hosts"]) == sorted([HOST_A, HOST_B])
    assert pair["directions"] == {"host-a->host-b": 4 * payload, "host-b->host-a": 4 * payload}
    assert pair["by_operation"]["AllReduce"]["operations"] == 4
    assert data["links"]["inter_node"]["bytes"] == 8 * payload
    assert data["links"]["intra_node"]["bytes"] == 0
    by_rank = {entry["rank"]: entry for entry in data["ranks"]}
    assert by_rank[0]["node"] == "host-a" and by_rank[1]["node"] == "host-b"
    assert {by_rank[r]["transport"] for r in (0, 1)} == {"tcp"}
    assert data["totals"]["socket_bytes"] > 0  # TCP: payloads travel in the socket stream
    text = markdown.read_text()
    assert "host-a" in text and "host-b" in text


def test_wrong_token_from_the_other_host_is_refused(two_hosts, shim_library, tmp_path):
    ns_a, ns_b = two_hosts
    good, bad = tmp_path / "good", tmp_path / "bad"
    launcher.write_token_file(good)
    launcher.write_token_file(bad)
    (tmp_path / "rank.py").write_text(RANK)
    (tmp_path / "out").mkdir()
    address = f"{HOST_A}:{PORT + 1}"
    coordinator = NetnsCoordinator(ns_a, address, ["--token-file", str(good), "--timeout-ms", "5000"],
                                   _env(shim_library))
    try:
        env = _env(shim_library, RANK="0", WORLD_SIZE="1", OUT_DIR=str(tmp_path / "out"),
                   FAKEGPU_COORDINATOR_TRANSPORT="tcp", FAKEGPU_COORDINATOR_ADDR=address,
                   FAKEGPU_COORDINATOR_TOKEN_FILE=str(bad), LD_PRELOAD=shim_library)
        done = subprocess.run(["ip", "netns", "exec", ns_b, sys.executable, str(tmp_path / "rank.py")],
                              env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode != 0
        assert "authentication" in (done.stdout + done.stderr).lower(), done.stdout + done.stderr
        assert coordinator.proc.poll() is None, "a bad token must not bring the coordinator down"
        ping = subprocess.run(["ip", "netns", "exec", ns_b, sys.executable, "-m", "fakegpu", "coordinator",
                               "--ping", address, "--token-file", str(good)],
                              env=_env(shim_library), capture_output=True, text=True, timeout=60)
        assert ping.returncode == 0, ping.stdout + ping.stderr
    finally:
        coordinator.stop()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.skipif(not (REPO_ROOT / "fakegpu" / "cli" / "bandwidth.py").exists(),
                    reason="the bandwidth command (fakegpu/cli/bandwidth.py) is not in this tree")
def test_usage_doc_single_host_tcp_bandwidth(shim_library, tmp_path):
    """The usage doc's command, with a free port and paths under tmp_path."""
    port = _free_port()
    out_json, cluster = tmp_path / "fakegpu-bandwidth.json", tmp_path / "fakegpu-cluster.json"
    done = subprocess.run(
        [sys.executable, "-m", "fakegpu", "bandwidth", "--listen", f"127.0.0.1:{port}", "--nodes", "2",
         "--ranks-per-node", "1", "--size", "4MiB", "--warmup", "2", "--iterations", "10",
         "--json", str(out_json), "--cluster-report", str(cluster)],
        env=_env(shim_library), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out_json.read_text())
    assert result["transport"] == "tcp" and result["world_size"] == 2
    (row,) = result["rows"]
    assert row["size"] == 4 << 20
    for placement in ("out_of_place", "in_place"):
        assert row[placement]["wrong"] == 0 and row[placement]["algbw"] > 0
    report = json.loads(cluster.read_text())
    assert report["topology"]["node_count"] == 2
    pair = _node_pair(report, "node0", "node1")
    # 2 warmup + 10 timed 4 MiB allreduces, out of place and in place, each direction 4 MiB per call.
    assert pair["by_operation"]["AllReduce"]["operations"] >= 24
    assert min(pair["directions"].values()) >= 24 * (4 << 20)
    if (REPO_ROOT / "fakegpu" / "cli" / "report.py").exists():
        check = subprocess.run([sys.executable, "-m", "fakegpu", "report", "check", str(cluster),
                                "--expect-world-size", "2"],
                               env=_env(shim_library), capture_output=True, text=True, timeout=120)
        assert check.returncode == 0, check.stdout + check.stderr


def test_usage_doc_two_host_bandwidth(two_hosts, shim_library, tmp_path):
    """The usage doc's two-host bandwidth flow: a coordinator on host A (all interfaces, with a
    token), `bandwidth --connect` on each host with one --session, then `--shutdown`."""
    ns_a, ns_b = two_hosts
    token = tmp_path / "token"
    launcher.write_token_file(token)
    (tmp_path / "cluster.yaml").write_text(CLUSTER_YAML)
    report = tmp_path / "cluster.json"
    coordinator = NetnsCoordinator(ns_a, f"0.0.0.0:{PORT + 2}", [
        "--token-file", str(token), "--cluster-config", str(tmp_path / "cluster.yaml"), "--report", str(report),
        "--timeout-ms", "60000"], _env(shim_library))
    address = f"{HOST_A}:{PORT + 2}"
    try:
        hosts = []
        for rank, ns in enumerate((ns_a, ns_b)):
            hosts.append(subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, "-m", "fakegpu", "bandwidth", "--connect", address,
                 "--token-file", str(token), "--world-size", "2", "--ranks", str(rank), "--session", "netns-test",
                 "--size", "1MiB", "--warmup", "1", "--iterations", "3", "--json", str(tmp_path / f"bw{rank}.json")],
                env=_env(shim_library), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = _outputs(hosts, 240)
        for rank, proc in enumerate(hosts):
            assert proc.returncode == 0, f"host {rank}:\n{outputs[rank]}\n--- coordinator ---\n{coordinator.output()}"
        _shutdown_from(ns_b, address, token, shim_library, coordinator)
    finally:
        coordinator.stop()
    for rank in range(2):
        result = json.loads((tmp_path / f"bw{rank}.json").read_text())
        assert result["transport"] == "tcp"
        assert all(row[p]["wrong"] == 0 for row in result["rows"] for p in ("out_of_place", "in_place"))
    pair = _node_pair(json.loads(report.read_text()), "host-a", "host-b")
    # (1 warmup + 3 timed) x (out of place + in place) allreduces of 1 MiB, 1 MiB each way per call.
    assert min(pair["directions"].values()) >= 8 * (1 << 20)


TORCH_TRAIN = textwrap.dedent("""
    import json, os
    import torch
    import torch.distributed as dist
    dist.init_process_group("fakegpu")   # no fakegpu import: fgpu's autoload registers the backend
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.arange(4096, dtype=torch.float32) + rank
    dist.all_reduce(t)
    ok = torch.equal(t, 2 * torch.arange(4096, dtype=torch.float32) + 1)
    dist.destroy_process_group()
    json.dump({"ok": bool(ok)}, open(os.path.join(os.environ["OUT_DIR"], "torch%d.json" % rank), "w"))
""")


@pytest.mark.torch
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_usage_doc_two_host_torchrun(two_hosts, shim_library, tmp_path):
    """The usage doc's two-host torchrun example: one coordinator on host A, `fgpu
    --coordinator-addr ... -- torchrun --nnodes 2 --node-rank N` on each host."""
    ns_a, ns_b = two_hosts
    token = tmp_path / "token"
    launcher.write_token_file(token)
    (tmp_path / "cluster.yaml").write_text(CLUSTER_YAML)
    (tmp_path / "train.py").write_text(TORCH_TRAIN)
    (tmp_path / "out").mkdir()
    report = tmp_path / "cluster.json"
    address = f"{HOST_A}:{PORT + 3}"
    coordinator = NetnsCoordinator(ns_a, address, [
        "--token-file", str(token), "--cluster-config", str(tmp_path / "cluster.yaml"), "--report", str(report),
        "--timeout-ms", "120000"], _env(shim_library))
    try:
        hosts = []
        for node_rank, ns in enumerate((ns_a, ns_b)):
            hosts.append(subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, "-m", "fakegpu", "run", "-q",
                 "--coordinator-addr", address, "--token-file", str(token), "--",
                 sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                 "--node-rank", str(node_rank), "--master-addr", HOST_A, "--master-port", str(PORT + 4),
                 "--max-restarts", "0", "train.py"],
                env=_env(shim_library, OUT_DIR=str(tmp_path / "out")), cwd=tmp_path,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True))
        outputs = _outputs(hosts, 300, kill_group=True)
        for node_rank, proc in enumerate(hosts):
            assert proc.returncode == 0, f"host {node_rank}:\n{outputs[node_rank][-4000:]}"
        _shutdown_from(ns_a, address, token, shim_library, coordinator)
    finally:
        coordinator.stop()
    for rank in range(2):
        assert json.loads((tmp_path / "out" / f"torch{rank}.json").read_text()) == {"ok": True}
    data = json.loads(report.read_text())
    pair = _node_pair(data, "host-a", "host-b")
    assert pair["by_operation"]["AllReduce"]["operations"] >= 1
    assert min(pair["directions"].values()) >= 4096 * 4
