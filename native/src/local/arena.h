// The shared-memory arena of one communicator whose members all live on the coordinator's
// host (docs/protocol.md, "Host-local collectives"). The coordinator creates the file; each
// member maps it and the members meet at a futex barrier in it. This module knows the layout
// and the barrier; local_collectives.cc runs the calls on top of it.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <functional>
#include <cstdint>
#include <string>

#include "generated/wire_spec.h"

namespace fakegpu::local {

// The layout is declared in spec/wire.py (generated/wire_spec.h, fakegpu/wire_spec.py).
constexpr uint32_t kArenaMagic = arena_layout::kMagic;  // bytes 'F' 'G' 'A' 'R'
constexpr uint32_t kArenaVersion = arena_layout::kVersion;
constexpr uint32_t kBrokenCount = 0xFFFFFFFFu;  // sync word's arrivals once the arena was given up

// One rank's record for a round parity: which round it is in, when it arrived, and its call.
struct RankRecord {
  uint64_t round;
  double arrival;             // epoch seconds
  uint8_t desc[proto::kOpDescSize];  // proto OpDesc of the call (first round of a call)
  uint8_t pad[arena_layout::kRecordBytes - arena_layout::kRecordOffDesc - proto::kOpDescSize];
};
static_assert(sizeof(RankRecord) == arena_layout::kRecordBytes, "two records per rank in its block");
static_assert(offsetof(RankRecord, round) == arena_layout::kRecordOffRound &&
                  offsetof(RankRecord, arrival) == arena_layout::kRecordOffArrival &&
                  offsetof(RankRecord, desc) == arena_layout::kRecordOffDesc,
              "the record's fields where spec/wire.py's ARENA_RECORD puts them");
static_assert(2 * arena_layout::kRecordBytes == arena_layout::kRecordBlock, "one record per round parity");

class Arena {
 public:
  // Maps the coordinator's file; nullptr with *err on failure (size or header mismatch).
  static Arena* open(const std::string& path, uint64_t total_bytes, uint64_t slot_bytes, int nranks, int rank,
                     std::string* err);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  int nranks() const { return nranks_; }
  int rank() const { return rank_; }
  uint64_t slot_bytes() const { return slot_; }

  uint8_t* input_slot(uint64_t round, int r) const { return data_ + parity(round) * (nranks_ + 1) * slot_ + r * slot_; }
  uint8_t* output_slot(uint64_t round) const { return input_slot(round, nranks_); }
  RankRecord* record(uint64_t round, int r) const {
    return reinterpret_cast<RankRecord*>(base_ + arena_layout::kRecordsAt + arena_layout::kRecordBlock * static_cast<uint64_t>(r) +
                                         arena_layout::kRecordBytes * parity(round));
  }

  // The round a call starting now gets: the generation of the barrier it will meet first.
  // It cannot move before this member arrives, so every member of a call reads the same.
  uint32_t generation() const { return static_cast<uint32_t>(sync().load(std::memory_order_acquire) >> 32); }

  // What the coordinator writes: a member that left (monotonic), and how many collectives of
  // this communicator wait at the coordinator for members right now.
  uint32_t failed_rank_plus_one() const { return load32(arena_layout::kOffFailed); }
  uint32_t pending() const { return load32(arena_layout::kOffPending); }
  bool closing() const { return load32(arena_layout::kOffClosing) != 0; }  // the coordinator is stopping
  bool broken() const { return (sync().load(std::memory_order_acquire) & 0xFFFFFFFFu) == kBrokenCount; }
  // True when a call may start here: no member left, nothing waiting at the coordinator (the
  // members must not split between the two paths), the arena not given up.
  bool usable() const { return failed_rank_plus_one() == 0 && pending() == 0 && !closing() && !broken(); }

  enum Outcome {
    kMet,        // every member arrived
    kWithdrawn,  // first barrier of a call: this member left it again; the call goes to the coordinator
    kBroken,     // the arena is given up for good (this member or another broke it)
  };
  // Arrives at the barrier of the current generation and waits for every member. The first
  // barrier of a call (`first`) withdraws this member when the coordinator has a collective of
  // this communicator waiting (some member sent its call there), a member left, `give_up()`
  // says so (the local comm was aborted, the coordinator is gone; asked at most every 50 ms),
  // or the deadline passes: the coordinator then decides the call. A later barrier of a call
  // breaks the arena instead: part of the call already happened.
  Outcome barrier(std::chrono::steady_clock::time_point deadline, const std::function<bool()>& give_up, bool first);

 private:
  Arena() = default;
  static uint64_t parity(uint64_t round) { return round & 1; }
  uint32_t load32(size_t off) const {
    return reinterpret_cast<const std::atomic<uint32_t>*>(base_ + off)->load(std::memory_order_acquire);
  }
  std::atomic<uint64_t>& sync() const { return *reinterpret_cast<std::atomic<uint64_t>*>(base_ + arena_layout::kOffSync); }
  // The high half of the sync word (little-endian): the futex waits on it.
  uint32_t* generation_word() const { return reinterpret_cast<uint32_t*>(base_ + arena_layout::kOffSync + 4); }
  // Leaves generation `gen` again (withdraw) or breaks the arena, unless the generation
  // completed meanwhile; returns true when it did complete.
  bool leave(uint32_t gen, bool withdraw);

  uint8_t* base_ = nullptr;
  uint8_t* data_ = nullptr;
  uint64_t total_ = 0, slot_ = 0;
  int nranks_ = 0, rank_ = 0;
};

}  // namespace fakegpu::local
