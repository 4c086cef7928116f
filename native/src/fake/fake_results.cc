#include "fake/fake_results.h"

#include <cstring>
#include <new>

#include "api/export.h"
#include "generated/wire_spec.h"
#include "numerics/fake_numerics.h"

namespace fakegpu::fake {
namespace {

bool overlap(const void* a, uint64_t alen, const void* b, uint64_t blen) {
  auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return alen && blen && x < y + blen && y < x + alen;
}

// Every block of out (n blocks) becomes `block`; a copy is taken first when it lives inside
// out anywhere but in our own slot (which then needs no copy).
void replicate(const uint8_t* block, uint8_t* out, int n, int rank, uint64_t blk) {
  std::vector<uint8_t> tmp;
  uint8_t* own = out + static_cast<uint64_t>(rank) * blk;
  if (block != own && overlap(block, blk, out, n * blk)) {
    tmp.assign(block, block + blk);
    block = tmp.data();
  }
  for (int j = 0; j < n; j++) {
    uint8_t* dst = out + static_cast<uint64_t>(j) * blk;
    if (dst != block) memcpy(dst, block, blk);
  }
}

}  // namespace

ResultStatus collective_result(int kind, int datatype, int redop, int n, int rank, int root,
                               const uint8_t* in, uint8_t* out, uint64_t count, uint64_t elem_size,
                               const void* scalar, uint64_t exact_limit) {
  if (n < 1 || rank < 0 || rank >= n || elem_size == 0) return ResultStatus::kBadArgument;
  const uint64_t blk = count * elem_size;
  if (count == 0) return ResultStatus::kOk;
  auto reduce = [&](const uint8_t* src, uint8_t* dst) {
    if (datatype < 0) return ResultStatus::kCannotReduce;
    std::vector<uint8_t> tmp;
    if (src != dst && overlap(src, blk, dst, blk)) {
      tmp.assign(src, src + blk);
      src = tmp.data();
    }
    return reduce_symmetric(datatype, redop, src, dst, count, n, scalar, exact_limit) ? ResultStatus::kOk
                                                                                        : ResultStatus::kCannotReduce;
  };
  switch (kind) {
    case proto::kAllReduce:
      return reduce(in, out);
    case proto::kReduce:
      return rank == root ? reduce(in, out) : ResultStatus::kOk;
    case proto::kReduceScatter:
      return reduce(in + static_cast<uint64_t>(rank) * blk, out);
    case proto::kBroadcast:  // the root held what we hold
      if (in && in != out) memmove(out, in, blk);
      return ResultStatus::kOk;
    case proto::kAllGather:
      replicate(in, out, n, rank, blk);
      return ResultStatus::kOk;
    case proto::kGather:
      if (rank == root) replicate(in, out, n, rank, blk);
      return ResultStatus::kOk;
    case proto::kAlltoAll: {  // rank j sends us its block r, which equals ours
      std::vector<uint8_t> mine(in + static_cast<uint64_t>(rank) * blk, in + static_cast<uint64_t>(rank + 1) * blk);
      for (int j = 0; j < n; j++) memcpy(out + static_cast<uint64_t>(j) * blk, mine.data(), blk);
      return ResultStatus::kOk;
    }
    case proto::kScatter:  // the root's block r; a non-root has no list to take it from
      if (rank == root && in) memmove(out, in + static_cast<uint64_t>(rank) * blk, blk);
      else memset(out, 0, blk);
      return ResultStatus::kOk;
  }
  return ResultStatus::kUnknownKind;
}

void PeerMirror::send(uint64_t group, int peer, int datatype, uint64_t count, const uint8_t* data,
                      uint64_t nbytes) {
  Pending p{peer, datatype, count, std::vector<uint8_t>(data, data + nbytes)};
  std::lock_guard<std::mutex> lk(mu_);
  auto& q = pending_[group];
  q.push_back(std::move(p));
  while (q.size() > max_pending_) q.pop_front();
}

bool PeerMirror::recv(uint64_t group, int rank, int n, int peer, int datatype, uint64_t count, uint8_t* out,
                      uint64_t nbytes) {
  const int target = n > 0 ? ((2 * rank - peer) % n + n) % n : 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = pending_.find(group);
    if (it != pending_.end()) {
      for (auto p = it->second.begin(); p != it->second.end(); ++p) {
        if (p->to == target && p->count == count && p->datatype == datatype && p->data.size() == nbytes) {
          memcpy(out, p->data.data(), nbytes);
          it->second.erase(p);
          return true;
        }
      }
    }
  }
  memset(out, 0, nbytes);
  return false;
}

void PeerMirror::forget(uint64_t group) {
  std::lock_guard<std::mutex> lk(mu_);
  pending_.erase(group);
}

}  // namespace fakegpu::fake

// For Python (fakegpu/fake/semantics.py): the same results and the same mirror.

extern "C" FG_VISIBLE int fakegpu_fake_collective(int kind, int datatype, int redop, int n, int rank, int root,
                                           const void* in, void* out, uint64_t count, uint64_t elem_size,
                                           const uint8_t* scalar, uint64_t exact_limit) {
  return static_cast<int>(fakegpu::fake::collective_result(kind, datatype, redop, n, rank, root,
                                                           static_cast<const uint8_t*>(in),
                                                           static_cast<uint8_t*>(out), count, elem_size, scalar,
                                                           exact_limit));
}

extern "C" FG_VISIBLE void* fakegpu_peer_mirror_new(uint64_t max_pending) {
  return new (std::nothrow) fakegpu::fake::PeerMirror(max_pending);
}

extern "C" FG_VISIBLE void fakegpu_peer_mirror_free(void* mirror) { delete static_cast<fakegpu::fake::PeerMirror*>(mirror); }

extern "C" FG_VISIBLE void fakegpu_peer_mirror_send(void* mirror, uint64_t group, int peer, int datatype, uint64_t count,
                                             const void* data, uint64_t nbytes) {
  static_cast<fakegpu::fake::PeerMirror*>(mirror)->send(group, peer, datatype, count,
                                                         static_cast<const uint8_t*>(data), nbytes);
}

extern "C" FG_VISIBLE int fakegpu_peer_mirror_recv(void* mirror, uint64_t group, int rank, int n, int peer, int datatype,
                                            uint64_t count, void* out, uint64_t nbytes) {
  return static_cast<fakegpu::fake::PeerMirror*>(mirror)->recv(group, rank, n, peer, datatype, count,
                                                                static_cast<uint8_t*>(out), nbytes)
             ? 1
             : 0;
}
