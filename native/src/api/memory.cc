// Memory helpers, buffer registration and user-defined reduction operators.
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/comm.h"
#include "cuda/cuda_staging.h"
#include "api/export.h"
#include "api/last_error.h"

using namespace fakegpu;

// Device memory (cudaMalloc) when the process computes on a GPU (hybrid mode, or a CUDA
// runtime already loaded: see cuda_staging.h); otherwise page-aligned host memory, like
// cuMem allocations, for programs that run on host buffers.
NCCL_API(ncclResult_t, ncclMemAlloc, void** ptr, size_t size) {
  if (!ptr) return fail(ncclInvalidArgument, "ncclMemAlloc: ptr is NULL");
  if (size == 0) {
    *ptr = nullptr;
    return ncclSuccess;
  }
  bool device = false;
  ncclResult_t rc = cuda_staging::enabled(&device);
  if (rc != ncclSuccess) return rc;
  if (device) return cuda_staging::device_alloc(ptr, size);
  long page = sysconf(_SC_PAGESIZE);
  void* p = nullptr;
  if (posix_memalign(&p, page > 0 ? static_cast<size_t>(page) : 4096, size) != 0)
    return failf(ncclSystemError, "ncclMemAlloc: cannot allocate %zu bytes", size);
  *ptr = p;
  return ncclSuccess;
}

NCCL_API(ncclResult_t, ncclMemFree, void* ptr) {
  if (!ptr) return ncclSuccess;
  bool device = false;
  if (cuda_staging::enabled(&device) == ncclSuccess && device && cuda_staging::is_device_pointer(ptr))
    return cuda_staging::device_free(ptr);
  free(ptr);
  return ncclSuccess;
}

namespace {
// A registration handle: only proves the buffer was registered (no zero-copy path here).
struct Registration {
  uint64_t magic = 0x6667707572656721ULL;
  void* buff;
  size_t size;
};
}  // namespace

NCCL_API(ncclResult_t, ncclCommRegister, const ncclComm_t comm, void* buff, size_t size, void** handle) {
  ncclResult_t rc = check_comm_valid(comm, "ncclCommRegister");
  if (rc != ncclSuccess) return rc;
  if (!handle) return fail(ncclInvalidArgument, "ncclCommRegister: handle is NULL");
  if (!buff && size) return fail(ncclInvalidArgument, "ncclCommRegister: buff is NULL");
  *handle = new Registration{0x6667707572656721ULL, buff, size};
  return ncclSuccess;
}

NCCL_API(ncclResult_t, ncclCommDeregister, const ncclComm_t comm, void* handle) {
  ncclResult_t rc = check_comm_valid(comm, "ncclCommDeregister");
  if (rc != ncclSuccess) return rc;
  auto* r = static_cast<Registration*>(handle);
  if (!r || r->magic != 0x6667707572656721ULL)
    return fail(ncclInvalidArgument, "ncclCommDeregister: handle did not come from ncclCommRegister");
  r->magic = 0;
  delete r;
  return ncclSuccess;
}

NCCL_API(ncclResult_t, ncclRedOpCreatePreMulSum, ncclRedOp_t* op, void* scalar, ncclDataType_t datatype,
         ncclScalarResidence_t residence, ncclComm_t comm) {
  ncclResult_t rc = check_comm_valid(comm, "ncclRedOpCreatePreMulSum");
  if (rc != ncclSuccess) return rc;
  if (!op) return fail(ncclInvalidArgument, "ncclRedOpCreatePreMulSum: op is NULL");
  if (!scalar) return fail(ncclInvalidArgument, "ncclRedOpCreatePreMulSum: scalar is NULL");
  size_t s = datatype_size(datatype);
  if (s == 0) return failf(ncclInvalidArgument, "ncclRedOpCreatePreMulSum: invalid datatype %d", (int)datatype);
  if (residence != ncclScalarDevice && residence != ncclScalarHostImmediate)
    return failf(ncclInvalidArgument, "ncclRedOpCreatePreMulSum: invalid residence %d", (int)residence);
  PreMulSumOp p;
  p.in_use = true;
  p.datatype = datatype;
  p.residence = residence;
  if (residence == ncclScalarHostImmediate)
    memcpy(p.value, scalar, s);
  else
    p.pointer = scalar;  // dereferenced when a collective using the op runs
  std::lock_guard<std::mutex> lk(comm->mu);
  size_t idx = 0;
  while (idx < comm->redops.size() && comm->redops[idx].in_use) idx++;
  if (idx == comm->redops.size()) {
    if (comm->redops.size() >= static_cast<size_t>(ncclMaxRedOp) - ncclNumOps)
      return fail(ncclInvalidUsage, "ncclRedOpCreatePreMulSum: too many operators on this communicator");
    comm->redops.push_back(p);
  } else {
    comm->redops[idx] = p;
  }
  *op = static_cast<ncclRedOp_t>(ncclNumOps + static_cast<int>(idx));
  return ncclSuccess;
}

NCCL_API(ncclResult_t, ncclRedOpDestroy, ncclRedOp_t op, ncclComm_t comm) {
  ncclResult_t rc = check_comm_valid(comm, "ncclRedOpDestroy");
  if (rc != ncclSuccess) return rc;
  int o = static_cast<int>(op);
  if (o >= 0 && o < ncclNumOps)
    return failf(ncclInvalidArgument, "ncclRedOpDestroy: op %d is a built-in operator", o);
  std::lock_guard<std::mutex> lk(comm->mu);
  size_t idx = static_cast<size_t>(o) - ncclNumOps;
  if (o < 0 || idx >= comm->redops.size() || !comm->redops[idx].in_use)
    return failf(ncclInvalidArgument, "ncclRedOpDestroy: op %d was not created on this communicator", o);
  comm->redops[idx] = PreMulSumOp();
  return ncclSuccess;
}
