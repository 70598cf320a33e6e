// What the Triton backend's kernels read of a list of tensors, in one loop: the table of its table
// kernels (overflow_fast._C.triton_table, triton_table.py's _table) and the list read
// (Launcher: the list kernel's arguments, launched from here).
//
// On a GPU the host only issues kernels, so the per-tensor Python of describing tensors (a dozen
// attribute reads and list appends per tensor) is the cost of a caller's read. Here it is a few
// tens of nanoseconds per tensor. Only the common case is handled: any tensor this loop does not
// recognise as a plain strided tensor makes it decline, and Python takes its usual path.
#include "launch.h"

#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/GradMode.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/SmallVector.h>

#include "prefetch.h"

#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>

namespace overflow_fast {
namespace {

// Keys of tensors whose memory is not simply theirs to read: wrappers (functorch, functional,
// Python dispatch), other layouts, and tensors without real data (zero tensors). Any of them
// sends the whole call to the Python path.
c10::DispatchKeySet unreadable_keys() {
  return c10::DispatchKeySet({
      c10::DispatchKey::Python,
      c10::DispatchKey::PythonTLSSnapshot,
      c10::DispatchKey::FuncTorchBatched,
      c10::DispatchKey::FuncTorchGradWrapper,
      c10::DispatchKey::BatchedNestedTensor,
      c10::DispatchKey::Functionalize,
      c10::DispatchKey::Sparse,
      c10::DispatchKey::SparseCsr,
      c10::DispatchKey::Quantized,
      c10::DispatchKey::NestedTensor,
      c10::DispatchKey::ZeroTensor,
      c10::DispatchKey::Conjugate,
  });
}

// The same rule as triton_table._is_dense: the elements fill exactly numel slots from
// data_ptr() on, in some order (dims of size 1 aside, sorted strides 1, size0, size0*size1, ...).
bool is_dense(const at::Tensor& tensor) {
  c10::SmallVector<std::pair<int64_t, int64_t>, 8> dims;  // (stride, size)
  const auto sizes = tensor.sizes();
  const auto strides = tensor.strides();
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] != 1) {
      dims.emplace_back(strides[d], sizes[d]);
    }
  }
  std::sort(dims.begin(), dims.end());
  int64_t expected = 1;
  for (const auto& [stride, size] : dims) {
    if (stride != expected) {
      return false;
    }
    expected *= size;
  }
  return true;
}

// Whether [address, address + bytes) lies inside the tensor's storage: a freed storage
// (resize_(0)) or a view past the end of a shrunk one would have a kernel read memory the tensor
// does not own (on a GPU, an illegal address that ends the CUDA context).
bool inside_storage(const at::Tensor& tensor, int64_t address, int64_t numel) {
  const c10::Storage& storage = tensor.unsafeGetTensorImpl()->unsafe_storage();
  const auto base = reinterpret_cast<uintptr_t>(storage.data());
  uint64_t bytes = 0;
  if (base == 0 || __builtin_mul_overflow(static_cast<uint64_t>(numel), static_cast<uint64_t>(tensor.element_size()),
                                          &bytes)) {
    return false;
  }
  const auto start = static_cast<uintptr_t>(address);
  return start >= base && start - base <= storage.nbytes() && bytes <= storage.nbytes() - (start - base);
}

// stats.kinds.is_zero3_released, the test's one owner, handed over once the module is loaded
// (set_zero3_released); unset, every empty tensor is left to the general path where DeepSpeed is
// loaded.
py::object& zero3_released() {
  static auto* test = new py::object();  // never destroyed: it may outlive the interpreter
  return *test;
}

// Whether `object` (an empty tensor, DeepSpeed loaded) may be a released ZeRO-3 parameter: its
// answer, or true where it has none or fails.
bool released(PyObject* object) {
  const py::object& test = zero3_released();
  if (!test) {
    return true;
  }
  PyObject* answer = PyObject_CallOneArg(test.ptr(), object);
  const int truth = answer == nullptr ? -1 : PyObject_IsTrue(answer);
  Py_XDECREF(answer);
  if (truth < 0) {
    PyErr_Clear();
    return true;
  }
  return truth == 1;
}

}  // namespace

PackRules::PackRules(const py::tuple& plain_types, const py::dict& words, int64_t aligned_bit_,
                     const c10::Device& device_)
    : aligned_bit(aligned_bit_), device(device_) {
  TORCH_CHECK(aligned_bit > 0 && (aligned_bit & (aligned_bit - 1)) == 0 && aligned_bit <= 32,
              "aligned_bit must be a power of two up to 32 (the format code sits below it)");
  TORCH_CHECK(plain_types.size() <= plain.size(), "at most ", plain.size(), " plain types");
  for (size_t i = 0; i < plain_types.size(); ++i) {
    TORCH_CHECK(PyType_Check(plain_types[i].ptr()), "plain_types must hold types");
    plain[i] = reinterpret_cast<PyTypeObject*>(plain_types[i].ptr());
  }
  word_of.fill(-1);
  for (const auto& item : words) {
    TORCH_CHECK(THPDtype_Check(item.first.ptr()), "words must map dtypes to ints");
    const auto type = static_cast<size_t>(reinterpret_cast<THPDtype*>(item.first.ptr())->scalar_type);
    const int64_t word = item.second.cast<int64_t>();
    TORCH_CHECK(word >= 0 && (word & aligned_bit) == 0, "a word must be >= 0 with aligned_bit clear");
    word_of[type] = word;
    dtype_of[type] = item.first.ptr();
  }
}

bool PackRules::is_plain(PyObject* object) const {
  return std::find(plain.begin(), plain.end(), Py_TYPE(object)) != plain.end();  // unused entries are null
}

Packed pack_tensor(PyObject* object, const PackRules& rules, Slot& slot, c10::ScalarType& dtype) {
  static const c10::DispatchKeySet unreadable = unreadable_keys();
  if (!rules.is_plain(object)) {
    return Packed::kRefused;
  }
  const at::Tensor& tensor = THPVariable_Unpack(object);
  if (!tensor.defined() || tensor.layout() != at::kStrided || tensor.key_set().has_any(unreadable) ||
      tensor.is_nested() || !tensor.has_storage() || tensor.is_meta() || tensor.device() != rules.device) {
    return Packed::kRefused;
  }
  dtype = tensor.scalar_type();
  const int64_t word = rules.word_of[static_cast<size_t>(dtype)];
  if (word < 0) {
    return Packed::kRefused;
  }
  const int64_t numel = tensor.numel();
  const auto address = reinterpret_cast<int64_t>(tensor.data_ptr());
  slot = Slot{address, numel, (address & 15) == 0 ? word | rules.aligned_bit : word};
  if (tensor.is_neg() || !(tensor.is_contiguous() || is_dense(tensor))) {
    return Packed::kFlat;  // its memory holds other values or other elements: read through a copy
  }
  if (numel > 0 && !inside_storage(tensor, address, numel)) {
    return Packed::kRefused;
  }
  return Packed::kTaken;
}

// tensors: a list. plain_types: the exact Python types read without questions (torch.Tensor,
// Parameter; subclasses go to Python). device: the one device every tensor must be on.
// words: {dtype: format word} of the dtypes taken here. chunk: elements per chunk. table: a
// contiguous int64 CPU tensor of at least 4 * T + 1 elements, filled as _table's list:
//   address[T], numel[T], word[T] (aligned_bit set on 16-byte aligned starts), first chunk[T + 1].
// [overlap_first, overlap_last): bytes of out's storage; non-empty tensors starting inside are
// listed (their exact extent is Python's to check). list_empty: list the empty tensors (ZeRO-3).
//
// Returns None when some tensor is not taken here (nothing else to use from the call), else
// (formats, unaligned, num_chunks, flat, overlaps, empties, dtypes): formats and unaligned are
// bitmasks of format codes (those present; those of a tensor starting unaligned); flat lists the tensors
// whose memory is not exactly their elements (not dense, or a lazy negation); their address and
// alignment bit are Python's to patch after its copy, and unaligned does not count them.
py::object triton_table(const py::list& tensors, const py::tuple& plain_types, const at::Device& device,
                        const py::dict& words, int64_t chunk, const at::Tensor& table, int64_t aligned_bit,
                        int64_t overlap_first, int64_t overlap_last, bool list_empty) {
  const int64_t count = static_cast<int64_t>(tensors.size());
  TORCH_CHECK(chunk > 0, "triton_table: chunk must be positive");
  TORCH_CHECK(table.device().is_cpu() && table.scalar_type() == at::kLong && table.is_contiguous() &&
                  table.numel() >= 4 * count + 1,
              "triton_table: table must be a contiguous int64 CPU tensor of at least 4 * len(tensors) + 1 elements");
  const PackRules rules(plain_types, words, aligned_bit, device);
  const int64_t code_mask = rules.code_mask();

  int64_t* addresses = table.data_ptr<int64_t>();
  int64_t* numels = addresses + count;
  int64_t* table_words = addresses + 2 * count;
  int64_t* firsts = addresses + 3 * count;
  int64_t formats = 0;
  int64_t unaligned = 0;
  int64_t num_chunks = 0;
  py::list flat, overlaps, empties;
  py::list dtypes(count);
  PyObject* const* items = PySequence_Fast_ITEMS(tensors.ptr());
  const auto is_plain = [&rules](PyObject* object) { return rules.is_plain(object); };
  for (int64_t index = 0; index < count; ++index) {
    prefetch_tensors(items, count, index, is_plain);
    Slot slot{};
    c10::ScalarType dtype{};
    const Packed packed = pack_tensor(items[index], rules, slot, dtype);
    if (packed == Packed::kRefused) {
      return py::none();
    }
    addresses[index] = slot.address;
    numels[index] = slot.numel;
    table_words[index] = slot.word;
    firsts[index] = num_chunks;
    num_chunks += (slot.numel + chunk - 1) / chunk;
    formats |= int64_t{1} << (slot.word & code_mask);
    if (packed == Packed::kFlat) {
      flat.append(index);  // read through a copy: its own alignment counts, not this one
    } else {
      unaligned |= (slot.word & aligned_bit) == 0 ? int64_t{1} << (slot.word & code_mask) : 0;
    }
    if (slot.numel == 0) {
      if (list_empty) {
        empties.append(index);
      }
    } else if (overlap_first <= slot.address && slot.address < overlap_last) {
      overlaps.append(index);
    }
    PyList_SET_ITEM(dtypes.ptr(), index,
                    py::reinterpret_borrow<py::object>(rules.dtype_of[static_cast<size_t>(dtype)]).release().ptr());
  }
  firsts[count] = num_chunks;
  return py::make_tuple(formats, unaligned, num_chunks, flat, overlaps, empties, dtypes);
}

// ---- the CUDA driver, loaded at run time ----------------------------------------------------------
//
// The package is built without CUDA: the few driver entry points the direct launch uses are
// declared here with the driver API's C signatures (cuda.h) and looked up in libcuda.so.1, which
// any process running CUDA tensors has loaded.
namespace {

using CUresult = int;
using cuLaunchKernel_t = CUresult (*)(void* f, unsigned grid_x, unsigned grid_y, unsigned grid_z, unsigned block_x,
                                      unsigned block_y, unsigned block_z, unsigned shared_bytes, void* stream,
                                      void** params, void** extra);
using cuCtxGetCurrent_t = CUresult (*)(void** context);
using cuGetErrorString_t = CUresult (*)(CUresult error, const char** text);
using cuFuncGetParamInfo_t = CUresult (*)(void* f, size_t index, size_t* offset, size_t* size);  // CUDA 12.4+

struct CudaDriver {
  cuLaunchKernel_t launch = nullptr;
  cuCtxGetCurrent_t current_context = nullptr;
  cuGetErrorString_t error_string = nullptr;
  cuFuncGetParamInfo_t param_info = nullptr;  // null on older drivers
  std::string missing;                         // why the driver cannot be used; empty when it can
};

const CudaDriver& cuda_driver() {
  static const CudaDriver driver = [] {
    CudaDriver d;
    void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (library == nullptr) {
      library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    }
    if (library == nullptr) {
      const char* error = dlerror();
      d.missing = std::string("libcuda.so.1 cannot be loaded (") + (error != nullptr ? error : "unknown error") + ")";
      return d;
    }
    d.launch = reinterpret_cast<cuLaunchKernel_t>(dlsym(library, "cuLaunchKernel"));
    d.current_context = reinterpret_cast<cuCtxGetCurrent_t>(dlsym(library, "cuCtxGetCurrent"));
    d.error_string = reinterpret_cast<cuGetErrorString_t>(dlsym(library, "cuGetErrorString"));
    d.param_info = reinterpret_cast<cuFuncGetParamInfo_t>(dlsym(library, "cuFuncGetParamInfo"));
    if (d.launch == nullptr || d.current_context == nullptr || d.error_string == nullptr) {
      d.missing = "libcuda.so.1 lacks cuLaunchKernel, cuCtxGetCurrent or cuGetErrorString";
    }
    return d;
  }();
  return driver;
}

std::string cuda_error(CUresult code) {
  const char* text = nullptr;
  if (cuda_driver().error_string == nullptr || cuda_driver().error_string(code, &text) != 0 || text == nullptr) {
    return "CUDA error " + std::to_string(code);
  }
  return std::string(text) + " (CUDA error " + std::to_string(code) + ")";
}

Launcher::Driver driver_named(const std::string& name) {
  if (name == "cuda") {
    return Launcher::Driver::kCuda;
  }
  if (name == "cpu") {
    return Launcher::Driver::kCpu;
  }
  if (name == "ordinary") {
    return Launcher::Driver::kOrdinary;
  }
  TORCH_CHECK(name == "count", "Launcher: driver must be 'cuda', 'cpu', 'ordinary' or 'count', got '", name, "'");
  return Launcher::Driver::kCount;
}

// The variant of a launch of `used` tensors: the fewest slots of 1, 2, 4, 8 that hold them.
int64_t variant_slots(int64_t used) {
  int64_t slots = 1;
  while (slots < used) {
    slots *= 2;
  }
  return slots;
}

}  // namespace

// ---- the list read's launcher ------------------------------------------------------------------

Launcher::Launcher(const std::string& driver, const c10::Device& device, const py::tuple& plain_types,
                   const py::dict& words, int64_t aligned_bit, int64_t chunk, int64_t max_launches,
                   int64_t max_formats, const at::Tensor& accumulators, int64_t groups,
                   const py::object& launch_hooks, py::object refresh_hooks, bool direct_allowed,
                   py::object ordinary)
    : driver_(driver_named(driver)),
      rules_(plain_types, words, aligned_bit, device),
      chunk_(chunk),
      max_launches_(max_launches),
      max_formats_(max_formats),
      accumulators_(accumulators),
      groups_(groups),
      hooks_(launch_hooks, std::move(refresh_hooks)),
      ordinary_(std::move(ordinary)),
      direct_allowed_(direct_allowed && driver_ != Driver::kCuda) {
  TORCH_CHECK(chunk > 0, "Launcher: chunk must be positive");
  TORCH_CHECK(max_launches > 0 && max_launches <= kMaxLaunches, "Launcher: max_launches must be in [1, ",
              kMaxLaunches, "]");
  TORCH_CHECK(max_formats > 0, "Launcher: max_formats must be positive");
  // the form its tensors report: a tensor's device is compared with it, and an index-less CUDA
  // device (or an indexed CPU one) would match none
  TORCH_CHECK(device.is_cpu() ? !device.has_index() : device.has_index(), "Launcher: the device must be named as its ",
              "tensors report it (cuda:N, cpu), got ", device);
  if (driver_ == Driver::kCuda) {
    TORCH_CHECK(device.is_cuda(), "Launcher: the cuda driver needs a CUDA device");
    TORCH_CHECK(cuda_driver().missing.empty(), "Launcher: ", cuda_driver().missing);
  }
  if (driver_ != Driver::kCpu) {
    TORCH_CHECK(accumulators.defined() && accumulators.device() == device && accumulators.scalar_type() == at::kLong &&
                    accumulators.is_contiguous() && accumulators.dim() == 2 && accumulators.size(1) == 8 &&
                    groups > 0 && accumulators.size(0) >= groups * kSlots,
                "Launcher: accumulators must be a contiguous int64 [groups * ", kSlots,
                ", 8] tensor on the launcher's device");
  }
  for (size_t type = 0; type < rules_.word_of.size(); ++type) {
    if (rules_.word_of[type] >= 0) {
      dtype_of_code_.at(static_cast<size_t>(rules_.word_of[type] & rules_.code_mask())) =
          static_cast<c10::ScalarType>(type);
    }
  }
}

// c10::Stream::native_handle (the CUDA stream the direct launch runs on) is absent from older
// torches' headers (torch 2.7's): there the direct launch is off and Triton's own launch runs.
template <typename S, typename = void>
struct HasNativeHandle : std::false_type {};
template <typename S>
struct HasNativeHandle<S, std::void_t<decltype(std::declval<const S&>().native_handle())>> : std::true_type {};

template <typename S>
void* native_handle_of(const S& stream) {
  if constexpr (HasNativeHandle<S>::value) {
    return stream.native_handle();
  } else {
    return nullptr;
  }
}

LaunchHooks::LaunchHooks(const py::object& hooks, py::object refresh) : refresh_(std::move(refresh)) { set(hooks); }

void LaunchHooks::set(const py::object& hooks) {
  fixed_.clear();
  lists_.clear();
  dict_ = py::none();
  if (hooks.is_none()) {
    return;
  }
  const auto parts = hooks.cast<py::tuple>();
  TORCH_CHECK(parts.size() == 3, "launch hooks: (fixed reason or None, ((list, reason), ...), dict or None)");
  if (!parts[0].is_none()) {
    fixed_ = parts[0].cast<std::string>();
  }
  for (const auto& item : parts[1].cast<py::tuple>()) {
    const auto pair = item.cast<py::tuple>();
    TORCH_CHECK(pair.size() == 2 && PyList_Check(pair[0].ptr()), "launch hooks: each watched entry is (list, reason)");
    lists_.emplace_back(py::reinterpret_borrow<py::object>(pair[0]), pair[1].cast<std::string>());
  }
  if (!parts[2].is_none()) {
    TORCH_CHECK(PyDict_CheckExact(parts[2].ptr()), "launch hooks: the watched holder must be a dict");
    dict_ = py::reinterpret_borrow<py::object>(parts[2]);
    dict_size_ = PyDict_GET_SIZE(dict_.ptr());
  }
}

const char* LaunchHooks::reason() {
  if (!HasNativeHandle<c10::Stream>::value) {
    return "this torch's c10::Stream has no native_handle (as torch 2.7's): the direct launch needs it";
  }
  if (!dict_.is_none() && PyDict_GET_SIZE(dict_.ptr()) != dict_size_) {
    refresh();  // a chain replaced, not added to: read them again
  }
  if (!fixed_.empty()) {
    return fixed_.c_str();
  }
  for (const auto& [list, why] : lists_) {
    if (PyList_GET_SIZE(list.ptr()) != 0) {
      return why.c_str();
    }
  }
  return nullptr;
}

void LaunchHooks::refresh() {
  if (refresh_.is_none()) {
    return;
  }
  try {
    set(refresh_());
  } catch (py::error_already_set& error) {
    if (error.matches(PyExc_KeyboardInterrupt)) {
      throw;
    }
    fixed_ = std::string("Triton's launch hooks cannot be read (") + error.what() + ")";
    lists_.clear();
    dict_ = py::none();
  }
}

const char* Launcher::hooks_reason() { return hooks_.reason(); }

void* Launcher::current_stream() const {
  if (!rules_.device.is_cuda()) {
    return nullptr;
  }
  const c10::impl::DeviceGuardImplInterface* guard = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  return native_handle_of(guard->getStream(rules_.device));
}

std::string Launcher::add_variant(int64_t slots, int64_t formats, bool any_unaligned, int64_t function,
                                  int64_t threads, int64_t shared) {
  TORCH_CHECK(driver_ == Driver::kCuda, "Launcher.add_variant: only the cuda driver launches compiled variants");
  TORCH_CHECK(slots == 1 || slots == 2 || slots == 4 || slots == kSlots, "Launcher.add_variant: slots must be 1, 2, 4 or 8");
  if (function == 0) {
    return "the compiled kernel has no CUfunction";
  }
  if (threads <= 0 || threads > 1024 || threads % 32 != 0) {
    return "threads per program " + std::to_string(threads) + " is not a multiple of 32 up to 1024";
  }
  if (shared < 0 || shared > 227 * 1024) {
    return "dynamic shared memory " + std::to_string(shared) + " bytes needs a launch attribute";
  }
  void* context = nullptr;
  if (cuda_driver().current_context(&context) != 0 || context == nullptr) {
    return "no current CUDA context where the variant was compiled";
  }
  if (context_ != nullptr && context != context_) {
    return "the variant was compiled in another CUDA context than the others";
  }
  // The driver's view of the function's parameters, where it can tell (CUDA 12.4+): exactly
  // kArgs 8-byte values then the two scratch pointers, back to back; nothing after them.
  const auto param_info = cuda_driver().param_info;
  if (param_info != nullptr) {
    void* f = reinterpret_cast<void*>(function);
    for (size_t index = 0; index < static_cast<size_t>(kArgs + 2); ++index) {
      size_t offset = 0, size = 0;
      const CUresult result = param_info(f, index, &offset, &size);
      if (result != 0) {
        return "cuFuncGetParamInfo(" + std::to_string(index) + "): " + cuda_error(result);
      }
      if (offset != 8 * index || size != 8) {
        return "parameter " + std::to_string(index) + " at offset " + std::to_string(offset) + ", " +
               std::to_string(size) + " bytes; the launch passes 8 bytes at " + std::to_string(8 * index);
      }
    }
    size_t offset = 0, size = 0;
    if (param_info(f, static_cast<size_t>(kArgs + 2), &offset, &size) == 0) {
      return "the compiled kernel takes more than " + std::to_string(kArgs + 2) + " parameters";
    }
  }
  context_ = context;
  variants_[variant_key(slots, formats, any_unaligned)] =
      Variant{reinterpret_cast<void*>(function), static_cast<unsigned>(threads), static_cast<unsigned>(shared)};
  return "";
}

int64_t Launcher::accumulators_of(int64_t stream) {
  for (const auto& [known, address] : stream_groups_) {
    if (known == stream) {
      return address;
    }
  }
  const auto used = static_cast<int64_t>(stream_groups_.size());
  if (used >= groups_) {
    return -1;
  }
  const int64_t address = reinterpret_cast<int64_t>(accumulators_.data_ptr()) + used * kSlots * 64;
  stream_groups_.emplace_back(stream, address);
  return address;
}

bool Launcher::read(PyObject* const* items, int64_t count, int64_t out, int64_t out_first, int64_t out_last,
                    int direct) {
  if (count == 0) {
    return true;
  }
  if (!disabled_.empty() || count > kSlots * max_launches_) {
    return false;
  }
  // Every tensor is checked before anything is launched: a refusal leaves nothing half done.
  std::array<Slot, kSlots * kMaxLaunches> slots;
  std::array<int64_t, kMaxLaunches> grids{};
  const int64_t code_mask = rules_.code_mask();
  int zero3 = -1;  // whether DeepSpeed is loaded: asked at the first empty tensor
  int64_t bytes = 0;
  c10::SmallVector<int64_t, 4> flat;  // tensors read through a flat copy
  for (int64_t index = 0; index < count; ++index) {
    Slot& slot = slots[index];
    c10::ScalarType dtype{};
    const Packed packed = pack_tensor(items[index], rules_, slot, dtype);
    if (packed == Packed::kRefused) {
      return false;
    }
    if (packed == Packed::kFlat) {
      flat.push_back(index);  // a fresh copy: nothing to overlap
    } else if (slot.numel == 0) {
      // a released ZeRO-3 parameter is an empty placeholder: the general path reads its partitions
      if (zero3 < 0) {
        zero3 = PyDict_GetItemString(PyImport_GetModuleDict(), "deepspeed") != nullptr;
      }
      if (zero3 > 0 && released(items[index])) {
        return false;
      }
    } else {
      const int64_t extent = slot.numel * static_cast<int64_t>(c10::elementSize(dtype));
      if (slot.address < out_last && out_first < slot.address + extent) {
        return false;  // the rows would overwrite it: the general path says so
      }
    }
    bytes += slot.numel * static_cast<int64_t>(c10::elementSize(dtype));
    // an empty tensor takes one program (its row is written), an unused slot none
    const int64_t programs = std::max<int64_t>((slot.numel + chunk_ - 1) / chunk_, 1);
    int64_t& grid = grids[index / kSlots];
    if (grid > (int64_t{1} << 31) - 1 - programs) {
      return false;  // past a launch's grid: the table kernels
    }
    grid += programs;
  }

  // On a CUDA device, whatever the driver (Triton's ordinary launch too): the tensors' device
  // current (cuda:1 under device_map="auto"), as Triton's launch and ATen's guards do, and the
  // accumulators of torch's current stream there (two streams' launches may run at once).
  std::optional<c10::DeviceGuard> guard;
  void* stream = nullptr;
  int64_t stream_id = 0;
  if (rules_.device.is_cuda()) {
    const c10::impl::DeviceGuardImplInterface* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    if (impl->getDevice() != rules_.device) {
      guard.emplace(rules_.device);
    }
    const c10::Stream current = impl->getStream(rules_.device);
    stream = native_handle_of(current);
    stream_id = static_cast<int64_t>(current.id());
  }
  int64_t accumulators = 0;
  if (driver_ != Driver::kCpu) {
    accumulators = accumulators_of(stream_id);
    if (accumulators < 0) {
      return false;  // more streams than accumulator groups
    }
  }
  // Rare (a transposed slice, an expanded bias, a lazy negation): read through a flat copy (one
  // device copy, enqueued before the read on the same stream), alive until the launches are.
  c10::SmallVector<at::Tensor, 4> copies;
  for (const int64_t index : flat) {
    const at::Tensor& tensor = THPVariable_Unpack(items[index]);
    at::Tensor copy;
    try {
      c10::AutoGradMode no_grad(false);
      if (driver_ == Driver::kCount) {  // the stand-in for a GPU: a copy's memory, never read
        copy = at::empty({tensor.numel()}, tensor.options());
      } else {
        copy = tensor.is_neg() ? tensor.resolve_neg() : tensor.contiguous();
      }
    } catch (const c10::Error&) {
      return false;  // e.g. no negation for float8: the general path reads it its own way
    }
    const auto address = reinterpret_cast<int64_t>(copy.data_ptr());
    const int64_t word = slots[index].word & ~rules_.aligned_bit;
    slots[index].address = address;
    slots[index].word = (address & 15) == 0 ? word | rules_.aligned_bit : word;
    ++copies_made;
    copy_bytes += copy.numel() * static_cast<int64_t>(copy.element_size());
    copies.push_back(std::move(copy));
  }
  tensors_read += count;
  bytes_read += bytes;
  bool may_direct = driver_ != Driver::kOrdinary && direct >= 0 &&
                    (direct > 0 || (direct_allowed_ && hooks_reason() == nullptr));
  if (may_direct && driver_ == Driver::kCuda) {
    // the variants' context, current on this thread (a thread that has not used CUDA yet has
    // none: Triton's launch makes it current)
    void* context = nullptr;
    may_direct = cuda_driver().current_context(&context) == 0 && context != nullptr && context == context_;
  }
  for (int64_t begin = 0, launch = 0; begin < count; begin += kSlots, ++launch) {
    const int64_t used = std::min<int64_t>(kSlots, count - begin);
    std::array<int64_t, kArgs> args;
    args[0] = out + begin * 64;
    args[1] = accumulators;
    // each format code present, in code order, and whether a tensor of it starts unaligned
    uint32_t present = 0;
    uint32_t unaligned = 0;
    for (int64_t i = 0; i < kSlots; ++i) {
      const bool filled = i < used;
      const Slot& slot = slots[begin + (filled ? i : 0)];
      args[2 + 3 * i] = filled ? slot.address : 0;
      args[3 + 3 * i] = filled ? slot.numel : -1;  // an unused slot: no programs
      args[4 + 3 * i] = filled ? slot.word : 0;
      if (filled) {
        const uint32_t bit = uint32_t{1} << (slot.word & code_mask);
        present |= bit;
        unaligned |= (slot.word & rules_.aligned_bit) == 0 ? bit : 0;
      }
    }
    const int64_t variant = variant_slots(used);
    // one launch per group of at most max_formats formats: its programs of other formats do nothing
    // (the CPU kernel compiles nothing and reads every format at once)
    const int64_t group = driver_ == Driver::kCpu ? 32 : max_formats_;
    while (present != 0) {
      uint32_t formats = 0;
      for (int64_t taken = 0; taken < group && present != 0; ++taken) {
        const uint32_t lowest = present & (~present + 1);
        formats |= lowest;
        present &= ~lowest;
      }
      const bool any_unaligned = (unaligned & formats) != 0;
      const Variant* compiled = nullptr;
      if (may_direct && driver_ == Driver::kCuda) {
        const auto found = variants_.find(variant_key(variant, formats, any_unaligned));
        compiled = found == variants_.end() ? nullptr : &found->second;
      }
      if (may_direct && (driver_ != Driver::kCuda || compiled != nullptr)) {
        launch_direct(compiled, stream, grids[launch], args.data(), used);
      } else {
        launch_ordinary(grids[launch], args.data(), variant, formats, any_unaligned);
      }
    }
  }
  return true;
}

void Launcher::launch_direct(const Variant* variant, void* stream, int64_t grid, int64_t* args, int64_t used) {
  programs += grid;
  ++direct_launches;
  if (driver_ == Driver::kCount) {
    std::memset(reinterpret_cast<void*>(args[0]), 0, static_cast<size_t>(used) * 64);
    return;
  }
  if (driver_ == Driver::kCpu) {
    std::array<FlatTensor, kSlots> flat;
    int64_t bytes = 0;
    for (int64_t i = 0; i < used; ++i) {
      const Slot slot{args[2 + 3 * i], args[3 + 3 * i], args[4 + 3 * i]};
      const c10::ScalarType dtype = dtype_of_code_[static_cast<size_t>(slot.word & rules_.code_mask())];
      flat[i] = FlatTensor{reinterpret_cast<const void*>(slot.address), slot.numel, dtype};
      bytes += slot.numel * static_cast<int64_t>(c10::elementSize(dtype));
    }
    int64_t* rows = reinterpret_cast<int64_t*>(args[0]);
    if (bytes >= (int64_t{1} << 20)) {  // long enough that other Python threads should run meanwhile
      py::gil_scoped_release release;
      compute_flat(flat.data(), used, rows);
    } else {
      compute_flat(flat.data(), used, rows);
    }
    return;
  }
  // kCuda: the parameters the compiled kernel declares (checked in add_variant): the kArgs int64
  // values, then Triton's global and profile scratch pointers, null (the variant uses neither)
  int64_t scratch[2] = {0, 0};
  void* params[kArgs + 2];
  for (int64_t i = 0; i < kArgs; ++i) {
    params[i] = &args[i];
  }
  params[kArgs] = &scratch[0];
  params[kArgs + 1] = &scratch[1];
  const CUresult result = cuda_driver().launch(variant->function, static_cast<unsigned>(grid), 1, 1,
                                               variant->threads, 1, 1, variant->shared, stream, params, nullptr);
  if (result != 0) {
    disabled_ = "cuLaunchKernel failed: " + cuda_error(result);
    TORCH_CHECK(false, "overflow_fast: the list kernel's direct launch failed: ", cuda_error(result));
  }
}

void Launcher::launch_ordinary(int64_t grid, const int64_t* args, int64_t slots, int64_t formats, bool any_unaligned) {
  TORCH_CHECK(!ordinary_.is_none(), "Launcher: no ordinary launch to fall back on");
  programs += grid;
  ++ordinary_launches;
  py::tuple values(kArgs);
  for (int64_t i = 0; i < kArgs; ++i) {
    values[i] = py::int_(args[i]);
  }
  ordinary_(grid, values, slots, formats, any_unaligned);
}

// ---- the Python face ---------------------------------------------------------------------------

void add_launcher(py::module& m) {
  m.def(
      "set_zero3_released", [](py::object test) { zero3_released() = std::move(test); }, py::arg("test"),
      "The test of a released ZeRO-3 parameter the launchers ask of an empty tensor (stats.kinds')");
  m.def(
      "launch_hooks_reason",
      [](const py::object& hooks) -> py::object {
        LaunchHooks watched(hooks, py::none());
        const char* reason = watched.reason();
        return reason == nullptr ? py::none() : py::object(py::str(reason));
      },
      py::arg("launch_hooks"),
      "Why a Triton launch must go through Triton (a launch hook, a pre-run hook), or None, from the plain data "
      "of triton_launch.launch_hooks: the predicate of Launcher's direct launch");
  py::class_<Launcher, std::shared_ptr<Launcher>>(
      m, "Launcher", "The list read of one device: pack a call's tensors, launch the list kernel (table.cpp)")
      .def(py::init<const std::string&, const c10::Device&, const py::tuple&, const py::dict&, int64_t, int64_t, int64_t,
                    int64_t, const at::Tensor&, int64_t, const py::object&, py::object, bool, py::object>(),
           py::arg("driver"), py::arg("device"), py::arg("plain_types"), py::arg("words"), py::arg("aligned_bit"),
           py::arg("chunk"), py::arg("max_launches"), py::arg("max_formats"), py::arg("accumulators"),
           py::arg("groups"), py::arg("launch_hooks"), py::arg("refresh_hooks"), py::arg("direct_allowed"),
           py::arg("ordinary"))
      .def(
          "read",
          [](Launcher& self, const py::list& tensors, const at::Tensor& out, int direct) {
            const auto count = static_cast<int64_t>(tensors.size());
            if (out.device() != self.device() || out.scalar_type() != at::kLong || !out.is_contiguous() ||
                out.dim() != 2 || out.size(0) != count || out.size(1) != 8 || out.is_neg() ||
                out.key_set().has_any(c10::python_ks)) {
              return false;
            }
            const auto first = reinterpret_cast<int64_t>(out.data_ptr());
            return self.read(PySequence_Fast_ITEMS(tensors.ptr()), count, first, first, first + count * 64, direct);
          },
          py::arg("tensors"), py::arg("out"), py::arg("direct") = 0,
          "Rows of `tensors` into `out` ([len, 8] int64 on the device); False when declined (nothing launched)")
      .def("hooks_reason",
           [](Launcher& self) -> py::object {
             const char* reason = self.hooks_reason();
             return reason == nullptr ? py::none() : py::object(py::str(reason));
           })
      .def("add_variant", &Launcher::add_variant, py::arg("slots"), py::arg("formats"), py::arg("any_unaligned"),
           py::arg("function"), py::arg("threads"), py::arg("shared"))
      .def("current_stream", [](const Launcher& self) { return reinterpret_cast<int64_t>(self.current_stream()); })
      .def("refresh_hooks", &Launcher::refresh_hooks)
      .def("allow_direct", &Launcher::allow_direct)
      .def_property_readonly("direct_allowed", &Launcher::direct_allowed)
      .def("disable", &Launcher::disable, py::arg("why"))
      .def_property_readonly("disabled", [](const Launcher& self) -> py::object {
        return self.disabled().empty() ? py::none() : py::object(py::str(self.disabled()));
      })
      .def_property_readonly("driver", [](const Launcher& self) {
        static const char* const kNames[] = {"cuda", "cpu", "ordinary", "count"};
        return std::string(kNames[static_cast<int>(self.driver())]);
      })
      .def_readonly("direct_launches", &Launcher::direct_launches)
      .def_readonly("ordinary_launches", &Launcher::ordinary_launches)
      .def_readonly("programs", &Launcher::programs)
      .def_readonly("tensors_read", &Launcher::tensors_read)
      .def_readonly("bytes_read", &Launcher::bytes_read)
      .def_readonly("copies", &Launcher::copies_made)
      .def_readonly("copy_bytes", &Launcher::copy_bytes);
}

}  // namespace overflow_fast
