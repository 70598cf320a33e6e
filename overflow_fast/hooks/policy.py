"""What a detection does, beyond the reference's "print and raise": which entries count
(``ignore``), what happens on a nan/inf (``on_detect``), the early warnings (``warn_above``:
an entry nearing its dtype's largest value, or underflowing to zeros and subnormals), and the
line naming where the non-finite values were born. Pure host logic over frames' rows."""

import collections
import re

import torch

from . import text
from .frames import BACKWARD
from .options import validated
from .text import TENSOR
from ..stats.layout import ABS_MAX, NUMEL, SUBNORMAL, ZERO, decode_row, holds_nonfinite

# Subnormals above this fraction of an entry's elements get an underflow line (with warn_above).
SUBNORMAL_FRACTION = 0.5
UNDERFLOW_EVERY = 100  # steps between two underflow lines of one module
REMEMBERED_PASSES = 256  # passes that detected, kept to tell their later frames from a new detection


def _glob(pattern):
    """fnmatch's * and ? only: entries hold brackets (input[0]) that fnmatch reads as classes."""
    return re.compile("".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern) + r"\Z")


class Policy:
    """``on_detect``: "raise" (the reference: report, then raise), "warn" (report each offending
    entry once, warn, go on), "record" (record only, go on), "skip" (report, then the step applies no
    update; see the detector) or a callable (report, then call it with the detection). Except with
    "raise", a pass reports one detection (later frames only pass the values on); with "skip", a
    step does.

    ``ignore``: patterns ``"MODULE"`` (every entry of the matching modules) or
    ``"MODULE:ENTRY"``, with * and ? as wildcards, matched against the module's qualified name
    ("" for the model itself) and the entry's name (``input[attention_mask]``, ``weight.grad``).
    Ignored entries keep their lines in frames but never count as a detection."""

    def __init__(self, on_detect="raise", ignore=(), warn_above=None, warn_gradients=False):
        on_detect = validated("on_detect", on_detect)
        ignore = list(validated("ignore", ignore))
        warn_above = validated("warn_above", warn_above)
        warn_gradients = validated("warn_gradients", warn_gradients)
        self.on_detect = on_detect
        self.warn_above = warn_above
        self.warn_gradients = bool(warn_gradients)
        self._underflow_at = {}  # module -> the step of its last underflow line
        self.ignore = ignore
        self._ignore = [(_glob(m), _glob(e) if e is not None else None)
                        for m, _, e in (p.partition(":") if ":" in p else (p, None, None) for p in ignore)]
        self._ignored_cache = {}
        self._warned = set()  # (module, entry) already warned of nearing the dtype's largest value
        self._reported = set()  # (module, entry) already reported with on_detect="warn"
        self._first_bad = None  # (frame, entries) of the first frame that counts, until ``conclude``
        self._report_due = False  # on_detect="warn": a (module, entry) not reported before
        # not "raise": the passes (or "skip": the steps) that detected already, the latest last
        # (several threads' passes can be open at once)
        self._reported_passes = collections.OrderedDict()

    def _pass_of(self, frame, batch, step, pass_key):
        if self.on_detect == "skip":
            return ("step", step)
        return (frame.phase, batch) if pass_key is None else pass_key

    def check(self, frame, batch, step=None, pass_key=None, scaling=None):
        """``(lines, detected)``: the lines to print at once for ``frame`` (the reference's "has
        nans"/"has infs", the shards that hold them, early warnings) and whether one of its
        entries counts as a detection. ``step``: the training step it belongs to ("skip");
        ``pass_key``: the pass it belongs to (by default its phase and batch); ``scaling``: in a
        backward that a GradScaler scaled, its ``scaling.Scaling`` (a gradient's nan/inf that the
        scaler recovers from is its backoff, not a detection)."""
        lines = []
        detected = False
        for kind, ctx, payload in frame.entries:
            if kind != TENSOR or not holds_nonfinite(frame.rows[payload]):
                continue
            if self.ignore and self.ignored(frame.module_name, ctx):
                continue
            if self.on_detect != "raise" and self._pass_of(frame, batch, step, pass_key) in self._reported_passes:
                self.new_reports(frame, [ctx])  # a consequence of what this pass reported
                continue
            if scaling is not None and frame.phase == BACKWARD and scaling.absorbs(frame, ctx):
                continue
            if self._first_bad is None:
                self._first_bad = (frame, [])  # where the source line looks
            if self._first_bad[0] is frame:
                self._first_bad[1].append(ctx)
            # on_detect="warn": each (module, entry) once; "record": no line
            if self.on_detect == "warn":
                report_it = bool(self.new_reports(frame, [ctx]))
            else:
                report_it = self.on_detect != "record"
            if report_it:
                lines.extend(text.overflow_lines(frame.rows[payload], ctx))
                if frame.bad_shards and payload in frame.bad_shards:  # a DTensor: whose shard holds them
                    lines.append(text.bad_shards_line(ctx, frame.bad_shards[payload]))
                self._report_due = True
            detected = True
        if self.warn_above is not None:
            lines.extend(self.early_warnings(frame, batch, step))
        return lines, detected

    def conclude(self, frame, batch, step=None, pass_key=None):
        """A detection ends at ``frame`` (of ``batch``): ``(detection, first_frame, bad, report_due)``,
        the detection as data, the first frame that counted and its entries, and whether a report
        is due (with "warn" only when an entry was new, never with "record"). Later frames of the
        same pass (with "skip": step) only pass the values on."""
        first_frame, bad = self._first_bad or (frame, [])
        self._first_bad = None
        report_due, self._report_due = self._report_due, False
        if self.on_detect != "raise":
            self._reported_passes[self._pass_of(frame, batch, step, pass_key)] = None
            while len(self._reported_passes) > REMEMBERED_PASSES:
                self._reported_passes.popitem(last=False)
        detection = {"batch_number": batch, "phase": first_frame.phase, "module": first_frame.module_name,
                     "class": first_frame.class_name, "entries": bad}
        return detection, first_frame, bad, report_due

    def ignored(self, module_name, ctx):
        key = (module_name, ctx)
        hit = self._ignored_cache.get(key)
        if hit is None:
            hit = self._ignored_cache[key] = any(
                m.match(module_name) and (e is None or e.match(ctx)) for m, e in self._ignore)
        return hit

    def new_reports(self, frame, bad):
        """With on_detect="warn", the entries not reported before (each (module, entry) once)."""
        fresh = [ctx for ctx in bad if (frame.module_name, ctx) not in self._reported]
        self._reported.update((frame.module_name, ctx) for ctx in fresh)
        return fresh

    def early_warnings(self, frame, batch_number, step=None):
        """Lines for entries crossing ``warn_above`` of their dtype's largest finite value (each
        (module, entry) once), and one line for a module whose entries underflow (an activation
        or gradient all zeros, any entry mostly subnormal), at most once per UNDERFLOW_EVERY
        steps (``step``, else the batch number); gradients only with ``warn_gradients``."""
        if self.warn_above is None:
            return []
        lines = []
        underflows = []
        where = f"{frame.module_name or '(model)'} {frame.class_name}"
        for ctx, row, dtype in frame.tensor_entries():
            if not dtype.is_floating_point or row[NUMEL] == 0 or holds_nonfinite(row):
                continue
            key = (frame.module_name, ctx)
            limit = torch.finfo(dtype).max
            abs_max = decode_row(row, dtype)["abs_max"]
            if abs_max >= self.warn_above * limit and key not in self._warned:
                self._warned.add(key)
                lines.append(f"{where} {ctx}: abs max {abs_max:.2e} is {abs_max / limit:.0%} of the largest "
                             f"{str(dtype).replace('torch.', '')} ({limit:.2e}) at batch_number={batch_number}")
            gradient = ctx.endswith(".grad")
            if gradient and not self.warn_gradients:
                continue
            # parameters are often all zeros by design (biases at initialisation): only activations
            # and gradients count as having underflowed to zeros
            if row[ZERO] == row[NUMEL] and row[ABS_MAX] == 0 and (gradient or ctx.startswith(("input", "output"))):
                underflows.append(f"{ctx}: all {row[NUMEL]} elements are zero")
            elif row[SUBNORMAL] > SUBNORMAL_FRACTION * row[NUMEL]:
                underflows.append(f"{ctx}: {row[SUBNORMAL] / row[NUMEL]:.0%} of {row[NUMEL]} elements are subnormal")
        if underflows:
            step = batch_number if step is None else step
            last = self._underflow_at.get(frame.module_name)
            if last is None or not 0 <= step - last < UNDERFLOW_EVERY:
                self._underflow_at[frame.module_name] = step
                lines.append(f"{where} underflows at batch_number={batch_number}: {'; '.join(underflows)}")
        return lines


def origin(frame, bad):
    """Where the first non-finite values were born, judged from the first frame (in execution
    order) that holds one, ``bad`` its entries (every frame before it was finite): one of
    "loss" (the model's output gradient came in non-finite), "gradient" (made by the backward of
    the modules that consume an output: ``frame.consumers``), "backward" (the module's own backward,
    from a finite incoming gradient), "weight" (already non-finite before this forward), "outside"
    (in the input batch), "before" (in code between modules) or "forward" (the module's forward,
    from finite inputs and weights)."""
    if frame.phase == BACKWARD:
        if any(ctx.startswith("output") for ctx in bad):
            return "loss" if frame.module_name == "" else "gradient"
        return "backward"
    if any(not ctx.startswith(("input", "output")) for ctx in bad):
        return "weight"
    if any(ctx.startswith("input") for ctx in bad):
        return "outside" if frame.module_name == "" else "before"
    return "forward"


def source_entry(frame, bad):
    """The entry the Source line names: the first weight when a weight was already non-finite,
    the first input when it came in from outside or was made before the module, else the first
    entry that counted."""
    kind = origin(frame, bad)
    if kind == "weight":
        return next(ctx for ctx in bad if not ctx.startswith(("input", "output")))
    if kind in ("outside", "before"):
        return next(ctx for ctx in bad if ctx.startswith("input"))
    return bad[0]


def source_line(frame, bad):
    """The report's line saying where the first non-finite values were born (``origin``), naming
    ``source_entry``."""
    where = f"{frame.module_name or '(model)'} ({frame.class_name})"
    kind = origin(frame, bad)
    if kind == "loss":
        return "Source: the gradient of the model's output came in non-finite (the loss or its scaling)"
    if kind == "gradient":
        consumers = ", ".join(name or "(model)" for name in frame.consumers or [])
        if not consumers:
            return (f"Source: born in backward, in the gradient arriving at {where} {bad[0]}: made by the backward "
                    "of code outside any hooked module that used it (the enclosing module's own code, or a "
                    "torch.compile region)")
        return (f"Source: born in backward, in the gradient arriving at {where} {bad[0]}: "
                f"made by the backward of {consumers}")
    if kind == "backward":
        if frame.incoming_read is False:
            return (f"Source: born in backward, first seen in {where} {bad[0]}: the gradient arriving at its "
                    "outputs was not read (e.g. in a torch.compile region), so which backward made it is not known")
        return f"Source: born in backward of {where}: {bad[0]} from a finite incoming gradient"
    if kind == "weight":
        weights = [ctx for ctx in bad if not ctx.startswith(("input", "output"))]
        return f"Source: a weight already non-finite before this forward: {where} {weights[0]}"
    inputs = [ctx for ctx in bad if ctx.startswith("input")]
    if kind == "outside":
        return f"Source: came in from outside, in the input batch: {where} {inputs[0]}"
    if kind == "before":
        return (f"Source: born outside any module, in the code before {where} {inputs[0]}: every module "
                "run before it was finite (an operation in a parent's forward, or an input from outside)")
    return f"Source: born in forward of {where}: {bad[0]} from finite inputs and weights"
