// NVIDIA's libnccl.so.2, loaded next to the shim for the proxy and passthrough modes.
//
// Where: FAKEGPU_REAL_NCCL_PATH, else the nvidia-nccl wheel (site-packages/nvidia/nccl/lib/
// libnccl.so.2) under VIRTUAL_ENV, CONDA_PREFIX, PYTHONPATH entries, the running
// interpreter's prefix, ~/.local and /usr{,/local}. It is opened RTLD_LOCAL|RTLD_DEEPBIND:
// its own internal calls must bind to itself, not to our identically named exports that
// are already in the global scope. Our own library is never picked.
#pragma once

#include <string>

#include "nccl.h"

namespace fakegpu::real {

struct Nccl {
  ncclResult_t (*GetVersion)(int*) = nullptr;
  ncclResult_t (*GetUniqueId)(ncclUniqueId*) = nullptr;
  ncclResult_t (*CommInitRankConfig)(ncclComm_t*, int, ncclUniqueId, int, ncclConfig_t*) = nullptr;
  ncclResult_t (*CommSplit)(ncclComm_t, int, int, ncclComm_t*, ncclConfig_t*) = nullptr;
  ncclResult_t (*CommFinalize)(ncclComm_t) = nullptr;
  ncclResult_t (*CommDestroy)(ncclComm_t) = nullptr;
  ncclResult_t (*CommAbort)(ncclComm_t) = nullptr;
  ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t*) = nullptr;
  ncclResult_t (*CommCount)(const ncclComm_t, int*) = nullptr;
  ncclResult_t (*CommUserRank)(const ncclComm_t, int*) = nullptr;
  ncclResult_t (*GroupStart)() = nullptr;
  ncclResult_t (*GroupEnd)() = nullptr;
  ncclResult_t (*AllReduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*Broadcast)(const void*, void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*Reduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, int, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*AllGather)(const void*, void*, size_t, ncclDataType_t, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*ReduceScatter)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*Send)(const void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*Recv)(void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*RedOpCreatePreMulSum)(ncclRedOp_t*, void*, ncclDataType_t, ncclScalarResidence_t, ncclComm_t) = nullptr;
  ncclResult_t (*RedOpDestroy)(ncclRedOp_t, ncclComm_t) = nullptr;
  // Optional (newer NCCL): AlltoAll/Gather/Scatter are emulated with Send/Recv without them.
  ncclResult_t (*AlltoAll)(const void*, void*, size_t, ncclDataType_t, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*Gather)(const void*, void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*Scatter)(const void*, void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*GroupSimulateEnd)(ncclSimInfo_t*) = nullptr;
  const char* (*GetLastError)(ncclComm_t) = nullptr;
  std::string path;
  int version = 0;
};

// The real library, loaded once; on failure an error (last error set) naming every place
// that was tried.
ncclResult_t load(const Nccl** out);

// Records a failure of the real library's `fn` with its own last-error text.
ncclResult_t real_fail(const Nccl* n, ncclResult_t r, const char* fn, ncclComm_t comm = nullptr);

}  // namespace fakegpu::real
