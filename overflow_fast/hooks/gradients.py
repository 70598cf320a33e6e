"""Gradient frames (``backward=True``): each parameter's gradient once it is accumulated, and the
gradient arriving at each module's tensor outputs, as frames in the forward frames' format
(``weight.grad``, ``output.grad``, ``output[0].grad``).

Output gradients are taken with a hook on the output tensor itself, not a module backward hook:
``register_full_backward_hook`` wraps the outputs in a view, which breaks in-place ops that
follow the module (``ReLU(inplace=True)``), and a debugging tool must not change what runs.
"""

import functools

from .frames import own_parameters
from .hook_core import output_gradients


class GradientHooks:
    """Registers the gradient hooks of a model; ``on_frame(module, items, consumers)`` receives
    each gradient frame's ``(tensor, ctx)`` items (called inside the backward pass); ``consumers``:
    for an output gradient, the names of the modules whose backward produced it."""

    def __init__(self, model, module_names, on_frame, on_output_gradient=None):
        self._module_names = module_names
        self._on_frame = on_frame
        self._on_output_gradient = on_output_gradient  # (id of the output tensor, its gradient)
        self.active = True
        self._handles = []
        # which output tensors of this forward are hooked, and who consumes them (made at the first
        # forward: the extension it may use is loaded then, as the detector's rows are)
        self._outputs = None
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
        # deepcopy(model) / torch.save(model) reach these hooks through the parameters; the
        # tensors of a forward are not carried
        state = self.__dict__.copy()
        state["_outputs"] = None
        return state

    def new_forward(self):
        if self._outputs is not None:
            self._outputs.new_forward()

    def incoming_read(self, module):
        """Whether the gradient arriving at ``module``'s outputs is read (so a nan/inf first seen in
        its parameters' gradients came from a finite one), as the last forward hooked them (not
        under torch.compile: traced hooks)."""
        return self._outputs is not None and self._outputs.incoming_read(module)

    def watch_outputs(self, module, entries, tensors):
        """Hook the gradients of a forward call's output tensors that require one, and note the
        module as a consumer of the hooked tensors it took as inputs (their gradient comes from
        its backward)."""
        outputs = self._outputs
        if outputs is None:
            outputs = self._outputs = output_gradients(self._output_hook, self._hook_apart)
        outputs.watch(module, entries, tensors)

    def _hook_apart(self, tensor, owner):
        tensor.register_hook(functools.partial(self._output_hook, owner))  # a subclass's own

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
