// Device buffers (hybrid compute mode): collectives whose buffers live in GPU memory.
//
// The coordinator only ever sees host bytes. A step's device pieces are copied to host
// (straight into the shared-memory input region, or a bounce buffer with socket staging)
// with cudaMemcpyAsync on the caller's stream, only that stream is synchronized, the frame
// is exchanged, and the results are copied back with cudaMemcpyAsync on the same stream
// (synchronized again before the staging memory is reused), so work queued on the stream
// after the collective sees its result. Host buffers keep the direct memcpy path.
//
// When it is on: FAKEGPU_MODE=hybrid (a CUDA runtime is required and loaded if the program
// has not done so), or automatically whenever the process already has a CUDA runtime
// loaded (torch's CUDA build). Without a runtime nothing here costs anything.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "modes/mode.h"
#include "nccl.h"

namespace fakegpu::cuda_staging {

// FAKEGPU_MODE=hybrid was asked for.
bool hybrid_requested();

// Whether device pointers must be looked for. Decided once per process on the first call
// (FAKEGPU_MODE=hybrid without any loadable runtime is an error, reported every time).
ncclResult_t enabled(bool* on);

// True for memory that the host must not touch directly (device or managed memory).
// Only meaningful when enabled().
bool is_device_pointer(const void* p);

// Classifies the buffers of `calls` and reads device-resident PreMulSum scalars (stream
// ordered). When any call involves device memory, *out receives a copy of the calls with
// send_on_device/recv_on_device set and scalars resolved, and *use_out is true.
ncclResult_t prepare_group(const std::vector<CollCall>& calls, std::vector<CollCall>* out, bool* use_out);

// Pins (cudaHostRegister) a staging segment once, so device copies run at DMA speed.
// Failures are ignored: pageable memory works too. FAKEGPU_CUDA_PIN_STAGING=0 disables.
void pin_staging(void* base, size_t len);

// Device memory for ncclMemAlloc/ncclMemFree when enabled.
ncclResult_t device_alloc(void** p, size_t n);
ncclResult_t device_free(void* p);

// Copies issued for one frame, and the streams they were issued on.
class DeviceCopies {
 public:
  void to_host(void* dst, const void* src, size_t n, void* stream);    // cudaMemcpyAsync D2H
  void to_device(void* dst, const void* src, size_t n, void* stream);  // cudaMemcpyAsync H2D
  // Synchronizes every stream used since the last sync; returns the first CUDA failure
  // of the copies or of the synchronization (ncclUnhandledCudaError, last error set).
  ncclResult_t sync();
  bool any() const { return !streams_.empty(); }

 private:
  void note(void* stream);
  std::vector<void*> streams_;
  ncclResult_t err_ = ncclSuccess;
  std::string msg_;
};

}  // namespace fakegpu::cuda_staging
