"""`python -m fakegpu bandwidth` end to end: the table, JSON, every collective's #wrong check,
parameter disagreement between separately started ranks, and the TCP --listen form."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.shim import REPO_ROOT

OPS = ("allreduce", "broadcast", "reduce", "allgather", "reducescatter", "alltoall", "gather",
       "scatter", "sendrecv")


def _env(shim_library: str, extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["FAKEGPU_NCCL_LIBRARY"] = shim_library
    env["FAKEGPU_COORDINATOR_TIMEOUT_MS"] = "60000"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.update(extra or {})
    return env


def _bandwidth(args: list[str], env: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fakegpu", "bandwidth", *args], env=env,
                          cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=timeout)


def test_local_sweep_table_and_json(shim_library, tmp_path):
    out = tmp_path / "bw.json"
    done = _bandwidth(["--ranks", "2", "--op", "allreduce", "-b", "1K", "-e", "64K", "-f", "8",
                       "-n", "3", "-w", "1", "--json", str(out)], _env(shim_library))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "algbw" in done.stdout and "busbw" in done.stdout and "#wrong" in done.stdout
    doc = json.loads(out.read_text())
    assert [row["size"] for row in doc["rows"]] == [1024, 8192, 65536]
    assert doc["world_size"] == 2 and doc["op"] == "allreduce"
    for row in doc["rows"]:
        for placement in ("out_of_place", "in_place"):
            cell = row[placement]
            assert cell["wrong"] == 0
            assert cell["time_us"] > 0
            assert cell["busbw"] == pytest.approx(cell["algbw"] * 1.0)  # 2(n-1)/n = 1 for n=2


@pytest.mark.parametrize("op", OPS)
def test_every_op_checks_clean(shim_library, start_coordinator, op):
    coordinator = start_coordinator("unix")
    env = _env(shim_library, coordinator.client_env)
    done = _bandwidth(["--connect", coordinator.address, "--world-size", "3", "--op", op,
                       "--root", "1", "-b", "3K", "-e", "48K", "-f", "16", "-n", "2", "-w", "1",
                       "--session", f"ops-{op}"], env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Out of bounds values : 0 OK" in done.stdout, done.stdout


@pytest.mark.parametrize("dtype,redop", [("bfloat16", "sum"), ("int8", "avg"),
                                         ("float8e4m3", "max"), ("float64", "prod")])
def test_dtypes_and_redops_check_clean(shim_library, start_coordinator, dtype, redop):
    coordinator = start_coordinator("unix")
    env = _env(shim_library, coordinator.client_env)
    done = _bandwidth(["--connect", coordinator.address, "--world-size", "4", "--dtype", dtype,
                       "--redop", redop, "--size", "8K", "-n", "2", "-w", "0",
                       "--session", "dtypes"], env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Out of bounds values : 0 OK" in done.stdout


def _two_hosts(shim_library, coordinator, flags0: list[str], flags1: list[str]):
    env = _env(shim_library, coordinator.client_env)
    base = [sys.executable, "-m", "fakegpu", "bandwidth", "--connect", coordinator.address,
            "--world-size", "2", "-n", "2", "-w", "0"]
    procs = [subprocess.Popen(base + ["--ranks", str(r)] + flags, env=env, cwd=str(REPO_ROOT),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r, flags in enumerate((flags0, flags1))]
    outputs = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        outputs.append((proc.returncode, out, err))
    return outputs


def test_separately_started_ranks_meet_by_session(shim_library, start_coordinator):
    coordinator = start_coordinator("unix")
    flags = ["--session", "meet", "--size", "64K"]
    results = _two_hosts(shim_library, coordinator, flags, flags)
    for code, out, err in results:
        assert code == 0, out + err
        assert "Out of bounds values : 0 OK" in out


@pytest.mark.parametrize("differ,expect", [
    (("--size", "64K", "--size", "128K"), "smallest size differs"),
    (("--size", "64K", "--size", "64K", "-n", "3"), "iterations differs"),
    (("--size", "64K", "--size", "64K", "--session", "other"), "session differs"),
])
def test_mismatched_hosts_are_reported(shim_library, start_coordinator, differ, expect):
    coordinator = start_coordinator("unix")
    flags0 = ["--session", "mismatch", differ[0], differ[1]]
    flags1 = ["--session", "mismatch", *differ[2:]]
    for code, out, err in _two_hosts(shim_library, coordinator, flags0, flags1):
        assert code == 2, out + err
        assert expect in err, err


def test_session_required_for_partial_ranks(shim_library):
    done = _bandwidth(["--connect", "127.0.0.1:1", "--world-size", "2", "--ranks", "0"],
                      _env(shim_library))
    assert done.returncode == 2 and "--session" in done.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_listen_tcp_two_logical_nodes(shim_library, tmp_path):
    out, report = tmp_path / "bw.json", tmp_path / "cluster.json"
    done = _bandwidth(["--listen", f"127.0.0.1:{_free_port()}", "--nodes", "2",
                       "--ranks-per-node", "1", "--size", "1MiB", "--warmup", "1",
                       "--iterations", "3", "--json", str(out), "--cluster-report", str(report)],
                      _env(shim_library))
    if done.returncode != 0 and "unrecognized arguments" in done.stderr:
        pytest.skip(f"the coordinator has no TCP --listen yet: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads(out.read_text())
    assert doc["transport"] == "tcp" and doc["world_size"] == 2
    assert doc["rows"][0]["out_of_place"]["wrong"] == 0
    assert report.is_file(), done.stdout + done.stderr


class _BrokenComm:
    """Stands in for a 1-rank communicator whose allreduce writes zeros (a wrong result)."""

    def all_reduce(self, send, recv, count, dtype, op):
        recv[:count] = 0


class _IdentityComm:
    """A correct 1-rank communicator: the allreduce of one rank is its input."""

    def all_reduce(self, send, recv, count, dtype, op):
        recv[:count] = send[:count]


@pytest.mark.parametrize("in_place", [False, True])
def test_wrong_results_are_counted(in_place):
    from fakegpu.cli import bandwidth as bw

    args = bw.build_parser().parse_args(["--ranks", "1", "--size", "4K"])
    sweep = bw.resolve_sweep(args, 1)
    bufs = bw._Buffers(sweep, 1)
    assert bw._count_wrong(_IdentityComm(), None, sweep, bufs, 1024, 0, 1, in_place) == 0
    assert bw._count_wrong(_BrokenComm(), None, sweep, bufs, 1024, 0, 1, in_place) == 1024


def test_flag_errors_are_clear(capsys):
    from fakegpu.cli import bandwidth as bw

    assert bw.main(["--op", "allshuffle"]) == 2
    assert "unknown collective" in capsys.readouterr().err
    assert bw.main(["--dtype", "float128"]) == 2
    assert "unknown datatype" in capsys.readouterr().err
    assert bw.main(["--world-size", "2", "--ranks", "5", "--connect", "h:1", "--session", "s"]) == 2
    assert "outside 0..1" in capsys.readouterr().err
    assert bw.main(["--nodes", "2", "--ranks-per-node", "2", "--world-size", "3"]) == 2
    assert "disagrees" in capsys.readouterr().err
    assert bw.main(["--size", "4K", "-b", "1K"]) == 2
    assert "--size" in capsys.readouterr().err


def test_busbw_factors_follow_nccl_tests():
    from fakegpu.cli.bandwidth import OPS

    assert OPS["allreduce"].busbw_factor(4) == pytest.approx(1.5)
    for name in ("allgather", "reducescatter", "alltoall", "gather", "scatter"):
        assert OPS[name].busbw_factor(4) == pytest.approx(0.75)
    for name in ("broadcast", "reduce", "sendrecv"):
        assert OPS[name].busbw_factor(4) == 1.0
