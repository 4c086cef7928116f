"""The FAKEGPU_* environment contract (fakegpu/env.py): defaults, parsing, clear errors."""
from __future__ import annotations

import pytest

from fakegpu.env import DEFAULT_TIMEOUT_MS, ConfigError, load_env, parse_size, parse_tcp_address


def test_defaults():
    env = load_env({})
    assert env.dist_mode == "simulate" and env.mode == "simulate"
    assert env.coordinator_transport == "unix" and env.coordinator_addr is None
    assert env.coordinator_timeout_ms == DEFAULT_TIMEOUT_MS == 600_000
    assert env.staging_chunk_bytes is None   # the coordinator chooses
    assert not env.staging_force_socket and env.cluster_report_max_operations == 4096
    with pytest.raises(ConfigError, match="FAKEGPU_COORDINATOR_ADDR is not set"):
        env.require_coordinator()


def test_full_environment(tmp_path):
    tok = tmp_path / "tok"
    tok.write_text("abc\n")
    env = load_env({
        "FAKEGPU_MODE": "hybrid", "FAKEGPU_DIST_MODE": "simulate",
        "FAKEGPU_COORDINATOR_TRANSPORT": "tcp", "FAKEGPU_COORDINATOR_ADDR": "10.0.0.1:29591",
        "FAKEGPU_COORDINATOR_TIMEOUT_MS": "60000", "FAKEGPU_COORDINATOR_TOKEN_FILE": str(tok),
        "FAKEGPU_STAGING_CHUNK_BYTES": "16MiB", "FAKEGPU_STAGING_FORCE_SOCKET": "1",
        "FAKEGPU_CLUSTER_CONFIG": "c.yaml", "FAKEGPU_CLUSTER_REPORT_PATH": "r.json",
        "FAKEGPU_CLUSTER_REPORT_MARKDOWN_PATH": "r.md", "FAKEGPU_CLUSTER_REPORT_MAX_OPERATIONS": "0",
        "FAKEGPU_TRACE_PATH": "t.json", "FAKEGPU_DEVICE_COUNT": "2",
    })
    assert env.mode == "hybrid" and env.coordinator_transport == "tcp"
    assert env.tcp_address == ("10.0.0.1", 29591)
    assert env.coordinator_timeout_ms == 60000 and env.coordinator_token == "abc"
    assert env.staging_chunk_bytes == 16 << 20 and env.staging_force_socket
    assert env.cluster_report_max_operations == 0 and env.device_count == 2
    assert env.trace_path == "t.json"


@pytest.mark.parametrize("text, value", [
    ("4096", 4096), ("64K", 65536), ("16MiB", 16 << 20), ("16MB", 16_000_000), ("1.5GiB", 3 << 29),
    ("2 mib", 2 << 20),
])
def test_sizes(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("env, message", [
    ({"FAKEGPU_DIST_MODE": "fast"}, "FAKEGPU_DIST_MODE='fast' is not one of"),
    ({"FAKEGPU_COORDINATOR_TRANSPORT": "udp"}, "FAKEGPU_COORDINATOR_TRANSPORT='udp'"),
    ({"FAKEGPU_COORDINATOR_ADDR": "relative.sock"}, "must be an absolute socket path"),
    ({"FAKEGPU_COORDINATOR_TRANSPORT": "tcp", "FAKEGPU_COORDINATOR_ADDR": "host"}, "is not HOST:PORT"),
    ({"FAKEGPU_COORDINATOR_TRANSPORT": "tcp", "FAKEGPU_COORDINATOR_ADDR": "h:70000"}, "above 65535"),
    ({"FAKEGPU_COORDINATOR_TIMEOUT_MS": "soon"}, "FAKEGPU_COORDINATOR_TIMEOUT_MS='soon' is not an integer"),
    ({"FAKEGPU_COORDINATOR_TIMEOUT_MS": "0"}, "must be at least 1"),
    ({"FAKEGPU_STAGING_CHUNK_BYTES": "16 parsecs"}, "is not a size"),
    ({"FAKEGPU_STAGING_CHUNK_BYTES": "100"}, "below the minimum"),
    ({"FAKEGPU_STAGING_FORCE_SOCKET": "maybe"}, "is not a boolean"),
    ({"FAKEGPU_COORDINATOR_TOKEN": "a", "FAKEGPU_COORDINATOR_TOKEN_FILE": "/x"}, "only one of"),
    ({"FAKEGPU_COORDINATOR_TOKEN_FILE": "/nonexistent/tok"}, "cannot be read"),
    ({"FAKEGPU_DEVICE_COUNT": "0"}, "must be at least 1"),
])
def test_errors_name_the_variable(env, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_env(env)


def test_ipv6_address():
    assert parse_tcp_address("[::1]:5") == ("::1", 5)


# --------------------------------------------------------------------------- token files
# One rule for both readers (docs/usage.md, "Token files"), pinned by tests/token_file_vectors.json:
# the coordinator (fakegpu/env.py, also fgpu's launcher) and the shim (native/src/core/env.cc) must
# turn every file there into the same token, or refuse it with the same reason.

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from fakegpu import launcher  # noqa: E402

TOKEN_VECTORS = json.loads(Path(__file__).with_name("token_file_vectors.json").read_text())["vectors"]


def _token_file_bytes(vector: dict) -> bytes:
    if "contents_hex" in vector:
        return bytes.fromhex(vector["contents_hex"])
    return vector["contents"].encode("utf-8") * vector.get("repeat", 1)


def _expected_token(vector: dict) -> str:
    return vector["token"] * vector.get("token_repeat", 1)


def _write_token_file(tmp_path, vector: dict) -> Path:
    path = tmp_path / "token"
    path.write_bytes(_token_file_bytes(vector))
    return path


@pytest.mark.parametrize("vector", TOKEN_VECTORS, ids=[v["name"] for v in TOKEN_VECTORS])
def test_token_file_rule_in_the_coordinator_and_fgpu(tmp_path, vector):
    path = _write_token_file(tmp_path, vector)
    env = {"FAKEGPU_COORDINATOR_TOKEN_FILE": str(path)}
    if "error" in vector:
        with pytest.raises(ConfigError, match=f"FAKEGPU_COORDINATOR_TOKEN_FILE='{path}' {vector['error']}"):
            load_env(env)
        with pytest.raises(launcher.LaunchError, match=f"--token-file='{path}' {vector['error']}"):
            launcher.read_token(path)
    else:
        assert load_env(env).coordinator_token == _expected_token(vector)
        assert launcher.read_token(path) == _expected_token(vector)


# A rank that joins a one-rank communicator (HELLO, then COMM_INIT) through the real shim and
# runs one AllReduce; it prints OK or the shim's own error text.
_RANK = """
import sys
import numpy as np
from fakegpu.nccl import Nccl, NcclError
nccl = Nccl(sys.argv[1])
try:
    comm = nccl.comm_init_rank(1, nccl.get_unique_id(), 0)
    x = np.arange(4, dtype=np.float32)
    comm.all_reduce(x, x, 4, np.float32)
    print("OK" if x.tolist() == [0, 1, 2, 3] else f"WRONG {x}")
except NcclError as exc:
    print(f"ERROR {exc}")
"""


def _run_shim_rank(shim_library, coordinator, **token_env) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGPU_") and k not in ("RANK", "WORLD_SIZE")}
    env.update(coordinator.client_env)
    env.pop("FAKEGPU_COORDINATOR_TOKEN")
    env.update(token_env, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    done = subprocess.run([sys.executable, "-c", _RANK, shim_library], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip()


@pytest.fixture(scope="module")
def coordinator_for_token():
    """token -> a running coordinator that requires exactly that token (one per token)."""
    from helpers.coordinator import CoordinatorProcess

    running: dict = {}

    def get(token: str):
        if token not in running:
            running[token] = CoordinatorProcess("unix", extra_env={"FAKEGPU_COORDINATOR_TOKEN": token})
        return running[token]

    yield get
    for coordinator in running.values():
        coordinator.stop()


@pytest.mark.parametrize("vector", TOKEN_VECTORS, ids=[v["name"] for v in TOKEN_VECTORS])
def test_token_file_rule_in_the_shim(tmp_path, vector, shim_library, coordinator_for_token):
    """The shim reads the same token from the same file: the coordinator, which requires the
    vector's token exactly, lets the rank in; a file the rule refuses fails ncclCommInitRank
    with the same reason, before anything is sent."""
    path = _write_token_file(tmp_path, vector)
    if "error" in vector:
        coordinator = coordinator_for_token("s3cret")
        out = _run_shim_rank(shim_library, coordinator, FAKEGPU_COORDINATOR_TOKEN_FILE=str(path))
        assert out.startswith("ERROR") and "ncclInvalidUsage" in out, out
        assert f"FAKEGPU_COORDINATOR_TOKEN_FILE='{path}' {vector['error']}" in out, out
        assert "authentication failed" not in coordinator.log()
    else:
        coordinator = coordinator_for_token(_expected_token(vector))
        out = _run_shim_rank(shim_library, coordinator, FAKEGPU_COORDINATOR_TOKEN_FILE=str(path))
        assert out == "OK", f"{out}\n{coordinator.log()}"


def test_shim_refuses_both_token_variables_like_the_coordinator(tmp_path, shim_library, coordinator_for_token):
    path = _write_token_file(tmp_path, TOKEN_VECTORS[0])
    both = {"FAKEGPU_COORDINATOR_TOKEN": "s3cret", "FAKEGPU_COORDINATOR_TOKEN_FILE": str(path)}
    with pytest.raises(ConfigError, match="set only one of"):
        load_env(both)
    out = _run_shim_rank(shim_library, coordinator_for_token("s3cret"), **both)
    assert "set only one of FAKEGPU_COORDINATOR_TOKEN and FAKEGPU_COORDINATOR_TOKEN_FILE" in out, out
