// Cutting calls into steps and moving bytes between user buffers and the staging layout
// (docs/protocol.md "Steps"). A step's input and output are a handful of contiguous
// pieces of user memory (one per rank block when a per-rank-block call is cut); the
// simulate mode copies those pieces into the shared-memory regions, or hands them to
// sendmsg/recv directly with socket staging — never through another buffer.
#pragma once

#include <cstdint>
#include <vector>

#include "core/comm.h"
#include "modes/mode.h"
#include "wire/protocol.h"

namespace fakegpu {

struct Step {
  uint32_t call = 0;                // index of its call in the group
  uint64_t off = 0, cnt = 0;        // element range [off, off+cnt) of the call
  uint64_t in_len = 0, out_len = 0; // per-rank bytes (protocol.md table)
  uint8_t flags = 0;                // proto::kOpFirstStep / kOpLastStep / kOpRejected
  uint32_t index = 0, total = 1;    // its place among the steps of its call
  uint64_t in_offset = 0, out_offset = 0;  // placement in the regions (frame packing)
};

// m in C = floor(S / (s * m)): n for the kinds whose buffers hold one block per rank.
inline uint64_t block_factor(uint8_t kind, int nranks) {
  return proto::per_member_blocks(kind) ? static_cast<uint64_t>(nranks) : 1;
}

// The wire OpDesc of step `st` of call `c` (a device-resident PreMulSum scalar is read now,
// when the collective runs, as NCCL does).
void encode_step_desc(const CollCall& c, const Step& st, uint8_t out[proto::kOpDescSize]);

// The reduction order (proto::kOrder*) of call `c`'s steps: its communicator's order for the
// reducing kinds (AllReduce and ReduceScatter: gloo's all-reduce ring, Reduce: its reduce ring).
uint8_t reduction_order(const CollCall& c);

// This rank's in_len/out_len for `cnt` elements of call `c`.
void step_lengths(const CollCall& c, uint64_t cnt, uint64_t* in_len, uint64_t* out_len);

// Appends the steps of every call, in call order. Fails only when one element per rank
// block does not fit in the staging region.
ncclResult_t plan_steps(const std::vector<CollCall>& calls, uint64_t staging_bytes, std::vector<Step>* steps);

// Calls f(pointer, bytes) for each contiguous piece of user memory that makes up the step's
// input (resp. output), in staging-layout order. Adjacent blocks are merged.
template <class Ptr, class F>
void for_each_block(Ptr base, const CollCall& c, uint64_t off, uint64_t cnt, size_t s, F&& f) {
  const uint64_t n = static_cast<uint64_t>(c.comm->nranks);
  if (cnt == 0) return;
  if (cnt == c.count) {  // uncut: the n blocks are back to back in the user buffer
    f(base, n * cnt * s);
    return;
  }
  for (uint64_t j = 0; j < n; j++) f(base + (j * c.count + off) * s, cnt * s);
}

// The pieces of one side of a call: none, one contiguous range, or one per member block, as
// the kind's row of the generated KindInfo table (spec/wire.py KINDS) says for that side.
template <class Ptr, class F>
void for_each_side_piece(Ptr base, const CollCall& c, uint8_t blocks, bool root_only, uint64_t off, uint64_t cnt,
                         F&& f) {
  const size_t s = datatype_size(c.datatype);
  if (cnt == 0 || blocks == 0 || (root_only && c.comm->rank != c.root)) return;
  if (blocks == proto::kPerMember) for_each_block(base, c, off, cnt, s, f);
  else f(base + off * s, cnt * s);
}

template <class F>
void for_each_input_piece(const CollCall& c, uint64_t off, uint64_t cnt, F&& f) {
  const proto::KindInfo& k = proto::kind_info(c.kind);
  for_each_side_piece(static_cast<const uint8_t*>(c.sendbuff), c, k.in_blocks, k.in_root_only, off, cnt, f);
}

template <class F>
void for_each_output_piece(const CollCall& c, uint64_t off, uint64_t cnt, F&& f) {
  const proto::KindInfo& k = proto::kind_info(c.kind);
  for_each_side_piece(static_cast<uint8_t*>(c.recvbuff), c, k.out_blocks, k.out_root_only, off, cnt, f);
}

}  // namespace fakegpu
