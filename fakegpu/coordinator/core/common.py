"""Constants and small helpers every part of the Core uses."""
from __future__ import annotations

import logging
import os
from typing import Optional

import numpy as np

from fakegpu import protocol as P


log = logging.getLogger("fakegpu.coordinator")

# Actions the I/O layer performs: (SEND, conn, data), (CLOSE, conn, reason),
# (SHUTDOWN, None, reason), (KILL, conn, pid): SIGKILL that process (a fault injected by
# FAKEGPU_FAULTS), before the connection's CLOSE that follows it.
SEND, CLOSE, SHUTDOWN, KILL = 0, 1, 2, 3
# Writes into a host-local arena (arena.py), (kind, Arena, value); the core itself never touches
# shared memory. The I/O layer performs those of one batch before its other actions, so a flag
# is up before any answer of the same batch reaches a rank (ranks read the flags, not the answers):
# ARENA_PENDING: Arena.set_pending(value), the number of collectives waiting at the coordinator;
# ARENA_FAILED: Arena.set_failed(value), comm rank value left (sent once, the first one);
# ARENA_CLOSING: Arena.set_closing(), the coordinator is stopping; ARENA_CLOSE: Arena.close(), unlink.
ARENA_PENDING, ARENA_FAILED, ARENA_CLOSING, ARENA_CLOSE = 4, 5, 6, 7
ARENA_ACTIONS = frozenset((ARENA_PENDING, ARENA_FAILED, ARENA_CLOSING, ARENA_CLOSE))

DEFAULT_STAGING_BYTES = 32 << 20

MAX_STAGING_BYTES = 256 << 20

MIN_STAGING_BYTES = 4096

# Collectives touching at least this many staging bytes run through ``Core.offload`` (the
# server's worker thread) when one is set; smaller ones inline, where a thread hop would cost
# more than the work.
OFFLOAD_MIN_BYTES = 4 << 20

_HDR = P.HEADER

_OPDESC_UNPACK = P.OPDESC_STRUCT.unpack_from

_OPDESC_SIZE = P.OPDESC_SIZE

# Failed calls kept per communicator (or Send/Recv pair) until every member is past them; a
# member that never moves on cannot make the coordinator keep more than this many.
_MAX_FAILED_CALLS = 1024

_NO_PAYLOAD = np.empty(0, dtype=np.uint8)

_MAX_SPLIT_GROUPS = 4096   # groups of one connection in several frames at once (one per thread)

_OPDESC_ITER = P.OPDESC_STRUCT.iter_unpack

_GROUP_HEAD = P.GROUP_HEAD

_DONE_ONE_OK = P.encode_body(P.GroupDone((P.NCCL_SUCCESS,), ""))   # the common answer, encoded once

_LOCAL_KINDS = P.LOCAL_KINDS

_FIRST = P.OP_FLAG_FIRST_STEP

_LAST = P.OP_FLAG_LAST_STEP

_SEND_KIND = P.KIND_SEND

_RECV_KIND = P.KIND_RECV

_PREMUL = P.REDOP_PREMULSUM

_STATUS_BY_RESULT = {P.NCCL_INVALID_USAGE: "mismatch", P.NCCL_INVALID_ARGUMENT: "error",
                     P.NCCL_TIMEOUT: "timeout", P.NCCL_REMOTE_ERROR: "peer_failed"}

def _reported_code(default_code: int, codes: Optional[dict]) -> int:
    """The result a failed call is reported with: ncclInvalidArgument when some rank passed a bad
    argument (the others got ncclInvalidUsage), else the call's result."""
    return P.NCCL_INVALID_ARGUMENT if codes and P.NCCL_INVALID_ARGUMENT in codes.values() else default_code

def frame_bytes(msg_type: int, request_id: int, body: bytes) -> bytes:
    return _HDR.pack(P.MAGIC, P.VERSION, msg_type, request_id, len(body)) + body

def error_frame(request_id: int, result: int, message: str) -> bytes:
    return frame_bytes(P.ERROR, request_id, P.encode_body(P.Error(result, message)))

def default_staging_factory(hello, staging_bytes: int):
    """Socket staging: a per-connection buffer. np.zeros is lazily backed by the OS, so
    untouched parts of the regions cost no memory."""
    return np.zeros(2 * staging_bytes, dtype=np.uint8), False

def _env_local_collectives() -> bool:
    """FAKEGPU_LOCAL_COLLECTIVES, read like the shim does: unset or empty = on."""
    from fakegpu.env import parse_bool
    text = os.environ.get("FAKEGPU_LOCAL_COLLECTIVES", "")
    return not text.strip() or parse_bool(text, "FAKEGPU_LOCAL_COLLECTIVES")

def _env_local_slot_bytes() -> Optional[int]:
    from fakegpu.env import parse_size
    text = os.environ.get("FAKEGPU_LOCAL_SLOT_BYTES", "")
    return parse_size(text, "FAKEGPU_LOCAL_SLOT_BYTES") if text.strip() else None

def logical_bytes(kind: int, count: int, size: int, n: int) -> int:
    """Payload size in the nccl-tests sense (docs/cost-model.md, "nccl-tests conventions")."""
    return count * size * (n if P.per_member_blocks(kind) else 1)

def _version() -> str:
    try:
        from fakegpu import __version__
        return __version__
    except Exception:  # pragma: no cover
        return "unknown"
