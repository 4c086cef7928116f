// The CUDA runtime of the process, found at run time (no link-time CUDA dependency).
//
// Order: the runtime already visible to the process (dlsym(RTLD_DEFAULT), i.e. a libcudart
// loaded with RTLD_GLOBAL or linked by the program), then a libcudart already mapped but
// loaded privately (Python extensions are dlopen'ed RTLD_LOCAL; found with
// dl_iterate_phdr and reopened with RTLD_NOLOAD so we share its state and streams), and
// only when asked (FAKEGPU_MODE=hybrid) a fresh dlopen of FAKEGPU_CUDART_PATH or
// libcudart.so.{13,12,11.0,}. The functions are declared with plain C types so that no
// CUDA header is needed.
#pragma once

#include <cstddef>
#include <string>

namespace fakegpu::cuda {

// cudaMemcpyKind values.
enum MemcpyKind { kHostToHost = 0, kHostToDevice = 1, kDeviceToHost = 2, kDeviceToDevice = 3, kDefault = 4 };
// cudaMemoryType values (cudaPointerAttributes::type, CUDA >= 10).
enum MemoryType { kUnregistered = 0, kHost = 1, kDevice = 2, kManaged = 3 };

struct Runtime {
  int (*PointerGetAttributes)(void* attr, const void* ptr) = nullptr;
  int (*MemcpyAsync)(void* dst, const void* src, size_t n, int kind, void* stream) = nullptr;
  int (*StreamSynchronize)(void* stream) = nullptr;
  int (*Malloc)(void** p, size_t n) = nullptr;
  int (*Free)(void* p) = nullptr;
  int (*Memcpy)(void* dst, const void* src, size_t n, int kind) = nullptr;
  // Optional.
  int (*GetLastError)() = nullptr;
  const char* (*GetErrorString)(int err) = nullptr;
  int (*HostRegister)(void* p, size_t n, unsigned flags) = nullptr;
  int (*HostUnregister)(void* p) = nullptr;
  std::string origin;  // where it was found, for messages and `fakegpu doctor`
};

// The runtime, or nullptr. With load=true a library is dlopen'ed when none is in the
// process yet. The first successful lookup is kept for the life of the process; a
// negative lookup without load is retried on the next call that asks with load=true.
const Runtime* runtime(bool load);

// Why the last lookup with load=true found nothing (names what was tried).
std::string missing_reason();

// "cudaXxx failed: <error string> (code N)" for messages.
std::string error_text(const Runtime* rt, const char* fn, int err);

}  // namespace fakegpu::cuda
