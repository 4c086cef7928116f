"""Launch a command under fakegpu: coordinator lifecycle, rank environment, signals, reports.

`fgpu` (fakegpu/cli/run.py) and `fgpu doctor` (fakegpu/cli/doctor.py) are thin front ends
over this module. The pieces, in the order `launch()` uses them:

* `LaunchConfig` — validated options, every path already absolute (we never change
  directory, so a relative path given on the command line must mean the same thing to the
  ranks, the coordinator and us).
* `CoordinatorProcess` — starts `python -m fakegpu coordinator` on a Unix socket inside a
  private 0700 directory (or on TCP), waits for its "listening on" line, stops it with
  SIGTERM so that it writes its reports.
* `rank_environment()` — the FAKEGPU_* variables, LD_PRELOAD and PYTHONPATH the command gets.
* `run_command()` — runs the command, forwards SIGINT/SIGTERM/SIGHUP, returns its exit code.
"""
from __future__ import annotations

import collections
import ctypes
import dataclasses
import importlib.util
import json
import os
import queue
import re
import secrets
import shutil
import signal
import site
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

import fakegpu
from fakegpu import _deps
from fakegpu.env import is_loopback_host, parse_size, parse_tcp_address  # noqa: F401 (re-exported)

# passthrough: the program computes on its real GPU and fakegpu fakes nothing; it pairs with
# a real-NCCL distribution mode (passthrough, the default with it, or proxy).
COMPUTE_MODES = ("simulate", "hybrid", "passthrough")
REAL_NCCL_DIST_MODES = ("passthrough", "proxy")
# Distribution modes, and whether each one needs a coordinator. fake and real_pp_fake_spmd
# complete the fake axes inside each process (the real pipeline traffic of the latter goes
# through torch's own backend) and write the report themselves; passthrough lets real NCCL
# work and keeps per-rank accounting in the shim.
DIST_MODES = {"simulate": True, "proxy": True, "passthrough": False, "fake": False, "real_pp_fake_spmd": False}
DEFAULT_MEMORY_CAPTURE_NAME = "fakegpu-memory.json"
TRANSPORTS = ("unix", "tcp")

DEFAULT_REPORT_NAME = "fakegpu-report.json"
DEFAULT_STARTUP_TIMEOUT_S = 60.0
DEFAULT_STOP_TIMEOUT_S = 60.0
READY_MARKER = "fakegpu coordinator listening on"
# sockaddr_un.sun_path is 108 bytes including the terminating NUL.
UNIX_PATH_MAX = 107

_LOG_PREFIX = "fgpu: "


class LaunchError(Exception):
    """A problem with the user's options or environment; the message says what to fix."""

    exit_status = 2


class CommandNotRunnable(LaunchError):
    """The command could not be started; exit status as a shell gives it (127 / 126)."""

    def __init__(self, message: str, exit_status: int):
        super().__init__(message)
        self.exit_status = exit_status


# ---------------------------------------------------------------------------------------------
# Parsing helpers


def guess_transport(address: str) -> str:
    """'unix' for something that looks like a path, 'tcp' for HOST:PORT."""
    if address.startswith(("/", ".", "~")) or "/" in address:
        return "unix"
    try:
        parse_tcp_address(address)
        return "tcp"
    except ValueError:
        return "unix"


# ---------------------------------------------------------------------------------------------
# Configuration


@dataclasses.dataclass
class LaunchConfig:
    mode: str = "simulate"
    dist_mode: str = "simulate"
    cluster_config: Optional[Path] = None
    transport: str = "unix"
    coordinator_addr: Optional[str] = None   # a running coordinator, or where to start one
    listen: Optional[str] = None             # TCP address to start a coordinator on
    timeout_ms: Optional[int] = None
    report: Path = dataclasses.field(default_factory=lambda: Path.cwd() / DEFAULT_REPORT_NAME)
    markdown_report: Optional[Path] = None
    trace: Optional[Path] = None
    device_count: Optional[int] = None
    staging_chunk_bytes: Optional[int] = None
    force_socket_staging: bool = False
    token_file: Optional[Path] = None
    keep_coordinator: bool = False
    memory_capture: Optional[Path] = None
    max_operations: Optional[int] = None
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
    verbose: bool = False
    quiet: bool = False

    @property
    def needs_coordinator(self) -> bool:
        return DIST_MODES[self.dist_mode]

    @property
    def markdown_path(self) -> Path:
        return self.markdown_report or self.report.with_suffix(".md")


def add_launch_options(parser) -> None:
    """The options `fgpu` and `fgpu doctor` share (they must describe the same launch)."""
    g = parser.add_argument_group("fakegpu options")
    g.add_argument("--mode", default=None, metavar="MODE",
                   help=f"compute mode, FAKEGPU_MODE: {' | '.join(COMPUTE_MODES)} (default simulate)")
    g.add_argument("--dist-mode", default=None, metavar="MODE",
                   help=f"distribution mode, FAKEGPU_DIST_MODE: {' | '.join(DIST_MODES)} (default simulate)")
    g.add_argument("--cluster-config", metavar="YAML", help="cluster topology YAML (FAKEGPU_CLUSTER_CONFIG)")
    g.add_argument("--coordinator-transport", choices=None, metavar="unix|tcp", default=None,
                   help="how ranks reach the coordinator (default unix; tcp for several hosts)")
    g.add_argument("--coordinator-addr", metavar="ADDR",
                   help="use the coordinator at ADDR (absolute socket path or HOST:PORT) if one answers "
                        "there; otherwise start one at ADDR")
    g.add_argument("--listen", metavar="HOST:PORT",
                   help="start a TCP coordinator listening on HOST:PORT (implies --coordinator-transport tcp)")
    g.add_argument("--coordinator-timeout-ms", metavar="MS",
                   help="rendezvous and operation timeout (FAKEGPU_COORDINATOR_TIMEOUT_MS)")
    g.add_argument("--report", metavar="PATH",
                   help=f"JSON cluster report (default ./{DEFAULT_REPORT_NAME})")
    g.add_argument("--markdown-report", metavar="PATH", help="Markdown report (default: the JSON path with .md)")
    g.add_argument("--trace", metavar="PATH", help="Chrome-trace / Perfetto timeline (FAKEGPU_TRACE_PATH)")
    g.add_argument("--max-operations", metavar="N",
                   help="operations kept in the report timeline (FAKEGPU_CLUSTER_REPORT_MAX_OPERATIONS)")
    g.add_argument("--device-count", metavar="N", help="fake devices per process (FAKEGPU_DEVICE_COUNT)")
    g.add_argument("--staging-chunk-bytes", metavar="SIZE",
                   help="staging chunk size, e.g. 64MiB (FAKEGPU_STAGING_CHUNK_BYTES)")
    g.add_argument("--force-socket-staging", action="store_true",
                   help="send payloads through the socket, not shared memory (FAKEGPU_STAGING_FORCE_SOCKET=1)")
    g.add_argument("--token-file", metavar="PATH",
                   help="file holding the coordinator token (created 0600 if missing when fgpu starts "
                        "the coordinator); share it with the other hosts of a multi-host run")
    g.add_argument("--capture-memory", action="store_true",
                   help=f"write memory captures (fakegpu.fake.memory.capture) to ./{DEFAULT_MEMORY_CAPTURE_NAME} "
                        "(FAKEGPU_MEMORY_CAPTURE_PATH)")
    g.add_argument("--memory-capture-path", metavar="PATH",
                   help="where --capture-memory writes (implies --capture-memory)")
    g.add_argument("--keep-coordinator", action="store_true",
                   help="leave the coordinator fgpu started running after the command ends")
    g.add_argument("--coordinator-startup-timeout", metavar="SECONDS", default=None,
                   help=f"how long to wait for the coordinator to listen (default {DEFAULT_STARTUP_TIMEOUT_S:g})")
    g.add_argument("-v", "--verbose", action="store_true", help="show the coordinator's log and the environment")
    g.add_argument("-q", "--quiet", action="store_true", help="print no report summary")


def _positive_int(value, flag: str, allow_zero: bool = False) -> int:
    try:
        number = int(str(value).strip())
    except ValueError:
        raise LaunchError(f"{flag} expects a whole number, got {value!r}") from None
    if number < 0 or (number == 0 and not allow_zero):
        raise LaunchError(f"{flag} must be {'>= 0' if allow_zero else '> 0'}, got {number}")
    return number


def _absolute(path: str, cwd: Path) -> Path:
    expanded = Path(os.path.expanduser(path))
    return expanded if expanded.is_absolute() else (cwd / expanded)


def _check_writable_parent(path: Path, flag: str) -> None:
    parent = path.parent
    if not parent.is_dir():
        raise LaunchError(f"{flag} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise LaunchError(f"{flag} {path}: directory {parent} is not writable")


def config_from_args(ns, cwd: Optional[Path] = None, environ: Optional[Mapping[str, str]] = None) -> LaunchConfig:
    """Validate parsed options into a LaunchConfig; raise LaunchError naming the bad option.

    Options left unset fall back to the FAKEGPU_* variable of the same meaning in `environ`,
    so `FAKEGPU_CLUSTER_CONFIG=x.yaml fgpu ...` works like `--cluster-config x.yaml`.
    """
    cwd = Path.cwd() if cwd is None else cwd
    env = os.environ if environ is None else environ

    # Where each setting came from, so that an error names what the user wrote: the option, or
    # the environment variable ("FAKEGPU_COORDINATOR_ADDR=x", not "--coordinator-addr x").
    given_as: dict = {}

    def pick(flag_value, var, flag=None):
        if flag_value not in (None, ""):
            return flag_value
        value = env.get(var) or None
        if value is not None and flag is not None:
            given_as[flag] = var
        return value

    def said(flag: str) -> str:
        return given_as.get(flag, flag)

    cfg = LaunchConfig(report=cwd / DEFAULT_REPORT_NAME)

    mode = pick(ns.mode, "FAKEGPU_MODE", "--mode") or "simulate"
    if mode not in COMPUTE_MODES:
        raise LaunchError(f"unknown {said('--mode')} {mode!r}; choose one of: {', '.join(COMPUTE_MODES)}")
    cfg.mode = mode

    dist_mode = pick(ns.dist_mode, "FAKEGPU_DIST_MODE", "--dist-mode") or (
        "passthrough" if mode == "passthrough" else "simulate")
    if dist_mode not in DIST_MODES:
        raise LaunchError(f"unknown {said('--dist-mode')} {dist_mode!r}; choose one of: {', '.join(DIST_MODES)}")
    if mode == "passthrough" and dist_mode not in REAL_NCCL_DIST_MODES:
        raise LaunchError(f"{said('--mode')} passthrough computes on the real GPU with NVIDIA's NCCL, so "
                          f"{said('--dist-mode')} must be {' or '.join(REAL_NCCL_DIST_MODES)}, not {dist_mode!r} "
                          "(--mode hybrid keeps real compute and simulates the communication)")
    cfg.dist_mode = dist_mode

    cluster = pick(ns.cluster_config, "FAKEGPU_CLUSTER_CONFIG", "--cluster-config")
    if cluster:
        from fakegpu.topology.bundled import bundled_cluster_config, bundled_names

        path = _absolute(cluster, cwd)
        if not path.is_file():
            bundled = bundled_cluster_config(cluster)   # a name fakegpu ships, from any directory
            if bundled is None:
                shipped = ", ".join(bundled_names())
                raise LaunchError(f"{said('--cluster-config')} {cluster}: no such file ({path})"
                                  + (f"; fakegpu ships these, usable by name: {shipped}" if shipped else ""))
            path = bundled
        cfg.cluster_config = path

    transport = ns.coordinator_transport
    addr = ns.coordinator_addr
    if not addr and not ns.listen and env.get("FAKEGPU_COORDINATOR_ADDR"):
        # Already inside a fakegpu launch (or the variables were exported by hand): join it.
        addr = env["FAKEGPU_COORDINATOR_ADDR"]
        given_as["--coordinator-addr"] = "FAKEGPU_COORDINATOR_ADDR"
    if ns.listen:
        if transport not in (None, "tcp"):
            raise LaunchError("--listen starts a TCP coordinator; it cannot be combined with "
                              f"--coordinator-transport {transport}")
        if addr:
            raise LaunchError("give either --listen (start a coordinator) or --coordinator-addr, not both")
        transport = "tcp"
        try:
            parse_tcp_address(ns.listen)
        except ValueError as exc:
            raise LaunchError(f"--listen: {exc}") from None
        cfg.listen = ns.listen.strip()
    if transport is None:
        transport = (guess_transport(addr) if addr else None) or env.get("FAKEGPU_COORDINATOR_TRANSPORT") or "unix"
    if transport not in TRANSPORTS:
        raise LaunchError(f"unknown --coordinator-transport {transport!r}; choose unix or tcp")
    cfg.transport = transport

    if addr:
        if transport == "unix":
            expanded = os.path.expanduser(addr)
            if not os.path.isabs(expanded):
                raise LaunchError(
                    f"{said('--coordinator-addr')} {addr!r}: a unix socket address must be an absolute path "
                    f"(for example {cwd / 'fakegpu.sock'}); for TCP use HOST:PORT")
            if len(os.fsencode(expanded)) > UNIX_PATH_MAX:
                raise LaunchError(f"{said('--coordinator-addr')} {addr!r}: unix socket paths are limited to "
                                  f"{UNIX_PATH_MAX} bytes; choose a shorter path")
            if not Path(expanded).parent.is_dir():
                raise LaunchError(f"{said('--coordinator-addr')} {addr!r}: directory {Path(expanded).parent} does not exist")
            addr = expanded
        else:
            try:
                parse_tcp_address(addr)
            except ValueError as exc:
                raise LaunchError(f"{said('--coordinator-addr')} {addr!r}: {exc}") from None
        cfg.coordinator_addr = addr

    timeout = pick(ns.coordinator_timeout_ms, "FAKEGPU_COORDINATOR_TIMEOUT_MS", "--coordinator-timeout-ms")
    if timeout is not None:
        cfg.timeout_ms = _positive_int(timeout, said("--coordinator-timeout-ms"))

    report = pick(ns.report, "FAKEGPU_CLUSTER_REPORT_PATH")
    if report:
        cfg.report = _absolute(report, cwd)
    _check_writable_parent(cfg.report, "--report")
    md = pick(ns.markdown_report, "FAKEGPU_CLUSTER_REPORT_MARKDOWN_PATH")
    if md:
        cfg.markdown_report = _absolute(md, cwd)
        _check_writable_parent(cfg.markdown_report, "--markdown-report")
    trace = pick(ns.trace, "FAKEGPU_TRACE_PATH")
    if trace:
        cfg.trace = _absolute(trace, cwd)
        _check_writable_parent(cfg.trace, "--trace")

    max_ops = pick(ns.max_operations, "FAKEGPU_CLUSTER_REPORT_MAX_OPERATIONS", "--max-operations")
    if max_ops is not None:
        cfg.max_operations = _positive_int(max_ops, said("--max-operations"), allow_zero=True)

    devices = pick(ns.device_count, "FAKEGPU_DEVICE_COUNT", "--device-count")
    if devices is not None:
        cfg.device_count = _positive_int(devices, said("--device-count"))

    chunk = pick(ns.staging_chunk_bytes, "FAKEGPU_STAGING_CHUNK_BYTES", "--staging-chunk-bytes")
    if chunk is not None:
        try:
            cfg.staging_chunk_bytes = parse_size(chunk)
        except ValueError as exc:
            raise LaunchError(f"{said('--staging-chunk-bytes')}: {exc}") from None
        if cfg.staging_chunk_bytes < 4096:
            raise LaunchError(f"{said('--staging-chunk-bytes')} {chunk}: must be at least 4096 bytes")
    force = env.get("FAKEGPU_STAGING_FORCE_SOCKET", "")
    cfg.force_socket_staging = bool(ns.force_socket_staging) or force.lower() in ("1", "true", "yes", "on")

    token_file = pick(ns.token_file, "FAKEGPU_COORDINATOR_TOKEN_FILE", "--token-file")
    if token_file:
        cfg.token_file = _absolute(token_file, cwd)
        if cfg.token_file.exists() and not cfg.token_file.is_file():
            raise LaunchError(f"{said('--token-file')} {token_file}: not a regular file")
        if not cfg.token_file.exists() and not cfg.token_file.parent.is_dir():
            raise LaunchError(f"{said('--token-file')} {token_file}: directory {cfg.token_file.parent} does not exist")

    capture = pick(ns.memory_capture_path, "FAKEGPU_MEMORY_CAPTURE_PATH")
    if capture or ns.capture_memory:
        cfg.memory_capture = _absolute(capture, cwd) if capture else cwd / DEFAULT_MEMORY_CAPTURE_NAME
        _check_writable_parent(cfg.memory_capture, "--memory-capture-path")

    cfg.keep_coordinator = bool(ns.keep_coordinator)
    if ns.coordinator_startup_timeout is not None:
        try:
            cfg.startup_timeout_s = float(ns.coordinator_startup_timeout)
        except ValueError:
            raise LaunchError("--coordinator-startup-timeout expects seconds, got "
                              f"{ns.coordinator_startup_timeout!r}") from None
        if cfg.startup_timeout_s <= 0:
            raise LaunchError("--coordinator-startup-timeout must be > 0")
    cfg.verbose = bool(ns.verbose)
    cfg.quiet = bool(ns.quiet)
    return cfg


# ---------------------------------------------------------------------------------------------
# Tokens


def read_token(path: Path) -> str:
    """The token in `path`, by the one token-file rule (fakegpu.env.read_token_file)."""
    from fakegpu.env import ConfigError, read_token_file

    try:
        return read_token_file(path, "--token-file")
    except ConfigError as exc:
        raise LaunchError(str(exc)) from None


def write_token_file(path: Path, token: Optional[str] = None) -> str:
    """Create `path` readable only by us (0600) holding a fresh random token; return the token."""
    token = token or secrets.token_hex(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(token + "\n")
    return token


def token_file_warning(path: Path) -> Optional[str]:
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        return (f"token file {path} is readable by other users (mode {stat.S_IMODE(mode):o}); "
                f"run `chmod 600 {path}`")
    return None


# ---------------------------------------------------------------------------------------------
# Where things are


def package_root() -> Path:
    """The directory that holds the fakegpu package."""
    return Path(fakegpu.__file__).resolve().parent.parent


def torch_autoload_dir() -> Optional[Path]:
    """Directory with the sitecustomize.py that registers the `fakegpu` torch backend, if shipped."""
    candidate = Path(fakegpu.__file__).resolve().parent / "torch" / "autoload"
    return candidate if (candidate / "sitecustomize.py").is_file() else None


def _package_on_default_path() -> bool:
    """True when a fresh interpreter would import this same fakegpu without PYTHONPATH help."""
    root = str(package_root())
    try:
        defaults = set(site.getsitepackages()) | {site.getusersitepackages()}
    except Exception:  # some virtualenv layouts lack getsitepackages
        defaults = set()
    return root in defaults


def _prepend_path_list(value: Optional[str], *entries: str) -> str:
    items = [e for e in entries if e]
    for existing in (value or "").split(os.pathsep):
        if existing and existing not in items:
            items.append(existing)
    return os.pathsep.join(items)


def python_path_for_children(base: Optional[str]) -> str:
    """PYTHONPATH so child interpreters import this fakegpu (and its torch autoload hook)."""
    entries = []
    autoload = torch_autoload_dir()
    if autoload is not None:
        entries.append(str(autoload))
    if not _package_on_default_path():
        entries.append(str(package_root()))
    return _prepend_path_list(base, *entries)


# ---------------------------------------------------------------------------------------------
# Environment for the ranks


@dataclasses.dataclass
class Endpoint:
    transport: str
    address: str


def fakegpu_variables(cfg: LaunchConfig, endpoint: Optional[Endpoint], token_file: Optional[Path]) -> dict[str, str]:
    """The FAKEGPU_* variables describing this launch (ranks and coordinator both get them)."""
    env = {
        "FAKEGPU_MODE": cfg.mode,
        "FAKEGPU_DIST_MODE": cfg.dist_mode,
        "FAKEGPU_CLUSTER_REPORT_PATH": str(cfg.report),
        "FAKEGPU_CLUSTER_REPORT_MARKDOWN_PATH": str(cfg.markdown_path),
    }
    if endpoint is not None:
        env["FAKEGPU_COORDINATOR_TRANSPORT"] = endpoint.transport
        env["FAKEGPU_COORDINATOR_ADDR"] = endpoint.address
    if token_file is not None:
        env["FAKEGPU_COORDINATOR_TOKEN_FILE"] = str(token_file)
    if cfg.timeout_ms is not None:
        env["FAKEGPU_COORDINATOR_TIMEOUT_MS"] = str(cfg.timeout_ms)
    if cfg.cluster_config is not None:
        env["FAKEGPU_CLUSTER_CONFIG"] = str(cfg.cluster_config)
    if cfg.trace is not None:
        env["FAKEGPU_TRACE_PATH"] = str(cfg.trace)
    if cfg.max_operations is not None:
        env["FAKEGPU_CLUSTER_REPORT_MAX_OPERATIONS"] = str(cfg.max_operations)
    if cfg.device_count is not None:
        env["FAKEGPU_DEVICE_COUNT"] = str(cfg.device_count)
    if cfg.staging_chunk_bytes is not None:
        env["FAKEGPU_STAGING_CHUNK_BYTES"] = str(cfg.staging_chunk_bytes)
    if cfg.force_socket_staging:
        env["FAKEGPU_STAGING_FORCE_SOCKET"] = "1"
    if cfg.memory_capture is not None:
        env["FAKEGPU_MEMORY_CAPTURE_PATH"] = str(cfg.memory_capture)
    return env


def rank_environment(cfg: LaunchConfig, endpoint: Optional[Endpoint], token_file: Optional[Path],
                     base: Optional[Mapping[str, str]] = None, shim: Optional[str] = None) -> dict[str, str]:
    """The complete environment of the user's command."""
    env = dict(os.environ if base is None else base)
    # A token given directly would override the file in the shim; drop a stale one from the caller.
    if token_file is not None:
        env.pop("FAKEGPU_COORDINATOR_TOKEN", None)
    env.update(fakegpu_variables(cfg, endpoint, token_file))
    # Fake CUDA devices for the ranks' torch (simulate mode only; a torch with a usable GPU
    # ignores it). FAKEGPU_FAKE_CUDA=0 in the caller's environment turns them off.
    if cfg.mode == "simulate":
        env.setdefault("FAKEGPU_FAKE_CUDA", "1")
    else:
        env["FAKEGPU_FAKE_CUDA"] = "0"
    shim = shim or fakegpu.nccl_library_path()
    env["FAKEGPU_NCCL_LIBRARY"] = shim
    preload = [p for p in re.split(r"[:\s]+", env.get("LD_PRELOAD", "")) if p and p != shim]
    env["LD_PRELOAD"] = ":".join([shim, *preload])
    env["PYTHONPATH"] = python_path_for_children(env.get("PYTHONPATH"))
    return env


# ---------------------------------------------------------------------------------------------
# The coordinator process


def _own_session() -> None:
    """preexec_fn: own session, so a terminal Ctrl-C cannot stop the coordinator before the
    ranks finish (fgpu stops it once the command has exited)."""
    os.setsid()


def _own_session_and_die_with_parent() -> None:
    """preexec_fn: as `_own_session`, plus SIGTERM when fgpu dies, so a killed fgpu leaves no orphan."""
    os.setsid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except Exception:
        pass


def coordinator_packages(cfg: LaunchConfig) -> None:
    """_deps.MissingPackage when this interpreter cannot run the coordinator ``cfg`` asks for."""
    needed = _deps.COORDINATOR + (_deps.CLUSTER_CONFIG if cfg.cluster_config is not None else ())
    _deps.check(needed, "the coordinator" + (" with a cluster config" if cfg.cluster_config is not None else ""))


def coordinator_command(python: str = sys.executable) -> list[str]:
    return [python, "-m", "fakegpu", "coordinator"]


# Variables that describe the ranks' side of the launch; the coordinator gets its address and
# token as flags, and a stale or rank-only value inherited from the shell must not reach it.
_RANK_ONLY_VARIABLES = ("FAKEGPU_MODE", "FAKEGPU_DIST_MODE", "FAKEGPU_COORDINATOR_ADDR",
                        "FAKEGPU_COORDINATOR_TRANSPORT", "FAKEGPU_COORDINATOR_TOKEN",
                        "FAKEGPU_COORDINATOR_TOKEN_FILE")


def coordinator_child_environment(cfg: LaunchConfig, token_file: Optional[Path]) -> dict[str, str]:
    env = dict(os.environ)
    env.update(fakegpu_variables(cfg, None, token_file))
    for name in _RANK_ONLY_VARIABLES:
        env.pop(name, None)
    env["PYTHONPATH"] = _prepend_path_list(env.get("PYTHONPATH"),
                                           "" if _package_on_default_path() else str(package_root()))
    env["PYTHONUNBUFFERED"] = "1"  # the ready line must reach us immediately
    # The coordinator must never load the shim itself.
    preload = [p for p in re.split(r"[:\s]+", env.get("LD_PRELOAD", "")) if p and "libnccl" not in p]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    else:
        env.pop("LD_PRELOAD", None)
    return env


class CoordinatorProcess:
    """A `python -m fakegpu coordinator` that we started and must stop."""

    def __init__(self, argv: list[str], env: Mapping[str, str], transport: str,
                 echo: Optional[Callable[[str], None]] = None, log_path: Optional[Path] = None):
        """With `log_path` the coordinator writes its output to that file instead of a pipe to
        us, and does not die with us: it may outlive fgpu (--keep-coordinator)."""
        self.argv = argv
        self.transport = transport
        self.address: Optional[str] = None
        self.log_path = log_path
        self._tail: collections.deque[str] = collections.deque(maxlen=60)
        self._lines: "queue.Queue[Optional[str]]" = queue.Queue()
        self._echo = echo
        self._stop_reading = threading.Event()
        self._ready_seen = False
        if log_path is None:
            self.proc = subprocess.Popen(
                argv, env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1,
                preexec_fn=_own_session_and_die_with_parent, close_fds=True)
            target = self._read_pipe
        else:
            with open(log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    argv, env=dict(env), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    preexec_fn=_own_session, close_fds=True)
            target = self._read_log
        self._reader = threading.Thread(target=target, name="fgpu-coordinator-log", daemon=True)
        self._reader.start()

    def _take(self, line: str) -> None:
        line = line.rstrip("\n")
        self._tail.append(line)
        if self._echo is not None:
            self._echo(line)
        if not self._ready_seen:  # only the start-up lines are waited on; later ones stay in the tail
            self._ready_seen = READY_MARKER in line
            self._lines.put(line)

    def _read_pipe(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._take(line)
        self._lines.put(None)

    def _read_log(self) -> None:
        assert self.log_path is not None
        with open(self.log_path, "r", errors="replace") as log:
            partial = ""
            while not self._stop_reading.is_set():
                chunk = log.readline()
                if chunk:
                    partial += chunk
                    if partial.endswith("\n"):
                        self._take(partial)
                        partial = ""
                    continue
                if self.proc.poll() is not None:
                    rest = log.read()
                    for line in (partial + rest).splitlines():
                        self._take(line)
                    break
                time.sleep(0.05)
        self._lines.put(None)

    def detach(self) -> None:
        """Stop following the output of a coordinator that is left running."""
        self._stop_reading.set()

    def output_tail(self) -> str:
        return "\n".join(self._tail)

    def wait_ready(self, timeout_s: float) -> str:
        """Block until the ready line; return the address it names. Raise LaunchError on failure."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.kill()
                raise LaunchError(
                    f"the coordinator did not report '{READY_MARKER} ...' within {timeout_s:g} s "
                    f"(raise --coordinator-startup-timeout if the machine is slow)\n"
                    f"command: {' '.join(self.argv)}\n--- coordinator output ---\n{self.output_tail()}")
            try:
                line = self._lines.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            if line is None:
                code = self.proc.wait(timeout=5)
                raise LaunchError(
                    f"the coordinator exited with status {code} before it was ready\n"
                    f"command: {' '.join(self.argv)}\n--- coordinator output ---\n{self.output_tail()}")
            if READY_MARKER in line:
                self.address = _address_from_ready_line(line)
                return self.address

    def running(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = DEFAULT_STOP_TIMEOUT_S) -> Optional[int]:
        """SIGTERM (the coordinator writes its reports and exits); SIGKILL after `timeout_s`.

        Returns the exit status, or None when it had to be killed.
        """
        if self.proc.poll() is not None:
            self._reader.join(timeout=2)
            return self.proc.returncode
        try:
            self.proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return None
        self._reader.join(timeout=2)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def _address_from_ready_line(line: str) -> str:
    rest = line.split(READY_MARKER, 1)[1].strip()
    address = rest.split()[0] if rest else ""
    for prefix in ("unix://", "unix:", "tcp://", "tcp:"):
        if address.startswith(prefix):
            address = address[len(prefix):]
            break
    return address.rstrip(".,;")


def start_coordinator(cfg: LaunchConfig, transport: str, address: str, token_file: Optional[Path],
                      echo: Optional[Callable[[str], None]] = None,
                      with_reports: bool = True, log_path: Optional[Path] = None) -> CoordinatorProcess:
    argv = coordinator_command()
    if transport == "unix":
        argv += ["--transport", "unix", "--address", address]
    else:
        argv += ["--listen", address]
    if token_file is not None:
        argv += ["--token-file", str(token_file)]
    if cfg.cluster_config is not None:
        argv += ["--cluster-config", str(cfg.cluster_config)]
    if with_reports:
        argv += ["--report", str(cfg.report), "--markdown-report", str(cfg.markdown_path)]
        if cfg.trace is not None:
            argv += ["--trace", str(cfg.trace)]
    if cfg.timeout_ms is not None:
        argv += ["--timeout-ms", str(cfg.timeout_ms)]
    env = coordinator_child_environment(cfg, token_file)
    if not with_reports:
        for var in ("FAKEGPU_CLUSTER_REPORT_PATH", "FAKEGPU_CLUSTER_REPORT_MARKDOWN_PATH", "FAKEGPU_TRACE_PATH"):
            env.pop(var, None)
    coordinator = CoordinatorProcess(argv, env, transport, echo=echo, log_path=log_path)
    try:
        coordinator.wait_ready(cfg.startup_timeout_s)
    except BaseException:  # including Ctrl-C while we wait: never leave it running
        coordinator.kill()
        raise
    if transport == "unix" and not coordinator.address:
        coordinator.address = address
    return coordinator


def ping_coordinator(address: str, token_file: Optional[Path] = None,
                     timeout_s: float = 15.0) -> tuple[bool, str]:
    """Ask the coordinator at `address` for its description: (answered, description or reason).

    In-process (no interpreter start-up, no parsing of our possibly rank-only environment).
    A coordinator with a token answers only a PING that carries it (from `token_file`); to
    any other it says "authentication required".
    """
    from fakegpu import protocol as P
    from fakegpu.coordinator.client import ClientError, SyncClient

    transport = guess_transport(address)
    try:
        token = read_token(token_file) if token_file is not None else ""
        with SyncClient(address, transport, timeout_s=timeout_s) as client:
            reply = client.request(P.Ping(token), timeout_s=timeout_s)
    except (ClientError, LaunchError, OSError, ValueError) as exc:
        return False, str(exc)
    if isinstance(reply, P.Pong):
        return True, reply.description
    return False, getattr(reply, "message", repr(reply))


# ---------------------------------------------------------------------------------------------
# Running the command


def _sigint_came_from_terminal() -> bool:
    """A Ctrl-C in the terminal already reached the command when it shares our foreground
    process group; forwarding it again would make torchrun and Python see two interrupts."""
    for fd in (0, 1, 2):
        try:
            if os.isatty(fd) and os.tcgetpgrp(fd) == os.getpgrp():
                return True
        except OSError:
            continue
    return False


FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def exit_status(returncode: int) -> int:
    """Shell convention: a child killed by signal N gives 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def run_command(command: Sequence[str], env: Mapping[str, str]) -> int:
    """Run `command` in the current directory, forwarding signals; return its exit status."""
    started: list[subprocess.Popen] = []
    pending: list[int] = []  # signals that arrived before the command existed

    def forward(signum, _frame):
        if signum == signal.SIGINT and _sigint_came_from_terminal():
            return
        if not started:
            pending.append(signum)
            return
        try:
            started[0].send_signal(signum)
        except ProcessLookupError:
            pass

    # Handlers first, so that no signal between start-up and installation is lost.
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in FORWARDED_SIGNALS:
            previous[signum] = signal.signal(signum, forward)
    try:
        try:
            started.append(subprocess.Popen(list(command), env=dict(env)))
        except FileNotFoundError:
            raise CommandNotRunnable(f"command not found: {command[0]}", 127) from None
        except PermissionError:
            raise CommandNotRunnable(f"command is not executable: {command[0]}", 126) from None
        for signum in pending:
            forward(signum, None)
        while True:
            try:
                return exit_status(started[0].wait())
            except KeyboardInterrupt:  # only if a handler was not installed
                forward(signal.SIGINT, None)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


# ---------------------------------------------------------------------------------------------
# Reports


def report_files(cfg: LaunchConfig) -> list[tuple[str, Path]]:
    files = [("JSON report", cfg.report), ("Markdown report", cfg.markdown_path)]
    if cfg.trace is not None:
        files.append(("trace", cfg.trace))
    if cfg.memory_capture is not None:
        files.append(("memory captures", cfg.memory_capture))
    return files


def report_summary(report: Path, timeout_s: float = 60.0) -> str:
    """A short text summary: the report helper's `report show` if present, else a few JSON fields."""
    if importlib.util.find_spec("fakegpu.cli.report") is not None:
        env = dict(os.environ)
        env["PYTHONPATH"] = _prepend_path_list(env.get("PYTHONPATH"),
                                               "" if _package_on_default_path() else str(package_root()))
        env.pop("LD_PRELOAD", None)
        try:
            done = subprocess.run([sys.executable, "-m", "fakegpu", "report", "show", str(report)],
                                  env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=timeout_s)
            if done.returncode == 0 and done.stdout.strip():
                return done.stdout.rstrip()
        except subprocess.TimeoutExpired:
            pass
    return _fallback_summary(report)


def _fallback_summary(report: Path) -> str:
    try:
        data = json.loads(report.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return f"(cannot read {report}: {exc})"
    if not isinstance(data, dict):
        return "(report is not a JSON object)"
    lines = []
    for key in ("world_size", "node_count", "schema_version"):
        if key in data:
            lines.append(f"{key}: {data[key]}")
    for key in ("collectives", "operations", "point_to_point"):
        value = data.get(key)
        if isinstance(value, (dict, list)):
            lines.append(f"{key}: {len(value)} entries")
    return "\n".join(lines) or "(report written; no summary fields recognised)"


# ---------------------------------------------------------------------------------------------
# The whole launch


def log(message: str) -> None:
    print(_LOG_PREFIX + message, file=sys.stderr, flush=True)


@dataclasses.dataclass
class PreparedLaunch:
    """What `prepare()` set up; `close()` undoes it."""
    cfg: LaunchConfig
    endpoint: Optional[Endpoint]
    token_file: Optional[Path]
    coordinator: Optional[CoordinatorProcess]
    private_dir: Optional[Path]
    reused: bool = False       # True when we use someone else's coordinator

    def close(self) -> Optional[int]:
        code = None
        if self.coordinator is not None:
            if self.cfg.keep_coordinator and self.coordinator.running():
                self.coordinator.detach()
                log(f"coordinator left running at {self.endpoint.address} (pid {self.coordinator.proc.pid}, "
                    f"log {self.coordinator.log_path}); stop it with: {sys.executable} -m fakegpu coordinator "
                    f"--shutdown {self.endpoint.address}"
                    + (f" --token-file {self.token_file}" if self.token_file else ""))
                return None
            code = self.coordinator.stop()
            if code is None:
                log("the coordinator did not exit after SIGTERM within "
                    f"{DEFAULT_STOP_TIMEOUT_S:g} s and was killed; reports may be incomplete")
            elif code != 0:
                log(f"the coordinator exited with status {code}; its last output:\n{self.coordinator.output_tail()}")
        if self.private_dir is not None:
            shutil.rmtree(self.private_dir, ignore_errors=True)
        return code


def _private_socket_dir() -> Path:
    """A fresh 0700 directory for the socket and token, short enough for sun_path."""
    base = tempfile.gettempdir()
    if len(os.fsencode(base)) > 60:
        base = "/tmp"
    return Path(tempfile.mkdtemp(prefix="fakegpu-", dir=base))


def prepare(cfg: LaunchConfig, echo: Optional[Callable[[str], None]] = None,
            ping: Callable[..., tuple[bool, str]] = ping_coordinator) -> PreparedLaunch:
    """Find or start the coordinator and settle the token. The caller must `close()` the result."""
    if not cfg.needs_coordinator:
        return PreparedLaunch(cfg, None, None, None, None)

    private_dir: Optional[Path] = None
    try:
        # 1. An existing coordinator at --coordinator-addr?
        if cfg.coordinator_addr:
            exists = cfg.transport == "tcp" or Path(cfg.coordinator_addr).exists()
            if cfg.transport == "unix" and exists and not stat.S_ISSOCK(os.stat(cfg.coordinator_addr).st_mode):
                raise LaunchError(f"--coordinator-addr {cfg.coordinator_addr} exists and is not a socket; "
                                  "choose another path")
            token_file = cfg.token_file if cfg.token_file and cfg.token_file.exists() else None
            if exists:
                answered, detail = ping(cfg.coordinator_addr, token_file)
                if answered:
                    if cfg.token_file is not None and token_file is None:
                        raise LaunchError(f"--token-file {cfg.token_file} does not exist; copy the token file "
                                          "of the running coordinator there")
                    return PreparedLaunch(cfg, Endpoint(cfg.transport, cfg.coordinator_addr), token_file,
                                          None, None, reused=True)
                if "authentic" in detail.lower():
                    if cfg.token_file is not None and token_file is None:
                        raise LaunchError(f"--token-file {cfg.token_file} does not exist; copy the token file "
                                          "of the running coordinator there")
                    raise LaunchError(f"the coordinator at {cfg.coordinator_addr} refused our token ({detail}); "
                                      "pass --token-file with a copy of the coordinator's token file")
                if cfg.transport == "tcp" and not _can_listen_here(cfg.coordinator_addr):
                    raise LaunchError(f"no coordinator answers at {cfg.coordinator_addr} ({detail or 'no answer'}) "
                                      "and it is not an address of this host to start one on")
                if cfg.transport == "unix" and "refused" not in detail.lower():
                    # Something is there but it is not a dead socket (that would refuse): do not take it over.
                    raise LaunchError(f"{cfg.coordinator_addr} exists but no coordinator answers there "
                                      f"({detail or 'no answer'}); remove it or choose another path")
                # A socket left by a coordinator that died: the new coordinator replaces it.

        # 2. Start our own, in this interpreter: stop now, in one line, if it lacks a package the
        # coordinator needs (a checkout without `pip install .`), rather than after it failed.
        coordinator_packages(cfg)
        if cfg.transport == "unix":
            if cfg.coordinator_addr:
                address = cfg.coordinator_addr
            else:
                private_dir = _private_socket_dir()
                address = str(private_dir / "coordinator.sock")
        else:
            address = cfg.listen or cfg.coordinator_addr or "127.0.0.1:0"

        if cfg.token_file is not None:
            if cfg.token_file.exists():
                read_token(cfg.token_file)  # fail early on an unreadable/empty file
                warning = token_file_warning(cfg.token_file)
                if warning:
                    log("warning: " + warning)
            else:
                write_token_file(cfg.token_file)
            token_file = cfg.token_file
        else:
            if private_dir is None:
                private_dir = _private_socket_dir()
            token_file = private_dir / "token"
            write_token_file(token_file)

        log_path = None
        if cfg.keep_coordinator:
            # It outlives us: its output goes to a file, not to a pipe that closes when we exit.
            if private_dir is None:
                private_dir = _private_socket_dir()
            log_path = private_dir / "coordinator.log"
        coordinator = start_coordinator(cfg, cfg.transport, address, token_file, echo=echo, log_path=log_path)
        endpoint = Endpoint(cfg.transport, coordinator.address or address)
        if cfg.transport == "tcp" and not is_loopback_host(parse_tcp_address(endpoint.address)[0]):
            # Other hosts can join; tell the user how (the token never goes on a command line).
            log(f"coordinator listening on {endpoint.address}; on the other hosts run "
                f"`fgpu --coordinator-addr HOST:PORT --token-file PATH -- ...` with a copy of {token_file}")
        return PreparedLaunch(cfg, endpoint, token_file, coordinator, private_dir)
    except BaseException:
        if private_dir is not None:
            shutil.rmtree(private_dir, ignore_errors=True)
        raise


def _can_listen_here(address: str) -> bool:
    """Whether HOST of HOST:PORT is an address we could bind (loopback, wildcard or ours)."""
    import socket

    host, _ = parse_tcp_address(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
        return True
    except OSError:
        return False


def launch(cfg: LaunchConfig, command: Sequence[str]) -> int:
    """Run `command` under fakegpu and return its exit status."""
    if not command:
        raise LaunchError("no command given; usage: fgpu [options] [--] COMMAND [ARGS...]")
    echo = (lambda line: print("[coordinator] " + line, file=sys.stderr, flush=True)) if cfg.verbose else None
    before = {path: _file_identity(path) for _, path in report_files(cfg)}
    prepared = prepare(cfg, echo=echo)
    coordinator_status: Optional[int] = 0
    try:
        env = rank_environment(cfg, prepared.endpoint, prepared.token_file)
        if cfg.verbose:
            if prepared.endpoint is not None:
                how = "using" if prepared.reused else "started"
                log(f"{how} coordinator at {prepared.endpoint.transport}:{prepared.endpoint.address}")
            for name in sorted(k for k in env if k.startswith("FAKEGPU_") or k in ("LD_PRELOAD", "PYTHONPATH")):
                log(f"  {name}={env[name]}")
        status = run_command(command, env)
    finally:
        coordinator_status = prepared.close()
    if prepared.reused or (prepared.coordinator and cfg.keep_coordinator):
        if prepared.reused and not cfg.quiet:
            log(f"the coordinator at {prepared.endpoint.address} writes its reports when it is stopped "
                f"(python -m fakegpu coordinator --shutdown {prepared.endpoint.address} ...)")
        return status
    report_written = _print_reports(cfg, before, status, quiet=cfg.quiet)
    if cfg.needs_coordinator and (coordinator_status != 0 or not report_written):
        # The report of this job is lost (disk full, a failing write): never a silent success.
        log(f"error: this job's reports were not written to {cfg.report}"
            + (f" (the coordinator exited with status {coordinator_status})" if coordinator_status else "")
            + "; any file there is from an earlier run")
        return status or 1
    return status


def _file_identity(path: Path) -> Optional[tuple]:
    """What tells one version of a file from another: a report is replaced by a new file
    (os.replace), so its inode and modification time change whenever this job writes it."""
    try:
        st = path.stat()
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


def _no_rank_reached_nccl(report: Path) -> bool:
    """True when the report shows that no process ever reached the coordinator (no
    communicator, no rank that connected or tried to create one): its figures describe nothing."""
    try:
        data = json.loads(report.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(data, dict) or data.get("communicators"):
        return False
    return not any(isinstance(r, dict) and (r.get("pid") is not None or r.get("connected") or r.get("comm_inits")
                                            or r.get("init_timeouts"))
                   for r in data.get("ranks") or [])


def _print_reports(cfg: LaunchConfig, before: Mapping[Path, Optional[tuple]], status: int = 0,
                   quiet: bool = False) -> bool:
    """Say where this job's reports are and summarise the JSON one, never a file an earlier run
    left there. Returns whether this job wrote the JSON report."""
    written, stale = [], []
    for label, path in report_files(cfg):
        now = _file_identity(path)
        if now is not None and now != before.get(path):
            written.append((label, path))
        elif now is not None:
            stale.append((label, path))
    report_written = any(path == cfg.report for _, path in written)
    if quiet:
        return report_written
    for label, path in stale:
        log(f"{label} {path} was not written by this job (it is from an earlier run)")
    if not written:
        if cfg.needs_coordinator and not stale:
            log(f"no report was written at {cfg.report}")
        return report_written
    for label, path in written:
        log(f"{label}: {path}")
    if report_written and status != 0 and _no_rank_reached_nccl(cfg.report):
        # A summary here would read "world size 1" for a job whose ranks failed before they got
        # that far.
        log(f"no rank reached NCCL (no process connected and no communicator was created; the command "
            f"exited with status {status}); the ranks' errors are in the command's output above. "
            f"Empty report: {cfg.report}")
        return report_written
    if report_written:
        for line in init_timeout_lines(cfg.report):
            log(line)
        summary = report_summary(cfg.report)
        if summary:
            print(summary, file=sys.stderr, flush=True)
        if status != 0:
            # The figures above are what ran before the job failed, not a finished job's.
            ran = _completed_operations(cfg.report)
            log(f"the command exited with status {status}: the report covers only what ran before "
                f"the failure ({'no collective completed' if ran == 0 else f'{ran} operations'}); "
                f"the ranks' errors are in the command's output above")
    return report_written


def _completed_operations(report: Path) -> Optional[int]:
    """Operations the report counts (None when it cannot say)."""
    try:
        data = json.loads(report.read_text(encoding="utf-8"))
        return int(data["totals"]["operations"])
    except (OSError, ValueError, TypeError, KeyError):
        return None


def init_timeout_lines(report: Path) -> list[str]:
    """One line per communicator init that timed out in the report: which ranks never arrived."""
    try:
        data = json.loads(report.read_text(encoding="utf-8"))
        items = data["events"]["items"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    lines = []
    for e in items:
        if isinstance(e, dict) and e.get("event") == "init_timeout":
            name = f" {e['name']!r}" if e.get("name") else ""
            lines.append(f"communicator init{name} of {e.get('nranks')} ranks timed out after "
                         f"{e.get('timeout_ms')} ms: ranks {e.get('missing_ranks')} never arrived "
                         f"(arrived: {e.get('arrived_ranks')})")
    return lines
