"""One control-host command for the physical multi-host check: a fakegpu coordinator here, one
torchrun rank on each SSH host, the numerical and fault cases of
verification/test_ddp_hybrid_numerics.py, and the combined results.

    python3 verification/run_physical_multihost.py \\
        --node 'name=blackwell;ssh=gpu-a;repo=/home/u/fakegpu;python=/opt/venv/bin/python;shell=posix' \\
        --node 'name=ampere-wsl;ssh=u@gpu-b;repo=/home/u/fakegpu;python=/opt/torch/bin/python;shell=wsl' \\
        --coordinator-host 100.x.y.z

Each --node is one rank, in order: name (a label), ssh (the destination given to the SSH command),
repo (the checkout on that host), python (an interpreter with torch), shell (posix, or wsl when SSH
lands on Windows and the checkout lives inside WSL), and optionally addr (the address the other
hosts reach it at; default: the ssh destination without user@). The first node also hosts torch's
rendezvous (--master-port).

Nothing is copied to the hosts and nothing there is changed. Before launching, every host must
have: a checkout with no modified tracked files, at the same commit as each other and as this
checkout, a shim build/libnccl.so.2 that loads, reports NCCL 2.30.7 and is newer than every file
of native/, and a Python with torch (its version, CUDA version and device are recorded). A host
with a CUDA device runs its rank in hybrid mode (CUDA compute, simulated communication); one
without runs the CPU form (CPU tensors, backend fakegpu), and the summary says which.

Results go to build/physical_multihost_validation/<session>/ (--out to choose): preflight.json,
rank<R>.json and rank<R>.log per rank, cluster-report.json and cluster-report.md (the
coordinator's), node-pairs.json, failures.json (the fault cases' errors, the report's failed
operations, timeouts and init timeouts) and summary.md. Exit status 0 only if every check passed.

The coordinator protocol is not encrypted: use a trusted network. A fresh token is made for the
run and reaches each rank on its SSH session's stdin, never on a command line.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import secrets
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
WORKER = "verification/test_ddp_hybrid_numerics.py"
RESULT_PREFIX = "FAKEGPU-RESULT "
DEFAULT_CLUSTER = REPO / "verification" / "data" / "cluster_tcp_2r.yaml"
NODE_KEYS = ("name", "ssh", "repo", "python", "shell", "addr")


class ControllerError(Exception):
    pass


@dataclasses.dataclass
class Node:
    name: str
    ssh: str
    repo: str
    python: str
    shell: str = "posix"
    addr: str = ""

    @classmethod
    def parse(cls, text: str) -> "Node":
        fields = {}
        for part in filter(None, (p.strip() for p in text.split(";"))):
            key, sep, value = part.partition("=")
            if not sep or key not in NODE_KEYS:
                raise ControllerError(f"--node {text!r}: {part!r} is not one of "
                                      f"{', '.join(k + '=...' for k in NODE_KEYS)}")
            fields[key] = value
        missing = [k for k in ("name", "ssh", "repo", "python") if not fields.get(k)]
        if missing:
            raise ControllerError(f"--node {text!r}: missing {', '.join(missing)}")
        node = cls(**fields)
        if node.shell not in ("posix", "wsl"):
            raise ControllerError(f"--node {text!r}: shell must be posix or wsl, not {node.shell!r}")
        node.addr = node.addr or node.ssh.rpartition("@")[2]
        return node


def remote_argv(ssh_command: list[str], node: Node, script: str) -> list[str]:
    """The local argv running the POSIX shell ``script`` on ``node``."""
    if node.shell == "wsl":   # SSH lands in Windows: hand the script to WSL's bash
        script = f"wsl.exe -e bash -c {shlex.quote(script)}"
    return [*ssh_command, node.ssh, script]


PREFLIGHT_PY = r"""
import ctypes, json, platform, sys
d = {"python": platform.python_version(), "executable": sys.executable}
try:
    lib = ctypes.CDLL("build/libnccl.so.2")
    v = ctypes.c_int(0)
    lib.ncclGetVersion(ctypes.byref(v))
    d["nccl_version"] = v.value
except OSError as exc:
    d["shim_error"] = str(exc)
try:
    import torch
    d["torch"] = torch.__version__
    d["cuda"] = torch.version.cuda
    d["cuda_available"] = bool(torch.cuda.is_available())
    d["device"] = torch.cuda.get_device_name(0) if d["cuda_available"] else None
except Exception as exc:
    d["torch_error"] = repr(exc)
print("preflight-python=" + json.dumps(d))
"""


def preflight_script(node: Node) -> str:
    q = shlex.quote
    return " ; ".join([
        f"cd {q(node.repo)} || exit 3",
        'echo "commit=$(git rev-parse HEAD 2>/dev/null)"',
        'echo "dirty=$(git status --porcelain --untracked-files=no 2>/dev/null | tr \'\\n\' \' \')"',
        'echo "git_ok=$(git rev-parse --is-inside-work-tree 2>/dev/null)"',
        'if [ -f build/libnccl.so.2 ]; then echo shim=present; '
        'echo "stale=$(find native CMakeLists.txt -type f -newer build/libnccl.so.2 2>/dev/null | head -3 | tr \'\\n\' \' \')"; '
        'else echo shim=missing; fi',
        f"{q(node.python)} -c {q(PREFLIGHT_PY)}",
    ])


def parse_preflight(text: str) -> dict:
    info: dict = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            continue
        if key == "preflight-python":
            try:
                info.update(json.loads(value))
            except json.JSONDecodeError:
                info["python_error"] = value
        elif key in ("commit", "dirty", "git_ok", "shim", "stale"):
            info[key] = value.strip()
    return info


def local_commit() -> Optional[str]:
    try:
        done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def check_hosts(nodes: list[Node], infos: list[dict], expected_commit: Optional[str]) -> list[str]:
    """What stops the launch, one line per problem, naming the host."""
    problems = []
    for node, info in zip(nodes, infos):
        where = f"{node.name} ({node.ssh}:{node.repo})"
        if info.get("ssh_status", 0) != 0 and not info.get("commit"):
            problems.append(f"{where}: cannot run the checks: exit {info.get('ssh_status')}: "
                            f"{info.get('ssh_output', '').strip()[-300:]}")
            continue
        if info.get("git_ok") != "true" or not info.get("commit"):
            problems.append(f"{where}: not a git checkout")
        if info.get("dirty"):
            problems.append(f"{where}: tracked files modified ({info['dirty'].strip()}); commit or stash them")
        if info.get("shim") != "present":
            problems.append(f"{where}: build/libnccl.so.2 missing: run cmake -S . -B build && cmake --build build there")
        elif info.get("stale"):
            problems.append(f"{where}: build/libnccl.so.2 is older than {info['stale'].split()[0]}: rebuild it")
        elif info.get("nccl_version") != 23007:
            problems.append(f"{where}: build/libnccl.so.2 does not load as NCCL 2.30.7 "
                            f"({info.get('shim_error') or info.get('nccl_version')})")
        if "torch" not in info:
            problems.append(f"{where}: {node.python} has no usable torch ({info.get('torch_error', info.get('python_error', 'no output'))})")
    commits = {n.name: i.get("commit") for n, i in zip(nodes, infos) if i.get("commit")}
    if len(set(commits.values())) > 1:
        problems.append("the hosts are at different commits: " + ", ".join(f"{k} {v[:12]}" for k, v in commits.items()))
    elif commits and expected_commit and expected_commit not in commits.values():
        problems.append(f"the hosts are at {next(iter(commits.values()))[:12]}, this checkout at {expected_commit[:12]}")
    return problems


class Coordinator:
    def __init__(self, listen: str, cluster: Path, out: Path, token_file: Path, timeout_ms: int):
        self.address = listen
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        self.log_path = out / "coordinator.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fakegpu", "coordinator", "--listen", listen,
             "--cluster-config", str(cluster), "--report", str(out / "cluster-report.json"),
             "--markdown-report", str(out / "cluster-report.md"), "--timeout-ms", str(timeout_ms),
             "--token-file", str(token_file)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(REPO),
            start_new_session=True)
        ready = threading.Event()

        def pump():
            for line in self.proc.stdout:
                self._log.write(line)
                self._log.flush()
                if "listening on" in line:
                    ready.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + 60
        while not ready.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise ControllerError(f"the coordinator did not start on {listen}:\n"
                                      + self.log_path.read_text()[-2000:])

    def shutdown(self, token_file: Path) -> int:
        subprocess.run([sys.executable, "-m", "fakegpu", "coordinator", "--shutdown", self.address,
                        "--token-file", str(token_file)], capture_output=True, timeout=60, cwd=str(REPO),
                       env={**os.environ, "PYTHONPATH": str(REPO)})
        try:
            return self.proc.wait(90)
        except subprocess.TimeoutExpired:
            self.kill()
            return -9

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def launch_script(node: Node, rank: int, world: int, args, modes: list[str], cases: str) -> str:
    q = shlex.quote
    env = {"FAKEGPU_MODE": modes[rank], "FAKEGPU_DEVICE_COUNT": "1", "FAKEGPU_DIST_MODE": "simulate",
           "FAKEGPU_COORDINATOR_TRANSPORT": "tcp",
           "FAKEGPU_COORDINATOR_ADDR": f"{args.coordinator_host}:{args.coordinator_port}",
           "FAKEGPU_COORDINATOR_TIMEOUT_MS": str(args.timeout_ms), "OMP_NUM_THREADS": "1",
           "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    exports = " ".join(f"{k}={q(v)}" for k, v in env.items())
    report_dir = f"/tmp/fakegpu-physical-{args.session}-rank{rank}"
    return (f"cd {q(node.repo)} || exit 3; export {exports}; "
            "IFS= read -r FAKEGPU_COORDINATOR_TOKEN; export FAKEGPU_COORDINATOR_TOKEN; "
            f"LD_PRELOAD=\"$PWD/build/libnccl.so.2\" exec {q(node.python)} -m torch.distributed.run "
            f"--nnodes={world} --nproc-per-node=1 --node-rank={rank} --master-addr={q(args.master_addr)} "
            f"--master-port={args.master_port} --max-restarts=0 {WORKER} "
            f"--report-dir={q(report_dir)} --session={q(args.session)} --cases={q(cases)}")


def run_ranks(nodes: list[Node], args, modes: list[str], token: str, out: Path) -> list[dict]:
    procs = []
    for rank, node in enumerate(nodes):
        log = open(out / f"rank{rank}.log", "w+")
        argv = remote_argv(args.ssh, node, launch_script(node, rank, len(nodes), args, modes, args.cases))
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        proc.stdin.write(token + "\n")
        proc.stdin.close()
        procs.append((proc, log))
    deadline = time.monotonic() + args.timeout
    results = []
    for rank, (proc, log) in enumerate(procs):
        try:
            proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other, _ in procs:
                if other.poll() is None:
                    os.killpg(other.pid, 9)
            proc.wait(10)
        log.seek(0)
        text = log.read()
        log.close()
        doc = None
        for line in text.splitlines():
            if line.startswith(RESULT_PREFIX):
                doc = json.loads(line[len(RESULT_PREFIX):])
        if doc is None:
            doc = {"rank": rank, "ok": False, "cases": {},
                   "error": f"no result (exit {proc.returncode}); see rank{rank}.log",
                   "log_tail": text[-3000:]}
        doc["node"] = nodes[rank].name
        doc["exit_status"] = proc.returncode
        (out / f"rank{rank}.json").write_text(json.dumps(doc, indent=1) + "\n")
        results.append(doc)
    return results


def failure_observations(results: list[dict], report: Optional[dict]) -> dict:
    faults = {}
    for doc in results:
        for case, r in doc.get("cases", {}).items():
            if case in ("mismatched_op", "missing_peer") or not r.get("ok"):
                faults.setdefault(case, {})[f"rank{doc['rank']}"] = {
                    k: v for k, v in r.items() if k in ("ok", "error", "async_error_after", "role", "seconds")}
    observed = {"cases": faults}
    if report:
        observed["report"] = {
            "failed_operations": report["totals"].get("failed_operations"),
            "rank_timeouts": {str(r["rank"]): r["timeouts"] for r in report["ranks"]},
            "init_timeouts": {str(r["rank"]): r["init_timeouts"] for r in report["ranks"]},
            "events": report.get("events", {}).get("by_event", {}),
            "failure_events": [e for e in report.get("events", {}).get("items", [])
                               if e.get("event") in ("op_failed", "init_timeout", "rank_timeout")][:50],
        }
    return observed


def summary(nodes, infos, modes, results, report, problems) -> str:
    lines = ["# Physical multi-host validation", ""]
    lines += ["| rank | node | ssh | commit | python | torch | CUDA | device | mode |",
              "|---|---|---|---|---|---|---|---|---|"]
    for rank, (node, info) in enumerate(zip(nodes, infos)):
        lines.append(f"| {rank} | {node.name} | {node.ssh} | {str(info.get('commit', ''))[:12]} | "
                     f"{info.get('python', '')} | {info.get('torch', '')} | {info.get('cuda') or '-'} | "
                     f"{info.get('device') or 'none'} | {modes[rank] if modes else '-'} |")
    if results:
        cases = list(results[0].get("cases", {}))
        lines += ["", "| case | " + " | ".join(f"rank {d['rank']}" for d in results) + " |",
                  "|---|" + "---|" * len(results)]
        for case in cases:
            lines.append(f"| {case} | " + " | ".join(
                "ok" if d.get("cases", {}).get(case, {}).get("ok") else "FAILED" for d in results) + " |")
    if report:
        lines += ["", "| node pair | operations | bytes a->b | bytes b->a | total bytes | peak per operation (B) |",
                  "|---|---|---|---|---|---|"]
        for pair in report.get("node_pairs", []):
            a, b = pair["nodes"]
            d = pair["directions"]
            lines.append(f"| {a} <-> {b} | {pair['operations']} | {d.get(f'{a}->{b}', 0)} | "
                         f"{d.get(f'{b}->{a}', 0)} | {pair['total_bytes']} | {pair['peak_operation_bytes']} |")
    lines += ["", "Problems: " + ("; ".join(problems) if problems else "none")]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--node", action="append", default=[], metavar="SPEC", help="one rank's host (repeat, in rank order)")
    p.add_argument("--coordinator-host", required=True, help="address of this host that every node can reach")
    p.add_argument("--coordinator-port", type=int, default=29591)
    p.add_argument("--coordinator-bind", help="address the coordinator listens on (default --coordinator-host)")
    p.add_argument("--master-addr", help="torch rendezvous host (default: the first node's addr)")
    p.add_argument("--master-port", type=int, default=29592)
    p.add_argument("--cluster-config", default=str(DEFAULT_CLUSTER),
                   help="cluster YAML for the coordinator's report (default verification/data/cluster_tcp_2r.yaml)")
    p.add_argument("--cases", default=None, help="worker cases, comma-separated (default: all of them)")
    p.add_argument("--session", default=None, help="name of this run (default: a UTC time stamp)")
    p.add_argument("--out", help="results folder (default build/physical_multihost_validation/<session>)")
    p.add_argument("--ssh-command", default="ssh -o BatchMode=yes",
                   help="how to reach a host: the node's ssh value and a shell command are appended "
                        "(default 'ssh -o BatchMode=yes')")
    p.add_argument("--timeout-ms", type=int, default=60000, help="coordinator operation timeout (default 60000)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole launch (default 1800)")
    args = p.parse_args(argv)
    try:
        return run(args)
    except ControllerError as exc:
        print(f"run_physical_multihost: error: {exc}", file=sys.stderr)
        return 2


def run(args) -> int:
    sys.path.insert(0, str(REPO / "verification"))
    from test_ddp_hybrid_numerics import ALL_CASES

    nodes = [Node.parse(text) for text in args.node]
    if len(nodes) < 2:
        raise ControllerError("give at least two --node values (one rank per host)")
    args.ssh = shlex.split(args.ssh_command)
    args.cases = args.cases or ",".join(ALL_CASES)
    args.session = args.session or datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    args.master_addr = args.master_addr or nodes[0].addr
    from fakegpu.topology.bundled import resolve_cluster_config

    cluster = Path(resolve_cluster_config(args.cluster_config)).resolve()
    from fakegpu.topology import load_cluster_config

    try:
        topology = load_cluster_config(str(cluster))
    except Exception as exc:
        raise ControllerError(f"--cluster-config {args.cluster_config}: {exc}") from None
    if topology.world_size != len(nodes):
        raise ControllerError(f"--cluster-config {cluster.name} places {topology.world_size} ranks, "
                              f"but {len(nodes)} --node values were given")
    out = Path(args.out) if args.out else REPO / "build" / "physical_multihost_validation" / args.session
    out.mkdir(parents=True, exist_ok=True)
    print(f"run_physical_multihost: session {args.session}, results in {out}", flush=True)

    infos = []
    for node in nodes:
        try:
            done = subprocess.run(remote_argv(args.ssh, node, preflight_script(node)), capture_output=True,
                                  text=True, timeout=180, stdin=subprocess.DEVNULL)
            info = parse_preflight(done.stdout)
            info["ssh_status"], info["ssh_output"] = done.returncode, (done.stdout + done.stderr)[-2000:]
        except (OSError, subprocess.TimeoutExpired) as exc:
            info = {"ssh_status": -1, "ssh_output": str(exc)}
        infos.append(info)
    (out / "preflight.json").write_text(json.dumps(
        [{"node": dataclasses.asdict(n), **i} for n, i in zip(nodes, infos)], indent=1) + "\n")
    problems = check_hosts(nodes, infos, local_commit())
    if problems:
        (out / "summary.md").write_text(summary(nodes, infos, [], [], None, problems))
        raise ControllerError("preflight failed, nothing launched:\n  " + "\n  ".join(problems))
    modes = ["hybrid" if info.get("cuda_available") else "simulate" for info in infos]
    for node, mode, info in zip(nodes, modes, infos):
        print(f"  {node.name}: commit {info['commit'][:12]}, python {info['python']}, torch {info['torch']}, "
              f"CUDA {info.get('cuda') or '-'}, " + (f"{info['device']}: hybrid mode" if mode == "hybrid"
                                                      else "no CUDA device: CPU form (backend fakegpu)"), flush=True)

    private = Path(tempfile.mkdtemp(prefix="fgpu-physical-"))
    token = secrets.token_hex(32)
    token_file = private / "token"
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token + "\n")
    bind = f"{args.coordinator_bind or args.coordinator_host}:{args.coordinator_port}"
    coordinator = Coordinator(bind, cluster, out, token_file, args.timeout_ms)
    try:
        results = run_ranks(nodes, args, modes, token, out)
    finally:
        status = coordinator.shutdown(token_file)
        token_file.unlink()
        private.rmdir()
    report_path = out / "cluster-report.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else None
    if report is None:
        problems.append(f"the coordinator wrote no report (exit {status}; see coordinator.log)")
    else:
        (out / "node-pairs.json").write_text(json.dumps(report.get("node_pairs", []), indent=1) + "\n")
        if report["world_size"] != len(nodes):
            problems.append(f"the report's world size is {report['world_size']}")
    (out / "failures.json").write_text(json.dumps(failure_observations(results, report), indent=1) + "\n")
    for doc in results:
        bad = [c for c, r in doc.get("cases", {}).items() if not r.get("ok")]
        if not doc.get("ok"):
            problems.append(f"rank {doc['rank']} ({doc['node']}): " +
                            (f"failed {', '.join(bad)}" if bad else doc.get("error", "failed")))
    (out / "summary.md").write_text(summary(nodes, infos, modes, results, report, problems))
    print((out / "summary.md").read_text())
    print(f"run_physical_multihost: {'FAILED' if problems else 'OK'}; results in {out}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
