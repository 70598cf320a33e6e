// Shared between the binding and the kernels: what a kernel computes and how it is called.
// Nothing here depends on the instruction set, so every translation unit may include it.
#pragma once

#include <cstdint>
#include <limits>

namespace overflow_fast {

// How the kernel reads a dtype's elements. Floating dtypes are read as integer bit patterns.
enum class Kind : int {
  F64, F32, F16, BF16, F8E4M3FN, F8E5M2,  // floating: integer lanes holding the bits
  F8E4M3FNUZ, F8E5M2FNUZ, F8E8M0FNU,      // the AMD fp8 formats (kernel.h, Mode)
  I8, I16, I32, I64,                      // signed integers
  U8, BOOL,                               // unsigned bytes
  C32, C64, C128,                         // complex: scalar path on the parts and the magnitude
};

// The statistics of part of one tensor. kmin/kmax are "keys" that order like |x| within a Kind:
// - floating: the bits of |x| (sign cleared); for every IEEE-like format the order of those
//   bits is the order of the magnitudes, and NaN bits sort above inf (the fnuz formats' NaN,
//   0x80, has the key 0xFF; e8m0fnu's key is its byte);
// - signed integers: -|x|, which never overflows (so the max key is the min magnitude);
// - uint8/bool: x ^ 0x80 as int8, which orders like x;
// - complex: the float64 bits of |z| (NaN stored as the positive quiet NaN, above inf).
// For complex kinds nan/posinf count elements with a NaN / an infinite part (torch.isnan/isinf);
// neginf stays 0.
struct Partial {
  int64_t kmin = std::numeric_limits<int64_t>::max();
  int64_t kmax = std::numeric_limits<int64_t>::min();
  int64_t nan = 0;
  int64_t posinf = 0;
  int64_t neginf = 0;
  int64_t zero = 0;
  int64_t small = 0;  // 0 <= |x| < smallest normal (zeros included); floating and complex only

  void merge(const Partial& o) {
    kmin = o.kmin < kmin ? o.kmin : kmin;
    kmax = o.kmax > kmax ? o.kmax : kmax;
    nan += o.nan;
    posinf += o.posinf;
    neginf += o.neginf;
    zero += o.zero;
    small += o.small;
  }
};

// Accumulate the statistics of n contiguous elements of the given kind into `acc`.
using ScanFn = void (*)(Kind kind, const void* data, int64_t n, Partial& acc);

void scan_default(Kind kind, const void* data, int64_t n, Partial& acc);
#ifdef OVERFLOW_FAST_HAVE_AVX2
void scan_avx2(Kind kind, const void* data, int64_t n, Partial& acc);
#endif
#ifdef OVERFLOW_FAST_HAVE_AVX512
void scan_avx512(Kind kind, const void* data, int64_t n, Partial& acc);
#endif
// Complex kinds only; scalar (std::hypot in float64), the same on every instruction set.
void scan_complex(Kind kind, const void* data, int64_t n, Partial& acc);

}  // namespace overflow_fast
