// How the shim exports its C API, mirroring the real libnccl: a strong `pncclX` (the
// profiling entry point) and `ncclX` as a weak alias of it, both with default visibility
// while everything else in the library stays hidden.
#pragma once

#include "nccl.h"

#define FG_VISIBLE __attribute__((visibility("default")))

// NCCL_API(ret, ncclX, args...) { body }  defines pncclX with `body` and ncclX as its alias.
#define NCCL_API(ret, func, ...)                                                         \
  extern "C" ret func(__VA_ARGS__) __attribute__((weak, alias("p" #func), visibility("default"))); \
  extern "C" FG_VISIBLE ret p##func(__VA_ARGS__)
