"""Shared memory the coordinator hands out: how big the staging segments are, and allocating them.

Every page a rank or the coordinator maps in /dev/shm is allocated first (posix_fallocate), so
a full /dev/shm is an error at the moment of allocation, answered with a fallback, and never a
SIGBUS at the first large copy (docs/protocol.md, "Staging size" and "Host-local collectives").

The staging size S of a client that leaves the choice to the coordinator (HELLO staging_bytes 0,
the shim's default) shrinks with the world so that the segments of all its ranks fit together:

    S = clamp(pow2_floor(budget / (2 * world_size)), MIN_DEFAULT_STAGING_BYTES, default)

where ``budget`` is a quarter of the smaller of /dev/shm's size and the physical memory (tmpfs
pages are memory), ``world_size`` the client's WORLD_SIZE (1 when unset) and ``default`` 32 MiB.
It depends only on the world size and the host, never on what is allocated right now, so every
rank of a job gets the same S and cuts its calls into the same steps.
"""
from __future__ import annotations

import os
from typing import Optional

SHM_DIR = "/dev/shm"
# Smallest S the sizing rule picks, however large the world (or small the host).
MIN_DEFAULT_STAGING_BYTES = 64 << 10
# Fraction of min(/dev/shm size, physical memory) the staging segments of one world may take;
# the rest is left to arenas, the ranks themselves and whatever else uses /dev/shm.
BUDGET_FRACTION = 4


def host_shm_bytes(directory: str = SHM_DIR) -> int:
    """The smaller of the size of ``directory``'s file system and the physical memory (0 when
    neither can be read). The size, not the free space: it does not change while a job starts."""
    sizes = []
    try:
        st = os.statvfs(directory)
        sizes.append(st.f_blocks * st.f_frsize)
    except OSError:
        pass
    try:
        sizes.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        pass
    sizes = [s for s in sizes if s > 0]
    return min(sizes) if sizes else 0


def default_staging_bytes(world_size: int, host_bytes: int, ceiling: int) -> int:
    """S for a client that left the choice to the coordinator (rule in the module docstring)."""
    n = world_size if world_size > 0 else 1
    share = host_bytes // BUDGET_FRACTION // (2 * n)
    pow2 = 1 << (share.bit_length() - 1) if share > 0 else 0
    return max(min(MIN_DEFAULT_STAGING_BYTES, ceiling), min(ceiling, pow2))


def allocate(fd: int, nbytes: int) -> Optional[OSError]:
    """Allocate ``[0, nbytes)`` of ``fd`` for real (this also extends the file to ``nbytes``);
    the error when /dev/shm cannot back it (ENOSPC, ...), else None."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        return exc
    return None


def describe_bytes(n: int) -> str:
    """``n`` for log lines: 10.0 MiB."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"
