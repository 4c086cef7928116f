"""Run a real ``python -m fakegpu coordinator`` process for a test, and stop it afterwards."""
from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

from .shim import REPO_ROOT

_TCP_ADDRESS = re.compile(r"(\d{1,3}(?:\.\d{1,3}){3}|\[[0-9a-fA-F:]+\]|localhost):(\d+)")


def coordinator_command(args: list[str]) -> list[str]:
    """The command line that starts a coordinator with ``args`` (one place to change it)."""
    return [sys.executable, "-m", "fakegpu", "coordinator", *args]


class CoordinatorUnavailable(RuntimeError):
    """The coordinator could not be started in the requested form (e.g. no TCP support yet)."""


class CoordinatorProcess:
    """A coordinator child process.  ``env`` is what its clients need to reach it."""

    def __init__(self, transport: str = "unix", *, extra_env: Optional[dict] = None,
                 extra_args: tuple[str, ...] = (), start_timeout_s: float = 30.0):
        if transport not in ("unix", "tcp"):
            raise ValueError(f"transport must be 'unix' or 'tcp', not {transport!r}")
        self.transport = transport
        # Short private directory: Unix socket paths are limited to 107 bytes.
        self.workdir = Path(tempfile.mkdtemp(prefix="fgpu-coord-"))
        os.chmod(self.workdir, 0o700)
        self.token = secrets.token_hex(16)
        self.address: Optional[str] = None
        self._lines: list[str] = []
        self._listening = threading.Event()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        env["FAKEGPU_COORDINATOR_TOKEN"] = self.token
        env.update(extra_env or {})
        if transport == "unix":
            self.address = str(self.workdir / "c.sock")
            args = ["--transport", "unix", "--address", self.address]
        else:
            args = ["--listen", "127.0.0.1:0"]
        self.command = coordinator_command([*args, *extra_args])
        self.proc = subprocess.Popen(
            self.command, cwd=str(REPO_ROOT), env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
        )
        self._reader = threading.Thread(target=self._read_output, daemon=True)
        self._reader.start()
        self._wait_listening(start_timeout_s)

    def _read_output(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.append(line.rstrip("\n"))
            if "listening" in line.lower() and not self._listening.is_set():
                if self.transport == "tcp":
                    match = _TCP_ADDRESS.search(line)
                    if match:
                        self.address = f"{match.group(1)}:{match.group(2)}"
                self._listening.set()

    def _wait_listening(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._listening.wait(0.05):
            if self.proc.poll() is not None:
                self._reader.join(2)
                message = (f"coordinator exited with {self.proc.returncode} before listening: "
                           f"{' '.join(self.command)}\n{self.log()}")
                if self.transport == "tcp":
                    raise CoordinatorUnavailable(message)
                raise RuntimeError(message)
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"coordinator printed no 'listening' line within {timeout_s} s:"
                                   f"\n{self.log()}")
        if self.transport == "tcp" and not self.address:
            self.stop()
            raise CoordinatorUnavailable(
                f"TCP coordinator did not print the address it listens on:\n{self.log()}")

    @property
    def client_env(self) -> dict:
        return {
            "FAKEGPU_DIST_MODE": "simulate",
            "FAKEGPU_COORDINATOR_TRANSPORT": self.transport,
            "FAKEGPU_COORDINATOR_ADDR": self.address or "",
            "FAKEGPU_COORDINATOR_TOKEN": self.token,
        }

    def log(self, last: int = 80) -> str:
        return "\n".join(self._lines[-last:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout_s``; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._reader.join(2)
        return self.proc.returncode

    def __enter__(self) -> "CoordinatorProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
