// Software prefetching for the loops that walk a list of tensors (table.cpp triton_table).
//
// At the end of a forward the staged tensors' Python objects, TensorImpls, version counters and
// storages have left the cache: each is a dependent load (object -> impl -> counter/storage), so
// a plain loop waits for several misses in a row per tensor (here ~0.6 us a tensor cold against
// ~0.05 warm). The loop below asks for tensor i + 12's object, i + 8's impl and i + 4's counter
// and storage while it works on tensor i, so that the misses of several tensors overlap.
#pragma once

#include <torch/csrc/autograd/python_variable.h>

namespace overflow_fast {

// One cache line at p into all levels. An asm statement on x86-64: GCC drops __builtin_prefetch
// from some loops it transforms (seen in triton_table's), and a prefetch it drops costs the misses
// again.
inline void prefetch_line(const void* p) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  asm volatile("prefetcht0 (%0)" : : "r"(p));
#else
  __builtin_prefetch(p);
#endif
}

constexpr Py_ssize_t kPrefetchObject = 12;
constexpr Py_ssize_t kPrefetchImpl = 8;
constexpr Py_ssize_t kPrefetchPointees = 4;

// Before working on items[index]: prefetch ahead. is_tensor(object) says whether an object may
// be read as a tensor (an exact tensor type the loop takes); others are skipped.
template <typename IsTensor>
inline void prefetch_tensors(PyObject* const* items, Py_ssize_t count, Py_ssize_t index, IsTensor is_tensor) {
  if (index + kPrefetchObject < count) {
    prefetch_line(items[index + kPrefetchObject]);
  }
  if (index + kPrefetchImpl < count && is_tensor(items[index + kPrefetchImpl])) {
    const char* impl = reinterpret_cast<const char*>(THPVariable_Unpack(items[index + kPrefetchImpl]).unsafeGetTensorImpl());
    // the fields read (storage, counter, sizes, strides, numel, dtype, device, keys, flags) span
    // ~230 bytes: five lines when the object does not start on one
    for (int line = 0; line < 5; ++line) {
      prefetch_line(impl + 64 * line);
    }
  }
  if (index + kPrefetchPointees < count && is_tensor(items[index + kPrefetchPointees])) {
    const c10::TensorImpl* impl = THPVariable_Unpack(items[index + kPrefetchPointees]).unsafeGetTensorImpl();
    // c10::VariableVersion is a single intrusive_ptr to its counter
    static_assert(sizeof(c10::VariableVersion) == sizeof(void*), "VariableVersion is one pointer");
    const void* counter = *reinterpret_cast<const void* const*>(&impl->version_counter());
    if (counter != nullptr) {
      prefetch_line(counter);
    }
    const char* storage = reinterpret_cast<const char*>(impl->unsafe_storage().unsafeGetStorageImpl());
    if (storage != nullptr) {  // its data pointer and flags
      prefetch_line(storage);
      prefetch_line(storage + 64);
    }
  }
}

}  // namespace overflow_fast
