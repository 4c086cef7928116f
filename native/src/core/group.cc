#include "core/group.h"

#include <cstddef>
#include <cstring>
#include <vector>

#include "core/comm_lifecycle.h"
#include "api/last_error.h"

namespace fakegpu {
namespace {

struct GroupState {
  int depth = 0;
  std::vector<CollCall> calls;  // capacity is kept between groups: no allocation per call
  std::vector<CommRequest*> comm_requests;
};

thread_local GroupState g_group;

ncclResult_t finish_comm_requests() {
  ncclResult_t first = ncclSuccess;
  std::vector<CommRequest*> reqs;
  reqs.swap(g_group.comm_requests);
  DistMode* mode = nullptr;
  ncclResult_t mrc = get_mode(&mode);
  for (CommRequest* r : reqs) {
    ncclResult_t rc = mrc == ncclSuccess ? finish_comm_request(mode, r) : mrc;
    if (rc != ncclSuccess && first == ncclSuccess) first = rc;
  }
  return first;
}

}  // namespace

bool in_group() { return g_group.depth > 0; }

ncclResult_t enqueue_call(const CollCall& c) {
  if (g_group.depth > 0) {
    g_group.calls.push_back(c);
    return ncclSuccess;
  }
  DistMode* mode;
  ncclResult_t rc = get_mode(&mode);
  if (rc != ncclSuccess) return rc;
  thread_local std::vector<CollCall> one;
  one.clear();
  one.push_back(c);
  return mode->run_group(one);
}

void defer_comm_request(CommRequest* req) { g_group.comm_requests.push_back(req); }

ncclResult_t group_start() {
  g_group.depth++;
  return ncclSuccess;
}

ncclResult_t group_end() {
  if (g_group.depth == 0)
    return fail(ncclInvalidUsage, "ncclGroupEnd: not inside a group (ncclGroupEnd without ncclGroupStart)");
  if (--g_group.depth > 0) return ncclSuccess;
  ncclResult_t rc = finish_comm_requests();
  if (g_group.calls.empty()) return rc;
  DistMode* mode;
  ncclResult_t mrc = get_mode(&mode);
  ncclResult_t grc = mrc == ncclSuccess ? mode->run_group(g_group.calls) : mrc;
  g_group.calls.clear();
  return rc != ncclSuccess ? rc : grc;
}

ncclResult_t group_simulate_end(ncclSimInfo_t* info) {
  if (g_group.depth == 0)
    return fail(ncclInvalidUsage, "ncclGroupSimulateEnd: not inside a group (call ncclGroupStart first)");
  // Validate the caller's struct by its size before doing anything.
  size_t size = 0;
  if (info) memcpy(&size, info, sizeof(size));
  if (--g_group.depth > 0) return ncclSuccess;
  ncclResult_t rc = finish_comm_requests();
  double us = 0;
  ncclResult_t src = ncclSuccess;
  if (!g_group.calls.empty()) {
    DistMode* mode;
    src = get_mode(&mode);
    if (src == ncclSuccess) src = mode->simulate_group(g_group.calls, &us);
  }
  g_group.calls.clear();  // simulated, never executed
  if (src == ncclSuccess && info && size >= offsetof(ncclSimInfo_t, estimatedTime) + sizeof(float)) {
    float t = static_cast<float>(us);
    memcpy(reinterpret_cast<char*>(info) + offsetof(ncclSimInfo_t, estimatedTime), &t, sizeof(t));
  }
  return rc != ncclSuccess ? rc : src;
}

}  // namespace fakegpu
