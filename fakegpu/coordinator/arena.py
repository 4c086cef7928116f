"""Shared-memory arenas for host-local collectives: the coordinator's side of the file.

An arena is one file in /dev/shm per communicator whose members all run on the coordinator's
host with shared memory (docs/protocol.md, "Host-local collectives"). The ranks copy their
inputs into it, meet at a futex barrier and compute the results themselves; the coordinator
only creates the file, writes its header, and keeps two fields in it up to date: ``pending``
(how many collectives of the communicator wait at the coordinator for members: ranks waiting
in the arena then send their call to the coordinator instead) and ``failed`` (a member left). Everything
past the header belongs to the ranks.
"""
from __future__ import annotations

import logging
import mmap
import os
import secrets
import struct
from typing import Callable, Optional

from fakegpu import wire_spec as W

log = logging.getLogger("fakegpu.coordinator")

# The layout is declared in spec/wire.py (generated into fakegpu/wire_spec.py and the shim's
# native/src/generated/wire_spec.h).
MAGIC = W.ARENA_MAGIC                        # the bytes "F" "G" "A" "R" read as a little-endian u32
LAYOUT_VERSION = W.ARENA_LAYOUT_VERSION
HEADER = struct.Struct(W.ARENA_HEADER_FORMAT)  # magic, version, nranks, failed, slot_bytes, pending, closing
OFF_FAILED = W.ARENA_OFF_FAILED
OFF_PENDING = W.ARENA_OFF_PENDING
OFF_CLOSING = W.ARENA_OFF_CLOSING
RECORDS_AT = W.ARENA_RECORDS_AT              # rank r's 256-byte block at RECORDS_AT + 256 * r
RECORD_BYTES = W.ARENA_RECORD_BLOCK
PAGE = 4096

# Per-slot cap. Smaller slots keep a round's working set in cache, larger ones need fewer
# barriers; 4 ranks, 2 cores, 16-64 MiB allreduce: 1 MiB best (2.3 GB/s at 64 MiB), 512 KiB
# close, 4 MiB ~1.2 GB/s, 256 KiB ~0.6 GB/s.
MAX_SLOT_BYTES = 1 << 20
BUDGET_BYTES = 256 << 20       # both parities of all slots together stay under this by default
MIN_SLOT_BYTES = 4096

_U32 = struct.Struct("<I")


def data_offset(nranks: int) -> int:
    """D: where the slots start, after the header page and the rank records (page aligned)."""
    end = RECORDS_AT + RECORD_BYTES * nranks
    return (end + PAGE - 1) // PAGE * PAGE


def total_bytes(nranks: int, slot_bytes: int) -> int:
    """D + two parities of (n input slots + 1 shared output slot)."""
    return data_offset(nranks) + 2 * (nranks + 1) * slot_bytes


def slot_bytes_for(nranks: int, staging_bytes: int, override: Optional[int] = None) -> int:
    """Slot size: min(1 MiB, 256 MiB / (2(n+1))) or the override, never above the smallest
    staging size granted to the members (so a call that fits a slot also fits their staging),
    a multiple of 4096 (every slot page aligned), at least 4096."""
    if override:
        slot = int(override)
    else:
        slot = min(MAX_SLOT_BYTES, BUDGET_BYTES // (2 * (nranks + 1)))
    slot = min(slot, int(staging_bytes))
    slot = slot // PAGE * PAGE
    return max(MIN_SLOT_BYTES, slot)


class Arena:
    """One communicator's arena file, mapped by the coordinator for the two flags it writes."""

    __slots__ = ("path", "nranks", "slot_bytes", "total_bytes", "map", "pending", "failed", "closed")

    def __init__(self, path: str, nranks: int, slot_bytes: int, size: int, mapping):
        self.path = path
        self.nranks = nranks
        self.slot_bytes = slot_bytes
        self.total_bytes = size
        self.map = mapping
        self.pending = 0          # collectives of the comm waiting at the coordinator for members
        self.failed = 0           # comm rank + 1 of the first member that left, 0 while none
        self.closed = False

    def set_pending(self, count: int) -> None:
        """Publish how many collectives of the communicator wait at the coordinator. While it is
        not 0 no call starts in the arena, and members waiting in its barrier withdraw and send
        their call here: the members of a call never split between the two paths."""
        if self.closed or count == self.pending:
            return
        self.pending = count
        _U32.pack_into(self.map, OFF_PENDING, count)

    def set_closing(self) -> None:
        """The coordinator is stopping: no call starts in the arena any more, and members
        waiting at a call's first barrier take it to the coordinator, so every call that
        completes in the arena from now on is one the ranks will still report."""
        if not self.closed:
            _U32.pack_into(self.map, OFF_CLOSING, 1)

    def set_failed(self, rank: int) -> None:
        """Record that comm rank ``rank`` left. The first one wins: ranks waiting in the barrier
        report the member that broke the communicator, not the last one to leave."""
        if self.failed or self.closed:
            return
        self.failed = rank + 1
        _U32.pack_into(self.map, OFF_FAILED, rank + 1)

    def close(self) -> None:
        """Unlink the file and drop the mapping. Ranks that still map it keep their pages."""
        if self.closed:
            return
        self.closed = True
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot remove arena file %s: %s", self.path, exc)
        try:
            self.map.close()
        except (BufferError, ValueError):   # a view of it still alive (tests): the GC unmaps it
            pass


def arena_path(directory: str, comm_id: int) -> str:
    # The pid keeps coordinators on one host apart; the random part keeps a stale file of a
    # crashed coordinator whose pid was reused from blocking O_EXCL.
    return os.path.join(directory, f"fakegpu-arena-{os.getpid()}-{comm_id}-{secrets.token_hex(4)}")


def create_arena(comm_id: int, nranks: int, slot_bytes: int, directory: str = "/dev/shm") -> Arena:
    """Create, allocate, map and stamp the arena file of communicator ``comm_id``.

    Every page is allocated now (posix_fallocate): a sparse file on a /dev/shm too small for it
    would kill the ranks with SIGBUS at their first large call. Raises OSError when the file
    cannot be made or allocated (no /dev/shm, ENOSPC); nothing is left behind then."""
    path = arena_path(directory, comm_id)
    size = total_bytes(nranks, slot_bytes)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, size)   # also sets the size; the pages come zero-filled
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        HEADER.pack_into(mapping, 0, MAGIC, LAYOUT_VERSION, nranks, 0, slot_bytes, 0, 0)
    except BaseException:
        try:
            os.unlink(path)
        except OSError:
            pass
        raise
    return Arena(path, nranks, slot_bytes, size, mapping)


# (comm_id, nranks, slot_bytes) -> Arena; raises OSError on failure. Core takes one so tests
# can place arenas elsewhere or make creation fail.
ArenaFactory = Callable[[int, int, int], Arena]


def remove_stale_arenas(directory: str = "/dev/shm") -> list[str]:
    """Unlink the arena files of coordinators that no longer run (one killed with SIGKILL
    cannot clean up). The owner's pid is in the name; files of live processes are kept."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        parts = name.split("-")
        if not name.startswith("fakegpu-arena-") or len(parts) < 4 or not parts[2].isdigit():
            continue
        pid = int(parts[2])
        try:
            os.kill(pid, 0)
            continue                      # still running (or not ours to signal): keep
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(name)
        except OSError:
            pass
    if removed:
        log.info("removed %d arena file(s) left by coordinators that died: %s", len(removed), ", ".join(removed))
    return removed
