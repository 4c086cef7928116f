#include "local/arena.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <string>

#include "wire/shm_alloc.h"

namespace fakegpu::local {
namespace {

// Shared (not private) futexes: the waiters are other processes.
long futex_wait(uint32_t* addr, uint32_t expected, const timespec* rel) {
  return syscall(SYS_futex, addr, FUTEX_WAIT, expected, rel, nullptr, 0);
}

void futex_wake_all(uint32_t* addr) { syscall(SYS_futex, addr, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0); }

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

constexpr uint64_t kLow = 0xFFFFFFFFull;
// A waiter looks at the coordinator's flags at least this often while it sleeps.
constexpr auto kPollSlice = std::chrono::milliseconds(50);
// Spinning briefly before sleeping saves a wake-up when the last rank is about to arrive;
// kept short because ranks often share few cores.
constexpr int kSpinChecks = 256;
// When every member can have a CPU of its own, a late member is running, not waiting for this
// CPU: spinning longer then saves the futex sleep and cross-CPU wake-up for members that
// arrive a few tens of microseconds apart, as a Python caller's do. It must outlast a futex
// wake-up (~50-100 us in a VM): with a shorter spin two ranks fall into lockstep where each
// wakes the other just too late, every call paying a sleep (torch all_reduce 4 B, 2 ranks:
// 100 us per call with a 30 us spin, 15 us with 100 us).
constexpr auto kOwnCpuSpin = std::chrono::microseconds(100);

// CPUs this process may run on (its affinity mask: what a container's cpuset allows).
bool members_have_own_cpus(int nranks) {
  static const int cpus = [] {
    cpu_set_t set;
    return sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
  }();
  return nranks <= cpus;
}
// Then give the CPU to whoever is runnable a few times before sleeping: with more ranks than
// cores the member still to arrive is often waiting for this very CPU, and a futex sleep +
// cross-CPU wake-up costs tens of microseconds in a VM (4-byte allreduce, 4 ranks, 2 cores:
// ~190 us without these yields, ~65 us with them).
constexpr int kYieldChecks = 16;

uint64_t data_offset(int nranks) {
  return (arena_layout::kRecordsAt + arena_layout::kRecordBlock * static_cast<uint64_t>(nranks) + 4095) & ~4095ull;
}

}  // namespace

Arena* Arena::open(const std::string& path, uint64_t total_bytes, uint64_t slot_bytes, int nranks, int rank,
                   std::string* err) {
  if (nranks < 2 || rank < 0 || rank >= nranks || slot_bytes == 0 ||
      total_bytes != data_offset(nranks) + 2ull * (nranks + 1) * slot_bytes) {
    *err = "inconsistent arena geometry from the coordinator";
    return nullptr;
  }
  int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    *err = "cannot open " + path + ": " + strerror(errno);
    return nullptr;
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) != total_bytes) {
    close(fd);
    *err = path + " does not have the size the coordinator announced";
    return nullptr;
  }
  if (!fully_allocated(fd, total_bytes)) {
    close(fd);
    *err = path + " is not allocated (a sparse file: a page /dev/shm cannot back would be a SIGBUS)";
    return nullptr;
  }
  void* p = mmap(nullptr, total_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    *err = "cannot map " + path + ": " + strerror(errno);
    return nullptr;
  }
  auto* a = new Arena();
  a->base_ = static_cast<uint8_t*>(p);
  a->total_ = total_bytes;
  a->slot_ = slot_bytes;
  a->nranks_ = nranks;
  a->rank_ = rank;
  a->data_ = a->base_ + data_offset(nranks);
  uint32_t magic, version, n;
  memcpy(&magic, a->base_ + arena_layout::kOffMagic, 4);
  memcpy(&version, a->base_ + arena_layout::kOffVersion, 4);
  memcpy(&n, a->base_ + arena_layout::kOffNranks, 4);
  uint64_t slot;
  memcpy(&slot, a->base_ + arena_layout::kOffSlotBytes, 8);
  if (magic != kArenaMagic || version != kArenaVersion || n != static_cast<uint32_t>(nranks) || slot != slot_bytes) {
    delete a;
    *err = path + " is not an arena of this communicator (header mismatch)";
    return nullptr;
  }
  return a;
}

Arena::~Arena() {
  if (base_) munmap(base_, total_);
}

bool Arena::leave(uint32_t gen, bool withdraw) {
  uint64_t w = sync().load(std::memory_order_acquire);
  for (;;) {
    if ((w >> 32) != gen) return true;              // the round completed meanwhile
    if ((w & kLow) == kBrokenCount) return false;    // broken by someone else
    uint64_t next = (static_cast<uint64_t>(gen) << 32) | (withdraw ? (w & kLow) - 1 : kBrokenCount);
    if (sync().compare_exchange_weak(w, next, std::memory_order_acq_rel)) {
      if (!withdraw) futex_wake_all(generation_word());
      return false;
    }
  }
}

Arena::Outcome Arena::barrier(std::chrono::steady_clock::time_point deadline, const std::function<bool()>& give_up,
                              bool first) {
  uint64_t w = sync().load(std::memory_order_acquire);
  uint32_t gen;
  for (;;) {
    if ((w & kLow) == kBrokenCount) return kBroken;
    gen = static_cast<uint32_t>(w >> 32);
    uint32_t arrived = static_cast<uint32_t>(w & kLow) + 1;
    if (arrived == static_cast<uint32_t>(nranks_)) {
      uint64_t next = static_cast<uint64_t>(gen + 1) << 32;  // arrivals back to 0
      if (sync().compare_exchange_weak(w, next, std::memory_order_acq_rel)) {
        futex_wake_all(generation_word());
        return kMet;
      }
    } else if (sync().compare_exchange_weak(w, (static_cast<uint64_t>(gen) << 32) | arrived,
                                            std::memory_order_acq_rel)) {
      break;
    }
  }
  for (int i = 0; i < kSpinChecks; i++) {
    if ((sync().load(std::memory_order_acquire) >> 32) != gen) return kMet;
    cpu_relax();
  }
  if (members_have_own_cpus(nranks_)) {
    const auto until = std::chrono::steady_clock::now() + kOwnCpuSpin;
    do {
      for (int i = 0; i < kSpinChecks; i++) {
        if ((sync().load(std::memory_order_acquire) >> 32) != gen) return kMet;
        cpu_relax();
      }
    } while (std::chrono::steady_clock::now() < until);
  }
  for (int i = 0; i < kYieldChecks; i++) {
    if ((sync().load(std::memory_order_acquire) >> 32) != gen) return kMet;
    sched_yield();
  }
  for (;;) {
    uint64_t now_w = sync().load(std::memory_order_acquire);
    if ((now_w >> 32) != gen) return kMet;
    if ((now_w & kLow) == kBrokenCount) return kBroken;
    if (failed_rank_plus_one() != 0 || (first && (pending() != 0 || closing())) ||
        std::chrono::steady_clock::now() >= deadline ||
        give_up()) {
      if (leave(gen, first)) return kMet;
      return first ? kWithdrawn : kBroken;
    }
    auto left = deadline - std::chrono::steady_clock::now();
    auto slice = left < kPollSlice ? left : std::chrono::duration_cast<std::chrono::steady_clock::duration>(kPollSlice);
    auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(slice).count();
    if (ns <= 0) ns = 1000;
    timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
    futex_wait(generation_word(), gen, &ts);  // EAGAIN when the generation moved on: rechecked above
  }
}

}  // namespace fakegpu::local
