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
#include <cstring>

namespace fakegpu::fake {

constexpr uint64_t kExactElementOps = 1ull << 24;  // semantics.EXACT_ELEMENT_OPS

// Wire redops (docs/protocol.md): 0 sum, 1 prod, 2 max, 3 min, 4 avg, 5 premulsum.
// `scalar` (PreMulSum only) is a value of `datatype`, left-aligned. `in` and `out` are
// `count` elements of `datatype`; they may be the same buffer (in place), not overlap
// otherwise. Floats fold the n copies in rank order while n * count <= exact_limit, and use the
// closed form (n*x, x^n) beyond. Returns false for a datatype or redop it does not know.
bool reduce_symmetric(int datatype, int redop, const void* in, void* out, uint64_t count, int n,
                      const void* scalar, uint64_t exact_limit = kExactElementOps);

// Conversions used by the reductions (round to nearest even; exposed for tests/tools). The
// float32 -> float16/bfloat16 ones are inline: the arenas' reduction (local/reduce_n.cc) calls
// them once per element.
float half_to_float(uint16_t h);
float bf16_to_float(uint16_t b);

// numpy's float32 -> float16 cast (npy_floatbits_to_halfbits): NaN payloads kept.
inline uint16_t float_to_half(float x) {
  uint32_t f;
  memcpy(&f, &x, 4);
  const uint32_t f_exp = f & 0x7f800000u;
  uint32_t f_sig = f & 0x007fffffu;
  const uint16_t h_sgn = static_cast<uint16_t>((f & 0x80000000u) >> 16);
  if (f_exp >= 0x47800000u) {  // overflow to infinity, infinity, or NaN (payload kept)
    if (f_exp == 0x7f800000u && f_sig != 0) {
      uint16_t ret = static_cast<uint16_t>(0x7c00u + (f_sig >> 13));
      if (ret == 0x7c00u) ret++;
      return static_cast<uint16_t>(h_sgn + ret);
    }
    return static_cast<uint16_t>(h_sgn + 0x7c00u);
  }
  if (f_exp <= 0x38000000u) {  // subnormal half, or signed zero
    if (f_exp < 0x33000000u) return h_sgn;
    const uint32_t e = f_exp >> 23;
    f_sig = (0x00800000u + (f & 0x007fffffu)) >> (113 - e);
    // round to nearest even; the shift may have dropped up to 11 set bits, checked in f
    if ((f_sig & 0x00003fffu) != 0x00001000u || (f & 0x000007ffu)) f_sig += 0x00001000u;
    return static_cast<uint16_t>(h_sgn + (f_sig >> 13));
  }
  const uint16_t h_exp = static_cast<uint16_t>((f_exp - 0x38000000u) >> 13);
  if ((f_sig & 0x00003fffu) != 0x00001000u) f_sig += 0x00001000u;  // nearest even
  return static_cast<uint16_t>(h_sgn + h_exp + (f_sig >> 13));  // a carry may reach infinity: right
}

// ml_dtypes' float32 -> bfloat16: round to nearest even; every NaN becomes 0x7fc0 with its sign.
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>(((bits >> 16) & 0x8000u) | 0x7fc0u);
  bits += 0x7fffu + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

float fp8e4m3_to_float(uint8_t v);
uint8_t float_to_fp8e4m3(float f);
float fp8e5m2_to_float(uint8_t v);
uint8_t float_to_fp8e5m2(float f);

}  // namespace fakegpu::fake
