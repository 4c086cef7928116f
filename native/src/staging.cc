#include "staging.h"

#include "last_error.h"

namespace fakegpu {

void step_lengths(const CollCall& c, uint64_t cnt, uint64_t* in_len, uint64_t* out_len) {
  const uint64_t s = datatype_size(c.datatype);
  const uint64_t n = static_cast<uint64_t>(c.comm->nranks);
  const bool root = c.comm->rank == c.root;
  const uint64_t one = cnt * s, all = n * cnt * s;
  uint64_t in = 0, out = 0;
  switch (c.kind) {
    case proto::kAllReduce: in = one; out = one; break;
    case proto::kBroadcast: in = root ? one : 0; out = one; break;
    case proto::kReduce: in = one; out = root ? one : 0; break;
    case proto::kAllGather: in = one; out = all; break;
    case proto::kReduceScatter: in = all; out = one; break;
    case proto::kAlltoAll: in = all; out = all; break;
    case proto::kGather: in = one; out = root ? all : 0; break;
    case proto::kScatter: in = root ? all : 0; out = one; break;
    case proto::kSend: in = one; break;
    case proto::kRecv: out = one; break;
  }
  *in_len = in;
  *out_len = out;
}

ncclResult_t plan_steps(const std::vector<CollCall>& calls, uint64_t S, std::vector<Step>* steps) {
  steps->clear();
  for (uint32_t i = 0; i < calls.size(); i++) {
    const CollCall& c = calls[i];
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
    uint64_t off = 0;
    do {
      Step st;
      st.call = i;
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
