"""The flight recorder's dashboards: TensorBoard and Weights & Biases, where people already watch
their runs. At each logged step, per module: ``overflow_fast/headroom_bits/<module>``, the lowest
headroom of its floating-point entries (log2 of the dtype's largest finite value over the entry's
abs-max: bits left before overflow; 0 for a nan/inf), and ``overflow_fast/subnormal_frac/<module>``,
the largest fraction of subnormal values among them (under ``overflow_fast/eval/`` for what runs in
evaluation); detections as text. Values are taken from
the rows the detector already read (no extra read); nothing is written for a step that
``log_every`` skips.
"""

import math

import torch

from .schema import TENSOR
from ..stats.layout import NUMEL, SUBNORMAL, decode_row, holds_nonfinite

HEADROOM = "overflow_fast/headroom_bits/"
SUBNORMAL_FRACTION = "overflow_fast/subnormal_frac/"
# what runs in evaluation goes under overflow_fast/eval/...
DETECTION = "overflow_fast/detection"

_LARGEST = {}


def _largest(dtype):
    value = _LARGEST.get(dtype)
    if value is None:
        value = _LARGEST[dtype] = torch.finfo(dtype).max
    return value


def headroom_bits(row, dtype, computed_in=None):
    """Bits left before ``dtype`` overflows (under autocast, the narrower dtype the call computed in:
    ``schema.judged_in``), from an entry's row: None for an empty or all-zero entry (no magnitude
    to speak of), 0 for one holding a nan/inf."""
    if holds_nonfinite(row):
        return 0.0
    abs_max = decode_row(row, dtype)["abs_max"]
    if not abs_max:
        return None
    largest = _largest(dtype)
    if computed_in is not None and computed_in.is_floating_point:
        largest = min(largest, _largest(computed_in))
    return max(0.0, math.log2(largest / abs_max))


def _tag(prefix, name):
    """``overflow_fast/headroom_bits/<module>``, or ``overflow_fast/eval/headroom_bits/<module>``."""
    if name.startswith("eval/"):
        return prefix.replace("overflow_fast/", "overflow_fast/eval/", 1) + name[len("eval/"):]
    return prefix + name


def is_dashboard(target):
    """A TensorBoard ``SummaryWriter`` or a W&B run (duck-typed: neither is a dependency)."""
    return hasattr(target, "add_scalar") or (hasattr(target, "log") and hasattr(target, "summary"))


class Dashboard:
    """Writes a step's per-module scalars to ``target`` (a ``SummaryWriter`` or a W&B run) when
    the step ends (``frame`` of a later step, ``flush`` or ``close``)."""

    def __init__(self, target):
        if not is_dashboard(target):
            raise TypeError(f"a dashboard is a torch.utils.tensorboard.SummaryWriter or a wandb run, got "
                            f"{type(target).__name__}")
        self.target = target
        self._tensorboard = hasattr(target, "add_scalar")
        self._step = None
        self._headroom = {}  # tag suffix (mode and module) -> lowest headroom in this step
        self._subnormal = {}  # tag suffix -> largest subnormal fraction in this step

    def frame(self, frame, step, mode=None):
        """Take a frame (``schema.RecordedFrame``) of ``step`` and ``mode`` into that step's scalars."""
        if step != self._step:
            self._write()
            self._step = step
        name = ("eval/" if mode == "eval" else "") + (frame.module_name or "(model)")
        for kind, _, payload in frame.entries:
            if kind != TENSOR:
                continue
            dtype = frame.dtypes[payload]
            row = frame.rows[payload]
            if not dtype.is_floating_point or not row[NUMEL]:
                continue
            bits = headroom_bits(row, dtype, getattr(frame, "computed_in", None))
            if bits is not None and bits < self._headroom.get(name, math.inf):
                self._headroom[name] = bits
            fraction = row[SUBNORMAL] / row[NUMEL]
            if fraction >= self._subnormal.get(name, 0.0):
                self._subnormal[name] = fraction

    def detection(self, detection, step):
        self._write()
        where = f"{detection['module'] or '(model)'} ({detection['class']})"
        text = (f"inf/nan in {where} {', '.join(detection['entries'])}, {detection['phase']}, "
                f"batch_number={detection['batch_number']}")
        if self._tensorboard:
            self.target.add_text(DETECTION, text, global_step=step)
        else:
            self.target.log({DETECTION: text}, step=step)

    def _write(self):
        if self._step is None or not (self._headroom or self._subnormal):
            return
        scalars = {_tag(HEADROOM, name): value for name, value in self._headroom.items()}
        scalars.update((_tag(SUBNORMAL_FRACTION, name), value) for name, value in self._subnormal.items())
        if self._tensorboard:
            for tag, value in scalars.items():
                self.target.add_scalar(tag, value, global_step=self._step)
        else:
            self.target.log(scalars, step=self._step)
        self._headroom = {}
        self._subnormal = {}

    def flush(self):
        self._write()
        flush = getattr(self.target, "flush", None)
        if self._tensorboard and flush is not None:
            flush()

    def close(self):
        """Write what is pending; the writer or run stays open (it is the caller's)."""
        self.flush()
