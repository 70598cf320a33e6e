"""check="step"'s replay of a whole step: the forwards of the model's root that the step ran, and
their backward, run again with the full detector watching every module.

The guard keeps what a replay needs as the step runs (``KeptForward``): references to each root
call's inputs and their versions (a replay runs only on inputs that did not change in place since),
the RNG states at the call's start, its grad mode and autocast, and the gradients that arrived at
its outputs in backward. ``replay_step`` runs them in the sandbox (``sandbox``: no hook but the
watcher's and tensor parallelism's, stand-in buffers and parameters, the RNG and private generators
put back, no collective), so the run goes on as if it had not happened, and tells what it found:
reproduced (the watcher reported it), not reproduced on the step's very inputs and draws with the
step's values everywhere else (a transient fault is likely), or why it cannot tell.
"""

import contextlib
import dataclasses

import torch

from ..distributed import NoCommunication
from .culprit import is_wrapper, versions_of
from .._compat import is_dataclass_instance
from .op_replay import agrees
from .sandbox import (PrivateGenerators, autocast_as, copied, module_kept, replay_hooks, rng_kept, rng_state,
                      set_rng_state, sharded_for_the_call)

REPRODUCED = "reproduced"
NOT_REPRODUCED = "not reproduced"
NOT_REPLAYED = "not replayed"
TRANSIENT = "a transient fault (hardware, a race, memory corruption) is likely"


class KeptForward:
    """One forward of the model's root, as its replay needs it: its inputs (references) and their
    versions then, the RNG states at its start (``sandbox.rng_state``; None where they could not be
    taken: a forward seen only as it ended), grad mode and autocast (``sandbox.call_state``), its
    ``batch`` (the detector's batch number), ``grads``: output index (``root_outputs`` order) -> the
    gradient that arrived there in backward, and ``run``: what a replay calls with the inputs (None:
    the model; an integration's own root call, a LightningModule's ``training_step``)."""

    __slots__ = ("args", "kwargs", "versions", "rng", "call", "batch", "grads", "run")

    def __init__(self, args, kwargs, rng, call, batch, run=None):
        self.args = args
        self.kwargs = kwargs
        self.versions = versions_of(args, kwargs)
        self.rng = rng
        self.call = call
        self.batch = batch
        self.grads = None
        self.run = run  # what a replay calls (None: the model)

    def changed(self):
        """Whether an input changed in place since the forward started."""
        return versions_of(self.args, self.kwargs) != self.versions

    def keep_gradient(self, index, grad):
        if self.grads is None:
            self.grads = {}
        self.grads[index] = grad


class StepReplay:
    """What a step's replay found: ``outcome`` (REPRODUCED, NOT_REPRODUCED, NOT_REPLAYED),
    ``transient`` (True: not reproduced on the step's very inputs and draws, with its values
    everywhere else; False: reproduced; None: it cannot tell), ``why`` (the words after the outcome)."""

    __slots__ = ("outcome", "transient", "why")

    def __init__(self, outcome, transient=None, why=None):
        self.outcome, self.transient, self.why = outcome, transient, why

    def line(self, reproduced_on=None, ranks=False):
        """The report's ``Replay:`` line; ``reproduced_on``: under torch.distributed (``ranks``),
        the ranks whose replay reproduced it."""
        if ranks:
            where = ", ".join(map(str, reproduced_on or []))
            if self.outcome == REPRODUCED:
                return f"Replay: reproduced on rank {where}"
            if reproduced_on:
                return f"Replay: {self.outcome} on this rank; reproduced on rank {where}"
            if self.outcome == NOT_REPRODUCED and self.transient:
                return f"Replay: not reproduced on any rank: {TRANSIENT}"
        return f"Replay: {self.outcome}" + (f": {self.why}" if self.why else "")

    def record(self):
        return {"outcome": self.outcome, "transient": self.transient, "why": self.why}


def replay_step(model, forwards, watcher, backward=False, run_outputs=None, ours=()):
    """Replay one step of ``model``: each of ``forwards`` (``KeptForward``, in the order they ran)
    from its RNG states, and with ``backward`` the backward through the gradients they kept at
    their outputs, with ``watcher(module)`` attached inside the sandbox (the full detector: it
    reports what it finds; it returns an object with ``remove()`` and ``detections``). A
    data-parallel wrapper's module is replayed, not the wrapper (its forward communicates).
    ``run_outputs``: the floating outputs of the last forward as the step computed them (a nan/inf
    born in the forward; else the parameters' gradients are): a replay that finds nothing compares
    its values with them. ``ours``: the ids of the caller's own hooks on the model (the others are
    left out of the replay, so one that ran in the step leaves a transient fault untold). Never
    raises."""
    module = model.module if is_wrapper(model) else model
    why = _cannot_replay(module, forwards, backward)
    if why is not None:
        return StepReplay(NOT_REPLAYED, None, why)
    foreign = hooks_left_out(model, ours)
    run_gradients = None if run_outputs is not None else {
        name: parameter.grad for name, parameter in module.named_parameters() if parameter.grad is not None}
    guard = NoCommunication()
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(guard)
            stack.enter_context(replay_hooks(module))
            stack.enter_context(module_kept(module, fresh_parameters=backward))
            stack.enter_context(rng_kept(None))
            generators = stack.enter_context(PrivateGenerators())
            incoming = _from_outside(module, forwards) if backward else None
            watching = watcher(module)
            stack.callback(watching.remove)
            outputs = [_forward(module, kept, backward) for kept in forwards]
            if backward:
                _backward(incoming, outputs)
            if watching.detections:
                return StepReplay(REPRODUCED, False)
            if run_outputs is not None:
                replayed = root_outputs(outputs[-1])
                if not all(bool(torch.isfinite(tensor).all()) for tensor in replayed):
                    # made outside every module: the driven call's own code (a LightningModule's step)
                    return StepReplay(REPRODUCED, False, "made outside every module, in the step's own code")
                same = agrees(run_outputs, replayed)
            else:
                same = _same_gradients(module, run_gradients)
            exact = all(kept.rng is not None for kept in forwards) and not generators.drawn
    except Exception as error:  # noqa: BLE001 - a replay never breaks the run it explains
        if guard.refused is not None:
            return StepReplay(NOT_REPLAYED, None, f"the step communicates across ranks ({guard.refused})")
        lines = str(error).strip().splitlines()
        return StepReplay(NOT_REPLAYED, None, f"{type(error).__name__}: {lines[0] if lines else ''}")
    if foreign:
        return StepReplay(NOT_REPRODUCED, None, f"hooks of other code ran in the step ({', '.join(foreign)}), and a "
                          "replay leaves them out: a transient fault cannot be told")
    if not exact:
        drawn = (f"its random ops drew from a private torch.Generator ({', '.join(generators.drawn)}), afresh"
                 if generators.drawn else "the RNG states at the step's start are unknown (a compiled model's)")
        return StepReplay(NOT_REPRODUCED, None, f"{drawn}: a transient fault cannot be told")
    if same is False:
        return StepReplay(NOT_REPRODUCED, None, "the replay's finite values differ from the step's too (a "
                          "nondeterministic kernel, or an input changed unseen): a transient fault cannot be told")
    if same is None:
        return StepReplay(NOT_REPRODUCED, None, "and the step's values cannot be compared with the replay's (no "
                          "finite one, or another shape): a transient fault cannot be told")
    return StepReplay(NOT_REPRODUCED, True, f"{TRANSIENT}")


def hooks_left_out(model, ours=()):
    """What hooks of other code a replay leaves out: each module's (but those whose ids are in
    ``ours``), the global ones, and the Python hooks on parameters, named briefly."""
    found = []
    for name, module in model.named_modules():
        count = sum(1 for attribute in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
                    for key in getattr(module, attribute) if key not in ours)
        if count:
            found.append(f"{count} on {name or 'the model'}")
    from torch.nn.modules import module as torch_module

    count = sum(len(getattr(torch_module, attribute, {}) or {}) for attribute in (
        "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks", "_global_backward_pre_hooks"))
    if count:
        found.append(f"{count} global")
    count = sum(len(parameter._backward_hooks or {}) + len(getattr(parameter, "_post_accumulate_grad_hooks", None) or {})
                for parameter in model.parameters())
    if count:
        found.append(f"{count} on parameters")
    return found[:4] + ([f"{len(found) - 4} more"] if len(found) > 4 else [])


def _cannot_replay(module, forwards, backward):
    if not forwards:
        return "the step's forward was not kept"
    if any(kept.changed() for kept in forwards):
        return "the step's inputs changed in place after its forward"
    if backward and not any(kept.grads for kept in forwards):
        return "no gradient arrived at the model's outputs"
    sharded = sharded_for_the_call(module)
    if sharded is not None:
        return (f"the parameters of {sharded or 'the model'} are sharded across ranks, and gathering them would "
                "communicate: a replay on one rank never does")
    return None


def _forward(module, kept, backward):
    """One kept forward, from its RNG states, under its grad mode (with ``backward``: on) and autocast."""
    with contextlib.ExitStack() as stack:
        if kept.rng is not None:
            set_rng_state(kept.rng)
        autocast_as(stack, kept.call.get("autocast") or {})
        stack.enter_context(torch.set_grad_enabled(kept.call["grad_enabled"] or backward))
        args, kwargs = copied((tuple(kept.args), dict(kept.kwargs or {})))
        return (kept.run or module)(*args, **kwargs)


def root_outputs(output, depth=0):
    """The floating (and complex) tensors of a root call's output, depth first: a tensor, the items
    of a tuple or a list, the values of a dict (a transformers ``ModelOutput``) and the fields of a
    dataclass, in order. The gradients a forward keeps are numbered in this order."""
    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() or output.is_complex() else []
    if depth >= _MAX_DEPTH:
        return []
    if isinstance(output, (tuple, list)):
        children = output
    elif isinstance(output, dict):
        children = output.values()
    elif is_dataclass_instance(output):
        children = [getattr(output, field.name) for field in dataclasses.fields(output)]
    else:
        return []
    return [tensor for child in children for tensor in root_outputs(child, depth + 1)]


_MAX_DEPTH = 8


def _gradient_pairs(gradients, outputs):
    """(output tensor, gradient) of each kept gradient (``gradients``: one {output index: gradient}
    per forward) whose output the replay gave and which requires one."""
    pairs = []
    for forward, (kept, output) in enumerate(zip(gradients, outputs)):
        floating = root_outputs(output)
        for index, grad in kept.items():
            if index < len(floating) and floating[index].requires_grad:
                pairs.append(((forward, index), floating[index], grad))
    return pairs


def _from_outside(module, forwards):
    """The gradients the step's backward brought to the forwards' outputs from outside the model,
    one {output index: gradient} per forward. A gradient kept at an output from which the model
    made another output (the logits its loss is made of) holds that path's part too: a first run
    of the forwards, nothing watching, computes that part, and only the rest goes into the replay
    (nothing, most often). Without two outputs that got one, the kept gradients are that already."""
    gradients = [dict(kept.grads or {}) for kept in forwards]
    if sum(map(len, gradients)) < 2:
        return gradients
    outputs = [_forward(module, kept, True) for kept in forwards]
    pairs = _gradient_pairs(gradients, outputs)
    inside = []
    for key, tensor, grad in pairs:
        others = [(other, g) for k, other, g in pairs if k != key]
        if not others:
            inside.append(None)
            continue
        inside.append(torch.autograd.grad([o for o, _ in others], [tensor], [g for _, g in others],
                                          retain_graph=True, allow_unused=True)[0])
    for ((forward, index), _, grad), internal in zip(pairs, inside):
        if internal is None:
            continue
        if torch.equal(torch.nan_to_num(grad), torch.nan_to_num(internal)) and torch.equal(grad.isnan(),
                                                                                        internal.isnan()):
            del gradients[forward][index]  # all of it came through the other outputs
        else:
            gradients[forward][index] = grad - internal
    return gradients


def _backward(gradients, outputs):
    """The backward of the replayed forwards, through the gradients that came from outside
    (outside autocast, as training loops run it)."""
    pairs = _gradient_pairs(gradients, outputs)
    if not pairs:
        raise RuntimeError("the replayed step gave none of the outputs its backward ran from")
    with contextlib.ExitStack() as stack:
        autocast_as(stack, {})
        torch.autograd.backward([tensor for _, tensor, _ in pairs], [grad for _, _, grad in pairs])


def _same_gradients(module, run_gradients):
    """Whether the replay's parameter gradients equal the step's wherever those are finite."""
    if not run_gradients:
        return None
    named = dict(module.named_parameters())
    pairs = [(run, named[name].grad) for name, run in run_gradients.items()
             if name in named and named[name].grad is not None]
    if len(pairs) != len(run_gradients):
        return None  # accumulated over several backwards, or a gradient the replay did not make
    return agrees([run for run, _ in pairs], [again for _, again in pairs])


def rng_now():
    """The RNG states to keep at a forward's start (``sandbox.rng_state``), or None where they
    cannot be read (a CUDA graph being captured)."""
    try:
        return rng_state()
    except RuntimeError:
        return None
