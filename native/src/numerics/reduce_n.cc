#include "numerics/reduce_n.h"

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "generated/wire_spec.h"
#include "numerics/fake_numerics.h"

// Products feeding sums must round on their own, as numpy's do: no fused multiply-add.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
// -O2 (RelWithDebInfo) only vectorizes loops whose trip count is a multiple of the vector
// width; the block loops here need the ordinary (dynamic) cost model to vectorize at all.
#pragma GCC optimize("fp-contract=off", "vect-cost-model=dynamic")
#endif

namespace fakegpu::local {
namespace {

namespace num = fakegpu::fake;

enum { kSum = 0, kProd = 1, kMax = 2, kMin = 3, kAvg = 4, kPreMulSum = 5 };

// Elements per block: the accumulator block (at most 16 KiB) stays in L1 while every input
// is folded into it.
constexpr uint64_t kBlock = 2048;
// Inputs folded per pass over a block: each pass loads and stores the block once.
constexpr int kFirstPass = 4;
constexpr int kLaterPass = 3;

// ---- operators on the accumulator type -------------------------------------------------------
// Integers arrive here as their unsigned twins, so Add/Mul wrap without undefined behaviour.
struct AddOp {
  template <class A>
  static A apply(A a, A b) { return static_cast<A>(a + b); }
};
struct MulOp {
  template <class A>
  static A apply(A a, A b) { return static_cast<A>(a * b); }
};
// np.maximum / np.minimum (`a` the value so far, `b` the next rank's): a NaN so far stays (its
// payload wins), a NaN input replaces the value, and between equal values (+0 and -0) the
// input is taken — numpy's loops do exactly this (x86 maxps/minps plus a NaN blend).
struct MaxOp {
  template <class A>
  static A apply(A a, A b) { return a != a ? a : (a > b ? a : b); }
};
struct MinOp {
  template <class A>
  static A apply(A a, A b) { return a != a ? a : (a < b ? a : b); }
};

// ---- element codecs: storage type -> accumulator ---------------------------------------------
template <class T>
struct SameCodec {  // float32, float64 and the (unsigned twins of the) integers
  using Src = T;
  using Acc = T;
  T load(T v) const { return v; }
};

// Narrow floats widen through a table of every bit pattern (one load per element, and the
// conversions of fake_numerics run once per pattern rather than once per element).
template <class T>
struct TableCodec {
  using Src = T;
  using Acc = float;
  const float* table;
  float load(T v) const { return table[v]; }
};

// Each table is built on its type's first use (the float16 one takes about a millisecond) and
// never freed (no exit-order issues); function-local statics make the first use thread-safe.
template <size_t N>
struct Table {
  float v[N];
};

template <size_t N, class Fill>
const float* build_table(Fill fill) {
  auto* t = new Table<N>;
  for (uint32_t i = 0; i < N; i++) t->v[i] = fill(i);
  return t->v;
}

// float32 value of every bit pattern of a narrow type, built once, on first use.
template <class Bits, float (*Decode)(Bits)>
const float* decode_table() {
  static const float* table = build_table<(size_t{1} << (8 * sizeof(Bits)))>(
      [](uint32_t v) { return Decode(static_cast<Bits>(v)); });
  return table;
}
const float* f16_table() { return decode_table<uint16_t, num::half_to_float>(); }
const float* bf16_table() { return decode_table<uint16_t, num::bf16_to_float>(); }
const float* e4m3_table() { return decode_table<uint8_t, num::fp8e4m3_to_float>(); }
const float* e5m2_table() { return decode_table<uint8_t, num::fp8e5m2_to_float>(); }

// ---- float32 accumulator -> narrow storage, rounded once -------------------------------------
struct StoreF16 {
  static uint16_t store(float f) { return num::float_to_half(f); }
};
struct StoreBF16 {
  static uint16_t store(float f) { return num::float_to_bf16(f); }
};
struct StoreE4M3 {
  static uint8_t store(float f) { return num::float_to_fp8e4m3(f); }
};
struct StoreE5M2 {
  static uint8_t store(float f) { return num::float_to_fp8e5m2(f); }
};

// ---- the fold ----------------------------------------------------------------------------------
// One pass over a block: o = ((t(x0) op t(x1)) op t(x2)) op t(x3) for the first g (1..4)
// inputs, where t widens and, for PreMulSum, multiplies by the rank's scalar. The __restrict
// pointers (out never overlaps an input; inputs are only read) let the compiler vectorize.
// One input element in the accumulator type; for PreMulSum times its rank's scalar.
template <class Codec, bool kPremul>
inline typename Codec::Acc widen(const Codec& c, typename Codec::Src x, typename Codec::Acc s) {
  const typename Codec::Acc v = c.load(x);
  if constexpr (kPremul) return static_cast<typename Codec::Acc>(v * s);
  else return v;
}

template <class Codec, class Op, bool kPremul>
inline void first_pass(const Codec& c, int g, typename Codec::Acc* __restrict o,
                       const typename Codec::Src* __restrict x0, const typename Codec::Src* __restrict x1,
                       const typename Codec::Src* __restrict x2, const typename Codec::Src* __restrict x3,
                       size_t m, typename Codec::Acc s0, typename Codec::Acc s1, typename Codec::Acc s2,
                       typename Codec::Acc s3) {
  auto t = [&c](typename Codec::Src x, typename Codec::Acc s) { return widen<Codec, kPremul>(c, x, s); };
  switch (g) {
    case 1:
      for (size_t i = 0; i < m; i++) o[i] = t(x0[i], s0);
      break;
    case 2:
      for (size_t i = 0; i < m; i++) o[i] = Op::apply(t(x0[i], s0), t(x1[i], s1));
      break;
    case 3:
      for (size_t i = 0; i < m; i++) o[i] = Op::apply(Op::apply(t(x0[i], s0), t(x1[i], s1)), t(x2[i], s2));
      break;
    default:
      for (size_t i = 0; i < m; i++)
        o[i] = Op::apply(Op::apply(Op::apply(t(x0[i], s0), t(x1[i], s1)), t(x2[i], s2)), t(x3[i], s3));
      break;
  }
}

// A later pass: o = ((o op t(x0)) op t(x1)) op t(x2) for k (1..3) more inputs.
template <class Codec, class Op, bool kPremul>
inline void later_pass(const Codec& c, int k, typename Codec::Acc* __restrict o,
                       const typename Codec::Src* __restrict x0, const typename Codec::Src* __restrict x1,
                       const typename Codec::Src* __restrict x2, size_t m, typename Codec::Acc s0,
                       typename Codec::Acc s1, typename Codec::Acc s2) {
  auto t = [&c](typename Codec::Src x, typename Codec::Acc s) { return widen<Codec, kPremul>(c, x, s); };
  switch (k) {
    case 1:
      for (size_t i = 0; i < m; i++) o[i] = Op::apply(o[i], t(x0[i], s0));
      break;
    case 2:
      for (size_t i = 0; i < m; i++) o[i] = Op::apply(Op::apply(o[i], t(x0[i], s0)), t(x1[i], s1));
      break;
    default:
      for (size_t i = 0; i < m; i++)
        o[i] = Op::apply(Op::apply(Op::apply(o[i], t(x0[i], s0)), t(x1[i], s1)), t(x2[i], s2));
      break;
  }
}

// acc[0, m) = the rank-order fold of elements [b, b + m) of the n inputs.
template <class Codec, class Op, bool kPremul>
void fold_block(const Codec& c, const typename Codec::Src* const* in, int n, uint64_t b, size_t m,
                typename Codec::Acc* acc, const typename Codec::Acc* scalars) {
  using A = typename Codec::Acc;
  // Unused slots of a pass point at a real input (never read), so no pointer is out of range.
  auto x = [&](int r) { return in[r < n ? r : n - 1] + b; };
  auto s = [&](int r) -> A { return kPremul ? scalars[r < n ? r : n - 1] : A(1); };
  const int g = n < kFirstPass ? n : kFirstPass;
  first_pass<Codec, Op, kPremul>(c, g, acc, x(0), x(1), x(2), x(3), m, s(0), s(1), s(2), s(3));
  for (int r = g; r < n; r += kLaterPass) {
    const int k = n - r < kLaterPass ? n - r : kLaterPass;
    later_pass<Codec, Op, kPremul>(c, k, acc, x(r), x(r + 1), x(r + 2), m, s(r), s(r + 1), s(r + 2));
  }
}

// Calls f(Op{}, premul) with the operator that folds `redop` (Avg folds a sum, PreMulSum a sum
// of scaled terms).
template <class F>
void with_op(int redop, F&& f) {
  switch (redop) {
    case kProd: f(MulOp{}, std::false_type{}); break;
    case kMax: f(MaxOp{}, std::false_type{}); break;
    case kMin: f(MinOp{}, std::false_type{}); break;
    case kPreMulSum: f(AddOp{}, std::true_type{}); break;
    default: f(AddOp{}, std::false_type{}); break;  // Sum, Avg
  }
}

// Rank r's PreMulSum scalar as a storage value (left-aligned in its 8 bytes).
template <class S>
S raw_scalar(const uint8_t (*scalars)[8], int r) {
  S v;
  memcpy(&v, scalars[r], sizeof(S));
  return v;
}

// The scalars converted to the accumulator: a few on the stack, more on the heap.
template <class A>
class Scalars {
 public:
  template <class Codec>
  Scalars(const Codec& c, const uint8_t (*raw)[8], int n, bool needed) {
    if (!needed) return;
    if (n > kInline) heap_.resize(n);
    A* dst = data();
    for (int r = 0; r < n; r++) dst[r] = c.load(raw_scalar<typename Codec::Src>(raw, r));
  }
  const A* data() const { return heap_.empty() ? inline_ : heap_.data(); }

 private:
  A* data() { return heap_.empty() ? inline_ : heap_.data(); }
  static constexpr int kInline = 64;
  A inline_[kInline];  // filled by the constructor when PreMulSum needs it
  std::vector<A> heap_;
};

// float32 and float64: the output block is the accumulator.
template <class T>
void reduce_same_float(int redop, const void* const* inputs, int n, void* out_v, uint64_t count,
                       const uint8_t (*scalars)[8]) {
  const SameCodec<T> c;
  const T* const* in = reinterpret_cast<const T* const*>(inputs);
  T* out = static_cast<T*>(out_v);
  const Scalars<T> s(c, scalars, n, redop == kPreMulSum);
  const T divisor = static_cast<T>(n);
  with_op(redop, [&](auto op, auto premul) {
    using Op = decltype(op);
    for (uint64_t b = 0; b < count; b += kBlock) {
      const size_t m = static_cast<size_t>(count - b < kBlock ? count - b : kBlock);
      T* __restrict o = out + b;
      fold_block<SameCodec<T>, Op, decltype(premul)::value>(c, in, n, b, m, o, s.data());
      if (redop == kAvg)  // in the type itself, like np.divide(out, T(n))
        for (size_t i = 0; i < m; i++) o[i] = o[i] / divisor;
    }
  });
}

// Integers: Sum/Prod/PreMulSum/Avg fold in the unsigned twin (wrapping), Max/Min in the type.
template <class T>
void reduce_int(int redop, const void* const* inputs, int n, void* out_v, uint64_t count,
                const uint8_t (*scalars)[8]) {
  using U = std::make_unsigned_t<T>;
  if (redop == kMax || redop == kMin) {
    const SameCodec<T> c;
    const T* const* in = reinterpret_cast<const T* const*>(inputs);
    T* out = static_cast<T*>(out_v);
    for (uint64_t b = 0; b < count; b += kBlock) {
      const size_t m = static_cast<size_t>(count - b < kBlock ? count - b : kBlock);
      if (redop == kMax) fold_block<SameCodec<T>, MaxOp, false>(c, in, n, b, m, out + b, nullptr);
      else fold_block<SameCodec<T>, MinOp, false>(c, in, n, b, m, out + b, nullptr);
    }
    return;
  }
  const SameCodec<U> c;
  const U* const* in = reinterpret_cast<const U* const*>(inputs);
  U* out = static_cast<U*>(out_v);
  const Scalars<U> s(c, scalars, n, redop == kPreMulSum);
  // n beyond the type's range: |x| < n for every value, so the truncated quotient is 0, except
  // that n = 2^(bits-1) (not representable in a signed type) gives -1 for the minimum.
  const uint64_t magnitude_limit = std::is_signed<T>::value
                                       ? static_cast<uint64_t>(std::numeric_limits<T>::max()) + 1
                                       : static_cast<uint64_t>(std::numeric_limits<T>::max());
  const bool avg_is_zero = static_cast<uint64_t>(n) > magnitude_limit;
  const bool avg_is_sign = std::is_signed<T>::value && static_cast<uint64_t>(n) == magnitude_limit;
  with_op(redop, [&](auto op, auto premul) {
    using Op = decltype(op);
    for (uint64_t b = 0; b < count; b += kBlock) {
      const size_t m = static_cast<size_t>(count - b < kBlock ? count - b : kBlock);
      U* __restrict o = out + b;
      fold_block<SameCodec<U>, Op, decltype(premul)::value>(c, in, n, b, m, o, s.data());
      if (redop != kAvg) continue;
      if (avg_is_zero) {
        for (size_t i = 0; i < m; i++) o[i] = 0;
      } else if (avg_is_sign) {
        for (size_t i = 0; i < m; i++)
          o[i] = static_cast<T>(o[i]) == std::numeric_limits<T>::min() ? static_cast<U>(-1) : static_cast<U>(0);
      } else {
        const T divisor = static_cast<T>(n);
        for (size_t i = 0; i < m; i++)  // the wrapped sum, divided with C's truncation toward zero
          o[i] = static_cast<U>(static_cast<T>(static_cast<T>(o[i]) / divisor));
      }
    }
  });
}

// float16, bfloat16 and the float8 types: fold into a float32 block, round once.
template <class T, class Store>
void reduce_narrow(const float* table, float saturate, int redop, const void* const* inputs, int n,
                   void* out_v, uint64_t count, const uint8_t (*scalars)[8]) {
  const TableCodec<T> c{table};
  const T* const* in = reinterpret_cast<const T* const*>(inputs);
  T* out = static_cast<T*>(out_v);
  const Scalars<float> s(c, scalars, n, redop == kPreMulSum);
  const float divisor = static_cast<float>(n);
  float acc[kBlock];
  with_op(redop, [&](auto op, auto premul) {
    using Op = decltype(op);
    for (uint64_t b = 0; b < count; b += kBlock) {
      const size_t m = static_cast<size_t>(count - b < kBlock ? count - b : kBlock);
      fold_block<TableCodec<T>, Op, decltype(premul)::value>(c, in, n, b, m, acc, s.data());
      if (redop == kAvg)
        for (size_t i = 0; i < m; i++) acc[i] = acc[i] / divisor;
      if (saturate > 0) {  // np.clip(acc, -max, max): NaN stays NaN, -0 stays -0
        for (size_t i = 0; i < m; i++) {
          const float a = acc[i];
          acc[i] = a > saturate ? saturate : (a < -saturate ? -saturate : a);
        }
      }
      T* o = out + b;
      for (size_t i = 0; i < m; i++) o[i] = Store::store(acc[i]);
    }
  });
}

}  // namespace

bool reduce_n(int datatype, int redop, const void* const* inputs, int n, void* out, uint64_t count,
              const uint8_t (*scalars)[8]) {
  if (datatype < 0 || datatype > 11 || redop < kSum || redop > kPreMulSum || n < 1) return false;
  if (redop == kPreMulSum && scalars == nullptr) return false;
  if (count == 0) return true;
  switch (datatype) {
    case 0: reduce_int<int8_t>(redop, inputs, n, out, count, scalars); break;
    case 1: reduce_int<uint8_t>(redop, inputs, n, out, count, scalars); break;
    case 2: reduce_int<int32_t>(redop, inputs, n, out, count, scalars); break;
    case 3: reduce_int<uint32_t>(redop, inputs, n, out, count, scalars); break;
    case 4: reduce_int<int64_t>(redop, inputs, n, out, count, scalars); break;
    case 5: reduce_int<uint64_t>(redop, inputs, n, out, count, scalars); break;
    case 6:
      reduce_narrow<uint16_t, StoreF16>(f16_table(), 0.0f, redop, inputs, n, out, count, scalars);
      break;
    case 7: reduce_same_float<float>(redop, inputs, n, out, count, scalars); break;
    case 8: reduce_same_float<double>(redop, inputs, n, out, count, scalars); break;
    case 9:
      reduce_narrow<uint16_t, StoreBF16>(bf16_table(), 0.0f, redop, inputs, n, out, count, scalars);
      break;
    case 10:  // saturate to ml_dtypes.finfo(float8_e4m3fn).max, like numerics.py
      reduce_narrow<uint8_t, StoreE4M3>(e4m3_table(), 448.0f, redop, inputs, n, out, count, scalars);
      break;
    case 11:  // ... and float8_e5m2's
      reduce_narrow<uint8_t, StoreE5M2>(e5m2_table(), 57344.0f, redop, inputs, n, out, count, scalars);
      break;
  }
  return true;
}

namespace {

uint64_t ceil_div(uint64_t a, uint64_t b) { return (a + b - 1) / b; }
uint64_t round_up(uint64_t a, uint64_t m) { return ceil_div(a, m) * m; }

constexpr uint64_t kGlooMaxSegmentBytes = 1 << 20;  // gloo's default maxSegmentSize

// One gloo step for the half types: the float32 result rounded to the type and widened again.
template <class Store>
inline float round_half(const float* table, float v) { return table[Store::store(v)]; }
// bfloat16's rounding without the table (float_to_bf16 kept in float32 bits: the same value,
// NaN included), so the loop vectorizes: about 3x faster than the table for 4 ranks.
template <>
inline float round_half<StoreBF16>(const float*, float v) {
  uint32_t b;
  memcpy(&b, &v, 4);
  b = (b & 0x7fffffffu) > 0x7f800000u ? ((b & 0x80000000u) | 0x7fc00000u) : ((b + 0x7fffu + ((b >> 16) & 1)) & 0xffff0000u);
  memcpy(&v, &b, 4);
  return v;
}

// float16 / bfloat16 Sum, Prod or Avg folded in the given input order, every step rounded.
template <class Store>
void fold_half_stepwise(const float* table, int redop, const uint16_t* const* in, int n, uint16_t* out,
                        uint64_t count) {
  float acc[kBlock];
  const float divisor = static_cast<float>(n);
  for (uint64_t b = 0; b < count; b += kBlock) {
    const size_t m = static_cast<size_t>(count - b < kBlock ? count - b : kBlock);
    const uint16_t* x0 = in[0] + b;
    for (size_t i = 0; i < m; i++) acc[i] = table[x0[i]];
    for (int r = 1; r < n; r++) {
      const uint16_t* x = in[r] + b;
      if (redop == kProd)
        for (size_t i = 0; i < m; i++) acc[i] = round_half<Store>(table, acc[i] * table[x[i]]);
      else
        for (size_t i = 0; i < m; i++) acc[i] = round_half<Store>(table, acc[i] + table[x[i]]);
    }
    if (redop == kAvg)  // gloo's AVG: the (rounded) sum divided by n in float32, rounded again
      for (size_t i = 0; i < m; i++) acc[i] = acc[i] / divisor;
    uint16_t* o = out + b;
    for (size_t i = 0; i < m; i++) o[i] = Store::store(acc[i]);
  }
}

}  // namespace

uint64_t gloo_chunk_elements(int plan, int n, uint64_t count, uint64_t elem_size) {
  if (count == 0 || elem_size == 0) return 0;
  if (n <= 1) return count;
  const uint64_t world = static_cast<uint64_t>(n), total = count * elem_size;
  const uint64_t max_seg = elem_size * std::max<uint64_t>(1, kGlooMaxSegmentBytes / elem_size);
  uint64_t nseg, seg;
  if (plan == kPlanGlooReduce) {
    seg = round_up(std::min(ceil_div(total, 2 * world), max_seg), elem_size);
    nseg = round_up(std::max(ceil_div(total, seg), 2 * world), world);
  } else {
    nseg = round_up(std::max(ceil_div(total, max_seg), 2 * world), world);
    seg = round_up(ceil_div(total, nseg), elem_size);
  }
  return (nseg / world) * seg / elem_size;
}

bool reduce_n_planned(int datatype, int redop, int plan, const void* const* inputs, int n, void* out,
                      uint64_t count, const uint8_t (*scalars)[8], uint64_t first, uint64_t plan_count) {
  if (plan < kPlanRank || plan > kPlanGlooReduce) return false;
  if (plan == kPlanRank || n <= 1) return reduce_n(datatype, redop, inputs, n, out, count, scalars);
  const uint64_t s = proto::datatype_size(datatype);  // 0: no datatype
  if (s == 0 || redop < kSum || redop > kPreMulSum) return false;
  if (redop == kPreMulSum && scalars == nullptr) return false;
  if (count == 0) return true;
  if (first + count > plan_count) return false;
  const uint64_t chunk = gloo_chunk_elements(plan, n, plan_count, s);
  const bool stepwise = (datatype == 6 || datatype == 9) && (redop == kSum || redop == kProd || redop == kAvg);
  thread_local std::vector<const void*> order;
  thread_local std::vector<std::array<uint8_t, 8>> scal;
  order.resize(n);
  scal.resize(n);
  auto* o = static_cast<uint8_t*>(out);
  for (uint64_t pos = 0; pos < count;) {
    const uint64_t g = first + pos, c = g / chunk;
    const uint64_t m = std::min((c + 1) * chunk, first + count) - g;
    // Chunk c: ranks c-1, c-2, ..., c (mod n). Float addition and multiplication commute, so
    // folding ((x[c-1] op x[c-2]) op ...) equals gloo's x[c] op (... op x[c-1]) bit for bit.
    for (int k = 0; k < n; k++) {
      const int r = static_cast<int>(((c % n) + 2 * static_cast<uint64_t>(n) - 1 - k) % n);
      order[k] = static_cast<const uint8_t*>(inputs[r]) + pos * s;
      if (scalars) memcpy(scal[k].data(), scalars[r], 8);
    }
    if (stepwise) {
      const auto* const* in = reinterpret_cast<const uint16_t* const*>(order.data());
      auto* dst = reinterpret_cast<uint16_t*>(o + pos * s);
      if (datatype == 6) fold_half_stepwise<StoreF16>(f16_table(), redop, in, n, dst, m);
      else fold_half_stepwise<StoreBF16>(bf16_table(), redop, in, n, dst, m);
    } else {
      const auto* rows = scalars ? reinterpret_cast<const uint8_t(*)[8]>(scal.data()) : nullptr;
      reduce_n(datatype, redop, order.data(), n, o + pos * s, m, rows);
    }
    pos += m;
  }
  return true;
}

}  // namespace fakegpu::local

// For Python (fakegpu/native_numerics.py: the coordinator's and the Python fake mode's reductions):
// reduce_n through the C ABI. `scalars` holds n 8-byte scalars (PreMulSum) or is NULL. 0 on
// success, -1 for arguments reduce_n refuses.
extern "C" __attribute__((visibility("default"))) int fakegpu_reduce_n(
    int datatype, int redop, const void* const* inputs, int n, void* out, uint64_t count,
    const uint8_t* scalars) {
  const auto* rows = reinterpret_cast<const uint8_t(*)[8]>(scalars);
  return fakegpu::local::reduce_n(datatype, redop, inputs, n, out, count, rows) ? 0 : -1;
}

// reduce_n_planned through the C ABI (plan: 0 rank order, 1 gloo all-reduce, 2 gloo reduce).
extern "C" __attribute__((visibility("default"))) int fakegpu_reduce_n_planned(
    int datatype, int redop, int plan, const void* const* inputs, int n, void* out, uint64_t count,
    const uint8_t* scalars, uint64_t first, uint64_t plan_count) {
  const auto* rows = reinterpret_cast<const uint8_t(*)[8]>(scalars);
  return fakegpu::local::reduce_n_planned(datatype, redop, plan, inputs, n, out, count, rows, first, plan_count)
             ? 0 : -1;
}

// gloo_chunk_elements through the C ABI (tests compare it with tests/helpers/gloo_order.py).
extern "C" __attribute__((visibility("default"))) uint64_t fakegpu_gloo_chunk_elements(
    int plan, int n, uint64_t count, uint64_t elem_size) {
  return fakegpu::local::gloo_chunk_elements(plan, n, count, elem_size);
}
