// What an ncclComm_t points at, and the checks every API entry point runs on it.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "nccl.h"
#include "core/env.h"

namespace fakegpu {
namespace local {
struct CommState;  // local/local_collectives.cc
}

constexpr uint64_t kCommMagic = 0x6667707563306d6dULL;  // "fgpuc0mm"

// An operator made by ncclRedOpCreatePreMulSum: ops >= ncclNumOps index this table.
struct PreMulSumOp {
  bool in_use = false;
  ncclDataType_t datatype = ncclFloat32;
  ncclScalarResidence_t residence = ncclScalarHostImmediate;
  uint8_t value[8] = {};          // HostImmediate: the scalar, read at creation
  const void* pointer = nullptr;  // Device: read each time a collective runs
};

// Parsed ncclConfig_t fields we honour (read by the caller's `size`, see config.cc).
struct CommConfig {
  bool blocking = true;
  std::string name;
};

}  // namespace fakegpu

struct ncclComm {
  uint64_t magic = fakegpu::kCommMagic;
  uint64_t handle = 0;  // the coordinator's member handle (COMM_INFO)
  int rank = -1;
  int nranks = 0;
  std::vector<int> global_ranks;  // global rank of each member (report attribution)
  int cuda_device = 0;
  fakegpu::CommConfig config;
  // FAKEGPU_REDUCTION_ORDER=gloo when the communicator was created: its reducing steps carry a
  // gloo order in their OpDesc flags (wire/staging.cc) and the arenas fold in that order.
  bool gloo_order = fakegpu::env::gloo_reduction_order();

  // ncclSuccess once usable; ncclInProgress while a non-blocking init/split runs; else the
  // init failure.
  std::atomic<int> init_state{ncclInProgress};
  // Reported by ncclCommGetAsyncError: init progress, then connection-level failures.
  std::atomic<int> async_error{ncclInProgress};
  std::thread init_thread;  // non-blocking init / split

  std::atomic<uint32_t> call_seq{0};  // calls issued on this communicator (diagnostics)
  // The matching order (docs/protocol.md "Matching"): collective calls on this communicator,
  // and Send / Recv calls per peer. Every call that names a usable communicator counts,
  // including one whose arguments were rejected, so that the members stay in step.
  std::atomic<uint32_t> collective_seq{0};
  std::vector<uint32_t> send_seq, recv_seq;  // per peer, sized on first use; guarded by mu
  bool finalized = false;
  std::atomic<bool> aborted{false};
  std::atomic<bool> suspended{false};

  // Host-local collectives: 0 not asked yet, 1 arena mapped (`local`), 2 refused or released.
  // `local` is read and replaced with std::atomic_load/atomic_exchange (an abort on another
  // thread may release it while a call runs; the call keeps its own reference).
  std::atomic<int> local_status{0};
  std::shared_ptr<fakegpu::local::CommState> local;

  std::mutex mu;           // guards redops, last_error and send_seq / recv_seq
  std::vector<fakegpu::PreMulSumOp> redops;
  std::string last_error;  // this communicator's last failure, for ncclGetLastError(comm)
};

namespace fakegpu {

// ncclInvalidArgument for NULL/foreign pointers; the init result while not ready;
// ncclInvalidUsage once aborted or suspended. `what` names the API call for the message.
ncclResult_t check_comm_usable(const ncclComm* comm, const char* what);
// Only checks that `comm` is one of ours (for Destroy/Abort/GetAsyncError...).
ncclResult_t check_comm_valid(const ncclComm* comm, const char* what);

// Records a failure that concerns `comm` both globally and on the comm itself.
ncclResult_t comm_fail(ncclComm* comm, ncclResult_t r, const std::string& msg);

// Reads the fields of a caller's ncclConfig_t that its `size` covers.
ncclResult_t read_config(const ncclConfig_t* cfg, CommConfig* out, const char* what);

size_t datatype_size(int dt);  // 0 for an invalid datatype
const char* datatype_name(int dt);

// Default device for a rank of this process: LOCAL_RANK % FAKEGPU_DEVICE_COUNT, else 0.
int default_cuda_device();

}  // namespace fakegpu
