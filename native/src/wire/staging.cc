#include "wire/staging.h"

#include <cstdint>
#include <cstring>

#include "api/last_error.h"

namespace fakegpu {

uint8_t reduction_order(const CollCall& c) {
  if (!c.comm->gloo_order) return proto::kOrderRank;
  switch (c.kind) {
    case proto::kAllReduce: case proto::kReduceScatter: return proto::kOrderGlooAllreduce;
    case proto::kReduce: return proto::kOrderGlooReduce;
    default: return proto::kOrderRank;
  }
}

void encode_step_desc(const CollCall& c, const Step& st, uint8_t out[proto::kOpDescSize]) {
  proto::OpDesc d;
  d.comm_handle = c.comm->handle;
  d.kind = c.kind;
  d.datatype = c.datatype;
  d.redop = c.redop;
  d.flags = static_cast<uint8_t>(st.flags | (c.in_place ? proto::kOpInPlace : 0) |
                                 (c.rejected ? 0 : reduction_order(c) << proto::kOpOrderShift));
  d.root = c.root;
  d.total_count = c.count;
  d.step_count = st.cnt;
  d.in_offset = st.in_offset;
  d.in_len = st.in_len;
  d.out_offset = st.out_offset;
  d.out_len = st.out_len;
  if (c.redop == 5 && !c.rejected)
    memcpy(d.scalar, c.scalar_ptr ? c.scalar_ptr : c.scalar, datatype_size(c.datatype));
  d.call_seq = c.call_seq;
  d.match_seq = c.match_seq;
  d.step_index = st.index;
  d.step_total = st.total;
  proto::encode_opdesc(out, d);
}

void step_lengths(const CollCall& c, uint64_t cnt, uint64_t* in_len, uint64_t* out_len) {
  proto::rank_lengths(c.kind, cnt, datatype_size(c.datatype), static_cast<uint64_t>(c.comm->nranks),
                      c.comm->rank == c.root, in_len, out_len);
}

ncclResult_t plan_steps(const std::vector<CollCall>& calls, uint64_t S, std::vector<Step>* steps) {
  steps->clear();
  for (uint32_t i = 0; i < calls.size(); i++) {
    const CollCall& c = calls[i];
    if (c.rejected) {  // a placeholder: one step, nothing staged
      Step st;
      st.call = i;
      st.flags = proto::kOpFirstStep | proto::kOpLastStep | proto::kOpRejected;
      steps->push_back(st);
      continue;
    }
    const uint64_t s = datatype_size(c.datatype);
    const uint64_t m = block_factor(c.kind, c.comm->nranks);
    // Every rank cuts by the largest per-rank length of the kind (c*s*m), not by its own
    // role's length, so roots and non-roots agree on the steps.
    uint64_t C = c.count;
    if (c.count * s * m > S) {
      C = S / (s * m);
      if (C == 0)
        return failf(ncclInvalidUsage,
                     "fakegpu: %s of %s over %d ranks needs %llu staging bytes per element but "
                     "FAKEGPU_STAGING_CHUNK_BYTES grants only %llu",
                     proto::kind_name(c.kind), datatype_name(c.datatype), c.comm->nranks,
                     (unsigned long long)(s * m), (unsigned long long)S);
    }
    const uint64_t n_steps = c.count == 0 ? 1 : (c.count + C - 1) / C;
    if (n_steps > UINT32_MAX)
      return failf(ncclInvalidUsage, "fakegpu: %s of %llu elements needs %llu steps of %llu; raise "
                   "FAKEGPU_STAGING_CHUNK_BYTES", proto::kind_name(c.kind), (unsigned long long)c.count,
                   (unsigned long long)n_steps, (unsigned long long)C);
    uint64_t off = 0;
    uint32_t index = 0;
    do {
      Step st;
      st.call = i;
      st.index = index++;
      st.total = static_cast<uint32_t>(n_steps);
      st.off = off;
      st.cnt = c.count - off < C ? c.count - off : C;
      step_lengths(c, st.cnt, &st.in_len, &st.out_len);
      st.flags = (off == 0 ? proto::kOpFirstStep : 0);
      off += st.cnt;
      if (off >= c.count) st.flags |= proto::kOpLastStep;
      steps->push_back(st);
    } while (off < c.count);
  }
  return ncclSuccess;
}

}  // namespace fakegpu
