"""fgpu: option validation, the rank environment, and real launches through the shim and a
real coordinator (ranks allreduce with fakegpu.nccl and check the exact result)."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fakegpu import launcher
from fakegpu.cli import run as fgpu_run
from helpers.paths import REPO_ROOT


# A tiny stand-in for torchrun: without RANK it starts WORLD copies of itself with RANK set,
# waits for them and exits with the worst status. Each rank allreduces through fakegpu.nccl
# (loaded as "libnccl.so.2", so it only works when fgpu preloaded the shim), checks the exact
# sum, and writes what it saw into OUT_DIR/rank<r>.json.
JOB = textwrap.dedent("""
    import json, os, subprocess, sys, time
    world = int(os.environ.get("JOB_WORLD", "2"))
    out_dir = os.environ["JOB_OUT_DIR"]
    if "RANK" not in os.environ:
        procs = []
        for r in range(world):
            env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world))
            procs.append(subprocess.Popen([sys.executable, __file__], env=env))
        codes = [p.wait(timeout=120) for p in procs]
        sys.exit(max(codes))

    import numpy as np
    from fakegpu.nccl import Nccl
    rank = int(os.environ["RANK"])
    nccl = Nccl("libnccl.so.2")
    comm = nccl.comm_init_rank(world, nccl.shared_unique_id(os.path.join(out_dir, "uid"), rank), rank)
    count = int(os.environ.get("JOB_COUNT", "4096"))
    send = (np.arange(count, dtype=np.float32) % 97) * (rank + 1)
    recv = np.empty_like(send)
    for _ in range(int(os.environ.get("JOB_ITERS", "3"))):
        comm.all_reduce(send, recv, count, send.dtype, "sum")
    expected = (np.arange(count, dtype=np.float32) % 97) * (world * (world + 1) // 2)
    comm.destroy()
    with open(os.path.join(out_dir, "rank%d.json" % rank), "w") as f:
        json.dump({"exact": bool(np.array_equal(recv, expected)),
                   "env": {k: v for k, v in os.environ.items()
                           if k.startswith("FAKEGPU_") or k in ("LD_PRELOAD", "PYTHONPATH")},
                   "cwd": os.getcwd(),
                   "modes": {name: os.stat(path).st_mode & 0o777 for name, path in (
                       ("socket_dir", os.path.dirname(os.environ["FAKEGPU_COORDINATOR_ADDR"])),
                       ("token_file", os.environ["FAKEGPU_COORDINATOR_TOKEN_FILE"]))
                       if os.environ["FAKEGPU_COORDINATOR_TRANSPORT"] == "unix"}}, f)
    sys.exit(int(os.environ.get("JOB_EXIT", "0")))
""")

TWO_NODE_YAML = textwrap.dedent("""
    version: 1
    cluster:
      name: launcher-test
      default_backend: nccl
    nodes:
      - id: node0
        host: 127.0.0.1
        ranks: [0, 1]
        gpus: [{profile: a100}, {profile: a100}]
      - id: node1
        host: 127.0.0.1
        ranks: [2, 3]
        gpus: [{profile: a100}, {profile: a100}]
    fabric:
      intra_node: {type: nvlink, bandwidth_gbps: 300, latency_us: 3}
      inter_node: {type: infiniband, bandwidth_gbps: 200, latency_us: 15, oversubscription: 1.5}
""")


# ---------------------------------------------------------------------------------------------
# Pure functions


@pytest.mark.parametrize("text, value", [
    ("1048576", 1 << 20), ("64K", 64 << 10), ("4MiB", 4 << 20), ("4M", 4 << 20), ("1G", 1 << 30),
    ("2KB", 2000), ("2KiB", 2048), ("0.5M", 512 << 10),
])
def test_parse_size(text, value):
    assert launcher.parse_size(text) == value


@pytest.mark.parametrize("text", ["", "4Q", "M", "-1", "1.3"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        launcher.parse_size(text)


def test_parse_tcp_address():
    assert launcher.parse_tcp_address("127.0.0.1:29591") == ("127.0.0.1", 29591)
    assert launcher.parse_tcp_address("[::1]:80") == ("::1", 80)
    assert launcher.parse_tcp_address("host.example:0") == ("host.example", 0)
    for bad in ("127.0.0.1", ":80", "h:99999", "h:x"):
        with pytest.raises(ValueError):
            launcher.parse_tcp_address(bad)


def _config(argv, cwd, environ=None):
    ns = fgpu_run.build_parser().parse_args(argv + ["--", "true"])
    return launcher.config_from_args(ns, cwd=cwd, environ=environ or {})


def test_relative_paths_become_absolute(tmp_path):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "c.yaml").write_text(TWO_NODE_YAML)
    (tmp_path / "out").mkdir()
    cfg = _config(["--cluster-config", "conf/c.yaml", "--report", "out/r.json", "--trace", "out/t.json"],
                  cwd=tmp_path)
    assert cfg.cluster_config == tmp_path / "conf" / "c.yaml"
    assert cfg.report == tmp_path / "out" / "r.json"
    assert cfg.markdown_path == tmp_path / "out" / "r.md"
    assert cfg.trace == tmp_path / "out" / "t.json"
    env = launcher.fakegpu_variables(cfg, launcher.Endpoint("unix", "/x/c.sock"), Path("/x/token"))
    for name in ("FAKEGPU_CLUSTER_CONFIG", "FAKEGPU_CLUSTER_REPORT_PATH",
                 "FAKEGPU_CLUSTER_REPORT_MARKDOWN_PATH", "FAKEGPU_TRACE_PATH"):
        assert os.path.isabs(env[name]), name


def test_defaults(tmp_path):
    cfg = _config([], cwd=tmp_path)
    assert (cfg.mode, cfg.dist_mode, cfg.transport) == ("simulate", "simulate", "unix")
    assert cfg.report == tmp_path / "fakegpu-report.json"
    assert cfg.needs_coordinator and cfg.coordinator_addr is None


def test_options_fall_back_to_environment(tmp_path):
    cfg = _config([], cwd=tmp_path, environ={"FAKEGPU_DEVICE_COUNT": "4", "FAKEGPU_STAGING_CHUNK_BYTES": "8M",
                                             "FAKEGPU_STAGING_FORCE_SOCKET": "1"})
    assert (cfg.device_count, cfg.staging_chunk_bytes, cfg.force_socket_staging) == (4, 8 << 20, True)
    cfg = _config(["--device-count", "2"], cwd=tmp_path, environ={"FAKEGPU_DEVICE_COUNT": "4"})
    assert cfg.device_count == 2


def test_fake_world_modes_and_memory_capture(tmp_path):
    for mode in ("fake", "real_pp_fake_spmd", "passthrough"):
        assert not _config(["--dist-mode", mode], cwd=tmp_path).needs_coordinator
    cfg = _config(["--dist-mode", "fake", "--capture-memory"], cwd=tmp_path)
    env = launcher.fakegpu_variables(cfg, None, None)
    assert env["FAKEGPU_MEMORY_CAPTURE_PATH"] == str(tmp_path / "fakegpu-memory.json")
    assert "FAKEGPU_COORDINATOR_ADDR" not in env
    cfg = _config(["--memory-capture-path", "mem.json"], cwd=tmp_path)
    assert cfg.memory_capture == tmp_path / "mem.json"


def test_transport_follows_the_address(tmp_path):
    assert _config(["--coordinator-addr", "10.0.0.1:29591"], cwd=tmp_path).transport == "tcp"
    assert _config(["--listen", "127.0.0.1:0"], cwd=tmp_path).transport == "tcp"
    assert _config(["--coordinator-addr", str(tmp_path / "s.sock")], cwd=tmp_path).transport == "unix"


def test_joins_the_coordinator_named_in_the_environment(tmp_path):
    """A nested fgpu (or exported variables) joins the running coordinator instead of starting one."""
    cfg = _config([], cwd=tmp_path, environ={"FAKEGPU_COORDINATOR_ADDR": "10.1.2.3:29591",
                                             "FAKEGPU_COORDINATOR_TOKEN_FILE": str(tmp_path / "tok")})
    assert (cfg.transport, cfg.coordinator_addr, cfg.token_file) == ("tcp", "10.1.2.3:29591", tmp_path / "tok")
    cfg = _config(["--listen", "127.0.0.1:0"], cwd=tmp_path, environ={"FAKEGPU_COORDINATOR_ADDR": "/x.sock"})
    assert cfg.coordinator_addr is None and cfg.listen == "127.0.0.1:0"


def test_joining_a_coordinator_needs_its_token(tmp_path, start_coordinator):
    """fgpu pings a running coordinator with the token file it was given; without the right
    token the coordinator answers only "authentication required", and fgpu says what to do."""
    coordinator = start_coordinator("unix")
    (tmp_path / "token").write_text(coordinator.token + "\n")
    prepared = launcher.prepare(_config(["--coordinator-addr", coordinator.address, "--token-file", "token"],
                                        cwd=tmp_path))
    assert prepared.reused and prepared.token_file == tmp_path / "token"
    prepared.close()
    with pytest.raises(launcher.LaunchError, match=r"refused our token \(authentication required\)"):
        launcher.prepare(_config(["--coordinator-addr", coordinator.address], cwd=tmp_path))
    with pytest.raises(launcher.LaunchError, match="--token-file .*missing does not exist; copy the token file"):
        launcher.prepare(_config(["--coordinator-addr", coordinator.address, "--token-file", "missing"],
                                 cwd=tmp_path))
    (tmp_path / "wrong").write_text("nope\n")
    with pytest.raises(launcher.LaunchError, match=r"refused our token \(authentication failed\)"):
        launcher.prepare(_config(["--coordinator-addr", coordinator.address, "--token-file", "wrong"],
                                 cwd=tmp_path))


def test_coordinator_gets_no_rank_only_variables(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKEGPU_DIST_MODE", "proxy")
    monkeypatch.setenv("FAKEGPU_COORDINATOR_ADDR", "relative-and-stale")
    monkeypatch.setenv("LD_PRELOAD", "/lib/libnccl.so.2:/opt/other.so")
    cfg = _config(["--dist-mode", "proxy", "--cluster-config", __file__], cwd=tmp_path)
    env = launcher.coordinator_child_environment(cfg, tmp_path / "tok")
    for name in ("FAKEGPU_DIST_MODE", "FAKEGPU_MODE", "FAKEGPU_COORDINATOR_ADDR", "FAKEGPU_COORDINATOR_TOKEN_FILE"):
        assert name not in env
    assert env["FAKEGPU_CLUSTER_CONFIG"] == __file__
    assert env["LD_PRELOAD"] == "/opt/other.so"  # the coordinator never loads the shim


def test_rank_environment_preload_and_variables(tmp_path):
    cfg = _config(["--device-count", "8", "--staging-chunk-bytes", "1MiB", "--force-socket-staging",
                   "--coordinator-timeout-ms", "5000"], cwd=tmp_path)
    base = {"LD_PRELOAD": "/opt/other.so /lib/shim.so", "PYTHONPATH": "/mine",
            "FAKEGPU_COORDINATOR_TOKEN": "stale", "HOME": "/root"}
    env = launcher.rank_environment(cfg, launcher.Endpoint("unix", "/d/c.sock"), Path("/d/token"),
                                    base=base, shim="/lib/shim.so")
    assert env["LD_PRELOAD"] == "/lib/shim.so:/opt/other.so"  # first, once
    assert env["FAKEGPU_NCCL_LIBRARY"] == "/lib/shim.so"
    assert env["PYTHONPATH"].split(os.pathsep)[-1] == "/mine"
    assert "FAKEGPU_COORDINATOR_TOKEN" not in env
    assert env["FAKEGPU_COORDINATOR_TOKEN_FILE"] == "/d/token"
    assert env["HOME"] == "/root"
    expected = {"FAKEGPU_MODE": "simulate", "FAKEGPU_DIST_MODE": "simulate",
                "FAKEGPU_COORDINATOR_TRANSPORT": "unix", "FAKEGPU_COORDINATOR_ADDR": "/d/c.sock",
                "FAKEGPU_COORDINATOR_TIMEOUT_MS": "5000", "FAKEGPU_DEVICE_COUNT": "8",
                "FAKEGPU_STAGING_CHUNK_BYTES": str(1 << 20), "FAKEGPU_STAGING_FORCE_SOCKET": "1"}
    assert {k: env[k] for k in expected} == expected
    autoload = launcher.torch_autoload_dir()
    if autoload is not None:
        assert env["PYTHONPATH"].split(os.pathsep)[0] == str(autoload)


def test_token_file_is_private(tmp_path):
    token = launcher.write_token_file(tmp_path / "tok")
    assert len(token) == 64 and (tmp_path / "tok").stat().st_mode & 0o777 == 0o600
    assert launcher.read_token(tmp_path / "tok") == token
    assert launcher.token_file_warning(tmp_path / "tok") is None
    os.chmod(tmp_path / "tok", 0o644)
    assert "chmod 600" in launcher.token_file_warning(tmp_path / "tok")


@pytest.mark.parametrize("argv, message", [
    (["--mode", "turbo", "--", "true"], "unknown --mode 'turbo'"),
    (["--dist-mode", "magic", "--", "true"], "unknown --dist-mode 'magic'"),
    (["--cluster-config", "missing.yaml", "--", "true"], "--cluster-config missing.yaml: no such file"),
    (["--coordinator-addr", "relative.sock", "--", "true"], "must be an absolute path"),
    (["--coordinator-transport", "unix", "--coordinator-addr", "127.0.0.1:5", "--", "true"],
     "must be an absolute path"),
    (["--coordinator-transport", "udp", "--", "true"], "unknown --coordinator-transport 'udp'"),
    (["--coordinator-addr", "/" + "x" * 120, "--", "true"], "limited to 107 bytes"),
    (["--listen", "nowhere", "--", "true"], "is not HOST:PORT"),
    (["--listen", "127.0.0.1:1", "--coordinator-addr", "127.0.0.1:2", "--", "true"], "not both"),
    (["--coordinator-timeout-ms", "soon", "--", "true"], "expects a whole number"),
    (["--device-count", "0", "--", "true"], "--device-count must be > 0"),
    (["--staging-chunk-bytes", "4Q", "--", "true"], "is not a size"),
    (["--staging-chunk-bytes", "16", "--", "true"], "at least 4096"),
    (["--report", "/nonexistent-dir/r.json", "--", "true"], "directory /nonexistent-dir does not exist"),
    (["--mode", "simulate"], "no command given"),
    (["--frobnicate", "true"], "--frobnicate"),
])
def test_bad_options_give_clear_errors(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    try:
        status = fgpu_run.main(argv)
    except SystemExit as exc:  # argparse's own errors
        status = exc.code
    assert status == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Real launches: the shim, a real coordinator, real rank processes


def _fgpu(args, cwd, shim, *, env=None, timeout=180, **kwargs):
    full_env = dict(os.environ if env is None else env)
    full_env["FAKEGPU_NCCL_LIBRARY"] = shim
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), full_env.get("PYTHONPATH")]))
    for name in [k for k in full_env if k.startswith("FAKEGPU_") and k != "FAKEGPU_NCCL_LIBRARY"]:
        full_env.pop(name)
    # Own process group, so that a hang cannot leave the command's processes behind.
    proc = subprocess.Popen([sys.executable, "-m", "fakegpu", "run", *args], cwd=cwd, env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                            start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"fgpu {' '.join(args)} did not finish within {timeout} s:\n{err[-4000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture
def job(tmp_path):
    path = tmp_path / "job.py"
    path.write_text(JOB)
    (tmp_path / "out").mkdir()
    return path


def _rank_results(out_dir: Path, world: int) -> list[dict]:
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]


def _check_report(path: Path, world: int, nodes: int | None = None) -> dict:
    data = json.loads(path.read_text())
    assert isinstance(data, dict)
    checker = [sys.executable, "-m", "fakegpu", "report", "check", str(path), "--expect-world-size", str(world)]
    if nodes is not None:
        checker += ["--expect-node-count", str(nodes)]
    if (REPO_ROOT / "fakegpu" / "cli" / "report.py").exists():
        done = subprocess.run(checker, capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
        assert done.returncode == 0, done.stdout + done.stderr
    return data


def test_fgpu_runs_four_ranks_with_relative_paths(tmp_path, job, shim_library):
    (tmp_path / "cluster.yaml").write_text(TWO_NODE_YAML)
    (tmp_path / "reports").mkdir()
    env = dict(os.environ, JOB_WORLD="4", JOB_OUT_DIR="out")
    done = _fgpu(["--cluster-config", "cluster.yaml", "--report", "reports/run.json", "--trace", "reports/trace.json",
                  "--device-count", "4", "--", sys.executable, "job.py"], tmp_path, shim_library, env=env)
    assert done.returncode == 0, done.stderr
    results = _rank_results(tmp_path / "out", 4)
    for rank, result in enumerate(results):
        assert result["exact"], f"rank {rank} got a wrong allreduce result"
        assert result["cwd"] == str(tmp_path)  # fgpu never changes directory
        seen = result["env"]
        assert seen["LD_PRELOAD"].split(":")[0] == shim_library
        assert seen["FAKEGPU_CLUSTER_CONFIG"] == str(tmp_path / "cluster.yaml")
        assert seen["FAKEGPU_CLUSTER_REPORT_PATH"] == str(tmp_path / "reports" / "run.json")
        assert seen["FAKEGPU_DEVICE_COUNT"] == "4"
        assert seen["FAKEGPU_COORDINATOR_TRANSPORT"] == "unix"
        sock_dir = Path(seen["FAKEGPU_COORDINATOR_ADDR"]).parent
        assert Path(seen["FAKEGPU_COORDINATOR_TOKEN_FILE"]).parent == sock_dir
        assert result["modes"] == {"socket_dir": 0o700, "token_file": 0o600}
    assert not sock_dir.exists(), "the private socket directory must be removed afterwards"
    _check_report(tmp_path / "reports" / "run.json", world=4, nodes=2)
    assert (tmp_path / "reports" / "run.md").is_file()
    trace = json.loads((tmp_path / "reports" / "trace.json").read_text())
    assert trace, "the trace requested with --trace is empty"
    assert str(tmp_path / "reports" / "run.json") in done.stderr  # fgpu says where the report is


def test_default_report_lands_in_cwd_and_tcp_works(tmp_path, job, shim_library):
    env = dict(os.environ, JOB_WORLD="2", JOB_OUT_DIR=str(tmp_path / "out"))
    done = _fgpu(["--coordinator-transport", "tcp", "--", sys.executable, str(job)], tmp_path, shim_library, env=env)
    assert done.returncode == 0, done.stderr
    results = _rank_results(tmp_path / "out", 2)
    assert all(r["exact"] for r in results)
    assert results[0]["env"]["FAKEGPU_COORDINATOR_TRANSPORT"] == "tcp"
    host, port = launcher.parse_tcp_address(results[0]["env"]["FAKEGPU_COORDINATOR_ADDR"])
    assert launcher.is_loopback_host(host) and port > 0
    _check_report(tmp_path / "fakegpu-report.json", world=2)


def test_a_report_this_job_could_not_write_is_an_error_and_the_old_one_is_not_shown(tmp_path, job, shim_library):
    """The 4-rank job runs and checks its results; meanwhile its report path becomes a directory,
    so the coordinator's final write fails. Before: exit 0 and the previous job's summary."""
    (tmp_path / "cluster.yaml").write_text(TWO_NODE_YAML)
    first = _fgpu(["--cluster-config", "cluster.yaml", "--report", "r.json", "--", "true"], tmp_path, shim_library)
    assert first.returncode == 0 and "cluster launcher-test" in first.stderr, first.stderr
    (tmp_path / "r.json").unlink()
    script = tmp_path / "take-path.sh"
    script.write_text(f"mkdir r.json && touch r.json/x && exec {shlex.quote(sys.executable)} job.py\n")
    env = dict(os.environ, JOB_WORLD="2", JOB_OUT_DIR=str(tmp_path / "out"))
    done = _fgpu(["--report", "r.json", "--", "sh", str(script)], tmp_path, shim_library, env=env)
    assert all(r["exact"] for r in _rank_results(tmp_path / "out", 2))
    assert done.returncode == 1, done.stderr
    assert "writing the reports (received SIGTERM) failed" in done.stderr, done.stderr   # the coordinator's tail
    assert f"Markdown report {tmp_path / 'r.md'} was not written by this job" in done.stderr, done.stderr
    assert "error: this job's reports were not written" in done.stderr
    assert "cluster launcher-test" not in done.stderr          # never the earlier job's summary
    # The coordinator refuses a report path it cannot write before the command starts.
    done = _fgpu(["--report", "r.json", "--", "sh", "-c", "touch ran"], tmp_path, shim_library)
    assert done.returncode == 2 and "r.json is a directory" in done.stderr, done.stderr
    assert not (tmp_path / "ran").exists()
    # A failing command keeps its own status.
    shutil.rmtree(tmp_path / "r.json")
    done = _fgpu(["-q", "--report", "r.json", "--", "sh", "-c", "mkdir r.json; exit 5"], tmp_path, shim_library)
    assert done.returncode == 5 and "this job's reports were not written" in done.stderr, done.stderr


def test_exit_status_propagates(tmp_path, job, shim_library):
    env = dict(os.environ, JOB_WORLD="2", JOB_OUT_DIR=str(tmp_path / "out"), JOB_EXIT="7")
    done = _fgpu(["-q", "--", sys.executable, str(job)], tmp_path, shim_library, env=env)
    assert done.returncode == 7, done.stderr
    done = _fgpu(["-q", "--", sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
                 tmp_path, shim_library)
    assert done.returncode == 128 + signal.SIGKILL


def test_command_not_found(tmp_path, shim_library):
    done = _fgpu(["--", "no-such-program-fgpu"], tmp_path, shim_library)
    assert done.returncode == 127 and "command not found: no-such-program-fgpu" in done.stderr
    (tmp_path / "not-executable").write_text("#!/bin/sh\n")
    done = _fgpu(["-q", "--", "./not-executable"], tmp_path, shim_library)
    assert done.returncode == 126 and "not executable" in done.stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_signals_are_forwarded_and_coordinator_stopped(tmp_path, shim_library, signum):
    """Not on a terminal, so SIGINT is forwarded too (on a terminal Ctrl-C reaches the command
    directly and fgpu does not repeat it)."""
    script = tmp_path / "sleeper.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, sys, time
        def bye(signum, frame):
            open("got-signal", "w").write(str(signum))
            sys.exit(3)
        signal.signal({int(signum)}, bye)
        # Written whole and then renamed: the test polls for the name and must never read it half-written.
        open("ready.part", "w").write(os.environ["FAKEGPU_COORDINATOR_ADDR"])
        os.replace("ready.part", "ready")
        time.sleep(120)
    """))
    env = dict(os.environ)
    env["FAKEGPU_NCCL_LIBRARY"] = shim_library
    env["PYTHONPATH"] = str(REPO_ROOT)
    proc = subprocess.Popen([sys.executable, "-m", "fakegpu", "run", "-q", "--", sys.executable, str(script)],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready").exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the command never started"
            time.sleep(0.05)
        socket_path = Path((tmp_path / "ready").read_text())
        assert socket_path.is_absolute(), f"FAKEGPU_COORDINATOR_ADDR is not a socket path: {socket_path}"
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, err
    assert (tmp_path / "got-signal").read_text() == str(int(signum))
    assert not socket_path.parent.exists(), "coordinator directory left behind"


def test_reuses_a_running_coordinator(tmp_path, job, shim_library):
    token_file = tmp_path / "token"
    sock = tmp_path / "shared.sock"
    env = dict(os.environ, FAKEGPU_NCCL_LIBRARY=shim_library, PYTHONPATH=str(REPO_ROOT))
    keeper = _fgpu(["--keep-coordinator", "--coordinator-addr", str(sock), "--token-file", str(token_file),
                    "--report", str(tmp_path / "shared.json"), "--", "true"], tmp_path, shim_library)
    assert keeper.returncode == 0, keeper.stderr
    assert "coordinator left running" in keeper.stderr and sock.exists()
    log_dir = Path(re.search(r"log (\S+)\)", keeper.stderr).group(1)).parent  # holds the coordinator's log
    assert token_file.stat().st_mode & 0o777 == 0o600
    try:
        out = tmp_path / "out"
        done = _fgpu(["--coordinator-addr", str(sock), "--token-file", str(token_file), "--",
                      sys.executable, str(job)], tmp_path, shim_library,
                     env=dict(os.environ, JOB_WORLD="2", JOB_OUT_DIR=str(out)))
        assert done.returncode == 0, done.stderr
        assert "writes its reports when it is stopped" in done.stderr
        assert all(r["exact"] for r in _rank_results(out, 2))
        answered, detail = launcher.ping_coordinator(str(sock), token_file)
        assert answered, detail
    finally:
        stop = subprocess.run([sys.executable, "-m", "fakegpu", "coordinator", "--shutdown", str(sock),
                               "--token-file", str(token_file)], env=env, capture_output=True, text=True,
                              timeout=60)
        shutil.rmtree(log_dir, ignore_errors=True)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    deadline = time.monotonic() + 30
    while not (tmp_path / "shared.json").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    _check_report(tmp_path / "shared.json", world=2)


def test_stale_socket_is_replaced_but_other_files_are_not(tmp_path, job, shim_library):
    import socket

    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as dead:  # bound, never listening: what a killed coordinator leaves
        dead.bind(str(stale))
    done = _fgpu(["-q", "--coordinator-addr", str(stale), "--", sys.executable, str(job)], tmp_path, shim_library,
                 env=dict(os.environ, JOB_WORLD="2", JOB_OUT_DIR=str(tmp_path / "out")))
    assert done.returncode == 0, done.stderr
    assert all(r["exact"] for r in _rank_results(tmp_path / "out", 2))
    (tmp_path / "precious").write_text("not a socket")
    done = _fgpu(["--coordinator-addr", str(tmp_path / "precious"), "--", "true"], tmp_path, shim_library)
    assert done.returncode == 2 and "exists and is not a socket" in done.stderr
    assert (tmp_path / "precious").read_text() == "not a socket"


def test_fake_mode_starts_no_coordinator(tmp_path, shim_library):
    probe = "import json, os; print(json.dumps({k: v for k, v in os.environ.items() if k.startswith('FAKEGPU_')}))"
    done = _fgpu(["--dist-mode", "fake", "-q", "--", sys.executable, "-c", probe], tmp_path, shim_library,
                 env=dict(os.environ))
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["FAKEGPU_DIST_MODE"] == "fake"
    assert "FAKEGPU_COORDINATOR_ADDR" not in seen


def test_hostile_cluster_yaml_fails_fgpu_with_the_limit_not_a_traceback(tmp_path, shim_library):
    """50,000 nested brackets (on main: a RecursionError traceback relayed from the coordinator)."""
    (tmp_path / "deep.yaml").write_text("version: " + "[" * 50_000 + "]" * 50_000 + "\n")
    done = _fgpu(["--cluster-config", "deep.yaml", "--", "true"], tmp_path, shim_library, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "RecursionError" not in done.stderr, done.stderr
    assert f"{tmp_path / 'deep.yaml'}:1: <document>: nesting deeper than 64 levels (the limit for a cluster config)" \
        in done.stderr


# ---------------------------------------------------------------------------------------------
# fgpu doctor


def test_doctor_passes(tmp_path, shim_library):
    (tmp_path / "cluster.yaml").write_text(TWO_NODE_YAML)
    done = _fgpu(["doctor", "--no-torch", "--cluster-config", "cluster.yaml"], tmp_path, shim_library)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "[FAIL]" not in out and "all checks passed" in out
    assert "ncclGetVersion = 23007" in out
    assert "exports all 51 NCCL names torch imports" in out
    assert "answers ping" in out
    assert "2-rank float32 allreduce" in out
    assert f"LD_PRELOAD={shim_library}" in out
    assert f"FAKEGPU_CLUSTER_CONFIG={tmp_path / 'cluster.yaml'}" in out
    assert not (tmp_path / "fakegpu-report.json").exists(), "doctor must not write the user's report"


def test_doctor_reports_failures(tmp_path, shim_library):
    done = _fgpu(["doctor", "--no-torch", "--no-selftest"], tmp_path, str(tmp_path / "missing" / "libnccl.so.2"))
    assert done.returncode == 1
    assert "[FAIL]" in done.stdout and "check(s) failed" in done.stdout
    done = _fgpu(["doctor", "--no-torch", "--coordinator-addr", str(tmp_path / "none.sock")], tmp_path, shim_library)
    assert done.returncode == 1 and "no coordinator answers" in done.stdout


def test_doctor_pings_a_running_coordinator_with_its_token(tmp_path, shim_library, start_coordinator):
    coordinator = start_coordinator("unix")
    (tmp_path / "token").write_text(coordinator.token + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGPU_COORDINATOR")}
    args = ["doctor", "--no-torch", "--no-selftest", "--coordinator-addr", coordinator.address]
    done = _fgpu(args + ["--token-file", "token"], tmp_path, shim_library, env=env)
    assert done.returncode == 0 and f"coordinator at {coordinator.address} answers ping" in done.stdout, done.stdout
    done = _fgpu(args, tmp_path, shim_library, env=env)
    assert done.returncode == 1, done.stdout
    assert f"the coordinator at {coordinator.address} refused the ping: authentication required" in done.stdout
    assert '"pid"' not in done.stdout


def test_fgpu_console_script(tmp_path):
    """The `fgpu` console script of an installed fakegpu (pip install .) is the same program."""
    script = shutil.which("fgpu", path=os.path.dirname(sys.executable))
    if script is None:
        pytest.skip("the fgpu console script is not installed next to this interpreter (pip install .)")
    done = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0 and "usage: fgpu [options] [--] COMMAND" in done.stdout
    done = subprocess.run([script, "--mode", "turbo", "--", "true"], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    assert done.returncode == 2 and "unknown --mode 'turbo'" in done.stderr


def test_python_m_fakegpu_with_fgpu_options_first_is_fgpu(tmp_path, shim_library):
    """`python -m fakegpu --mode simulate -- CMD` launches CMD as `fgpu --mode simulate -- CMD` does
    (the usage doc calls the two launch styles equivalent); a bad option is fgpu's own error."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGPU_")}
    env.update(FAKEGPU_NCCL_LIBRARY=shim_library,
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    job = [sys.executable, "-c", "import os; print('job sees', os.environ['FAKEGPU_MODE'])"]
    done = subprocess.run([sys.executable, "-m", "fakegpu", "--mode", "simulate", "-q", "--", *job], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    assert "job sees simulate" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "fakegpu", "--no-such-option", "--", "true"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert bad.returncode == 2 and "unrecognized arguments: --no-such-option" in bad.stderr
    assert "unknown subcommand" not in bad.stderr


@pytest.mark.parametrize("var, value, expected", [
    ("FAKEGPU_COORDINATOR_ADDR", "relative.sock", "FAKEGPU_COORDINATOR_ADDR 'relative.sock': a unix socket address"),
    ("FAKEGPU_DEVICE_COUNT", "four", "FAKEGPU_DEVICE_COUNT expects a whole number, got 'four'"),
    ("FAKEGPU_MODE", "gpu", "unknown FAKEGPU_MODE 'gpu'"),
    ("FAKEGPU_CLUSTER_CONFIG", "nope.yaml", "FAKEGPU_CLUSTER_CONFIG nope.yaml: no such file"),
])
def test_an_error_about_an_environment_variable_names_the_variable(tmp_path, var, value, expected):
    with pytest.raises(launcher.LaunchError) as err:
        _config([], tmp_path, {var: value})
    assert expected in str(err.value) and "--" not in str(err.value).split(":")[0]
    # The same value given as the option is reported as the option.
    flag = {"FAKEGPU_COORDINATOR_ADDR": "--coordinator-addr", "FAKEGPU_DEVICE_COUNT": "--device-count",
            "FAKEGPU_MODE": "--mode", "FAKEGPU_CLUSTER_CONFIG": "--cluster-config"}[var]
    with pytest.raises(launcher.LaunchError, match=flag):
        _config([flag, value], tmp_path)
