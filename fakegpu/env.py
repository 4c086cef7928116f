"""The FAKEGPU_* environment contract, parsed once into a frozen dataclass.

Every variable is optional; a malformed value is a ``ConfigError`` that names the
variable, the value and what was expected, never a silent default.

Why the coordinator timeout defaults to 600000 ms (10 minutes): the timeout bounds how
long one rank may wait at a rendezvous for its peers. In a real training job one rank
can legitimately spend minutes between two collectives (a slow first step that compiles
kernels, checkpoint writing on rank 0, evaluation on one rank, data-loader stalls), and
a timeout that fires there kills a healthy job. Ten minutes matches torch's own NCCL
watchdog default, so fakegpu never fails earlier than the real stack would; tests and
CI that want fast failure set a small value explicitly.
"""
from __future__ import annotations

import os
import ipaddress
import re
from fractions import Fraction
from dataclasses import dataclass
from typing import Mapping, Optional

from fakegpu.wire_spec import SIZE_UNITS

DEFAULT_TIMEOUT_MS = 600_000
MIN_STAGING_CHUNK_BYTES = 4096
DEFAULT_REPORT_MAX_OPERATIONS = 4096

DIST_MODES = ("simulate", "passthrough", "disabled")
COMPUTE_MODES = ("simulate", "hybrid", "passthrough")
TRANSPORTS = ("unix", "tcp")


class ConfigError(ValueError):
    """An environment variable (or flag) holds a value we cannot use."""


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$", re.ASCII)
_SIZE_UNITS = SIZE_UNITS   # spec/env.py, generated into fakegpu/wire_spec.py and the shim


def parse_size(text: str, what: str = "size") -> int:
    """'4096', '16MiB', '16M' (binary), '16MB' (decimal), '1.5GiB' -> bytes."""
    m = _SIZE_RE.match(str(text))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ConfigError(
            f"{what}={text!r} is not a size (examples: 4096, 64K, 16MiB, 1.5GB; "
            f"units: {', '.join(u for u in _SIZE_UNITS if u)})")
    # Exact arithmetic, as in the shim's env::bytes (the same grammar, tests/vectors/size_vectors.json):
    # a float would round 16.000000000000001M to a whole number.
    value = Fraction(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
    if value.denominator != 1:
        raise ConfigError(f"{what}={text!r} is not a whole number of bytes")
    if value >= 1 << 64:
        raise ConfigError(f"{what}={text!r} is larger than 2^64 - 1 bytes")
    return int(value)


def parse_bool(text: str, what: str) -> bool:
    v = str(text).strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("", "0", "false", "no", "off"):
        return False
    raise ConfigError(f"{what}={text!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


def parse_int(text: str, what: str, minimum: Optional[int] = None) -> int:
    try:
        value = int(str(text).strip(), 0)
    except ValueError:
        raise ConfigError(f"{what}={text!r} is not an integer") from None
    if minimum is not None and value < minimum:
        raise ConfigError(f"{what}={text!r} must be at least {minimum}")
    return value


def parse_tcp_address(text: str, what: str = "address") -> tuple[str, int]:
    """'host:port' or '[v6addr]:port' -> (host, port)."""
    text = str(text).strip()
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
    else:
        host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"{what}={text!r} is not HOST:PORT")
    port_no = parse_int(port, f"{what} port", minimum=0)
    if port_no > 65535:
        raise ConfigError(f"{what}={text!r}: port {port_no} is above 65535")
    return host, port_no


def is_loopback_host(host: str) -> bool:
    """True for names and addresses that never leave this machine."""
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class FakegpuEnv:
    mode: str = "simulate"
    dist_mode: str = "simulate"
    coordinator_transport: str = "unix"
    coordinator_addr: Optional[str] = None
    coordinator_timeout_ms: int = DEFAULT_TIMEOUT_MS
    coordinator_token: str = ""
    # None: the coordinator chooses, smaller for large worlds (docs/protocol.md, "Staging size")
    staging_chunk_bytes: Optional[int] = None
    staging_force_socket: bool = False
    cluster_config: Optional[str] = None
    cluster_report_path: Optional[str] = None
    cluster_report_markdown_path: Optional[str] = None
    cluster_report_max_operations: int = DEFAULT_REPORT_MAX_OPERATIONS
    trace_path: Optional[str] = None
    device_count: Optional[int] = None

    @property
    def tcp_address(self) -> tuple[str, int]:
        if self.coordinator_addr is None:
            raise ConfigError("FAKEGPU_COORDINATOR_ADDR is not set")
        return parse_tcp_address(self.coordinator_addr, "FAKEGPU_COORDINATOR_ADDR")

    def require_coordinator(self) -> str:
        """The coordinator address, or a ConfigError saying how to provide one."""
        if self.dist_mode == "simulate" and not self.coordinator_addr:
            raise ConfigError(
                "FAKEGPU_COORDINATOR_ADDR is not set: start a coordinator "
                "(`python -m fakegpu coordinator --transport unix --address PATH`) or launch the job "
                "with `fgpu -- COMMAND`, which starts one and sets the variable")
        return self.coordinator_addr or ""


def _choice(env: Mapping[str, str], name: str, choices: tuple, default: str) -> str:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value not in choices:
        raise ConfigError(f"{name}={raw!r} is not one of: {', '.join(choices)}")
    return value


def _path(env: Mapping[str, str], name: str) -> Optional[str]:
    raw = env.get(name)
    return raw if raw else None


def read_token(env: Mapping[str, str]) -> str:
    """FAKEGPU_COORDINATOR_TOKEN as it is, else the token in FAKEGPU_COORDINATOR_TOKEN_FILE."""
    token = env.get("FAKEGPU_COORDINATOR_TOKEN", "")
    token_file = env.get("FAKEGPU_COORDINATOR_TOKEN_FILE", "")
    if token and token_file:
        raise ConfigError("set only one of FAKEGPU_COORDINATOR_TOKEN and FAKEGPU_COORDINATOR_TOKEN_FILE")
    if token_file:
        return read_token_file(token_file, "FAKEGPU_COORDINATOR_TOKEN_FILE")
    return token


# The token-file rule (docs/usage.md, "Token files"), shared with the shim (native/src/core/env.cc,
# env::token_from_file_contents) and pinned for both by tests/vectors/token_file_vectors.json.
TOKEN_FILE_MAX_BYTES = 4096
TOKEN_FILE_WHITESPACE = b" \t\n\r\v\f"   # ASCII only: a non-breaking space is part of the token


def token_from_file_contents(raw: bytes, what: str = "token file") -> str:
    """The token a token file holds: its bytes without ASCII whitespace at either end, which must
    leave one non-empty line of UTF-8 text."""
    if len(raw) > TOKEN_FILE_MAX_BYTES:
        raise ConfigError(f"{what} is larger than {TOKEN_FILE_MAX_BYTES} bytes; a token file holds one token")
    token = raw.strip(TOKEN_FILE_WHITESPACE)
    if not token:
        raise ConfigError(f"{what} is empty")
    if b"\n" in token or b"\r" in token:
        raise ConfigError(f"{what} holds more than one line; a token file holds one token")
    try:
        return token.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{what} is not UTF-8 text") from None


def read_token_file(path, what: str = "token file") -> str:
    try:
        with open(path, "rb") as fh:
            raw = fh.read(TOKEN_FILE_MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{what}={str(path)!r} cannot be read: {exc.strerror or exc}") from None
    return token_from_file_contents(raw, f"{what}={str(path)!r}")


def load_env(env: Optional[Mapping[str, str]] = None) -> FakegpuEnv:
    env = os.environ if env is None else env
    transport = _choice(env, "FAKEGPU_COORDINATOR_TRANSPORT", TRANSPORTS, "unix")
    addr = env.get("FAKEGPU_COORDINATOR_ADDR") or None
    if addr is not None:
        if transport == "unix" and not os.path.isabs(addr):
            raise ConfigError(
                f"FAKEGPU_COORDINATOR_ADDR={addr!r} must be an absolute socket path when "
                "FAKEGPU_COORDINATOR_TRANSPORT=unix")
        if transport == "tcp":
            parse_tcp_address(addr, "FAKEGPU_COORDINATOR_ADDR")
    timeout = DEFAULT_TIMEOUT_MS
    if env.get("FAKEGPU_COORDINATOR_TIMEOUT_MS", "").strip():
        timeout = parse_int(env["FAKEGPU_COORDINATOR_TIMEOUT_MS"], "FAKEGPU_COORDINATOR_TIMEOUT_MS", minimum=1)
    chunk = None
    if env.get("FAKEGPU_STAGING_CHUNK_BYTES", "").strip():
        chunk = parse_size(env["FAKEGPU_STAGING_CHUNK_BYTES"], "FAKEGPU_STAGING_CHUNK_BYTES")
        if chunk < MIN_STAGING_CHUNK_BYTES:
            raise ConfigError(
                f"FAKEGPU_STAGING_CHUNK_BYTES={env['FAKEGPU_STAGING_CHUNK_BYTES']!r} is below the "
                f"minimum of {MIN_STAGING_CHUNK_BYTES} bytes")
    max_ops = DEFAULT_REPORT_MAX_OPERATIONS
    if env.get("FAKEGPU_CLUSTER_REPORT_MAX_OPERATIONS", "").strip():
        max_ops = parse_int(env["FAKEGPU_CLUSTER_REPORT_MAX_OPERATIONS"],
                            "FAKEGPU_CLUSTER_REPORT_MAX_OPERATIONS", minimum=0)
    device_count = None
    if env.get("FAKEGPU_DEVICE_COUNT", "").strip():
        device_count = parse_int(env["FAKEGPU_DEVICE_COUNT"], "FAKEGPU_DEVICE_COUNT", minimum=1)
    return FakegpuEnv(
        mode=_choice(env, "FAKEGPU_MODE", COMPUTE_MODES, "simulate"),
        dist_mode=_choice(env, "FAKEGPU_DIST_MODE", DIST_MODES, "simulate"),
        coordinator_transport=transport,
        coordinator_addr=addr,
        coordinator_timeout_ms=timeout,
        coordinator_token=read_token(env),
        staging_chunk_bytes=chunk,
        staging_force_socket=parse_bool(env.get("FAKEGPU_STAGING_FORCE_SOCKET", ""), "FAKEGPU_STAGING_FORCE_SOCKET"),
        cluster_config=_path(env, "FAKEGPU_CLUSTER_CONFIG"),
        cluster_report_path=_path(env, "FAKEGPU_CLUSTER_REPORT_PATH"),
        cluster_report_markdown_path=_path(env, "FAKEGPU_CLUSTER_REPORT_MARKDOWN_PATH"),
        cluster_report_max_operations=max_ops,
        trace_path=_path(env, "FAKEGPU_TRACE_PATH"),
        device_count=device_count,
    )
