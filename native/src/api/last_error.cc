#include "api/last_error.h"

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace fakegpu {
namespace {

std::mutex g_mu;
// Fixed storage so the pointer handed to ncclGetLastError callers stays valid; a later
// error overwrites it, exactly as in NCCL.
char g_last[2048];

bool debug_enabled() {
  static const bool on = [] {
    const char* v = getenv("FAKEGPU_DEBUG");
    return v && *v && strcmp(v, "0") != 0;
  }();
  return on;
}

}  // namespace

ncclResult_t fail(ncclResult_t result, const std::string& msg) {
  {
    std::lock_guard<std::mutex> lk(g_mu);
    snprintf(g_last, sizeof(g_last), "%s", msg.c_str());
  }
  if (debug_enabled()) fprintf(stderr, "[fakegpu nccl] %s: %s\n", result_name(result), msg.c_str());
  return result;
}

ncclResult_t failf(ncclResult_t result, const char* fmt, ...) {
  char buf[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  return fail(result, buf);
}

std::string last_error() {
  std::lock_guard<std::mutex> lk(g_mu);
  return g_last;
}

const char* last_error_cstr() { return g_last; }

const char* result_name(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "ncclSuccess";
    case ncclUnhandledCudaError: return "ncclUnhandledCudaError";
    case ncclSystemError: return "ncclSystemError";
    case ncclInternalError: return "ncclInternalError";
    case ncclInvalidArgument: return "ncclInvalidArgument";
    case ncclInvalidUsage: return "ncclInvalidUsage";
    case ncclRemoteError: return "ncclRemoteError";
    case ncclInProgress: return "ncclInProgress";
    case ncclTimeout: return "ncclTimeout";
    default: return "unknown ncclResult_t";
  }
}

}  // namespace fakegpu
