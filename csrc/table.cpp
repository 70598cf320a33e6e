// overflow_fast._C.triton_table: the Triton backend's table (triton_backend.py, _table) for a list
// of plain tensors, written straight into an int64 host tensor in one loop.
//
// On a GPU the host only issues kernels, so the per-tensor Python of building the table (a dozen
// attribute reads and list appends per tensor) is the cost of a detector hook. Here it is a few
// tens of nanoseconds per tensor. Only the common case is handled: any tensor this loop does not
// recognise as a plain strided tensor makes it return None, and Python takes its usual path.
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <c10/util/SmallVector.h>

#include "prefetch.h"

#include <algorithm>
#include <array>
#include <cstdint>
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

// The same rule as triton_backend._is_dense: the elements fill exactly numel slots from
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

}  // namespace

// tensors: a list. plain_types: the exact Python types read without questions (torch.Tensor,
// Parameter; subclasses go to Python). device: the one device every tensor must be on.
// words: {dtype: format word} of the dtypes taken here. chunk: elements per chunk. table: a
// contiguous int64 CPU tensor of at least 4 * T + 1 elements, filled as _table's list:
//   address[T], numel[T], word[T] (aligned_bit set on 16-byte aligned starts), first chunk[T + 1].
// [overlap_first, overlap_last): bytes of out's storage; non-empty tensors starting inside are
// listed (their exact extent is Python's to check). list_empty: list the empty tensors (ZeRO-3).
//
// Returns None when some tensor is not taken here (nothing else to use from the call), else
// (formats, any_unaligned, num_chunks, flat, overlaps, empties, dtypes): flat lists the tensors
// whose memory is not exactly their elements (not dense, or a lazy negation); their address and
// alignment bit are Python's to patch after its copy, and any_unaligned does not count them.
py::object triton_table(const py::list& tensors, const py::tuple& plain_types, const at::Device& device,
                        const py::dict& words, int64_t chunk, const at::Tensor& table, int64_t aligned_bit,
                        int64_t overlap_first, int64_t overlap_last, bool list_empty) {
  const int64_t count = static_cast<int64_t>(tensors.size());
  TORCH_CHECK(chunk > 0, "triton_table: chunk must be positive");
  TORCH_CHECK(table.device().is_cpu() && table.scalar_type() == at::kLong && table.is_contiguous() &&
                  table.numel() >= 4 * count + 1,
              "triton_table: table must be a contiguous int64 CPU tensor of at least 4 * len(tensors) + 1 elements");
  TORCH_CHECK(aligned_bit > 0 && (aligned_bit & (aligned_bit - 1)) == 0, "triton_table: aligned_bit must be a power of two");
  TORCH_CHECK(plain_types.size() <= 4, "triton_table: at most 4 plain types");

  // dtype -> (word, the dtype object), indexed by ScalarType; word -1: not taken here
  constexpr size_t kNumTypes = static_cast<size_t>(c10::ScalarType::NumOptions);
  std::array<int64_t, kNumTypes> word_of;
  std::array<PyObject*, kNumTypes> dtype_of{};
  word_of.fill(-1);
  for (const auto& item : words) {
    TORCH_CHECK(THPDtype_Check(item.first.ptr()), "triton_table: words must map dtypes to ints");
    const auto type = static_cast<size_t>(reinterpret_cast<THPDtype*>(item.first.ptr())->scalar_type);
    const int64_t word = item.second.cast<int64_t>();
    TORCH_CHECK(word >= 0 && (word & aligned_bit) == 0, "triton_table: a word must be >= 0 with aligned_bit clear");
    word_of[type] = word;
    dtype_of[type] = item.first.ptr();
  }
  std::array<PyTypeObject*, 4> plain{};
  for (size_t i = 0; i < plain_types.size(); ++i) {
    plain[i] = reinterpret_cast<PyTypeObject*>(plain_types[i].ptr());
  }
  static const c10::DispatchKeySet unreadable = unreadable_keys();
  const int64_t code_mask = aligned_bit - 1;  // the format code sits below the alignment bit

  int64_t* addresses = table.data_ptr<int64_t>();
  int64_t* numels = addresses + count;
  int64_t* table_words = addresses + 2 * count;
  int64_t* firsts = addresses + 3 * count;
  int64_t formats = 0;
  bool any_unaligned = false;
  int64_t num_chunks = 0;
  py::list flat, overlaps, empties;
  py::list dtypes(count);
  PyObject* const* items = PySequence_Fast_ITEMS(tensors.ptr());
  const auto is_plain = [&plain](PyObject* object) {
    return std::find(plain.begin(), plain.end(), Py_TYPE(object)) != plain.end();
  };
  for (int64_t index = 0; index < count; ++index) {
    prefetch_tensors(items, count, index, is_plain);
    PyObject* object = items[index];
    PyTypeObject* type = Py_TYPE(object);
    if (std::find(plain.begin(), plain.end(), type) == plain.end()) {  // unused entries are null
      return py::none();
    }
    const at::Tensor& tensor = THPVariable_Unpack(object);
    if (!tensor.defined() || tensor.layout() != at::kStrided || tensor.key_set().has_any(unreadable) ||
        tensor.is_nested() || !tensor.has_storage() || tensor.is_meta() || tensor.device() != device) {
      return py::none();
    }
    const auto scalar_type = static_cast<size_t>(tensor.scalar_type());
    const int64_t word = word_of[scalar_type];
    if (word < 0) {
      return py::none();
    }
    const int64_t numel = tensor.numel();
    const auto address = reinterpret_cast<int64_t>(tensor.data_ptr());
    const bool aligned = (address & 15) == 0;
    addresses[index] = address;
    numels[index] = numel;
    table_words[index] = aligned ? word | aligned_bit : word;
    firsts[index] = num_chunks;
    num_chunks += (numel + chunk - 1) / chunk;
    formats |= int64_t{1} << (word & code_mask);
    if (tensor.is_neg() || !(tensor.is_contiguous() || is_dense(tensor))) {
      flat.append(index);  // read through a copy: its own alignment counts, not this one
    } else {
      any_unaligned = any_unaligned || !aligned;
    }
    if (numel == 0) {
      if (list_empty) {
        empties.append(index);
      }
    } else if (overlap_first <= address && address < overlap_last) {
      overlaps.append(index);
    }
    PyList_SET_ITEM(dtypes.ptr(), index, py::reinterpret_borrow<py::object>(dtype_of[scalar_type]).release().ptr());
  }
  firsts[count] = num_chunks;
  return py::make_tuple(formats, any_unaligned, num_chunks, flat, overlaps, empties, dtypes);
}

}  // namespace overflow_fast
