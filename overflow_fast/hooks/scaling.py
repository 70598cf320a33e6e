"""Loss scaling, seen from the detector: which backward a ``GradScaler`` scaled, at what scale, and
how many of the scaler's steps in a row backed off.

Under a ``torch.amp.GradScaler`` an inf/nan gradient is the scaler's normal backoff, not a bug: the
scaler finds it in ``unscale_``, skips the optimizer's step and lowers its scale. In a backward that
a scaler scaled, the detector records such a gradient as a backoff (one line, one record) and
treats it as a detection only where the scaler cannot recover (``Backoffs.judge``): the loss given
to ``scale()`` was non-finite already (born in the forward: no scale explains it), the scale is at
or below ``min_loss_scale`` (the gradient overflows unscaled), or the scaler backed off more than
``max_backoffs`` of its steps in a row.

How a backward is known to be scaled, with no argument and no host sync: ``scale``, ``unscale_``
and ``update`` of ``torch.amp.GradScaler`` and of every subclass that defines its own (``torch.cuda.amp``'s,
FSDP's ``ShardedGradScaler``, those of Accelerate, the HF Trainer and Lightning, which are these
classes) are wrapped once per process, when the first detector with gradient checks is made (and
a subclass defined later, when it is defined). The wrapped ``scale`` hooks the gradient of each
tensor it returns: that hook runs first in the backward of ``scaler.scale(loss)``, and the graph
task running it names that backward. ``update`` counts the scaler's steps. ``unscale_`` tells
check="step"'s guard what the scaler found (its ``found_inf``, which its ``step`` reads next: the
guard reads no scaled gradient of its own). They pass everything through unchanged and do nothing
more while no detector listens. The scale is read (``get_scale()``) only in a backward that found
a nan/inf, after the pass's one host read.
"""

import collections
import functools
import threading
import weakref

import torch
from torch.compiler import is_compiling

from .frames import graph_task_id
from .text import TENSOR
from ..stats.layout import NAN, NEGINF, POSINF

REMEMBERED_BACKWARDS = 16  # scaled backwards remembered by graph task (a detector asks about its own, at its end)
# A nan (not an inf: an inf is what a scale too high makes, and it moves or goes as the scale falls)
# first seen at the same entry at this many backoffs in a row is that entry's own fault: the scale
# is not why, and no backoff recovers it.
NAN_REPEATS = 3

_lock = threading.Lock()
_listeners = weakref.WeakSet()  # the live detectors' Backoffs
_scaled = collections.OrderedDict()  # graph task id -> ScaledBackward, the latest last
_steps = weakref.WeakKeyDictionary()  # scaler -> its update() calls so far
_inside = threading.local()  # a wrapped method running on this thread (a subclass's calling its parent's)
_installed = []


class ScaledBackward:
    """One backward of a scaled loss: the scaler (weakly) and, per tensor it scaled, whether that
    tensor was finite before scaling (a 0-dim bool on its device, read only when asked)."""

    __slots__ = ("scaler", "finite", "_facts")

    def __init__(self, scaler):
        self.scaler = scaler
        self.finite = []
        self._facts = None

    def facts(self):
        """``(loss_finite, scale, steps, scaler)``: whether every scaled tensor was finite, the scale,
        the scaler's ``update()`` calls so far, the scaler; read once (a host sync, at a backward's
        nan/inf only). None when the scaler is gone."""
        if self._facts is None:
            scaler = self.scaler()
            if scaler is None:
                return None
            self._facts = (all(bool(flag) for flag in self.finite), float(scaler.get_scale()), _steps.get(scaler, 0),
                           scaler)
        return self._facts


def scaled_backward(task):
    """The ScaledBackward of graph task ``task``, or None when no scaler scaled its loss."""
    return _scaled.get(task) if task != -1 else None


# -- watching the scalers -------------------------------------------------------------------------

def listen(backoffs):
    """``backoffs`` (a live detector's) wants to know which backwards are scaled."""
    with _lock:
        if not _installed:
            _install()
        _listeners.add(backoffs)


def leave(backoffs):
    with _lock:
        _listeners.discard(backoffs)


def _install():
    base = torch.amp.GradScaler
    family, todo = [], [base]
    while todo:
        cls = todo.pop()
        family.append(cls)
        todo.extend(cls.__subclasses__())
    for cls in family:
        _wrap(cls)

    def subclassed(cls, **kwargs):
        super(base, cls).__init_subclass__(**kwargs)
        _wrap(cls)

    base.__init_subclass__ = classmethod(subclassed)
    _installed.append(base)


def _wrap(cls):
    for name, wrapper in (("scale", _wrapped_scale), ("update", _wrapped_update), ("unscale_", _wrapped_unscale)):
        method = cls.__dict__.get(name)
        if method is not None and not hasattr(method, "__overflow_fast_wraps__"):
            wrapped = functools.wraps(method)(wrapper(method))
            wrapped.__overflow_fast_wraps__ = method
            setattr(cls, name, wrapped)


def _wrapped_scale(scale):
    def wrapper(self, outputs, *args, **kwargs):
        if getattr(_inside, "depth", 0) or not _listeners or is_compiling():
            return scale(self, outputs, *args, **kwargs)
        _inside.depth = 1
        try:
            scaled = scale(self, outputs, *args, **kwargs)
        finally:
            _inside.depth = 0
        if scaled is not outputs:  # a disabled scaler returns what it was given
            _note(weakref.ref(self), outputs, scaled)
        return scaled
    return wrapper


def _wrapped_update(update):
    def wrapper(self, *args, **kwargs):
        if getattr(_inside, "depth", 0) or not _listeners:
            return update(self, *args, **kwargs)
        _inside.depth = 1
        try:
            return update(self, *args, **kwargs)
        finally:
            _inside.depth = 0
            _steps[self] = _steps.get(self, 0) + 1
            for backoffs in list(_listeners):
                if backoffs.owner is not None:
                    backoffs.owner.updated(self)
    return wrapper


def _wrapped_unscale(unscale):
    def wrapper(self, optimizer, *args, **kwargs):
        if getattr(_inside, "depth", 0) or not _listeners:
            return unscale(self, optimizer, *args, **kwargs)
        _inside.depth = 1
        try:
            result = unscale(self, optimizer, *args, **kwargs)
        finally:
            _inside.depth = 0
        watching = [backoffs.owner for backoffs in list(_listeners) if backoffs.owner is not None]
        if watching:
            found_inf = _found_inf(self, optimizer)
            for owner in watching:
                owner.unscaled(self, found_inf)
        return result
    return wrapper


def _found_inf(scaler, optimizer):
    """Whether the scaler's ``unscale_`` of ``optimizer``'s gradients found an inf/nan (its own
    finding, which its ``step`` reads next; None where it cannot be read)."""
    try:
        found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        return any(bool(flag.item()) for flag in found.values())
    except (AttributeError, KeyError, TypeError, RuntimeError):
        return None


def _note(scaler, outputs, scaled):
    """Hook the gradient of each scaled tensor that autograd will reach (pairs of a tensor or of
    lists and tuples of them; what ``scale`` returns lazily, a ``map``, is left alone)."""
    if isinstance(scaled, torch.Tensor) and isinstance(outputs, torch.Tensor):
        if scaled.requires_grad:
            local = outputs.to_local() if hasattr(outputs, "to_local") else outputs  # a DTensor: never a collective
            finite = torch.isfinite(local.detach()).all()  # on its device: no sync
            scaled.register_hook(functools.partial(_backward_started, scaler, finite))
    elif isinstance(scaled, (list, tuple)) and isinstance(outputs, (list, tuple)) and len(scaled) == len(outputs):
        for output, one in zip(outputs, scaled):
            _note(scaler, output, one)


def _backward_started(scaler, finite, grad):
    """The gradient of a scaled tensor: the backward running now is scaled by ``scaler``."""
    task = graph_task_id()
    with _lock:
        entry = _scaled.get(task)
        if entry is None or entry.scaler is not scaler:
            entry = _scaled[task] = ScaledBackward(scaler)
            while len(_scaled) > REMEMBERED_BACKWARDS:
                _scaled.popitem(last=False)
        entry.finite.append(finite)
    # returns None: the gradient flows on unchanged


# -- one detector's judgement ---------------------------------------------------------------------

# What a detector concluded about a scaled backward with a nan/inf gradient: the scale it ran at,
# the scaler's steps in a row that backed off (this one included), and ``why`` the scaler cannot
# recover (None: it can; a backoff).
Verdict = collections.namedtuple("Verdict", ("scale", "in_a_row", "why"))


class Backoffs:
    """One detector's view of the scalers: ``judge`` a scaled backward that holds a nan/inf
    gradient. ``min_loss_scale`` and ``max_backoffs`` as ``options.Options`` validated them."""

    def __init__(self, min_loss_scale, max_backoffs, owner=None):
        self.min_loss_scale = min_loss_scale
        self.max_backoffs = max_backoffs
        self._last = weakref.WeakKeyDictionary()  # scaler -> (its step of the last backoff seen, in a row)
        self._nans = weakref.WeakKeyDictionary()  # scaler -> (the entry where a backoff's first nan was, times in a row)
        # check="step"'s guard: told of each scaler's unscale_ (``unscaled(scaler, found_inf)``) and
        # update (``updated(scaler)``), where it takes the scaler's own verdict on its gradients
        self.owner = owner
        listen(self)

    def close(self):
        self.owner = None
        leave(self)

    def scaling(self, task):
        """The Scaling of the backward running as graph task ``task`` (None when it is not scaled)."""
        scaled = scaled_backward(task)
        return Scaling(self, task, scaled) if scaled is not None else None

    def judge(self, scaled, first=None):
        """The Verdict on ``scaled`` (a ScaledBackward that found a nan/inf gradient), and whether
        this backoff is the first this detector sees in its scaler's step; None when the scaler is
        gone. ``first``: ``(module, entry, kind)`` of its first non-finite gradient entry, ``kind``
        "nan", "inf" or "nan and inf" (a nan there at NAN_REPEATS backoffs in a row is a fault)."""
        facts = scaled.facts()
        if facts is None:
            return None, False
        finite, scale, step, scaler = facts
        last_step, in_a_row = self._last.get(scaler, (None, 0))
        first_of_step = last_step != step
        nans = self._nans.get(scaler, (None, 0))
        if first_of_step:
            consecutive = last_step == step - 1
            in_a_row = in_a_row + 1 if consecutive else 1
            self._last[scaler] = (step, in_a_row)
            where = first[:2] if first is not None and first[2] == "nan" else None
            nans = (where, nans[1] + 1 if consecutive and where is not None and nans[0] == where else 1)
            self._nans[scaler] = nans
        if not finite:
            why = "the loss given to scaler.scale() is non-finite: born in the forward, which no scale explains"
        elif scale <= self.min_loss_scale:
            why = (f"the scale is {scale:.1e}, at or below min_loss_scale={self.min_loss_scale:g}: the gradient "
                   "overflows unscaled, which no backoff recovers")
        elif in_a_row > self.max_backoffs:
            why = f"the scaler backed off {in_a_row} steps in a row, more than max_backoffs={self.max_backoffs}"
        elif nans[0] is not None and nans[1] >= NAN_REPEATS:
            module, entry = nans[0]
            why = (f"a nan first in {module or '(model)'} {entry} at {nans[1]} backoffs in a row, the scale down to "
                   f"{scale:.1e}: the same entry at every scale is its own fault, which no backoff recovers")
        else:
            why = None
        return Verdict(scale, in_a_row, why), first_of_step


class Scaling:
    """A scaled backward as one detector decides it: whether its nan/inf gradients are the scaler's
    (``absorbs``, judged once, at the first), and the backoff to report (``take_backoff``, once)."""

    __slots__ = ("backoffs", "task", "scaled", "verdict", "first", "due")

    def __init__(self, backoffs, task, scaled):
        self.backoffs = backoffs
        self.task = task
        self.scaled = scaled
        self.verdict = None
        self.first = None  # (frame, entries) of the first gradient frame holding the scaler's nan/inf
        self.due = False  # a backoff line and record are due

    def absorbs(self, frame, ctx):
        """Whether the nan/inf of entry ``ctx`` of gradient frame ``frame`` is the scaler's backoff."""
        if self.verdict is None:
            self.verdict, first_of_step = self.backoffs.judge(self.scaled, (frame.module_name, ctx,
                                                                            entry_kind(frame, [ctx])))
            self.due = first_of_step and self.verdict is not None and self.verdict.why is None
        if self.verdict is None or self.verdict.why is not None:
            return False
        if self.first is None:
            self.first = (frame, [])
        if self.first[0] is frame:
            self.first[1].append(ctx)
        return True

    def take_backoff(self):
        """``(frame, entries, verdict)`` of a backoff to report, once; else None."""
        if not self.due or self.first is None:
            return None
        self.due = False
        return self.first[0], self.first[1], self.verdict

    def unrecoverable(self):
        """The verdict as a detection carries it (``detection["scaler"]``), when the scaler cannot recover."""
        if self.verdict is None or self.verdict.why is None:
            return None
        return {"scale": self.verdict.scale, "in_a_row": self.verdict.in_a_row, "why": self.verdict.why}


def entry_kind(frame, entries):
    """"nan", "inf" or "nan and inf": what the frame's ``entries`` hold (host rows)."""
    rows = [frame.rows[payload] for kind, ctx, payload in frame.entries if kind == TENSOR and ctx in entries]
    nan = any(row[NAN] for row in rows)
    inf = any(row[POSINF] or row[NEGINF] for row in rows)
    return "nan and inf" if nan and inf else "nan" if nan else "inf"


def backoff_line(module_name, class_name, entries, verdict, batch, global_step=None, kind="inf/nan"):
    """The one line a backoff prints (``kind``: what its first entries hold, ``entry_kind``)."""
    step = f" (optimizer step {global_step})" if global_step is not None else ""
    return (f"GradScaler backoff in the backward of batch_number={batch}{step}: {kind} gradient at scale "
            f"{verdict.scale:.1e}, first in {module_name or '(model)'} ({class_name}) {', '.join(entries)}; the "
            f"scaler skips this step and lowers its scale ({verdict.in_a_row} in a row)")


def scaler_line(scaler):
    """The report's line saying why the scaler cannot recover (``Scaling.unrecoverable``)."""
    return f"GradScaler: {scaler['why']}"
