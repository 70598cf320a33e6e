// The kernel for AVX-512 CPUs: the avx512 build (overflow_fast/stats/cpu_build.py) compiles it with
// -DCPU_CAPABILITY=AVX512 -DCPU_CAPABILITY_AVX512 and ATen's AVX512 flags (-mavx512f -mavx512bw
// -mavx512vl -mavx512dq -mfma, plus -mf16c); the binding calls it only after checking the CPU and
// the OS.
#if !defined(CPU_CAPABILITY_AVX512)
#error "kernel_avx512.cpp must be compiled with the AVX-512 flags (see overflow_fast/stats/cpu_build.py)"
#endif
#include "kernel.h"

namespace overflow_fast {

void scan_avx512(Kind kind, const void* data, int64_t n, Partial& acc) {
  AVX512::scan(kind, data, n, acc);
}

}  // namespace overflow_fast
