// Complex tensors: a scalar pass on the magnitude. Compiled without ISA flags and shared by
// every kernel build; |z| is std::hypot in the real part's precision (hypotf for complex64),
// as torch's abs computes it.
#include <cmath>
#include <complex>
#include <cstring>

#include "stats.h"

namespace overflow_fast {

namespace {

template <typename T>
void scan_magnitudes(const T* p, int64_t n, double tiny, Partial& acc) {
  for (int64_t i = 0; i < n; i++) {
    const double m = static_cast<double>(std::hypot(p[2 * i], p[2 * i + 1]));
    acc.nan += std::isnan(m);
    acc.posinf += std::isinf(m);
    acc.zero += m == 0.0;
    acc.small += m < tiny;  // false for NaN
    // a magnitude is >= 0, so its float64 bits order like its value
    int64_t key;
    std::memcpy(&key, &m, sizeof(key));
    acc.kmin = key < acc.kmin ? key : acc.kmin;
    acc.kmax = key > acc.kmax ? key : acc.kmax;
  }
}

}  // namespace

void scan_complex(Kind kind, const void* data, int64_t n, Partial& acc) {
  if (kind == Kind::C64) {
    scan_magnitudes(static_cast<const float*>(data), n, 0x1p-126, acc);
  } else {
    scan_magnitudes(static_cast<const double*>(data), n, 0x1p-1022, acc);
  }
}

}  // namespace overflow_fast
