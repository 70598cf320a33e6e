// The kernel for any CPU: no ISA flags, at::vec's portable Vectorized (plain loops the compiler
// vectorises with the baseline SSE2).
#define CPU_CAPABILITY DEFAULT
#include "kernel.h"

namespace overflow_fast {

void scan_default(Kind kind, const void* data, int64_t n, Partial& acc) {
  DEFAULT::scan(kind, data, n, acc);
}

}  // namespace overflow_fast
