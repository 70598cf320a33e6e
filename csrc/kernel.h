// The single-pass kernel, compiled once per instruction set: kernel_default.cpp, kernel_avx2.cpp
// and kernel_avx512.cpp include this file with different CPU_CAPABILITY macros and flags.
//
// Everything sits in the namespace CPU_CAPABILITY (as at::vec does), so the builds never share
// a symbol, and nothing here is a non-trivial global: a global's initializer would run with
// AVX instructions at load time, before any CPU check (ATen's note "Do not compile
// initializers with AVX").
#pragma once

#ifndef CPU_CAPABILITY
#error "define CPU_CAPABILITY (DEFAULT, AVX2, AVX512) before including kernel.h"
#endif

#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "stats.h"

namespace overflow_fast {
namespace CPU_CAPABILITY {

using at::vec::Vectorized;

// How a kind's elements are read. Floats are classified on their key, the bits of |x|, whose
// order is the order of the magnitudes:
// - Float: IEEE-like, +-inf at inf's bits, NaN above;
// - FloatNoInf (e4m3fn): no inf; NaN is the all-ones magnitude, the keys above nan_above;
// - FloatNuz (e4m3fnuz, e5m2fnuz, on unsigned lanes): no inf and no -0; the one NaN is the sign
//   bit alone, whose abs bits (0) would read as a zero, so its key is all ones instead: above
//   every magnitude, then classified as FloatNoInf's;
// - Exponent (e8m0fnu, unsigned lanes): no sign, no zero, no subnormal, no inf; the byte is the
//   key (2^(x-127)), 0xFF the NaN above nan_above.
enum class Mode { Float, FloatNoInf, FloatNuz, Exponent, Signed, Unsigned8 };

template <Mode M>
constexpr bool kFloatMode = M == Mode::Float || M == Mode::FloatNoInf || M == Mode::FloatNuz ||
                            M == Mode::Exponent;

// The per-kind constants, as lane integers. For floats: the sign-clearing mask, the key of inf
// (anything above is NaN; with no inf, the largest finite key), the bits of +inf/-inf, the key of
// the smallest normal, and FloatNuz's NaN pattern.
template <typename L>
struct Consts {
  L abs_mask = 0;
  L nan_above = 0;
  L pos_inf = 0;
  L neg_inf = 0;
  L tiny = 0;
  L nan_bits = 0;
};

// The key of a float element (see Mode).
template <typename L, Mode M>
inline L float_key(L x, const Consts<L>& c) {
  if constexpr (M == Mode::Exponent) {
    return x;
  } else if constexpr (M == Mode::FloatNuz) {
    // all ones or'ed in on the NaN pattern; as a select (?:) GCC 12 left the loop unvectorised
    // (2.5x the time of e4m3fn's in the baseline build)
    return static_cast<L>((x & c.abs_mask) | -static_cast<L>(x == c.nan_bits));
  } else {
    return static_cast<L>(x & c.abs_mask);
  }
}

// The scalar loop: the tail of each run (fewer elements than a vector), and the whole run in the
// baseline build, where at::vec's generic Vectorized (a loop per operation, a memset per compare)
// is slower than a plain loop that the compiler vectorises with the baseline SSE2.
// Accumulators are locals, so that the compiler may keep them in registers.
template <typename L, Mode M>
inline void scan_scalar(const L* p, int64_t n, const Consts<L>& c, Partial& acc) {
  using U = std::make_unsigned_t<L>;
  int64_t nan = 0, posinf = 0, neginf = 0, zero = 0, small = 0;
  L kmin = std::numeric_limits<L>::max();
  L kmax = std::numeric_limits<L>::lowest();
  for (int64_t i = 0; i < n; i++) {
    const L x = p[i];
    L k;
    if constexpr (kFloatMode<M>) {
      k = float_key<L, M>(x, c);
      nan += k > c.nan_above;
      if constexpr (M == Mode::Float) {
        posinf += x == c.pos_inf;
        neginf += x == c.neg_inf;
      }
      if constexpr (M != Mode::Exponent) {  // its key 0 is 2^-127, not a zero
        zero += k == 0;
        small += k < c.tiny;
      }
    } else if constexpr (M == Mode::Signed) {
      // -|x| in unsigned arithmetic, so the most negative value maps onto itself without UB
      const L neg = static_cast<L>(U(0) - static_cast<U>(x));
      k = x < neg ? x : neg;
      zero += x == 0;
    } else {
      k = static_cast<L>(x ^ static_cast<L>(0x80));
      zero += x == 0;
    }
    kmin = k < kmin ? k : kmin;
    kmax = k > kmax ? k : kmax;
  }
  if (n > 0) {
    acc.kmin = std::min<int64_t>(acc.kmin, kmin);
    acc.kmax = std::max<int64_t>(acc.kmax, kmax);
  }
  acc.nan += nan;
  acc.posinf += posinf;
  acc.neginf += neginf;
  acc.zero += zero;
  acc.small += small;
}

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)

template <typename L>
inline int64_t lane_sum(const Vectorized<L>& v) {
  __at_align__ L buf[Vectorized<L>::size()];
  v.store(buf);
  int64_t s = 0;
  for (int64_t i = 0; i < Vectorized<L>::size(); i++) {
    s += buf[i];
  }
  return s;
}

template <typename L>
inline L lane_max(const Vectorized<L>& v) {
  __at_align__ L buf[Vectorized<L>::size()];
  v.store(buf);
  return *std::max_element(buf, buf + Vectorized<L>::size());
}

template <typename L>
inline L lane_min(const Vectorized<L>& v) {
  __at_align__ L buf[Vectorized<L>::size()];
  v.store(buf);
  return *std::min_element(buf, buf + Vectorized<L>::size());
}

// Whether any lane of a compare's result (all ones or all zeros per lane) is set: one
// instruction or two, where a reduction over the lanes (lane_min) takes a dozen.
template <typename L>
inline bool any_lane(const Vectorized<L>& mask) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i m = mask;
  return _mm512_test_epi64_mask(m, m) != 0;
#else
  return _mm256_movemask_epi8(mask) != 0;
#endif
}

// GCC 12 keeps each running value of these loops (a min, a max, a counter) in two registers and
// copies one into the other on every step: a vmovdqa per running value, which in a light loop
// took a fifth to a quarter of the time (AMD EPYC Zen3: fp32 ReLU 5.1 -> 3.9 us per 256 KB). An
// empty asm statement that takes the values in registers and gives them back makes the compiler
// update them in place; it emits no instruction. On AVX-512 the same: the keys-only loop of
// 16-bit lanes held four copies beside its four min/max, one with this; "x" (registers 0-15)
// left fewer copies there than "v" (all 32).
#if defined(CPU_CAPABILITY_AVX2)
using VecReg = __m256i;
#elif defined(CPU_CAPABILITY_AVX512)
using VecReg = __m512i;
#endif

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
inline void in_register(VecReg& v) { __asm__("" : "+x"(v)); }

template <typename L>
inline void in_register(Vectorized<L>& v) {
  VecReg r = v;
  in_register(r);
  v = r;
}
#endif

template <typename... T>
inline void in_registers([[maybe_unused]] T&... v) {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  (in_register(v), ...);
#endif
}

// Per-lane counters are as narrow as the elements (a compare gives -1 per matching lane, so
// subtracting it counts), so they move into int64 after this many vectors, before an 8-bit
// lane can overflow.
template <typename L>
constexpr int64_t kCountVectors = sizeof(L) == 1 ? 127 : 1024;

// How far ahead of the loads the heavier loops (64-bit lanes: a compare and a blend per min or
// max on AVX2; the counting loops) ask for cache lines (bytes). Out of cache such a loop keeps
// fewer loads in flight than x.sum()'s (the out-of-order window fills with ALU work), and the
// hardware prefetcher alone does not hide the latency; a prefetch per 64-byte line 1 KB ahead
// does (AMD EPYC Zen3, one thread, 64 MB: int64 / fp64 / fp32 ReLU 0.86-0.93x of their time
// without, at 2 KB). Since the loops update their values in place (in_registers) they run
// faster, and 1 KB ahead beats 2 KB out of cache (fp64 0.90-0.94x, int64 0.95x of the time;
// 1.5 KB and more were slower again). The light keys-only loop of 8-32-bit lanes (and, min,
// max) was slower with it (fp32, bf16: ~1.1x), so it has none. Past the end of the data a
// prefetch is harmless (it never faults).
#ifndef OVERFLOW_FAST_PREFETCH_BYTES
#define OVERFLOW_FAST_PREFETCH_BYTES 1024
#endif
constexpr int64_t kPrefetchBytes = OVERFLOW_FAST_PREFETCH_BYTES;

// Prefetches the lines of `bytes` bytes starting kPrefetchBytes past p, one per 64-byte line.
template <int64_t bytes>
inline void prefetch_ahead(const void* p) {
  if constexpr (kPrefetchBytes > 0) {
    for (int64_t off = 0; off < bytes; off += 64) {
      _mm_prefetch(static_cast<const char*>(p) + kPrefetchBytes + off, _MM_HINT_T0);
    }
  }
}

// The vectors of constants a pass needs, built once per call.
template <typename L>
struct VConsts {
  Vectorized<L> abs_mask, tiny, zero, flip, nan_bits;
  explicit VConsts(const Consts<L>& c)
      : abs_mask(c.abs_mask), tiny(c.tiny), zero(L(0)), flip(static_cast<L>(0x80)), nan_bits(c.nan_bits) {}
};

// The keys of a vector of float elements (see Mode): an and (FloatNuz: a compare and an or more).
template <typename L, Mode M>
inline Vectorized<L> float_key(const Vectorized<L>& x, const VConsts<L>& v) {
  if constexpr (M == Mode::Exponent) {
    return x;
  } else if constexpr (M == Mode::FloatNuz) {
    return (x & v.abs_mask) | (x == v.nan_bits);  // the compare's all ones on the NaN pattern
  } else {
    return x & v.abs_mask;
  }
}

// The key of each lane: abs bits (floats), -|x| (signed; the most negative value wraps onto
// itself) or x^0x80 (uint8/bool).
template <typename L, Mode M>
inline Vectorized<L> key_of(const Vectorized<L>& x, const VConsts<L>& v) {
  if constexpr (kFloatMode<M>) {
    return float_key<L, M>(x, v);
  } else if constexpr (M == Mode::Signed) {
#if defined(CPU_CAPABILITY_AVX2)
    if constexpr (sizeof(L) == 8) {
      // AVX2 has no 64-bit min (at::vec's is a compare and a blend): x where x < 0, else -x,
      // picked by one blend on each lane's sign bit (blendv_pd reads only the top bit of a
      // lane), no compare. -x wraps for the most negative value, whose sign picks x itself.
      const __m256d neg = _mm256_castsi256_pd(_mm256_sub_epi64(v.zero, x));
      const __m256d xd = _mm256_castsi256_pd(x);
      return _mm256_castpd_si256(_mm256_blendv_pd(neg, xd, xd));
    } else {
      return at::vec::minimum(x, v.zero - x);
    }
#else
    return at::vec::minimum(x, v.zero - x);
#endif
  } else {
    return x ^ v.flip;
  }
}

// Adds the lane counts of zeros and of |x| < smallest normal (floats only) in x to the counters.
template <typename L, Mode M>
inline void count_lanes(const Vectorized<L>& x, const VConsts<L>& v, Vectorized<L>& zeros,
                        Vectorized<L>& smalls) {
  if constexpr (kFloatMode<M>) {
    const Vectorized<L> k = float_key<L, M>(x, v);
    zeros = zeros - (k == v.zero);
    smalls = smalls - (v.tiny > k);
  } else {
    zeros = zeros - (x == v.zero);
  }
}

template <typename L>
inline void add_counts(const Vectorized<L>& zeros, const Vectorized<L>& smalls, Partial& acc) {
  acc.zero += lane_sum(zeros);
  acc.small += lane_sum(smalls);  // stays 0 for integers
}

// Keys' min and max per lane over n whole-vector elements, nothing else: the common pass.
// Two vectors per step with their own min/max, so that the dependency of a running min (one
// cycle; two for 64-bit lanes on AVX2, a compare then a blend) does not limit the loop. The
// running values are locals, never the caller's vectors through the references: a load from
// p may alias a vector in memory, so the compiler would store the references' vectors back
// on every step.
template <typename L, Mode M>
inline void keys_only(const L* p, int64_t n, const VConsts<L>& v, Vectorized<L>& bmin,
                      Vectorized<L>& bmax) {
  using V = Vectorized<L>;
  constexpr int64_t W = V::size();
  V min0 = bmin, max0 = bmax, min1 = bmin, max1 = bmax;
  int64_t i = 0;
  if constexpr (sizeof(L) == 8) {
    V min2 = bmin, max2 = bmax, min3 = bmin, max3 = bmax;
    for (; i + 4 * W <= n; i += 4 * W) {
      prefetch_ahead<4 * W * sizeof(L)>(p + i);
      const V k0 = key_of<L, M>(V::loadu(p + i), v);
      const V k1 = key_of<L, M>(V::loadu(p + i + W), v);
      const V k2 = key_of<L, M>(V::loadu(p + i + 2 * W), v);
      const V k3 = key_of<L, M>(V::loadu(p + i + 3 * W), v);
      min0 = at::vec::minimum(min0, k0);
      max0 = at::vec::maximum(max0, k0);
      min1 = at::vec::minimum(min1, k1);
      max1 = at::vec::maximum(max1, k1);
      min2 = at::vec::minimum(min2, k2);
      max2 = at::vec::maximum(max2, k2);
      min3 = at::vec::minimum(min3, k3);
      max3 = at::vec::maximum(max3, k3);
      in_registers(min0, max0, min1, max1, min2, max2, min3, max3);
    }
    min0 = at::vec::minimum(min0, min2);
    max0 = at::vec::maximum(max0, max2);
    min1 = at::vec::minimum(min1, min3);
    max1 = at::vec::maximum(max1, max3);
  }
  for (; i + 2 * W <= n; i += 2 * W) {
    const V k0 = key_of<L, M>(V::loadu(p + i), v);
    const V k1 = key_of<L, M>(V::loadu(p + i + W), v);
    min0 = at::vec::minimum(min0, k0);
    max0 = at::vec::maximum(max0, k0);
    min1 = at::vec::minimum(min1, k1);
    max1 = at::vec::maximum(max1, k1);
    in_registers(min0, max0, min1, max1);
  }
  if (i < n) {
    const V k = key_of<L, M>(V::loadu(p + i), v);
    min1 = at::vec::minimum(min1, k);
    max1 = at::vec::maximum(max1, k);
  }
  bmin = at::vec::minimum(min0, min1);
  bmax = at::vec::maximum(max0, max1);
}

// The zero/small counts alone: the second read of a block found to hold some.
template <typename L, Mode M>
void count_small(const L* p, int64_t n, const VConsts<L>& v, Partial& acc) {
  using V = Vectorized<L>;
  constexpr int64_t W = V::size();
  for (int64_t begin = 0; begin < n; begin += kCountVectors<L> * W) {
    const int64_t end = std::min(n, begin + kCountVectors<L> * W);
    V zeros(L(0)), smalls(L(0));
    for (int64_t i = begin; i < end; i += W) {
      count_lanes<L, M>(V::loadu(p + i), v, zeros, smalls);
      in_registers(zeros, smalls);
    }
    add_counts(zeros, smalls, acc);
  }
}

// Keys' min and max and the zero count in one read, for integers: for a block that follows one
// that held zeros (every block of an int8 tensor over its whole range does), where a second
// read would cost more than counting as it goes. Two vectors per step, each with its own
// min/max, one counter (locals, as in keys_only); the counter moves into acc after
// kCountVectors<L> vectors, before a lane can overflow.
template <typename L, Mode M>
inline void keys_and_zeros(const L* p, int64_t n, const VConsts<L>& v, Vectorized<L>& bmin,
                           Vectorized<L>& bmax, Partial& acc) {
  using V = Vectorized<L>;
  constexpr int64_t W = V::size();
  V min0 = bmin, max0 = bmax, min1 = bmin, max1 = bmax;
  for (int64_t begin = 0; begin < n; begin += kCountVectors<L> * W) {
    const int64_t end = std::min(n, begin + kCountVectors<L> * W);
    V zeros(L(0));
    int64_t i = begin;
    for (; i + 2 * W <= end; i += 2 * W) {
      prefetch_ahead<2 * W * sizeof(L)>(p + i);
      const V x0 = V::loadu(p + i);
      const V x1 = V::loadu(p + i + W);
      const V k0 = key_of<L, M>(x0, v);
      const V k1 = key_of<L, M>(x1, v);
      min0 = at::vec::minimum(min0, k0);
      max0 = at::vec::maximum(max0, k0);
      min1 = at::vec::minimum(min1, k1);
      max1 = at::vec::maximum(max1, k1);
      zeros = zeros - (x0 == v.zero);
      zeros = zeros - (x1 == v.zero);
      in_registers(min0, max0, min1, max1, zeros);
    }
    if (i < end) {
      const V x = V::loadu(p + i);
      const V k = key_of<L, M>(x, v);
      min1 = at::vec::minimum(min1, k);
      max1 = at::vec::maximum(max1, k);
      zeros = zeros - (x == v.zero);
    }
    acc.zero += lane_sum(zeros);
  }
  bmin = at::vec::minimum(min0, min1);
  bmax = at::vec::maximum(max0, max1);
}

// The same for floats, with one count instead of two: per vector the abs bits k, their max,
// the count of k < smallest normal ("smalls", zeros included), and the min of k + L's max
// (wrapping), which orders the nonzero keys as they are (1 -> lowest, ...) and zero above
// every other: its min, less L's max, is the smallest nonzero key of each lane (0 in a lane
// of zeros only). A block with no subnormal (no nonzero key below the smallest normal, the
// common case: ReLU outputs) holds as many zeros as smalls, and its smallest key is 0 if it
// holds any, else the smallest nonzero one; only a block with a subnormal is read again to
// count its zeros. Per vector: and, add, min, max, compare, subtract (the zero count took a
// compare, a subtract and a min of its own).
template <typename L, Mode M>
inline void keys_and_smalls(const L* p, int64_t n, const VConsts<L>& v, Vectorized<L>& bmin,
                            Vectorized<L>& bmax, Partial& acc) {
  using V = Vectorized<L>;
  constexpr int64_t W = V::size();
  const V top(std::numeric_limits<L>::max());
  V nz0 = top, nz1 = top, max0 = bmax, max1 = bmax;
  int64_t smalls = 0;
  for (int64_t begin = 0; begin < n; begin += kCountVectors<L> * W) {
    const int64_t end = std::min(n, begin + kCountVectors<L> * W);
    V small0(L(0)), small1(L(0));
    int64_t i = begin;
    for (; i + 2 * W <= end; i += 2 * W) {
      prefetch_ahead<2 * W * sizeof(L)>(p + i);
      const V k0 = float_key<L, M>(V::loadu(p + i), v);
      const V k1 = float_key<L, M>(V::loadu(p + i + W), v);
      nz0 = at::vec::minimum(nz0, k0 + top);
      max0 = at::vec::maximum(max0, k0);
      small0 = small0 - (v.tiny > k0);
      nz1 = at::vec::minimum(nz1, k1 + top);
      max1 = at::vec::maximum(max1, k1);
      small1 = small1 - (v.tiny > k1);
      in_registers(nz0, max0, small0, nz1, max1, small1);
    }
    if (i < end) {
      const V k = float_key<L, M>(V::loadu(p + i), v);
      nz1 = at::vec::minimum(nz1, k + top);
      max1 = at::vec::maximum(max1, k);
      small1 = small1 - (v.tiny > k);
    }
    smalls += lane_sum(small0) + lane_sum(small1);
  }
  // the smallest nonzero key per lane (0 where a lane held zeros only)
  const V nz = at::vec::minimum(nz0, nz1) - top;
  int64_t zeros = smalls;
  if (any_lane((nz > v.zero) & (v.tiny > nz))) {
    Partial counts;  // a subnormal: count the zeros apart
    count_small<L, M>(p, n, v, counts);
    zeros = counts.zero;
  }
  acc.small += smalls;
  acc.zero += zeros;
  bmin = zeros > 0 ? v.zero : nz;
  bmax = at::vec::maximum(max0, max1);
}

#if defined(CPU_CAPABILITY_AVX2)
// keys_and_smalls for float32 on AVX2, in 5 vector ops per vector instead of 6 (in cache about
// 0.8x the time, AMD EPYC Zen3), on y = k - 1, which maps a zero to -1 (all ones) and every other
// key k to k - 1 >= 0: y's sign bits count the zeros (two vectors' packed with signed saturation
// into one movemask: -1 stays -1, the rest become 0x7FFF, whose high byte's sign is clear; the
// count is a popcount on the scalar side, which has ALUs to spare); the unsigned min of y is the
// smallest nonzero key - 1 (zeros are its largest values), below tiny - 1 exactly where a
// subnormal is; the signed max of y + 1 is the largest key. Per vector: and, subtract, min,
// max, and half a pack and a movemask. A block with a subnormal is read again for both counts.
template <>
inline void keys_and_smalls<int32_t, Mode::Float>(const int32_t* p, int64_t n, const VConsts<int32_t>& v,
                                                  Vectorized<int32_t>& bmin, Vectorized<int32_t>& bmax,
                                                  Partial& acc) {
  const __m256i abs_mask = v.abs_mask;
  const __m256i one = _mm256_set1_epi32(1);
  __m256i low0 = _mm256_set1_epi32(-1), low1 = low0;  // unsigned: -1 is the largest
  __m256i high0 = low0, high1 = low0;                 // signed: -1 stands for key 0, the smallest
  auto load = [&](int64_t i) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i));
    return _mm256_sub_epi32(_mm256_and_si256(x, abs_mask), one);
  };
  int64_t zeros = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    prefetch_ahead<64>(p + i);
    const __m256i y0 = load(i);
    const __m256i y1 = load(i + 8);
    low0 = _mm256_min_epu32(low0, y0);
    high0 = _mm256_max_epi32(high0, y0);
    low1 = _mm256_min_epu32(low1, y1);
    high1 = _mm256_max_epi32(high1, y1);
    // the sign of each 16-bit lane's high byte: one bit per element
    const uint32_t signs = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_packs_epi32(y0, y1)));
    zeros += __builtin_popcount(signs & 0xAAAAAAAAu);
    in_registers(low0, high0, low1, high1);
  }
  if (i < n) {  // a lone last vector
    const __m256i y = load(i);
    low1 = _mm256_min_epu32(low1, y);
    high1 = _mm256_max_epi32(high1, y);
    zeros += __builtin_popcount(static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(y))));
  }
  const __m256i low = _mm256_min_epu32(low0, low1);
  // a lane with 0 <= y <= tiny - 2 (unsigned) saw a subnormal
  const __m256i below = _mm256_sub_epi32(v.tiny, _mm256_set1_epi32(2));
  if (_mm256_movemask_epi8(_mm256_cmpeq_epi32(_mm256_min_epu32(low, below), low)) != 0) {
    Partial counts;
    count_small<int32_t, Mode::Float>(p, n, v, counts);
    acc.zero += counts.zero;
    acc.small += counts.small;
    zeros = counts.zero;
  } else {
    acc.zero += zeros;
    acc.small += zeros;
  }
  bmin = zeros > 0 ? v.zero : Vectorized<int32_t>(_mm256_add_epi32(low, one));
  bmax = _mm256_add_epi32(_mm256_max_epi32(high0, high1), one);
}
#endif

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
// keys_and_smalls on y = k - 1 as in the AVX2 build's float32 one, for float32, float16 and
// bfloat16 on AVX-512 and for float16 and bfloat16 on AVX2: per vector and, subtract, unsigned
// min, signed max, and the zero count from y's sign bits (a shift and an add), 6 ops with no
// compare, where the generic loop's compares cost a compare and a subtract per count (on AVX-512
// through a mask register and back to a vector). No prefetch, as in keys_only's light loop. The
// lane counts cannot overflow: n is one block (at most 512 elements per lane).
template <typename L>
struct Lanes;
#if defined(CPU_CAPABILITY_AVX512)
// what does not depend on the lane width: the register, its load, and and zero
struct Register512 {
  using R = __m512i;
  static R loadu(const void* p) { return _mm512_loadu_si512(p); }
  static R and_(R a, R b) { return _mm512_and_si512(a, b); }
  static R zero() { return _mm512_setzero_si512(); }
};
template <>
struct Lanes<int32_t> : Register512 {
  static R set1(int32_t x) { return _mm512_set1_epi32(x); }
  static R sub(R a, R b) { return _mm512_sub_epi32(a, b); }
  static R add(R a, R b) { return _mm512_add_epi32(a, b); }
  static R min_unsigned(R a, R b) { return _mm512_min_epu32(a, b); }
  static R max_signed(R a, R b) { return _mm512_max_epi32(a, b); }
  static R sign_bit(R a) { return _mm512_srli_epi32(a, 31); }
  static bool any_le_unsigned(R a, R b) { return _mm512_cmple_epu32_mask(a, b) != 0; }
};
template <>
struct Lanes<int16_t> : Register512 {
  static R set1(int16_t x) { return _mm512_set1_epi16(x); }
  static R sub(R a, R b) { return _mm512_sub_epi16(a, b); }
  static R add(R a, R b) { return _mm512_add_epi16(a, b); }
  static R min_unsigned(R a, R b) { return _mm512_min_epu16(a, b); }
  static R max_signed(R a, R b) { return _mm512_max_epi16(a, b); }
  static R sign_bit(R a) { return _mm512_srli_epi16(a, 15); }
  static bool any_le_unsigned(R a, R b) { return _mm512_cmple_epu16_mask(a, b) != 0; }
};
#else
template <>
struct Lanes<int16_t> {
  using R = __m256i;
  static R loadu(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  static R and_(R a, R b) { return _mm256_and_si256(a, b); }
  static R zero() { return _mm256_setzero_si256(); }
  static R set1(int16_t x) { return _mm256_set1_epi16(x); }
  static R sub(R a, R b) { return _mm256_sub_epi16(a, b); }
  static R add(R a, R b) { return _mm256_add_epi16(a, b); }
  static R min_unsigned(R a, R b) { return _mm256_min_epu16(a, b); }
  static R max_signed(R a, R b) { return _mm256_max_epi16(a, b); }
  static R sign_bit(R a) { return _mm256_srli_epi16(a, 15); }
  // AVX2 has no unsigned compare: a <= b exactly where min(a, b) == a
  static bool any_le_unsigned(R a, R b) { return _mm256_movemask_epi8(_mm256_cmpeq_epi16(min_unsigned(a, b), a)) != 0; }
};
#endif

template <typename L>
inline void keys_and_smalls_from_signs(const L* p, int64_t n, const VConsts<L>& v, Vectorized<L>& bmin,
                                       Vectorized<L>& bmax, Partial& acc) {
  using O = Lanes<L>;
  using R = typename O::R;
  constexpr int64_t W = Vectorized<L>::size();
  const R abs_mask = v.abs_mask;
  const R one = O::set1(1);
  R low0 = O::set1(-1), low1 = low0;  // unsigned: -1 is the largest
  R high0 = low0, high1 = low0;       // signed: -1 stands for key 0, the smallest
  R count0 = O::zero(), count1 = count0;
  auto load = [&](int64_t i) { return O::sub(O::and_(O::loadu(p + i), abs_mask), one); };
  int64_t i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {
    const R y0 = load(i);
    const R y1 = load(i + W);
    low0 = O::min_unsigned(low0, y0);
    high0 = O::max_signed(high0, y0);
    count0 = O::add(count0, O::sign_bit(y0));
    low1 = O::min_unsigned(low1, y1);
    high1 = O::max_signed(high1, y1);
    count1 = O::add(count1, O::sign_bit(y1));
    in_registers(low0, high0, count0, low1, high1, count1);
  }
  if (i < n) {  // a lone last vector
    const R y = load(i);
    low1 = O::min_unsigned(low1, y);
    high1 = O::max_signed(high1, y);
    count1 = O::add(count1, O::sign_bit(y));
  }
  int64_t zeros = lane_sum(Vectorized<L>(O::add(count0, count1)));
  const R low = O::min_unsigned(low0, low1);
  // a lane with 0 <= y <= tiny - 2 (unsigned) saw a subnormal
  if (O::any_le_unsigned(low, O::sub(v.tiny, O::set1(2)))) {
    Partial counts;
    count_small<L, Mode::Float>(p, n, v, counts);
    acc.zero += counts.zero;
    acc.small += counts.small;
    zeros = counts.zero;
  } else {
    acc.zero += zeros;
    acc.small += zeros;
  }
  bmin = zeros > 0 ? v.zero : Vectorized<L>(O::add(low, one));
  bmax = Vectorized<L>(O::add(O::max_signed(high0, high1), one));
}

#if defined(CPU_CAPABILITY_AVX512)
template <>
inline void keys_and_smalls<int32_t, Mode::Float>(const int32_t* p, int64_t n, const VConsts<int32_t>& v,
                                                  Vectorized<int32_t>& bmin, Vectorized<int32_t>& bmax,
                                                  Partial& acc) {
  keys_and_smalls_from_signs<int32_t>(p, n, v, bmin, bmax, acc);
}
#endif

template <>
inline void keys_and_smalls<int16_t, Mode::Float>(const int16_t* p, int64_t n, const VConsts<int16_t>& v,
                                                  Vectorized<int16_t>& bmin, Vectorized<int16_t>& bmax,
                                                  Partial& acc) {
  keys_and_smalls_from_signs<int16_t>(p, n, v, bmin, bmax, acc);
}
#endif

// Keys' min and max and both counts (zeros, smalls) in one read: for a float block that
// follows one that held subnormals, where keys_and_smalls would read the block twice. Two
// vectors per step with their own min/max, the two counters shared (locals, as in keys_only).
template <typename L, Mode M>
inline void keys_and_counts(const L* p, int64_t n, const VConsts<L>& v, Vectorized<L>& bmin,
                            Vectorized<L>& bmax, Partial& acc) {
  using V = Vectorized<L>;
  constexpr int64_t W = V::size();
  V min0 = bmin, max0 = bmax, min1 = bmin, max1 = bmax;
  for (int64_t begin = 0; begin < n; begin += kCountVectors<L> * W) {
    const int64_t end = std::min(n, begin + kCountVectors<L> * W);
    V zeros(L(0)), smalls(L(0));
    int64_t i = begin;
    for (; i + 2 * W <= end; i += 2 * W) {
      prefetch_ahead<2 * W * sizeof(L)>(p + i);
      const V k0 = float_key<L, M>(V::loadu(p + i), v);
      const V k1 = float_key<L, M>(V::loadu(p + i + W), v);
      min0 = at::vec::minimum(min0, k0);
      max0 = at::vec::maximum(max0, k0);
      min1 = at::vec::minimum(min1, k1);
      max1 = at::vec::maximum(max1, k1);
      zeros = zeros - (k0 == v.zero);
      smalls = smalls - (v.tiny > k0);
      zeros = zeros - (k1 == v.zero);
      smalls = smalls - (v.tiny > k1);
      in_registers(min0, max0, min1, max1, zeros, smalls);
    }
    if (i < end) {
      const V k = float_key<L, M>(V::loadu(p + i), v);
      min1 = at::vec::minimum(min1, k);
      max1 = at::vec::maximum(max1, k);
      zeros = zeros - (k == v.zero);
      smalls = smalls - (v.tiny > k);
    }
    add_counts(zeros, smalls, acc);
  }
  bmin = at::vec::minimum(min0, min1);
  bmax = at::vec::maximum(max0, max1);
}

// NaN and +-inf counts of whole vectors; only for blocks known to hold some (rare).
template <typename L, Mode M>
void count_non_finite(const L* p, int64_t n, const Consts<L>& c, Partial& acc) {
  using V = Vectorized<L>;
  constexpr int64_t W = V::size();
  const VConsts<L> v(c);
  const V nan_above(c.nan_above), pos_inf(c.pos_inf), neg_inf(c.neg_inf);
  for (int64_t begin = 0; begin < n; begin += kCountVectors<L> * W) {
    const int64_t end = std::min(n, begin + kCountVectors<L> * W);
    V nans(L(0)), pinfs(L(0)), ninfs(L(0));
    for (int64_t i = begin; i < end; i += W) {
      const V x = V::loadu(p + i);
      nans = nans - (float_key<L, M>(x, v) > nan_above);
      if constexpr (M == Mode::Float) {
        pinfs = pinfs - (x == pos_inf);
        ninfs = ninfs - (x == neg_inf);
      }
      in_registers(nans, pinfs, ninfs);
    }
    acc.nan += lane_sum(nans);
    acc.posinf += lane_sum(pinfs);
    acc.neginf += lane_sum(ninfs);
  }
}

#if defined(CPU_CAPABILITY_AVX2)
// int64 on AVX2, whose 64-bit lanes have no min, max or abs (a compare and a blend each): where
// every value of a block fits in int32 (indices, positions, counts: nearly every int64 tensor
// of a model), the low halves are the values, and on 32-bit lanes |x| is one abs (as uint32:
// |INT32_MIN| = 2^31) and its min and max one op each, over twice the values per vector. Per
// pair of vectors (8 values): two shuffles (the low halves, the high halves), the fit check
// (high half == the low half's sign: a shift, a compare, an and), abs, min, max: 8 ops, against
// 12 on 64-bit lanes (in cache 0.73-0.86x the time, AMD EPYC Zen3). Sets the block's smallest
// and largest |x| and its zero count (when asked) and returns true, or returns false where a
// value does not fit. n is a multiple of the vector width.
template <bool kCountZeros>
inline bool narrow_int64_block(const int64_t* p, int64_t n, uint32_t& abs_min, uint32_t& abs_max,
                               int64_t& zeros) {
  const __m256i zero = _mm256_setzero_si256();
  const __m256i all = _mm256_set1_epi32(-1);
  __m256i mn = all, mx = zero, fits = all, counts = zero;
  // the order of values within a vector means nothing to a min, a max or a count
  auto step = [&](__m256i a, __m256i b, bool count) {
    const __m256 af = _mm256_castsi256_ps(a), bf = _mm256_castsi256_ps(b);
    const __m256i lo = _mm256_castps_si256(_mm256_shuffle_ps(af, bf, 0x88));
    const __m256i hi = _mm256_castps_si256(_mm256_shuffle_ps(af, bf, 0xDD));
    fits = _mm256_and_si256(fits, _mm256_cmpeq_epi32(hi, _mm256_srai_epi32(lo, 31)));
    const __m256i mag = _mm256_abs_epi32(lo);
    mn = _mm256_min_epu32(mn, mag);
    mx = _mm256_max_epu32(mx, mag);
    if (kCountZeros && count) {
      counts = _mm256_sub_epi32(counts, _mm256_cmpeq_epi32(lo, zero));
    }
  };
  auto load = [](const int64_t* q) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)); };
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    prefetch_ahead<64>(p + i);
    step(load(p + i), load(p + i + 4), true);
    in_registers(mn, mx, fits, counts);
  }
  int64_t lone_zeros = 0;
  if (i < n) {
    // a lone last vector, read as both halves of a pair; its zeros counted on 64-bit lanes
    const __m256i a = load(p + i);
    step(a, a, false);
    if constexpr (kCountZeros) {
      lone_zeros = __builtin_popcount(_mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpeq_epi64(a, zero))));
    }
  }
  if (_mm256_movemask_epi8(fits) != -1) {
    return false;
  }
  // unsigned lane min/max through the signed ones, on values with the top bit flipped
  const Vectorized<int32_t> flip(INT32_MIN);
  abs_min = static_cast<uint32_t>(lane_min(Vectorized<int32_t>(mn) ^ flip) ^ INT32_MIN);
  abs_max = static_cast<uint32_t>(lane_max(Vectorized<int32_t>(mx) ^ flip) ^ INT32_MIN);
  if constexpr (kCountZeros) {
    zeros = lane_sum(Vectorized<int32_t>(counts)) + lone_zeros;
  }
  return true;
}
#endif

// Bytes per block: small enough that a block read a second time right after the first is still
// in L1 (32-48 KB per core on current x86), whatever the vector width, and large enough that
// the per-block checks and the mispredicted exit of the block's loop cost a few percent.
constexpr int64_t kBlockBytes = 16 * 1024;

// One pass over n contiguous elements, a block at a time. Per vector only the key (abs bits,
// -|x| or x^0x80) and its running min and max per lane. Every count is of values that sit at
// one end of the key order, so a block's smallest and largest keys say whether it can hold
// any, and only such a block is read again (from L1) to count them:
// - floats: zeros and subnormals have the smallest keys (below the smallest normal); NaN and inf
//   the largest (above / at inf's bits; the fnuz NaN's key is made so);
// - signed integers: zero is the largest key (-|x| = 0); uint8/bool: the smallest (0 ^ 0x80).
// Zeros come in runs of blocks (ReLU outputs, sparse weights, bool masks): after a block that
// held some, the next block counts them as it reads (floats: the smalls alone while no
// subnormal shows up, both counts after a block that held one), and returns to the keys-only
// pass after a block that held none.
template <typename L, Mode M>
void scan_lanes(const L* p, int64_t n, const Consts<L>& c, Partial& acc) {
  using V = Vectorized<L>;
  constexpr int64_t W = V::size();
  constexpr int64_t kBlock = kBlockBytes / sizeof(L);
  constexpr bool kFloat = kFloatMode<M>;
  const VConsts<L> v(c);
  V vmin(std::numeric_limits<L>::max());
  V vmax(std::numeric_limits<L>::lowest());
  // how the previous block's zeros and subnormals are counted in this one, from what it held
  enum class Count { None, Smalls, Both } counting = Count::None;
  const int64_t n_vec = n - n % W;
#if defined(CPU_CAPABILITY_AVX2)
  // int64 read on 32-bit lanes until a block holds a value beyond int32; such values (hashes,
  // timestamps) come in whole tensors, so the rest is read on 64-bit lanes
  bool narrow = M == Mode::Signed && sizeof(L) == 8;
#endif
  for (int64_t begin = 0; begin < n_vec;) {
    const int64_t end = std::min(n_vec, begin + kBlock);
    const int64_t zero_before = acc.zero, small_before = acc.small;
    V bmin(std::numeric_limits<L>::max());
    V bmax(std::numeric_limits<L>::lowest());
    bool read = false;
#if defined(CPU_CAPABILITY_AVX2)
    if constexpr (M == Mode::Signed && sizeof(L) == 8) {
      uint32_t abs_min = 0, abs_max = 0;
      int64_t zeros = 0;
      if (narrow) {
        read = counting == Count::None
                   ? narrow_int64_block<false>(p + begin, end - begin, abs_min, abs_max, zeros)
                   : narrow_int64_block<true>(p + begin, end - begin, abs_min, abs_max, zeros);
        narrow = read;
      }
      if (read) {
        bmin = V(-static_cast<L>(abs_max));  // keys are -|x|
        bmax = V(-static_cast<L>(abs_min));
        acc.zero += zeros;
      }
    }
#endif
    if (read) {
      // done on 32-bit lanes
    } else if (counting == Count::None) {
      keys_only<L, M>(p + begin, end - begin, v, bmin, bmax);
    } else if constexpr (kFloat) {
      if (counting == Count::Smalls) {
        keys_and_smalls<L, M>(p + begin, end - begin, v, bmin, bmax, acc);
      } else {
        keys_and_counts<L, M>(p + begin, end - begin, v, bmin, bmax, acc);
      }
    } else {
      keys_and_zeros<L, M>(p + begin, end - begin, v, bmin, bmax, acc);
    }
    bool has_small;
    if constexpr (kFloat) {
      has_small = M != Mode::Exponent && any_lane(v.tiny > bmin);  // e8m0 has neither
      V non_finite = bmax > V(c.nan_above);
      if constexpr (M == Mode::Float) {
        non_finite = non_finite | (bmax == V(c.pos_inf));
      }
      if (any_lane(non_finite)) {
        count_non_finite<L, M>(p + begin, end - begin, c, acc);
      }
    } else if constexpr (M == Mode::Signed) {
      has_small = any_lane(bmax == v.zero);
    } else {
      has_small = any_lane(bmin == v.flip);
    }
    if (has_small && counting == Count::None) {
      count_small<L, M>(p + begin, end - begin, v, acc);
    }
    // zeros only (ReLU outputs; every integer case): count the smalls alone as the next block
    // is read; subnormals too (fp16 gradients): count both
    counting = !has_small ? Count::None
               : acc.small - small_before > acc.zero - zero_before ? Count::Both : Count::Smalls;
    vmin = at::vec::minimum(vmin, bmin);
    vmax = at::vec::maximum(vmax, bmax);
    begin = end;
  }
  if (n_vec > 0) {
    acc.kmin = std::min<int64_t>(acc.kmin, lane_min(vmin));
    acc.kmax = std::max<int64_t>(acc.kmax, lane_max(vmax));
  }
  scan_scalar<L, M>(p + n_vec, n - n_vec, c, acc);
}

#else  // the baseline build

template <typename L, Mode M>
void scan_lanes(const L* p, int64_t n, const Consts<L>& c, Partial& acc) {
  scan_scalar<L, M>(p, n, c, acc);
}

#endif

template <typename L>
inline Consts<L> float_consts(uint64_t inf_bits, uint64_t sign_bit, uint64_t tiny_bits) {
  Consts<L> c;
  c.abs_mask = static_cast<L>(sign_bit - 1);
  c.nan_above = static_cast<L>(inf_bits);
  c.pos_inf = static_cast<L>(inf_bits);
  c.neg_inf = static_cast<L>(inf_bits | sign_bit);
  c.tiny = static_cast<L>(tiny_bits);
  return c;
}

// e4m3fnuz and e5m2fnuz: no inf, so NaN is the only key above the largest magnitude (0x7F), and
// that key is FloatNuz's all ones for the pattern 0x80.
inline Consts<uint8_t> fnuz_consts(uint8_t tiny_bits) {
  Consts<uint8_t> c;
  c.abs_mask = 0x7F;
  c.nan_above = 0x7F;
  c.nan_bits = 0x80;
  c.tiny = tiny_bits;
  return c;
}

inline void scan(Kind kind, const void* data, int64_t n, Partial& acc) {
  switch (kind) {
    case Kind::F64:
      return scan_lanes<int64_t, Mode::Float>(static_cast<const int64_t*>(data), n,
          float_consts<int64_t>(0x7FF0000000000000ull, 1ull << 63, 0x0010000000000000ull), acc);
    case Kind::F32:
      return scan_lanes<int32_t, Mode::Float>(static_cast<const int32_t*>(data), n,
          float_consts<int32_t>(0x7F800000u, 1ull << 31, 0x00800000u), acc);
    case Kind::F16:
      return scan_lanes<int16_t, Mode::Float>(static_cast<const int16_t*>(data), n,
          float_consts<int16_t>(0x7C00, 1u << 15, 0x0400), acc);
    case Kind::BF16:
      return scan_lanes<int16_t, Mode::Float>(static_cast<const int16_t*>(data), n,
          float_consts<int16_t>(0x7F80, 1u << 15, 0x0080), acc);
    case Kind::F8E5M2:
      return scan_lanes<int8_t, Mode::Float>(static_cast<const int8_t*>(data), n,
          float_consts<int8_t>(0x7C, 1u << 7, 0x04), acc);
    case Kind::F8E4M3FN: {
      // no infinities; S.1111.111 is NaN, so abs bits above 0x7E are NaN
      Consts<int8_t> c = float_consts<int8_t>(0x7E, 1u << 7, 0x08);
      return scan_lanes<int8_t, Mode::FloatNoInf>(static_cast<const int8_t*>(data), n, c, acc);
    }
    case Kind::F8E4M3FNUZ:  // smallest normal 2^-7: bits 0x08
      return scan_lanes<uint8_t, Mode::FloatNuz>(static_cast<const uint8_t*>(data), n, fnuz_consts(0x08), acc);
    case Kind::F8E5M2FNUZ:  // smallest normal 2^-15: bits 0x04
      return scan_lanes<uint8_t, Mode::FloatNuz>(static_cast<const uint8_t*>(data), n, fnuz_consts(0x04), acc);
    case Kind::F8E8M0FNU: {
      Consts<uint8_t> c;
      c.abs_mask = 0xFF;  // no sign bit
      c.nan_above = 0xFE;
      return scan_lanes<uint8_t, Mode::Exponent>(static_cast<const uint8_t*>(data), n, c, acc);
    }
    case Kind::I8:
      return scan_lanes<int8_t, Mode::Signed>(static_cast<const int8_t*>(data), n, {}, acc);
    case Kind::I16:
      return scan_lanes<int16_t, Mode::Signed>(static_cast<const int16_t*>(data), n, {}, acc);
    case Kind::I32:
      return scan_lanes<int32_t, Mode::Signed>(static_cast<const int32_t*>(data), n, {}, acc);
    case Kind::I64:
      return scan_lanes<int64_t, Mode::Signed>(static_cast<const int64_t*>(data), n, {}, acc);
    case Kind::U8:
    case Kind::BOOL:
      return scan_lanes<int8_t, Mode::Unsigned8>(static_cast<const int8_t*>(data), n, {}, acc);
    case Kind::C32:
    case Kind::C64:
    case Kind::C128:
      return scan_complex(kind, data, n, acc);
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace overflow_fast
