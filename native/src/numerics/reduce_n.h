// The n-way reduction the ranks of a host-local collective (native/src/local: the ranks reduce
// their shared-memory inputs themselves) compute: exactly the bits the coordinator's reduce_into
// (fakegpu/coordinator/collectives/numerics.py, docs/numerics.md) produces, so a collective
// gives the same result whichever way it ran.
#pragma once

#include <cstdint>

namespace fakegpu::local {

// out[i] = inputs[0][i] op inputs[1][i] op ... op inputs[n-1][i] for i in [0, count), folded in
// rank order with the numerics of docs/numerics.md:
//   - datatype: ncclDataType_t code 0..11 (int8, uint8, int32, uint32, int64, uint64, float16,
//     float32, float64, bfloat16, float8 e4m3fn, float8 e5m2);
//   - redop: wire redop 0 sum, 1 prod, 2 max, 3 min, 4 avg, 5 premulsum;
//   - scalars[r]: rank r's PreMulSum scalar, a value of `datatype` left-aligned in 8 bytes;
//     read only when redop == 5 (may be null otherwise).
// Floats accumulate in float32 (float64 for float64) and are rounded once into the output
// type (float8 saturates); integers wrap modulo 2^bits; Max/Min propagate NaN like np.maximum.
// `out` must not overlap any input (inputs may be the same buffer). Returns false, writing
// nothing, for an unknown datatype or redop, n < 1, or PreMulSum without scalars.
bool reduce_n(int datatype, int redop, const void* const* inputs, int n, void* out, uint64_t count,
              const uint8_t (*scalars)[8]);

// Reduction orders (the OpDesc's order bits, docs/protocol.md; docs/numerics.md "Reduction
// order"): rank order (reduce_n above), or the association of torch 2.13's CPU gloo, whose ring
// all-reduce and ring reduce cut the buffer into n chunks of different lengths.
enum ReductionPlan { kPlanRank = 0, kPlanGlooAllreduce = 1, kPlanGlooReduce = 2 };

// Elements per chunk of gloo's ring all-reduce (kPlanGlooAllreduce) or ring reduce
// (kPlanGlooReduce) of `count` elements of `elem_size` bytes over n ranks (gloo/allreduce.cc,
// gloo/reduce.cc; tests/helpers/gloo_order.py is the numpy model): chunk c is elements
// [c*C, min((c+1)*C, count)). 0 for count 0.
uint64_t gloo_chunk_elements(int plan, int n, uint64_t count, uint64_t elem_size);

// reduce_n for elements [first, first + count) of a reduction of `plan_count` elements
// (inputs[r] and out point at element `first`): rank order for kPlanRank; else chunk c of the
// plan is folded from rank c-1 down to rank c (mod n): x[c-1] op x[c-2] op ... op x[c], and
// float16 / bfloat16 Sum, Prod and Avg round to their type after every step (gloo adds in
// float32 and rounds back), Avg dividing the rounded sum in float32 and rounding again. A large
// call reduced in steps gives the same bits as one call: the plan is over global indices.
// False, writing nothing, where reduce_n refuses or the plan is unknown.
bool reduce_n_planned(int datatype, int redop, int plan, const void* const* inputs, int n, void* out,
                      uint64_t count, const uint8_t (*scalars)[8], uint64_t first, uint64_t plan_count);

}  // namespace fakegpu::local
