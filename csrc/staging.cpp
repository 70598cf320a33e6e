// overflow_fast._C.frame_entries, stage_tensors, all_unchanged: the per-tensor loops a detector hook
// runs with check="batch" (frames.py forward_items + entries_of; rows.py _stage, _all_unchanged),
// in C++; make_frame and make_call: the two objects a hook makes. They take and build the same Python objects as their Python twins, which stay the
// fallback and the specification (tests/test_staging_native.py holds the two equal).
//
// On a GPU the host only issues kernels, so a hook's Python is the detector's cost: each tensor
// attribute read costs ~100 ns there (a dozen per tensor), a few ns here. These are raw CPython
// METH_FASTCALL functions: pybind11's argument dispatch would cost as much as the work.
#include <torch/extension.h>

#include <structmember.h>

#include "prefetch.h"

#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>

#include <c10/util/SmallVector.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <unordered_map>

namespace overflow_fast {
namespace {

// Set once by hook_setup (when overflow_fast.native is imported); strong references, never released.
struct HookConstants {
  bool ready = false;
  PyTypeObject* plain[2] = {nullptr, nullptr};  // torch.Tensor, torch.nn.Parameter: read without questions
  std::array<bool, static_cast<size_t>(c10::ScalarType::NumOptions)> supported{};
  PyObject* input_names = nullptr;   // ["input[0]", ...]: a list, shared with frames.py
  PyObject* output_names = nullptr;  // ["output[0]", ...]
  PyObject* unreadable_reason = nullptr;  // stats.unreadable_reason
  PyObject* input = nullptr;   // "input"
  PyObject* output = nullptr;  // "output"
  // attribute names of rows.py's _DeviceRows, interned once (a C string would be decoded and
  // hashed at every lookup)
  PyObject* used = nullptr;
  PyObject* launched = nullptr;
  PyObject* staged = nullptr;
  PyObject* versions = nullptr;
  PyObject* pointers = nullptr;
  PyObject* buffer = nullptr;
  PyObject* slot_sources = nullptr;
  PyObject* dataclass_fields = nullptr;
  // stage_call's: rows.py's DeferredRows, ReuseCache and _DeviceRows attributes, a frame's rows
  PyObject* last_state = nullptr;
  PyObject* pending = nullptr;
  PyObject* pending_modes = nullptr;
  PyObject* capacity = nullptr;
  PyObject* devices = nullptr;
  PyObject* modes = nullptr;
  PyObject* watched = nullptr;
  PyObject* watched_bytes = nullptr;
  PyObject* stage_bytes = nullptr;
  PyObject* enabled = nullptr;
  PyObject* open = nullptr;
  PyObject* reuse_rows = nullptr;
  PyObject* stages = nullptr;
  PyObject* infos = nullptr;
  PyObject* staged_bytes = nullptr;
  PyObject* rows = nullptr;
  PyObject* deepspeed = nullptr;
  Py_ssize_t max_remembered = 0;  // reuse.py _MAX_REMEMBERED
};
HookConstants g;

// A hook's own objects (its Frame and Call, the lists of its entries, dtypes, tensors and row
// sources, a new tensor's reuse entry and weak reference) hold only strings, ints, dtypes, tensors
// and (buffer, slot) tuples: they can never close a reference cycle. Left to the collector, the ~6 of them each hook keeps until the
// forward's read are most of what its gen-0 collections walk (~1 us per hook on the GPT-2 small
// sequence, a sixth of the hook); untracked, they are freed by reference counting alone. Returns
// `object` (null stays null).
PyObject* untracked(PyObject* object) {
  if (object != nullptr && PyObject_GC_IsTracked(object)) {
    PyObject_GC_UnTrack(object);
  }
  return object;
}

// Entry kinds (report.py) and staging modes (rows.py).
constexpr long kTensor = 0, kNone = 1, kNotATensor = 2, kUnreadable = 3;
constexpr long kUnknown = 0, kStage = 1;

// The entry tuples (kind, ctx, payload) of calls whose ctx is a long-lived string (a parameter's
// name, "input[0]", "output"): the same tuple serves every forward instead of a new one per hook
// (each tuple made is also one more object for Python's collector to visit). The cache holds the
// tuples, and through them their ctx strings, so a cached ctx pointer is never reused by another
// string. Cleared when it grows past kMaxCachedEntries (modules made and dropped at run time).
struct EntryKey {
  PyObject* ctx;
  long kind;
  Py_ssize_t index;  // the row index of a tensor entry, -1 for the others
  bool operator==(const EntryKey& other) const {
    return ctx == other.ctx && kind == other.kind && index == other.index;
  }
};
struct EntryKeyHash {
  size_t operator()(const EntryKey& key) const {
    return std::hash<const void*>()(key.ctx) ^ (static_cast<size_t>(key.index + 1) * 0x9E3779B97F4A7C15ULL) ^
           static_cast<size_t>(key.kind);
  }
};
constexpr size_t kMaxCachedEntries = 1 << 14;
std::unordered_map<EntryKey, PyObject*, EntryKeyHash> g_entries;

// A new reference to the entry (kind, ctx, payload); payload is stolen.
PyObject* entry_tuple(long kind, PyObject* ctx, PyObject* payload, Py_ssize_t index, bool stable_ctx) {
  const bool cacheable = stable_ctx && kind != kUnreadable;
  if (cacheable) {
    const auto found = g_entries.find(EntryKey{ctx, kind, index});
    if (found != g_entries.end()) {
      Py_DECREF(payload);
      return Py_NewRef(found->second);
    }
  }
  PyObject* entry = PyTuple_New(3);
  if (entry == nullptr) {
    Py_DECREF(payload);
    return nullptr;
  }
  PyTuple_SET_ITEM(entry, 0, PyLong_FromLong(kind));  // small ints: cached, never fail
  PyTuple_SET_ITEM(entry, 1, Py_NewRef(ctx));
  PyTuple_SET_ITEM(entry, 2, payload);
  if (cacheable) {
    if (g_entries.size() >= kMaxCachedEntries) {
      for (auto& item : g_entries) {
        Py_DECREF(item.second);
      }
      g_entries.clear();
    }
    g_entries.emplace(EntryKey{ctx, kind, index}, Py_NewRef(entry));
  }
  return entry;
}

bool is_plain(PyObject* object) {
  PyTypeObject* type = Py_TYPE(object);
  return type == g.plain[0] || type == g.plain[1];
}

// A tensor's version counter, or -1 for a tensor without one (an inference tensor: Python's
// `_version` raises there).
int64_t version_of(const at::Tensor& tensor) {
  const auto& counter = tensor.unsafeGetTensorImpl()->version_counter();
  return counter.enabled() ? static_cast<int64_t>(counter.current_version()) : -1;
}

// A new reference: the tensor's data pointer as a Python int, or None where Python's data_ptr()
// raises (no storage: sparse, functionalized, ...).
PyObject* pointer_of(const at::Tensor& tensor) {
  try {
    return PyLong_FromVoidPtr(tensor.data_ptr());
  } catch (const c10::Error&) {
    Py_RETURN_NONE;
  }
}

// Appends (kind, ctx, payload) to entries, and a readable tensor to tensors with its dtype.
// Steals nothing; returns false with a Python error set.
bool add_item(PyObject* entries, PyObject* tensors, PyObject* dtypes, PyObject* value, PyObject* ctx,
              bool stable_ctx) {
  long kind;
  Py_ssize_t index = -1;
  PyObject* payload;  // new reference
  if (value == Py_None) {
    kind = kNone;
    payload = Py_NewRef(Py_None);
  } else if (!THPVariable_Check(value)) {
    if (PyErr_Occurred()) {
      return false;
    }
    kind = kNotATensor;
    payload = Py_NewRef(Py_None);
  } else {
    PyObject* dtype = nullptr;  // new reference
    if (is_plain(value)) {
      // entries_of's fast test: a plain strided tensor of a supported dtype
      const at::Tensor& tensor = THPVariable_Unpack(value);
      const auto type = tensor.scalar_type();
      if (g.supported[static_cast<size_t>(type)] && tensor.layout() == at::kStrided && !tensor.is_meta() &&
          !tensor.is_nested()) {
        dtype = Py_NewRef(reinterpret_cast<PyObject*>(torch::getTHPDtype(type)));
      }
    }
    if (dtype == nullptr) {
      PyObject* reason = PyObject_CallOneArg(g.unreadable_reason, value);
      if (reason == nullptr) {
        return false;
      }
      if (reason != Py_None) {
        kind = kUnreadable;
        payload = reason;
      } else {
        Py_DECREF(reason);
        dtype = PyObject_GetAttrString(value, "dtype");
        if (dtype == nullptr) {
          return false;
        }
      }
    }
    if (dtype != nullptr) {
      kind = kTensor;
      index = PyList_GET_SIZE(tensors);
      payload = PyLong_FromSsize_t(index);
      const bool ok = payload != nullptr && PyList_Append(tensors, value) == 0 && PyList_Append(dtypes, dtype) == 0;
      Py_DECREF(dtype);
      if (!ok) {
        Py_XDECREF(payload);
        return false;
      }
    }
  }
  PyObject* entry = entry_tuple(kind, ctx, payload, index, stable_ctx);
  if (entry == nullptr) {
    return false;
  }
  const bool ok = PyList_Append(entries, entry) == 0;
  Py_DECREF(entry);
  return ok;
}

// names[index] when the list has it, else a new "{base}[index]" (a new reference either way).
PyObject* indexed_name(PyObject* names, const char* base, Py_ssize_t index) {
  if (index < PyList_GET_SIZE(names)) {
    return Py_NewRef(PyList_GET_ITEM(names, index));
  }
  return PyUnicode_FromFormat("%s[%zd]", base, index);
}

// ctx: a new reference (stable_ctx: one of the name tables' strings)
bool add_named(PyObject* entries, PyObject* tensors, PyObject* dtypes, PyObject* value, PyObject* ctx,
               bool stable_ctx) {
  if (ctx == nullptr) {
    return false;
  }
  const bool ok = add_item(entries, tensors, dtypes, value, ctx, stable_ctx);
  Py_DECREF(ctx);
  return ok;
}

bool check_ready(const char* name) {
  if (!g.ready) {
    PyErr_Format(PyExc_RuntimeError, "overflow_fast._C.%s: hook_setup was not called", name);
    return false;
  }
  return true;
}

// hook_setup(plain_types, supported_dtypes, input_names, output_names, unreadable_reason, max_remembered)
PyObject* hook_setup(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 6 || !PyTuple_Check(args[0]) || PyTuple_GET_SIZE(args[0]) != 2 || !PyList_Check(args[2]) ||
      !PyList_Check(args[3]) || !PyCallable_Check(args[4]) || !PyLong_Check(args[5])) {
    PyErr_SetString(PyExc_TypeError,
                    "hook_setup(plain_types: 2-tuple, supported_dtypes: iterable, input_names: list, "
                    "output_names: list, unreadable_reason: callable, max_remembered: int)");
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < 2; ++i) {
    PyObject* type = PyTuple_GET_ITEM(args[0], i);
    if (!PyType_Check(type)) {
      PyErr_SetString(PyExc_TypeError, "hook_setup: plain_types must hold types");
      return nullptr;
    }
    g.plain[i] = reinterpret_cast<PyTypeObject*>(Py_NewRef(type));
  }
  PyObject* iterator = PyObject_GetIter(args[1]);
  if (iterator == nullptr) {
    return nullptr;
  }
  g.supported.fill(false);
  while (PyObject* dtype = PyIter_Next(iterator)) {
    const bool is_dtype = THPDtype_Check(dtype);
    if (is_dtype) {
      g.supported[static_cast<size_t>(reinterpret_cast<THPDtype*>(dtype)->scalar_type)] = true;
    }
    Py_DECREF(dtype);
    if (!is_dtype) {
      Py_DECREF(iterator);
      PyErr_SetString(PyExc_TypeError, "hook_setup: supported_dtypes must hold torch dtypes");
      return nullptr;
    }
  }
  Py_DECREF(iterator);
  if (PyErr_Occurred()) {
    return nullptr;
  }
  g.input_names = Py_NewRef(args[2]);
  g.output_names = Py_NewRef(args[3]);
  g.unreadable_reason = Py_NewRef(args[4]);
  g.input = PyUnicode_InternFromString("input");
  g.output = PyUnicode_InternFromString("output");
  g.used = PyUnicode_InternFromString("used");
  g.launched = PyUnicode_InternFromString("launched");
  g.staged = PyUnicode_InternFromString("staged");
  g.versions = PyUnicode_InternFromString("versions");
  g.pointers = PyUnicode_InternFromString("pointers");
  g.buffer = PyUnicode_InternFromString("buffer");
  g.slot_sources = PyUnicode_InternFromString("slot_sources");
  g.dataclass_fields = PyUnicode_InternFromString("__dataclass_fields__");
  bool names_ok = true;
  for (auto [field, name] : {std::pair{&g.last_state, "_last_state"}, {&g.pending, "pending"},
                             {&g.pending_modes, "_pending_modes"}, {&g.capacity, "capacity"},
                             {&g.devices, "_devices"}, {&g.modes, "modes"}, {&g.watched, "_watched"},
                             {&g.watched_bytes, "_watched_bytes"}, {&g.stage_bytes, "stage_bytes"},
                             {&g.enabled, "enabled"}, {&g.open, "_open"}, {&g.reuse_rows, "_rows"},
                             {&g.stages, "stages"}, {&g.infos, "infos"}, {&g.staged_bytes, "staged_bytes"},
                             {&g.rows, "rows"}, {&g.deepspeed, "deepspeed"}}) {
    *field = PyUnicode_InternFromString(name);
    names_ok = names_ok && *field != nullptr;
  }
  g.max_remembered = PyLong_AsSsize_t(args[5]);
  g.ready = names_ok && g.max_remembered > 0 && g.input != nullptr && g.output != nullptr && g.used != nullptr &&
            g.launched != nullptr && g.staged != nullptr && g.versions != nullptr && g.pointers != nullptr &&
            g.buffer != nullptr && g.slot_sources != nullptr && g.dataclass_fields != nullptr;
  if (!g.ready) {
    return nullptr;
  }
  Py_RETURN_NONE;
}

// What frames.py's _children opens with containers=True: tuples, lists, dicts (ModelOutput) and
// dataclass instances. -1 with a Python error set.
int is_container(PyObject* value) {
  if (value == Py_None || THPVariable_Check(value)) {
    return PyErr_Occurred() ? -1 : 0;
  }
  if (PyTuple_Check(value) || PyList_Check(value) || PyDict_Check(value)) {
    return 1;
  }
  // dataclasses.is_dataclass: the class carries __dataclass_fields__ (looked up without raising)
  return !PyType_Check(value) && _PyType_Lookup(Py_TYPE(value), g.dataclass_fields) != nullptr;
}

// Whether some value forward_items would hand to _open is a container (containers=True): then
// the caller's Python opens them (-1: a Python error).
int holds_container(PyObject* input, PyObject* output, PyObject* kwargs) {
  auto any_of = [](PyObject* sequence) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(sequence); ++i) {
      const int found = is_container(PyTuple_GET_ITEM(sequence, i));
      if (found != 0) {
        return found;
      }
    }
    return 0;
  };
  int found = PyTuple_Check(input) ? any_of(input) : is_container(input);
  if (found == 0 && kwargs != Py_None) {
    PyObject* name;
    PyObject* value;
    Py_ssize_t cursor = 0;
    while (found == 0 && PyDict_Next(kwargs, &cursor, &name, &value)) {
      found = is_container(value);
    }
  }
  if (found == 0 && PyTuple_Check(output)) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(output) && found == 0; ++i) {
      PyObject* value = PyTuple_GET_ITEM(output, i);
      found = PyTuple_Check(value) ? any_of(value) : is_container(value);  // forward_items' one level
    }
  } else if (found == 0) {
    found = is_container(output);
  }
  return found;
}

// frame_entries(parameters, input, output, kwargs, containers) -> (entries, tensors, dtypes):
// frames.py's entries_of(forward_items(module, input, output, kwargs, containers)) for a module
// whose named_parameters is torch's own (parameters: module._parameters, in order, None skipped,
// one tensor under two names listed under the first). With containers, None when some value is
// one to open (the caller's Python opens it): then the lines are those without containers.
// The entries, tensors and dtypes of one forward hook call (new references in `out`): 1, or 0
// when containers must be opened (Python does that), or -1 with an error set.
int collect_entries(PyObject* parameters, PyObject* input, PyObject* output, PyObject* kwargs, bool containers,
                    std::array<PyObject*, 3>& out) {
  if (containers) {
    const int found = holds_container(input, output, kwargs);
    if (found != 0) {
      return found < 0 ? -1 : 0;
    }
  }
  PyObject* entries = untracked(PyList_New(0));
  PyObject* tensors = untracked(PyList_New(0));
  PyObject* dtypes = untracked(PyList_New(0));
  if (entries == nullptr || tensors == nullptr || dtypes == nullptr) {
    goto fail;
  }
  {
    PyObject* name;
    PyObject* parameter;
    Py_ssize_t cursor = 0;
    c10::SmallVector<PyObject*, 8> seen;  // named_parameters(remove_duplicate=True): the first name wins
    while (PyDict_Next(parameters, &cursor, &name, &parameter)) {
      if (parameter == Py_None || std::find(seen.begin(), seen.end(), parameter) != seen.end()) {
        continue;
      }
      seen.push_back(parameter);
      if (!add_item(entries, tensors, dtypes, parameter, name, true)) {
        goto fail;
      }
    }
  }
  if (PyTuple_Check(input)) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(input); ++i) {
      if (!add_named(entries, tensors, dtypes, PyTuple_GET_ITEM(input, i), indexed_name(g.input_names, "input", i),
                     i < PyList_GET_SIZE(g.input_names))) {
        goto fail;
      }
    }
  } else if (!add_item(entries, tensors, dtypes, input, g.input, true)) {
    goto fail;
  }
  if (kwargs != Py_None) {
    PyObject* name;
    PyObject* value;
    Py_ssize_t cursor = 0;
    while (PyDict_Next(kwargs, &cursor, &name, &value)) {
      const int tensor = THPVariable_Check(value);
      if (PyErr_Occurred()) {
        goto fail;
      }
      if (tensor && !add_named(entries, tensors, dtypes, value, PyUnicode_FromFormat("input[%S]", name), false)) {
        goto fail;
      }
    }
  }
  if (PyTuple_Check(output)) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(output); ++i) {
      PyObject* value = PyTuple_GET_ITEM(output, i);
      if (PyTuple_Check(value)) {
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(value); ++j) {
          if (!add_named(entries, tensors, dtypes, PyTuple_GET_ITEM(value, j),
                         PyUnicode_FromFormat("output[%zd][%zd]", i, j), false)) {
            goto fail;
          }
        }
      } else if (!add_named(entries, tensors, dtypes, value, indexed_name(g.output_names, "output", i),
                            i < PyList_GET_SIZE(g.output_names))) {
        goto fail;
      }
    }
  } else if (!add_item(entries, tensors, dtypes, output, g.output, true)) {
    goto fail;
  }
  out = {entries, tensors, dtypes};
  return 1;
fail:
  Py_XDECREF(entries);
  Py_XDECREF(tensors);
  Py_XDECREF(dtypes);
  return -1;
}

PyObject* frame_entries(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!check_ready("frame_entries")) {
    return nullptr;
  }
  if (nargs != 5 || !PyDict_Check(args[0]) || !(args[3] == Py_None || PyDict_Check(args[3])) ||
      !PyBool_Check(args[4])) {
    PyErr_SetString(PyExc_TypeError,
                    "frame_entries(parameters: dict, input, output, kwargs: dict or None, containers: bool)");
    return nullptr;
  }
  std::array<PyObject*, 3> found{};
  const int status = collect_entries(args[0], args[1], args[2], args[3], args[4] == Py_True, found);
  if (status <= 0) {
    return status < 0 ? nullptr : Py_NewRef(Py_None);
  }
  PyObject* result = PyTuple_Pack(3, found[0], found[1], found[2]);
  for (PyObject* list : found) {
    Py_DECREF(list);
  }
  return result;
}

// (tensor, version, pointer, modes, position): a tensor read at once on its first sight (rows.py
// _watched); null arguments (a failed allocation) give null
PyObject* watch_record(PyObject* tensor, PyObject* version, PyObject* pointer, PyObject* modes, Py_ssize_t position) {
  if (version == nullptr || pointer == nullptr) {
    return nullptr;
  }
  PyObject* index = PyLong_FromSsize_t(position);
  PyObject* record = index == nullptr ? nullptr : PyTuple_Pack(5, tensor, version, pointer, modes, index);
  Py_XDECREF(index);
  return record;
}

long as_long(PyObject* object) {
  return PyLong_AsLong(object);  // the modes and slots here are small Python ints
}

// stage_tensors(tensors, known, state, modes, watched) -> (sources, used, launch_now, staged_bytes,
// watched_bytes); None when a tensor is not of a plain type (Python's loop takes those), False
// when one is not on the device of state.buffer. Nothing is changed in those two cases.
// rows.py's _stage: see there for what each step is for.
struct Staged {
  long used = 0;  // state.used after the call
  bool launch_now = false;
  int64_t staged_bytes = 0;
  int64_t watched_bytes = 0;
};

// stage_tensors' work: the sources list (a new reference), or Py_None / Py_False (new references)
// for a tensor of another type / on another device, nothing changed; null with an error set.
// known, modes: null for None.
PyObject* stage_core(PyObject* tensors, PyObject* known, PyObject* state, PyObject* modes, PyObject* watched,
                     Staged& out) {
  const Py_ssize_t count = PyList_GET_SIZE(tensors);
  for (Py_ssize_t i = 0; i < count; ++i) {
    if (!is_plain(PyList_GET_ITEM(tensors, i))) {
      Py_RETURN_NONE;
    }
  }
  {
    PyObject* buffer = PyObject_GetAttr(state, g.buffer);
    if (buffer == nullptr) {
      return nullptr;
    }
    if (!THPVariable_Check(buffer)) {
      Py_DECREF(buffer);
      PyErr_SetString(PyExc_TypeError, "stage_tensors: state.buffer must be a tensor");
      return nullptr;
    }
    const at::Device device = THPVariable_Unpack(buffer).device();
    Py_DECREF(buffer);
    for (Py_ssize_t i = 0; i < count; ++i) {
      if (THPVariable_Unpack(PyList_GET_ITEM(tensors, i)).device() != device) {
        Py_RETURN_FALSE;  // not the buffer's device: the caller finds theirs
      }
    }
  }
  if (modes != nullptr && PyList_GET_SIZE(modes) < count) {
    PyErr_SetString(PyExc_ValueError, "stage_tensors: modes is shorter than tensors");
    return nullptr;
  }
  PyObject* used_object = PyObject_GetAttr(state, g.used);
  PyObject* staged = used_object ? PyObject_GetAttr(state, g.staged) : nullptr;
  PyObject* versions = staged ? PyObject_GetAttr(state, g.versions) : nullptr;
  PyObject* pointers = versions ? PyObject_GetAttr(state, g.pointers) : nullptr;
  PyObject* slot_sources = pointers ? PyObject_GetAttr(state, g.slot_sources) : nullptr;
  PyObject* sources = untracked(PyList_New(0));
  PyObject* result = nullptr;
  long used = 0;
  bool launch_now = modes == nullptr;
  int64_t staged_bytes = 0;
  int64_t watched_bytes = 0;
  if (used_object == nullptr || staged == nullptr || versions == nullptr || pointers == nullptr ||
      slot_sources == nullptr || sources == nullptr || !PyList_Check(staged) || !PyList_Check(versions) ||
      !PyList_Check(pointers) || !PyList_Check(slot_sources)) {
    if (!PyErr_Occurred()) {
      PyErr_SetString(PyExc_TypeError, "stage_tensors: state must hold int used and lists staged, versions, "
                                       "pointers, slot_sources");
    }
    goto done;
  }
  used = as_long(used_object);
  if (used == -1 && PyErr_Occurred()) {
    goto done;
  }
  for (Py_ssize_t position = 0; position < count; ++position) {
    PyObject* object = PyList_GET_ITEM(tensors, position);
    const at::Tensor& tensor = THPVariable_Unpack(object);
    const int64_t version = version_of(tensor);
    PyObject* key = nullptr;
    if (known != nullptr && version >= 0) {
      key = PyLong_FromVoidPtr(object);  // id(tensor)
      if (key == nullptr) {
        goto done;
      }
      PyObject* entry = PyDict_GetItemWithError(known, key);  // borrowed
      if (entry == nullptr && PyErr_Occurred()) {
        Py_DECREF(key);
        goto done;
      }
      if (entry != nullptr && PyTuple_Check(entry) && PyTuple_GET_SIZE(entry) == 3 &&
          PyLong_AsLongLong(PyTuple_GET_ITEM(entry, 1)) == version &&
          PyWeakref_GetObject(PyTuple_GET_ITEM(entry, 0)) == object) {
        // a row this forward already has serves again
        Py_DECREF(key);
        PyObject* source = PyTuple_GET_ITEM(entry, 2);
        if (PyList_Append(sources, source) != 0) {
          goto done;
        }
        const long mode = modes != nullptr && PyTuple_CheckExact(source) ? as_long(PyList_GET_ITEM(modes, position))
                                                                         : kStage;
        if (mode != kStage) {
          // a tensor an earlier hook staged and this position is not known to stage: launch now
          // if its row still waits
          PyObject* launched = PyObject_GetAttr(PyTuple_GET_ITEM(source, 0), g.launched);
          if (launched == nullptr) {
            goto done;
          }
          launch_now = launch_now || as_long(PyTuple_GET_ITEM(source, 1)) >= as_long(launched);
          Py_DECREF(launched);
          if (mode == kUnknown) {
            PyObject* version_object = PyLong_FromLongLong(version);
            PyObject* pointer = pointer_of(tensor);
            PyObject* record = watch_record(object, version_object, pointer, modes, position);
            const bool ok = record != nullptr && PyList_Append(watched, record) == 0;
            Py_XDECREF(record);
            Py_XDECREF(version_object);
            Py_XDECREF(pointer);
            if (!ok) {
              goto done;
            }
          }
        }
        continue;
      }
    }
    // a new tensor: the next slot (its (state, slot) tuple made once), its version and data pointer
    PyObject* source;
    if (used < PyList_GET_SIZE(slot_sources)) {
      source = Py_NewRef(PyList_GET_ITEM(slot_sources, used));
    } else {
      PyObject* slot = PyLong_FromLong(used);
      source = slot == nullptr ? nullptr : PyTuple_Pack(2, state, slot);
      Py_XDECREF(slot);
      if (source != nullptr && (used != PyList_GET_SIZE(slot_sources) || PyList_Append(slot_sources, source) != 0)) {
        if (!PyErr_Occurred()) {
          PyErr_SetString(PyExc_ValueError, "stage_tensors: state.slot_sources skips a slot");
        }
        Py_CLEAR(source);
      }
    }
    if (source == nullptr) {
      Py_XDECREF(key);
      goto done;
    }
    ++used;
    PyObject* version_object = PyLong_FromLongLong(version);
    PyObject* pointer = pointer_of(tensor);
    bool ok = version_object != nullptr && pointer != nullptr && PyList_Append(sources, source) == 0 &&
              PyList_Append(staged, object) == 0 && PyList_Append(versions, version_object) == 0 &&
              PyList_Append(pointers, pointer) == 0;
    if (version < 0) {
      launch_now = true;
    }
    // only what staging alone keeps alive counts (autograd keeps what requires grad anyway)
    const int64_t size = tensor.requires_grad() ? 0 : tensor.numel() * static_cast<int64_t>(tensor.itemsize());
    staged_bytes += size;
    if (ok && modes != nullptr) {
      const long mode = as_long(PyList_GET_ITEM(modes, position));
      if (mode != kStage) {
        launch_now = true;
        if (mode == kUnknown) {
          PyObject* record = watch_record(object, version_object, pointer, modes, position);
          ok = record != nullptr && PyList_Append(watched, record) == 0;
          Py_XDECREF(record);
          watched_bytes += size;
        }
      }
    }
    if (ok && key != nullptr) {
      // neither can close a cycle: a weak reference without a callback holds nothing strongly
      PyObject* reference = untracked(PyWeakref_NewRef(object, nullptr));
      PyObject* entry = reference == nullptr ? nullptr : untracked(PyTuple_Pack(3, reference, version_object, source));
      ok = entry != nullptr && PyDict_SetItem(known, key, entry) == 0;
      Py_XDECREF(entry);
      Py_XDECREF(reference);
    }
    Py_XDECREF(key);
    Py_XDECREF(version_object);
    Py_XDECREF(pointer);
    Py_DECREF(source);
    if (!ok) {
      goto done;
    }
  }
  out = Staged{used, launch_now, staged_bytes, watched_bytes};
  result = Py_NewRef(sources);
done:
  Py_XDECREF(used_object);
  Py_XDECREF(staged);
  Py_XDECREF(versions);
  Py_XDECREF(pointers);
  Py_XDECREF(slot_sources);
  Py_XDECREF(sources);
  return result;
}

PyObject* stage_tensors(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!check_ready("stage_tensors")) {
    return nullptr;
  }
  if (nargs != 5 || !PyList_Check(args[0]) || !(args[1] == Py_None || PyDict_Check(args[1])) ||
      !(args[3] == Py_None || PyList_Check(args[3])) || !PyList_Check(args[4])) {
    PyErr_SetString(PyExc_TypeError,
                    "stage_tensors(tensors: list, known: dict or None, state, modes: list or None, watched: list)");
    return nullptr;
  }
  Staged staged;
  PyObject* sources = stage_core(args[0], args[1] == Py_None ? nullptr : args[1], args[2],
                                 args[3] == Py_None ? nullptr : args[3], args[4], staged);
  if (sources == nullptr || sources == Py_None || sources == Py_False) {
    return sources;
  }
  PyObject* result = Py_BuildValue("(OlOLL)", sources, staged.used, staged.launch_now ? Py_True : Py_False,
                                   static_cast<long long>(staged.staged_bytes),
                                   static_cast<long long>(staged.watched_bytes));
  Py_DECREF(sources);
  return result;
}

// obj.name as a C integer (-1 with an error set on failure).
Py_ssize_t get_size(PyObject* object, PyObject* name) {
  PyObject* value = PyObject_GetAttr(object, name);
  if (value == nullptr) {
    return -1;
  }
  const Py_ssize_t size = PyLong_AsSsize_t(value);
  Py_DECREF(value);
  return size;
}

// obj.name += amount for an int attribute, its new value in `total`; false with an error set.
bool add_to(PyObject* object, PyObject* name, int64_t amount, long long& total) {
  PyObject* value = PyObject_GetAttr(object, name);
  if (value == nullptr) {
    return false;
  }
  total = PyLong_AsLongLong(value) + amount;
  Py_DECREF(value);
  if (PyErr_Occurred()) {
    return false;
  }
  if (amount == 0) {
    return true;
  }
  PyObject* updated = PyLong_FromLongLong(total);
  const bool ok = updated != nullptr && PyObject_SetAttr(object, name, updated) == 0;
  Py_XDECREF(updated);
  return ok;
}

// stage_call(deferred, reuse, call, tensors, module): rows.py's DeferredRows.stage, the common case
// of a forward hook's call inside a top-level forward (must_read_before false, then add) in one
// call: plain tensors on the device of the call before, room in the queue and the buffer, no
// DTensor shards or (with DeepSpeed loaded) empty tensors, the module's modes known for every
// position, the reuse table not full. -> None when the call is not that case (nothing changed: Python's path takes it), else
// whether staged work must be launched now.
PyObject* stage_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!check_ready("stage_call")) {
    return nullptr;
  }
  if (nargs != 5 || !PyTuple_Check(args[2]) || PyTuple_GET_SIZE(args[2]) < 1 || !PyList_Check(args[3])) {
    PyErr_SetString(PyExc_TypeError, "stage_call(deferred, reuse, call: Call, tensors: list, module)");
    return nullptr;
  }
  PyObject* deferred = args[0];
  PyObject* reuse = args[1];
  PyObject* call = args[2];
  PyObject* tensors = args[3];
  const Py_ssize_t count = PyList_GET_SIZE(tensors);
  if (count == 0) {
    Py_RETURN_NONE;
  }
  // With DeepSpeed loaded an empty plain tensor may be a released ZeRO-3 parameter, whose
  // partitions are combined across ranks: Python's path.
  const bool zero3 = PyDict_GetItemWithError(PyImport_GetModuleDict(), g.deepspeed) != nullptr;
  if (PyErr_Occurred()) {
    return nullptr;
  }
  for (Py_ssize_t i = 0; zero3 && i < count; ++i) {
    PyObject* tensor = PyList_GET_ITEM(tensors, i);
    if (is_plain(tensor) && THPVariable_Unpack(tensor).numel() == 0) {
      Py_RETURN_NONE;
    }
  }
  // every reference below is released at `done`
  PyObject* result = nullptr;
  PyObject* state = nullptr;
  PyObject* pending = nullptr;
  PyObject* devices = nullptr;
  PyObject* stages = nullptr;
  PyObject* infos = nullptr;
  PyObject* module_modes = nullptr;
  PyObject* enabled = nullptr;
  PyObject* known = nullptr;
  PyObject* watched = nullptr;
  PyObject* sources = nullptr;
  PyObject* pending_modes = nullptr;
  PyObject* frame = PyTuple_GET_ITEM(call, 0);
  PyObject* modes = nullptr;  // borrowed from module_modes
  Py_ssize_t capacity = 0;
  Py_ssize_t used = 0;
  Py_ssize_t open = 0;
  Staged staged;
  long long staged_total = 0;   // state.staged_bytes after this call
  long long watched_total = 0;  // deferred._watched_bytes after this call
  bool launch = false;

  state = PyObject_GetAttr(deferred, g.last_state);
  if (state == nullptr || state == Py_None) {
    goto not_taken;
  }
  pending = PyObject_GetAttr(deferred, g.pending);
  devices = pending ? PyObject_GetAttr(deferred, g.devices) : nullptr;
  if (devices == nullptr) {
    goto done;
  }
  if (!PyList_Check(pending) || !PyDict_Check(devices) || PyDict_GET_SIZE(devices) != 1) {
    goto not_taken;  // several devices: must_read_before looks at each
  }
  capacity = get_size(deferred, g.capacity);
  used = capacity < 0 ? -1 : get_size(state, g.used);
  if (used < 0) {
    goto done;
  }
  if (PyList_GET_SIZE(pending) >= capacity || used > capacity - count) {
    goto not_taken;  // the queue or the buffer is full: read first
  }
  stages = PyObject_GetAttr(state, g.stages);
  infos = stages ? PyObject_GetAttr(state, g.infos) : nullptr;
  if (infos == nullptr) {
    goto done;
  }
  if (stages != Py_True || infos != Py_None) {
    goto not_taken;
  }
  {
    PyObject* all_modes = PyObject_GetAttr(deferred, g.modes);
    if (all_modes == nullptr) {
      goto done;
    }
    module_modes = PyDict_Check(all_modes) ? PyDict_GetItemWithError(all_modes, args[4]) : nullptr;
    Py_XINCREF(module_modes);
    Py_DECREF(all_modes);
    if (module_modes == nullptr && PyErr_Occurred()) {
      goto done;
    }
    if (module_modes == nullptr || !PyList_Check(module_modes) || PyList_GET_SIZE(module_modes) < count) {
      goto not_taken;  // a module not seen yet: Python's path makes its modes
    }
    modes = module_modes;
  }
  // reuse.open_rows(count)
  enabled = PyObject_GetAttr(reuse, g.enabled);
  open = enabled ? get_size(reuse, g.open) : -1;
  if (open < 0) {
    goto done;
  }
  if (PyObject_IsTrue(enabled) == 1 && open > 0) {
    known = PyObject_GetAttr(reuse, g.reuse_rows);
    if (known == nullptr) {
      goto done;
    }
    if (!PyDict_Check(known) || PyDict_GET_SIZE(known) + count > g.max_remembered) {
      goto not_taken;  // Python's path clears it
    }
  }
  watched = PyObject_GetAttr(deferred, g.watched);
  if (watched == nullptr) {
    goto done;
  }
  if (!PyList_Check(watched)) {
    goto not_taken;
  }
  sources = stage_core(tensors, known, state, modes, watched, staged);
  if (sources == nullptr) {
    goto done;
  }
  if (sources == Py_None || sources == Py_False) {
    goto not_taken;  // another type or another device: nothing changed
  }
  // the rest of add(): the call queued with its sources and modes
  {
    PyObject* used_object = PyLong_FromLong(staged.used);
    const bool ok = used_object != nullptr && PyObject_SetAttr(state, g.used, used_object) == 0;
    Py_XDECREF(used_object);
    if (!ok) {
      goto done;
    }
  }
  pending_modes = PyObject_GetAttr(deferred, g.pending_modes);
  if (pending_modes == nullptr || !add_to(state, g.staged_bytes, staged.staged_bytes, staged_total) ||
      !add_to(deferred, g.watched_bytes, staged.watched_bytes, watched_total) ||
      PyObject_SetAttr(frame, g.rows, sources) != 0 || PyList_Append(pending, call) != 0 ||
      PyList_Append(pending_modes, modes) != 0) {
    goto done;
  }
  launch = staged.launch_now;
  if (!launch) {
    const Py_ssize_t limit = get_size(deferred, g.stage_bytes);
    if (limit < 0 && PyErr_Occurred()) {
      goto done;
    }
    launch = staged_total + watched_total > limit;
  }
  result = Py_NewRef(launch ? Py_True : Py_False);
  goto done;
not_taken:
  if (!PyErr_Occurred()) {
    result = Py_NewRef(Py_None);
  }
done:
  Py_XDECREF(state);
  Py_XDECREF(pending);
  Py_XDECREF(devices);
  Py_XDECREF(stages);
  Py_XDECREF(infos);
  Py_XDECREF(module_modes);
  Py_XDECREF(enabled);
  Py_XDECREF(known);
  Py_XDECREF(watched);
  Py_XDECREF(sources);
  Py_XDECREF(pending_modes);
  return result;
}

// Columns of a row (overflow_fast/stats/layout.py): those counting nan, +inf and -inf.
constexpr int64_t kColumns = 8, kNanColumn = 2, kNegInfColumn = 4;

// read_rows(rows) -> (bytes, nonfinite): rows.py's to_host. The one host read of a device's rows
// (on a GPU it waits for the device, without the GIL as torch's own copies do), their int64
// values copied out, and whether any row counts a nan or an inf.
PyObject* read_rows(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 1 || !THPVariable_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "read_rows(rows: an int64 tensor)");
    return nullptr;
  }
  const at::Tensor rows = THPVariable_Unpack(args[0]);
  if (rows.scalar_type() != at::kLong || rows.layout() != at::kStrided || rows.numel() % kColumns != 0) {
    PyErr_SetString(PyExc_TypeError, "read_rows: rows must be a strided int64 tensor of 8-column rows");
    return nullptr;
  }
  at::Tensor host;
  std::string error;
  Py_BEGIN_ALLOW_THREADS
  try {
    host = rows.cpu().contiguous();
  } catch (const std::exception& exception) {
    error = exception.what();
  }
  Py_END_ALLOW_THREADS
  if (!error.empty()) {
    PyErr_SetString(PyExc_RuntimeError, error.c_str());
    return nullptr;
  }
  const auto* values = host.const_data_ptr<int64_t>();
  const int64_t count = host.numel();
  bool nonfinite = false;
  for (int64_t row = 0; row < count && !nonfinite; row += kColumns) {
    for (int64_t column = kNanColumn; column <= kNegInfColumn; ++column) {
      nonfinite = nonfinite || values[row + column] != 0;
    }
  }
  PyObject* data = PyBytes_FromStringAndSize(reinterpret_cast<const char*>(values),
                                             static_cast<Py_ssize_t>(count * sizeof(int64_t)));
  if (data == nullptr) {
    return nullptr;
  }
  PyObject* result = PyTuple_Pack(2, data, nonfinite ? Py_True : Py_False);
  Py_DECREF(data);
  return result;
}

// resolve_rows(sources, values) -> rows: rows.py's resolve. Each (state, slot) source becomes the
// list of its row's 8 ints in values (a flat int64 buffer, to_host's); other sources (host rows)
// stay as they are.
PyObject* resolve_rows(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyList_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "resolve_rows(sources: list, values: an int64 buffer)");
    return nullptr;
  }
  Py_buffer view;
  if (PyObject_GetBuffer(args[1], &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) != 0) {
    return nullptr;
  }
  if (view.itemsize != 8 || view.format == nullptr ||
      (std::strcmp(view.format, "q") != 0 && std::strcmp(view.format, "l") != 0)) {
    PyBuffer_Release(&view);
    PyErr_SetString(PyExc_TypeError, "resolve_rows: values must be a buffer of int64");
    return nullptr;
  }
  const auto* values = static_cast<const int64_t*>(view.buf);
  const Py_ssize_t slots = view.len / static_cast<Py_ssize_t>(kColumns * sizeof(int64_t));
  PyObject* sources = args[0];
  const Py_ssize_t count = PyList_GET_SIZE(sources);
  PyObject* rows = PyList_New(count);
  for (Py_ssize_t i = 0; rows != nullptr && i < count; ++i) {
    PyObject* source = PyList_GET_ITEM(sources, i);
    if (!PyTuple_CheckExact(source)) {
      PyList_SET_ITEM(rows, i, Py_NewRef(source));
      continue;
    }
    const Py_ssize_t slot = PyTuple_GET_SIZE(source) == 2 ? PyLong_AsSsize_t(PyTuple_GET_ITEM(source, 1)) : -1;
    if (slot < 0 || slot >= slots) {
      if (!PyErr_Occurred()) {
        PyErr_Format(PyExc_ValueError, "resolve_rows: source %zd names no row of the %zd read", i, slots);
      }
      Py_CLEAR(rows);
      break;
    }
    PyObject* row = PyList_New(kColumns);
    for (int64_t column = 0; row != nullptr && column < kColumns; ++column) {
      PyObject* value = PyLong_FromLongLong(values[slot * kColumns + column]);
      if (value == nullptr) {
        Py_CLEAR(row);
        break;
      }
      PyList_SET_ITEM(row, column, value);
    }
    if (row == nullptr) {
      Py_CLEAR(rows);
      break;
    }
    PyList_SET_ITEM(rows, i, row);
  }
  PyBuffer_Release(&view);
  return rows;
}

// all_unchanged(tensors, versions, pointers) -> bool: rows.py's _all_unchanged. False also means
// "look at each": a tensor of another type, or one without a version counter or a data pointer.
PyObject* all_unchanged(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!check_ready("all_unchanged")) {
    return nullptr;
  }
  if (nargs != 3 || !PyList_Check(args[0]) || !PyList_Check(args[1]) || !PyList_Check(args[2])) {
    PyErr_SetString(PyExc_TypeError, "all_unchanged(tensors: list, versions: list, pointers: list)");
    return nullptr;
  }
  const Py_ssize_t count = PyList_GET_SIZE(args[0]);
  if (PyList_GET_SIZE(args[1]) != count || PyList_GET_SIZE(args[2]) != count) {
    Py_RETURN_FALSE;
  }
  PyObject* const* items = PySequence_Fast_ITEMS(args[0]);
  for (Py_ssize_t i = 0; i < count; ++i) {
    prefetch_tensors(items, count, i, is_plain);
    PyObject* object = items[i];
    if (!is_plain(object)) {
      Py_RETURN_FALSE;
    }
    const at::Tensor& tensor = THPVariable_Unpack(object);
    const int64_t version = version_of(tensor);
    PyObject* expected_version = PyList_GET_ITEM(args[1], i);
    PyObject* expected_pointer = PyList_GET_ITEM(args[2], i);
    if (version < 0 || !PyLong_CheckExact(expected_version) || PyLong_AsLongLong(expected_version) != version ||
        !PyLong_CheckExact(expected_pointer)) {
      PyErr_Clear();
      Py_RETURN_FALSE;
    }
    void* pointer;
    try {
      pointer = tensor.data_ptr();
    } catch (const c10::Error&) {
      Py_RETURN_FALSE;
    }
    if (PyLong_AsVoidPtr(expected_pointer) != pointer) {
      PyErr_Clear();
      Py_RETURN_FALSE;
    }
  }
  Py_RETURN_TRUE;
}

// frames.py's Frame and Call, made in C: a Python __init__ setting nine slots, or namedtuple's
// __new__, costs ~0.4 us per hook; these ~0.05. Set by frame_setup.
struct FrameType {
  PyTypeObject* frame = nullptr;  // frames.Frame: a __slots__ class
  PyTypeObject* call = nullptr;   // frames.Call: a namedtuple of kCallFields
  PyObject* forward = nullptr;    // frames.FORWARD, a new frame's phase
  PyObject* empty = nullptr;      // (), a new frame's lead
  PyObject* class_names = nullptr;       // frames._CLASS_NAMES: module type -> the name frames show
  PyObject* class_name = nullptr;        // frames.class_name, for a type not in it yet
  PyObject* named_parameters = nullptr;  // torch.nn.Module.named_parameters (not overridden: read _parameters)
  PyObject* named_parameters_name = nullptr;
  PyObject* parameters_name = nullptr;   // "_parameters"
  PyObject* unknown = nullptr;           // "?": the name of a module module_names lacks
  // Frame's slots, in the order of kFrameSlots; their offsets in the object
  std::array<Py_ssize_t, 9> offsets{};
};
FrameType g_frame;
constexpr const char* kFrameSlots[] = {"lead", "module_name", "class_name", "entries", "dtypes", "rows", "phase",
                                       "consumers", "bad_shards"};
constexpr Py_ssize_t kCallFields = 7;

// Where __slots__ puts `name` in instances of `type`: its member descriptor's offset, or -1 with
// an error set.
Py_ssize_t slot_offset(PyTypeObject* type, const char* name) {
  PyObject* descriptor = PyDict_GetItemString(type->tp_dict, name);  // borrowed
  if (descriptor == nullptr || Py_TYPE(descriptor) != &PyMemberDescr_Type ||
      reinterpret_cast<PyMemberDescrObject*>(descriptor)->d_member->type != T_OBJECT_EX) {
    PyErr_Format(PyExc_TypeError, "frame_setup: %s.%s is not a __slots__ slot", type->tp_name, name);
    return -1;
  }
  return reinterpret_cast<PyMemberDescrObject*>(descriptor)->d_member->offset;
}

// frame_setup(Frame, Call, forward, class_names, class_name, named_parameters)
PyObject* frame_setup(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 6 || !PyType_Check(args[0]) || !PyType_Check(args[1]) ||
      !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(args[1]), &PyTuple_Type) || !PyDict_Check(args[3]) ||
      !PyCallable_Check(args[4])) {
    PyErr_SetString(PyExc_TypeError,
                    "frame_setup(frame_type: a __slots__ class, call_type: a namedtuple, forward, class_names: dict, "
                    "class_name: callable, named_parameters)");
    return nullptr;
  }
  auto* frame = reinterpret_cast<PyTypeObject*>(args[0]);
  if (frame->tp_itemsize != 0 || frame->tp_alloc == nullptr) {
    PyErr_SetString(PyExc_TypeError, "frame_setup: the frame type must be a plain __slots__ class");
    return nullptr;
  }
  PyObject* fields = PyObject_GetAttrString(args[1], "_fields");
  const bool call_fields_ok = fields != nullptr && PyTuple_Check(fields) && PyTuple_GET_SIZE(fields) == kCallFields;
  Py_XDECREF(fields);
  if (!call_fields_ok) {
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError, "frame_setup: the call type must be a namedtuple of %zd fields", kCallFields);
    return nullptr;
  }
  std::array<Py_ssize_t, 9> offsets{};
  for (size_t i = 0; i < offsets.size(); ++i) {
    offsets[i] = slot_offset(frame, kFrameSlots[i]);
    if (offsets[i] < 0) {
      return nullptr;
    }
  }
  g_frame.frame = reinterpret_cast<PyTypeObject*>(Py_NewRef(args[0]));
  g_frame.call = reinterpret_cast<PyTypeObject*>(Py_NewRef(args[1]));
  g_frame.empty = PyTuple_New(0);
  if (g_frame.empty == nullptr) {
    return nullptr;
  }
  g_frame.named_parameters_name = PyUnicode_InternFromString("named_parameters");
  g_frame.parameters_name = PyUnicode_InternFromString("_parameters");
  g_frame.unknown = PyUnicode_InternFromString("?");
  if (g_frame.named_parameters_name == nullptr || g_frame.parameters_name == nullptr || g_frame.unknown == nullptr) {
    return nullptr;
  }
  g_frame.forward = Py_NewRef(args[2]);
  g_frame.class_names = Py_NewRef(args[3]);
  g_frame.class_name = Py_NewRef(args[4]);
  g_frame.named_parameters = Py_NewRef(args[5]);
  g_frame.offsets = offsets;
  Py_RETURN_NONE;
}

// Frame(module_name, class_name, entries, dtypes), a new reference (nothing stolen)
PyObject* new_frame(PyObject* module_name, PyObject* class_name, PyObject* entries, PyObject* dtypes) {
  PyObject* frame = untracked(g_frame.frame->tp_alloc(g_frame.frame, 0));  // zeroed: every slot unset
  if (frame == nullptr) {
    return nullptr;
  }
  PyObject* values[] = {g_frame.empty, module_name, class_name, entries, dtypes, Py_None, g_frame.forward, Py_None,
                        Py_None};
  for (size_t i = 0; i < g_frame.offsets.size(); ++i) {
    *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(frame) + g_frame.offsets[i]) = Py_NewRef(values[i]);
  }
  return frame;
}

// make_frame(module_name, class_name, entries, dtypes): Frame(module_name, class_name, entries, dtypes)
PyObject* make_frame(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (g_frame.frame == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "overflow_fast._C.make_frame: frame_setup was not called");
    return nullptr;
  }
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "make_frame(module_name, class_name, entries, dtypes)");
    return nullptr;
  }
  return new_frame(args[0], args[1], args[2], args[3]);
}

// hook_frame(module_names, module, input, output, kwargs, containers): frames.py's
// forward_frame(module_names.get(module, "?"), module, ...) -> (frame, tensors), or None where
// Python must build it (containers to open, named_parameters overridden, _parameters not a dict).
PyObject* hook_frame(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!check_ready("hook_frame")) {
    return nullptr;
  }
  if (g_frame.frame == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "overflow_fast._C.hook_frame: frame_setup was not called");
    return nullptr;
  }
  if (nargs != 6 || !PyDict_Check(args[0]) || !(args[4] == Py_None || PyDict_Check(args[4]))) {
    PyErr_SetString(PyExc_TypeError,
                    "hook_frame(module_names: dict, module, input, output, kwargs: dict or None, containers)");
    return nullptr;
  }
  PyObject* module = args[1];
  PyTypeObject* type = Py_TYPE(module);
  if (_PyType_Lookup(type, g_frame.named_parameters_name) != g_frame.named_parameters) {
    Py_RETURN_NONE;
  }
  const int containers = PyObject_IsTrue(args[5]);
  if (containers < 0) {
    return nullptr;
  }
  PyObject* parameters = PyObject_GetAttr(module, g_frame.parameters_name);
  if (parameters == nullptr) {
    return nullptr;
  }
  if (!PyDict_Check(parameters)) {
    Py_DECREF(parameters);
    Py_RETURN_NONE;
  }
  std::array<PyObject*, 3> found{};
  const int status = collect_entries(parameters, args[2], args[3], args[4], containers != 0, found);
  Py_DECREF(parameters);
  if (status <= 0) {
    return status < 0 ? nullptr : Py_NewRef(Py_None);
  }
  PyObject* result = nullptr;
  PyObject* frame = nullptr;
  PyObject* class_name = nullptr;  // new reference
  PyObject* name = PyDict_GetItemWithError(args[0], module);  // borrowed
  if (name == nullptr && PyErr_Occurred()) {
    goto done;
  }
  class_name = PyDict_GetItemWithError(g_frame.class_names, reinterpret_cast<PyObject*>(type));
  if (class_name != nullptr) {
    Py_INCREF(class_name);
  } else if (PyErr_Occurred() || (class_name = PyObject_CallOneArg(g_frame.class_name, module)) == nullptr) {
    goto done;
  }
  frame = new_frame(name != nullptr ? name : g_frame.unknown, class_name, found[0], found[2]);
  if (frame != nullptr) {
    result = PyTuple_Pack(2, frame, found[1]);
    Py_DECREF(frame);
  }
done:
  Py_XDECREF(class_name);
  for (PyObject* list : found) {
    Py_DECREF(list);
  }
  return result;
}

// make_call(frame, trace_mode, first_call, last_frame_of_batch, batch_before, batch_after, total_calls)
PyObject* make_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (g_frame.call == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "overflow_fast._C.make_call: frame_setup was not called");
    return nullptr;
  }
  if (nargs != kCallFields) {
    PyErr_SetString(PyExc_TypeError,
                    "make_call(frame, trace_mode, first_call, last_frame_of_batch, batch_before, batch_after, "
                    "total_calls)");
    return nullptr;
  }
  PyObject* call = untracked(g_frame.call->tp_alloc(g_frame.call, kCallFields));
  if (call == nullptr) {
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < kCallFields; ++i) {
    PyTuple_SET_ITEM(call, i, Py_NewRef(args[i]));
  }
  return call;
}

// A METH_FASTCALL function as the PyCFunction a method table holds.
PyCFunction fastcall(PyObject* (*function)(PyObject*, PyObject* const*, Py_ssize_t)) {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(function));
}

PyMethodDef kMethods[] = {
    {"hook_setup", fastcall(hook_setup), METH_FASTCALL,
     "hook_setup(plain_types, supported_dtypes, input_names, output_names, unreadable_reason, max_remembered): "
     "the constants of the functions below (staging.cpp)"},
    {"frame_entries", fastcall(frame_entries), METH_FASTCALL,
     "frame_entries(parameters, input, output, kwargs, containers) -> (entries, tensors, dtypes), or None "
     "when containers must be opened (frames.py)"},
    {"stage_tensors", fastcall(stage_tensors), METH_FASTCALL,
     "stage_tensors(tensors, known, state, modes, watched) -> (sources, used, launch_now, staged_bytes, "
     "watched_bytes), None (a tensor of another type) or False (another device) (rows.py _stage)"},
    {"stage_call", fastcall(stage_call), METH_FASTCALL,
     "stage_call(deferred, reuse, call, tensors, module) -> None (not the common case: nothing changed) or "
     "whether to launch now (rows.py DeferredRows.stage)"},
    {"read_rows", fastcall(read_rows), METH_FASTCALL,
     "read_rows(rows) -> (bytes, nonfinite) (rows.py to_host)"},
    {"resolve_rows", fastcall(resolve_rows), METH_FASTCALL,
     "resolve_rows(sources, values) -> rows (rows.py resolve)"},
    {"all_unchanged", fastcall(all_unchanged), METH_FASTCALL,
     "all_unchanged(tensors, versions, pointers) -> bool (rows.py)"},
    {"frame_setup", fastcall(frame_setup), METH_FASTCALL,
     "frame_setup(Frame, Call, forward, class_names, class_name, named_parameters): what hook_frame, "
     "make_frame and make_call use (frames.py)"},
    {"hook_frame", fastcall(hook_frame), METH_FASTCALL,
     "hook_frame(module_names, module, input, output, kwargs, containers) -> (frame, tensors), or None where "
     "Python builds it (frames.py forward_frame)"},
    {"make_frame", fastcall(make_frame), METH_FASTCALL,
     "make_frame(module_name, class_name, entries, dtypes) -> Frame (frames.py)"},
    {"make_call", fastcall(make_call), METH_FASTCALL,
     "make_call(frame, trace_mode, first_call, last_frame_of_batch, batch_before, batch_after, total_calls) "
     "-> Call (frames.py)"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

void add_staging_functions(PyObject* module) {
  if (PyModule_AddFunctions(module, kMethods) != 0) {
    throw py::error_already_set();
  }
}

}  // namespace overflow_fast
