// Version and error reporting.
#include "core/comm.h"
#include "api/export.h"
#include "api/last_error.h"

using namespace fakegpu;

NCCL_API(ncclResult_t, ncclGetVersion, int* version) {
  if (!version) return fail(ncclInvalidArgument, "ncclGetVersion: version is NULL");
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

NCCL_API(const char*, ncclGetErrorString, ncclResult_t result) {
  // NCCL's wording, so logs read the same as with the real library.
  switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    case ncclTimeout: return "NCCL operation timed out";
    default: return "unknown result code";
  }
}

NCCL_API(const char*, ncclGetLastError, ncclComm_t comm) {
  // A broken communicator explains itself (e.g. a failure in its background init, seen by
  // the thread polling ncclCommGetAsyncError); otherwise the process's latest error.
  int async = comm && comm->magic == kCommMagic ? comm->async_error.load() : ncclSuccess;
  if (async != ncclSuccess && async != ncclInProgress) {
    std::lock_guard<std::mutex> lk(comm->mu);
    if (!comm->last_error.empty()) {
      thread_local std::string copy;
      copy = comm->last_error;
      return copy.c_str();
    }
  }
  return last_error_cstr();
}

NCCL_API(void, ncclResetDebugInit, void) {}
NCCL_API(void, ncclResetDebugInitInternal, void) {}
