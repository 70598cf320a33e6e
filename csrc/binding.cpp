// overflow_fast._C: the statistics of a list of CPU tensors in one call (SPEC §3).
//
// Each tensor is planned as rows of contiguous elements read in place; the whole call's bytes
// are split evenly between threads (small calls stay on one thread), each thread scans its share
// with the kernel picked for this CPU, and the per-thread partials are merged into one
// [n, 8] int64 row per tensor (layout.py). Min, max and counts are exact, so the result does not
// depend on how the work was split.
// Built with NDEBUG defined (cpu_build.compile_flags), as a release build: pybind11 otherwise checks
// the GIL at every reference count change.
// Only the headers used: <torch/extension.h> (all of libtorch's C++ API) costs about 30 s of
// compile time per translation unit on a small machine, most of the build.
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include "hook_layer.h"
#include "launch.h"
#include "stats.h"

#ifndef OVERFLOW_FAST_TORCH_VERSION
#define OVERFLOW_FAST_TORCH_VERSION "unknown"
#endif
#ifndef OVERFLOW_FAST_SOURCE_HASH
#define OVERFLOW_FAST_SOURCE_HASH "unknown"
#endif

namespace overflow_fast {
namespace {

// Bumped whenever the Python side must change with the module (cpu_backend.py checks it).
constexpr int kAbiVersion = 23;

// Columns of a row (overflow_fast/stats/layout.py).
enum Column : int64_t { ABS_MIN, ABS_MAX, NAN_COUNT, POSINF, NEGINF, ZERO, SUBNORMAL, NUMEL, NUM_COLUMNS };

// A call with less work than this per thread stays on the calling thread: waking the OpenMP
// team costs several microseconds, as much as reading this many bytes.
constexpr int64_t kMinBytesPerThread = 256 * 1024;
// hypot costs far more per byte than the SIMD path; weigh complex work up so threads get even shares.
constexpr int64_t kComplexCostFactor = 16;

// The kernel for this CPU; a plain function pointer (no initializer runs at load time).
ScanFn g_scan = nullptr;
const char* g_capability = "default";

// The kernel builds, worst first; the index orders them like ATen's CPUCapability.
constexpr const char* kCapabilities[] = {"default", "avx2", "avx512"};

#if defined(OVERFLOW_FAST_HAVE_AVX2) || defined(OVERFLOW_FAST_HAVE_AVX512)
// Whether the OS saves (and so enables) the register state in `mask` of XCR0. A CPU may report
// AVX or AVX-512 in CPUID while the OS (or the hypervisor) leaves their state off; then the
// first such instruction faults. cpuinfo, which ATen asks, reads the same bits (its
// avx512_regs: XCR0 & 0xE6), after CPUID's OSXSAVE bit says XGETBV may be executed.
bool os_saves(uint64_t mask) {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) {
    return false;
  }
  constexpr unsigned kXsaveAndOsxsave = (1u << 26) | (1u << 27);
  if ((ecx & kXsaveAndOsxsave) != kXsaveAndOsxsave) {
    return false;
  }
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  const uint64_t xcr0 = (static_cast<uint64_t>(hi) << 32) | lo;
  return (xcr0 & mask) == mask;
}

// XCR0 bits: SSE (1) and the upper halves of ymm0-15 (2); for AVX-512 also the opmask
// registers (5), the upper halves of zmm0-15 (6) and zmm16-31 (7).
constexpr uint64_t kYmmState = 0x06;
constexpr uint64_t kZmmState = 0xE6;

// Adds `name` to the list of what this CPU lacks unless it `has` it.
void need(bool has, const char* name, std::string& missing) {
  if (!has) {
    missing += (missing.empty() ? "" : ", ") + std::string(name);
  }
}
#endif

// Why this module cannot run the named build on this CPU; "" when it can.
std::string unavailable_reason(const std::string& name) {
  if (name == "default") {
    return "";
  }
  if (name == "avx2") {
#ifdef OVERFLOW_FAST_HAVE_AVX2
    // everything kernel_avx2.cpp is compiled for (-mavx2 -mfma -mf16c -mpopcnt)
    __builtin_cpu_init();
    std::string missing;
    need(__builtin_cpu_supports("avx2"), "avx2", missing);
    need(__builtin_cpu_supports("fma"), "fma", missing);
    need(__builtin_cpu_supports("f16c"), "f16c", missing);
    need(__builtin_cpu_supports("popcnt"), "popcnt", missing);
    need(os_saves(kYmmState), "the OS's saving of the ymm registers (XCR0)", missing);
    return missing.empty() ? "" : "this CPU cannot run the AVX2 kernel: it lacks " + missing;
#else
    return "this module was built without the AVX2 kernel (each build holds the baseline kernel and "
           "its instruction set's: see `overflow-fast info`)";
#endif
  }
  if (name == "avx512") {
#ifdef OVERFLOW_FAST_HAVE_AVX512
    // everything kernel_avx512.cpp is compiled for (cpu_build.py's ISA_FLAGS)
    __builtin_cpu_init();
    std::string missing;
    need(__builtin_cpu_supports("avx512f"), "avx512f", missing);
    need(__builtin_cpu_supports("avx512bw"), "avx512bw", missing);
    need(__builtin_cpu_supports("avx512vl"), "avx512vl", missing);
    need(__builtin_cpu_supports("avx512dq"), "avx512dq", missing);
    need(__builtin_cpu_supports("fma"), "fma", missing);
    need(__builtin_cpu_supports("f16c"), "f16c", missing);
    need(os_saves(kZmmState), "the OS's saving of the zmm and opmask registers (XCR0)", missing);
    return missing.empty() ? "" : "this CPU cannot run the AVX-512 kernel: it lacks " + missing;
#else
    return "this module was built without the AVX-512 kernel (each build holds the baseline kernel "
           "and its instruction set's: see `overflow-fast info`)";
#endif
  }
  return "unknown capability '" + name + "' (known: default, avx2, avx512)";
}

void set_capability(const std::string& name) {
  const std::string reason = unavailable_reason(name);
  TORCH_CHECK(reason.empty(), "overflow_fast._C: cannot use the '", name, "' kernel: ", reason);
#ifdef OVERFLOW_FAST_HAVE_AVX512
  if (name == "avx512") {
    g_scan = scan_avx512;
    g_capability = kCapabilities[2];
    return;
  }
#endif
#ifdef OVERFLOW_FAST_HAVE_AVX2
  if (name == "avx2") {
    g_scan = scan_avx2;
    g_capability = kCapabilities[1];
    return;
  }
#endif
  g_scan = scan_default;
  g_capability = kCapabilities[0];
}

// The best kernel this CPU runs, as ATen picks its own: AVX-512, else AVX2, else the baseline;
// ATEN_CPU_CAPABILITY=default|avx2|avx512 caps the choice (for torch and for us).
void choose_capability() {
  int best = 2;
  if (const char* env = std::getenv("ATEN_CPU_CAPABILITY")) {
    for (int i = 0; i < 3; i++) {
      if (std::string(env) == kCapabilities[i]) {
        best = i;
      }
    }
  }
  for (int i = best; i > 0; i--) {
    if (unavailable_reason(kCapabilities[i]).empty()) {
      set_capability(kCapabilities[i]);
      return;
    }
  }
  set_capability("default");
}

std::optional<Kind> kind_of(at::ScalarType dtype) {
  switch (dtype) {
    case at::kDouble: return Kind::F64;
    case at::kFloat: return Kind::F32;
    case at::kHalf: return Kind::F16;
    case at::kBFloat16: return Kind::BF16;
    case at::kFloat8_e4m3fn: return Kind::F8E4M3FN;
    case at::kFloat8_e5m2: return Kind::F8E5M2;
    case at::kFloat8_e4m3fnuz: return Kind::F8E4M3FNUZ;
    case at::kFloat8_e5m2fnuz: return Kind::F8E5M2FNUZ;
#if __has_include(<c10/util/Float8_e8m0fnu.h>)  // the dtype came with torch 2.7
    case at::kFloat8_e8m0fnu: return Kind::F8E8M0FNU;
#endif
    case at::kChar: return Kind::I8;
    case at::kShort: return Kind::I16;
    case at::kInt: return Kind::I32;
    case at::kLong: return Kind::I64;
    case at::kByte: return Kind::U8;
    case at::kBool: return Kind::BOOL;
    case at::kComplexHalf: return Kind::C32;
    case at::kComplexFloat: return Kind::C64;
    case at::kComplexDouble: return Kind::C128;
    default: return std::nullopt;
  }
}

bool is_complex(Kind kind) { return kind == Kind::C32 || kind == Kind::C64 || kind == Kind::C128; }

bool is_floating(Kind kind) {
  return kind == Kind::F64 || kind == Kind::F32 || kind == Kind::F16 || kind == Kind::BF16 ||
         kind == Kind::F8E4M3FN || kind == Kind::F8E5M2 || kind == Kind::F8E4M3FNUZ ||
         kind == Kind::F8E5M2FNUZ || kind == Kind::F8E8M0FNU;
}

// How to read one tensor: `rows` rows of `row_len` contiguous elements; row r starts at
// base + offset(r) elements, where offset decomposes r over the outer sizes and strides.
struct Plan {
  int64_t row = 0;  // output row
  Kind kind = Kind::F32;
  const char* base = nullptr;
  int64_t itemsize = 0;
  int64_t row_len = 1;
  int64_t rows = 1;
  c10::SmallVector<int64_t, 6> outer_sizes;    // outermost first
  c10::SmallVector<int64_t, 6> outer_strides;  // in elements
  int64_t repeat = 1;  // every element read stands for this many (stride-0, broadcast dimensions)
  int64_t cost = 0;    // cost units of one element
  int64_t cost_begin = 0;
  int64_t cost_end = 0;
  int64_t numel = 0;     // the tensor's elements (its row's count)
  bool negated = false;  // a negative view (torch._neg_view): its infinities change sign
  at::Tensor copy;  // holds the contiguous copy, for the layouts that need one
};

// Statistics do not depend on element order, so dimensions can be reordered and merged freely:
// drop size-1 dimensions, read stride-0 dimensions once (scaling the counts), sort the rest by
// stride and merge those that are contiguous with each other. A dense tensor (contiguous,
// transposed, permuted) becomes one row; a slice becomes rows; only a layout whose smallest
// stride is not 1 (e.g. x[:, ::2]) is copied.
Plan make_plan(const at::Tensor& t, int64_t row, Kind kind) {
  Plan plan;
  plan.row = row;
  plan.kind = kind;
  plan.itemsize = static_cast<int64_t>(t.element_size());
  c10::SmallVector<std::pair<int64_t, int64_t>, 6> dims;  // (size, stride)
  for (int64_t d = 0; d < t.dim(); d++) {
    const int64_t size = t.size(d);
    const int64_t stride = t.stride(d);
    if (size == 1) {
      continue;
    }
    if (stride == 0) {
      plan.repeat *= size;
      continue;
    }
    dims.emplace_back(size, stride);
  }
  std::stable_sort(dims.begin(), dims.end(),
                   [](const auto& a, const auto& b) { return a.second > b.second; });
  c10::SmallVector<std::pair<int64_t, int64_t>, 6> merged;
  for (const auto& [size, stride] : dims) {
    if (!merged.empty() && merged.back().second == size * stride) {
      merged.back() = {merged.back().first * size, stride};
    } else {
      merged.emplace_back(size, stride);
    }
  }
  plan.base = static_cast<const char*>(t.const_data_ptr());
  if (!merged.empty() && merged.back().second != 1) {
    // no contiguous innermost run: read a compact copy of the distinct elements
    std::vector<int64_t> sizes, strides;
    for (const auto& [size, stride] : merged) {
      sizes.push_back(size);
      strides.push_back(stride);
    }
    plan.copy = t.as_strided(sizes, strides).contiguous();
    plan.base = static_cast<const char*>(plan.copy.const_data_ptr());
    plan.row_len = plan.copy.numel();
  } else if (!merged.empty()) {
    plan.row_len = merged.back().first;
    for (size_t d = 0; d + 1 < merged.size(); d++) {
      plan.outer_sizes.push_back(merged[d].first);
      plan.outer_strides.push_back(merged[d].second);
      plan.rows *= merged[d].first;
    }
  }
  plan.cost = plan.itemsize * (is_complex(kind) ? kComplexCostFactor : 1);
  return plan;
}

void scan_elements(const Plan& plan, int64_t begin, int64_t end, Partial& acc) {
  const ScanFn scan = is_complex(plan.kind) ? scan_complex : g_scan;
  int64_t r = begin / plan.row_len;
  int64_t col = begin % plan.row_len;
  while (begin < end) {
    const int64_t len = std::min(plan.row_len - col, end - begin);
    int64_t offset = 0;
    int64_t rest = r;
    for (int64_t d = static_cast<int64_t>(plan.outer_sizes.size()) - 1; d >= 0; d--) {
      offset += (rest % plan.outer_sizes[d]) * plan.outer_strides[d];
      rest /= plan.outer_sizes[d];
    }
    scan(plan.kind, plan.base + (offset + col) * plan.itemsize, len, acc);
    begin += len;
    col = 0;
    r++;
  }
}

int64_t double_bits(double value) {
  int64_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

// The magnitude a floating key (abs bit pattern) stands for.
double float_of_key(Kind kind, int64_t key) {
  switch (kind) {
    case Kind::F64: {
      double v;
      std::memcpy(&v, &key, sizeof(v));
      return v;
    }
    case Kind::F32: {
      const uint32_t bits = static_cast<uint32_t>(key);
      float v;
      std::memcpy(&v, &bits, sizeof(v));
      return v;
    }
    case Kind::F16:
      return static_cast<float>(c10::Half(static_cast<uint16_t>(key), c10::Half::from_bits()));
    case Kind::BF16:
      return static_cast<float>(c10::BFloat16(static_cast<uint16_t>(key), c10::BFloat16::from_bits()));
    case Kind::F8E4M3FN:
      return static_cast<float>(
          c10::Float8_e4m3fn(static_cast<uint8_t>(key), c10::Float8_e4m3fn::from_bits()));
    case Kind::F8E5M2:
      return static_cast<float>(
          c10::Float8_e5m2(static_cast<uint8_t>(key), c10::Float8_e5m2::from_bits()));
    case Kind::F8E4M3FNUZ:
      return static_cast<float>(
          c10::Float8_e4m3fnuz(static_cast<uint8_t>(key), c10::Float8_e4m3fnuz::from_bits()));
    case Kind::F8E5M2FNUZ:
      return static_cast<float>(
          c10::Float8_e5m2fnuz(static_cast<uint8_t>(key), c10::Float8_e5m2fnuz::from_bits()));
    case Kind::F8E8M0FNU:  // 2^(key-127); key 0 is 2^-127, a float32 subnormal, exact; 0xFF NaN
      return key == 0xFF ? std::numeric_limits<float>::quiet_NaN() : std::ldexp(1.0f, static_cast<int>(key) - 127);
    default:
      TORCH_INTERNAL_ASSERT(false, "not a floating kind");
  }
}

void write_row(const Plan& plan, const Partial& p, bool negated, int64_t numel, int64_t* out) {
  out[NUMEL] = numel;
  out[ZERO] = p.zero * plan.repeat;
  const Kind kind = plan.kind;
  if (is_complex(kind)) {
    // nan/inf counted by parts (torch.isnan/isinf); the magnitudes are float64 (complex.cpp)
    out[NAN_COUNT] = p.nan * plan.repeat;
    out[POSINF] = p.posinf * plan.repeat;
    out[SUBNORMAL] = (p.small - p.zero) * plan.repeat;
    if (p.kmax > double_bits(std::numeric_limits<double>::infinity())) {
      // some magnitude is NaN (the keys are positive NaN bits): torch's abs().min()/max()
      // propagate it. An element inf+nan*j has magnitude inf, not NaN.
      out[ABS_MIN] = out[ABS_MAX] = double_bits(std::numeric_limits<double>::quiet_NaN());
    } else {
      out[ABS_MIN] = p.kmin;  // already float64 bits
      out[ABS_MAX] = p.kmax;
    }
  } else if (is_floating(kind)) {
    out[NAN_COUNT] = p.nan * plan.repeat;
    out[negated ? NEGINF : POSINF] = p.posinf * plan.repeat;
    out[negated ? POSINF : NEGINF] = p.neginf * plan.repeat;
    out[SUBNORMAL] = (p.small - p.zero) * plan.repeat;
    if (p.nan > 0) {
      // torch's abs().min()/max() propagate NaN
      out[ABS_MIN] = out[ABS_MAX] = double_bits(std::numeric_limits<double>::quiet_NaN());
    } else {
      out[ABS_MIN] = double_bits(float_of_key(kind, p.kmin));
      out[ABS_MAX] = double_bits(float_of_key(kind, p.kmax));
    }
  } else if (kind == Kind::U8 || kind == Kind::BOOL) {
    // key = x ^ 0x80 read as int8
    const uint64_t lo = static_cast<uint8_t>(p.kmin) ^ 0x80u;
    const uint64_t hi = static_cast<uint8_t>(p.kmax) ^ 0x80u;
    if (kind == Kind::BOOL) {
      out[ABS_MIN] = double_bits(lo != 0 ? 1.0 : 0.0);
      out[ABS_MAX] = double_bits(hi != 0 ? 1.0 : 0.0);
    } else {
      out[ABS_MIN] = static_cast<int64_t>(lo);
      out[ABS_MAX] = static_cast<int64_t>(hi);
    }
  } else {
    // key = -|x|: the largest key is the smallest magnitude; negate in uint64 (|INT64_MIN| = 2^63)
    out[ABS_MIN] = static_cast<int64_t>(uint64_t(0) - static_cast<uint64_t>(p.kmax));
    out[ABS_MAX] = static_cast<int64_t>(uint64_t(0) - static_cast<uint64_t>(p.kmin));
  }
}

// The bytes [begin, end) that a tensor's elements can occupy.
struct Extent {
  uintptr_t begin = 0;
  uintptr_t end = 0;
  bool overlaps(const Extent& o) const { return begin < o.end && o.begin < end; }
};

// An argument's name for error messages ("tensors[3]", "out"), written only when a check fails:
// a std::string per tensor would cost every call an allocation and a formatting.
struct ArgName {
  int64_t index;  // into `tensors`, or -1 for `out`
};

std::ostream& operator<<(std::ostream& os, const ArgName& name) {
  return name.index < 0 ? os << "out" : os << "tensors[" << name.index << "]";
}

// Checks that `t` is a plain, storage-backed CPU tensor whose every element lies inside memory
// it owns, and returns the bytes its elements span (empty for numel 0). Every caller of the
// module is checked here, not only dispatch.py: whatever reaches the kernel is read through raw
// pointers, so anything else must become a Python error (RuntimeError), never a read of memory
// the tensor does not own.
Extent checked_extent(const at::Tensor& t, ArgName name) {
  constexpr const char* kWhere = "overflow_fast._C.compute: ";
  TORCH_CHECK(t.defined(), kWhere, name, " is undefined");
  const c10::DispatchKeySet keys = t.key_set();
  // Wrapper subclasses (torch.Tensor._make_wrapper_subclass: DTensor, FakeTensor, a
  // __torch_dispatch__ wrapper) have no data of their own: their storage is empty.
  TORCH_CHECK(!keys.has_any(c10::python_ks), kWhere, name,
              " is a tensor subclass that dispatches to Python (__torch_dispatch__, e.g. DTensor "
              "or FakeTensor): it holds no data the kernel can read");
  TORCH_CHECK(!keys.has(c10::DispatchKey::FuncTorchBatched) &&
                  !keys.has(c10::DispatchKey::BatchedNestedTensor) &&
                  !keys.has(c10::DispatchKey::FuncTorchGradWrapper) &&
                  !keys.has(c10::DispatchKey::Functionalize),
              kWhere, name, " is a functorch-wrapped tensor (vmap, grad or functionalize)");
  TORCH_CHECK(!t.is_nested(), kWhere, name, " is a nested tensor");
  TORCH_CHECK(!keys.has(c10::DispatchKey::ZeroTensor), kWhere, name,
              " is an efficient zero tensor, which has no memory");
  TORCH_CHECK(t.device().is_cpu(), kWhere, name, " is on ", t.device(), ", not the CPU");
  TORCH_CHECK(t.layout() == at::kStrided && !t.is_quantized() && !t.is_mkldnn(), kWhere, name,
              " is not a plain strided tensor (layout ", t.layout(), ")");
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  const int64_t numel = t.numel();
  if (numel == 0) {
    return {};
  }
  // unsafe_storage(): storage() throws for the TensorImpl subclasses that have none
  const c10::Storage& storage = impl->unsafe_storage();
  TORCH_CHECK(storage && storage.data() != nullptr, kWhere, name, " has ", numel,
              " elements but no storage or a null data pointer");
  TORCH_CHECK(storage.device().is_cpu(), kWhere, name, "'s storage is on ", storage.device());
  // The last element's offset, in elements from the start of the storage; each step checked
  // for overflow. torch has no negative strides; refuse them rather than read before the start.
  const int64_t offset = impl->storage_offset();
  TORCH_CHECK(offset >= 0, kWhere, name, " has a negative storage offset ", offset);
  uint64_t last = static_cast<uint64_t>(offset);
  bool overflow = false;
  const at::IntArrayRef sizes = t.sizes();
  const at::IntArrayRef strides = t.strides();
  for (size_t d = 0; d < sizes.size(); d++) {
    TORCH_CHECK(strides[d] >= 0, kWhere, name, " has a negative stride ", strides[d], " in dimension ", d);
    uint64_t step = 0;
    overflow |= __builtin_mul_overflow(static_cast<uint64_t>(sizes[d] - 1),
                                       static_cast<uint64_t>(strides[d]), &step);
    overflow |= __builtin_add_overflow(last, step, &last);
  }
  const uint64_t itemsize = static_cast<uint64_t>(t.element_size());
  uint64_t end_bytes = 0;
  overflow |= __builtin_add_overflow(last, uint64_t{1}, &last);
  overflow |= __builtin_mul_overflow(last, itemsize, &end_bytes);
  const uint64_t nbytes = static_cast<uint64_t>(storage.nbytes());
  TORCH_CHECK(!overflow && end_bytes <= nbytes, kWhere, name, " (sizes ", sizes, ", strides ", strides,
              ", storage offset ", offset, ", ", itemsize, " bytes per element) reaches past the end of its storage of ",
              nbytes, " bytes");
  const uintptr_t base = reinterpret_cast<uintptr_t>(storage.data());
  return {base + static_cast<uintptr_t>(offset) * itemsize, base + static_cast<uintptr_t>(end_bytes)};
}

// Reads every planned element, the whole call's cost split evenly between threads, and writes
// each plan's row into `out` (rows of zeros already there for the tensors without a plan).
void scan_plans(c10::SmallVector<Plan, 4>& plans, int64_t total_cost, int64_t* out) {
  if (plans.empty()) {
    return;
  }
  // Thread p reads the elements whose cost offsets fall in [total*p/parts, total*(p+1)/parts).
  const int64_t num_plans = static_cast<int64_t>(plans.size());
  const int64_t parts = std::max<int64_t>(
      1, std::min<int64_t>(at::get_num_threads(), total_cost / kMinBytesPerThread));
  c10::SmallVector<Partial, 8> partials(parts * num_plans);
  at::parallel_for(0, parts, 1, [&](int64_t part_begin, int64_t part_end) {
    for (int64_t part = part_begin; part < part_end; part++) {
      const int64_t lo = total_cost / parts * part + total_cost % parts * part / parts;
      const int64_t hi = total_cost / parts * (part + 1) + total_cost % parts * (part + 1) / parts;
      auto it = std::upper_bound(plans.begin(), plans.end(), lo,
                                 [](int64_t value, const Plan& p) { return value < p.cost_end; });
      for (; it != plans.end() && it->cost_begin < hi; ++it) {
        const int64_t count = it->rows * it->row_len;
        // element j belongs to the part holding its cost offset cost_begin + j * cost
        auto first_at_or_after = [&](int64_t offset) {
          const int64_t d = offset - it->cost_begin;
          return d <= 0 ? 0 : std::min(count, (d + it->cost - 1) / it->cost);
        };
        scan_elements(*it, first_at_or_after(lo), first_at_or_after(hi),
                      partials[part * num_plans + (it - plans.begin())]);
      }
    }
  });

  for (int64_t k = 0; k < num_plans; k++) {
    Partial total;
    for (int64_t part = 0; part < parts; part++) {
      total.merge(partials[part * num_plans + k]);
    }
    const Plan& plan = plans[k];
    write_row(plan, total, plan.negated, plan.numel, out + plan.row * NUM_COLUMNS);
  }
}

at::Tensor compute(at::TensorList tensors, const std::optional<at::Tensor>& out_rows) {
  const int64_t n = static_cast<int64_t>(tensors.size());
  // inline storage for a hook's few tensors: no heap allocation per call
  c10::SmallVector<Extent, 8> extents;
  extents.reserve(tensors.size());
  c10::SmallVector<Kind, 8> kinds;
  kinds.reserve(tensors.size());
  for (int64_t i = 0; i < n; i++) {
    const at::Tensor& t = tensors[i];
    const ArgName name{i};
    extents.push_back(checked_extent(t, name));
    const std::optional<Kind> kind = kind_of(t.scalar_type());
    TORCH_CHECK(kind.has_value(), "overflow_fast._C.compute: ", name, " has unsupported dtype ",
                t.scalar_type());
    kinds.push_back(*kind);
  }

  at::Tensor result;
  if (out_rows.has_value()) {
    // rows of a caller's buffer (the detector's check="batch"): no allocation, no copy after
    result = *out_rows;
    const Extent out_extent = checked_extent(result, ArgName{-1});
    TORCH_CHECK(result.scalar_type() == at::kLong && result.dim() == 2 && result.size(0) == n &&
                    result.size(1) == NUM_COLUMNS && result.is_contiguous() && !result.is_neg() &&
                    !result.is_conj(),
                "overflow_fast._C.compute: out must be a contiguous CPU int64 tensor of shape [", n, ", ",
                NUM_COLUMNS, "]");
    for (int64_t i = 0; i < n; i++) {
      // zeroing out first would destroy such an input before it is read
      TORCH_CHECK(!out_extent.overlaps(extents[i]), "overflow_fast._C.compute: out overlaps the memory of tensors[",
                  i, "]");
    }
  } else {
    // empty_cpu and memset, not at::zeros: two trips through the dispatcher (empty, fill) are
    // about 1 us, a third of a small tensor's call
    result = at::detail::empty_cpu({n, NUM_COLUMNS}, at::kLong);
  }
  int64_t* out = result.data_ptr<int64_t>();
  // the rows of empty tensors stay zero; write_row leaves the columns a kind has not at zero
  std::memset(out, 0, static_cast<size_t>(n) * NUM_COLUMNS * sizeof(int64_t));

  c10::SmallVector<Plan, 4> plans;
  plans.reserve(tensors.size());
  int64_t total_cost = 0;
  for (int64_t i = 0; i < n; i++) {
    const at::Tensor& t = tensors[i];
    if (t.numel() == 0) {
      continue;  // a row of zeros
    }
    Plan plan = make_plan(t, i, kinds[i]);
    plan.numel = t.numel();
    // a negative view holds the bits of -x: its infinities change sign; a complex magnitude does not
    plan.negated = t.is_neg() && is_floating(plan.kind);
    plan.cost_begin = total_cost;
    total_cost += plan.rows * plan.row_len * plan.cost;
    plan.cost_end = total_cost;
    plans.push_back(std::move(plan));
  }
  scan_plans(plans, total_cost, out);
  return result;
}

// The pybind entry point: the same kernel, called directly (no dispatcher: its per-call cost is
// what a hook pays), under the op's name for the profiler (RECORD_FUNCTION costs one check of
// a global flag when no profiler is on).
at::Tensor compute_binding(const std::vector<at::Tensor>& tensors, const std::optional<at::Tensor>& out_rows) {
  if (out_rows.has_value()) {
    RECORD_FUNCTION("overflow_fast::tensor_stats_out", std::vector<c10::IValue>());
    return compute(tensors, out_rows);
  }
  RECORD_FUNCTION("overflow_fast::tensor_stats", std::vector<c10::IValue>());
  return compute(tensors, out_rows);
}

// ---- torch ops (SPEC §6: the engine as torch ops) -----------------------------------------
//
//   overflow_fast::tensor_stats(Tensor[] tensors) -> Tensor
//   overflow_fast::tensor_stats_out(Tensor[] tensors, Tensor(a!) out) -> ()
//
// The out variant is an op of its own, not an overload "tensor_stats.out" tagged `out`: Inductor
// lowers a functional op that has such an overload to that overload writing into a buffer of
// its own, and (torch 2.13) passes a Tensor[] argument there as separate positional tensors,
// which the schema rejects at run time. Returning nothing (no aliased output) is what
// auto_functionalize takes without an `out` tag.
//
// CPU kernels are compute() itself, with its checks (a tensor reaching them through the
// dispatcher has already been unwrapped by the Python key, but the raw-pointer reads stay
// guarded). Autograd kernels: the rows are int64, never differentiable; they step below
// autograd and re-invoke the op (what opcheck's autograd_registration test asks of
// non-differentiable ops), and the out variant bumps out's version counter as an in-place
// aten op would. The fake (meta) implementations live in overflow_fast/stats/ops.py.

at::Tensor tensor_stats_cpu(at::TensorList tensors) { return compute(tensors, std::nullopt); }

void tensor_stats_out_cpu(at::TensorList tensors, at::Tensor& out) { compute(tensors, out); }

at::Tensor tensor_stats_autograd(at::TensorList tensors) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("overflow_fast::tensor_stats", "")
                             .typed<at::Tensor(at::TensorList)>();
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.call(tensors);
}

void tensor_stats_out_autograd(at::TensorList tensors, at::Tensor& out) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("overflow_fast::tensor_stats_out", "")
                             .typed<void(at::TensorList, at::Tensor&)>();
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.call(tensors, out);
  }
  if (!out.is_inference()) {
    out.unsafeGetTensorImpl()->bump_version();
  }
}

}  // namespace

void compute_flat(const FlatTensor* tensors, int64_t count, int64_t* rows) {
  // the rows of empty tensors stay zero; write_row leaves the columns a kind has not at zero
  std::memset(rows, 0, static_cast<size_t>(count) * NUM_COLUMNS * sizeof(int64_t));
  c10::SmallVector<Plan, 4> plans;
  int64_t total_cost = 0;
  for (int64_t i = 0; i < count; i++) {
    const FlatTensor& t = tensors[i];
    if (t.numel == 0) {
      continue;
    }
    const std::optional<Kind> kind = kind_of(t.dtype);
    TORCH_CHECK(kind.has_value(), "overflow_fast: compute_flat: unsupported dtype ", t.dtype);
    Plan plan;
    plan.row = i;
    plan.kind = *kind;
    plan.base = static_cast<const char*>(t.data);
    plan.itemsize = static_cast<int64_t>(c10::elementSize(t.dtype));
    plan.row_len = t.numel;
    plan.numel = t.numel;
    plan.cost = plan.itemsize * (is_complex(plan.kind) ? kComplexCostFactor : 1);
    plan.cost_begin = total_cost;
    total_cost += plan.row_len * plan.cost;
    plan.cost_end = total_cost;
    plans.push_back(std::move(plan));
  }
  scan_plans(plans, total_cost, rows);
}

// table.cpp
void add_launcher(py::module& m);
py::object triton_table(const py::list& tensors, const py::tuple& plain_types, const at::Device& device,
                        const py::dict& words, int64_t chunk, const at::Tensor& table, int64_t aligned_bit,
                        int64_t overlap_first, int64_t overlap_last, bool list_empty);

}  // namespace overflow_fast

TORCH_LIBRARY(overflow_fast, m) {
  // where the fake (meta) implementations are registered: torch names it when one is missing
  m.set_python_module("overflow_fast.stats.ops");
  // pt2_compliant: traceable by torch.compile (fake implementations, no data-dependent output
  // shapes)
  m.def("tensor_stats(Tensor[] tensors) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def("tensor_stats_out(Tensor[] tensors, Tensor(a!) out) -> ()", {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(overflow_fast, CPU, m) {
  m.impl("tensor_stats", &overflow_fast::tensor_stats_cpu);
  m.impl("tensor_stats_out", &overflow_fast::tensor_stats_out_cpu);
}

// An empty list has no tensor to dispatch on: the fallback gives its [0, 8] rows on the CPU.
// (Other devices reach it too and get the kernel's "not the CPU" error.)
TORCH_LIBRARY_IMPL(overflow_fast, CompositeExplicitAutograd, m) {
  m.impl("tensor_stats", &overflow_fast::tensor_stats_cpu);
}

TORCH_LIBRARY_IMPL(overflow_fast, Autograd, m) {
  m.impl("tensor_stats", &overflow_fast::tensor_stats_autograd);
  m.impl("tensor_stats_out", &overflow_fast::tensor_stats_out_autograd);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  overflow_fast::choose_capability();
  m.doc() = "overflow_fast's CPU statistics kernel (SPEC §3): one pass per tensor, many tensors per call";
  m.def("compute", &overflow_fast::compute_binding, py::arg("tensors"), py::arg("out") = py::none(),
        py::call_guard<py::gil_scoped_release>(),
        "Statistics rows [len(tensors), 8] int64 (layout.py) of a list of CPU tensors, into `out` if given");
  m.def("capability", []() { return std::string(overflow_fast::g_capability); },
        "The kernel build in use: 'avx512', 'avx2' or 'default'");
  m.def("set_capability", &overflow_fast::set_capability, py::arg("name"),
        "Use the 'avx512', 'avx2' or 'default' kernel (for tests and benchmarks); a RuntimeError "
        "saying why when this module or this CPU cannot run it");
  m.def("capabilities", []() {
          std::vector<std::pair<std::string, std::string>> out;
          for (const char* name : overflow_fast::kCapabilities) {
            out.emplace_back(name, overflow_fast::unavailable_reason(name));
          }
          return out;
        },
        "[(name, why not)] for every kernel build, worst first: why not is '' for the builds "
        "this module holds and this CPU runs");
  m.def("triton_table", &overflow_fast::triton_table, "The Triton backend's table of plain tensors (table.cpp)");
  overflow_fast::add_launcher(m);
  // the hook layer's C++, apart from the engine's (hook_layer.h)
  py::module hooks = m.def_submodule("hooks", "The hook layer's C++ (csrc/hook_layer.h): not the engine's");
  overflow_fast::add_hook_layer(hooks);
  m.attr("ABI_VERSION") = overflow_fast::kAbiVersion;
  m.attr("TORCH_VERSION") = OVERFLOW_FAST_TORCH_VERSION;
  m.attr("SOURCE_HASH") = OVERFLOW_FAST_SOURCE_HASH;
}
