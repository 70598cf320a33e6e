"""The one sandbox every replay runs in: find_op's replay of one module call and check="step"'s replay of
a whole step. Inside it the run is left as it was: no forward, forward-pre or backward hook of the
module, its submodules or the global ones runs (but tensor parallelism's, which hold no state), its
buffers (and, for a replay that takes gradients, its parameters) are stand-ins, the RNG states are
those given and put back after, and so are the private ``torch.Generator``s its random ops draw from
(``PrivateGenerators``), grad mode and autocast are the call's, and nothing is sent to other ranks
(``distributed.NoCommunication``: a collective stops the replay before it runs). No optimizer holds
the stand-in parameters, so none can step them."""

import contextlib
import copy
from collections import OrderedDict

import torch
import torch.nn.modules.module as _torch_module
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..distributed import holds_sharded_parameters

_MODULE_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                 "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
                 "_backward_pre_hooks")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_hooks_with_kwargs",
                 "_global_forward_hooks_always_called", "_global_forward_pre_hooks",
                 "_global_backward_hooks", "_global_backward_pre_hooks")
_AUTOCAST_DEVICES = ("cpu", "cuda")


# -- what the replay keeps as it was -----------------------------------------------------------------

@contextlib.contextmanager
def without_hooks(module, keep_tensor_parallel=False):
    """No forward, forward-pre or backward hook runs inside: those of ``module`` and its submodules,
    and the global ones (``register_module_forward_hook``...), are set aside and put back after.
    ``keep_tensor_parallel``: but those of tensor parallelism stay (``_tensor_parallel_hooks``)."""
    modules = _unique_modules(module)
    saved = [(m, {name: m.__dict__[name] for name in _MODULE_HOOKS if name in m.__dict__})
             for m in modules]
    global_saved = {}
    try:
        for m, hooks in saved:
            for name in hooks:
                m.__dict__[name] = _tensor_parallel_hooks(name, hooks[name]) if keep_tensor_parallel else OrderedDict()
        for name in _GLOBAL_HOOKS:
            hooks = getattr(_torch_module, name, None)
            if isinstance(hooks, dict):
                global_saved[name] = dict(hooks)
                hooks.clear()
        yield module
    finally:
        for m, hooks in saved:
            m.__dict__.update(hooks)
        for name, hooks in global_saved.items():
            live = getattr(_torch_module, name)
            live.clear()
            live.update(hooks)


def _tensor_parallel_hooks(name, hooks):
    """The forward hooks of torch.distributed.tensor (``distribute_module``, which
    ``parallelize_module`` uses): they turn a call's local inputs into DTensors and its outputs back,
    holding no state, so that a replay runs as the call did (a collective they would run is refused
    like any other)."""
    if name not in ("_forward_pre_hooks", "_forward_hooks"):
        return OrderedDict()
    return OrderedDict((key, hook) for key, hook in hooks.items()
                       if getattr(hook, "__module__", "").startswith("torch.distributed.tensor"))


def replay_hooks(module):
    """What a replay runs without: every hook of ``without_hooks`` but tensor parallelism's."""
    return without_hooks(module, keep_tensor_parallel=True)


def sharded_for_the_call(module):
    """The name (within ``module``; "" for itself) of a module whose parameters are sharded across
    ranks with no tensor-parallel hook of its own to run its forward on them (FSDP2's, which
    gathers them for each call only), or None."""
    for name, sub in module.named_modules():
        if holds_sharded_parameters(sub) and not _tensor_parallel_hooks("_forward_pre_hooks", sub._forward_pre_hooks):
            return name
    return None


def _unique_modules(module):
    return list(module.modules())  # modules() yields a shared submodule once


def _restore(live, saved):
    for key in [key for key in live if key not in saved]:
        del live[key]
    live.update(saved)


@contextlib.contextmanager
def module_kept(module, fresh_parameters):
    """Each submodule's attributes, parameters, buffers and children are as before after the block;
    inside, its buffers are copies (what the forward writes into them is dropped), it runs eagerly
    (a ``module.compile()``'d one too: the dispatch mode must see every op), and with
    ``fresh_parameters`` its parameters are new leaves sharing their data, with no hooks (tensor
    hooks fire in ``torch.autograd.grad`` too)."""
    modules = _unique_modules(module)
    saved = [(m, dict(m.__dict__), dict(m._parameters), dict(m._buffers), dict(m._modules))
             for m in modules]
    replaced = {}
    try:
        with torch.no_grad():
            for m in modules:
                for name, buffer in m._buffers.items():
                    if buffer is not None:
                        if id(buffer) not in replaced:
                            replaced[id(buffer)] = buffer.clone()
                        m._buffers[name] = replaced[id(buffer)]
                if fresh_parameters:
                    for name, parameter in m._parameters.items():
                        if type(parameter) is torch.nn.Parameter:  # a subclass is kept as it is
                            if id(parameter) not in replaced:
                                replaced[id(parameter)] = torch.nn.Parameter(
                                    parameter.detach(), requires_grad=parameter.requires_grad)
                            m._parameters[name] = replaced[id(parameter)]
                m.__dict__["_compiled_call_impl"] = None
        yield
    finally:
        for m, attributes, parameters, buffers, children in saved:
            _restore(m.__dict__, attributes)
            _restore(m._parameters, parameters)
            _restore(m._buffers, buffers)
            _restore(m._modules, children)


def rng_state():
    """The CPU and CUDA RNG states now (CUDA's only where CUDA is initialized): take it just before
    a call to replay that call's random ops exactly (``rng=``)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


def set_rng_state(state):
    if state.get("cpu") is not None:
        torch.set_rng_state(state["cpu"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


@contextlib.contextmanager
def rng_kept(rng):
    before = rng_state()
    try:
        if rng is not None:
            set_rng_state(rng)
        yield
    finally:
        set_rng_state(before)


class PrivateGenerators(TorchDispatchMode):
    """Inside, every ``torch.Generator`` that an op is given (``torch.rand(..., generator=g)``: a
    module's own) is put back after as it was before its first draw, so that the run's later draws
    are its own; ``drawn`` names the ops that drew from one. Their draws cannot be the run's (the
    run drew them already): a replay that made them says so."""

    def __init__(self):
        super().__init__()
        self.saved = {}  # id -> (generator, its state before the replay's first draw)
        self.drawn = []  # the ops that drew from one, in order

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Generator):
                if id(value) not in self.saved:
                    self.saved[id(value)] = (value, value.get_state())
                name = str(getattr(func, "overloadpacket", func))
                if name not in self.drawn:
                    self.drawn.append(name)
        return func(*args, **kwargs)

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for generator, state in self.saved.values():
                generator.set_state(state)


def call_state():
    """What a call ran under, beyond its inputs: grad mode and autocast (device type -> dtype).
    Take it at the call when the replay runs later (``call=``)."""
    autocast = {device: torch.get_autocast_dtype(device) for device in _AUTOCAST_DEVICES
                if torch.is_autocast_enabled(device)}
    return {"grad_enabled": torch.is_grad_enabled(), "autocast": autocast}


def autocast_as(stack, autocast):
    """Autocast as ``autocast`` says, for the device types that have it; off elsewhere. Its cache
    of casts is off: inside the run's own autocast region it holds the run's cast weights, and a
    replay must make (and see) each cast again: a weight that does not fit the dtype it is cast to
    becomes inf there."""
    for device in _AUTOCAST_DEVICES:
        dtype = autocast.get(device)
        if dtype is not None:
            if device == "cuda" and not torch.cuda.is_available():
                continue
            stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=False))
        elif torch.is_autocast_enabled(device):
            stack.enter_context(torch.autocast(device, enabled=False))



_ATOMS = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device, torch.nn.Module)


def copied(value, requires_grad=True):
    """A copy of ``value`` (args, kwargs, gradients) for a replay or a file: tensors detached and
    cloned (``requires_grad`` as they had, with ``requires_grad``), shared ones still shared, in the
    objects that hold them too (a transformers cache holding a graph's tensors); other objects
    deep-copied (a cache the call appends to), modules and plain values as they are."""
    memo = {}

    def tensor_copy(tensor):
        clone = memo.get(id(tensor))
        if clone is None:
            with torch.no_grad():
                clone = tensor.detach().clone()
            if requires_grad and tensor.requires_grad:
                clone.requires_grad_(True)
            memo[id(tensor)] = clone
        return clone

    leaves, spec = pytree.tree_flatten(value)
    copies = []
    with _TensorsCloned(tensor_copy):
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                copies.append(tensor_copy(leaf))
            elif isinstance(leaf, _ATOMS) or callable(leaf):
                copies.append(leaf)
            else:
                copies.append(copy.deepcopy(leaf, memo))
    return pytree.tree_unflatten(copies, spec)


class _TensorsCloned(TorchFunctionMode):
    """Inside, ``copy.deepcopy`` copies a tensor as ``tensor_copy`` does: deepcopy refuses a tensor
    that is not a leaf of autograd's graph (the keys and values of a cache, under grad mode)."""

    def __init__(self, tensor_copy):
        super().__init__()
        self.tensor_copy = tensor_copy

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__deepcopy__:
            return self.tensor_copy(args[0])
        return func(*args, **(kwargs or {}))


def entered(stack, module, rng, call, without_hooks=replay_hooks, backward=False):
    """Enter what every replay runs inside: no hook of the module runs (``without_hooks``), its
    buffers (and for a ``backward`` its parameters) are stand-ins, the RNG as ``rng`` says and
    restored after, private generators restored after, grad mode (a backward's: on) and autocast as
    ``call`` says. Returns the ``PrivateGenerators`` mode (what drew from one)."""
    stack.enter_context(without_hooks(module))
    stack.enter_context(module_kept(module, fresh_parameters=backward))
    stack.enter_context(rng_kept(rng))
    generators = stack.enter_context(PrivateGenerators())
    if call is not None:
        autocast_as(stack, call.get("autocast") or {})
        if not backward:
            stack.enter_context(torch.set_grad_enabled(call["grad_enabled"]))
    if backward:
        stack.enter_context(torch.enable_grad())
    return generators



def holds_objects(args, kwargs):
    """Whether a call's inputs hold objects other than tensors and plain values (a cache): those
    may have changed in place since the call with no version counter to say so."""
    return any(not (isinstance(leaf, (torch.Tensor, *_ATOMS)) or callable(leaf))
               for leaf in pytree.tree_leaves((tuple(args), dict(kwargs or {}))))


