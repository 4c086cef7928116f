// SPMD-symmetric reductions for the fake mode: the reduction of n copies of this rank's
// buffer, with the same numbers fakegpu/fake/semantics.py (and so the coordinator's
// numerics, docs/numerics.md) produces:
//   - floats narrower than float32 (float16, bfloat16, float8 e4m3fn/e5m2) accumulate in
//     float32 and are rounded once (to nearest even; float8 saturates to its largest finite
//     value); float32 in float32, float64 in float64;
//   - up to kExactElementOps (n x count) element operations the n copies are folded in rank
//     order, beyond that the closed forms (n*x, x^n, ...) computed in the accumulator type;
//   - integers wrap modulo 2^bits (Sum, Prod, PreMulSum) and Avg is the wrapped sum divided
//     by n with truncation toward zero; Max/Min return x.
#pragma once

#include <cstddef>
#include <cstdint>

namespace fakegpu::fake {

constexpr uint64_t kExactElementOps = 1ull << 24;  // semantics.EXACT_ELEMENT_OPS

// Wire redops (docs/protocol.md): 0 sum, 1 prod, 2 max, 3 min, 4 avg, 5 premulsum.
// `scalar` (PreMulSum only) is a value of `datatype`, left-aligned. `in` and `out` are
// `count` elements of `datatype`; they may be the same buffer (in place), not overlap
// otherwise. Returns false for a datatype or redop it does not know.
bool reduce_symmetric(int datatype, int redop, const void* in, void* out, uint64_t count, int n,
                      const void* scalar);

// Conversions used by the reductions (round to nearest even; exposed for tests/tools).
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);
float bf16_to_float(uint16_t b);
uint16_t float_to_bf16(float f);
float fp8e4m3_to_float(uint8_t v);
uint8_t float_to_fp8e4m3(float f);
float fp8e5m2_to_float(uint8_t v);
uint8_t float_to_fp8e5m2(float f);

}  // namespace fakegpu::fake
