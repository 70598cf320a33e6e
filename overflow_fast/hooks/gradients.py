"""Gradient frames (``backward=True``): each parameter's gradient once it is accumulated, and the
gradient arriving at each module's tensor outputs, as frames in the forward frames' format
(``weight.grad``, ``output.grad``, ``output[0].grad``).

Output gradients are taken with a hook on the output tensor itself, not a module backward hook:
``register_full_backward_hook`` wraps the outputs in a view, which breaks in-place ops that
follow the module (``ReLU(inplace=True)``), and a debugging tool must not change what runs.
"""

import weakref

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
                hook = _ParameterHook(self, module, f"{name}.grad")
                self._handles.append(parameter.register_post_accumulate_grad_hook(hook))

    def remove(self):
        self.active = False
        for handle in self._handles:
            handle.remove()
        self._handles = []
        # output hooks on tensors still alive (a loss kept after remove()) fire as no-ops, and
        # nothing here leads to the model any more
        if self._outputs is not None:
            self._outputs.clear()
            self._outputs = None
        self._module_names = {}

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

    def output_hooks(self):
        """The ``OutputGradients`` that a forward hook call hands its entries to (``watch``): it hooks
        the gradients of the call's output tensors that require one, and notes the module as a
        consumer of the hooked tensors it took as inputs (their gradient comes from its backward)."""
        outputs = self._outputs
        if outputs is None:
            outputs = self._outputs = output_gradients(self._output_hook, self._hook_apart)
        return outputs

    @staticmethod
    def _hook_apart(tensor, hook):
        tensor.register_hook(hook)  # a subclass's own

    def _parameter_hook(self, module, ctx, parameter):
        if self.active and parameter.grad is not None:
            self._on_frame(module, [(parameter.grad, ctx)], None)

    def _output_hook(self, owner, grad):
        if self.active:
            module, ctx, consumers, tensor_id = owner  # (the modules: weak references)
            module = module()
            if module is None:
                return
            if self._on_output_gradient is not None:
                self._on_output_gradient(tensor_id, grad)
            names = self._module_names
            self._on_frame(module, [(grad, ctx)], [names.get(consumer(), "?") for consumer in consumers])
        # returns None: the gradient flows on unchanged


class _ParameterHook:
    """A parameter's gradient hook: ``hooks._parameter_hook(module, ctx, parameter)``. torch keeps a
    parameter's hooks where no collector sees them (its C++ autograd metadata), so a strong
    reference back to the detector would keep the model alive for good once both are dropped
    without remove(): it holds them weakly. A copy of the model (deepcopy, pickle) carries the
    hook with its own copies of both, as a plain reference would."""

    __slots__ = ("hooks", "module", "ctx")

    def __init__(self, hooks, module, ctx):
        self.hooks = weakref.ref(hooks) if hooks is not None else _gone
        self.module = weakref.ref(module) if module is not None else _gone
        self.ctx = ctx

    def __call__(self, parameter):
        hooks, module = self.hooks(), self.module()
        if hooks is not None and module is not None:
            hooks._parameter_hook(module, self.ctx, parameter)

    def __reduce__(self):
        return _ParameterHook, (self.hooks(), self.module(), self.ctx)


def _gone():
    return None
