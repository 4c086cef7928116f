// FAKEGPU_DIST_MODE=passthrough and proxy: NVIDIA's NCCL (real_nccl.h) does the work.
//
// passthrough  every communicator and call is forwarded; the shim counts calls and bytes per
//              communicator and writes a per-rank JSON report (FAKEGPU_CLUSTER_REPORT_PATH,
//              default ./fakegpu-report.json, with ".rank<RANK>" appended) when a
//              communicator is destroyed and at exit.
// proxy        the same, and every communicator is also created on the coordinator with the
//              real library's binary unique id, so the coordinator checks that the ranks agree
//              on membership and the split colours and attributes them to global ranks, and
//              every group is checked and accounted there (ACCOUNT) before it is forwarded
//              (mode_proxy.cc).
#pragma once

#include "modes/mode.h"

namespace fakegpu {

// `coordinator` (may be null) mirrors communicator creation and teardown.
DistMode* make_forwarding_mode(const char* name, DistMode* coordinator);

}  // namespace fakegpu
