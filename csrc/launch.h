// What a launch reads of a list of tensors, and the list read's launch itself (table.cpp); the
// CPU kernel on flat tensors (binding.cpp). Shared by table.cpp (the Triton backend's table and
// the list read's launcher), hooks.cpp (HookCore launches a hook's reads through a bound
// launcher) and binding.cpp.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <array>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace overflow_fast {

// ---- the per-tensor facts a launch reads (one loop for the table and the list read) ------------

// What a kernel is told of one tensor: where its elements start, how many, its format word.
struct Slot {
  int64_t address;
  int64_t numel;
  int64_t word;
};

// Which tensors a loop takes and how it describes them.
struct PackRules {
  static constexpr size_t kNumTypes = static_cast<size_t>(c10::ScalarType::NumOptions);
  std::array<PyTypeObject*, 4> plain{};   // the exact Python types taken (subclasses are not)
  std::array<int64_t, kNumTypes> word_of;  // format word per dtype; -1: not taken
  std::array<PyObject*, kNumTypes> dtype_of{};  // the torch.dtype objects (borrowed from `words`)
  int64_t aligned_bit = 0;  // set in a word whose tensor starts on a 16-byte boundary
  c10::Device device = c10::Device(c10::kCPU);

  // plain_types: a tuple of at most 4 types; words: {torch.dtype: format word}, the word
  // >= 0 with aligned_bit clear. Raises on anything else.
  PackRules(const py::tuple& plain_types, const py::dict& words, int64_t aligned_bit, const c10::Device& device);
  int64_t code_mask() const { return aligned_bit - 1; }
  bool is_plain(PyObject* object) const;
};

enum class Packed {
  kTaken,    // read in place: `slot` describes exactly its elements
  kFlat,     // a strided tensor of a taken dtype whose memory is not exactly its elements (not
             // dense, or a lazy negation): read through a flat copy; `slot` holds its numel and word
  kRefused,  // anything else: not a plain strided tensor of a taken dtype on the device, a wrapper,
             // no storage, or elements outside its storage
};

// The one classification of a tensor: what the table and the list read read of `object`.
Packed pack_tensor(PyObject* object, const PackRules& rules, Slot& slot, c10::ScalarType& dtype);

// ---- the CPU kernel on flat tensors (binding.cpp) ------------------------------------------------

struct FlatTensor {
  const void* data;
  int64_t numel;
  c10::ScalarType dtype;
};

// Rows [count, 8] (layout.py) at `rows` of tensors whose elements are `numel` contiguous values
// from `data` (memory the caller has checked); the same kernel and threads as compute().
void compute_flat(const FlatTensor* tensors, int64_t count, int64_t* rows);

// ---- the list read's launcher (table.cpp) -----------------------------------------------------------

// Triton's launch hooks as plain data, made by Python (triton_launch.launch_hooks) from Triton's
// objects, so that nothing here reads a Python object by name at a launch: a reason fixed when
// they were read (a hook set as a plain attribute, hooks that cannot be read), the lists that
// hold hooks (a HookChain's `calls`, the kernel's `pre_run_hooks`: whoever adds a hook appends to
// one of them, read here by their size) with what each one means, and the dict of the object that
// holds the chains (Triton keeps them on the class: replacing one adds it to the instance's dict),
// whose size changes when a chain is replaced rather than added to; then `refresh` makes the data
// again. A hook replaced by another where one was already replaced is seen at Python's next
// refresh (launch_path, a device's set-up).
class LaunchHooks {
 public:
  // hooks: None (no hooks to read), or (fixed reason or None, ((list, reason), ...), dict or None);
  // refresh: a callable returning such a value, or None.
  LaunchHooks(const py::object& hooks, py::object refresh);
  // Why a launch must go through Triton's own launcher (a hook is set), or null: the one
  // predicate of the direct launch.
  const char* reason();
  // Make the data again (Python's refresh, where hooks may have been replaced).
  void refresh();

 private:
  void set(const py::object& hooks);
  std::string fixed_;
  std::vector<std::pair<py::object, std::string>> lists_;
  py::object dict_;
  Py_ssize_t dict_size_ = 0;
  py::object refresh_;
};

// The list read of one device: a call's tensors packed as the list kernel's arguments
// (triton_kernels._list_kernel: Out, Accumulators, then (address, numel, word) per slot) and
// launched, at most kSlots tensors a launch, at most `max_formats` formats a launch (a launch
// with more is made once per group of them: no compiled variant holds more). The driver is what
// differs:
// - kCuda: cuLaunchKernel on the CUfunction Triton compiled for the launch's variant (libcuda
//   loaded at run time), once the variant is registered, direct launches allowed (the verdict
//   of the device's probe) and no Triton launch hook is set;
// - kCpu: the CPU kernel on the packed arguments (the cpu backend's list read);
// - kOrdinary: every launch through the Python callback (Triton's ordinary launch: the
//   interpreter, or no direct launch here);
// - kCount: no kernel: counts the launches and writes zero rows (a benchmark's stand-in for the
//   GPU; the path to it is the real one).
// A launch that cannot be made directly (a variant not registered yet, a launch hook set, no
// current CUDA context) goes through the callback, which launches it through Triton. On a CUDA
// device every launch, direct or not, is made with that device current and on torch's current
// stream there, whose own accumulators it uses.
// Hidden, as pybind11's own types are: it holds Python objects and lives in this module alone.
class __attribute__((visibility("hidden"))) Launcher {
 public:
  enum class Driver { kCuda, kCpu, kOrdinary, kCount };
  static constexpr int64_t kSlots = 8;
  static constexpr int64_t kArgs = 2 + 3 * kSlots;  // Out, Accumulators, (address, numel, word) per slot
  static constexpr int64_t kMaxLaunches = 4;

  // device: in the form its tensors report (cuda:N, cpu). direct_allowed: whether direct launches
  // may be made before allow_direct() (not for the cuda driver: its probe decides).
  Launcher(const std::string& driver, const c10::Device& device, const py::tuple& plain_types,
           const py::dict& words, int64_t aligned_bit, int64_t chunk, int64_t max_launches, int64_t max_formats,
           const at::Tensor& accumulators, int64_t groups, const py::object& launch_hooks, py::object refresh_hooks,
           bool direct_allowed, py::object ordinary);

  // Reads `count` tensors (Python objects) into the rows at `out` (device address of count rows
  // of 8 int64). [out_first, out_last): bytes no tensor may overlap (the rows' buffer). False,
  // with nothing launched, where a tensor is not taken (the caller's general path decides). A
  // failed driver call disables the launcher and raises. `direct`: 0 as allowed and as the launch
  // hooks decide, 1 direct wherever a variant is registered (the probe's self-check), -1 never.
  bool read(PyObject* const* items, int64_t count, int64_t out, int64_t out_first, int64_t out_last,
            int direct = 0);

  // Why Triton's ordinary launch must run instead of a direct one (a launch hook, a pre-run hook
  // of the kernel), or null: the one predicate (also `overflow-fast info`'s, through Python).
  const char* hooks_reason();
  void refresh_hooks() { hooks_.refresh(); }

  // A compiled variant (K slots, FORMATS, ANY_UNALIGNED) for kCuda, whose metadata Python
  // checked: its CUfunction, threads per program and dynamic shared memory. The driver's view
  // of the function's parameters is checked here too where the driver can tell; refused: why.
  std::string add_variant(int64_t slots, int64_t formats, bool any_unaligned, int64_t function, int64_t threads,
                          int64_t shared);

  // Direct launches happen only once allowed (the cuda driver: once its probe passed).
  void allow_direct() { direct_allowed_ = true; }
  bool direct_allowed() const { return direct_allowed_; }
  void disable(const std::string& why) { disabled_ = why; }
  const std::string& disabled() const { return disabled_; }
  Driver driver() const { return driver_; }
  const c10::Device& device() const { return rules_.device; }
  void* current_stream() const;

  // what it launched, for tests and benchmarks
  int64_t direct_launches = 0;
  int64_t ordinary_launches = 0;
  int64_t programs = 0;
  int64_t tensors_read = 0;
  int64_t bytes_read = 0;
  int64_t copies_made = 0;  // flat copies of tensors whose memory is not exactly their elements
  int64_t copy_bytes = 0;

 private:
  struct Variant {
    void* function;
    unsigned threads;
    unsigned shared;
  };
  static uint64_t variant_key(int64_t slots, int64_t formats, bool any_unaligned) {
    return (static_cast<uint64_t>(formats) << 8) | (static_cast<uint64_t>(slots) << 1) | (any_unaligned ? 1 : 0);
  }
  int64_t accumulators_of(int64_t stream);
  void launch_direct(const Variant* variant, void* stream, int64_t grid, int64_t* args, int64_t used);
  void launch_ordinary(int64_t grid, const int64_t* args, int64_t slots, int64_t formats, bool any_unaligned);

  Driver driver_;
  PackRules rules_;
  int64_t chunk_;
  int64_t max_launches_;
  int64_t max_formats_;
  at::Tensor accumulators_;  // [groups * kSlots, 8] int64 on the device, at identity
  int64_t groups_;
  std::vector<std::pair<int64_t, int64_t>> stream_groups_;  // stream id -> address of its accumulators
  std::unordered_map<uint64_t, Variant> variants_;
  void* context_ = nullptr;  // the CUDA context the variants were registered in
  std::array<c10::ScalarType, 32> dtype_of_code_{};  // kCpu: the dtype of each format code
  LaunchHooks hooks_;
  py::object ordinary_;       // callback(grid, args, K, FORMATS, ANY_UNALIGNED)
  bool direct_allowed_;
  std::string disabled_;
};

}  // namespace overflow_fast
