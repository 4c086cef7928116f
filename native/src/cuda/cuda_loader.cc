#include "cuda/cuda_loader.h"

#include <dlfcn.h>
#include <link.h>

#include <cstring>
#include <mutex>
#include <vector>

#include "core/env.h"

namespace fakegpu::cuda {
namespace {

std::mutex g_mu;
Runtime* g_runtime = nullptr;  // never freed: streams and pointers outlive any teardown order
std::string g_missing;

template <class Fn>
bool bind(void* handle, const char* name, Fn* out) {
  void* p = dlsym(handle, name);
  *out = reinterpret_cast<Fn>(p);
  return p != nullptr;
}

// Fills every entry from `handle`; false when a required one is missing.
bool bind_all(void* handle, Runtime* rt, std::string* missing) {
  bool ok = true;
  auto need = [&](const char* name, auto* fn) {
    if (!bind(handle, name, fn)) {
      ok = false;
      if (missing) *missing += std::string(missing->empty() ? "" : ", ") + name;
    }
  };
  need("cudaPointerGetAttributes", &rt->PointerGetAttributes);
  need("cudaMemcpyAsync", &rt->MemcpyAsync);
  need("cudaStreamSynchronize", &rt->StreamSynchronize);
  need("cudaMalloc", &rt->Malloc);
  need("cudaFree", &rt->Free);
  need("cudaMemcpy", &rt->Memcpy);
  bind(handle, "cudaGetLastError", &rt->GetLastError);
  bind(handle, "cudaGetErrorString", &rt->GetErrorString);
  bind(handle, "cudaHostRegister", &rt->HostRegister);
  bind(handle, "cudaHostUnregister", &rt->HostUnregister);
  return ok;
}

// A libcudart already mapped into the process (possibly RTLD_LOCAL), by path.
int find_mapped(dl_phdr_info* info, size_t, void* data) {
  const char* name = info->dlpi_name;
  if (!name || !*name) return 0;
  const char* base = strrchr(name, '/');
  base = base ? base + 1 : name;
  if (strncmp(base, "libcudart.so", 12) == 0) {
    *static_cast<std::string*>(data) = name;
    return 1;
  }
  return 0;
}

Runtime* lookup(bool load, std::string* why) {
  auto* rt = new Runtime();
  // 1. Visible globally: the runtime torch (or the program) already uses.
  if (dlsym(RTLD_DEFAULT, "cudaPointerGetAttributes") && bind_all(RTLD_DEFAULT, rt, nullptr)) {
    rt->origin = "process (global symbols)";
    return rt;
  }
  // 2. Mapped privately.
  std::string path;
  dl_iterate_phdr(find_mapped, &path);
  if (!path.empty()) {
    void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    std::string missing;
    if (h && bind_all(h, rt, &missing)) {
      rt->origin = path + " (already loaded)";
      return rt;
    }
    *why = path + " is loaded but lacks " + (missing.empty() ? std::string("a usable handle") : missing);
  }
  if (!load) {
    delete rt;
    if (why->empty()) *why = "no CUDA runtime is loaded in this process";
    return nullptr;
  }
  // 3. Load one ourselves (FAKEGPU_MODE=hybrid before the program touched CUDA).
  std::string explicit_path = env::str("FAKEGPU_CUDART_PATH");
  std::vector<std::string> names;
  if (!explicit_path.empty()) names.push_back(explicit_path);
  else names = {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"};
  std::string tried;
  for (const std::string& n : names) {
    void* h = dlopen(n.c_str(), RTLD_NOW | RTLD_GLOBAL);
    if (!h) {
      const char* e = dlerror();
      tried += (tried.empty() ? "" : "; ") + n + ": " + (e ? e : "not found");
      continue;
    }
    std::string missing;
    if (bind_all(h, rt, &missing)) {
      rt->origin = n;
      return rt;
    }
    tried += (tried.empty() ? "" : "; ") + n + ": lacks " + missing;
  }
  delete rt;
  *why = "no CUDA runtime could be loaded (" + tried + ")" +
         (explicit_path.empty() ? "; set FAKEGPU_CUDART_PATH to the libcudart.so to use" : "");
  return nullptr;
}

}  // namespace

const Runtime* runtime(bool load) {
  std::lock_guard<std::mutex> lk(g_mu);
  if (g_runtime) return g_runtime;
  std::string why;
  g_runtime = lookup(load, &why);
  if (!g_runtime) g_missing = why;
  return g_runtime;
}

std::string missing_reason() {
  std::lock_guard<std::mutex> lk(g_mu);
  return g_missing;
}

std::string error_text(const Runtime* rt, const char* fn, int err) {
  const char* s = (rt && rt->GetErrorString) ? rt->GetErrorString(err) : nullptr;
  return std::string(fn) + " failed: " + (s ? s : "CUDA error") + " (code " + std::to_string(err) + ")";
}

}  // namespace fakegpu::cuda
