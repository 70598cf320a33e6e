"""``on_detect="skip"``: a step in which a nan/inf appears applies no update, and training goes on.

A skipped step keeps its gradients until an optimizer holding one of the model's parameters steps,
so that whatever inspects them first still can (``GradScaler.unscale_`` and its inf checks: the
scaler then skips or steps, and moves its scale, as it would without the detector). Right before
that optimizer's update runs, every gradient of every parameter it holds (all its groups, other
models' parameters too) is set to None: torch's optimizers skip a parameter without a gradient,
so neither the weights nor the optimizer's state (step counts, moments) change.

A step ends when such an optimizer has stepped, when the trainer names a new step (``set_step``),
or when the gradients are reset before a backward pass without an optimizer step in between (a
``GradScaler`` that found an inf skips the optimizer's ``step``; ``zero_grad`` follows).

The optimizer hooks are process-wide (``torch.optim`` has no other way to see every optimizer):
one pair for the process, which calls the live ``SkipStep`` objects (held weakly: a copied or
pickled detector makes its own, and nothing keeps it alive). It is installed with the first and
taken off when the last is removed; a detector collected without ``remove()`` leaves the pair idle
until then (never taken off by the collector: that could change torch's hook dict while an
optimizer step is walking it).
"""

import threading
import weakref

from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .frames import graph_task_id

_live = weakref.WeakSet()
_hooks = []
_hooks_lock = threading.Lock()


def _before_step(optimizer, args, kwargs):
    for skip in list(_live):
        skip.before_step(optimizer)


def _after_step(optimizer, args, kwargs):
    for skip in list(_live):
        skip.after_step(optimizer)


def _join(skip):
    with _hooks_lock:
        _live.add(skip)
        if not _hooks:
            _hooks.extend([register_optimizer_step_pre_hook(_before_step),
                           register_optimizer_step_post_hook(_after_step)])


def _leave(skip):
    with _hooks_lock:
        _live.discard(skip)
        if not _live:
            for handle in _hooks:
                handle.remove()
            _hooks.clear()


class SkipStep:
    """The skip state of one detector on ``model``: ``begin()`` when a step detects; ``due_to_raise``
    after ``max_skips`` skipped steps in a row."""

    def __init__(self, model, max_skips):
        self.model = model
        self.max_skips = max_skips
        self.skipping = False
        self.in_a_row = 0
        self._stepping = 0  # optimizers holding the model's parameters that are stepping now
        # id(parameter) -> (a weak reference to its grad, that grad's version) after the skipped step's backward
        self._seen = {}
        self._checked_task = None  # the backward pass that already looked for a reset
        self._handles = []  # the parameters' hooks, while a step is skipped
        _join(self)

    def close(self):
        self._unhook()
        _leave(self)
        self.model = None  # the optimizers' hooks call it no more
        self._seen = {}

    def _unhook(self):
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @property
    def due_to_raise(self):
        return self.in_a_row >= self.max_skips

    def begin(self):
        """This step detected: it applies no update."""
        if not self.skipping:
            self.skipping = True
            self._seen = {}
            self._checked_task = graph_task_id()
            for parameter in self.model.parameters() if not self._handles else ():
                if parameter.requires_grad:
                    self._handles.append(parameter.register_hook(self._before_accumulate(parameter)))
                    self._handles.append(parameter.register_post_accumulate_grad_hook(self._after_accumulate))
            if self._checked_task != -1:  # decided in backward: these gradients are this step's
                self._remember_gradients()

    def end(self, unhook=True):
        """The step ended (an optimizer stepped, or the trainer named the next step). ``unhook``:
        take the parameters' hooks off now (not from inside one of them, while autograd runs them)."""
        self.in_a_row = self.in_a_row + 1 if self.skipping else 0
        self.skipping = False
        self._seen = {}
        if unhook:
            self._unhook()

    def holds(self, optimizer):
        if self.model is None:  # closed
            return False
        ours = {id(p) for p in self.model.parameters()}
        return any(id(p) in ours for group in optimizer.param_groups for p in group["params"])

    def before_step(self, optimizer):
        if not self.holds(optimizer):
            return
        self._stepping += 1
        if self.skipping:
            _drop_gradients(optimizer)

    def after_step(self, optimizer):
        if self.holds(optimizer):
            self._stepping = max(0, self._stepping - 1)
            self.end()

    def _remember_gradients(self):
        for parameter in self.model.parameters():
            if parameter.grad is not None:
                self._seen[id(parameter)] = (weakref.ref(parameter.grad), parameter.grad._version)

    def _after_accumulate(self, parameter):
        if not self.skipping or parameter.grad is None:
            return
        if self._stepping:  # a backward run by the optimizer's closure: its gradients go at once
            parameter.grad = None
            return
        self._seen[id(parameter)] = (weakref.ref(parameter.grad), parameter.grad._version)

    def _before_accumulate(self, parameter):
        reference = weakref.ref(parameter)

        def hook(grad):
            if self.skipping and self._seen:
                self._look_for_reset(reference())
            # returns None: the gradient flows on unchanged
        return hook

    def _look_for_reset(self, parameter):
        """Before the first gradient of a new backward pass is accumulated: were the gradients of
        the skipped step reset (``zero_grad``) since its last backward, without an optimizer step?"""
        task = graph_task_id()
        if parameter is None or task == self._checked_task or id(parameter) not in self._seen:
            return
        self._checked_task = task
        grad, version = self._seen[id(parameter)]
        now = parameter.grad
        if now is None or now is not grad():
            self.end(unhook=False)
        elif now._version != version and not bool(now.count_nonzero()):  # zero_grad(set_to_none=False)
            self.end(unhook=False)


def _drop_gradients(optimizer):
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            parameter.grad = None
