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

// sqrt(x^2 + y^2) for x >= y >= 0 in [2^-480, 2^500] (x) where nothing below overflows or
// loses bits to underflow: the sum of squares as an exact double-double (s + lo), sqrt of it
// rounded, then corrected once by the exact residual (s + lo) - h^2. Multiplying x and y by a
// power of two multiplies every intermediate exactly, so the scaled callers below get the same
// bits (torch_backend._magnitude scales each element into [0.5, 1) and agrees bit for bit).
struct Corrected {
  double h, s, lo;
};

inline Corrected corrected_sqrt(double x, double y) {
  double xx, xx_lo, yy, yy_lo, s, s_lo;
  exact_square(x, xx, xx_lo);
  exact_square(y, yy, yy_lo);
  two_sum(xx, yy, s, s_lo);
  const double lo = s_lo + (xx_lo + yy_lo);
  const double h = std::sqrt(s + lo);
  double hh, hh_lo;
  exact_square(h, hh, hh_lo);
  const double residual = (s - hh) + (lo - hh_lo);  // s - hh is exact (Sterbenz)
  return {h + residual / (2.0 * h), s, lo};
}

constexpr double kBig = 0x1p500;
constexpr double kSmall = 0x1p-480;

// |re + im*j| in float64, correctly rounded in the cases checked (glibc's hypot is one ulp off
// for about 1% of operands of similar size; torch's abs and Python's math.hypot are off in
// rarer cases). The parts of complex32/complex64 always take the fast path.
inline double magnitude(double re, double im) {
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
  if (x <= kBig && x >= kSmall) {
    // a y that underflows below is < 2^-1021 x: far too small to change the rounded result
    return corrected_sqrt(x, y).h;
  }
  if (x > kBig) {
    return corrected_sqrt(x * 0x1p-600, y * 0x1p-600).h * 0x1p600;  // inf above the range
  }
  // tiny parts: scaled up, and the result scaled back down may be subnormal, where the
  // multiplication rounds h a second time, to fewer bits. Redo that rounding against s + lo:
  // compare it with the midpoints around the result (ties to even).
  const Corrected c = corrected_sqrt(x * 0x1p600, y * 0x1p600);
  double result = c.h * 0x1p-600;
  if (c.h < 0x1p-422) {  // the result is below 2^-1022: subnormal
    const double half_grid = 0x1p-475;     // half the last place of a subnormal, scaled
    const double scaled = result * 0x1p600;  // exact
    auto excess = [&](double mid) {  // the sign of (s + lo) - mid^2
      double mm, mm_lo;
      exact_square(mid, mm, mm_lo);
      return (c.s - mm) + (c.lo - mm_lo);
    };
    uint64_t bits;
    std::memcpy(&bits, &result, sizeof(bits));
    const bool odd = bits & 1;
    const double up = excess(scaled + half_grid);
    if (up > 0.0 || (up == 0.0 && odd)) {
      result = std::nextafter(result, 1.0);
    } else if (result > 0.0) {
      const double down = excess(scaled - half_grid);
      if (down < 0.0 || (down == 0.0 && odd)) {
        result = std::nextafter(result, 0.0);
      }
    }
  }
  return result;
}

double double_of_key(int64_t key) {
  double v;
  std::memcpy(&v, &key, sizeof(v));
  return v;
}

// Most elements can be neither the smallest nor the largest magnitude seen so far, nor near the
// subnormal threshold; for them the squared magnitude s = x*x + y*y (relative error < 2^-51)
// proves it, and the exact magnitude is skipped. Margins of 2^-48 are far wider than every
// rounding involved, so the result is exactly that of computing every magnitude.
template <typename T>
void scan_parts(const T* p, int64_t n, double tiny, Partial& acc) {
  int64_t nan = 0, inf = 0, zero = 0, small = 0;
  int64_t kmin = acc.kmin, kmax = acc.kmax;
  const double tiny_below = tiny * tiny * (1.0 - 0x1p-48);  // 0 for complex128 (underflow)
  const double tiny_above = tiny * tiny * (1.0 + 0x1p-48);
  double skip_above = 0.0;  // s in (skip_above, skip_below): not a new min or max
  double skip_below = 0.0;
  auto update_bounds = [&]() {
    // none yet: no element skips; a NaN minimum (every magnitude so far NaN) neither
    const double lo = kmin == std::numeric_limits<int64_t>::max() ? std::numeric_limits<double>::infinity()
                                                                   : double_of_key(kmin);
    skip_above = lo * lo * (1.0 + 0x1p-48);
    const double hi = kmax == std::numeric_limits<int64_t>::min() ? 0.0 : double_of_key(kmax);
    // a NaN magnitude outranks everything; above the safe range, so does any s
    skip_below = std::isnan(hi) ? std::numeric_limits<double>::infinity() : hi * hi * (1.0 - 0x1p-48);
  };
  update_bounds();
  for (int64_t i = 0; i < n; i++) {
    const double re = static_cast<double>(p[2 * i]);
    const double im = static_cast<double>(p[2 * i + 1]);
    const double x = std::fabs(re);
    const double y = std::fabs(im);
    const double big = x > y ? x : y;
    if (big >= kSmall && big <= kBig) {  // finite, not zero, squares exact enough
      const double s = x * x + y * y;
      if (s > skip_above && s < skip_below) {
        if (s < tiny_below) {
          small++;
          continue;
        }
        if (s > tiny_above) {
          continue;
        }
      }
    }
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
    if (key < kmin || key > kmax) {
      kmin = key < kmin ? key : kmin;
      kmax = key > kmax ? key : kmax;
      update_bounds();
    }
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
