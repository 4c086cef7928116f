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

}  // namespace fakegpu::local
