// The kernel for AVX2 CPUs: setup.py compiles this file alone with -DCPU_CAPABILITY=AVX2
// -DCPU_CAPABILITY_AVX2 -mavx2 -mfma -mf16c -mpopcnt, and the binding calls it only after checking the CPU.
#if !defined(CPU_CAPABILITY_AVX2)
#error "kernel_avx2.cpp must be compiled with the AVX2 flags (see setup.py)"
#endif
#include "kernel.h"

namespace overflow_fast {

void scan_avx2(Kind kind, const void* data, int64_t n, Partial& acc) {
  AVX2::scan(kind, data, n, acc);
}

}  // namespace overflow_fast
