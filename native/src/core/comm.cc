#include "core/comm.h"

#include <climits>
#include <cstddef>
#include <cstring>

#include "core/env.h"
#include "generated/wire_spec.h"
#include "api/last_error.h"

namespace fakegpu {

ncclResult_t check_comm_valid(const ncclComm* comm, const char* what) {
  if (comm == nullptr) return failf(ncclInvalidArgument, "%s: comm is NULL", what);
  if (comm->magic != kCommMagic)
    return failf(ncclInvalidArgument, "%s: comm %p is not a live communicator (destroyed, or not from ncclCommInit*)",
                 what, (const void*)comm);
  return ncclSuccess;
}

ncclResult_t check_comm_usable(const ncclComm* comm, const char* what) {
  ncclResult_t rc = check_comm_valid(comm, what);
  if (rc != ncclSuccess) return rc;
  int st = comm->init_state.load(std::memory_order_acquire);
  if (st == ncclInProgress)
    return failf(ncclInvalidUsage,
                 "%s: communicator initialization has not finished; poll ncclCommGetAsyncError until it "
                 "returns ncclSuccess",
                 what);
  if (st != ncclSuccess)
    return failf(ncclInvalidUsage, "%s: communicator initialization failed (%s); destroy it", what,
                 result_name((ncclResult_t)st));
  if (comm->aborted.load()) return failf(ncclInvalidUsage, "%s: the communicator was aborted", what);
  if (comm->suspended.load())
    return failf(ncclInvalidUsage, "%s: the communicator is suspended; call ncclCommResume first", what);
  return ncclSuccess;
}

ncclResult_t comm_fail(ncclComm* comm, ncclResult_t r, const std::string& msg) {
  if (comm) {
    std::lock_guard<std::mutex> lk(comm->mu);
    comm->last_error = msg;
  }
  return fail(r, msg);
}

ncclResult_t read_config(const ncclConfig_t* cfg, CommConfig* out, const char* what) {
  *out = CommConfig();
  if (!cfg) return ncclSuccess;
  // Callers built against other NCCL versions pass smaller or larger structs: read only
  // what their `size` covers, field by field, and never past it.
  size_t size;
  memcpy(&size, cfg, sizeof(size));
  auto covers = [&](size_t off, size_t len) { return size >= off + len; };
  if (!covers(offsetof(ncclConfig_t, magic), sizeof(unsigned)))
    return failf(ncclInvalidArgument, "%s: config->size=%zu is too small; initialize it with NCCL_CONFIG_INITIALIZER",
                 what, size);
  unsigned magic;
  memcpy(&magic, reinterpret_cast<const char*>(cfg) + offsetof(ncclConfig_t, magic), sizeof(magic));
  if (magic != NCCL_API_MAGIC)
    return failf(ncclInvalidArgument, "%s: config->magic is 0x%x, not 0x%x; initialize it with NCCL_CONFIG_INITIALIZER",
                 what, magic, (unsigned)NCCL_API_MAGIC);
  const char* base = reinterpret_cast<const char*>(cfg);
  if (covers(offsetof(ncclConfig_t, blocking), sizeof(int))) {
    int b;
    memcpy(&b, base + offsetof(ncclConfig_t, blocking), sizeof(b));
    if (b != NCCL_CONFIG_UNDEF_INT) {
      if (b != 0 && b != 1) return failf(ncclInvalidArgument, "%s: config->blocking=%d (expected 0 or 1)", what, b);
      out->blocking = b != 0;
    }
  }
  if (covers(offsetof(ncclConfig_t, commName), sizeof(const char*))) {
    const char* name;
    memcpy(&name, base + offsetof(ncclConfig_t, commName), sizeof(name));
    if (name) out->name.assign(name, strnlen(name, 4096));
  }
  return ncclSuccess;
}

size_t datatype_size(int dt) { return proto::datatype_size(dt); }

const char* datatype_name(int dt) { return proto::datatype_name(dt); }

int default_cuda_device() {
  long long local = env::integer("LOCAL_RANK", 0);
  long long count = env::integer("FAKEGPU_DEVICE_COUNT", 0);
  if (local < 0 || count <= 0) return 0;
  return static_cast<int>(local % count);
}

}  // namespace fakegpu
