#include "real/real_nccl.h"

#include <dlfcn.h>
#include <glob.h>
#include <limits.h>
#include <stdlib.h>
#include <unistd.h>

#include <mutex>
#include <string>
#include <vector>

#include "core/env.h"
#include "api/last_error.h"

namespace fakegpu::real {
namespace {

std::string real_path(const std::string& p) {
  char buf[PATH_MAX];
  return realpath(p.c_str(), buf) ? std::string(buf) : p;
}

std::string own_path() {
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&own_path), &info) && info.dli_fname) return real_path(info.dli_fname);
  return "";
}

void add_glob(const std::string& pattern, std::vector<std::string>* out) {
  glob_t g;
  if (glob(pattern.c_str(), 0, nullptr, &g) == 0)
    for (size_t i = 0; i < g.gl_pathc; i++) out->push_back(g.gl_pathv[i]);
  globfree(&g);
}

// The nvidia-nccl wheel's library under each plausible Python prefix.
std::vector<std::string> candidates() {
  std::vector<std::string> out;
  const std::string explicit_path = env::str("FAKEGPU_REAL_NCCL_PATH");
  if (!explicit_path.empty()) {
    out.push_back(explicit_path);
    return out;  // an explicit choice is never second-guessed
  }
  const char* rel = "nvidia/nccl/lib/libnccl.so.2";
  std::vector<std::string> prefixes;
  for (const char* var : {"VIRTUAL_ENV", "CONDA_PREFIX"})
    if (!env::str(var).empty()) prefixes.push_back(env::str(var));
  char exe[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n > 0) {  // .../bin/python3.11 -> ... (an interpreter running the program)
    exe[n] = 0;
    std::string e(exe);
    auto slash = e.rfind('/');
    if (slash != std::string::npos) {
      std::string bin = e.substr(0, slash);
      auto s2 = bin.rfind('/');
      if (s2 != std::string::npos) prefixes.push_back(bin.substr(0, s2));
    }
  }
  std::string home = env::str("HOME");
  if (!home.empty()) prefixes.push_back(home + "/.local");
  prefixes.push_back("/usr/local");
  prefixes.push_back("/usr");
  std::string pp = env::str("PYTHONPATH");
  size_t pos = 0;
  while (pos <= pp.size() && !pp.empty()) {
    size_t colon = pp.find(':', pos);
    std::string dir = pp.substr(pos, colon == std::string::npos ? std::string::npos : colon - pos);
    if (!dir.empty()) out.push_back(dir + "/" + rel);
    if (colon == std::string::npos) break;
    pos = colon + 1;
  }
  for (const std::string& p : prefixes) {
    add_glob(p + "/lib/python3*/site-packages/" + rel, &out);
    add_glob(p + "/lib/python3*/dist-packages/" + rel, &out);
    add_glob(p + "/lib64/python3*/site-packages/" + rel, &out);
  }
  return out;
}

template <class Fn>
void bind(void* h, const char* name, Fn* out) {
  *out = reinterpret_cast<Fn>(dlsym(h, name));
}

std::mutex g_mu;
Nccl* g_nccl = nullptr;
std::string g_error;

}  // namespace

ncclResult_t load(const Nccl** out) {
  std::lock_guard<std::mutex> lk(g_mu);
  if (g_nccl) {
    *out = g_nccl;
    return ncclSuccess;
  }
  if (!g_error.empty()) return fail(ncclSystemError, g_error);
  const std::string self = own_path();
  std::string tried;
  for (const std::string& c : candidates()) {
    if (access(c.c_str(), R_OK) != 0) {
      tried += "\n  " + c + ": not found";
      continue;
    }
    if (!self.empty() && real_path(c) == self) {
      tried += "\n  " + c + ": is fakegpu's own library";
      continue;
    }
    void* h = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
    if (!h) {
      const char* e = dlerror();
      tried += "\n  " + c + ": " + (e ? e : "dlopen failed");
      continue;
    }
    auto* n = new Nccl();
    bind(h, "ncclGetVersion", &n->GetVersion);
    bind(h, "ncclGetUniqueId", &n->GetUniqueId);
    bind(h, "ncclCommInitRankConfig", &n->CommInitRankConfig);
    bind(h, "ncclCommSplit", &n->CommSplit);
    bind(h, "ncclCommFinalize", &n->CommFinalize);
    bind(h, "ncclCommDestroy", &n->CommDestroy);
    bind(h, "ncclCommAbort", &n->CommAbort);
    bind(h, "ncclCommGetAsyncError", &n->CommGetAsyncError);
    bind(h, "ncclCommCount", &n->CommCount);
    bind(h, "ncclCommUserRank", &n->CommUserRank);
    bind(h, "ncclGroupStart", &n->GroupStart);
    bind(h, "ncclGroupEnd", &n->GroupEnd);
    bind(h, "ncclAllReduce", &n->AllReduce);
    bind(h, "ncclBroadcast", &n->Broadcast);
    bind(h, "ncclReduce", &n->Reduce);
    bind(h, "ncclAllGather", &n->AllGather);
    bind(h, "ncclReduceScatter", &n->ReduceScatter);
    bind(h, "ncclSend", &n->Send);
    bind(h, "ncclRecv", &n->Recv);
    bind(h, "ncclRedOpCreatePreMulSum", &n->RedOpCreatePreMulSum);
    bind(h, "ncclRedOpDestroy", &n->RedOpDestroy);
    bind(h, "ncclAlltoAll", &n->AlltoAll);
    bind(h, "ncclGather", &n->Gather);
    bind(h, "ncclScatter", &n->Scatter);
    bind(h, "ncclGroupSimulateEnd", &n->GroupSimulateEnd);
    bind(h, "ncclGetLastError", &n->GetLastError);
    std::string missing;
#define REQUIRE(f) if (!n->f) missing += std::string(missing.empty() ? "" : ", ") + "nccl" #f;
    REQUIRE(GetVersion) REQUIRE(GetUniqueId) REQUIRE(CommInitRankConfig) REQUIRE(CommSplit) REQUIRE(CommFinalize)
    REQUIRE(CommDestroy) REQUIRE(CommAbort) REQUIRE(CommGetAsyncError) REQUIRE(CommCount) REQUIRE(CommUserRank)
    REQUIRE(GroupStart) REQUIRE(GroupEnd) REQUIRE(AllReduce) REQUIRE(Broadcast) REQUIRE(Reduce) REQUIRE(AllGather)
    REQUIRE(ReduceScatter) REQUIRE(Send) REQUIRE(Recv) REQUIRE(RedOpCreatePreMulSum) REQUIRE(RedOpDestroy)
#undef REQUIRE
    if (!missing.empty()) {
      tried += "\n  " + c + ": lacks " + missing;
      dlclose(h);
      delete n;
      continue;
    }
    n->path = c;
    n->GetVersion(&n->version);
    g_nccl = n;
    *out = n;
    return ncclSuccess;
  }
  g_error = "fakegpu: the proxy/passthrough modes need NVIDIA's libnccl.so.2 (pip install nvidia-nccl-cu12 or "
            "-cu13, or set FAKEGPU_REAL_NCCL_PATH); tried:" + (tried.empty() ? std::string(" nothing") : tried);
  return fail(ncclSystemError, g_error);
}

ncclResult_t real_fail(const Nccl* n, ncclResult_t r, const char* fn, ncclComm_t comm) {
  const char* why = n->GetLastError ? n->GetLastError(comm) : nullptr;
  return failf(r, "fakegpu: real %s failed: %s%s%s", fn, ncclGetErrorString(r), why && *why ? ": " : "",
               why ? why : "");
}

}  // namespace fakegpu::real
