// Shared-memory files the shim maps (its staging segment, arenas) are allocated by the
// coordinator with posix_fallocate before it hands them out (docs/protocol.md). The shim checks
// that before mapping, so it never maps a page /dev/shm has not backed: touching one on a full
// /dev/shm is a SIGBUS, not an error anybody could report.
#pragma once

#include <sys/stat.h>

#include <cstdint>

namespace fakegpu {

// True when the file behind `fd` is at least `bytes` long and that much of it is allocated
// (st_blocks counts 512-byte units; a sparse file has fewer than its size). Cheap: one fstat,
// where allocating again would walk every page.
inline bool fully_allocated(int fd, uint64_t bytes) {
  struct stat st;
  return fstat(fd, &st) == 0 && static_cast<uint64_t>(st.st_size) >= bytes &&
         static_cast<uint64_t>(st.st_blocks) * 512 >= bytes;
}

}  // namespace fakegpu
