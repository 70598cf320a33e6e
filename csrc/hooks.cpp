// The hook layer's C++ (hook_layer.h), in one translation unit (each unit parses torch's headers
// again: a second would lengthen every first-use build):
// - HookCore: when each hook's tensors are read and into which rows;
// - what one hook call hands over: its entries (EntriesOf), its inputs' and outputs' versions
//   (versions_of, for find_op), the gradients arriving at its outputs (OutputGradients), and with
//   find_op the call as its replay needs it (KeptCall). Each has its specification in Python, which
//   the tests hold equal: hooks/frames.py, hooks/culprit.py, and hooks/hook_core.py's
//   OutputGradients;
// - forward_call: a forward hook's entries, output-gradient hooks, kept call's output and rows in
//   one crossing (hook_core.py's forward_call is its specification).
//
// HookCore: a hook hands over the tensors of one module call; the core answers, per tensor, the row
// of its device's buffer that holds (or will hold) its statistics, and which tensors the caller must
// read into which rows now. It owns:
// - the rows reused within a pass: a tensor seen again unchanged (the same TensorImpl, version
//   counter and data pointer) keeps its row instead of being read again;
// - with deferral (off by default): the tensors whose read waits, the versions and data pointers
//   they had at their hook, and per call site (a module's tensor position) whether its tensor was
//   ever changed after its hook.
// Where a launcher is bound to a device (the backend's per-hook read, table.cpp), the tensors to
// read are launched from here, in the same call: a hook's host work is this one call.
// Tensors and ints in, tuples of ints and tensors out: it reads no Python attribute, so the Python
// side can change without it.
// Only the headers used: <torch/extension.h> (all of libtorch's C++ API) costs about 30 s of
// CPU to parse, most of this unit's share of a first-use build.
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>

#include <structmember.h>

#include "hook_layer.h"
#include "launch.h"

#include <c10/core/TensorImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <array>
#include <iterator>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace overflow_fast {
namespace {

// What add() answers instead of rows.
constexpr int64_t kFull = -1;          // not enough free rows: read what is pending, then add again
constexpr int64_t kMixedDevices = -2;  // the tensors are on several devices: read them apart

// Who read the tensors an answer hands out (its last element): the caller (none bound to the
// device, or its launcher declined them: the caller reads them, if any), the bound launcher
// (into their rows, in this call), or nobody: the launcher failed on them, said why once (its
// `disabled`, which declines every read from then on) and the caller reads them.
enum Read : int64_t { kByCaller = 0, kLaunched = 1, kLaunchFailed = 2 };

// Per call site and tensor position, under deferral: not seen yet (read at once, watched until the
// pass ends), seen unchanged at the end of a pass (its read may wait), seen changed (read at once).
enum Mode : uint8_t { kUnknown = 0, kDefer = 1, kAtOnce = 2 };

// A tuple of objects the collector never tracks (ints, strs, None) can be in no reference cycle:
// untracked now, as the collector itself would untrack it at its next pass, it adds nothing to
// what each pass traverses (a hook's entries and versions live until its pass is decided).
py::tuple untracked_if_atomic(py::tuple tuple) {
  for (const auto& item : tuple) {
    if (PyObject_GC_IsTracked(item.ptr())) {
      return tuple;
    }
  }
  PyObject_GC_UnTrack(tuple.ptr());
  return tuple;
}

// A tensor's version counter, or -1 where it has none (inference tensors).
int64_t version_of(const at::Tensor& tensor) {
  const auto& counter = tensor.unsafeGetTensorImpl()->version_counter();
  return counter.enabled() ? static_cast<int64_t>(counter.current_version()) : -1;
}

// Where a tensor's elements start, or null where it has no storage of its own (wrapper subclasses,
// sparse tensors): those are told apart by their version counter alone.
const void* data_of(const at::Tensor& tensor) {
  const c10::TensorImpl* impl = tensor.unsafeGetTensorImpl();
  if (!impl->has_storage() || impl->is_python_dispatch() || impl->layout() != c10::kStrided) {
    return nullptr;
  }
  return impl->storage().data();
}

struct Held {
  py::object object;  // the caller's tensor (handed back as it came)
  int64_t version;
  const void* data;
  int64_t site;
  int64_t position;

  bool changed() const {
    const at::Tensor& tensor = tensor_of(object);
    return version_of(tensor) != version || data_of(tensor) != data;
  }
};

struct DeviceRows {
  c10::Device device;
  int64_t used = 0;      // rows given out since the last reset
  int64_t launched = 0;  // rows [0, launched) were handed to the caller to read
  std::vector<Held> deferred;  // the tensors of rows [launched, used)
  int64_t deferred_bytes = 0;  // of those, the ones only deferral keeps alive
  // bound: the device's per-hook read and the rows it writes ([capacity, 8] int64 on the device)
  std::shared_ptr<Launcher> launcher;
  at::Tensor buffer;
};

struct Seen {
  c10::weak_intrusive_ptr<c10::TensorImpl> impl;  // keeps the address from being reused
  int64_t version;
  const void* data;
  int64_t device;
  int64_t row;
};

class HookCore {
 public:
  HookCore(int64_t capacity, int64_t stage_bytes, int64_t max_remembered)
      : capacity_(capacity), stage_bytes_(stage_bytes), max_remembered_(max_remembered) {
    TORCH_CHECK(capacity > 0, "HookCore: capacity must be positive, got ", capacity);
    TORCH_CHECK(stage_bytes >= 0, "HookCore: stage_bytes must be >= 0, got ", stage_bytes);
  }

  // The rows of one hook call's tensors: (device key, rows, first, to_read, changed, read), where
  // `to_read` go into rows [first, first + len(to_read)) of the device's buffer now, read by whom
  // `read` says (Read); `changed`: rows whose deferred tensor changed before this read (read as
  // empty tensors). Not added: (kFull or kMixedDevices, None, None, None, None, None), one result
  // type either way. `site` >= 0 with `defer`: the call may wait.
  py::tuple add(const py::object& objects, int64_t site, bool defer) {
    // a list as it is; any other iterable (a list subclass included) through its own iteration
    const py::list tensors = PyList_CheckExact(objects.ptr())
                                 ? py::reinterpret_borrow<py::list>(objects)
                                 : py::reinterpret_steal<py::list>(PySequence_List(objects.ptr()));
    if (!tensors) {
      throw py::error_already_set();
    }
    TORCH_CHECK(!tensors.empty(), "HookCore.add: no tensors");
    for (const auto& object : tensors) {
      if (!THPVariable_Check(object.ptr())) {
        throw py::type_error(std::string("HookCore.add: expected tensors, got ") + Py_TYPE(object.ptr())->tp_name);
      }
    }
    const c10::Device device = tensor_of(PyList_GET_ITEM(tensors.ptr(), 0)).device();
    for (const auto& object : tensors) {
      if (tensor_of(object).device() != device) {
        return not_added(kMixedDevices);
      }
    }
    const int64_t key = device_key(device);
    DeviceRows& rows = devices_[key];
    const auto count = static_cast<int64_t>(tensors.size());
    if (rows.used + count > capacity_) {
      return not_added(kFull);
    }
    if (static_cast<int64_t>(seen_.size()) + count > max_remembered_) {
      seen_.clear();
      forgot_ = true;
    }
    const bool may_defer = defer && site >= 0;
    std::vector<uint8_t>* modes = nullptr;
    if (may_defer) {
      modes = &modes_[site];
      if (static_cast<int64_t>(modes->size()) < count) {
        modes->resize(count, kUnknown);
      }
    }
    bool read_now = !may_defer;
    const int64_t held_site = may_defer ? site : -1;
    py::tuple row_of(count);
    for (int64_t position = 0; position < count; ++position) {
      const py::handle object(PyList_GET_ITEM(tensors.ptr(), position));
      const at::Tensor& tensor = tensor_of(object);
      c10::TensorImpl* impl = tensor.unsafeGetTensorImpl();
      const int64_t version = version_of(tensor);
      const void* data = data_of(tensor);
      const Mode mode = modes != nullptr && version >= 0 ? static_cast<Mode>((*modes)[position]) : kAtOnce;
      if (version >= 0) {
        const auto found = seen_.find(impl);
        if (found != seen_.end() && found->second.version == version && found->second.data == data &&
            found->second.device == key && !found->second.impl.expired()) {
          const int64_t row = found->second.row;
          row_of[position] = py::int_(row);
          // a row still waiting is read now where this position may not wait
          read_now = read_now || (row >= rows.launched && mode != kDefer);
          if (mode == kUnknown && modes != nullptr) {
            watch(object, version, data, site, position);
          }
          continue;
        }
      }
      const int64_t row = rows.used++;
      row_of[position] = py::int_(row);
      rows.deferred.push_back(Held{py::reinterpret_borrow<py::object>(object), version, data, held_site, position});
      if (!tensor.requires_grad()) {  // autograd keeps the others until backward anyway
        rows.deferred_bytes += bytes_of(tensor);
      }
      if (version >= 0 && max_remembered_ > 0) {
        seen_.insert_or_assign(
            impl, Seen{c10::weak_intrusive_ptr<c10::TensorImpl>(tensor.getIntrusivePtr()), version, data, key, row});
      }
      if (mode != kDefer) {
        read_now = true;
        if (mode == kUnknown && modes != nullptr) {
          watch(object, version, data, site, position);
        }
      }
    }
    if (rows.deferred_bytes + watched_bytes_ > stage_bytes_) {
      read_now = true;
    }
    if (watched_bytes_ > stage_bytes_) {
      learn();
    }
    if (!read_now) {
      return py::make_tuple(key, row_of, rows.launched, py::list(), py::list(), static_cast<int64_t>(kByCaller));
    }
    auto [first, to_read, changed] = take(rows);
    const Read read = launch(rows, first, to_read);
    return py::make_tuple(key, row_of, first, std::move(to_read), std::move(changed), static_cast<int64_t>(read));
  }

  // Every row still waiting: [(device key, first, to_read, changed, read)], as add() gives them.
  std::vector<py::tuple> pending() {
    std::vector<py::tuple> out;
    for (size_t key = 0; key < devices_.size(); ++key) {
      if (devices_[key].launched < devices_[key].used) {
        auto [first, tensors, changed] = take(devices_[key]);
        const Read read = launch(devices_[key], first, tensors);
        out.push_back(py::make_tuple(static_cast<int64_t>(key), first, std::move(tensors), std::move(changed),
                                     static_cast<int64_t>(read)));
      }
    }
    return out;
  }

  // After the rows were read: every row is free again and no tensor is reused or held; what the
  // watched call sites did decides whether they may wait from now on.
  void reset() {
    learn();
    for (auto& rows : devices_) {
      rows.used = rows.launched = rows.deferred_bytes = 0;
      rows.deferred.clear();
    }
    seen_.clear();
    forgot_ = false;
  }

  // From now on the tensors of `key`'s device that add() or pending() hand out are read here, by
  // `launcher` into rows of `buffer` ([capacity, 8] int64 on the device), unless it declines them
  // (their answer says who read them). None: the caller reads them again.
  void bind(int64_t key, const py::object& launcher, const at::Tensor& buffer) {
    DeviceRows& rows = devices_.at(key);
    if (launcher.is_none()) {
      rows.launcher.reset();
      rows.buffer = at::Tensor();
      return;
    }
    auto bound = launcher.cast<std::shared_ptr<Launcher>>();
    TORCH_CHECK(bound->device() == rows.device, "HookCore.bind: the launcher reads ", bound->device(),
                ", not this key's ", rows.device);
    TORCH_CHECK(buffer.device() == rows.device && buffer.scalar_type() == at::kLong && buffer.is_contiguous() &&
                    buffer.dim() == 2 && buffer.size(0) == capacity_ && buffer.size(1) == 8 &&
                    !buffer.key_set().has_any(c10::python_ks),
                "HookCore.bind: buffer must be a contiguous int64 [capacity, 8] tensor on the key's device");
    rows.launcher = std::move(bound);
    rows.buffer = buffer;
  }

  // Rows in use on a device (by key); the device of a key.
  int64_t used(int64_t key) const { return devices_.at(key).used; }
  c10::Device device(int64_t key) const { return devices_.at(key).device; }

  // Whether `tensor`, read into `row` of `key`'s buffer in this pass, is unchanged since that read
  // (the same version counter and data pointer): 1; 0 where it changed; -1 where this core cannot
  // tell (it does not remember that read: reuse off, an inference tensor, past max_remembered).
  int64_t unchanged(const py::handle& object, int64_t key, int64_t row) const {
    if (!THPVariable_Check(object.ptr())) {
      throw py::type_error(std::string("HookCore.unchanged: expected a tensor, got ") + Py_TYPE(object.ptr())->tp_name);
    }
    const at::Tensor& tensor = tensor_of(object);
    const auto found = seen_.find(tensor.unsafeGetTensorImpl());
    if (found == seen_.end() || found->second.impl.expired()) {
      return -1;
    }
    const Seen& seen = found->second;
    const bool same = seen.version == version_of(tensor) && seen.data == data_of(tensor);
    if (seen.device == key && seen.row == row) {
      return same ? 1 : 0;
    }
    // read again since, into another row: it had changed then, unless this pass forgot that read
    return same && forgot_ ? -1 : 0;
  }

  // The collector's tp_traverse: the tensors held for a read or watched until the pass ends.
  int traverse(visitproc visit, void* arg) const {
    for (const auto& rows : devices_) {
      for (const auto& held : rows.deferred) {
        Py_VISIT(held.object.ptr());
      }
    }
    for (const auto& held : watched_) {
      Py_VISIT(held.object.ptr());
    }
    return 0;
  }

  // The collector's tp_clear: every row free and no tensor held (as reset(), learning nothing).
  void clear() {
    std::vector<Held> released;  // dropped last: a tensor's dealloc may run any code
    for (auto& rows : devices_) {
      std::move(rows.deferred.begin(), rows.deferred.end(), std::back_inserter(released));
      rows.deferred.clear();
      rows.used = rows.launched = rows.deferred_bytes = 0;
    }
    std::move(watched_.begin(), watched_.end(), std::back_inserter(released));
    watched_.clear();
    watched_bytes_ = 0;
    seen_.clear();
    forgot_ = false;
  }

 private:
  int64_t device_key(const c10::Device& device) {
    for (size_t key = 0; key < devices_.size(); ++key) {
      if (devices_[key].device == device) {
        return static_cast<int64_t>(key);
      }
    }
    devices_.push_back(DeviceRows{device});
    return static_cast<int64_t>(devices_.size()) - 1;
  }

  static int64_t bytes_of(const at::Tensor& tensor) {
    return static_cast<int64_t>(tensor.numel()) * static_cast<int64_t>(tensor.element_size());
  }

  static py::tuple not_added(int64_t why) {
    return py::make_tuple(why, py::none(), py::none(), py::none(), py::none(), py::none());
  }

  // (first, tensors, changed rows) of a device's waiting rows, which count as launched from now.
  // A deferred tensor changed since its hook is never handed out (its memory may be gone): an
  // empty tensor stands in, and its call site is read at once from now on.
  std::tuple<int64_t, py::list, py::list> take(DeviceRows& rows) {
    py::list tensors(rows.deferred.size());
    py::list changed;
    int64_t row = rows.launched;
    Py_ssize_t index = 0;
    for (auto& held : rows.deferred) {
      if (held.site >= 0 && held.changed()) {
        changed.append(row);
        modes_[held.site][held.position] = kAtOnce;
        tensors[index] = py::cast(at::empty({0}, tensor_of(held.object).options().dtype(at::kByte)));
      } else {
        tensors[index] = std::move(held.object);
      }
      ++row;
      ++index;
    }
    const int64_t first = rows.launched;
    rows.launched = rows.used;
    rows.deferred.clear();
    rows.deferred_bytes = 0;
    return {first, std::move(tensors), std::move(changed)};
  }

  // The one decision of who reads taken tensors: the launcher bound to their device, into rows
  // [first, first + len) of its buffer, unless it declines them (a tensor it does not take) or
  // none is bound; then the caller. A launcher that fails is disabled with its reason and declines
  // from then on (a disabled one never raises): kLaunchFailed says so, once. An interrupt is not a
  // failure.
  Read launch(DeviceRows& rows, int64_t first, const py::list& tensors) {
    if (rows.launcher == nullptr || tensors.empty()) {
      return kByCaller;
    }
    const auto start = reinterpret_cast<int64_t>(rows.buffer.data_ptr());
    const int64_t end = start + capacity_ * 64;
    std::string why;
    try {
      return rows.launcher->read(PySequence_Fast_ITEMS(tensors.ptr()), static_cast<int64_t>(tensors.size()),
                                 start + first * 64, start, end)
                 ? kLaunched
                 : kByCaller;
    } catch (py::error_already_set& error) {
      if (!error.matches(PyExc_Exception)) {
        throw;  // KeyboardInterrupt, SystemExit
      }
      why = error.what();
    } catch (const std::exception& error) {
      why = error.what();
    }
    if (rows.launcher->disabled().empty()) {  // (a driver call's failure disables it with its own reason)
      rows.launcher->disable(why.substr(0, why.find('\n')));
    }
    return kLaunchFailed;
  }

  // A call site's tensor read at once on its first sight: whether it changes before the pass ends
  // decides whether that site may wait from then on.
  void watch(const py::handle& object, int64_t version, const void* data, int64_t site, int64_t position) {
    const at::Tensor& tensor = tensor_of(object);
    watched_.push_back(Held{py::reinterpret_borrow<py::object>(object), version, data, site, position});
    watched_bytes_ += tensor.requires_grad() ? 0 : bytes_of(tensor);
  }

  void learn() {
    for (const auto& held : watched_) {
      uint8_t& mode = modes_[held.site][held.position];
      if (held.changed()) {
        mode = kAtOnce;
      } else if (mode == kUnknown) {
        mode = kDefer;
      }
    }
    watched_.clear();
    watched_bytes_ = 0;
  }

  const int64_t capacity_;
  const int64_t stage_bytes_;
  const int64_t max_remembered_;
  std::vector<DeviceRows> devices_;
  std::unordered_map<const c10::TensorImpl*, Seen> seen_;
  bool forgot_ = false;  // seen_ was cleared in this pass (past max_remembered)
  std::unordered_map<int64_t, std::vector<uint8_t>> modes_;
  std::vector<Held> watched_;
  int64_t watched_bytes_ = 0;
};

// Which part of a forward call a tensor entry came from: its gradient hooks differ (an output's
// gradient is hooked, an input's consumer noted, a parameter's left to its own hook).
enum class Side : uint8_t { kParameter, kInput, kOutput };

// What a call keeps until its pass is decided as a tuple, untracked where its items are: (kind,
// ctx, payload) entries and dtypes, in no reference cycle, are then nothing the collector
// traverses or moves into an older generation, however many calls a pass holds.
py::tuple kept_as_tuple(const py::list& list) {
  PyObject* tuple = PyList_AsTuple(list.ptr());
  if (tuple == nullptr) {
    throw py::error_already_set();
  }
  return untracked_if_atomic(py::reinterpret_steal<py::tuple>(tuple));
}

// What EntriesOf makes of a hook call: the entries, the tensors it reads (in row order) and their
// dtypes, as Python receives them; and per tensor its side and ctx (borrowed from its entry), so
// that the output-gradient hooks need not parse the entries again.
struct Entries {
  py::list entries;
  py::list tensors;
  py::list dtypes;
  std::vector<Side> sides;
  std::vector<PyObject*> ctxs;

  py::tuple result() const { return py::make_tuple(kept_as_tuple(entries), tensors, kept_as_tuple(dtypes)); }
};

// What the gradient hooks of one OutputGradients share with it: the callback, held while that
// OutputGradients holds it (its collector's traverse sees it there) and dropped when it is cleared
// or goes. A hook lives as long as autograd keeps the tensor's node, which no collector sees: it
// holds no Python object but this and its owner, whose modules are weak references, so a hook that
// outlives its detector (a loss kept after remove()) keeps neither the detector nor the model alive.
struct GradientTarget {
  PyObject* callback = nullptr;  // strong; null once dropped

  GradientTarget() = default;
  GradientTarget(const GradientTarget&) = delete;
  GradientTarget& operator=(const GradientTarget&) = delete;
  ~GradientTarget() { drop(); }

  void drop() {
    if (callback != nullptr && Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      Py_CLEAR(callback);
    }
  }
};

// Who a hooked output's gradient belongs to: the module (a weak reference) and "<ctx>.grad" it is
// named after, the modules that consume it (weak references) and id(tensor). Plain C++ until its
// gradient arrives, when the callback receives it as a list: a hook adds no object to what the
// collector tracks. Touched with the GIL held only.
struct Owner {
  py::object module;
  py::object ctx;
  std::vector<py::object> consumers;
  py::object id;

  // [module, ctx, [consumers], id], the owner the callback receives; null with the error set.
  PyObject* as_list() const {
    PyObject* listed = PyList_New(static_cast<Py_ssize_t>(consumers.size()));
    if (listed == nullptr) {
      return nullptr;
    }
    for (size_t index = 0; index < consumers.size(); ++index) {
      PyList_SET_ITEM(listed, static_cast<Py_ssize_t>(index), Py_NewRef(consumers[index].ptr()));
    }
    PyObject* owner = PyList_New(4);
    if (owner == nullptr) {
      Py_DECREF(listed);
      return nullptr;
    }
    PyList_SET_ITEM(owner, 0, Py_NewRef(module.ptr()));
    PyList_SET_ITEM(owner, 1, Py_NewRef(ctx.ptr()));
    PyList_SET_ITEM(owner, 2, listed);
    PyList_SET_ITEM(owner, 3, Py_NewRef(id.ptr()));
    return owner;
  }
};

// What an output-gradient hook registered from C++ calls: `callback(owner, grad)` while its target
// holds one, with the GIL held, as a Python hook on the tensor would be called. Its owner is dropped
// with the GIL held, wherever autograd frees the graph (a worker thread included); after Python's
// end it is left.
class GradientCallback {
 public:
  GradientCallback(std::shared_ptr<GradientTarget> target, std::shared_ptr<Owner> owner)
      : target_(std::move(target)), owner_(std::move(owner)) {}
  GradientCallback(const GradientCallback&) = delete;
  GradientCallback& operator=(const GradientCallback&) = delete;

  ~GradientCallback() {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      owner_.reset();
    } else {
      new std::shared_ptr<Owner>(std::move(owner_));  // left: its objects cannot be released now
    }
  }

  void operator()(const at::TensorBase& grad) const {
    py::gil_scoped_acquire gil;
    PyObject* wrapped = THPVariable_Wrap(grad);  // None where the gradient is undefined
    const bool called = wrapped != nullptr && call(wrapped);
    Py_XDECREF(wrapped);
    if (!called) {
      python_error error;
      error.persist();  // while this thread holds the GIL: autograd raises it where backward was called
      throw error;
    }
  }

  // With the GIL held: false with the Python error set.
  bool call(PyObject* grad) const {
    if (target_->callback == nullptr) {
      return true;  // its OutputGradients was cleared: the gradient flows on unchanged
    }
    PyObject* owner = owner_->as_list();
    if (owner == nullptr) {
      return false;
    }
    PyObject* callback = Py_NewRef(target_->callback);  // (the call may clear the target)
    PyObject* result = PyObject_CallFunctionObjArgs(callback, owner, grad, nullptr);
    Py_DECREF(callback);
    Py_DECREF(owner);
    Py_XDECREF(result);
    return result != nullptr;
  }

 private:
  std::shared_ptr<GradientTarget> target_;
  std::shared_ptr<Owner> owner_;
};

// A weak reference to a module (the shared one Python gives it), as an owner holds its modules.
py::object weak_module(const py::handle& module) {
  PyObject* reference = PyWeakref_NewRef(module.ptr(), nullptr);
  if (reference == nullptr) {
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(reference);
}

// The gradients arriving at forward outputs (hooks/gradients.py's GradientHooks, whose twin in
// hooks/hook_core.py is the specification): `watch` takes a forward hook call's entries; for each
// output tensor that requires a gradient, first seen in this forward, it registers a hook that
// runs `callback(owner, grad)` in backward, owner = [module, "<ctx>.grad", consumers, id(tensor)]
// with weak references to the modules; a tensor that several modules return (a block's last layer
// and the block itself) keeps its one hook and is named after the outermost (hooks run inner first:
// the last one wins); a module that takes a hooked tensor as input is one of its consumers (its
// backward produces that gradient). Plain tensors get a C++ hook (no Python handle or hook dict per
// tensor); a subclass is handed to `hook_apart(tensor, hook)`, whose register_hook is its own.
// `clear()` drops the callback: every hook registered so far does nothing from then on.
// It takes part in garbage collection (add_hook_layer: the callback and its owners may lead back to it).
class OutputGradients {
 public:
  OutputGradients(py::object callback, py::object hook_apart)
      : target_(std::make_shared<GradientTarget>()), hook_apart_(std::move(hook_apart)) {
    target_->callback = callback.release().ptr();
  }
  OutputGradients(const OutputGradients&) = delete;
  OutputGradients& operator=(const OutputGradients&) = delete;
  ~OutputGradients() { clear(); }

  // `entries` and `tensors` as frames.entries_of gives them: inputs and outputs told apart by
  // their ctx (the specification's rule; the hook's own call passes its sides instead).
  void watch(const py::handle& module, const py::tuple& entries, const py::list& tensors) {
    if (!watching()) {
      return;
    }
    for (const auto& entry : entries) {
      if (!PyTuple_Check(entry.ptr()) || PyTuple_GET_SIZE(entry.ptr()) != 3) {
        throw py::type_error("OutputGradients.watch: entries must be (kind, ctx, payload) tuples");
      }
      PyObject* kind = PyTuple_GET_ITEM(entry.ptr(), 0);
      if (!PyLong_Check(kind) || PyLong_AsLong(kind) != 0) {  // TENSOR
        continue;
      }
      PyObject* ctx = PyTuple_GET_ITEM(entry.ptr(), 1);
      const py::handle object(PyList_GetItem(tensors.ptr(), PyLong_AsSsize_t(PyTuple_GET_ITEM(entry.ptr(), 2))));
      if (!object || !THPVariable_Check(object.ptr()) || !PyUnicode_Check(ctx)) {
        throw py::error_already_set();
      }
      const Side side = PyUnicode_Tailmatch(ctx, input_.ptr(), 0, PY_SSIZE_T_MAX, -1) == 1    ? Side::kInput
                        : PyUnicode_Tailmatch(ctx, output_.ptr(), 0, PY_SSIZE_T_MAX, -1) == 1 ? Side::kOutput
                                                                                               : Side::kParameter;
      watch_one(module, object, ctx, side);
    }
  }

  // The same for a hook call's entries as EntriesOf made them (their sides known).
  void watch_entries(const py::handle& module, const Entries& entries) {
    if (!watching()) {
      return;
    }
    for (size_t index = 0; index < entries.sides.size(); ++index) {
      watch_one(module, PyList_GET_ITEM(entries.tensors.ptr(), index), entries.ctxs[index], entries.sides[index]);
    }
  }

  // A forward of the model begins: the tensors of the last one are not told apart any more.
  void new_forward() {
    owners_.clear();
    incoming_.clear();
  }

  // Whether the gradient arriving at `module`'s outputs is read, as the last forward hooked them.
  bool incoming_read(const py::handle& module) const { return incoming_.count(module.ptr()) > 0; }

  // The hooks are off: the callback goes (hooks still on live tensors do nothing), and so does
  // every Python object held here. Also the collector's tp_clear.
  void clear() {
    target_->drop();
    hook_apart_ = py::none();
    new_forward();
  }

  // The collector's tp_traverse.
  int traverse(visitproc visit, void* arg) const {
    Py_VISIT(target_->callback);
    Py_VISIT(hook_apart_.ptr());
    for (const auto& [impl, known] : owners_) {
      Py_VISIT(known.owner->module.ptr());
      for (const auto& consumer : known.owner->consumers) {
        Py_VISIT(consumer.ptr());
      }
    }
    return 0;
  }

 private:
  // Whether this call's outputs are hooked at all (autograd on, not cleared).
  bool watching() {
    if (!at::GradMode::is_enabled() || target_->callback == nullptr) {
      return false;
    }
    if (owners_.size() > kMaxOwners) {  // submodules driven alone never start a new forward
      new_forward();
    }
    return true;
  }

  void watch_one(const py::handle& module, const py::handle& object, PyObject* ctx, Side side) {
    const at::Tensor& tensor = tensor_of(object);
    const bool is_input = side == Side::kInput;
    if (!is_input && !(side == Side::kOutput && tensor.requires_grad())) {
      return;  // a parameter, or an output without a gradient
    }
    c10::TensorImpl* impl = tensor.unsafeGetTensorImpl();
    auto found = owners_.find(impl);
    if (found != owners_.end() && found->second.impl.lock().get() != impl) {
      owners_.erase(found);  // its tensor is gone: another one took its address
      found = owners_.end();
    }
    if (is_input) {
      if (found != owners_.end()) {
        std::vector<py::object>& consumers = found->second.owner->consumers;
        py::object consumer = weak_module(module);
        for (const auto& known : consumers) {
          const int same = PyObject_RichCompareBool(known.ptr(), consumer.ptr(), Py_EQ);
          if (same < 0) {
            throw py::error_already_set();
          }
          if (same == 1) {
            return;
          }
        }
        consumers.push_back(std::move(consumer));
      }
      return;
    }
    incoming_.insert(module.ptr());
    py::object gradient_ctx = py::reinterpret_steal<py::object>(PyUnicode_Concat(ctx, grad_suffix_.ptr()));
    if (!gradient_ctx) {
      throw py::error_already_set();
    }
    if (found != owners_.end()) {
      found->second.owner->module = weak_module(module);
      found->second.owner->ctx = std::move(gradient_ctx);
      return;
    }
    auto owner = std::make_shared<Owner>(Owner{weak_module(module), std::move(gradient_ctx), {},
                                               py::reinterpret_steal<py::object>(PyLong_FromVoidPtr(object.ptr()))});
    if (!owner->id) {
      throw py::error_already_set();
    }
    auto call = std::make_shared<GradientCallback>(target_, owner);
    if (THPVariable_CheckExact(object.ptr())) {
      tensor.register_hook([call](const at::TensorBase& grad) { (*call)(grad); });
    } else {
      hook_apart_(object, py::cpp_function([call](const py::object& grad) {
                    if (!call->call(grad.ptr())) {
                      throw py::error_already_set();
                    }
                  }));
    }
    owners_.insert_or_assign(impl, Known{c10::weak_intrusive_ptr<c10::TensorImpl>(tensor.getIntrusivePtr()),
                                         std::move(owner)});
  }

  static constexpr size_t kMaxOwners = 1 << 16;

  struct Known {
    c10::weak_intrusive_ptr<c10::TensorImpl> impl;  // keeps the address from being reused
    std::shared_ptr<Owner> owner;
  };

  std::shared_ptr<GradientTarget> target_;
  py::object hook_apart_;
  const py::str input_{"input"};
  const py::str output_{"output"};
  const py::str grad_suffix_{".grad"};
  std::unordered_map<const c10::TensorImpl*, Known> owners_;
  std::unordered_set<const PyObject*> incoming_;  // the modules, by identity (as id() does)
};

// Each input tensor's version counter, in order: the positional values, then the keyword ones
// (one level deep), inference tensors left out (they have none): hooks/culprit.py's versions_of,
// its specification. A subclass's are its TensorImpl's, as torch's own getters read them.
py::tuple versions_of(const py::handle& args, const py::handle& kwargs) {
  // plain integers until the tuple is made (this runs twice a hook with find_op)
  std::vector<int64_t> versions;
  const auto add = [&versions](PyObject* value) {
    if (THPVariable_Check(value)) {
      const at::Tensor& tensor = THPVariable_Unpack(value);
      if (!tensor.is_inference()) {
        versions.push_back(static_cast<int64_t>(tensor.unsafeGetTensorImpl()->version_counter().current_version()));
      }
    }
  };
  if (PyTuple_Check(args.ptr()) || PyList_Check(args.ptr())) {  // (add runs no Python: the items stay put)
    PyObject** items = PySequence_Fast_ITEMS(args.ptr());
    for (Py_ssize_t index = 0; index < PySequence_Fast_GET_SIZE(args.ptr()); ++index) {
      add(items[index]);
    }
  } else {
    for (const auto& value : args) {
      add(value.ptr());
    }
  }
  if (PyDict_Check(kwargs.ptr())) {
    PyObject* key = nullptr;
    PyObject* value = nullptr;
    Py_ssize_t position = 0;
    while (PyDict_Next(kwargs.ptr(), &position, &key, &value)) {
      add(value);
    }
  } else if (PyObject_IsTrue(kwargs.ptr()) == 1) {  // a mapping of another type
    const py::object values = py::reinterpret_steal<py::object>(PyMapping_Values(kwargs.ptr()));
    if (!values) {
      throw py::error_already_set();
    }
    for (const auto& value : values) {
      add(value.ptr());
    }
  }
  py::tuple out(versions.size());
  for (size_t index = 0; index < versions.size(); ++index) {
    PyObject* version = PyLong_FromLongLong(versions[index]);
    if (version == nullptr) {
      throw py::error_already_set();
    }
    PyTuple_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(index), version);
  }
  return untracked_if_atomic(std::move(out));
}

// A Python predicate on types, asked once per type and its answer kept: with a reference to the
// type, whose address is then never another type's. The collector sees the predicate and the types.
class TypeAnswers {
 public:
  explicit TypeAnswers(py::object predicate) : predicate_(std::move(predicate)) {}

  bool operator()(PyTypeObject* type) const {
    const auto found = answers_.find(type);
    if (found != answers_.end()) {
      return found->second.second;
    }
    auto object = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(type));
    const bool answer = predicate_(object).cast<bool>();
    answers_.emplace(type, std::make_pair(std::move(object), answer));
    return answer;
  }

  int traverse(visitproc visit, void* arg) const {
    Py_VISIT(predicate_.ptr());
    for (const auto& [type, known] : answers_) {
      Py_VISIT(known.first.ptr());
    }
    return 0;
  }

  void clear() {
    predicate_ = py::none();
    answers_.clear();
  }

 private:
  py::object predicate_;
  mutable std::unordered_map<const PyTypeObject*, std::pair<py::object, bool>> answers_;
};

// The entries of a hook call outside torch.func transforms, as hooks/frames.py gives them (its
// specification; tests hold the two equal): `forward` is entries_of(forward_items(...)), `of` is
// entries_of(items), each one pass in C++ where the common case (a plain strided tensor of a
// supported dtype) needs no Python. What it does not decide itself it asks of frames.py:
// `own_parameters(module)`, `leaves(value, ctx, keyword)` (the items of a value that is neither a
// tensor, None nor a plain scalar, with containers), `unreadable_reason(tensor)` (every tensor
// but the common case; a str: why the engine cannot read it); and once per type
// `listed_as_torch(type)` and `opens_nothing(type)` (no value of the type is a container: such
// a value is an item as it is, and a keyword one is left out, without asking `leaves`).
class EntriesOf {
 public:
  // The entry kinds (recording/schema.py's TENSOR, NONE, NOT_A_TENSOR, UNREADABLE).
  enum Kind : int64_t { kTensor = 0, kNone = 1, kNotATensor = 2, kUnreadable = 3 };

  EntriesOf(const py::iterable& supported_dtypes, py::object unreadable_reason, py::object own_parameters,
            py::object listed_as_torch, py::object leaves, py::object opens_nothing, bool containers)
      : unreadable_reason_(std::move(unreadable_reason)),
        own_parameters_(std::move(own_parameters)),
        listed_as_torch_(std::move(listed_as_torch)),
        leaves_(std::move(leaves)),
        opens_nothing_(std::move(opens_nothing)),
        containers_(containers) {
    supported_.fill(false);
    for (const auto& dtype : supported_dtypes) {
      if (!THPDtype_Check(dtype.ptr())) {
        throw py::type_error("EntriesOf: supported_dtypes must be torch dtypes");
      }
      supported_.at(static_cast<size_t>(reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type)) = true;
    }
    for (int64_t kind = 0; kind < 4; ++kind) {
      kinds_[kind] = py::int_(kind);
    }
    for (size_t index = 0; index < inputs_.size(); ++index) {
      inputs_[index] = py::str("input[" + std::to_string(index) + "]");
      outputs_[index] = py::str("output[" + std::to_string(index) + "]");
    }
  }

  // (entries, tensors, dtypes) of (value, ctx) items: an entry per item, (kind, ctx, payload) with
  // the tensor's index in `tensors` (TENSOR), the reason (UNREADABLE) or None as payload.
  py::tuple of(const py::list& items) const {
    Entries out;
    for (const auto& item : items) {
      add_item(out, item, Side::kParameter);
    }
    return out.result();
  }

  // The entries of one forward hook call, in the reference's order: the module's own parameters,
  // the positional inputs, the keyword tensors (input[name]), the outputs (one level of nested
  // tuples); with containers, each container opened into its tensors.
  py::tuple forward(const py::handle& module, const py::handle& input, const py::handle& output,
                    const py::handle& kwargs) const {
    return entries(module, input, output, kwargs).result();
  }

  Entries entries(const py::handle& module, const py::handle& input, const py::handle& output,
                  const py::handle& kwargs) const {
    Entries out;
    add_parameters(out, module);
    if (PyTuple_Check(input.ptr())) {
      for (Py_ssize_t index = 0; index < PyTuple_GET_SIZE(input.ptr()); ++index) {
        add_value(out, PyTuple_GET_ITEM(input.ptr(), index), name(inputs_, "input", index), false, Side::kInput);
      }
    } else {
      add_value(out, input.ptr(), input_, false, Side::kInput);
    }
    if (!kwargs.is_none()) {
      if (!PyDict_Check(kwargs.ptr())) {
        throw py::type_error("EntriesOf.forward: kwargs must be a dict or None");
      }
      PyObject* key = nullptr;
      PyObject* value = nullptr;
      Py_ssize_t position = 0;
      while (PyDict_Next(kwargs.ptr(), &position, &key, &value)) {
        if (THPVariable_Check(value) || (containers_ && !value_is_a_leaf(value))) {
          add_value(out, value, py::reinterpret_steal<py::object>(PyUnicode_FromFormat("input[%S]", key)), true,
                    Side::kInput);
        }
      }
    }
    if (PyTuple_Check(output.ptr())) {
      for (Py_ssize_t index = 0; index < PyTuple_GET_SIZE(output.ptr()); ++index) {
        PyObject* value = PyTuple_GET_ITEM(output.ptr(), index);
        if (PyTuple_Check(value)) {
          for (Py_ssize_t inner = 0; inner < PyTuple_GET_SIZE(value); ++inner) {
            add_value(out, PyTuple_GET_ITEM(value, inner),
                      py::reinterpret_steal<py::object>(PyUnicode_FromFormat("output[%zd][%zd]", index, inner)),
                      false, Side::kOutput);
          }
        } else {
          add_value(out, value, name(outputs_, "output", index), false, Side::kOutput);
        }
      }
    } else {
      add_value(out, output.ptr(), output_, false, Side::kOutput);
    }
    return out;
  }

  // The collector's tp_traverse and tp_clear: the callables it asks (frames.py's functions).
  int traverse(visitproc visit, void* arg) const {
    Py_VISIT(unreadable_reason_.ptr());
    Py_VISIT(own_parameters_.ptr());
    Py_VISIT(leaves_.ptr());
    const int visited = listed_as_torch_.traverse(visit, arg);
    return visited != 0 ? visited : opens_nothing_.traverse(visit, arg);
  }

  void clear() {
    unreadable_reason_ = py::none();
    own_parameters_ = py::none();
    listed_as_torch_.clear();
    leaves_ = py::none();
    opens_nothing_.clear();
  }

 private:
  static py::object name(const std::array<py::object, 16>& names, const char* prefix, Py_ssize_t index) {
    if (index < static_cast<Py_ssize_t>(names.size())) {
      return names[index];
    }
    return py::reinterpret_steal<py::object>(PyUnicode_FromFormat("%s[%zd]", prefix, index));
  }

  // The module's own parameters, as own_parameters(module) lists them: read here where the module
  // keeps them as torch.nn.Module does (a dict _parameters, named_parameters not overridden, no
  // tensor under two names), else asked of own_parameters.
  void add_parameters(Entries& out, const py::handle& module) const {
    std::vector<std::pair<PyObject*, PyObject*>> pairs;  // (parameter, name), borrowed from the dict
    if (parameters_of(module, pairs)) {
      for (const auto& [parameter, name] : pairs) {
        add(out, parameter, name, Side::kParameter);
      }
      return;
    }
    const py::list listed = own_parameters_(module);
    for (const auto& pair : listed) {
      add_item(out, pair, Side::kParameter);
    }
  }

  bool parameters_of(const py::handle& module, std::vector<std::pair<PyObject*, PyObject*>>& pairs) const {
    PyObject* dict = listed_as_torch_(Py_TYPE(module.ptr())) ? PyObject_GenericGetDict(module.ptr(), nullptr) : nullptr;
    PyObject* parameters = dict == nullptr ? nullptr : PyDict_GetItemWithError(dict, parameters_.ptr());
    Py_XDECREF(dict);  // (the module keeps its __dict__, which keeps the borrowed parameters)
    if (parameters == nullptr || !PyDict_CheckExact(parameters)) {
      PyErr_Clear();
      return false;
    }
    PyObject* name = nullptr;
    PyObject* parameter = nullptr;
    Py_ssize_t position = 0;
    while (PyDict_Next(parameters, &position, &name, &parameter)) {
      if (parameter == Py_None) {
        continue;
      }
      for (const auto& seen : pairs) {
        if (seen.first == parameter) {
          return false;  // one tensor under two names: own_parameters says which name
        }
      }
      pairs.emplace_back(parameter, name);
    }
    return true;
  }

  // A tensor, None, or a plain scalar: an item as it is, never opened (they hold no tensors).
  static bool value_is_a_leaf(PyObject* value) {
    return value == Py_None || THPVariable_Check(value) || PyLong_CheckExact(value) || PyFloat_CheckExact(value) ||
           PyBool_Check(value) || PyUnicode_CheckExact(value);
  }

  // One forward item: as it is, or with containers, what frames.py makes of it.
  void add_value(Entries& out, PyObject* value, const py::object& ctx, bool keyword, Side side) const {
    if (!containers_ || value_is_a_leaf(value)) {
      add(out, value, ctx.ptr(), side);
      return;
    }
    if (opens_nothing_(Py_TYPE(value))) {  // (a model's cache object, passed to every block)
      if (!keyword) {
        add(out, value, ctx.ptr(), side);
      }
      return;
    }
    const py::list leaves = leaves_(py::handle(value), ctx, keyword);
    for (const auto& leaf : leaves) {
      add_item(out, leaf, side);
    }
  }

  void add_item(Entries& out, const py::handle& item, Side side) const {
    if (!PyTuple_Check(item.ptr()) || PyTuple_GET_SIZE(item.ptr()) != 2) {
      throw py::type_error("EntriesOf: items must be (value, ctx) tuples");
    }
    add(out, PyTuple_GET_ITEM(item.ptr(), 0), PyTuple_GET_ITEM(item.ptr(), 1), side);
  }

  void add(Entries& out, PyObject* value, PyObject* ctx, Side side) const {
    Kind kind = kNotATensor;
    py::object payload = py::none();
    if (THPVariable_Check(value)) {
      const at::Tensor& tensor = THPVariable_Unpack(value);
      const bool common = THPVariable_CheckExact(value) && supported_.at(static_cast<size_t>(tensor.scalar_type())) &&
                          tensor.layout() == c10::kStrided && !tensor.is_meta() && !tensor.is_nested();
      py::object reason = common ? py::none() : unreadable_reason_(py::handle(value));
      if (reason.is_none()) {
        kind = kTensor;
        payload = py::int_(static_cast<int64_t>(out.tensors.size()));
        out.tensors.append(py::handle(value));
        out.dtypes.append(py::handle(reinterpret_cast<PyObject*>(torch::getTHPDtype(tensor.scalar_type()))));
        out.sides.push_back(side);
        out.ctxs.push_back(ctx);  // (its entry, appended below, holds it)
      } else {
        kind = kUnreadable;
        payload = std::move(reason);
      }
    } else if (value == Py_None) {
      kind = kNone;
    }
    out.entries.append(untracked_if_atomic(py::make_tuple(kinds_[kind], py::handle(ctx), std::move(payload))));
  }

  std::array<bool, static_cast<size_t>(c10::ScalarType::NumOptions)> supported_{};
  py::object unreadable_reason_;
  py::object own_parameters_;
  TypeAnswers listed_as_torch_;  // per module type: lists its parameters as torch.nn.Module does
  const py::str parameters_{"_parameters"};
  py::object leaves_;
  TypeAnswers opens_nothing_;  // per value type: no value of it is a container
  bool containers_;
  std::array<py::object, 4> kinds_;
  std::array<py::object, 16> inputs_;
  std::array<py::object, 16> outputs_;
  const py::object input_ = py::str("input");
  const py::object output_ = py::str("output");
};

// find_op's record of one hooked call: hooks/culprit.py's KeptCall is its specification (the same
// fields, set by the same rules; tests hold the two equal). Its construction runs at every hooked
// call, so it is one C call here: the inputs' versions, the grad mode, its root and its ordinal
// under the root. What only the root of a pass needs (the RNG states, whether it is a data-parallel
// wrapper) comes from the `root_state` it is handed, called once per pass. A plain type with member
// slots (Python reads its fields as fast as a class's __slots__) and culprit.KeptCall's methods.
struct KeptCallObject {
  PyObject_HEAD
  PyObject* module;
  PyObject* args;
  PyObject* kwargs;
  PyObject* versions;
  PyObject* parent;
  PyObject* grad_enabled;
  PyObject* autocast;
  PyObject* output;
  PyObject* output_versions;
  PyObject* root;  // null for a root (a root holding itself would be a reference cycle)
  PyObject* rng;
  PyObject* counts;
  PyObject* ordinal;
  PyObject* wraps;
  PyObject* kept;
};

#define KEPT_CALL_FIELDS(X)                                                                            \
  X(module) X(args) X(kwargs) X(versions) X(parent) X(grad_enabled) X(autocast) X(output) X(output_versions) \
  X(root) X(rng) X(counts) X(ordinal) X(wraps) X(kept)

PyTypeObject kept_call_type = {PyVarObject_HEAD_INIT(nullptr, 0)};

// versions_of(args, kwargs) as a new reference, or null with the Python error set.
PyObject* versions_or_null(PyObject* args, PyObject* kwargs) {
  try {
    return versions_of(args, kwargs).release().ptr();
  } catch (py::error_already_set& error) {
    error.restore();
  } catch (const std::exception& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what());
  }
  return nullptr;
}

int kept_call_traverse(PyObject* self, visitproc visit, void* arg) {
  auto* call = reinterpret_cast<KeptCallObject*>(self);
#define VISIT(field) Py_VISIT(call->field);
  KEPT_CALL_FIELDS(VISIT)
#undef VISIT
  return 0;
}

int kept_call_clear(PyObject* self) {
  auto* call = reinterpret_cast<KeptCallObject*>(self);
#define CLEAR(field) Py_CLEAR(call->field);
  KEPT_CALL_FIELDS(CLEAR)
#undef CLEAR
  return 0;
}

void kept_call_dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  kept_call_clear(self);
  Py_TYPE(self)->tp_free(self);
}

// KeptCall(module, args, kwargs, parent, autocast, root_state): culprit.KeptCall.__init__.
PyObject* kept_call_new(PyTypeObject* type, PyObject* arguments, PyObject* keywords) {
  PyObject* module = nullptr;
  PyObject* args = nullptr;
  PyObject* kwargs = nullptr;
  PyObject* parent_object = nullptr;
  PyObject* autocast = nullptr;
  PyObject* root_state = nullptr;
  if (keywords != nullptr && PyDict_GET_SIZE(keywords) > 0) {
    PyErr_SetString(PyExc_TypeError, "KeptCall takes positional arguments only");
    return nullptr;
  }
  if (!PyArg_UnpackTuple(arguments, "KeptCall", 6, 6, &module, &args, &kwargs, &parent_object, &autocast,
                         &root_state)) {
    return nullptr;
  }
  if (parent_object != Py_None && !PyObject_TypeCheck(parent_object, &kept_call_type)) {
    PyErr_SetString(PyExc_TypeError, "KeptCall: parent must be a KeptCall or None");
    return nullptr;
  }
  PyObject* versions = versions_or_null(args, kwargs);
  if (versions == nullptr) {
    return nullptr;
  }
  auto* call = reinterpret_cast<KeptCallObject*>(type->tp_alloc(type, 0));
  if (call == nullptr) {
    Py_DECREF(versions);
    return nullptr;
  }
  PyObject* self = reinterpret_cast<PyObject*>(call);
  call->versions = versions;
  call->module = Py_NewRef(module);
  call->args = Py_NewRef(args);
  call->kwargs = Py_NewRef(kwargs);
  call->parent = Py_NewRef(parent_object);
  call->grad_enabled = PyBool_FromLong(at::GradMode::is_enabled());
  call->autocast = Py_NewRef(autocast);
  call->kept = Py_NewRef(Py_True);
  auto* parent = parent_object == Py_None ? nullptr : reinterpret_cast<KeptCallObject*>(parent_object);
  KeptCallObject* root = nullptr;
  if (parent == nullptr || parent->wraps == Py_True) {
    // root_state(module, outermost): (rng, wraps) of a root, its RNG states and whether it is a
    // data-parallel wrapper (only the outermost call can be one)
    PyObject* state = PyObject_CallFunctionObjArgs(root_state, module, parent == nullptr ? Py_True : Py_False, nullptr);
    if (state == nullptr) {
      Py_DECREF(self);
      return nullptr;
    }
    if (!PyTuple_Check(state) || PyTuple_GET_SIZE(state) != 2) {
      Py_DECREF(state);
      Py_DECREF(self);
      PyErr_SetString(PyExc_TypeError, "KeptCall: root_state must return (rng, wraps)");
      return nullptr;
    }
    call->rng = Py_NewRef(PyTuple_GET_ITEM(state, 0));
    call->wraps = PyBool_FromLong(PyObject_IsTrue(PyTuple_GET_ITEM(state, 1)) == 1);
    Py_DECREF(state);
    call->counts = PyDict_New();
    if (call->counts == nullptr) {
      Py_DECREF(self);
      return nullptr;
    }
    root = call;
  } else {
    root = parent->root == nullptr || parent->root == Py_None ? parent : reinterpret_cast<KeptCallObject*>(parent->root);
    call->root = Py_NewRef(reinterpret_cast<PyObject*>(root));
    call->wraps = Py_NewRef(Py_False);
  }
  if (parent != nullptr && parent->module == module) {  // one call hooked twice (a module under two parents)
    call->ordinal = Py_NewRef(parent->ordinal == nullptr ? Py_None : parent->ordinal);
    return self;
  }
  if (root->counts == nullptr || !PyDict_CheckExact(root->counts)) {
    Py_DECREF(self);
    PyErr_SetString(PyExc_TypeError, "KeptCall: the root's counts must be a dict");
    return nullptr;
  }
  PyObject* key = PyLong_FromVoidPtr(module);  // id(module)
  if (key == nullptr) {
    Py_DECREF(self);
    return nullptr;
  }
  PyObject* before = PyDict_GetItemWithError(root->counts, key);  // borrowed; null: not called before
  const long ordinal = before == nullptr ? 0 : PyLong_AsLong(before);
  PyObject* next = PyErr_Occurred() != nullptr ? nullptr : PyLong_FromLong(ordinal + 1);
  call->ordinal = next == nullptr ? nullptr : PyLong_FromLong(ordinal);
  const bool failed = call->ordinal == nullptr || PyDict_SetItem(root->counts, key, next) < 0;
  Py_XDECREF(next);
  Py_DECREF(key);
  if (failed) {
    Py_DECREF(self);
    return nullptr;
  }
  return self;
}

// call.returned(output): its output as it returned, and the versions of its tensors then (one
// level deep: a tensor, or the tensors of a tuple or list), as culprit.KeptCall.returned.
PyObject* kept_call_returned(PyObject* self, PyObject* output) {
  auto* call = reinterpret_cast<KeptCallObject*>(self);
  PyObject* versions = nullptr;
  if (THPVariable_Check(output)) {
    PyObject* items = PyTuple_Pack(1, output);
    versions = items == nullptr ? nullptr : versions_or_null(items, Py_None);
    Py_XDECREF(items);
  } else {
    versions = PyTuple_Check(output) || PyList_Check(output) ? versions_or_null(output, Py_None) : PyTuple_New(0);
  }
  if (versions == nullptr) {
    return nullptr;
  }
  Py_XSETREF(call->output, Py_NewRef(output));
  Py_XSETREF(call->output_versions, versions);
  Py_RETURN_NONE;
}

// call.release(): lets go of the inputs and output (a replay runs the nearest enclosing call that kept them).
PyObject* kept_call_release(PyObject* self, PyObject* /*unused*/) {
  auto* call = reinterpret_cast<KeptCallObject*>(self);
  Py_XSETREF(call->args, Py_NewRef(Py_None));
  Py_XSETREF(call->kwargs, Py_NewRef(Py_None));
  Py_XSETREF(call->output, Py_NewRef(Py_None));
  Py_XSETREF(call->output_versions, Py_NewRef(Py_None));
  Py_XSETREF(call->kept, Py_NewRef(Py_False));
  Py_RETURN_NONE;
}

// Whether `versions` (a field) differ from versions_of(args, kwargs) now; null with the error set.
PyObject* versions_differ(PyObject* args, PyObject* kwargs, PyObject* versions) {
  PyObject* now = versions_or_null(args, kwargs);
  if (now == nullptr) {
    return nullptr;
  }
  const int differ = PyObject_RichCompareBool(now, versions == nullptr ? Py_None : versions, Py_NE);
  Py_DECREF(now);
  return differ < 0 ? nullptr : PyBool_FromLong(differ);
}

// call.changed(): whether an input changed in place since the call started.
PyObject* kept_call_changed(PyObject* self, PyObject* /*unused*/) {
  auto* call = reinterpret_cast<KeptCallObject*>(self);
  return versions_differ(call->args, call->kwargs, call->versions);
}

// call.output_changed(): whether the output changed in place since the call returned.
PyObject* kept_call_output_changed(PyObject* self, PyObject* /*unused*/) {
  auto* call = reinterpret_cast<KeptCallObject*>(self);
  PyObject* output = call->output == nullptr ? Py_None : call->output;
  PyObject* items = THPVariable_Check(output) ? PyTuple_Pack(1, output)
                    : PyTuple_Check(output) || PyList_Check(output) ? Py_NewRef(output)
                                                                    : PyTuple_New(0);
  if (items == nullptr) {
    return nullptr;
  }
  PyObject* differ = versions_differ(items, Py_None, call->output_versions);
  Py_DECREF(items);
  return differ;
}

// call.call_state(): what the replay runs under ({"grad_enabled", "autocast"}).
PyObject* kept_call_state(PyObject* self, PyObject* /*unused*/) {
  auto* call = reinterpret_cast<KeptCallObject*>(self);
  return Py_BuildValue("{sOsO}", "grad_enabled", call->grad_enabled, "autocast", call->autocast);
}

// call.root: the outermost call of its pass (itself for a root); call.output: its output or None.
PyObject* kept_call_root(PyObject* self, void* /*unused*/) {
  auto* call = reinterpret_cast<KeptCallObject*>(self);
  return Py_NewRef(call->root == nullptr || call->root == Py_None ? self : call->root);
}

PyObject* kept_call_output(PyObject* self, void* /*unused*/) {
  auto* call = reinterpret_cast<KeptCallObject*>(self);
  return Py_NewRef(call->output == nullptr ? Py_None : call->output);
}

PyGetSetDef kept_call_getset[] = {{"root", kept_call_root, nullptr, "The outermost call of its pass", nullptr},
                                  {"output", kept_call_output, nullptr, "Its output as it returned", nullptr},
                                  {nullptr, nullptr, nullptr, nullptr, nullptr}};

#define KEPT_CALL_MEMBER(field, name) {name, T_OBJECT, offsetof(KeptCallObject, field), 0, nullptr},
PyMemberDef kept_call_members[] = {
    KEPT_CALL_MEMBER(module, "module") KEPT_CALL_MEMBER(args, "args") KEPT_CALL_MEMBER(kwargs, "kwargs")
    KEPT_CALL_MEMBER(versions, "versions") KEPT_CALL_MEMBER(parent, "parent")
    KEPT_CALL_MEMBER(grad_enabled, "grad_enabled") KEPT_CALL_MEMBER(autocast, "autocast")
    KEPT_CALL_MEMBER(output, "_output") KEPT_CALL_MEMBER(output_versions, "output_versions")
    KEPT_CALL_MEMBER(root, "_root") KEPT_CALL_MEMBER(rng, "rng") KEPT_CALL_MEMBER(counts, "counts")
    KEPT_CALL_MEMBER(ordinal, "ordinal") KEPT_CALL_MEMBER(wraps, "wraps") KEPT_CALL_MEMBER(kept, "kept")
    {nullptr, 0, 0, 0, nullptr}};
#undef KEPT_CALL_MEMBER

PyMethodDef kept_call_methods[] = {
    {"returned", kept_call_returned, METH_O, "The call's output as it returned, and its tensors' versions then"},
    {"release", kept_call_release, METH_NOARGS, "Let go of the inputs and output"},
    {"changed", kept_call_changed, METH_NOARGS, "Whether an input changed in place since the call started"},
    {"output_changed", kept_call_output_changed, METH_NOARGS, "Whether the output changed in place since it returned"},
    {"call_state", kept_call_state, METH_NOARGS, "What the replay runs under"},
    {nullptr, nullptr, 0, nullptr}};

void add_kept_call(py::module& m) {
  kept_call_type.tp_name = "overflow_fast._C.hooks.KeptCall";
  kept_call_type.tp_basicsize = sizeof(KeptCallObject);
  kept_call_type.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  kept_call_type.tp_doc = "find_op's record of one hooked call (hooks/culprit.py's KeptCall; csrc/hooks.cpp)";
  kept_call_type.tp_new = kept_call_new;
  kept_call_type.tp_dealloc = kept_call_dealloc;
  kept_call_type.tp_traverse = kept_call_traverse;
  kept_call_type.tp_clear = kept_call_clear;
  kept_call_type.tp_members = kept_call_members;
  kept_call_type.tp_methods = kept_call_methods;
  kept_call_type.tp_getset = kept_call_getset;
  if (PyType_Ready(&kept_call_type) < 0) {
    throw py::error_already_set();
  }
  m.add_object("KeptCall", py::handle(reinterpret_cast<PyObject*>(&kept_call_type)));
}

// The C++ object of a pybind11 instance, or null before its constructor ran (the collector may
// traverse an instance whose construction failed).
template <typename T>
T* constructed(PyObject* self) {
  const auto holder = reinterpret_cast<py::detail::instance*>(self)->get_value_and_holder();
  return holder.holder_constructed() ? holder.template value_ptr<T>() : nullptr;
}

// A class whose C++ object holds Python objects takes part in garbage collection, through its
// traverse(visit, arg) and clear(): a reference cycle through it (a detector's callback that
// leads back to the detector, and to the model) is then collected, not kept forever.
template <typename T>
py::custom_type_setup collected() {
  return py::custom_type_setup([](PyHeapTypeObject* heap_type) {
    PyTypeObject* type = &heap_type->ht_type;
    type->tp_flags |= Py_TPFLAGS_HAVE_GC;
    type->tp_traverse = [](PyObject* self, visitproc visit, void* arg) -> int {
      Py_VISIT(Py_TYPE(self));  // an instance of a heap type holds its type
      const T* object = constructed<T>(self);
      return object == nullptr ? 0 : object->traverse(visit, arg);
    };
    type->tp_clear = [](PyObject* self) -> int {
      if (T* object = constructed<T>(self)) {
        object->clear();
      }
      return 0;
    };
  });
}

// The hook layer's classes as Python sees them (set where they are registered): the one call
// below checks its arguments' types itself.
PyTypeObject* entries_of_type = nullptr;
PyTypeObject* output_gradients_type = nullptr;
PyTypeObject* hook_core_type = nullptr;

// The C++ object of `object`, an instance of exactly `type` (or None where `optional`: null).
template <typename T>
T* object_of(PyObject* object, PyTypeObject* type, bool optional, const char* what) {
  if (optional && object == Py_None) {
    return nullptr;
  }
  T* value = Py_TYPE(object) == type ? constructed<T>(object) : nullptr;
  if (value == nullptr) {
    throw py::type_error(std::string("forward_call: ") + what + " must be a " + type->tp_name +
                         (optional ? " or None" : "") + ", got " + Py_TYPE(object)->tp_name);
  }
  return value;
}

// Whether HookCore.add's answer leaves its caller nothing to do: added, no row changed after its
// hook, and its rows read by the launcher or waiting (hook_core.py's settled is its specification).
bool settled(const py::tuple& answer) {
  return answer[0].cast<int64_t>() >= 0 && py::len(answer[4]) == 0 &&
         (answer[5].cast<int64_t>() == kLaunched || py::len(answer[3]) == 0);
}

// One forward hook call outside torch.func transforms, in one crossing (hooks/hook_core.py's
// forward_call is its specification): its entries (EntriesOf), the hooks on its outputs'
// gradients (`outputs`, or None without gradient checks), its kept call's output (`kept`, or None
// without find_op) and its rows (`core`'s add, which launches where a launcher is bound; None:
// the caller adds them). `site` >= 0: the call may wait, where its tensors are off the CPU or
// `waits_on_cpu`. (entries, tensors, dtypes, sources, answer): the call's sources (key, rows,
// None) where the add's answer is `settled`, else None and that answer (None: nothing added).
py::tuple forward_call(PyObject* const* args) {
  const auto& entries_of = *object_of<EntriesOf>(args[0], entries_of_type, false, "entries_of");
  const py::handle module(args[1]);
  const py::handle output(args[3]);
  auto* outputs = object_of<OutputGradients>(args[5], output_gradients_type, true, "outputs");
  PyObject* kept = args[6];
  auto* core = object_of<HookCore>(args[7], hook_core_type, true, "core");
  int64_t site = PyLong_AsLongLong(args[8]);
  const int waits_on_cpu = PyObject_IsTrue(args[9]);
  if ((site == -1 || waits_on_cpu < 0) && PyErr_Occurred() != nullptr) {
    throw py::error_already_set();
  }
  Entries entries = entries_of.entries(module, py::handle(args[2]), output, py::handle(args[4]));
  if (outputs != nullptr) {
    outputs->watch_entries(module, entries);
  }
  if (kept != Py_None) {
    if (!PyObject_TypeCheck(kept, &kept_call_type)) {
      throw py::type_error("forward_call: kept must be a KeptCall or None");
    }
    if (py::reinterpret_steal<py::object>(kept_call_returned(kept, output.ptr())).ptr() == nullptr) {
      throw py::error_already_set();
    }
  }
  py::object sources = py::none();
  py::object added = py::none();
  if (core != nullptr && !entries.tensors.empty()) {
    if (site >= 0 && waits_on_cpu == 0 && tensor_of(PyList_GET_ITEM(entries.tensors.ptr(), 0)).is_cpu()) {
      site = -1;
    }
    py::tuple answer = core->add(entries.tensors, site, site >= 0);
    if (settled(answer)) {
      sources = py::make_tuple(answer[0], answer[1], py::none());
    } else {
      added = std::move(answer);
    }
  }
  return py::make_tuple(kept_as_tuple(entries.entries), std::move(entries.tensors), kept_as_tuple(entries.dtypes),
                        std::move(sources), std::move(added));
}

// forward_call(entries_of, module, input, output, kwargs, outputs, kept, core, site, waits_on_cpu)
// as a plain C function: it runs at every hook, where pybind11's dispatch of ten arguments would
// cost about as much as the call's own work.
PyObject* forward_call_entry(PyObject* /*self*/, PyObject* const* args, Py_ssize_t count) {
  if (count != 10) {
    PyErr_Format(PyExc_TypeError, "forward_call takes 10 positional arguments (%zd given)", count);
    return nullptr;
  }
  try {
    return forward_call(args).release().ptr();
  } catch (py::error_already_set& error) {
    error.restore();
  } catch (python_error& error) {  // (torch's: a Python error raised under a torch call)
    error.restore();
  } catch (const py::builtin_exception& error) {
    error.set_error();
  } catch (const c10::Error& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what_without_backtrace());
  } catch (const std::exception& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what());
  }
  return nullptr;
}

PyMethodDef forward_call_method = {"forward_call", reinterpret_cast<PyCFunction>(forward_call_entry), METH_FASTCALL,
                                   "One forward hook call's work in one crossing (csrc/hooks.cpp)"};

}  // namespace

void add_hook_layer(py::module& m) {
  add_kept_call(m);
  py::class_<HookCore> core(m, "HookCore",
                             "The detector's bookkeeping of when each hook's tensors are read (csrc/hooks.cpp)",
                             collected<HookCore>());
  core.def(py::init<int64_t, int64_t, int64_t>(), py::arg("capacity"), py::arg("stage_bytes"),
           py::arg("max_remembered"))
      .def("add", &HookCore::add, py::arg("tensors"), py::arg("site"), py::arg("defer"))
      .def("bind", &HookCore::bind, py::arg("key"), py::arg("launcher"), py::arg("buffer"))
      .def("pending", &HookCore::pending)
      .def("reset", &HookCore::reset)
      .def("used", &HookCore::used, py::arg("key"))
      .def("unchanged", &HookCore::unchanged, py::arg("tensor"), py::arg("key"), py::arg("row"))
      .def("device", &HookCore::device, py::arg("key"));
  hook_core_type = reinterpret_cast<PyTypeObject*>(core.ptr());
  m.attr("HOOK_FULL") = kFull;
  m.attr("HOOK_MIXED_DEVICES") = kMixedDevices;
  m.attr("READ_BY_CALLER") = static_cast<int64_t>(kByCaller);
  m.attr("LAUNCHED") = static_cast<int64_t>(kLaunched);
  m.attr("LAUNCH_FAILED") = static_cast<int64_t>(kLaunchFailed);
  py::class_<EntriesOf> entries_of(m, "EntriesOf", "frames.py's entries of a hook call in one C++ pass (csrc/hooks.cpp)",
                                   collected<EntriesOf>());
  entries_of.def(py::init<const py::iterable&, py::object, py::object, py::object, py::object, py::object, bool>(),
                 py::arg("supported_dtypes"), py::arg("unreadable_reason"), py::arg("own_parameters"),
                 py::arg("listed_as_torch"), py::arg("leaves"), py::arg("opens_nothing"), py::arg("containers"))
      .def("of", &EntriesOf::of, py::arg("items"))
      .def("forward", &EntriesOf::forward, py::arg("module"), py::arg("input"), py::arg("output"),
           py::arg("kwargs"));
  entries_of_type = reinterpret_cast<PyTypeObject*>(entries_of.ptr());
  PyObject* function = PyCFunction_New(&forward_call_method, nullptr);
  if (function == nullptr) {
    throw py::error_already_set();
  }
  m.add_object("forward_call", py::reinterpret_steal<py::object>(function));
  m.def("versions_of", &versions_of, py::arg("args"), py::arg("kwargs"),
        "culprit.versions_of's answer in one C++ call (csrc/hooks.cpp)");
  py::class_<OutputGradients> outputs(
      m, "OutputGradients", "The gradients arriving at forward outputs, hooked in one C++ pass (csrc/hooks.cpp)",
      collected<OutputGradients>());
  outputs.def(py::init<py::object, py::object>(), py::arg("callback"), py::arg("hook_apart"))
      .def("clear", &OutputGradients::clear)
      .def("watch", &OutputGradients::watch, py::arg("module"), py::arg("entries"), py::arg("tensors"))
      .def("new_forward", &OutputGradients::new_forward)
      .def("incoming_read", &OutputGradients::incoming_read, py::arg("module"));
  output_gradients_type = reinterpret_cast<PyTypeObject*>(outputs.ptr());
}

}  // namespace overflow_fast
