// A fake world's per-rank results, written once: the native fake mode (modes/mode_fake.cc)
// and the torch fake backend (fakegpu/fake/semantics.py, through the exports below) both
// complete their calls here, so the two cannot drift.
//
// Only one rank of each communicator exists, so every call is completed as if each member
// held exactly what this rank holds (the SPMD assumption): all-reduce and reduce-scatter
// reduce n copies (numerics/fake_numerics.h), broadcast keeps what we hold, all-gather and
// gather repeat our block n times, all-to-all takes our block r for every j (rank j sends us
// its block r, which equals ours), scatter takes the root's block r (zeros on a non-root),
// and a receive takes what the PeerMirror says a symmetric peer sent.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <vector>

namespace fakegpu::fake {

enum class ResultStatus { kOk = 0, kUnknownKind = 1, kCannotReduce = 2, kBadArgument = 3 };

// This rank's result of one collective (not send/recv) of `kind` (the wire's op kinds) on a
// communicator of `n` ranks. `count` elements of `elem_size` bytes per block; `datatype` is
// the wire datatype, or -1 for an element type NCCL has none for (torch's int16, bool), which
// only the kinds that move data accept. `in` and `out` may be the same buffer (in place) or
// overlap as NCCL's in-place layouts do. A non-root's output of reduce/gather is not written.
ResultStatus collective_result(int kind, int datatype, int redop, int n, int rank, int root,
                               const uint8_t* in, uint8_t* out, uint64_t count, uint64_t elem_size,
                               const void* scalar, uint64_t exact_limit);

// Send/recv between this rank and fake peers, by symmetry: this rank (r) receiving from peer
// p = r + d gets what p sent to p - d; in an SPMD world that is what r sent to r - d (mod n).
// So a receive takes the oldest untaken send of the same group to (2r - p) mod n with the same
// count and datatype, else zeros (deterministic, unlike stale memory). At most max_pending
// unmatched sends per group are kept, the oldest dropped first.
class PeerMirror {
 public:
  static constexpr size_t kDefaultMaxPending = 64;
  explicit PeerMirror(size_t max_pending = kDefaultMaxPending) : max_pending_(max_pending) {}

  void send(uint64_t group, int peer, int datatype, uint64_t count, const uint8_t* data, uint64_t nbytes);
  // True when a send matched; out (nbytes) is written either way.
  bool recv(uint64_t group, int rank, int n, int peer, int datatype, uint64_t count, uint8_t* out,
            uint64_t nbytes);
  void forget(uint64_t group);

 private:
  struct Pending {
    int to;
    int datatype;
    uint64_t count;
    std::vector<uint8_t> data;
  };
  size_t max_pending_;
  std::mutex mu_;
  std::map<uint64_t, std::deque<Pending>> pending_;
};

}  // namespace fakegpu::fake
