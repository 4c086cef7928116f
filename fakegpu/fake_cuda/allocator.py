"""A model of PyTorch's CUDA caching allocator, fed with the allocations of one fake device.

Fake CUDA tensors live in host memory, so nothing here allocates: the model replays each
storage allocation and free the way c10/cuda/CUDACachingAllocator.cpp would handle it, so
that ``memory_allocated`` / ``memory_reserved`` / ``memory_stats`` / ``memory_snapshot`` read
like a GPU run's.  The rules it follows (defaults, no ``PYTORCH_CUDA_ALLOC_CONF``):

- a request is rounded up to a multiple of 512 bytes (``kMinBlockSize``), at least 512;
- requests of at most 1 MiB (``kSmallSize``) come from the small pool, whose segments are
  2 MiB (``kSmallBuffer``); larger ones from the large pool, whose new segments are 20 MiB
  (``kLargeBuffer``) for requests under 10 MiB (``kMinLargeAlloc``) and the request rounded
  up to 2 MiB (``kRoundLarge``) otherwise;
- a free block is picked best-fit (smallest block of the pool that fits, lowest address on a
  tie) and split when what remains is at least 512 bytes (small pool) or more than 1 MiB
  (large pool);
- a freed block merges with free neighbours of its segment; segments stay reserved until
  ``empty_cache`` (or an allocation that would not fit otherwise) releases the wholly free ones;
- when a new segment would exceed the device's memory, the cached free segments are released
  and the allocation retried (``num_alloc_retries``), then ``torch.OutOfMemoryError``.

One stream only: the real allocator keeps blocks of different streams apart, fake devices
run everything in order.
"""
from __future__ import annotations

import bisect
import dataclasses
from typing import Optional

MIN_BLOCK_SIZE = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20

_POOLS = ("small_pool", "large_pool")


def round_size(size: int) -> int:
    if size < MIN_BLOCK_SIZE:
        return MIN_BLOCK_SIZE
    return MIN_BLOCK_SIZE * ((size + MIN_BLOCK_SIZE - 1) // MIN_BLOCK_SIZE)


def segment_size(rounded: int) -> int:
    """Size of the new segment (cudaMalloc) for a rounded request that found no free block."""
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((rounded + ROUND_LARGE - 1) // ROUND_LARGE)


def pool_of(rounded: int) -> str:
    return "small_pool" if rounded <= SMALL_SIZE else "large_pool"


class Block:
    """A piece of a segment; neighbours are linked, as in the real allocator, so that a free
    merges in constant time."""
    __slots__ = ("segment", "address", "size", "requested", "allocated", "prev", "next")

    def __init__(self, segment: "Segment", address: int, size: int):
        self.segment = segment
        self.address = address
        self.size = size
        self.requested = 0
        self.allocated = False
        self.prev: Optional[Block] = None
        self.next: Optional[Block] = None


@dataclasses.dataclass(eq=False)
class Segment:
    address: int
    size: int
    pool: str
    head: Optional[Block] = None

    @property
    def blocks(self) -> list:
        """The blocks in address order."""
        out, block = [], self.head
        while block is not None:
            out.append(block)
            block = block.next
        return out

    def wholly_free(self) -> bool:
        return self.head.next is None and not self.head.allocated


class _Stat:
    __slots__ = ("current", "peak", "allocated", "freed")

    def __init__(self):
        self.current = self.peak = self.allocated = self.freed = 0

    def add(self, amount: int) -> None:
        self.current += amount
        self.allocated += amount
        self.peak = max(self.peak, self.current)

    def sub(self, amount: int) -> None:
        self.current -= amount
        self.freed += amount

    def reset_peak(self) -> None:
        self.peak = self.current

    def reset_accumulated(self) -> None:
        self.allocated = self.freed = 0


class _StatSet:
    """One stat per pool plus the aggregate, as the allocator's ``StatArray``."""
    __slots__ = ("by_pool", "_all")

    def __init__(self):
        self.by_pool = {"all": _Stat(), "small_pool": _Stat(), "large_pool": _Stat()}
        self._all = self.by_pool["all"]

    def add(self, pool: str, amount: int) -> None:
        # _Stat.add inlined and unrolled for the aggregate and the pool: this runs per op.
        stat = self._all
        current = stat.current + amount
        stat.current = current
        stat.allocated += amount
        if current > stat.peak:
            stat.peak = current
        stat = self.by_pool[pool]
        current = stat.current + amount
        stat.current = current
        stat.allocated += amount
        if current > stat.peak:
            stat.peak = current

    def sub(self, pool: str, amount: int) -> None:
        stat = self._all
        stat.current -= amount
        stat.freed += amount
        stat = self.by_pool[pool]
        stat.current -= amount
        stat.freed += amount


class OutOfMemory(Exception):
    """Raised by the model; the runtime turns it into ``torch.OutOfMemoryError``."""


_STAT_NAMES = ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
               "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes")


class CachingAllocatorModel:
    """Allocations of one device; ``malloc`` returns a handle for ``free``."""

    def __init__(self, device: int, total_memory: int):
        self.device = device
        self.total_memory = int(total_memory)
        self._next_address = 0x7F0000000000 + device * (1 << 40)
        self.segments: list[Segment] = []
        # Free blocks per pool: (size, address) sorted for best fit, address -> block.
        self._free: dict[str, list[tuple[int, int]]] = {p: [] for p in _POOLS}
        self._free_blocks: dict[int, Block] = {}
        self.stats = {name: _StatSet() for name in _STAT_NAMES}
        # With one stream and no frees deferred behind other streams' work, a block is active
        # exactly while it is allocated: the "active" stats are the "allocation" ones.
        self.stats["active"] = self.stats["allocation"]
        self.stats["active_bytes"] = self.stats["allocated_bytes"]
        self._allocation = self.stats["allocation"]
        self._allocated_bytes = self.stats["allocated_bytes"]
        self._requested_bytes = self.stats["requested_bytes"]
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self.num_device_alloc = 0
        self.num_device_free = 0

    # -- bookkeeping -----------------------------------------------------------------------
    def _insert_free(self, block: Block) -> None:
        bisect.insort(self._free[block.segment.pool], (block.size, block.address))
        self._free_blocks[block.address] = block

    def _remove_free(self, block: Block) -> None:
        entries = self._free[block.segment.pool]
        i = bisect.bisect_left(entries, (block.size, block.address))
        del entries[i]
        del self._free_blocks[block.address]

    @property
    def reserved(self) -> int:
        return self.stats["reserved_bytes"].by_pool["all"].current

    @property
    def allocated(self) -> int:
        return self.stats["allocated_bytes"].by_pool["all"].current

    # -- malloc / free ---------------------------------------------------------------------
    def malloc(self, nbytes: int) -> Block:
        size = round_size(int(nbytes))
        pool = pool_of(size)
        block = self._best_fit(pool, size)
        if block is None:
            block = self._new_segment(pool, size, nbytes)
        split_remaining = block.size - size
        if self._should_split(pool, split_remaining):
            rest = Block(block.segment, block.address + size, split_remaining)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            self._insert_free(rest)
            self.stats["inactive_split"].add(pool, 1)
            self.stats["inactive_split_bytes"].add(pool, rest.size)
        block.allocated = True
        block.requested = int(nbytes)
        self._allocation.add(pool, 1)
        self._allocated_bytes.add(pool, block.size)
        self._requested_bytes.add(pool, block.requested)
        return block

    @staticmethod
    def _should_split(pool: str, remaining: int) -> bool:
        if pool == "small_pool":
            return remaining >= MIN_BLOCK_SIZE
        return remaining > SMALL_SIZE

    def _best_fit(self, pool: str, size: int) -> Optional[Block]:
        entries = self._free[pool]
        i = bisect.bisect_left(entries, (size, 0))
        if i == len(entries):
            return None
        block = self._free_blocks.pop(entries[i][1])
        del entries[i]
        if block.prev is not None or block.next is not None:  # a free piece of a split segment
            self.stats["inactive_split"].sub(pool, 1)
            self.stats["inactive_split_bytes"].sub(pool, block.size)
        return block

    def _new_segment(self, pool: str, size: int, requested: int) -> Block:
        seg_size = segment_size(size)
        if self.reserved + seg_size > self.total_memory:
            self.num_alloc_retries += 1
            self.release_cached()
            if self.reserved + seg_size > self.total_memory:
                self.num_ooms += 1
                free = self.total_memory - self.reserved
                raise OutOfMemory(
                    f"CUDA out of memory. Tried to allocate {_fmt(size)}. GPU {self.device} has a total "
                    f"capacity of {_fmt(self.total_memory)} of which {_fmt(free)} is free. Of the "
                    f"allocated memory {_fmt(self.allocated)} is allocated by PyTorch, and "
                    f"{_fmt(self.reserved - self.allocated)} is reserved by PyTorch but unallocated. "
                    "(fakegpu fake device: host memory, the CUDA caching allocator's figures)")
        segment = Segment(self._next_address, seg_size, pool)
        self._next_address += seg_size
        block = Block(segment, segment.address, seg_size)
        segment.head = block
        self.segments.append(segment)
        self.num_device_alloc += 1
        self.stats["segment"].add(pool, 1)
        self.stats["reserved_bytes"].add(pool, seg_size)
        return block

    def free(self, block: Block) -> None:
        if not block.allocated:
            return
        pool = block.segment.pool
        self._allocation.sub(pool, 1)
        self._allocated_bytes.sub(pool, block.size)
        self._requested_bytes.sub(pool, block.requested)
        block.allocated = False
        block.requested = 0
        # Merge with free neighbours (each of them was an inactive split).
        for other in (block.next, block.prev):
            if other is None or other.allocated:
                continue
            self._remove_free(other)
            self.stats["inactive_split"].sub(pool, 1)
            self.stats["inactive_split_bytes"].sub(pool, other.size)
            if other is block.prev:
                block.address = other.address
                block.prev = other.prev
                if other.prev is not None:
                    other.prev.next = block
                else:
                    block.segment.head = block
            else:
                block.next = other.next
                if other.next is not None:
                    other.next.prev = block
            block.size += other.size
        if block.prev is not None or block.next is not None:
            self.stats["inactive_split"].add(pool, 1)
            self.stats["inactive_split_bytes"].add(pool, block.size)
        self._insert_free(block)

    def release_cached(self) -> None:
        """``empty_cache``: give back every segment that holds no allocated block."""
        kept = []
        for segment in self.segments:
            if segment.wholly_free():
                self._remove_free(segment.head)
                self.stats["segment"].sub(segment.pool, 1)
                self.stats["reserved_bytes"].sub(segment.pool, segment.size)
                self.num_device_free += 1
            else:
                kept.append(segment)
        self.segments = kept

    # -- what torch.cuda reports -----------------------------------------------------------
    def reset_peak(self) -> None:
        for stat_set in self.stats.values():
            for stat in stat_set.by_pool.values():
                stat.reset_peak()

    def reset_accumulated(self) -> None:
        for stat_set in self.stats.values():
            for stat in stat_set.by_pool.values():
                stat.reset_accumulated()
        self.num_alloc_retries = self.num_ooms = 0
        self.num_device_alloc = self.num_device_free = 0

    def memory_stats(self) -> dict:
        """Flat dict with the key names of ``torch.cuda.memory_stats``."""
        out = {}
        for name, stat_set in self.stats.items():
            for pool, stat in stat_set.by_pool.items():
                for field in ("current", "peak", "allocated", "freed"):
                    out[f"{name}.{pool}.{field}"] = getattr(stat, field)
        out.update({
            "num_alloc_retries": self.num_alloc_retries,
            "num_ooms": self.num_ooms,
            "num_device_alloc": self.num_device_alloc,
            "num_device_free": self.num_device_free,
            "num_sync_all_streams": 0,
            "max_split_size": -1,
            "oversize_allocations.current": 0, "oversize_allocations.peak": 0,
            "oversize_allocations.allocated": 0, "oversize_allocations.freed": 0,
            "oversize_segments.current": 0, "oversize_segments.peak": 0,
            "oversize_segments.allocated": 0, "oversize_segments.freed": 0,
        })
        return dict(sorted(out.items()))

    def snapshot(self) -> list[dict]:
        """Segments in the shape ``torch.cuda.memory_snapshot()`` returns."""
        result = []
        for segment in self.segments:
            blocks = [{"address": b.address, "size": b.size, "requested_size": b.requested,
                       "state": "active_allocated" if b.allocated else "inactive", "frames": []}
                      for b in segment.blocks]
            allocated = sum(b.size for b in segment.blocks if b.allocated)
            result.append({
                "device": self.device, "address": segment.address, "total_size": segment.size,
                "allocated_size": allocated, "active_size": allocated,
                "requested_size": sum(b.requested for b in segment.blocks),
                "stream": 0, "segment_type": "small" if segment.pool == "small_pool" else "large",
                "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": blocks,
            })
        return result


def _fmt(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} bytes"
