// Communicator creation, teardown and queries.
#include <cstring>

#include "core/comm.h"
#include "core/comm_lifecycle.h"
#include "api/export.h"
#include "api/last_error.h"
#include "modes/mode.h"

using namespace fakegpu;

namespace {

ncclResult_t check_ready(const ncclComm* comm, const char* what) {
  ncclResult_t rc = check_comm_valid(comm, what);
  if (rc != ncclSuccess) return rc;
  int st = comm->init_state.load(std::memory_order_acquire);
  if (st == ncclInProgress) return failf(ncclInProgress, "%s: communicator initialization is still in progress", what);
  if (st != ncclSuccess) return failf(ncclInvalidUsage, "%s: communicator initialization failed", what);
  return ncclSuccess;
}

ncclResult_t init_rank(ncclComm_t* out, int nranks, const ncclUniqueId& id, int rank, const CommConfig& cfg,
                       const char* what) {
  if (!out) return failf(ncclInvalidArgument, "%s: comm (the output pointer) is NULL", what);
  if (nranks < 1) return failf(ncclInvalidArgument, "%s: nranks=%d must be at least 1", what, nranks);
  if (rank < 0 || rank >= nranks)
    return failf(ncclInvalidArgument, "%s: rank=%d is outside [0, %d)", what, rank, nranks);
  auto* comm = new ncclComm();
  comm->config = cfg;
  comm->cuda_device = default_cuda_device();
  auto* req = new CommRequest();
  req->kind = CommRequest::kInit;
  req->comm = comm;
  memcpy(req->unique_id, id.internal, sizeof(req->unique_id));
  req->nranks = nranks;
  req->rank = rank;
  return create_comm(req, out);
}

}  // namespace

NCCL_API(ncclResult_t, ncclGetUniqueId, ncclUniqueId* uniqueId) {
  if (!uniqueId) return fail(ncclInvalidArgument, "ncclGetUniqueId: uniqueId is NULL");
  DistMode* mode;
  // A mode that cannot be set up reports that at init, where callers look for it.
  if (get_mode(&mode) != ncclSuccess) {
    make_unique_id(reinterpret_cast<uint8_t*>(uniqueId->internal));
    return ncclSuccess;
  }
  return mode->get_unique_id(reinterpret_cast<uint8_t*>(uniqueId->internal));
}

NCCL_API(ncclResult_t, ncclCommInitRank, ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank) {
  return init_rank(comm, nranks, commId, rank, CommConfig(), "ncclCommInitRank");
}

NCCL_API(ncclResult_t, ncclCommInitRankConfig, ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank,
         ncclConfig_t* config) {
  CommConfig cfg;
  ncclResult_t rc = read_config(config, &cfg, "ncclCommInitRankConfig");
  if (rc != ncclSuccess) return rc;
  return init_rank(comm, nranks, commId, rank, cfg, "ncclCommInitRankConfig");
}

NCCL_API(ncclResult_t, ncclCommInitRankScalable, ncclComm_t* newcomm, int nranks, int myrank, int nId,
         ncclUniqueId* commIds, ncclConfig_t* config) {
  if (nId < 1 || !commIds)
    return failf(ncclInvalidArgument, "ncclCommInitRankScalable: need at least one unique id (nId=%d, commIds=%p)",
                 nId, (void*)commIds);
  CommConfig cfg;
  ncclResult_t rc = read_config(config, &cfg, "ncclCommInitRankScalable");
  if (rc != ncclSuccess) return rc;
  // Every rank passes the same ids; the first one names the communicator.
  return init_rank(newcomm, nranks, commIds[0], myrank, cfg, "ncclCommInitRankScalable");
}

NCCL_API(ncclResult_t, ncclCommInitAll, ncclComm_t* comms, int ndev, const int* devlist) {
  if (!comms) return fail(ncclInvalidArgument, "ncclCommInitAll: comms is NULL");
  if (ndev < 1) return failf(ncclInvalidArgument, "ncclCommInitAll: ndev=%d must be at least 1", ndev);
  DistMode* mode;
  ncclResult_t rc = get_mode(&mode);
  if (rc != ncclSuccess) return rc;
  uint8_t id[128];
  rc = mode->get_unique_id(id);
  if (rc != ncclSuccess) return rc;
  // All members are requested at once (one connection, many request ids), then collected.
  std::vector<CommRequest*> reqs(ndev, nullptr);
  ncclResult_t first = ncclSuccess;
  for (int i = 0; i < ndev; i++) {
    auto* comm = new ncclComm();
    comm->cuda_device = devlist ? devlist[i] : i;
    auto* req = new CommRequest();
    req->kind = CommRequest::kInit;
    req->comm = comm;
    memcpy(req->unique_id, id, sizeof(id));
    req->nranks = ndev;
    req->rank = i;
    reqs[i] = req;
    comms[i] = comm;
    if (first == ncclSuccess) first = mode->comm_start(req);
  }
  for (int i = 0; i < ndev; i++) {
    if (reqs[i]->state) {
      ncclResult_t rc2 = finish_comm_request(mode, reqs[i]);  // deletes the request
      if (rc2 != ncclSuccess && first == ncclSuccess) first = rc2;
    } else {
      delete reqs[i];
    }
  }
  if (first != ncclSuccess) {
    std::string msg = last_error();
    for (int i = 0; i < ndev; i++) {
      if (comms[i]->init_state.load() == ncclSuccess) mode->comm_free(comms[i], proto::kFreeAbort);
      delete_comm(comms[i]);
      comms[i] = nullptr;
    }
    return fail(first, msg);
  }
  return ncclSuccess;
}

NCCL_API(ncclResult_t, ncclCommSplit, ncclComm_t comm, int color, int key, ncclComm_t* newcomm,
         ncclConfig_t* config) {
  ncclResult_t rc = check_comm_usable(comm, "ncclCommSplit");
  if (rc != ncclSuccess) return rc;
  if (!newcomm) return fail(ncclInvalidArgument, "ncclCommSplit: newcomm is NULL");
  if (color < 0 && color != NCCL_SPLIT_NOCOLOR)
    return failf(ncclInvalidArgument, "ncclCommSplit: color=%d must be >= 0 or NCCL_SPLIT_NOCOLOR", color);
  CommConfig cfg;
  if (config) {
    rc = read_config(config, &cfg, "ncclCommSplit");
    if (rc != ncclSuccess) return rc;
  } else {
    cfg.blocking = comm->config.blocking;  // NCCL: a NULL config inherits the parent's
  }
  auto* child = new ncclComm();
  child->config = cfg;
  child->cuda_device = comm->cuda_device;
  auto* req = new CommRequest();
  req->kind = CommRequest::kSplit;
  req->comm = child;
  req->parent = comm;
  req->color = color;
  req->key = key;
  return create_comm(req, newcomm);
}

// COMM_SHRINK (docs/faults.md): the survivors of a communicator, in their old order, without
// the excluded ranks, which (being dead or leaving) never call.
NCCL_API(ncclResult_t, ncclCommShrink, ncclComm_t comm, int* excludeRanksList, int excludeRanksCount,
         ncclComm_t* newcomm, ncclConfig_t* config, int shrinkFlags) {
  ncclResult_t rc = check_comm_usable(comm, "ncclCommShrink");
  if (rc != ncclSuccess) return rc;
  if (!newcomm) return fail(ncclInvalidArgument, "ncclCommShrink: newcomm is NULL");
  if (excludeRanksCount < 0 || excludeRanksCount >= comm->nranks)
    return failf(ncclInvalidArgument, "ncclCommShrink: excludeRanksCount=%d must be in 0..%d", excludeRanksCount,
                 comm->nranks - 1);
  if (excludeRanksCount > 0 && !excludeRanksList)
    return fail(ncclInvalidArgument, "ncclCommShrink: excludeRanksList is NULL");
  std::vector<int32_t> excluded(excludeRanksList, excludeRanksList + excludeRanksCount);
  std::vector<bool> seen(comm->nranks, false);
  for (int32_t r : excluded) {
    if (r < 0 || r >= comm->nranks)
      return failf(ncclInvalidArgument, "ncclCommShrink: excluded rank %d is not a rank of the %d-rank communicator",
                   r, comm->nranks);
    if (r == comm->rank)
      return failf(ncclInvalidArgument, "ncclCommShrink: rank %d excludes itself (excluded ranks must not call)", r);
    if (seen[r]) return failf(ncclInvalidArgument, "ncclCommShrink: rank %d is excluded twice", r);
    seen[r] = true;
  }
  DistMode* mode;
  rc = get_mode(&mode);
  if (rc != ncclSuccess) return rc;
  if (strcmp(mode->name(), "simulate") != 0)
    return failf(ncclInvalidUsage, "ncclCommShrink is implemented in simulate mode only (FAKEGPU_DIST_MODE=%s)",
                 mode->name());
  CommConfig cfg;
  if (config) {
    rc = read_config(config, &cfg, "ncclCommShrink");
    if (rc != ncclSuccess) return rc;
  } else {
    cfg.blocking = comm->config.blocking;
  }
  auto* child = new ncclComm();
  child->config = cfg;
  child->cuda_device = comm->cuda_device;
  auto* req = new CommRequest();
  req->kind = CommRequest::kShrink;
  req->comm = child;
  req->parent = comm;
  req->excluded = std::move(excluded);
  req->shrink_flags = static_cast<uint32_t>(shrinkFlags);
  return create_comm(req, newcomm);
}

NCCL_API(ncclResult_t, ncclCommFinalize, ncclComm_t comm) {
  ncclResult_t rc = check_comm_usable(comm, "ncclCommFinalize");
  if (rc != ncclSuccess) return rc;
  if (comm->finalized) return ncclSuccess;
  DistMode* mode;
  rc = get_mode(&mode);
  if (rc == ncclSuccess) rc = mode->comm_free(comm, proto::kFreeFinalize);
  comm->finalized = true;
  return rc;
}

NCCL_API(ncclResult_t, ncclCommDestroy, ncclComm_t comm) {
  if (comm == nullptr) return ncclSuccess;  // NCCL accepts destroying NULL
  ncclResult_t rc = check_comm_valid(comm, "ncclCommDestroy");
  if (rc != ncclSuccess) return rc;
  if (comm->init_thread.joinable()) comm->init_thread.join();  // bounded by the init timeout
  rc = ncclSuccess;
  if (comm->init_state.load() == ncclSuccess && !comm->finalized && !comm->aborted.load()) {
    DistMode* mode;
    rc = get_mode(&mode);
    if (rc == ncclSuccess) rc = mode->comm_free(comm, proto::kFreeDestroy);
  }
  delete_comm(comm);
  return rc;
}

NCCL_API(ncclResult_t, ncclCommAbort, ncclComm_t comm) {
  if (comm == nullptr) return ncclSuccess;
  ncclResult_t rc = check_comm_valid(comm, "ncclCommAbort");
  if (rc != ncclSuccess) return rc;
  if (comm->aborted.exchange(true)) return ncclSuccess;
  if (comm->init_state.load() == ncclSuccess) {
    DistMode* mode;
    if (get_mode(&mode) == ncclSuccess) mode->comm_free(comm, proto::kFreeAbort);  // best effort
  }
  // Another thread may still be inside a call on this communicator (a watchdog aborting a
  // stuck collective), so the object is left allocated: a small leak instead of a
  // use-after-free. It stays marked aborted and refuses further use.
  if (comm->init_thread.joinable()) comm->init_thread.detach();
  return ncclSuccess;
}

NCCL_API(ncclResult_t, ncclCommGetAsyncError, ncclComm_t comm, ncclResult_t* asyncError) {
  ncclResult_t rc = check_comm_valid(comm, "ncclCommGetAsyncError");
  if (rc != ncclSuccess) return rc;
  if (!asyncError) return fail(ncclInvalidArgument, "ncclCommGetAsyncError: asyncError is NULL");
  *asyncError = static_cast<ncclResult_t>(comm->async_error.load());
  DistMode* mode;
  if (*asyncError == ncclSuccess && !comm->aborted.load() && get_mode(&mode) == ncclSuccess) {
    ncclResult_t r = mode->async_error(comm);  // e.g. the real library's, in passthrough/proxy
    if (r != ncclSuccess) {
      comm->async_error.store(r);
      *asyncError = r;
    }
  }
  return ncclSuccess;
}

NCCL_API(ncclResult_t, ncclCommCount, const ncclComm_t comm, int* count) {
  ncclResult_t rc = check_ready(comm, "ncclCommCount");
  if (rc != ncclSuccess) return rc;
  if (!count) return fail(ncclInvalidArgument, "ncclCommCount: count is NULL");
  *count = comm->nranks;
  return ncclSuccess;
}

NCCL_API(ncclResult_t, ncclCommUserRank, const ncclComm_t comm, int* rank) {
  ncclResult_t rc = check_ready(comm, "ncclCommUserRank");
  if (rc != ncclSuccess) return rc;
  if (!rank) return fail(ncclInvalidArgument, "ncclCommUserRank: rank is NULL");
  *rank = comm->rank;
  return ncclSuccess;
}

NCCL_API(ncclResult_t, ncclCommCuDevice, const ncclComm_t comm, int* device) {
  ncclResult_t rc = check_ready(comm, "ncclCommCuDevice");
  if (rc != ncclSuccess) return rc;
  if (!device) return fail(ncclInvalidArgument, "ncclCommCuDevice: device is NULL");
  *device = comm->cuda_device;
  return ncclSuccess;
}

NCCL_API(ncclResult_t, ncclCommSuspend, ncclComm_t comm, int flags) {
  ncclResult_t rc = check_comm_usable(comm, "ncclCommSuspend");
  if (rc != ncclSuccess) return rc;
  if (flags & ~NCCL_SUSPEND_MEM) return failf(ncclInvalidArgument, "ncclCommSuspend: unknown flags 0x%x", flags);
  // There is no device memory to release; the communicator refuses work until resumed.
  comm->suspended.store(true);
  return ncclSuccess;
}

NCCL_API(ncclResult_t, ncclCommResume, ncclComm_t comm) {
  ncclResult_t rc = check_ready(comm, "ncclCommResume");
  if (rc != ncclSuccess) return rc;
  if (!comm->suspended.exchange(false)) return fail(ncclInvalidUsage, "ncclCommResume: the communicator is not suspended");
  return ncclSuccess;
}

NCCL_API(ncclResult_t, ncclCommMemStats, ncclComm_t comm, ncclCommMemStat_t stat, uint64_t* value) {
  ncclResult_t rc = check_ready(comm, "ncclCommMemStats");
  if (rc != ncclSuccess) return rc;
  if (!value) return fail(ncclInvalidArgument, "ncclCommMemStats: value is NULL");
  switch (stat) {
    case ncclStatGpuMemSuspend: case ncclStatGpuMemPersist: case ncclStatGpuMemTotal:
      *value = 0;  // the shim allocates no GPU memory
      return ncclSuccess;
    case ncclStatGpuMemSuspended:
      *value = comm->suspended.load() ? 1 : 0;
      return ncclSuccess;
  }
  return failf(ncclInvalidArgument, "ncclCommMemStats: unknown stat %d", (int)stat);
}
