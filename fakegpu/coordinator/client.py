"""A small blocking Python client of the wire protocol: ``--ping``/``--shutdown`` and tests.

The real client is the C++ shim; this one exists so the coordinator can be exercised and
administered without loading libnccl.so.2. Every wait has a timeout.
"""
from __future__ import annotations

import os
import socket
import time
from typing import Optional

from fakegpu import protocol as P


class ClientError(RuntimeError):
    pass


def parse_address(address: str, transport: Optional[str] = None) -> tuple[str, object]:
    """('unix', path) or ('tcp', (host, port)). Without a transport, an absolute path is unix."""
    for prefix, kind in (("unix://", "unix"), ("unix:", "unix"), ("tcp://", "tcp"), ("tcp:", "tcp")):
        if address.startswith(prefix):
            address, transport = address[len(prefix):], kind
            break
    if transport is None:
        transport = "unix" if address.startswith("/") or address.startswith(".") else "tcp"
    if transport == "unix":
        return "unix", address
    from fakegpu.env import parse_tcp_address
    return "tcp", parse_tcp_address(address, "address")


class SyncClient:
    def __init__(self, address: str, transport: Optional[str] = None, timeout_s: float = 10.0):
        self.transport, target = parse_address(address, transport)
        self.timeout_s = timeout_s
        try:
            if self.transport == "unix":
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.settimeout(timeout_s)
                self.sock.connect(target)
            else:
                self.sock = socket.create_connection(target, timeout=timeout_s)
                self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as exc:
            raise ClientError(f"cannot reach the coordinator at {address}: {exc.strerror or exc}") from None
        self.parser = P.FrameParser(max_body_len=1 << 34)
        self._rid = 0
        self._pending: list = []

    def close(self) -> None:
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send(self, msg, request_id: Optional[int] = None) -> int:
        if request_id is None:
            self._rid += 1
            request_id = self._rid
        self.sock.sendall(P.encode_frame(msg, request_id))
        return request_id

    def recv_frame(self, timeout_s: Optional[float] = None) -> P.Frame:
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while not self._pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ClientError("no answer from the coordinator within the timeout")
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(1 << 20)
            except socket.timeout:
                raise ClientError("no answer from the coordinator within the timeout") from None
            if not data:
                raise ClientError("the coordinator closed the connection")
            self._pending.extend(self.parser.feed(data))
        return self._pending.pop(0)

    def request(self, msg, timeout_s: Optional[float] = None):
        rid = self.send(msg)
        frame = self.recv_frame(timeout_s)
        if frame.request_id != rid:
            raise ClientError(f"answer to request {frame.request_id}, expected {rid}")
        return P.decode_body(frame.msg_type, frame.body)

    def hello(self, token: str = "", global_rank: int = -1, staging_bytes: int = 1 << 20):
        reply = self.request(P.Hello(flags=0, global_rank=global_rank, pid=os.getpid(),
                                     staging_bytes=staging_bytes, token=token,
                                     hostname=socket.gethostname()))
        if isinstance(reply, P.Error):
            raise ClientError(f"HELLO refused: {reply.message}")
        return reply
