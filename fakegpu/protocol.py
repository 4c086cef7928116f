"""Sans-I/O codec for the fakegpu wire protocol, version 2 (docs/protocol.md).

Nothing here touches a socket: messages are plain dataclasses, ``encode_frame`` turns
one into bytes, ``decode_body`` turns a frame body back into a message, and
``FrameParser`` cuts an arbitrary byte stream into frames while enforcing the limits a
receiver must enforce (magic, version, known type, body length). Every violation raises
``ProtocolError`` with a message that names what was wrong.

The coordinator's hot path does not build these dataclasses for GROUP frames; it reads
the OpDesc table straight out of the frame body with ``OPDESC_STRUCT``. The dataclasses
are for tests, the Python client and the byte vectors shared with the C++ shim.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Optional, Sequence, Union

# The wire's tables (message types, flag bits, OpDesc layout, kinds, datatypes, reduction operators,
# result codes) are declared once in spec/wire.py and generated into fakegpu/wire_spec.py and the
# shim's native/src/generated/wire_spec.h; this module adds the codec around them.
from fakegpu.wire_spec import *  # noqa: F401,F403  (part of this module's API: P.KIND_NAMES, P.GROUP, ...)
# The message bodies' codecs are generated from spec/wire.py's BODIES (fakegpu/wire_bodies.py) and
# written with fakegpu/wire_io.py's pieces; this module adds the messages, frames and the parser.
from fakegpu import wire_bodies as _bodies
from fakegpu.wire_io import MAX_STR_BYTES, ProtocolError, Reader, encode_str, pack as _pack  # noqa: F401

HEADER = struct.Struct(HEADER_FORMAT)
HEADER_SIZE = HEADER.size  # 16
OPDESC_STRUCT = struct.Struct(OPDESC_FORMAT)
assert HEADER_SIZE == 16 and OPDESC_STRUCT.size == OPDESC_SIZE == 88

# OpDesc in_offset and in_len (two u64 side by side), read as a column by group_payload_layout.
_OPDESC_IN_OFFSET = OPDESC_OFFSETS["in_offset"]
assert OPDESC_OFFSETS["in_len"] == _OPDESC_IN_OFFSET + 8

# Frames other than GROUP / GROUP_DONE / SIMULATE / ACCOUNT are small; so are descriptor tables (the
# "+ 16 MiB" of the body limit). Bounding them bounds what a connection can make us buffer.
MAX_SMALL_BODY = 256 * 1024
MAX_DESCRIPTOR_BYTES = 16 << 20
# Before HELLO the staging size is unknown; nothing legitimate is larger than this.
PRE_HELLO_MAX_BODY = 64 * 1024

_LARGE_TYPES = LARGE_TYPES


class VersionError(ProtocolError):
    """The peer speaks another protocol version. docs/protocol.md: answer with a version-1
    ERROR frame that states our version, then close."""

    def __init__(self, version: int, request_id: int):
        super().__init__(f"unsupported protocol version {version} (this side speaks {VERSION})")
        self.version = version
        self.request_id = request_id


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class Hello:
    TYPE: ClassVar[int] = HELLO
    flags: int = 0
    global_rank: int = -1
    local_rank: int = -1
    world_size: int = -1
    pid: int = 0
    staging_bytes: int = 0
    token: str = ""
    shm_name: str = ""
    hostname: str = ""


@dataclass(frozen=True)
class HelloOk:
    TYPE: ClassVar[int] = HELLO_OK
    client_id: int
    flags: int
    staging_bytes: int
    timeout_ms: int


@dataclass(frozen=True)
class Error:
    TYPE: ClassVar[int] = ERROR
    result: int
    message: str


@dataclass(frozen=True)
class Ok:
    TYPE: ClassVar[int] = OK


@dataclass(frozen=True)
class CommInit:
    TYPE: ClassVar[int] = COMM_INIT
    unique_id: bytes
    nranks: int
    rank: int
    name: str = ""


@dataclass(frozen=True)
class CommInfo:
    TYPE: ClassVar[int] = COMM_INFO
    comm_handle: int
    rank: int
    global_ranks: tuple = ()

    @property
    def nranks(self) -> int:
        return len(self.global_ranks)


@dataclass(frozen=True)
class CommSplit:
    TYPE: ClassVar[int] = COMM_SPLIT
    parent_handle: int
    color: int
    key: int
    name: str = ""


@dataclass(frozen=True)
class CommShrink:
    """ncclCommShrink: a new communicator of the parent's members minus ``excluded``."""
    TYPE: ClassVar[int] = COMM_SHRINK
    parent_handle: int
    flags: int = 0
    excluded: tuple = ()
    name: str = ""


@dataclass(frozen=True)
class CommFree:
    TYPE: ClassVar[int] = COMM_FREE
    comm_handle: int
    how: int = FREE_DESTROY


@dataclass(frozen=True)
class OpDesc:
    comm_handle: int
    kind: int
    datatype: int
    redop: int = 0
    flags: int = OP_FLAG_FIRST_STEP | OP_FLAG_LAST_STEP
    root: int = -1
    total_count: int = 0
    step_count: int = 0
    in_offset: int = 0
    in_len: int = 0
    out_offset: int = 0
    out_len: int = 0
    scalar: bytes = bytes(8)
    call_seq: int = 0
    match_seq: int = 1
    step_index: int = 0
    step_total: int = 1

    def __post_init__(self):
        # The wire carries the scalar left-aligned in 8 bytes; normalise so equal ops compare equal.
        scalar = bytes(self.scalar)
        if len(scalar) < 8:
            object.__setattr__(self, "scalar", scalar.ljust(8, b"\0"))

    def pack(self) -> bytes:
        scalar = bytes(self.scalar)
        if len(scalar) > 8:
            raise ProtocolError(f"OpDesc scalar is {len(scalar)} bytes; at most 8 fit")
        return _pack(OPDESC_STRUCT, "OpDesc", self.comm_handle, self.kind, self.datatype,
                     self.redop, self.flags, self.root, self.total_count, self.step_count,
                     self.in_offset, self.in_len, self.out_offset, self.out_len,
                     scalar.ljust(8, b"\0"), self.call_seq, self.match_seq,
                     self.step_index, self.step_total)

    @classmethod
    def unpack_from(cls, buf, offset: int = 0) -> "OpDesc":
        return cls(*OPDESC_STRUCT.unpack_from(buf, offset))


@dataclass(frozen=True)
class Group:
    TYPE: ClassVar[int] = GROUP
    ops: tuple = ()
    flags: int = 0
    payload: bytes = b""

    @property
    def n_ops(self) -> int:
        return len(self.ops)


@dataclass(frozen=True)
class GroupDone:
    TYPE: ClassVar[int] = GROUP_DONE
    results: tuple = ()
    message: str = ""
    payload: bytes = b""

    @property
    def n_ops(self) -> int:
        return len(self.results)


@dataclass(frozen=True)
class Simulate:
    TYPE: ClassVar[int] = SIMULATE
    ops: tuple = ()
    flags: int = 0

    @property
    def n_ops(self) -> int:
        return len(self.ops)


@dataclass(frozen=True)
class Account:
    """Proxy mode: the ops a rank forwarded to NVIDIA's NCCL, matched and accounted like a
    GROUP's steps with no data movement; answered by GROUP_DONE without payload."""
    TYPE: ClassVar[int] = ACCOUNT
    ops: tuple = ()
    flags: int = 0

    @property
    def n_ops(self) -> int:
        return len(self.ops)


@dataclass(frozen=True)
class ArenaRequest:
    """ARENA: the shared-memory arena of the communicator the member handle belongs to."""
    TYPE: ClassVar[int] = ARENA
    comm_handle: int


@dataclass(frozen=True)
class ProbeSource:
    """PROBE_SOURCE: which rank has a Send to the caller waiting (docs/protocol.md, "Receive from
    any source"); answered by SOURCE once one does, or by ERROR ``ncclTimeout`` after
    ``timeout_ms`` (0: the coordinator's own timeout, which also caps any other value)."""
    TYPE: ClassVar[int] = PROBE_SOURCE
    comm_handle: int
    timeout_ms: int = 0
    # The caller's Recv calls from each rank of the communicator so far (its match_seq
    # counters): the next Recv from rank s pairs with s's Send number recvs_posted[s] + 1.
    recvs_posted: tuple = ()


@dataclass(frozen=True)
class Source:
    """SOURCE: the answer to PROBE_SOURCE, ``peer`` a rank of the caller's communicator."""
    TYPE: ClassVar[int] = SOURCE
    peer: int


@dataclass(frozen=True)
class ArenaInfo:
    """ARENA_INFO: ``granted`` 1 with the arena file's path and geometry, or 0 with ``reason``."""
    TYPE: ClassVar[int] = ARENA_INFO
    granted: int
    rank: int
    slot_bytes: int = 0
    total_bytes: int = 0
    path: str = ""
    reason: str = ""


@dataclass(frozen=True)
class LocalOpRecord:
    """One call run in an arena as comm rank 0 saw it; ``arrival_wait_s`` in comm rank order."""
    desc: OpDesc
    started_at: float
    rendezvous_s: float
    execution_s: float
    arrival_wait_s: tuple = ()


@dataclass(frozen=True)
class LocalOps:
    """LOCAL_OPS: comm rank 0's batch of arena calls, for the reports. Never answered."""
    TYPE: ClassVar[int] = LOCAL_OPS
    comm_handle: int
    nranks: int
    records: tuple = ()


@dataclass(frozen=True)
class SimulateDone:
    TYPE: ClassVar[int] = SIMULATE_DONE
    estimated_time_us: float


@dataclass(frozen=True)
class Ping:
    """Empty body, or the coordinator's token (needed on a connection that has not sent HELLO)."""
    TYPE: ClassVar[int] = PING
    token: str = ""


@dataclass(frozen=True)
class Pong:
    TYPE: ClassVar[int] = PONG
    description: str


@dataclass(frozen=True)
class Shutdown:
    TYPE: ClassVar[int] = SHUTDOWN
    token: str = ""


Message = Union[Hello, HelloOk, Error, Ok, CommInit, CommInfo, CommSplit, CommShrink, CommFree, Group,
                GroupDone, Simulate, SimulateDone, Account, Ping, Pong, Shutdown, ArenaRequest, ArenaInfo,
                LocalOps, ProbeSource, Source]

# --------------------------------------------------------------------------- encoding

# The head of GROUP / SIMULATE / ACCOUNT (u32 n_ops, u32 flags), read in place by the parser
# and the coordinator; generated from spec/wire.py like every body.
GROUP_HEAD = _bodies.GROUP_HEAD_0
LOCAL_OPS_HEAD = _bodies.LOCAL_OPS_0   # u64 comm_handle, u32 n_records, u32 nranks
# LOCAL_OPS as plain fields, (comm_handle, nranks, records of (OpDesc tuple, started_at,
# rendezvous_s, execution_s, arrival waits)): the coordinator's path, without dataclasses.
decode_local_ops_fields = _bodies.decode_local_ops


def encode_header(msg_type: int, request_id: int, body_len: int) -> bytes:
    return _pack(HEADER, "frame header", MAGIC, VERSION, msg_type, request_id, body_len)


def encode_body(msg: Message) -> bytes:
    t = msg.TYPE
    if t in (GROUP, SIMULATE, ACCOUNT):
        head = _bodies.encode_group_head(msg) + b"".join(op.pack() for op in msg.ops)
        return head + bytes(msg.payload) if t == GROUP else head
    if t == GROUP_DONE:
        return _bodies.encode_group_done(msg) + bytes(msg.payload)
    if t == OK:
        return b""
    codec = _bodies.CODECS.get(t)
    if codec is None:
        raise ProtocolError(f"cannot encode unknown message {msg!r}")
    return codec[0](msg)


def encode_frame(msg: Message, request_id: int = 0) -> bytes:
    body = encode_body(msg)
    return encode_header(msg.TYPE, request_id, len(body)) + body


# --------------------------------------------------------------------------- decoding


_Reader = Reader


def decode_ops(r: _Reader, n_ops: int) -> tuple:
    r.need(n_ops * OPDESC_SIZE, f"{n_ops} OpDesc")
    ops = tuple(OpDesc.unpack_from(r.buf, r.pos + i * OPDESC_SIZE) for i in range(n_ops))
    r.pos += n_ops * OPDESC_SIZE
    return ops


def _local_ops(comm_handle: int, nranks: int, records: tuple) -> "LocalOps":
    return LocalOps(comm_handle, nranks, tuple(LocalOpRecord(OpDesc(*desc), *rest) for desc, *rest in records))


# message type -> its dataclass, for the bodies decoded by wire_bodies.
_CLASSES = {cls.TYPE: cls for cls in (Hello, HelloOk, Error, CommInit, CommInfo, CommSplit, CommShrink,
                                      CommFree, ArenaRequest, ProbeSource, Source, ArenaInfo, SimulateDone,
                                      Ping, Pong, Shutdown)}


def decode_body(msg_type: int, body) -> Message:
    """Decode one frame body. Raises ProtocolError naming the problem."""
    name = MESSAGE_NAMES.get(msg_type)
    if name is None:
        raise ProtocolError(f"unknown message type {msg_type}")
    r = Reader(body, name)
    if msg_type in (GROUP, SIMULATE, ACCOUNT):
        n_ops, flags = _bodies.decode_group_head(r)
        ops = decode_ops(r, n_ops)
        if msg_type == GROUP:
            msg = Group(ops, flags, r.rest())
        elif msg_type == ACCOUNT:
            msg = Account(ops, flags)
        else:
            msg = Simulate(ops, flags)
    elif msg_type == GROUP_DONE:
        results, message = _bodies.decode_group_done(r)
        msg = GroupDone(tuple(results), message, r.rest())
    elif msg_type == LOCAL_OPS:
        msg = _local_ops(*_bodies.decode_local_ops(r))
    elif msg_type == OK:
        msg = Ok()
    else:
        msg = _CLASSES[msg_type](*_bodies.CODECS[msg_type][1](r))
    r.done()
    return msg


def decode_frame(data) -> tuple[int, Message]:
    """Decode exactly one whole frame (header + body). Returns (request_id, message)."""
    frames = FrameParser(max_body_len=1 << 32).feed(data)
    if len(frames) != 1:
        raise ProtocolError(f"expected exactly one frame, found {len(frames)}")
    f = frames[0]
    return f.request_id, decode_body(f.msg_type, f.body)


# --------------------------------------------------------------------------- stream parser


class Frame:
    """One received frame. ``body`` excludes socket-staged GROUP payload when a payload
    router placed it directly (``payload_placed``)."""

    __slots__ = ("msg_type", "request_id", "body", "payload_placed")

    def __init__(self, msg_type: int, request_id: int, body: bytes, payload_placed: bool = False):
        self.msg_type = msg_type
        self.request_id = request_id
        self.body = body
        self.payload_placed = payload_placed

    def __repr__(self) -> str:
        return (f"Frame({MESSAGE_NAMES.get(self.msg_type, self.msg_type)}, rid={self.request_id}, "
                f"{len(self.body)} body bytes{', payload placed' if self.payload_placed else ''})")


# A payload router gets the GROUP body prefix (n_ops, flags, OpDescs) and returns the
# writable destinations (memoryviews) for the socket-staged bytes, in op order, or None
# to receive the payload inside the frame body as usual. It may raise ProtocolError.
PayloadRouter = Callable[[bytes, int], Optional[Sequence[memoryview]]]


class FrameParser:
    """Incremental frame parser: ``feed(bytes) -> [Frame]``.

    Validates each header as soon as its 16 bytes are in (magic, version, type, body_len
    against ``max_body_len``), so a hostile peer cannot make us buffer more than one
    legal frame. ``accepted_types`` restricts the types (a server accepts only
    client-to-server types). With a ``payload_router`` the socket-staged payload of a
    GROUP frame is copied straight into the destinations it returns (the connection's
    staging buffer) instead of being accumulated.
    """

    def __init__(self, max_body_len: int, accepted_types: Optional[frozenset] = None,
                 payload_router: Optional[PayloadRouter] = None):
        self.max_body_len = max_body_len
        self.accepted_types = accepted_types
        self.payload_router = payload_router
        self._buf = bytearray()
        self._hdr: Optional[tuple] = None  # (type, request_id, body_len)
        # Direct payload placement state.
        self._targets: Optional[list] = None
        self._target_idx = 0
        self._target_pos = 0
        self._direct_frame: Optional[Frame] = None

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def _check_header(self, magic, version, msg_type, body_len, request_id=0) -> None:
        if magic != MAGIC:
            raise ProtocolError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r})")
        if version != VERSION:
            raise VersionError(version, request_id)
        if msg_type not in MESSAGE_NAMES:
            raise ProtocolError(f"unknown message type {msg_type}")
        if self.accepted_types is not None and msg_type not in self.accepted_types:
            raise ProtocolError(f"message type {MESSAGE_NAMES[msg_type]} ({msg_type}) is not accepted in this direction")
        limit = self.max_body_len if msg_type in _LARGE_TYPES else min(self.max_body_len, MAX_SMALL_BODY)
        if msg_type == SIMULATE or msg_type == ACCOUNT:
            limit = min(limit, MAX_DESCRIPTOR_BYTES + 8)
        elif msg_type == LOCAL_OPS:
            limit = min(limit, MAX_DESCRIPTOR_BYTES + LOCAL_OPS_HEAD.size)
        if body_len > limit:
            raise ProtocolError(
                f"{MESSAGE_NAMES[msg_type]} body_len {body_len} exceeds the limit of {limit} bytes")

    def _feed_direct(self, mv: memoryview, pos: int, frames: list) -> int:
        """Copy payload bytes from mv[pos:] into the targets; return the new position."""
        targets = self._targets
        n = len(mv)
        while pos < n and self._target_idx < len(targets):
            t = targets[self._target_idx]
            room = len(t) - self._target_pos
            take = min(room, n - pos)
            t[self._target_pos:self._target_pos + take] = mv[pos:pos + take]
            pos += take
            self._target_pos += take
            if self._target_pos == len(t):
                self._target_idx += 1
                self._target_pos = 0
        if self._target_idx >= len(targets):
            frames.append(self._direct_frame)
            self._targets = None
            self._direct_frame = None
        return pos

    # Zero-copy receive (asyncio.BufferedProtocol): while a GROUP payload is being routed,
    # the transport may recv_into the destination itself.
    def direct_buffer(self) -> Optional[memoryview]:
        """The unfilled rest of the current payload destination, or None."""
        if self._targets is None:
            return None
        t = self._targets[self._target_idx]
        return t[self._target_pos:]

    def direct_filled(self, nbytes: int) -> list:
        """``nbytes`` were written into ``direct_buffer()``; returns the frames completed."""
        frames: list = []
        self._target_pos += nbytes
        t = self._targets[self._target_idx]
        if self._target_pos >= len(t):
            self._target_idx += 1
            self._target_pos = 0
            if self._target_idx >= len(self._targets):
                frames.append(self._direct_frame)
                self._targets = None
                self._direct_frame = None
        return frames

    def feed(self, data) -> list:
        if self._hdr is None and self._targets is None and not self._buf and len(data) >= HEADER_SIZE:
            # Fast path: exactly one whole frame without a payload to route (the common
            # case for small requests).
            magic, version, msg_type, rid, body_len = HEADER.unpack_from(data, 0)
            if len(data) == HEADER_SIZE + body_len and (
                    msg_type != GROUP or self.payload_router is None
                    or (body_len >= GROUP_HEAD.size
                        and body_len == GROUP_HEAD.size + OPDESC_SIZE * GROUP_HEAD.unpack_from(data, HEADER_SIZE)[0])):
                self._check_header(magic, version, msg_type, body_len, rid)
                return [Frame(msg_type, rid, bytes(data[HEADER_SIZE:]))]
        frames: list = []
        if self._targets is not None:
            mv = memoryview(data)
            pos = self._feed_direct(mv, 0, frames)
            if pos == len(mv):
                return frames
            data = mv[pos:]
        buf = self._buf
        buf += data
        pos = 0
        while True:
            hdr = self._hdr
            if hdr is None:
                if len(buf) - pos < HEADER_SIZE:
                    break
                magic, version, msg_type, rid, body_len = HEADER.unpack_from(buf, pos)
                self._check_header(magic, version, msg_type, body_len, rid)
                pos += HEADER_SIZE
                hdr = self._hdr = (msg_type, rid, body_len)
            msg_type, rid, body_len = hdr
            avail = len(buf) - pos
            if msg_type == GROUP and self.payload_router is not None:
                # Route the payload once the descriptor table is in.
                if avail < 8:
                    break
                n_ops, _flags = GROUP_HEAD.unpack_from(buf, pos)
                desc_end = 8 + n_ops * OPDESC_SIZE
                if desc_end - 8 > MAX_DESCRIPTOR_BYTES:
                    raise ProtocolError(
                        f"GROUP declares {n_ops} ops: its descriptor table exceeds {MAX_DESCRIPTOR_BYTES} bytes")
                if desc_end > body_len:
                    raise ProtocolError(
                        f"GROUP declares {n_ops} ops ({desc_end} bytes) but body_len is {body_len}")
                if avail < desc_end:
                    break
                prefix = bytes(buf[pos:pos + desc_end])
                targets = self.payload_router(prefix, body_len - desc_end)
                if targets is not None:
                    pos += desc_end
                    self._hdr = None
                    frame = Frame(GROUP, rid, prefix, True)
                    self._targets = [t for t in targets if len(t)]
                    self._target_idx = 0
                    self._target_pos = 0
                    self._direct_frame = frame
                    if not self._targets:
                        frames.append(frame)
                        self._targets = None
                        continue
                    mv = memoryview(buf)
                    try:
                        pos = self._feed_direct(mv, pos, frames)
                    finally:
                        mv.release()
                    if self._targets is not None:
                        break  # all buffered bytes consumed by the payload
                    continue
                # Router declined: fall through to whole-body accumulation.
            if avail < body_len:
                break
            body = bytes(buf[pos:pos + body_len])
            pos += body_len
            self._hdr = None
            frames.append(Frame(msg_type, rid, body))
        if pos:
            del buf[:pos]
        return frames


def group_payload_layout(prefix: bytes, payload_len: int, region_bytes: int) -> list:
    """Where a socket-staged GROUP payload goes: (offset, length) ranges of the input region
    ``[0, region_bytes)`` in payload order, one per op with a non-zero in_len, and ranges that
    follow each other in the region merged into one (so a packed group is one range).

    The payload must be exactly the sum of in_len and every input must lie inside the
    input region; otherwise ProtocolError. Vectorised: a 200k-op table takes milliseconds.
    """
    import numpy as np  # here: the admin client (--ping) imports this module without numpy work

    n_ops = GROUP_HEAD.unpack_from(prefix, 0)[0]
    if len(prefix) < 8 + n_ops * OPDESC_SIZE:
        raise ProtocolError(f"GROUP declares {n_ops} ops but its descriptor table is truncated")
    if n_ops == 0:
        off = ln = np.zeros(0, dtype=np.uint64)
    else:
        fields = np.ndarray((n_ops, 2), dtype="<u8", buffer=prefix, offset=8 + _OPDESC_IN_OFFSET,
                            strides=(OPDESC_SIZE, 8))
        off, ln = fields[:, 0], fields[:, 1]
    region = np.uint64(region_bytes)
    outside = (ln > region) | (off > region - np.minimum(ln, region))
    if outside.any():
        i = int(np.flatnonzero(outside)[0])
        o, n = int(off[i]), int(ln[i])
        raise ProtocolError(
            f"GROUP op {i}: input [{o}, {o + n}) lies outside the {region_bytes}-byte input region")
    total = int(ln.sum(dtype=np.uint64))
    if total != payload_len:
        raise ProtocolError(
            f"GROUP payload is {payload_len} bytes but the ops' in_len add up to {total}")
    used = ln != 0
    off, ln = off[used], ln[used]
    if len(off) == 0:
        return []
    # A new range starts wherever an input does not begin where the previous one ended.
    starts = np.flatnonzero(np.concatenate(([True], off[1:] != off[:-1] + ln[:-1])))
    return list(zip(off[starts].tolist(), np.add.reduceat(ln, starts).tolist()))
