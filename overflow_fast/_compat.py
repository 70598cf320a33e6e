"""What differs between the torch versions the package supports, in one place: the rest of the
package asks here and never compares versions itself. Imports torch only, so that every folder
may use it (tests/test_layout.py)."""

import torch

# ---- what this torch has: dtypes and APIs that only some supported versions have --------------
# The floor is pyproject's (torch 2.7); docs/install.md lists the versions the suite passed on.
# Older versions' differences stay where they cost a line (DTensor's module before 2.5).


def dtypes(*names):
    """The dtypes of these names that this torch has, in order: float8_e8m0fnu from torch 2.7,
    uint16, uint32 and uint64 from 2.3."""
    return tuple(getattr(torch, name) for name in names if isinstance(getattr(torch, name, None), torch.dtype))


def dtensor_api():
    """torch's DTensor module (DTensor, Shard, Replicate, distribute_tensor, ...): public as
    torch.distributed.tensor from torch 2.5, torch.distributed._tensor before; None in a torch
    built without distributed."""
    import importlib

    for name in ("torch.distributed.tensor", "torch.distributed._tensor"):
        try:
            module = importlib.import_module(name)
        except Exception:
            continue
        if hasattr(module, "DTensor"):
            return module
    return None


# ---- torch.compile: what each version's dynamo traces -----------------------------------------
# The tests of tests/test_compile.py pass on every version below; the notes say which one needs it.


# From torch 2.11 (the oldest tested that does; 2.8 to 2.10 untested) dynamo compiles a model with
# a detector attached whole, without graph breaks, and no recompile from batch to batch. torch 2.7's
# compiles no graph of it (the call runs eagerly) or, without never_a_compiled_frame, breaks at each
# module: what the detector prints is the same, the speed is eager's.
COMPILES_A_WATCHED_MODEL_WHOLE = torch.__version__ >= (2, 11)


def is_dataclass_instance(value):
    """``dataclasses.is_dataclass(value)`` for an instance, written so that dynamo traces it on
    every version: torch 2.11's breaks the graph on ``hasattr`` of a builtin class (the type of
    None, of a dtype, of a device), which ``is_dataclass`` calls."""
    return not isinstance(value, type) and getattr(type(value), "__dataclass_fields__", None) is not None


def never_a_compiled_frame(*functions):
    """Dynamo still inlines these functions into a frame that it traces, but never compiles one of
    them as a frame of its own, nor what it calls: called from code that dynamo skips (torch.nn's
    ``_call_impl`` around a module whose forward it does not trace: on torch 2.11 a built-in
    ``nn.Sequential``, or every module once a graph break lost the frame around them), a hook then
    runs eagerly, as it would without torch.compile, instead of compiling a graph of its own per
    call. A torch without this (private) switch keeps dynamo's default."""
    # torch._C's own module, not torch._dynamo's: importing dynamo would add a second to every import
    frames = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    if frames is None or not hasattr(frames, "set_code_exec_strategy"):
        return
    skip = frames._FrameExecStrategy(frames._FrameAction.SKIP, frames._FrameAction.SKIP)
    for function in functions:
        frames.set_code_exec_strategy(function.__code__, skip)


def kept_out_of_graphs(*functions):
    """What ``torch.compiler.disable`` does to these functions, without its wrapper: dynamo never
    traces them into a graph (a call to one from a traced frame runs eagerly, as a disabled
    function's does) and never compiles them or what they call as frames of their own."""
    for function in functions:
        function._torchdynamo_disable = True
    never_a_compiled_frame(*functions)


# ---- Triton's interpreter (TRITON_INTERPRET=1, the CPU run of the Triton kernels) ---------------


def interpreter_indexes_one_element_arrays():
    """Triton's interpreter holds every scalar as a one-element numpy array, and up to Triton 3.6
    makes an index of it (a loop's run-time bound) with ``int()`` of that array, which numpy 2.4
    refuses (only 0-d arrays convert): every kernel with such a loop fails. Make the index from the
    array's one element, as later Tritons do. A GPU compiles the loop, so nothing changes there.
    Call it only where the interpreter runs (it imports Triton's interpreter and numpy)."""
    import numpy
    from triton.runtime import interpreter

    try:
        int(numpy.ones(1, dtype=numpy.int64))
        return  # this numpy still converts one-element arrays
    except TypeError:
        pass
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "indexes_one_element_arrays", False):
        return

    def patch_lang_tensor(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patch_lang_tensor.indexes_one_element_arrays = True
    interpreter._patch_lang_tensor = patch_lang_tensor
