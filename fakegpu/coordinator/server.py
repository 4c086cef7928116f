"""asyncio transport for the coordinator: it only moves bytes between sockets and the core.

One ``Connection`` (an ``asyncio.Protocol``, cheaper per message than streams) per client
process. Socket-staged GROUP payloads are copied straight from the received chunks into
the connection's staging buffer by the frame parser's payload router; shared-memory
clients' segments are mapped once from /dev/shm with ``mmap`` (not
multiprocessing.shared_memory, whose resource tracker would unlink them).

A malformed frame, an oversize length, a wrong version, an unknown type or a bad token
closes only that connection, with the reason logged.

Staying reachable (docs/protocol.md, "Coordinator limits and edge cases"): the server runs its
own accept loop, so running out of file descriptors costs one log line every few seconds and
a short pause in accepting, not a traceback per attempt; a connection that has not completed
HELLO is closed after ``hello_timeout_s``, and at most ``max_unauthenticated`` of them are open
at once (a new one closes the oldest); idle connections hold no receive buffer (all share one
scratch buffer); large reductions run in a worker thread and large GROUP frames are submitted
a slice at a time, so the event loop keeps answering everyone else.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import errno
import logging
import mmap
import os
import signal
import socket
import stat
import time
from typing import Callable, Optional

import numpy as np

from fakegpu import protocol as P
from fakegpu.coordinator import core as C
from fakegpu.coordinator import shm as SHM
from fakegpu.coordinator.arena import remove_stale_arenas
from fakegpu.env import is_loopback_host

log = logging.getLogger("fakegpu.coordinator")

# How long a signalled coordinator keeps reading before it writes the reports, when arenas
# exist (see serve()): a few of the shim's 50 ms LOCAL_OPS flush periods.
LOCAL_OPS_GRACE_S = 0.3

UNIX_PATH_MAX = 107
SOCKET_BUFFER_BYTES = 4 << 20

# A connection must complete HELLO within this long (--hello-timeout-ms).
DEFAULT_HELLO_TIMEOUT_S = 10.0
# Connections open without a completed HELLO, at most (--max-unauthenticated).
DEFAULT_MAX_UNAUTHENTICATED = 256
# Headers and small frames are received here; shared by every connection, because a frame's
# bytes are parsed (and copied where kept) before the next socket is read.
SCRATCH_BYTES = 256 * 1024
# Connections accepted per readiness event of the listening socket, so one burst cannot keep
# the loop from reading the connections it already has.
ACCEPT_BATCH = 64
# Accepting pauses this long after the process ran out of descriptors (doubling up to the max).
ACCEPT_BACKOFF_S = (0.05, 1.0)
# Errors that mean "out of descriptors or memory": wait and retry, never fatal.
_ACCEPT_RESOURCE_ERRORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# Ops of one GROUP frame submitted per event-loop turn (see Core.group_slice_ops).
GROUP_SLICE_OPS = 256


def perform_arena_action(kind: int, arena, value) -> None:
    """Carry out one of the core's ARENA_* actions on the arena's mapping."""
    if kind == C.ARENA_PENDING:
        arena.set_pending(value)
    elif kind == C.ARENA_FAILED:
        arena.set_failed(value)
    elif kind == C.ARENA_CLOSING:
        arena.set_closing()
    elif kind == C.ARENA_CLOSE:
        arena.close()
    else:
        raise ValueError(f"not an arena action: {kind}")


class ServerError(RuntimeError):
    """The coordinator cannot listen where it was asked to (message says why)."""


_staging_fallbacks = 0   # clients whose segment could not be allocated (the first one is a warning)


def map_shm_segment(name: str, S: int):
    """Allocate (posix_fallocate) and map the client's staging segment, 2*S bytes, from
    /dev/shm; None when impossible, and the client then uses socket staging. The client made
    the segment empty and maps it only after HELLO_OK, so neither side ever maps a page
    /dev/shm cannot back."""
    global _staging_fallbacks
    base = name[1:] if name.startswith("/") else name
    if not base or "/" in base or base in (".", ".."):
        log.warning("refusing shared-memory name %r (not a plain POSIX shm name)", name)
        return None
    path = os.path.join(SHM.SHM_DIR, base)
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        log.info("cannot open shared memory %s (%s); using socket staging", path, exc.strerror)
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            log.info("shared memory %s is not a regular file; using socket staging", path)
            return None
        exc = SHM.allocate(fd, 2 * S)
        if exc is not None:
            _staging_fallbacks += 1
            (log.warning if _staging_fallbacks == 1 else log.info)(
                "cannot allocate the %s staging segment %s (%s); this client uses socket staging%s",
                SHM.describe_bytes(2 * S), path, exc.strerror or exc,
                " (later clients that fail too are logged at info level)" if _staging_fallbacks == 1 else "")
            os.ftruncate(fd, 0)   # give back what was allocated before it failed
            return None
        mm = mmap.mmap(fd, 2 * S, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        log.info("cannot map shared memory %s (%s); using socket staging", path, exc)
        return None
    finally:
        os.close(fd)
    return np.frombuffer(mm, dtype=np.uint8)


class LogThrottle:
    """For events that come in floods (a connection flood, descriptor exhaustion): the first
    of a kind is logged at once, later ones at most once per ``interval_s``, each line saying
    how many were not logged since the previous one."""

    def __init__(self, interval_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.interval_s = interval_s
        self.clock = clock
        self._last: dict = {}       # kind -> when its last line was logged
        self._skipped: dict = {}    # kind -> [count, last message]

    def warning(self, kind: str, message: str) -> None:
        now = self.clock()
        last = self._last.get(kind)
        if last is not None and now - last < self.interval_s:
            entry = self._skipped.setdefault(kind, [0, message])
            entry[0] += 1
            entry[1] = message
            return
        self._emit(kind, message, now)

    def flush(self) -> None:
        """Log what was held back once its interval has passed (called from the tick loop)."""
        now = self.clock()
        for kind in [k for k, (n, _) in self._skipped.items() if n and now - self._last[k] >= self.interval_s]:
            n, message = self._skipped.pop(kind)
            self._last[kind] = now
            if n > 1:
                log.warning("%s (%d more like this in the last %.0f s)", message, n - 1, self.interval_s)
            else:
                log.warning("%s", message)

    def _emit(self, kind: str, message: str, now: float) -> None:
        skipped = self._skipped.pop(kind, None)
        if skipped and skipped[0]:
            log.warning("%s (%d more like this since the last report)", message, skipped[0])
        else:
            log.warning("%s", message)
        self._last[kind] = now


def _enable_keepalive(sock) -> None:
    """TCP keepalive: a client host that vanished (crash, partition) is noticed within about
    a minute even while it has nothing in flight, and its peers get ncclRemoteError."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    except OSError:
        pass


class Connection(asyncio.BufferedProtocol):
    """One client connection. As a BufferedProtocol it lets the event loop ``recv_into``
    our buffers: a scratch buffer for frame headers and small bodies, and, while a
    socket-staged GROUP payload is arriving, the staging region itself (no copy)."""

    __slots__ = ("server", "core", "id", "transport", "parser", "peer", "closing", "direct", "fd", "outq",
                 "_add_writer", "_writer_loop", "accepted_at", "held", "quiet")

    def __init__(self, server: "CoordinatorServer"):
        self.server = server
        self.core = server.core
        self.id = server.next_conn_id()
        self.transport = None
        self.closing = False
        self.peer = "?"
        self.parser = P.FrameParser(P.PRE_HELLO_MAX_BODY, accepted_types=P.CLIENT_TO_SERVER,
                                    payload_router=self._route_payload)
        self.direct = False
        self.accepted_at = 0.0
        self.held: Optional[collections.deque] = None  # frames waiting while a GROUP is submitted in slices
        self.quiet = False   # closed by the flood rules: the server logs those in summary
        self.fd = -1
        # Large answers still to send, as views of the staging memory (see write_pieces).
        self.outq: collections.deque = collections.deque()
        self._writer_loop = None
        self._add_writer = None

    # -- asyncio callbacks
    def connection_made(self, transport) -> None:
        self.transport = transport
        # The selector loop's own writer registration (what its transports use), for large
        # answers sent from staging memory. Without it (another loop implementation) they
        # go through transport.write, which copies.
        loop = asyncio.get_running_loop()
        if hasattr(loop, "_add_writer") and hasattr(loop, "_remove_writer"):
            self._writer_loop = loop
            self._add_writer = loop._add_writer
        sock = transport.get_extra_info("socket")
        self.fd = sock.fileno() if sock is not None else -1
        if sock is not None:
            # Large kernel buffers: fewer wake-ups per socket-staged megabyte (capped by
            # net.core.[rw]mem_max; failure is harmless).
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                try:
                    sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
                except OSError:
                    pass
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _enable_keepalive(sock)
            self.peer = "%s:%s" % transport.get_extra_info("peername")[:2]
        else:
            self.peer = f"unix connection {self.id}"
        self.server.conns[self.id] = self
        self.server.admit(self)

    def get_buffer(self, sizehint: int):
        target = self.parser.direct_buffer()
        if target is not None and len(target):
            self.direct = True
            return target
        self.direct = False
        return self.server.scratch_mv

    def buffer_updated(self, nbytes: int) -> None:
        if self.closing:
            return
        if self.direct:
            self._dispatch(self.parser.direct_filled(nbytes))
        else:
            self.data_received(self.server.scratch_mv[:nbytes])

    def pause_writing(self) -> None:
        # The client is not reading its answers: stop reading its requests, so the
        # memory this connection holds stays bounded.
        if self.transport is not None and not self.closing:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.closing and self.held is None:
            self.transport.resume_reading()

    def data_received(self, data) -> None:
        if self.closing:
            return
        try:
            frames = self.parser.feed(data)
        except P.VersionError as exc:
            self.transport.write(C.error_frame(
                exc.request_id, P.NCCL_INVALID_USAGE,
                f"fakegpu coordinator speaks protocol version {P.VERSION}; this client sent version "
                f"{exc.version} (use a shim and coordinator from the same fakegpu release)"))
            self.close(f"protocol error: {exc}")
            return
        except P.ProtocolError as exc:
            self.close(f"protocol error: {exc}")
            return
        self._dispatch(frames)

    def _dispatch(self, frames: list) -> None:
        if self.held is not None:   # a GROUP of ours is still being submitted: keep the order
            self.held.extend(frames)
            return
        core = self.core
        apply = self.server.apply
        for i, frame in enumerate(frames):
            had_hello = frame.msg_type == P.HELLO
            apply(core.on_frame(self.id, frame, self.server.transport_name, self._staging_factory))
            if self.closing:
                break
            if had_hello:
                self.parser.max_body_len = core.max_body_len(self.id)
                if self.id in core.clients:
                    self.server.authenticated(self)
            if core.submitting(self.id):
                # A large GROUP goes in slices, one per loop turn; what this client sends
                # meanwhile waits (in order) and its socket is not read.
                self.held = collections.deque(frames[i + 1:])
                if self.transport is not None:
                    self.transport.pause_reading()
                self.server.continue_group(self)
                break
        if core._records:
            self.server.schedule_flush()

    def continue_group(self) -> None:
        """Submit the next slice of our GROUP; once it is all in, the frames held meanwhile."""
        if self.closing:
            return
        self.server.apply(self.core.resume(self.id))
        if self.closing:
            return
        if self.core.submitting(self.id):
            self.server.continue_group(self)
            return
        held, self.held = self.held, None
        if held:
            self._dispatch(list(held))
        if self.held is None and not self.closing and self.transport is not None:
            self.transport.resume_reading()
        if self.core._records:
            self.server.schedule_flush()

    def connection_lost(self, exc) -> None:
        self.closing = True
        if self.outq:
            self._stop_writer()
        self.server.conns.pop(self.id, None)
        self.server.unauthenticated.pop(self.id, None)
        reason = "connection closed" if exc is None else f"connection lost: {exc}"
        self.server.apply(self.core.disconnect(self.id, reason))
        self.server.schedule_flush()

    # -- helpers
    def write(self, data: bytes) -> None:
        """Write a small frame, behind any large answer still queued (keeps the order)."""
        if self.outq:
            self.outq.append(memoryview(data))
        else:
            self.transport.write(data)

    def write_pieces(self, pieces: list) -> None:
        """Write a large answer (header + staging views) without copying the payload: send
        straight from the staging buffer while the kernel takes it, and queue the views of
        what is left, sent from our own writable callback. The staging bytes cannot change
        meanwhile: the client reuses that output window only after it has read this answer."""
        views = [memoryview(p).cast("B") for p in pieces]
        if self.outq or self.fd < 0 or self.transport.get_write_buffer_size() != 0:
            self._queue(views)
            return
        for i, mv in enumerate(views):
            try:
                while mv:
                    n = os.write(self.fd, mv)
                    mv = mv[n:]
            except BlockingIOError:
                self._queue([mv, *views[i + 1:]])
                return
            except OSError:
                return  # let the transport find and report the broken connection

    def _queue(self, views: list) -> None:
        if self.outq:
            self.outq.extend(views)
            return
        if self.transport.get_write_buffer_size() != 0 or self._add_writer is None:
            for mv in views:  # the transport already has bytes queued: it must send ours after them
                self.transport.write(mv)
            return
        self.outq.extend(views)
        self._add_writer(self.fd, self._write_ready)

    def _write_ready(self) -> None:
        q = self.outq
        try:
            while q:
                mv = q[0]
                n = os.write(self.fd, mv)
                if n < len(mv):
                    q[0] = mv[n:]
                    return
                q.popleft()
        except BlockingIOError:
            return
        except OSError as exc:
            self._stop_writer()
            self.close(f"write failed: {exc}")
            return
        self._stop_writer()

    def _stop_writer(self) -> None:
        if self._writer_loop is not None:
            self._writer_loop._remove_writer(self.fd)
        self.outq.clear()

    def close(self, reason: str) -> None:
        if self.closing:
            return
        self.closing = True
        if not self.quiet:
            log.warning("closing %s: %s", self.peer, reason)
        if self.transport is not None:
            if self.outq:  # hand what is queued to the transport, which flushes before closing
                pending = list(self.outq)
                self._stop_writer()
                for mv in pending:
                    self.transport.write(mv)
            self.transport.close()

    def _staging_factory(self, hello, S: int):
        if (self.server.transport_name == "unix" and hello.flags & P.HELLO_FLAG_SHM and hello.shm_name):
            arr = map_shm_segment(hello.shm_name, S)
            if arr is not None:
                return arr, True
        return np.zeros(2 * S, dtype=np.uint8), False

    def _route_payload(self, prefix: bytes, payload_len: int):
        client = self.core.clients.get(self.id)
        if client is None:
            raise P.ProtocolError("GROUP before HELLO")
        if client.shm:
            if payload_len:
                raise P.ProtocolError("GROUP carries payload bytes on a shared-memory connection")
            return None
        layout = P.group_payload_layout(prefix, payload_len, client.S)
        mv = client.inp_mv
        return [mv[off:off + ln] for off, ln in layout]


class CoordinatorServer:
    def __init__(self, core: C.Core, *, transport: str, address: str,
                 write_reports: Optional[Callable[[str], None]] = None,
                 report_interval_s: Optional[float] = None, tick_interval_s: Optional[float] = None,
                 hello_timeout_s: float = DEFAULT_HELLO_TIMEOUT_S,
                 max_unauthenticated: int = DEFAULT_MAX_UNAUTHENTICATED):
        self.core = core
        self.transport_name = transport
        self.address = address
        self.write_reports = write_reports
        self.report_interval_s = report_interval_s
        self.hello_timeout_s = hello_timeout_s
        self.max_unauthenticated = max(1, max_unauthenticated)
        self.tick_interval_s = tick_interval_s or max(0.01, min(0.25, core.timeout_s / 8, hello_timeout_s / 4))
        self.conns: dict = {}
        # Connections without a completed HELLO, oldest first (conn id -> Connection).
        self.unauthenticated: collections.OrderedDict = collections.OrderedDict()
        self.scratch_mv = memoryview(bytearray(SCRATCH_BYTES))
        self.throttle = LogThrottle()
        self._flush_scheduled = False
        self._next_id = 0
        self._listeners: list = []
        self._accept_delay = ACCEPT_BACKOFF_S[0]
        self._accept_tasks: set = set()
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stop: Optional[asyncio.Event] = None
        self._stop_reason = ""
        self._created_dir: Optional[str] = None
        self.listen_address = address

    def schedule_flush(self) -> None:
        """Account deferred op records once the ready I/O callbacks have run."""
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        try:
            self.core.flush_records()
        except Exception:
            log.exception("accounting failed")

    def next_conn_id(self) -> int:
        self._next_id += 1
        return self._next_id

    # -- connections that have not completed HELLO
    def admit(self, conn: Connection) -> None:
        """A new connection: it must complete HELLO within hello_timeout_s, and at most
        max_unauthenticated such connections are open: the oldest goes to make room (an idle
        flood ages out first, while a rank sends HELLO at once)."""
        conn.accepted_at = time.monotonic()
        pending = self.unauthenticated
        while len(pending) >= self.max_unauthenticated:
            _, oldest = pending.popitem(last=False)
            self._close_quietly(oldest, "unauthenticated-limit",
                                f"{self.max_unauthenticated} connections are open without a completed HELLO "
                                f"(--max-unauthenticated); closed the oldest, from {oldest.peer}")
        pending[conn.id] = conn

    def authenticated(self, conn: Connection) -> None:
        self.unauthenticated.pop(conn.id, None)

    def _close_quietly(self, conn: Connection, kind: str, message: str) -> None:
        conn.quiet = True
        conn.close(message)
        self.throttle.warning(kind, message)

    def _expire_unauthenticated(self) -> None:
        pending = self.unauthenticated
        if not pending:
            return
        cutoff = time.monotonic() - self.hello_timeout_s
        while pending:
            conn = next(iter(pending.values()))
            if conn.accepted_at > cutoff:
                break
            del pending[conn.id]
            self._close_quietly(conn, "hello-timeout",
                                f"closed {conn.peer}: no HELLO within {self.hello_timeout_s:g} s "
                                "(--hello-timeout-ms)")

    # -- accepting
    def _start_accepting(self) -> None:
        loop = asyncio.get_running_loop()
        for sock in self._listeners:
            loop.add_reader(sock.fileno(), self._accept, sock)

    def _accept(self, sock: socket.socket) -> None:
        loop = self._loop
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _addr = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                if exc.errno in _ACCEPT_RESOURCE_ERRORS:
                    self._accept_exhausted(exc)
                else:
                    self.throttle.warning("accept-error", f"accept() failed: {exc}")
                return
            self._accept_delay = ACCEPT_BACKOFF_S[0]
            conn.setblocking(False)
            task = loop.create_task(self._connect(conn))
            self._accept_tasks.add(task)
            task.add_done_callback(self._accept_tasks.discard)

    def _accept_exhausted(self, exc: OSError) -> None:
        """Out of descriptors (or kernel memory): stop accepting for a moment instead of
        spinning on a listening socket that stays readable. Unauthenticated connections past
        half their time are closed, oldest first, to make room."""
        delay = self._accept_delay
        self._accept_delay = min(ACCEPT_BACKOFF_S[1], delay * 2)
        freed = 0
        cutoff = time.monotonic() - self.hello_timeout_s / 2
        pending = self.unauthenticated
        while pending and freed < ACCEPT_BATCH:
            conn = next(iter(pending.values()))
            if conn.accepted_at > cutoff:
                break
            del pending[conn.id]
            conn.quiet = True
            conn.close("out of file descriptors")
            freed += 1
        self.throttle.warning(
            "accept-exhausted",
            f"cannot accept connections: {exc.strerror or exc} ({len(self.conns)} open, "
            f"{len(self.unauthenticated)} without HELLO); closed {freed} unauthenticated, pausing accept for "
            f"{delay:g} s. Raise the open-files limit (ulimit -n) for larger jobs")
        loop = self._loop
        for sock in self._listeners:
            loop.remove_reader(sock.fileno())
        loop.call_later(delay, self._resume_accepting)

    def _resume_accepting(self) -> None:
        if self._stop is not None and self._stop.is_set():
            return
        for sock in self._listeners:
            if sock.fileno() >= 0:
                self._loop.add_reader(sock.fileno(), self._accept, sock)

    async def _connect(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(lambda: Connection(self), conn)
        except OSError as exc:
            conn.close()
            self.throttle.warning("accept-error", f"setting up an accepted connection failed: {exc}")

    # -- heavy work off the event loop
    def _offload(self, job) -> None:
        """Core hook: run ``job.run()`` in the worker thread, then hand it back to the core on
        the loop. One worker: jobs run in submission order."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                                   thread_name_prefix="fakegpu-execute")
        loop = self._loop
        future = self._executor.submit(job.run)
        future.add_done_callback(lambda _f: loop.call_soon_threadsafe(self._executed, job))

    def _executed(self, job) -> None:
        self.apply(self.core.executed(job))
        self.schedule_flush()

    def continue_group(self, conn: Connection) -> None:
        self._loop.call_soon(conn.continue_group)

    # -- actions from the core
    def apply(self, actions: list) -> None:
        arena_actions = C.ARENA_ACTIONS
        for action in actions:
            # First the arena flags, as if the core had written them while it worked: no answer of
            # this batch reaches a rank before the flags that go with it.
            if action[0] in arena_actions:
                perform_arena_action(*action)
        for kind, cid, data in actions:
            if kind == C.SEND:
                conn = self.conns.get(cid)
                if conn is None or conn.closing:
                    continue
                if type(data) is bytes:
                    conn.write(data)
                else:
                    conn.write_pieces(data)
            elif kind == C.CLOSE:
                conn = self.conns.get(cid)
                if conn is not None:
                    conn.close(data)
            elif kind == C.SHUTDOWN:
                self.request_stop(data)
            elif kind == C.KILL:
                try:
                    os.kill(data, signal.SIGKILL)
                except OSError as exc:
                    log.warning("injected kill: SIGKILL to pid %d failed (%s); the connection is dropped",
                                data, exc.strerror)

    def request_stop(self, reason: str) -> None:
        if self._stop is not None and not self._stop.is_set():
            self._stop_reason = reason
            self._stop.set()

    # -- listening
    async def start(self) -> str:
        loop = self._loop = asyncio.get_running_loop()
        if self._stop is None:
            self._stop = asyncio.Event()
        if self.core.local_collectives:
            remove_stale_arenas()
        if self.transport_name == "unix":
            path = self._prepare_unix_path(self.address)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind(path)
                sock.listen(socket.SOMAXCONN)
            except OSError as exc:
                sock.close()
                raise ServerError(f"cannot listen on unix socket {path}: {exc.strerror or exc}") from None
            os.chmod(path, 0o600)
            self._listeners = [sock]
            self.listen_address = path
        else:
            from fakegpu.env import parse_tcp_address
            host, port = parse_tcp_address(self.address, "--listen")
            if not is_loopback_host(host) and not self.core.token:
                raise ServerError(
                    f"refusing to listen on {host}:{port} without a token: anyone who can reach this "
                    "address could join or shut down the job. Pass --token/--token-file (or set "
                    "FAKEGPU_COORDINATOR_TOKEN / FAKEGPU_COORDINATOR_TOKEN_FILE), or listen on 127.0.0.1")
            try:
                self._listeners = self._tcp_listeners(host, port)
            except OSError as exc:
                raise ServerError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
            sockname = self._listeners[0].getsockname()
            shown = f"[{sockname[0]}]" if ":" in sockname[0] else sockname[0]
            self.listen_address = f"{shown}:{sockname[1]}"
        for sock in self._listeners:
            sock.setblocking(False)
        self._start_accepting()
        _raise_open_files_limit()
        self.core.offload = self._offload
        self.core.group_slice_ops = GROUP_SLICE_OPS
        return self.listen_address

    @staticmethod
    def _tcp_listeners(host: str, port: int) -> list:
        """Listening sockets for every address ``host`` resolves to (as asyncio's create_server
        binds them), all on one port: the first one's, when port 0 asked for any."""
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        socks: list = []
        seen = set()
        try:
            for family, kind, proto, _, addr in infos:
                if (family, addr) in seen:
                    continue
                seen.add((family, addr))
                if socks and port == 0:
                    addr = (addr[0], socks[0].getsockname()[1], *addr[2:])
                sock = socket.socket(family, kind, proto)
                socks.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(addr)
                sock.listen(socket.SOMAXCONN)
        except OSError:
            for sock in socks:
                sock.close()
            raise
        return socks

    def _prepare_unix_path(self, path: str) -> str:
        path = os.path.abspath(path)
        if len(path.encode()) > UNIX_PATH_MAX:
            raise ServerError(f"unix socket path {path!r} is {len(path.encode())} bytes; the limit is "
                              f"{UNIX_PATH_MAX}. Use a shorter path (e.g. under /tmp)")
        directory = os.path.dirname(path)
        if not os.path.isdir(directory):
            try:
                os.makedirs(directory, mode=0o700)
            except OSError as exc:
                raise ServerError(f"cannot create socket directory {directory}: {exc.strerror or exc}") from None
            os.chmod(directory, 0o700)
            self._created_dir = directory
        if os.path.lexists(path):
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                raise ServerError(f"{path} exists and is not a socket; refusing to replace it")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.settimeout(1.0)
            try:
                probe.connect(path)
            except OSError:
                os.unlink(path)  # stale socket of a coordinator that died
            else:
                raise ServerError(f"another coordinator is already listening on {path}")
            finally:
                probe.close()
        return path

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        if self._stop is None:
            self._stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self.request_stop, f"received {signal.Signals(sig).name}")
            except (NotImplementedError, RuntimeError):  # not the main thread
                pass

    async def serve(self) -> str:
        """Serve until SHUTDOWN or a signal; returns why it stopped."""
        loop = asyncio.get_running_loop()
        self.install_signal_handlers()
        ticker = loop.create_task(self._tick_loop())
        reporter = loop.create_task(self._report_loop()) if self.report_interval_s else None
        try:
            await self._stop.wait()
            closing = self.core.close_arenas()
            self.apply(closing)
            if closing:
                # No call starts in an arena any more; the ranks send the ones they ran in batches,
                # at least every 50 ms: keep reading a moment so that the reports hold them all.
                await asyncio.sleep(LOCAL_OPS_GRACE_S)
        finally:
            ticker.cancel()
            if reporter is not None:
                reporter.cancel()
            for sig in (signal.SIGINT, signal.SIGTERM):
                try:
                    loop.remove_signal_handler(sig)
                except (NotImplementedError, RuntimeError):
                    pass
        return self._stop_reason

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.tick_interval_s)
            try:
                self.apply(self.core.tick())
                self.core.flush_records()
                self._expire_unauthenticated()
                self.throttle.flush()
            except Exception:  # never let a bug stop timeouts from firing
                log.exception("timeout tick failed")

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(self.report_interval_s)
            if self.write_reports is not None:
                self.write_reports("periodic")

    async def close(self) -> None:
        for sock in self._listeners:
            if sock.fileno() >= 0:
                self._loop.remove_reader(sock.fileno())
            sock.close()
        if self._executor is not None:
            # A reduction still running finishes first (it writes into staging memory).
            await self._loop.run_in_executor(None, self._executor.shutdown, True)
        self.core.flush_records()
        self.apply(self.core.close())   # unlink the arenas of communicators still alive
        for task in list(self._accept_tasks):
            task.cancel()
        for conn in list(self.conns.values()):
            conn.closing = True
            if conn.transport is not None:
                conn.transport.close()
        await asyncio.sleep(0)
        if self.transport_name == "unix":
            try:
                os.unlink(self.listen_address)
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    log.warning("cannot remove %s: %s", self.listen_address, exc)
            if self._created_dir:
                try:
                    os.rmdir(self._created_dir)
                except OSError:
                    pass


def _raise_open_files_limit() -> None:
    """Every rank holds one connection: let the coordinator use as many descriptors as the
    hard limit allows (the soft limit is often 1024)."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard > soft:
            target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, ValueError, OSError):
        pass


async def run_server(core: C.Core, *, transport: str, address: str, on_listening: Callable[[str], None],
                     write_reports: Optional[Callable[[str], None]] = None,
                     report_interval_s: Optional[float] = None,
                     hello_timeout_s: float = DEFAULT_HELLO_TIMEOUT_S,
                     max_unauthenticated: int = DEFAULT_MAX_UNAUTHENTICATED) -> str:
    server = CoordinatorServer(core, transport=transport, address=address, write_reports=write_reports,
                               report_interval_s=report_interval_s, hello_timeout_s=hello_timeout_s,
                               max_unauthenticated=max_unauthenticated)
    server.install_signal_handlers()  # before announcing: a SIGTERM right after must still write reports
    addr = await server.start()
    on_listening(addr)
    try:
        reason = await server.serve()
    finally:
        await server.close()
    return reason
