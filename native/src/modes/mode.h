// A distribution mode decides who does the communication work. The C API validates
// arguments, queues calls (group.cc) and hands them to the process's mode:
//   simulate (default)  the coordinator computes every result (mode_simulate.cc);
//   fake, proxy, passthrough: later issues, each its own module behind this interface.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/comm.h"
#include "nccl.h"
#include "wire/protocol.h"

namespace fakegpu {

// One collective or point-to-point call, as queued until the outermost GroupEnd.
struct CollCall {
  ncclComm* comm = nullptr;
  uint8_t kind = 0;      // proto::OpKind
  uint8_t datatype = 0;
  uint8_t redop = 0;     // wire redop: 0..4, 5 = PreMulSum
  uint8_t in_place = 0;
  int32_t root = -1;     // root or peer
  uint64_t count = 0;
  const void* sendbuff = nullptr;
  void* recvbuff = nullptr;
  uint32_t call_seq = 0;
  uint32_t match_seq = 0;  // place in the matching order (comm.h)
  // The shim rejected the arguments: a placeholder that only keeps the rank's place in the
  // matching order, so the call fails on every member (its fields are as the caller passed).
  bool rejected = false;
  // PreMulSum: the scalar, or where to read it when the group runs (device residence).
  uint8_t scalar[8] = {};
  const void* scalar_ptr = nullptr;
  void* stream = nullptr;  // cudaStream_t, for modes that stage device memory
  // Set by cuda_staging::prepare_group when the buffer is GPU memory (hybrid mode).
  bool send_on_device = false, recv_on_device = false;
};

// A communicator being created: start() sends the request, finish() completes `comm`.
// Several may be in flight at once (ncclCommInitAll, inits inside a group).
struct CommRequest {
  enum Kind { kInit, kSplit, kShrink } kind = kInit;
  ncclComm* comm = nullptr;  // being filled in
  // kInit
  uint8_t unique_id[128] = {};
  int nranks = 0, rank = 0;
  // kSplit
  ncclComm* parent = nullptr;
  int color = 0, key = 0;
  // kShrink (also uses parent): ranks of the parent left out, ncclCommShrink's flags
  std::vector<int32_t> excluded;
  uint32_t shrink_flags = 0;
  // Mode-private state of the request in flight.
  void* state = nullptr;
  bool no_color_result = false;  // a split that gave this member no communicator
};

class DistMode {
 public:
  virtual ~DistMode() = default;
  virtual const char* name() const = 0;
  virtual ncclResult_t comm_start(CommRequest* req) = 0;
  virtual ncclResult_t comm_finish(CommRequest* req) = 0;
  virtual ncclResult_t comm_free(ncclComm* comm, proto::FreeHow how) = 0;
  // Runs every call of a group to completion (host buffers: synchronously).
  virtual ncclResult_t run_group(const std::vector<CollCall>& calls) = 0;
  // Asks for the modeled time of a group without running it.
  virtual ncclResult_t simulate_group(const std::vector<CollCall>& calls, double* estimated_us) = 0;
  // Proxy mode: has the coordinator match and account a group that NVIDIA's NCCL is about to
  // run (ACCOUNT request, no data); a disagreement between the ranks fails it. Modes that keep
  // no books on a coordinator accept every group.
  virtual ncclResult_t account_group(const std::vector<CollCall>& calls) { return ncclSuccess; }
  // A call rejected for its arguments outside a group: modes that match calls on a coordinator
  // send its placeholder there without waiting for an answer, so the caller gets its argument
  // error at once (as from NCCL) while the other members' call still fails with it.
  virtual void post_rejected(const CollCall& call) {}
  // ncclGetUniqueId: our own random id, or the real library's (proxy/passthrough).
  virtual ncclResult_t get_unique_id(uint8_t out[128]);
  // An asynchronous failure the mode knows of beyond comm->async_error (the real library's,
  // polled by torch's watchdog through ncclCommGetAsyncError); ncclSuccess when none.
  virtual ncclResult_t async_error(ncclComm* comm) { return ncclSuccess; }
  // fakegpu_probe_source: waits (at most timeout_ms; 0 = the coordinator's timeout) until some
  // peer's Send to this rank of `comm` waits at the coordinator and sets *peer to that rank.
  // Only modes whose Send/Recv meet on the coordinator can answer.
  virtual ncclResult_t probe_source(ncclComm* comm, uint32_t timeout_ms, int* peer);
};

// `calls` without the rejected placeholders, for modes that match nothing on a coordinator
// (fake, passthrough): returns `calls` itself when there are none, else *storage.
const std::vector<CollCall>& without_rejected(const std::vector<CollCall>& calls, std::vector<CollCall>* storage);

// The mode selected by FAKEGPU_DIST_MODE (read once); an error for unknown or not yet
// implemented modes.
ncclResult_t get_mode(DistMode** out);

DistMode* make_simulate_mode();
DistMode* make_passthrough_mode();  // mode_passthrough.cc: NVIDIA's NCCL does the work
DistMode* make_proxy_mode();        // mode_proxy.cc: the same, with the coordinator keeping books

}  // namespace fakegpu
