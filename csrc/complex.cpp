// Complex tensors: a scalar pass on the parts and the magnitude. Compiled without ISA flags and
// shared by every kernel build.
//
// - nan / posinf count the elements with a NaN / an infinite part, as torch.isnan / torch.isinf
//   do (and the reference, which calls them); an element inf+nan*j counts in both; neginf is 0.
// - |z| is the hypot of the parts widened to float64 (magnitude() below), so a complex64 (or complex32) magnitude
//   never overflows (3e38+3e38j is 4.24e+38, finite); a complex128 magnitude above the float64
//   range (1e308+1e308j) is inf although both parts are finite (posinf counts only parts).
//   hypot(inf, nan) is inf, as torch's abs gives, so the magnitude is NaN only when a part is
//   NaN and none is infinite.
// - zero is |z| == 0; subnormal is 0 < |z| < the smallest normal of the part's dtype.
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>

#include "stats.h"

namespace overflow_fast {

namespace {

// a * a = hi + lo exactly (Dekker: Veltkamp's split, no FMA, which the baseline build lacks).
// |a| < 2^996, so the split cannot overflow.
inline void exact_square(double a, double& hi, double& lo) {
  hi = a * a;
  const double c = 134217729.0 * a;  // 2^27 + 1
  const double a_hi = c - (c - a);
  const double a_lo = a - a_hi;
  lo = ((a_hi * a_hi - hi) + 2.0 * a_hi * a_lo) + a_lo * a_lo;
}

// a + b = s + err exactly (Knuth's two-sum).
inline void two_sum(double a, double b, double& s, double& err) {
  s = a + b;
  const double b_virtual = s - a;
  err = (a - (s - b_virtual)) + (b - b_virtual);
}

// sqrt(re^2 + im^2), correctly rounded in the cases checked (glibc's hypot is off by one ulp for
// about 1% of operands of similar size, torch's abs and Python's math.hypot are not): the parts
// are scaled by a power of two so that the larger lies in [0.5, 1), the sum of squares is kept
// as an exact double-double, and sqrt's result is corrected by the exact residual.
double magnitude(double re, double im) {
  double x = std::fabs(re);
  double y = std::fabs(im);
  if (std::isinf(x) || std::isinf(y)) {
    return std::numeric_limits<double>::infinity();  // even with a NaN part, as hypot does
  }
  if (std::isnan(x) || std::isnan(y)) {
    return std::numeric_limits<double>::quiet_NaN();
  }
  if (x < y) {
    std::swap(x, y);
  }
  if (y == 0.0) {
    return x;
  }
  int exponent = 0;
  std::frexp(x, &exponent);
  // exact scaling (ldexp of a normal result); a y that underflows here is below 2^-1021 x,
  // far too small to change the rounded result
  x = std::ldexp(x, -exponent);
  y = std::ldexp(y, -exponent);
  double xx, xx_lo, yy, yy_lo, s, s_lo;
  exact_square(x, xx, xx_lo);
  exact_square(y, yy, yy_lo);
  two_sum(xx, yy, s, s_lo);
  const double lo = s_lo + (xx_lo + yy_lo);  // the sum of squares is s + lo (lo < ulp(s))
  double h = std::sqrt(s + lo);
  double hh, hh_lo;
  exact_square(h, hh, hh_lo);
  // residual: (s + lo) - h^2; s - hh is exact (Sterbenz)
  const double residual = (s - hh) + (lo - hh_lo);
  h += residual / (2.0 * h);
  double result = std::ldexp(h, exponent);  // inf when the magnitude exceeds the float64 range
  if (h < std::ldexp(1.0, -1022 - exponent)) {
    // a subnormal result: ldexp rounded h a second time, to fewer bits. Redo that rounding
    // against sqrt(s + lo): compare it with the midpoints around the result (ties to even).
    const double half_grid = std::ldexp(1.0, -1075 - exponent);  // half its last place, scaled
    const double c = std::ldexp(result, -exponent);                // exact
    auto excess = [&](double mid) {  // the sign of (s + lo) - mid^2
      double mm, mm_lo;
      exact_square(mid, mm, mm_lo);
      return (s - mm) + (lo - mm_lo);
    };
    uint64_t bits;
    std::memcpy(&bits, &result, sizeof(bits));
    const bool odd = bits & 1;
    const double up = excess(c + half_grid);
    if (up > 0.0 || (up == 0.0 && odd)) {
      result = std::nextafter(result, 1.0);
    } else if (result > 0.0) {
      const double down = excess(c - half_grid);
      if (down < 0.0 || (down == 0.0 && odd)) {
        result = std::nextafter(result, 0.0);
      }
    }
  }
  return result;
}

template <typename T>
void scan_parts(const T* p, int64_t n, double tiny, Partial& acc) {
  int64_t nan = 0, inf = 0, zero = 0, small = 0;
  int64_t kmin = acc.kmin, kmax = acc.kmax;
  for (int64_t i = 0; i < n; i++) {
    const double re = static_cast<double>(p[2 * i]);
    const double im = static_cast<double>(p[2 * i + 1]);
    nan += std::isnan(re) || std::isnan(im);
    inf += std::isinf(re) || std::isinf(im);
    double m = magnitude(re, im);
    if (std::isnan(m)) {
      m = std::numeric_limits<double>::quiet_NaN();  // positive: its bits sort above inf
    }
    zero += m == 0.0;
    small += m < tiny;  // false for NaN
    // a magnitude is >= 0 (or the positive NaN), so its float64 bits order like its value
    int64_t key;
    std::memcpy(&key, &m, sizeof(key));
    kmin = key < kmin ? key : kmin;
    kmax = key > kmax ? key : kmax;
  }
  acc.nan += nan;
  acc.posinf += inf;
  acc.zero += zero;
  acc.small += small;
  acc.kmin = kmin;
  acc.kmax = kmax;
}

}  // namespace

void scan_complex(Kind kind, const void* data, int64_t n, Partial& acc) {
  switch (kind) {
    case Kind::C32:
      return scan_parts(static_cast<const c10::Half*>(data), n, 0x1p-14, acc);
    case Kind::C64:
      return scan_parts(static_cast<const float*>(data), n, 0x1p-126, acc);
    case Kind::C128:
      return scan_parts(static_cast<const double*>(data), n, 0x1p-1022, acc);
    default:
      return;
  }
}

}  // namespace overflow_fast
