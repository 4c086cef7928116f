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
