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

enum class Mode { Float, FloatNoInf, Signed, Unsigned8 };

// The per-kind constants, as lane integers. For floats: the sign-clearing mask, the abs bits of
// inf (anything above is NaN; for e4m3fn, which has no inf, the largest finite), the bits of
// +inf/-inf, and the abs bits of the smallest normal.
template <typename L>
struct Consts {
  L abs_mask = 0;
  L nan_above = 0;
  L pos_inf = 0;
  L neg_inf = 0;
  L tiny = 0;
};

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
    if constexpr (M == Mode::Float || M == Mode::FloatNoInf) {
      k = static_cast<L>(x & c.abs_mask);
      nan += k > c.nan_above;
      if constexpr (M == Mode::Float) {
        posinf += x == c.pos_inf;
        neginf += x == c.neg_inf;
      }
      zero += k == 0;
      small += k < c.tiny;
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

// NaN and +-inf counts of whole vectors; only for blocks known to hold some (rare).
template <typename L, Mode M>
void count_non_finite(const L* p, int64_t n, const Consts<L>& c, Partial& acc) {
  using V = Vectorized<L>;
  const V abs_mask(c.abs_mask), nan_above(c.nan_above), pos_inf(c.pos_inf), neg_inf(c.neg_inf);
  V nans(L(0)), pinfs(L(0)), ninfs(L(0));
  for (int64_t i = 0; i < n; i += V::size()) {
    const V x = V::loadu(p + i);
    nans = nans - ((x & abs_mask) > nan_above);
    if constexpr (M == Mode::Float) {
      pinfs = pinfs - (x == pos_inf);
      ninfs = ninfs - (x == neg_inf);
    }
  }
  acc.nan += lane_sum(nans);
  acc.posinf += lane_sum(pinfs);
  acc.neginf += lane_sum(ninfs);
}

// One pass over n contiguous elements, a block of vectors at a time. Per vector: the key (abs
// bits, -|x| or x^0x80), its running min and max, and the counts that are common: a compare
// gives -1 per matching lane, so subtracting it counts. NaN and inf are rare, so floats do not
// count them per vector: their abs bits sort above every finite value, so a block whose
// largest key is finite has none, and only a block that has some is read again to count them.
// Lane counters are as narrow as the elements, so they move into int64 after every block,
// before they can overflow (127 vectors for 8-bit lanes).
template <typename L, Mode M>
void scan_lanes(const L* p, int64_t n, const Consts<L>& c, Partial& acc) {
  using V = Vectorized<L>;
  constexpr int64_t W = V::size();
  constexpr int64_t kBlockVectors = sizeof(L) == 1 ? 127 : 1024;
  constexpr bool kFloat = M == Mode::Float || M == Mode::FloatNoInf;
  const V abs_mask(c.abs_mask), tiny(c.tiny), zero(L(0)), flip(static_cast<L>(0x80));
  V vmin(std::numeric_limits<L>::max());
  V vmax(std::numeric_limits<L>::lowest());
  const int64_t n_vec = n - n % W;
  for (int64_t begin = 0; begin < n_vec;) {
    const int64_t end = std::min(n_vec, begin + kBlockVectors * W);
    V bmax(std::numeric_limits<L>::lowest());
    V zeros(L(0)), smalls(L(0));
    for (int64_t i = begin; i < end; i += W) {
      const V x = V::loadu(p + i);
      V k;
      if constexpr (kFloat) {
        k = x & abs_mask;
        zeros = zeros - (k == zero);
        smalls = smalls - (tiny > k);
      } else if constexpr (M == Mode::Signed) {
        k = at::vec::minimum(x, zero - x);  // -|x|; the most negative value wraps onto itself
        zeros = zeros - (x == zero);
      } else {
        k = x ^ flip;
        zeros = zeros - (k == flip);
      }
      vmin = at::vec::minimum(vmin, k);
      bmax = at::vec::maximum(bmax, k);
    }
    acc.zero += lane_sum(zeros);
    if constexpr (kFloat) {
      acc.small += lane_sum(smalls);
      const L largest = lane_max(bmax);
      if (largest > c.nan_above || (M == Mode::Float && largest == c.pos_inf)) {
        count_non_finite<L, M>(p + begin, end - begin, c, acc);
      }
    }
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
