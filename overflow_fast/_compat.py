"""What differs between the torch versions the package supports, in one place: the rest of the
package asks here and never compares versions itself. Imports torch only, so that every folder
may use it (tests/test_layout.py)."""

import torch

# ---- torch.compile: what each version's dynamo traces -----------------------------------------
# The tests of tests/test_compile.py pass on every version below; the notes say which one needs it.


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
