// fakegpu_probe_source: a fakegpu extension (not an NCCL API) for receives from any source.
//
// NCCL has no wildcard receive; a backend that offers one (torch's recv without src) asks
// which peer has a Send to this rank waiting, then posts an ordinary ncclRecv from it. The
// coordinator holds every Send that waits for its Recv, so it answers exactly and claims that
// Send for the caller (docs/protocol.md, "Receive from any source").
#include "api/export.h"
#include "api/last_error.h"
#include "core/comm.h"
#include "core/group.h"
#include "modes/mode.h"

using namespace fakegpu;

// Blocks until some peer's Send to this rank of `comm` waits at the coordinator, at most
// `timeout_ms` (0: the coordinator's timeout, which also caps larger values), and sets *peer
// to that rank: the earliest such Send to arrive (ties: the lower rank), whose call the
// caller's next ncclRecv from *peer then completes. ncclTimeout when nobody sent in time.
// Not inside ncclGroupStart/End: the group's own calls would not have been issued yet.
extern "C" FG_VISIBLE ncclResult_t fakegpu_probe_source(ncclComm_t comm, int timeout_ms, int* peer) {
  ncclResult_t rc = check_comm_usable(comm, "fakegpu_probe_source");
  if (rc != ncclSuccess) return rc;
  if (peer == nullptr) return fail(ncclInvalidArgument, "fakegpu_probe_source: peer is NULL");
  if (timeout_ms < 0)
    return failf(ncclInvalidArgument, "fakegpu_probe_source: timeout_ms %d is negative (0 means the "
                 "coordinator's timeout)", timeout_ms);
  if (in_group())
    return fail(ncclInvalidUsage, "fakegpu_probe_source inside ncclGroupStart/ncclGroupEnd: the group's calls "
                "are issued only at ncclGroupEnd, so probe before the group or after it");
  if (comm->nranks < 2)
    return failf(ncclInvalidUsage, "fakegpu_probe_source: a %d-rank communicator has no peer to receive from",
                 comm->nranks);
  DistMode* mode;
  rc = get_mode(&mode);
  if (rc != ncclSuccess) return rc;
  return mode->probe_source(comm, static_cast<uint32_t>(timeout_ms), peer);
}
