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

The model itself is C++ in the shim (native/src/allocator/caching_allocator_model.cc): it
runs on every tensor allocation of a fake CUDA program, where a Python model cost about
20 us per allocation and free.  This module drives it through cffi and shapes its figures
the way ``torch.cuda`` reports them.
"""
from __future__ import annotations

from typing import Optional

from fakegpu.shim_helpers import ShimHelpers

MIN_BLOCK_SIZE = 512
SMALL_SIZE = 1 << 20

_CDEF = """
void* fakegpu_alloc_model_new(int device, uint64_t total_memory);
void fakegpu_alloc_model_delete(void* model);
uint64_t fakegpu_alloc_model_malloc(void* model, uint64_t nbytes);
void fakegpu_alloc_model_free(void* model, uint64_t handle);
uint64_t fakegpu_alloc_model_block_size(void* model, uint64_t handle);
void fakegpu_alloc_model_release_cached(void* model);
void fakegpu_alloc_model_set_limit(void* model, uint64_t limit);
void fakegpu_alloc_model_reset_peak(void* model);
void fakegpu_alloc_model_reset_accumulated(void* model);
void fakegpu_alloc_model_stats(void* model, int64_t* out);
uint64_t fakegpu_alloc_model_blocks(void* model, uint64_t* out, uint64_t capacity);
uint64_t fakegpu_alloc_round_size(uint64_t nbytes);
uint64_t fakegpu_alloc_segment_size(uint64_t rounded);
"""

_library = ShimHelpers(_CDEF, "fakegpu_alloc_model_new", "the caching-allocator model's rules")


def model_entry_points() -> tuple[int, int]:
    """Addresses of the model's malloc and free, for the C++ storage tracker."""
    ffi, lib = _library()
    return (int(ffi.cast("uintptr_t", lib.fakegpu_alloc_model_malloc)),
            int(ffi.cast("uintptr_t", lib.fakegpu_alloc_model_free)))


def round_size(size: int) -> int:
    """A request rounded as the allocator rounds it (multiples of 512 bytes, at least 512)."""
    return int(_library()[1].fakegpu_alloc_round_size(int(size)))


def segment_size(rounded: int) -> int:
    """Size of the new segment (cudaMalloc) for a rounded request that found no free block."""
    return int(_library()[1].fakegpu_alloc_segment_size(int(rounded)))


def pool_of(rounded: int) -> str:
    return "small_pool" if rounded <= SMALL_SIZE else "large_pool"


class OutOfMemory(Exception):
    """Raised by the model; the runtime turns it into ``torch.OutOfMemoryError``."""


# The C++ model's stat table, in its order; "active" is "allocation" with one stream (a block
# is active exactly while it is allocated), "active_bytes" is "allocated_bytes".
_MODEL_STATS = ("allocation", "segment", "inactive_split", "allocated_bytes", "reserved_bytes",
                "inactive_split_bytes", "requested_bytes")
_STAT_NAMES = ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
               "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes")
_ALIASES = {"active": "allocation", "active_bytes": "allocated_bytes"}
_STAT_POOLS = ("all", "small_pool", "large_pool")
_FIELDS = ("current", "peak", "allocated", "freed")
_STATS_LEN = len(_MODEL_STATS) * len(_STAT_POOLS) * len(_FIELDS) + 4
_BLOCK_RECORD = 7
_ALLOCATED_BIT = 1 << 63


def _stat_index(name: str, pool: str = "all", field: str = "current") -> int:
    name = _ALIASES.get(name, name)
    return ((_MODEL_STATS.index(name) * len(_STAT_POOLS) + _STAT_POOLS.index(pool)) * len(_FIELDS)
            + _FIELDS.index(field))


_ALLOCATED_INDEX = _stat_index("allocated_bytes")
_RESERVED_INDEX = _stat_index("reserved_bytes")


class Block:
    """An allocation the model placed: ``free`` it with the model that returned it."""
    __slots__ = ("handle", "requested", "_model")

    def __init__(self, handle: int, requested: int, model: "CachingAllocatorModel"):
        self.handle = handle
        self.requested = requested
        self._model = model

    @property
    def size(self) -> int:
        """The bytes the allocator gave it (0 once freed)."""
        model = self._model
        return int(model._lib.fakegpu_alloc_model_block_size(model._model, self.handle))


class BlockView:
    """A block of a segment, as :attr:`CachingAllocatorModel.segments` shows it."""
    __slots__ = ("address", "size", "requested", "allocated")

    def __init__(self, address: int, size: int, requested: int, allocated: bool):
        self.address, self.size, self.requested, self.allocated = address, size, requested, allocated


class SegmentView:
    __slots__ = ("address", "size", "pool", "blocks")

    def __init__(self, address: int, size: int, pool: str):
        self.address, self.size, self.pool = address, size, pool
        self.blocks: list[BlockView] = []

    def wholly_free(self) -> bool:
        return len(self.blocks) == 1 and not self.blocks[0].allocated


class CachingAllocatorModel:
    """Allocations of one device; ``malloc`` returns a :class:`Block` for ``free``."""

    def __init__(self, device: int, total_memory: int):
        self._ffi, self._lib = _library()
        self.device = device
        self.total_memory = int(total_memory)
        self.fraction: Optional[float] = None   # set_per_process_memory_fraction
        self._model = self._ffi.gc(self._lib.fakegpu_alloc_model_new(device, self.total_memory),
                                   self._lib.fakegpu_alloc_model_delete)
        self._malloc = self._lib.fakegpu_alloc_model_malloc
        self._free = self._lib.fakegpu_alloc_model_free
        self._stats_buffer = self._ffi.new("int64_t[]", _STATS_LEN)

    @property
    def address(self) -> int:
        """The C++ model's address (the storage tracker charges it directly)."""
        return int(self._ffi.cast("uintptr_t", self._model))

    # -- malloc / free ---------------------------------------------------------------------
    def malloc(self, nbytes: int) -> Block:
        nbytes = int(nbytes)
        handle = self._malloc(self._model, nbytes)
        if handle == 0:
            raise OutOfMemory(self.out_of_memory_message(nbytes))
        return Block(handle, nbytes, self)

    def free(self, block: Block) -> None:
        self._free(self._model, block.handle)

    def release_cached(self) -> None:
        """``empty_cache``: give back every segment that holds no allocated block."""
        self._lib.fakegpu_alloc_model_release_cached(self._model)

    def set_fraction(self, fraction: float) -> None:
        """``set_per_process_memory_fraction``: segments past ``fraction`` x total are refused."""
        if not isinstance(fraction, (int, float)) or isinstance(fraction, bool) or not 0 <= fraction <= 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        self.fraction = float(fraction)
        self._lib.fakegpu_alloc_model_set_limit(self._model, int(self.fraction * self.total_memory))

    def out_of_memory_message(self, nbytes: int) -> str:
        """What ``torch.OutOfMemoryError`` says when ``nbytes`` more do not fit."""
        size = round_size(nbytes)
        reserved, allocated = self.reserved, self.allocated
        free = self.total_memory - reserved
        allowed = "" if self.fraction is None else \
            f" (the process may use {_fmt(int(self.fraction * self.total_memory))}: memory fraction {self.fraction:g})"
        return (
            f"CUDA out of memory. Tried to allocate {_fmt(size)}. GPU {self.device} has a total "
            f"capacity of {_fmt(self.total_memory)} of which {_fmt(free)} is free{allowed}. Of the "
            f"allocated memory {_fmt(allocated)} is allocated by PyTorch, and "
            f"{_fmt(reserved - allocated)} is reserved by PyTorch but unallocated. "
            "(fakegpu fake device: host memory, the CUDA caching allocator's figures)")

    # -- what torch.cuda reports -----------------------------------------------------------
    def _stats(self):
        self._lib.fakegpu_alloc_model_stats(self._model, self._stats_buffer)
        return self._stats_buffer

    def stat(self, name: str, pool: str = "all", field: str = "current") -> int:
        """One figure of ``memory_stats``: e.g. ``stat("allocated_bytes", field="peak")``."""
        return int(self._stats()[_stat_index(name, pool, field)])

    @property
    def reserved(self) -> int:
        return int(self._stats()[_RESERVED_INDEX])

    @property
    def allocated(self) -> int:
        return int(self._stats()[_ALLOCATED_INDEX])

    def _counters(self) -> tuple[int, int, int, int]:
        stats = self._stats()
        return tuple(int(stats[_STATS_LEN - 4 + i]) for i in range(4))

    @property
    def num_alloc_retries(self) -> int:
        return self._counters()[0]

    @property
    def num_ooms(self) -> int:
        return self._counters()[1]

    def reset_peak(self) -> None:
        self._lib.fakegpu_alloc_model_reset_peak(self._model)

    def reset_accumulated(self) -> None:
        self._lib.fakegpu_alloc_model_reset_accumulated(self._model)

    def memory_stats(self) -> dict:
        """Flat dict with the key names of ``torch.cuda.memory_stats``."""
        stats = list(self._stats())
        out = {}
        for name in _STAT_NAMES:
            for pool in _STAT_POOLS:
                for field in _FIELDS:
                    out[f"{name}.{pool}.{field}"] = int(stats[_stat_index(name, pool, field)])
        retries, ooms, device_alloc, device_free = stats[_STATS_LEN - 4:]
        out.update({
            "num_alloc_retries": retries,
            "num_ooms": ooms,
            "num_device_alloc": device_alloc,
            "num_device_free": device_free,
            "num_sync_all_streams": 0,
            "max_split_size": -1,
            "oversize_allocations.current": 0, "oversize_allocations.peak": 0,
            "oversize_allocations.allocated": 0, "oversize_allocations.freed": 0,
            "oversize_segments.current": 0, "oversize_segments.peak": 0,
            "oversize_segments.allocated": 0, "oversize_segments.freed": 0,
        })
        return dict(sorted(out.items()))

    @property
    def segments(self) -> list[SegmentView]:
        """The segments in allocation order, each with its blocks in address order."""
        count = self._lib.fakegpu_alloc_model_blocks(self._model, self._ffi.NULL, 0)
        buffer = self._ffi.new("uint64_t[]", max(1, count * _BLOCK_RECORD))
        count = min(count, self._lib.fakegpu_alloc_model_blocks(self._model, buffer, count))
        values = list(buffer)
        segments: list[SegmentView] = []
        last: Optional[int] = None
        for i in range(count):
            ordinal, seg_address, seg_size, pool, address, size, packed = \
                values[i * _BLOCK_RECORD:(i + 1) * _BLOCK_RECORD]
            if ordinal != last:
                segments.append(SegmentView(seg_address, seg_size, "small_pool" if pool == 0 else "large_pool"))
                last = ordinal
            segments[-1].blocks.append(BlockView(address, size, packed & ~_ALLOCATED_BIT,
                                                 bool(packed & _ALLOCATED_BIT)))
        return segments

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
