#include "modes/mode.h"

#include <mutex>

#include "core/comm_lifecycle.h"
#include "core/env.h"
#include "api/last_error.h"
#include "modes/mode_fake.h"

namespace fakegpu {

ncclResult_t get_mode(DistMode** out) {
  static std::once_flag once;
  static DistMode* mode = nullptr;
  static std::string requested;
  std::call_once(once, [] {
    requested = env::str("FAKEGPU_DIST_MODE", "simulate");
    if (requested == "simulate") mode = make_simulate_mode();
    else if (requested == "passthrough") mode = make_passthrough_mode();
    else if (requested == "proxy") mode = make_proxy_mode();
    else if (requested == "fake") mode = make_fake_mode();  // mode_fake.cc: no coordinator
  });
  if (mode) {
    *out = mode;
    return ncclSuccess;
  }
  *out = nullptr;
  if (requested == "real_pp_fake_spmd")
    return failf(ncclInvalidUsage, "fakegpu: FAKEGPU_DIST_MODE=%s is not implemented in the NCCL shim; use the fakegpu "
                 "torch backend (fakegpu.fake.init_process_group) or FAKEGPU_DIST_MODE=fake", requested.c_str());
  if (requested == "hybrid")
    return failf(ncclInvalidUsage, "fakegpu: FAKEGPU_DIST_MODE=%s is not implemented yet in this build (use simulate)",
                 requested.c_str());
  return failf(ncclInvalidUsage,
               "fakegpu: FAKEGPU_DIST_MODE=%s is not a mode (expected simulate, fake, proxy or passthrough)",
               requested.c_str());
}

ncclResult_t DistMode::probe_source(ncclComm*, uint32_t, int*) {
  return failf(ncclInvalidUsage, "fakegpu_probe_source: FAKEGPU_DIST_MODE=%s has no coordinator that sees the "
               "peers' Sends (receiving from any source needs the simulate mode)", name());
}

ncclResult_t DistMode::get_unique_id(uint8_t out[128]) {
  make_unique_id(out);
  return ncclSuccess;
}

}  // namespace fakegpu

namespace fakegpu {

const std::vector<CollCall>& without_rejected(const std::vector<CollCall>& calls, std::vector<CollCall>* storage) {
  bool any = false;
  for (const CollCall& c : calls) any = any || c.rejected;
  if (!any) return calls;
  storage->clear();
  for (const CollCall& c : calls)
    if (!c.rejected) storage->push_back(c);
  return *storage;
}

}  // namespace fakegpu
