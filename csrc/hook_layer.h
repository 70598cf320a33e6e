// The hook layer's C++ (hooks/, not the engine): registered as the extension's submodule
// `overflow_fast._C.hooks`, which only overflow_fast/hooks/hook_core.py opens. It reaches the
// engine through one seam, launch.h's Launcher (the backend's per-hook read, bound to a HookCore).
// hooks.cpp holds it: HookCore (when each hook's tensors are read, into which rows) and what one
// hook call hands over (its entries, its inputs' versions, the gradients arriving at its outputs).
#pragma once

#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

namespace overflow_fast {

// The tensor of a Python object the caller checked (THPVariable_Check).
inline const at::Tensor& tensor_of(const py::handle& object) { return THPVariable_Unpack(object.ptr()); }

// Registers the hook layer's classes and functions in `m` (the submodule `hooks`).
void add_hook_layer(py::module& m);

}  // namespace overflow_fast
