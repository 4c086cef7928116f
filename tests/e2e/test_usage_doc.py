"""Every command block of the usage document (the user contract, distributed-sim-usage.md), run
as the document writes it, from the checkout's root, against the build tree its own build block
makes.

The blocks are kept below verbatim. `adapt()` changes only what the document leaves to the
reader, each change listed in ADAPTATIONS: host names (coordinator-host, gpu-a, 0.0.0.0 and
100.x.y.z become this machine's loopback or the two network-namespace hosts), ports (free ones
instead of 29591/29592/29500), the document's `test/` folder (ours is `verification/`, as
docs/usage.md maps it), and the placeholders `...` and `your_training_script.py`. There is no GPU
here: commands that need one run in their documented CPU form, which the command itself says
(FAKEGPU_MODE=hybrid becomes simulate for the physical-host worker; the numerics runners pick
their CPU form themselves and print so); each such test asserts that line. The SSH controller
reaches its two hosts through `--ssh-command` (a namespace runner instead of sshd), with a stand-in
`wsl.exe` for the `shell=wsl` node.

Long blocks are marked slow; the namespace blocks need root (skipped, saying why, otherwise).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from helpers.torchrun import TORCH_UNDER_FGPU
from test_multihost_netns import HOST_A, HOST_B, two_hosts  # noqa: F401  (namespace "hosts" fixture)
from test_physical_multihost import clone  # noqa: F401  (a clean clone of HEAD with a shim build)
from helpers.paths import REPO_ROOT as REPO

NEEDS_TORCH = TORCH_UNDER_FGPU

# ---------------------------------------------------------------------------------------------
# The document's blocks, verbatim.

MODE_PAIR = """\
FAKEGPU_MODE=simulate
FAKEGPU_DIST_MODE=simulate
"""

BUILD = """\
cmake -S . -B build
cmake --build build -j4
"""

FGPU_FLAGS = """\
./fgpu --mode simulate --dist-mode simulate --cluster-config ... --coordinator-transport unix --coordinator-addr ...
"""

BANDWIDTH_ONE_HOST = """\
python3 -m fakegpu bandwidth \\
  --listen 127.0.0.1:29591 \\
  --nodes 2 \\
  --ranks-per-node 1 \\
  --size 4MiB \\
  --warmup 2 \\
  --iterations 10 \\
  --json /tmp/fakegpu-bandwidth.json \\
  --cluster-report /tmp/fakegpu-cluster.json
"""

COORDINATOR_TWO_HOSTS = """\
python3 -m fakegpu coordinator \\
  --listen 0.0.0.0:29591 \\
  --cluster-config verification/data/cluster_tcp_2r.yaml \\
  --report /tmp/fakegpu-cluster.json \\
  --markdown-report /tmp/fakegpu-project-communication.md
"""

BANDWIDTH_HOSTS = """\
# host A
python3 -m fakegpu bandwidth \\
  --connect coordinator-host:29591 \\
  --world-size 2 \\
  --ranks 0 \\
  --session test-2026-07-20 \\
  --size 16MiB

# host B
python3 -m fakegpu bandwidth \\
  --connect coordinator-host:29591 \\
  --world-size 2 \\
  --ranks 1 \\
  --session test-2026-07-20 \\
  --size 16MiB
"""

SHUTDOWN = """\
python3 -m fakegpu coordinator --shutdown coordinator-host:29591
"""

PHYSICAL_DDP = """\
export NODE_RANK=0
export COORDINATOR_HOST=coordinator-host
export FAKEGPU_MODE=hybrid
export FAKEGPU_DEVICE_COUNT=1
export FAKEGPU_DIST_MODE=simulate
export FAKEGPU_CLUSTER_CONFIG="$PWD/verification/data/cluster_tcp_2r.yaml"
export FAKEGPU_COORDINATOR_TRANSPORT=tcp
export FAKEGPU_COORDINATOR_ADDR="${COORDINATOR_HOST}:29591"
export FAKEGPU_COORDINATOR_TIMEOUT_MS=60000

LD_PRELOAD="$PWD/build/libnccl.so.2" \\
python3 -m torch.distributed.run \\
  --nnodes=2 \\
  --nproc-per-node=1 \\
  --node-rank="$NODE_RANK" \\
  --master-addr="$COORDINATOR_HOST" \\
  --master-port=29592 \\
  --max-restarts=0 \\
  test/test_ddp_hybrid_numerics.py \\
  --report-dir="/tmp/fakegpu-cross-ddp-rank${NODE_RANK}"
"""

CONTROLLER = """\
python3 verification/run_physical_multihost.py \\
  --node 'name=blackwell;ssh=gpu-a;repo=/home/user/repos/fakeGPU;python=/opt/fakegpu/bin/python;shell=posix' \\
  --node 'name=ampere-wsl;ssh=user@gpu-b;repo=/home/user/repos/fakeGPU;python=/opt/torch/bin/python;shell=wsl' \\
  --coordinator-host 100.x.y.z
"""

MINIMAL_CONFIG = """\
version: 1
cluster:
  name: dev-cluster
  default_backend: nccl

nodes:
  - id: node0
    host: 127.0.0.1
    ranks: [0, 1]
    gpus:
      - profile: a100
      - profile: a100

  - id: node1
    host: 127.0.0.1
    ranks: [2, 3]
    gpus:
      - profile: h100
      - profile: h100

fabric:
  intra_node:
    type: nvlink
    bandwidth_gbps: 300
    latency_us: 3

  inter_node:
    type: infiniband
    bandwidth_gbps: 200
    latency_us: 15
    oversubscription: 1.5
"""

MAINTAINED_CHECKS = """\
python3 verification/test_coordinator_smoke.py
python3 test/test_allreduce_correctness.py
python3 verification/test_allgather_correctness.py
python3 verification/test_group_semantics.py
./ftest tcp_bandwidth
./test/run_hybrid_multinode.sh 2
python3 verification/run_hybrid_ddp_numerics.py --variant all
python3 verification/run_hybrid_fsdp_numerics.py
python3 verification/run_hybrid_fsdp2_numerics.py --world-size 4 --precision bf16
python3 verification/run_hybrid_fsdp2_numerics.py --world-size 4 --precision bf16 --reduce-precision parameter
"""

# The "Recommended order" list and the text name these too (inline code, not blocks).
INLINE_COMMANDS = """\
./test/run_multinode_sim.sh 2
./test/run_multinode_sim.sh 4
./test/run_ddp_multinode.sh 4
./ftest distributed_resilience
"""

COORDINATOR_UNIX = """\
SOCKET_PATH=/tmp/fakegpu-coordinator.sock
CLUSTER_CONFIG=$PWD/verification/data/cluster_valid.yaml

FAKEGPU_DIST_MODE=simulate \\
FAKEGPU_CLUSTER_CONFIG="$CLUSTER_CONFIG" \\
FAKEGPU_COORDINATOR_TRANSPORT=unix \\
FAKEGPU_COORDINATOR_ADDR="$SOCKET_PATH" \\
FAKEGPU_CLUSTER_REPORT_PATH=/tmp/fakegpu-cluster-report.json \\
FAKEGPU_CLUSTER_REPORT_MARKDOWN_PATH=/tmp/fakegpu-project-communication.md \\
./build/fakegpu-coordinator --transport unix --address "$SOCKET_PATH"
"""

COORDINATOR_TCP = """\
COORD_ADDR=127.0.0.1:29591
CLUSTER_CONFIG=$PWD/verification/data/cluster_valid.yaml

FAKEGPU_DIST_MODE=simulate \\
FAKEGPU_CLUSTER_CONFIG="$CLUSTER_CONFIG" \\
FAKEGPU_COORDINATOR_TRANSPORT=tcp \\
FAKEGPU_COORDINATOR_ADDR="$COORD_ADDR" \\
FAKEGPU_CLUSTER_REPORT_PATH=/tmp/fakegpu-cluster-report.json \\
FAKEGPU_CLUSTER_REPORT_MARKDOWN_PATH=/tmp/fakegpu-project-communication.md \\
./build/fakegpu-coordinator --transport tcp --address "$COORD_ADDR"
"""

TORCHRUN_TEMPLATE = """\
SOCKET_PATH=/tmp/fakegpu-coordinator.sock
CLUSTER_CONFIG=$PWD/verification/data/cluster_valid.yaml

export LD_PRELOAD="$PWD/build/libnccl.so.2${LD_PRELOAD:+:$LD_PRELOAD}"

./fgpu \\
  --mode simulate \\
  --dist-mode simulate \\
  --cluster-config "$CLUSTER_CONFIG" \\
  --coordinator-transport unix \\
  --coordinator-addr "$SOCKET_PATH" \\
  --device-count 4 \\
  torchrun \\
  --nnodes=1 \\
  --nproc_per_node=4 \\
  --master_addr 127.0.0.1 \\
  --master_port 29500 \\
  your_training_script.py
"""

# What the document leaves to the reader, and nothing else.
ADAPTATIONS = """\
ports 29591, 29592, 29500   -> free ports of this machine
coordinator-host, 0.0.0.0   -> 127.0.0.1 (one machine plays every host), or host A's address
gpu-a, user@gpu-b, 100.x.y.z -> the two network-namespace hosts and host A
/home/user/repos/fakeGPU, /opt/*/bin/python -> a clean clone of this checkout, this interpreter
test/NAME                   -> verification/NAME (docs/usage.md maps the document's test/ folder)
--cluster-config ... --coordinator-addr ... -> a bundled config and a socket, plus `-- COMMAND`
your_training_script.py     -> a GPU-style script written for the test
FAKEGPU_MODE=hybrid         -> simulate (no GPU: the worker's documented CPU form)
SSH to the hosts            -> --ssh-command NETNS-RUNNER and --timeout-ms 5000 added (no sshd; the
                               missing-peer case waits one timeout, 60 s by default)
"""


# ---------------------------------------------------------------------------------------------
# Running blocks


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def ports():
    return {"29591": str(_free_port()), "29592": str(_free_port()), "29500": str(_free_port())}


def adapt(block: str, ports: dict) -> str:
    """The block with free ports and the document's test/ folder mapped to verification/; the
    tests below replace host names and placeholders themselves, in plain sight."""
    text = block
    for doc_port, port in ports.items():
        text = re.sub(rf"\b{doc_port}\b", port, text)
    return re.sub(r"(?<![\w/.])(\./)?test/", lambda m: f"{m.group(1) or ''}verification/", text)


def block_env() -> dict:
    """The reader's shell: this interpreter first on PATH as python3; nothing of fakegpu's set,
    so every command finds the shim the build block made (build/libnccl.so.2)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("FAKEGPU_") and k not in ("LD_PRELOAD", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


def run_block(text: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(["bash", "-e", "-c", text], cwd=str(REPO), env=env or block_env(),
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"block failed ({done.returncode}):\n{text}\n--- stdout\n" \
                                 f"{done.stdout[-5000:]}\n--- stderr\n{done.stderr[-5000:]}"
    return done


class Background:
    """A block that runs until stopped (a coordinator), started and waited for like a reader would."""

    def __init__(self, text: str, ready: str = "listening on", env: dict | None = None, timeout: float = 60):
        self.proc = subprocess.Popen(["bash", "-e", "-c", text], cwd=str(REPO), env=env or block_env(),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        seen = threading.Event()

        def pump():
            for line in self.proc.stdout:
                self.lines.append(line)
                if ready in line:
                    seen.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not seen.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"never printed {ready!r}:\n{text}\n{self.output}")

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def stop(self, sig=signal.SIGINT) -> int:
        """Ctrl-C, as in a terminal (the coordinator writes its reports)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode

    def wait(self, timeout: float = 120) -> int:
        return self.proc.wait(timeout)


@pytest.fixture(scope="module")
def built():
    """The document's build block, run first: everything after it uses the build tree."""
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed")
    done = run_block(BUILD, timeout=1200)
    assert (REPO / "build" / "libnccl.so.2").is_file() and os.access(REPO / "build" / "fakegpu-coordinator", os.X_OK)
    return done


def _report(path: str) -> dict:
    return json.loads(Path(path).read_text())


# ---------------------------------------------------------------------------------------------
# Set-up and launch styles


def test_recommended_mode_pair_is_valid_shell():
    run_block(MODE_PAIR)


def test_build_block_makes_the_shim_coordinator_launcher_and_fgpu_runs_from_it(built, ports):
    ping = run_block("./build/fakegpu-coordinator --help && ./fgpu --list-cluster-configs")
    assert "cluster_valid.yaml" in ping.stdout and "cluster_tcp_2r.yaml" in ping.stdout


def test_fgpu_flags_line_and_python_module_are_the_same_launch(built, ports, tmp_path):
    sock = tmp_path / "c.sock"
    filled = FGPU_FLAGS.replace("--cluster-config ...", "--cluster-config cluster_valid.yaml") \
                       .replace("--coordinator-addr ...", f"--coordinator-addr {sock}").rstrip("\n")
    probe = ("-- python3 -c \"import os; print(os.environ['FAKEGPU_MODE'], os.environ['FAKEGPU_DIST_MODE'], "
             "os.environ['FAKEGPU_COORDINATOR_ADDR'], os.path.basename(os.environ['FAKEGPU_CLUSTER_CONFIG']))\"")
    want = f"simulate simulate {sock} cluster_valid.yaml"
    fgpu = run_block(f"{filled} {probe}")
    module = run_block(f"{filled.replace('./fgpu', 'python3 -m fakegpu')} {probe}")
    assert want in fgpu.stdout and want in module.stdout
    # The minimal config's NVLink figure draws the units warning before the command runs.
    assert "gigabits per second" in fgpu.stderr, fgpu.stderr


def test_minimal_cluster_config_is_the_bundled_cluster_valid_yaml():
    from fakegpu.topology import load_cluster_config

    shipped = (REPO / "verification" / "data" / "cluster_valid.yaml").read_text()
    body = "\n".join(line for line in shipped.splitlines() if not line.startswith("#")).strip()
    assert body == MINIMAL_CONFIG.strip()
    topology = load_cluster_config(str(REPO / "verification" / "data" / "cluster_valid.yaml"))
    assert topology.world_size == 4 and len(topology.nodes) == 2 and topology.warnings


def test_passthrough_pair_is_accepted(built):
    done = run_block("FAKEGPU_MODE=passthrough FAKEGPU_DIST_MODE=passthrough ./fgpu -q -- "
                     "python3 -c \"import os; print(os.environ['FAKEGPU_MODE'], os.environ['FAKEGPU_DIST_MODE'])\"")
    assert "passthrough passthrough" in done.stdout


# ---------------------------------------------------------------------------------------------
# TCP bandwidth: one host, then two "hosts" (two concurrent commands) and a separate coordinator


def test_single_host_tcp_bandwidth(built, ports):
    done = run_block(adapt(BANDWIDTH_ONE_HOST, ports), timeout=300)
    assert re.search(r"\[3, 3, 3\] on all 2 ranks", done.stdout), done.stdout
    assert "Gbit/s" in done.stdout and "(GB/s)" in done.stdout
    report = _report("/tmp/fakegpu-cluster.json")
    assert report["world_size"] == 2 and report["topology"]["node_count"] == 2
    assert json.loads(Path("/tmp/fakegpu-bandwidth.json").read_text())["rows"][0]["size"] == 4 << 20


def test_separate_coordinator_two_rank_commands_and_shutdown(built, ports):
    coordinator = Background(adapt(COORDINATOR_TWO_HOSTS, ports).replace("0.0.0.0", "127.0.0.1"))
    try:
        hosts = adapt(BANDWIDTH_HOSTS, ports).replace("coordinator-host", "127.0.0.1")
        host_a, host_b = hosts.split("# host B")
        procs = [subprocess.Popen(["bash", "-e", "-c", h], cwd=str(REPO), env=block_env(),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for h in (host_a, host_b)]
        outputs = [p.communicate(timeout=600)[0] for p in procs]
        for p, out in zip(procs, outputs):
            assert p.returncode == 0, out
            assert "[3, 3, 3] on all 2 ranks" in out, out
        run_block(adapt(SHUTDOWN, ports).replace("coordinator-host", "127.0.0.1"))
        assert coordinator.wait(60) == 0, coordinator.output
    finally:
        coordinator.stop()
    report = _report("/tmp/fakegpu-cluster.json")
    pair = report["node_pairs"][0]
    assert report["world_size"] == 2 and all(v > 0 for v in pair["directions"].values())
    assert all(r["timeouts"] == 0 for r in report["ranks"])
    assert Path("/tmp/fakegpu-project-communication.md").read_text().strip()


@pytest.mark.slow
@pytest.mark.parametrize("_", [pytest.param(None, marks=NEEDS_TORCH)])
def test_physical_host_ddp_worker_on_two_node_ranks(built, ports, _):
    """The document's per-host block, run twice at once (NODE_RANK=0 and 1) on this machine; its
    CPU form: FAKEGPU_MODE=simulate, and the worker says it uses CPU tensors."""
    coordinator = Background(adapt(COORDINATOR_TWO_HOSTS, ports).replace("0.0.0.0", "127.0.0.1"))
    try:
        block = adapt(PHYSICAL_DDP, ports).replace("COORDINATOR_HOST=coordinator-host", "COORDINATOR_HOST=127.0.0.1") \
                                         .replace("FAKEGPU_MODE=hybrid", "FAKEGPU_MODE=simulate")
        procs = [subprocess.Popen(["bash", "-e", "-c", block.replace("NODE_RANK=0", f"NODE_RANK={r}")],
                                  cwd=str(REPO), env=block_env(), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
        outputs = [p.communicate(timeout=900)[0] for p in procs]
        for p, out in zip(procs, outputs):
            assert p.returncode == 0, out[-6000:]
            assert "no CUDA device visible to torch: CPU tensors" in out
    finally:
        run_block(adapt(SHUTDOWN, ports).replace("coordinator-host", "127.0.0.1"))
        coordinator.stop()
    for r in (0, 1):
        doc = json.loads(Path(f"/tmp/fakegpu-cross-ddp-rank{r}/rank{r}.json").read_text())
        assert doc["ok"] and {"ddp_all", "fsdp1", "fsdp2_bf16_param"} <= set(doc["cases"]), doc
    report = _report("/tmp/fakegpu-cluster.json")
    assert report["world_size"] == 2 and report["node_pairs"][0]["total_bytes"] > 0


# ---------------------------------------------------------------------------------------------
# The SSH controller, on two network-namespace hosts


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.parametrize("_", [pytest.param(None, marks=NEEDS_TORCH)])
def test_physical_multihost_controller(two_hosts, clone, tmp_path, _):  # noqa: F811
    ns_a, ns_b = two_hosts
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # What `ssh DEST CMD` does, for the two namespace "hosts" named by their addresses.
    (bin_dir / "netns-ssh").write_text(textwrap.dedent(f"""\
        #!/bin/sh
        dest=${{1#*@}}; shift
        case "$dest" in {HOST_A}) ns={ns_a} ;; {HOST_B}) ns={ns_b} ;; *) echo "netns-ssh: unknown host $dest" >&2; exit 255 ;; esac
        exec ip netns exec "$ns" sh -c "$*"
        """))
    # shell=wsl: the controller hands its script to `wsl.exe -e bash -c SCRIPT`.
    (bin_dir / "wsl.exe").write_text('#!/bin/sh\n[ "$1" = -e ] && shift\nexec "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    block = CONTROLLER.replace("ssh=gpu-a", f"ssh={HOST_A}").replace("ssh=user@gpu-b", f"ssh=user@{HOST_B}") \
                      .replace("/home/user/repos/fakeGPU", str(clone)) \
                      .replace("/opt/fakegpu/bin/python", sys.executable).replace("/opt/torch/bin/python", sys.executable) \
                      .replace("100.x.y.z", HOST_A)
    block = block.rstrip("\n") + f" \\\n  --ssh-command {bin_dir / 'netns-ssh'} --timeout-ms 5000\n"
    env = block_env()
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    done = subprocess.run(["ip", "netns", "exec", ns_a, "bash", "-e", "-c", block], cwd=str(REPO), env=env,
                          capture_output=True, text=True, timeout=1500)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-6000:]
    assert text.count("no CUDA device: CPU form") == 2
    out = Path(re.search(r"results in (\S+)", text).group(1))
    assert out.parent == REPO / "build" / "physical_multihost_validation"
    for name in ("preflight.json", "rank0.json", "rank1.json", "cluster-report.json", "cluster-report.md",
                 "node-pairs.json", "failures.json", "summary.md"):
        assert (out / name).is_file(), name
    failures = json.loads((out / "failures.json").read_text())
    assert failures["cases"]["missing_peer"]["rank1"]["error"]["name"] == "ncclTimeout"
    shutil.rmtree(out)


# ---------------------------------------------------------------------------------------------
# The maintained checks, line by line; then the manual coordinator and torchrun template

CHECK_LINES = [line for line in MAINTAINED_CHECKS.splitlines() if line.strip()]
INLINE_LINES = [line for line in INLINE_COMMANDS.splitlines() if line.strip()]
QUICK = {"python3 verification/test_coordinator_smoke.py"}
TORCH_LINES = ("hybrid", "multinode")


def _marks(line: str):
    marks = [] if line in QUICK else [pytest.mark.slow]
    if any(word in line for word in TORCH_LINES):
        marks += NEEDS_TORCH
    return marks


@pytest.mark.parametrize("line", [pytest.param(line, marks=_marks(line), id=line)
                                  for line in CHECK_LINES + INLINE_LINES])
def test_maintained_check(built, ports, line):
    done = run_block(adapt(line, ports), timeout=1500)
    text = done.stdout + done.stderr
    if "numerics" in line or "hybrid_multinode" in line:
        assert "no CUDA device visible to torch" in text and "CPU form" in text, text[-3000:]


@pytest.mark.parametrize("_", [pytest.param(None, marks=NEEDS_TORCH)])
def test_manual_unix_coordinator_with_the_torchrun_template(built, ports, tmp_path, _):
    script = tmp_path / "your_training_script.py"
    script.write_text(textwrap.dedent("""\
        # A GPU training step as written for a cluster: "cuda", backend nccl.
        import os
        import torch
        import torch.distributed as dist
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
        t = torch.full((3,), float(dist.get_rank() + 1), device="cuda")
        dist.all_reduce(t)
        assert t.tolist() == [10.0, 10.0, 10.0], t
        print(f"rank {dist.get_rank()}: all-reduce sample {t.tolist()}")
        dist.destroy_process_group()
        """))
    for stale in ("/tmp/fakegpu-cluster-report.json",):
        Path(stale).unlink(missing_ok=True)
    coordinator = Background(adapt(COORDINATOR_UNIX, ports))
    try:
        assert "gigabits per second" in coordinator.output   # the units warning, at start
        done = run_block(adapt(TORCHRUN_TEMPLATE, ports).replace("your_training_script.py", str(script)),
                         timeout=600)
        assert done.stdout.count("all-reduce sample [10.0, 10.0, 10.0]") == 4, done.stdout + done.stderr
    finally:
        assert coordinator.stop() == 0, coordinator.output
    report = _report("/tmp/fakegpu-cluster-report.json")
    assert report["world_size"] == 4 and report["topology"]["node_count"] == 2
    run_block("python3 verification/check_cluster_report.py /tmp/fakegpu-cluster-report.json "
              "--expect-world-size 4 --expect-collective AllReduce")


def test_manual_tcp_coordinator(built, ports):
    Path("/tmp/fakegpu-cluster-report.json").unlink(missing_ok=True)
    coordinator = Background(adapt(COORDINATOR_TCP, ports))
    try:
        run_block(f"python3 -m fakegpu coordinator --ping 127.0.0.1:{ports['29591']}")
    finally:
        assert coordinator.stop() == 0, coordinator.output
    assert _report("/tmp/fakegpu-cluster-report.json")["metadata"]["coordinator"]["transport"] == "tcp"


def test_passthrough_compute_with_simulated_communication_is_refused_naming_the_variable(built):
    done = subprocess.run(["bash", "-c", "FAKEGPU_MODE=passthrough FAKEGPU_DIST_MODE=simulate ./fgpu -- true"],
                          cwd=str(REPO), env=block_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "FAKEGPU_MODE passthrough" in done.stderr and "FAKEGPU_DIST_MODE must be passthrough or proxy" in done.stderr, \
        done.stderr
