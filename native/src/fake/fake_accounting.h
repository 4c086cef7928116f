// Which process of a fake world accounts an operation, and the event lines that record it
// (fakegpu/fake/events.py documents the format; docs/fake-worlds.md the rule). Written once:
// the native fake mode (modes/mode_fake.cc) and the torch fake backend
// (fakegpu/fake/runtime.py, through fakegpu_fake_op_event below) both call it, so a C program
// and a torch program account the same operations and write the same lines.
//
// The rule:
// - pure fake (one physical process): every operation, its replicas tiled over the whole
//   logical world; a send or receive also stands for the same-offset transfers of the other
//   group members ("spread"), a receive only when this rank cannot itself send with that
//   offset (its own send already stands for it).
// - several physical processes: each stands for its slice of the world (slice_of). A
//   communicator inside the slice is tiled inside it; one that spans slices is tiled over
//   the world and each replica is accounted by the process whose slice holds its lowest
//   member ("owned"). A send is accounted by its sender; a receive from a physical peer by
//   nobody (it is that peer's send), from a fake peer by the receiver.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "fake/fake_contract.h"

namespace fakegpu::fake {

struct Placement {
  bool account = true;           // false: another process (or this rank's own send) accounts it
  bool has_domain = false;       // the replicas tile [domain_lo, domain_hi) instead of the world
  int domain_lo = 0, domain_hi = 0;
  bool has_owned = false;        // keep only replicas whose lowest member is in [owned_lo, owned_hi)
  int owned_lo = 0, owned_hi = 0;
  bool spread = false;           // a send/recv standing for the group's same-offset transfers
};

// [lo, hi) logical ranks the physical process playing `logical_rank` stands for: from its
// rank up to the next physical rank (the first one also those below it). The whole world
// with one physical process.
std::pair<int, int> slice_of(const Contract& c, int logical_rank);

// The rule above for an operation issued by comm rank `rank` of the communicator whose comm
// rank i is global logical rank members[i]. For a send/recv (`p2p`), `root` is the sender's
// comm rank and `peer` the receiver's.
Placement place_op(const Contract& c, const std::vector<int>& members, int rank, bool p2p, int root, int peer);

// One operation as its "op" event records it.
struct OpEvent {
  int comm_id = 0;
  std::string kind;    // AllReduce, Broadcast, ..., SendRecv
  std::string dtype;   // float32, bfloat16, ...
  int elem_size = 1;
  uint64_t count = 0;  // the NCCL count
  std::string redop;   // empty: not a reduction (null in the event)
  int root = -1, peer = -1, rank = 0;
};

// The event lines (one JSON object each, no newline).
std::string world_line(const Contract& c, const std::string& frontend);
std::string comm_line(int id, const std::string& name, const std::vector<int>& members);
std::string op_line(const OpEvent& op, const Placement& where);

}  // namespace fakegpu::fake
