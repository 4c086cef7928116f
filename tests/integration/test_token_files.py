"""One token-file rule for both readers (docs/usage.md, "Token files"), pinned by
tests/vectors/token_file_vectors.json: the coordinator (fakegpu/env.py, also fgpu's launcher) and
the shim (native/src/core/env.cc) must turn every file there into the same token, or refuse it
with the same reason. The shim's side runs a real rank process against a real coordinator."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fakegpu import launcher
from fakegpu.env import ConfigError, load_env
from helpers.coordinator import CoordinatorProcess
from helpers.paths import REPO_ROOT, VECTORS

TOKEN_VECTORS = json.loads((VECTORS / "token_file_vectors.json").read_text())["vectors"]


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
    env.update(token_env, PYTHONPATH=str(REPO_ROOT))
    done = subprocess.run([sys.executable, "-c", _RANK, shim_library], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip()


@pytest.fixture(scope="module")
def coordinator_for_token():
    """token -> a running coordinator that requires exactly that token (one per token)."""
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
