"""The reference's face: the attributes and methods of transformers' ``DebugUnderflowOverflow``
that code written for it uses (its frames and counters, ``save_frame``, ``analyse_variable``,
``forward_hook``...), and its helper functions ``get_abs_min_max`` and ``detect_overflow``, on this
package's state: the frames and counters are the reference's state machine's (``reference``),
and a tensor is read through the engine."""

import torch

from . import text
from .errors import say
from .frames import entries_of, forward_items
from .text import NONE, NOT_A_TENSOR, UNREADABLE
from ..stats import tensor_stats, unreadable_reason
from ..stats.layout import holds_nonfinite


class ReferenceFace:
    """The reference's attributes and methods, for the detector (which has ``decisions``,
    ``model``, ``_passes`` and the hook entry points ``_before`` and ``_after``)."""

    _state = property(lambda self: self.decisions.state)

    # -- the reference's attributes (its state machine's) -------------------------------------

    frames = property(lambda self: self._state.frames, lambda self, value: setattr(self._state, "frames", value))
    frame = property(lambda self: self._state.frame, lambda self, value: setattr(self._state, "frame", value))
    batch_number = property(lambda self: self._state.batch_number,
                            lambda self, value: setattr(self._state, "batch_number", value))
    total_calls = property(lambda self: self._state.total_calls,
                           lambda self, value: setattr(self._state, "total_calls", value))
    detected_overflow = property(lambda self: self._state.detected_overflow,
                                 lambda self, value: self._state.set_detected_overflow(value))

    def save_frame(self, frame=None):
        if frame is not None:
            self.expand_frame(frame)
        self.frames.append("\n".join(self.frame))
        self.frame = []

    def expand_frame(self, line):
        self.frame.append(line)

    def trace_frames(self):
        say("\n".join(str(frame) for frame in self.frames))
        self.frames.clear()

    def reset_saved_frames(self):
        self.frames.clear()

    def dump_saved_frames(self, during=None):
        say(text.dump_text(self.batch_number, self.frames, during))
        self.frames.clear()

    def analyse_model(self):
        # first name wins for a module reachable under several names
        self.module_names = {m: name for name, m in self.model.named_modules()}

    def analyse_variable(self, var, ctx):
        """Add one line for ``var`` to the frame being built, printing its nan/inf lines at once."""
        if isinstance(var, torch.Tensor):
            row = _row_of(var, "analyse_variable")  # one read serves the line and the check
            if isinstance(row, str):
                self.expand_frame(text.entry_line(UNREADABLE, ctx, row))
                return
            self.expand_frame(text.tensor_line(row, var.dtype, ctx))
            for line in text.overflow_lines(row, ctx):
                say(line)
            if holds_nonfinite(row):
                self.detected_overflow = True
        elif var is None:
            self.expand_frame(text.entry_line(NONE, ctx, None))
        else:
            self.expand_frame(text.entry_line(NOT_A_TENSOR, ctx, None))

    def batch_start_frame(self):
        self.frame.extend(text.batch_start_lines(self.batch_number))

    def batch_end_frame(self):
        self.expand_frame(text.batch_end_line(self.batch_number - 1))

    def create_frame(self, module, input, output):
        """Build, check and save the frame of one hook call right away (one host read)."""
        entries, tensors, dtypes = entries_of(forward_items(module, input, output))
        self._passes.decide_apart(module, entries, dtypes, tensors)

    def forward_hook(self, module, input, output):
        """The reference's hook: record one forward call of ``module`` (a pass of its own when no
        hooked call is running on this thread)."""
        self._before(module, input)
        self._after(module, input, None, output)



def _row_of(var, caller):
    """One tensor's host row, or the reason the engine cannot read it (a string)."""
    if not isinstance(var, torch.Tensor):
        raise TypeError(f"{caller} expects a tensor, got {type(var).__name__}")
    reason = unreadable_reason(var)
    return reason if reason is not None else tensor_stats([var]).host_rows()[0]


def get_abs_min_max(var: torch.Tensor, ctx: str) -> str:
    """``"{abs min:8.2e} {abs max:8.2e} {ctx}"`` for a tensor, as the reference formats it."""
    row = _row_of(var, "get_abs_min_max")
    if isinstance(row, str):
        try:  # the reference's own ops, where torch can run them on this tensor
            abs_var = var.abs()
            return f"{abs_var.min():8.2e} {abs_var.max():8.2e} {ctx}"
        except Exception:
            return text.entry_line(UNREADABLE, ctx, row)
    return text.tensor_line(row, var.dtype, ctx)


def detect_overflow(var: torch.Tensor, ctx: str) -> bool:
    """Print ``"{ctx} has nans"`` / ``"{ctx} has infs"`` and return True if ``var`` holds any."""
    row = _row_of(var, "detect_overflow")
    if isinstance(row, str):
        # the engine cannot read it: ask torch as the reference does, rather than answer False
        try:
            has_nans, has_infs = bool(torch.isnan(var).any()), bool(torch.isinf(var).any())
        except Exception:
            return False
        lines = ([f"{ctx} has nans"] if has_nans else []) + ([f"{ctx} has infs"] if has_infs else [])
    else:
        lines = text.overflow_lines(row, ctx)
    for line in lines:
        say(line)
    return bool(lines)
