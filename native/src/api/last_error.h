// The text ncclGetLastError returns. NCCL keeps one process-wide buffer; so do we, and a
// communicator also remembers its own last failure so that an error raised on a
// background thread (non-blocking init) is still readable through that communicator.
#pragma once

#include <string>

#include "nccl.h"

namespace fakegpu {

// Records `msg` as the last error and returns `result` (so call sites can `return fail(...)`).
ncclResult_t fail(ncclResult_t result, const std::string& msg);
ncclResult_t failf(ncclResult_t result, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

// Copy of the process-wide last error (empty when none).
std::string last_error();
// Pointer to a stable buffer holding the process-wide last error, for ncclGetLastError.
const char* last_error_cstr();

const char* result_name(ncclResult_t r);

}  // namespace fakegpu
