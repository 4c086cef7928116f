#include "core/comm_lifecycle.h"

#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include <cstring>
#include <thread>

#include "core/group.h"
#include "api/last_error.h"

namespace fakegpu {

void make_unique_id(uint8_t out[128]) {
  memset(out, 0, 128);
  memcpy(out, "fakegpu1", 8);
  uint32_t pid = static_cast<uint32_t>(getpid());
  memcpy(out + 8, &pid, 4);
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  uint64_t ns = static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + ts.tv_nsec;
  memcpy(out + 12, &ns, 8);
  uint8_t rnd[32];
  ssize_t got = getrandom(rnd, sizeof(rnd), 0);
  if (got != static_cast<ssize_t>(sizeof(rnd))) {  // no entropy source: still unique per process/time
    static std::atomic<uint64_t> ctr{0};
    uint64_t c = ++ctr;
    for (size_t i = 0; i < sizeof(rnd); i++) rnd[i] = static_cast<uint8_t>((c * 0x9E3779B97F4A7C15ull) >> (8 * (i % 8)));
  }
  memcpy(out + 20, rnd, sizeof(rnd));
}

void delete_comm(ncclComm* comm) {
  if (!comm) return;
  if (comm->init_thread.joinable()) comm->init_thread.join();
  comm->magic = 0;
  delete comm;
}

ncclResult_t finish_comm_request(DistMode* mode, CommRequest* req) {
  ncclComm* comm = req->comm;
  ncclResult_t rc = mode->comm_finish(req);
  if (rc != ncclSuccess) {
    comm_fail(comm, rc, last_error());
    comm->init_state.store(rc, std::memory_order_release);
    comm->async_error.store(rc);
  } else if (req->no_color_result) {
    comm->magic = 0;  // the caller was given NULL; nobody else holds this object
    delete comm;
  } else {
    comm->async_error.store(ncclSuccess);
    comm->init_state.store(ncclSuccess, std::memory_order_release);
  }
  delete req;
  return rc;
}

ncclResult_t create_comm(CommRequest* req, ncclComm_t* out) {
  DistMode* mode;
  ncclResult_t rc = get_mode(&mode);
  if (rc != ncclSuccess) {
    delete req->comm;
    delete req;
    *out = nullptr;
    return rc;
  }
  ncclComm* comm = req->comm;
  // A split with NCCL_SPLIT_NOCOLOR still takes part in the (collective) split, but the
  // caller gets NULL right away.
  const bool nocolor = req->kind == CommRequest::kSplit && req->color == NCCL_SPLIT_NOCOLOR;

  if (in_group()) {  // NCCL: inits/splits inside a group complete at the outermost GroupEnd
    rc = mode->comm_start(req);
    if (rc != ncclSuccess) {
      if (req->state) mode->comm_finish(req);  // releases the pending request
      delete comm;
      delete req;
      *out = nullptr;
      return rc;
    }
    *out = nocolor ? nullptr : comm;
    if (nocolor) req->no_color_result = true;
    defer_comm_request(req);
    return ncclSuccess;
  }

  if (comm->config.blocking || nocolor) {
    rc = mode->comm_start(req);
    if (rc == ncclSuccess) {
      rc = finish_comm_request(mode, req);  // deletes req (and comm when NOCOLOR)
      if (rc != ncclSuccess) {
        delete_comm(comm);
        *out = nullptr;
        return rc;
      }
      *out = nocolor ? nullptr : comm;
      return ncclSuccess;
    }
    if (req->state) mode->comm_finish(req);
    delete comm;
    delete req;
    *out = nullptr;
    return rc;
  }

  // Non-blocking: hand back the communicator now; ncclCommGetAsyncError reports
  // ncclInProgress until the background thread is done.
  *out = comm;
  comm->init_thread = std::thread([mode, req, comm] {
    ncclResult_t r = mode->comm_start(req);
    if (r == ncclSuccess) {
      finish_comm_request(mode, req);
    } else {
      if (req->state) mode->comm_finish(req);
      comm_fail(comm, r, last_error());
      comm->init_state.store(r, std::memory_order_release);
      comm->async_error.store(r);
      delete req;
    }
  });
  return ncclInProgress;
}

}  // namespace fakegpu
