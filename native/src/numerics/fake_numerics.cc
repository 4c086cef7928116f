#include "numerics/fake_numerics.h"

#include "generated/wire_spec.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

// Products feeding sums must round on their own, as numpy's do: no fused multiply-add.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace fakegpu::fake {
namespace {

// ---- minifloats ----------------------------------------------------------------------------
// A binary format with E exponent bits, M mantissa bits and bias B. IEEE-like formats
// (float16, float8 e5m2) have infinities and NaNs at the top exponent; "fn" formats
// (float8 e4m3fn) have no infinity and one NaN pattern per sign (all ones).
struct Minifloat {
  int E, M, B;
  bool ieee;
};
constexpr Minifloat kHalf{5, 10, 15, true};
constexpr Minifloat kE4M3{4, 3, 7, false};
constexpr Minifloat kE5M2{5, 2, 15, true};

float decode(const Minifloat& f, uint32_t v) {
  const uint32_t max_e = (1u << f.E) - 1, max_m = (1u << f.M) - 1;
  const bool neg = (v >> (f.E + f.M)) & 1;
  const uint32_t e = (v >> f.M) & max_e, m = v & max_m;
  float val;
  if (f.ieee && e == max_e) val = m ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  else if (!f.ieee && e == max_e && m == max_m) val = std::numeric_limits<float>::quiet_NaN();
  else if (e == 0) val = std::ldexp(static_cast<float>(m), 1 - f.B - f.M);
  else val = std::ldexp(static_cast<float>((1u << f.M) | m), static_cast<int>(e) - f.B - f.M);
  return neg ? -val : val;
}

// v / 2^shift rounded to nearest, ties to even.
uint64_t round_shift(uint64_t v, int shift) {
  if (shift <= 0) return v;
  if (shift >= 63) return 0;
  uint64_t q = v >> shift, rem = v & ((1ull << shift) - 1), half = 1ull << (shift - 1);
  if (rem > half || (rem == half && (q & 1))) q++;
  return q;
}

uint32_t encode(const Minifloat& f, float x) {
  uint32_t bits;
  memcpy(&bits, &x, 4);
  const uint32_t sign = (bits >> 31) << (f.E + f.M);
  const uint32_t a = bits & 0x7fffffffu;
  const uint32_t max_e = (1u << f.E) - 1, max_m = (1u << f.M) - 1;
  const uint32_t nan = sign | (max_e << f.M) | (f.ieee ? (1u << (f.M - 1)) : max_m);
  if (a > 0x7f800000u) {  // NaN: keep the top payload bits like numpy's float16 cast
    if (!f.ieee) return nan;
    uint32_t m = (a & 0x7fffffu) >> (23 - f.M);
    return sign | (max_e << f.M) | (m ? m : 1u);
  }
  if (a == 0x7f800000u) return f.ieee ? (sign | (max_e << f.M)) : nan;
  const int exp32 = static_cast<int>(a >> 23);
  if (exp32 == 0) return sign;  // float32 subnormals are far below every minifloat's range
  int e = exp32 - 127;
  const uint64_t full = (1u << 23) | (a & 0x7fffffu);
  const int emin = 1 - f.B;
  if (e >= emin) {
    uint64_t q = round_shift(full, 23 - f.M);
    if (q >> (f.M + 1)) {
      q >>= 1;
      e++;
    }
    const uint32_t field = static_cast<uint32_t>(e + f.B);
    const uint32_t m = static_cast<uint32_t>(q) & max_m;
    if (f.ieee ? field >= max_e : (field > max_e || (field == max_e && m == max_m)))
      return f.ieee ? (sign | (max_e << f.M)) : nan;
    return sign | (field << f.M) | m;
  }
  // Subnormal result; a carry into 1 << M is exactly the smallest normal.
  return sign | static_cast<uint32_t>(round_shift(full, 23 - f.M + (emin - e)));
}

// ---- element access ------------------------------------------------------------------------
struct F16 {
  using T = uint16_t;
  static float load(T v) { return half_to_float(v); }
  static T store(float f) { return float_to_half(f); }
};
struct BF16 {
  using T = uint16_t;
  static float load(T v) { return bf16_to_float(v); }
  static T store(float f) { return float_to_bf16(f); }
};
struct E4M3 {
  using T = uint8_t;
  static float load(T v) { return fp8e4m3_to_float(v); }
  static T store(float f) { return float_to_fp8e4m3(f); }
};
struct E5M2 {
  using T = uint8_t;
  static float load(T v) { return fp8e5m2_to_float(v); }
  static T store(float f) { return float_to_fp8e5m2(f); }
};
template <class F>
struct Plain {
  using T = F;
  static F load(F v) { return v; }
  static F store(F f) { return f; }
};

enum { kSum = 0, kProd = 1, kMax = 2, kMin = 3, kAvg = 4, kPreMulSum = 5 };

// Floating types: Acc is the accumulator (float32, or float64 for float64). `satmax` > 0
// clips the result (float8).
// x^n for the closed form of a product of n equal values. A float32 power is computed in
// float64 and rounded once: powf and numpy's float32 power disagree in the last bits, while the
// float64 power rounded to float32 is the same in both (semantics._closed_form does the same).
template <class Acc>
Acc closed_form_power(Acc x, int n) {
  if constexpr (sizeof(Acc) < sizeof(double))
    return static_cast<Acc>(std::pow(static_cast<double>(x), static_cast<double>(n)));
  else
    return std::pow(x, static_cast<Acc>(n));
}

template <class Codec, class Acc>
void reduce_float(int redop, const void* in_v, void* out_v, uint64_t count, int n, const void* scalar, Acc satmax,
                  uint64_t exact_limit) {
  using T = typename Codec::T;
  const T* in = static_cast<const T*>(in_v);
  T* out = static_cast<T*>(out_v);
  Acc s = 1;
  if (redop == kPreMulSum) {
    T raw;
    memcpy(&raw, scalar, sizeof(T));
    s = static_cast<Acc>(Codec::load(raw));
  }
  const bool exact = static_cast<uint64_t>(n) * count <= exact_limit;
  const Acc an = static_cast<Acc>(n);
  for (uint64_t i = 0; i < count; i++) {
    const Acc x = static_cast<Acc>(Codec::load(in[i]));
    Acc a;
    if (exact) {  // n copies folded in rank order, like reduce_into
      const Acc xs = redop == kPreMulSum ? x * s : x;
      a = xs;
      if (redop == kProd)
        for (int k = 1; k < n; k++) a = a * xs;
      else
        for (int k = 1; k < n; k++) a = a + xs;
      if (redop == kAvg) a = a / an;
    } else {  // semantics._closed_form
      a = x;
      if (redop == kPreMulSum) a = a * s;
      if (redop == kSum || redop == kPreMulSum) a = a * an;
      else if (redop == kAvg) a = (a * an) / an;
      else if (redop == kProd) a = closed_form_power(a, n);
    }
    if (satmax > 0) {
      if (a > satmax) a = satmax;
      else if (a < -satmax) a = -satmax;
    }
    out[i] = Codec::store(a);
  }
}

template <class T>
void reduce_int(int redop, const void* in_v, void* out_v, uint64_t count, int n, const void* scalar) {
  using U = std::make_unsigned_t<T>;
  const T* in = static_cast<const T*>(in_v);
  T* out = static_cast<T*>(out_v);
  U s = 1;
  if (redop == kPreMulSum) {
    T raw;
    memcpy(&raw, scalar, sizeof(T));
    s = static_cast<U>(raw);
  }
  // Modular arithmetic is exact: n wrapped copies sum to n*x mod 2^bits whatever the order.
  const U un = static_cast<U>(static_cast<uint64_t>(n));
  const uint64_t power_n = static_cast<uint64_t>(n);  // not U: 256 would wrap to x^0 in uint8
  for (uint64_t i = 0; i < count; i++) {
    U v = static_cast<U>(in[i]);
    if (redop == kPreMulSum) v = static_cast<U>(v * s);
    if (redop == kSum || redop == kPreMulSum || redop == kAvg) {
      v = static_cast<U>(v * un);
    } else if (redop == kProd) {
      U result = 1, base = v;
      for (uint64_t e = power_n; e; e >>= 1) {
        if (e & 1) result = static_cast<U>(result * base);
        base = static_cast<U>(base * base);
      }
      v = result;
    }
    T r = static_cast<T>(v);
    if (redop == kAvg) {
      // The wrapped sum divided by n in a 64-bit integer of T's signedness (C truncation toward
      // zero): n itself may not fit in T (int8 avg over 128 ranks of -1 is -128 / 128 = -1).
      using Wide = std::conditional_t<std::is_signed<T>::value, int64_t, uint64_t>;
      r = static_cast<T>(static_cast<Wide>(r) / static_cast<Wide>(n));
    }
    out[i] = r;
  }
}

}  // namespace

float half_to_float(uint16_t h) {
  if ((h & 0x7c00u) == 0x7c00u && (h & 0x3ffu)) {
    // NaN: numpy's float16 -> float32 cast keeps the sign and the payload bits (signalling
    // NaNs included), so NaN results carry the same bits as the coordinator's.
    const uint32_t bits = (static_cast<uint32_t>(h & 0x8000u) << 16) | 0x7f800000u |
                          (static_cast<uint32_t>(h & 0x3ffu) << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
  }
  return decode(kHalf, h);
}
float fp8e4m3_to_float(uint8_t v) { return decode(kE4M3, v); }
uint8_t float_to_fp8e4m3(float f) { return static_cast<uint8_t>(encode(kE4M3, f)); }
float fp8e5m2_to_float(uint8_t v) { return decode(kE5M2, v); }
uint8_t float_to_fp8e5m2(float f) { return static_cast<uint8_t>(encode(kE5M2, f)); }

float bf16_to_float(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}


bool reduce_symmetric(int datatype, int redop, const void* in, void* out, uint64_t count, int n,
                      const void* scalar, uint64_t exact_limit) {
  if (proto::datatype_size(datatype) == 0 || redop < 0 || redop >= proto::kNumRedops || n < 1) return false;
  if (count == 0) return true;
  if (redop == kMax || redop == kMin) {  // max/min of identical values
    if (in != out) memmove(out, in, count * proto::datatype_size(datatype));
    return true;
  }
  switch (datatype) {
    case 0: reduce_int<int8_t>(redop, in, out, count, n, scalar); break;
    case 1: reduce_int<uint8_t>(redop, in, out, count, n, scalar); break;
    case 2: reduce_int<int32_t>(redop, in, out, count, n, scalar); break;
    case 3: reduce_int<uint32_t>(redop, in, out, count, n, scalar); break;
    case 4: reduce_int<int64_t>(redop, in, out, count, n, scalar); break;
    case 5: reduce_int<uint64_t>(redop, in, out, count, n, scalar); break;
    case 6: reduce_float<F16, float>(redop, in, out, count, n, scalar, 0.0f, exact_limit); break;
    case 7: reduce_float<Plain<float>, float>(redop, in, out, count, n, scalar, 0.0f, exact_limit); break;
    case 8: reduce_float<Plain<double>, double>(redop, in, out, count, n, scalar, 0.0, exact_limit); break;
    case 9: reduce_float<BF16, float>(redop, in, out, count, n, scalar, 0.0f, exact_limit); break;
    case 10: reduce_float<E4M3, float>(redop, in, out, count, n, scalar, 448.0f, exact_limit); break;
    case 11: reduce_float<E5M2, float>(redop, in, out, count, n, scalar, 57344.0f, exact_limit); break;
  }
  return true;
}

}  // namespace fakegpu::fake

// For Python (fakegpu/native_numerics.py): the fake modes' symmetric reduction. 0 on success.
extern "C" __attribute__((visibility("default"))) int fakegpu_reduce_symmetric(
    int datatype, int redop, const void* in, void* out, uint64_t count, int n, const uint8_t* scalar,
    uint64_t exact_limit) {
  return fakegpu::fake::reduce_symmetric(datatype, redop, in, out, count, n, scalar, exact_limit) ? 0 : -1;
}
