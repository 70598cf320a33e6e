// The kernel for AVX2 CPUs: the avx2 build (overflow_fast/stats/cpu_build.py) compiles it with
// -DCPU_CAPABILITY=AVX2 -DCPU_CAPABILITY_AVX2 and -mavx2 -mfma -mf16c -mpopcnt, and the binding calls
// it only after checking the CPU.
#if !defined(CPU_CAPABILITY_AVX2)
#error "kernel_avx2.cpp must be compiled with the AVX2 flags (see overflow_fast/stats/cpu_build.py)"
#endif
#include "kernel.h"

namespace overflow_fast {

void scan_avx2(Kind kind, const void* data, int64_t n, Partial& acc) {
  AVX2::scan(kind, data, n, acc);
}

}  // namespace overflow_fast
