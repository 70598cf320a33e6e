"""Gradient frames (``backward=True``): each parameter's gradient once it is accumulated, and the
gradient arriving at each module's tensor outputs, as frames in the forward frames' format
(``weight.grad``, ``output.grad``, ``output[0].grad``).

Output gradients are taken with a hook on the output tensor itself, not a module backward hook:
``register_full_backward_hook`` wraps the outputs in a view, which breaks in-place ops that
follow the module (``ReLU(inplace=True)``), and a debugging tool must not change what runs.
"""

import functools
import weakref

import torch

from ..stats.kinds import PLAIN_TYPES
from .frames import own_parameters
from .hook_core import gradient_hooks_registrar
from .text import TENSOR


class GradientHooks:
    """Registers the gradient hooks of a model; ``on_frame(module, items, consumers)`` receives
    each gradient frame's ``(tensor, ctx)`` items (called inside the backward pass); ``consumers``:
    for an output gradient, the names of the modules whose backward produced it."""

    def __init__(self, model, module_names, on_frame, on_output_gradient=None):
        self._module_names = module_names
        self._on_frame = on_frame
        self._on_output_gradient = on_output_gradient  # (id of the output tensor, its gradient)
        self._hook_gradients = gradient_hooks_registrar()
        self.active = True
        self._handles = []
        # id(output tensor) -> (weakref, [module, ctx]): a tensor several modules return (a
        # block's last layer and the block itself) gets one hook, named after the outermost
        self._owners = {}
        # ids of the modules whose outputs' gradients are hooked in this forward: the gradient
        # arriving at them is read before their parameters' (not under torch.compile: traced hooks)
        self._incoming = set()
        seen = set()
        for module in model.modules():
            for parameter, name in own_parameters(module):
                # a parameter shared by several modules reports under its first owner
                if id(parameter) in seen or not parameter.requires_grad or not parameter.is_leaf:
                    continue
                seen.add(id(parameter))
                hook = functools.partial(self._parameter_hook, module, f"{name}.grad")
                self._handles.append(parameter.register_post_accumulate_grad_hook(hook))

    def remove(self):
        self.active = False  # output hooks on tensors still alive fire as no-ops
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __getstate__(self):
        # deepcopy(model) / torch.save(model) reach these hooks through the parameters
        state = self.__dict__.copy()
        state["_owners"] = {}
        del state["_hook_gradients"]  # the extension's function: found again where it is loaded
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._hook_gradients = gradient_hooks_registrar()

    def new_forward(self):
        self._owners.clear()
        self._incoming.clear()

    def incoming_read(self, module):
        """Whether the gradient arriving at ``module``'s outputs is read (so a nan/inf first seen in
        its parameters' gradients came from a finite one), as the last forward hooked them."""
        return id(module) in self._incoming

    def watch_outputs(self, module, entries, tensors):
        """Hook the gradients of a forward call's output tensors that require one, and note the
        module as a consumer of the hooked tensors it took as inputs (their gradient comes from
        its backward)."""
        if not torch.is_grad_enabled():
            return
        if len(self._owners) > 1 << 16:  # submodules driven alone never start a new forward
            self._owners.clear()
            self._incoming.clear()
        hooked, owners = [], []
        for kind, ctx, payload in entries:
            if kind != TENSOR:
                continue
            tensor = tensors[payload]
            is_input = ctx.startswith("input")
            if not is_input and not (ctx.startswith("output") and tensor.requires_grad):
                continue  # a parameter, or an output without a gradient
            known = self._owners.get(id(tensor))
            if known is not None and known[0]() is not tensor:
                known = None
            if is_input:
                if known is not None and module not in known[1][2]:
                    known[1][2].append(module)
            else:
                self._incoming.add(id(module))
                if known is not None:
                    known[1][:2] = [module, f"{ctx}.grad"]  # hooks run inner first: the outer one wins
                    continue
                owner = [module, f"{ctx}.grad", [], id(tensor)]
                if type(tensor) in PLAIN_TYPES:
                    hooked.append(tensor)
                    owners.append(owner)
                else:  # a subclass's register_hook is its own
                    tensor.register_hook(functools.partial(self._output_hook, owner))
                try:
                    self._owners[id(tensor)] = (weakref.ref(tensor), owner)
                except TypeError:
                    pass
        if hooked:
            self._hook_gradients(hooked, owners, self._output_hook)  # one call, no handle per tensor

    def _parameter_hook(self, module, ctx, parameter):
        if self.active and parameter.grad is not None:
            self._on_frame(module, [(parameter.grad, ctx)], None)

    def _output_hook(self, owner, grad):
        if self.active:
            module, ctx, consumers, tensor_id = owner
            if self._on_output_gradient is not None:
                self._on_output_gradient(tensor_id, grad)
            self._on_frame(module, [(grad, ctx)], [self._module_names.get(m, "?") for m in consumers])
        # returns None: the gradient flows on unchanged
