#include "cuda/cuda_staging.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>

#include "cuda/cuda_loader.h"
#include "core/env.h"
#include "api/last_error.h"

namespace fakegpu::cuda_staging {
namespace {

enum State { kUndecided = 0, kOff = 1, kOn = 2 };
std::atomic<int> g_state{kUndecided};
const cuda::Runtime* g_rt = nullptr;

// Clears a sticky runtime error left by a failed query so the program does not see it.
void clear_error() {
  if (g_rt && g_rt->GetLastError) g_rt->GetLastError();
}

}  // namespace

bool hybrid_requested() {
  static const bool hybrid = env::str("FAKEGPU_MODE") == "hybrid";
  return hybrid;
}

ncclResult_t enabled(bool* on) {
  int st = g_state.load(std::memory_order_acquire);
  if (st == kUndecided) {
    static std::mutex mu;
    std::lock_guard<std::mutex> lk(mu);
    st = g_state.load(std::memory_order_relaxed);
    if (st == kUndecided) {
      const bool hybrid = hybrid_requested();
      g_rt = cuda::runtime(hybrid);
      // Without hybrid an absent runtime is final (CPU programs pay nothing). With hybrid
      // it stays undecided so that every call reports the missing runtime.
      if (g_rt) st = kOn;
      else if (!hybrid) st = kOff;
      if (st != kUndecided) g_state.store(st, std::memory_order_release);
    }
  }
  if (st == kUndecided) {
    *on = false;
    return failf(ncclUnhandledCudaError, "fakegpu: FAKEGPU_MODE=hybrid needs the CUDA runtime: %s",
                 cuda::missing_reason().c_str());
  }
  *on = st == kOn;
  return ncclSuccess;
}

bool is_device_pointer(const void* p) {
  if (!p || !g_rt) return false;
  // cudaPointerAttributes is {int type; int device; void* devicePointer; void* hostPointer}
  // in CUDA 10..13; the buffer is larger in case a later runtime appends fields.
  alignas(8) unsigned char attr[128];
  memset(attr, 0, sizeof(attr));
  int err = g_rt->PointerGetAttributes(attr, p);
  if (err != 0) {  // old runtimes fail for plain host memory; no device in the process
    clear_error();
    return false;
  }
  int type;
  memcpy(&type, attr, sizeof(type));
  return type == cuda::kDevice || type == cuda::kManaged;
}

ncclResult_t prepare_group(const std::vector<CollCall>& calls, std::vector<CollCall>* out, bool* use_out) {
  *use_out = false;
  bool on = false;
  ncclResult_t rc = enabled(&on);
  if (rc != ncclSuccess || !on) return rc;
  bool any = false;
  for (size_t i = 0; i < calls.size(); i++) {
    const CollCall& c = calls[i];
    const bool sd = is_device_pointer(c.sendbuff);
    const bool rd = c.recvbuff == c.sendbuff ? sd : is_device_pointer(c.recvbuff);
    const bool scalar_dev = c.scalar_ptr && is_device_pointer(c.scalar_ptr);
    if (!any && !(sd || rd || scalar_dev)) continue;
    if (!any) {
      out->assign(calls.begin(), calls.begin() + i);
      any = true;
    }
    out->push_back(c);
    CollCall& s = out->back();
    s.send_on_device = sd;
    s.recv_on_device = rd;
    if (scalar_dev) {
      // NCCL reads a device scalar when the collective runs: after the work already
      // queued on the stream.
      const size_t sz = datatype_size(c.datatype);
      int err = g_rt->MemcpyAsync(s.scalar, c.scalar_ptr, sz, cuda::kDeviceToHost, c.stream);
      if (err == 0) err = g_rt->StreamSynchronize(c.stream);
      if (err != 0)
        return fail(ncclUnhandledCudaError,
                    "fakegpu: reading the PreMulSum scalar from device memory: " + cuda::error_text(g_rt, "cudaMemcpyAsync", err));
      s.scalar_ptr = nullptr;
    }
  }
  *use_out = any;
  return ncclSuccess;
}

void pin_staging(void* base, size_t len) {
  static std::mutex mu;
  static std::vector<void*> pinned;
  if (!g_rt || !g_rt->HostRegister || !base || len == 0) return;
  static const bool allowed = env::str("FAKEGPU_CUDA_PIN_STAGING", "1") != "0";
  if (!allowed) return;
  std::lock_guard<std::mutex> lk(mu);
  if (std::find(pinned.begin(), pinned.end(), base) != pinned.end()) return;
  pinned.push_back(base);  // tried once per segment, whatever the outcome
  if (g_rt->HostRegister(base, len, 0 /* cudaHostRegisterDefault */) != 0) clear_error();
}

ncclResult_t device_alloc(void** p, size_t n) {
  int err = g_rt->Malloc(p, n);
  if (err != 0) {
    *p = nullptr;
    return failf(ncclUnhandledCudaError, "ncclMemAlloc: %s", cuda::error_text(g_rt, "cudaMalloc", err).c_str());
  }
  return ncclSuccess;
}

ncclResult_t device_free(void* p) {
  int err = g_rt->Free(p);
  if (err != 0) return failf(ncclUnhandledCudaError, "ncclMemFree: %s", cuda::error_text(g_rt, "cudaFree", err).c_str());
  return ncclSuccess;
}

void DeviceCopies::note(void* stream) {
  if (std::find(streams_.begin(), streams_.end(), stream) == streams_.end()) streams_.push_back(stream);
}

void DeviceCopies::to_host(void* dst, const void* src, size_t n, void* stream) {
  note(stream);
  if (err_ != ncclSuccess) return;
  int err = g_rt->MemcpyAsync(dst, src, n, cuda::kDeviceToHost, stream);
  if (err != 0) {
    err_ = ncclUnhandledCudaError;
    msg_ = "fakegpu: staging device input to host: " + cuda::error_text(g_rt, "cudaMemcpyAsync", err);
  }
}

void DeviceCopies::to_device(void* dst, const void* src, size_t n, void* stream) {
  note(stream);
  if (err_ != ncclSuccess) return;
  int err = g_rt->MemcpyAsync(dst, src, n, cuda::kHostToDevice, stream);
  if (err != 0) {
    err_ = ncclUnhandledCudaError;
    msg_ = "fakegpu: copying a result back to device memory: " + cuda::error_text(g_rt, "cudaMemcpyAsync", err);
  }
}

ncclResult_t DeviceCopies::sync() {
  for (void* s : streams_) {
    int err = g_rt->StreamSynchronize(s);
    if (err != 0 && err_ == ncclSuccess) {
      err_ = ncclUnhandledCudaError;
      msg_ = "fakegpu: waiting for the collective's stream: " + cuda::error_text(g_rt, "cudaStreamSynchronize", err);
    }
  }
  streams_.clear();
  ncclResult_t r = err_;
  err_ = ncclSuccess;
  if (r != ncclSuccess) return fail(r, msg_);
  return ncclSuccess;
}

}  // namespace fakegpu::cuda_staging
