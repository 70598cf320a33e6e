"""Where the first nan/inf sits in the tensor that the report's Source line names, and which rows
(samples of the batch) hold them: the report's ``Where:`` line and the detection's ``"where"``.

Computed only at a detection, from a tensor the detection still holds: the tensors of a call
decided in its own hook (``check="module"``), the call's inputs and output that ``find_op`` keeps,
a parameter, a parameter's gradient, or an output's gradient that ``find_op`` keeps. Before a
detection nothing here runs. The tensor is read again, and used only if it is unchanged since its
hook read it: its version counter and data pointer as then (``reads.Reads.unchanged``: an in-place
reorder keeps every count, and would name the wrong rows), and its statistics row the same. Where
the hook's read is not remembered (reuse_stats=False, a call read apart), the whole row must match.
Under no_grad and inference mode a call lets go of its tensors when it returns (``culprit``): its
tensor is brought back by running its pass again from the outermost call, up to that call's end,
and used only if its row is the one the hook read. Otherwise the line says why nothing is shown:
never a guess.

Rows are indices along dim 0. They are *batch* rows when the detector knows the batch: the
``set_batch(ids)`` of this batch (one id per row: the samples are then named), or for a Hugging Face
transformers model the batch size of its input (``input_ids``, ``inputs_embeds``, ...) as kept by
``find_op``; with the latter, dim 1 of a tensor whose first two dims are (batch, sequence) is the
token position.
"""

import torch

from .frames import BACKWARD, entries_of, forward_items, own_parameters
from .text import TENSOR
from ..stats import tensor_stats
from ..stats.kinds import PLAIN_TYPES
from ..stats.layout import NAN, NEGINF, NUMEL, POSINF

ROWS_SHOWN = 8  # rows (and samples) named in the line; the record keeps up to ROWS_KEPT
ROWS_KEPT = 1024
# a transformers model's inputs whose first two dims are (batch, sequence)
_SEQUENCE_INPUTS = ("input_ids", "inputs_embeds", "attention_mask", "decoder_input_ids", "labels")


class Held:
    """What a detection holds to find its tensor: the tensors of a call decided in its hook
    (``tensors``, by row), ``find_op``'s kept calls (``kept_call``: the detecting call's;
    ``kept_forward``, ``kept_gradients``: the forward's calls and the gradients at their outputs),
    the model's modules by name, whether frames hold keyword inputs and containers, the batch's
    sample ids (``set_batch``), and ``unchanged(tensor, index)``: whether a tensor is unchanged
    since the hook read it as the call's ``index``-th (True, False, or None: not known)."""

    __slots__ = ("tensors", "kept_call", "kept_forward", "kept_gradients", "modules_by_name", "kwargs", "containers",
                 "samples", "unchanged")

    def __init__(self, tensors=None, kept_call=None, kept_forward=(), kept_gradients=None, modules_by_name=None,
                 kwargs=False, containers=False, samples=None, unchanged=None):
        self.tensors, self.kept_call = tensors, kept_call
        self.kept_forward, self.kept_gradients = kept_forward, kept_gradients or {}
        self.modules_by_name = modules_by_name or {}
        self.kwargs, self.containers, self.samples = kwargs, containers, samples
        self.unchanged = unchanged or _not_known


def _not_known(tensor, index):
    return None


# how a tensor was found: one held since its hook read it (it may have changed since: in a hook
# that decides at once it has not); one brought back by a replay (a new tensor, the same values
# where the run is deterministic)
_HELD, _REPLAYED = "held", "replayed"
CHANGED = "it changed after its hook (in place, or its memory swapped): what it holds now is not what the hook read"


def facts(frame, ctx, held):
    """The detection's ``"where"``: ``{"entry", "shape", "rows", "rows_total", "batch", "first",
    "token", "samples", "nan", "posinf", "neginf", "numel"}`` for the entry ``ctx`` of ``frame``
    (the Source line's), or ``{"entry", "why"}`` where it cannot be told. Never raises."""
    try:
        row, index = _row_of(frame, ctx)
        tensor, why, how = _tensor(frame, ctx, held)
        if tensor is None:
            return {"entry": ctx, "why": why}
        return _read(tensor, row, ctx, frame, held, how, index)
    except Exception as error:  # noqa: BLE001 - a report's extra line must never break the run
        return {"entry": ctx, "why": f"not read ({type(error).__name__}: {error})"}


def line(where):
    """``Where: batch rows 3, 5 of 8 (samples 1003, 1005); first at [3, 517, 12] (token 517); 96 of
    6,291,456 elements are nan``, or ``Where: not shown (<why>)``."""
    if "why" in where:
        return f"Where: not shown for {where['entry']} ({where['why']})"
    parts = []
    if where["shape"]:
        rows = where["rows"][:ROWS_SHOWN]
        named = ", ".join(str(r) for r in rows)
        if where["rows_total"] > len(rows):
            named += f" and {where['rows_total'] - len(rows)} more"
        noun = ("batch " if where["batch"] else "") + ("row" if where["rows_total"] == 1 else "rows")
        part = f"{noun} {named} of {where['shape'][0]}"
        if where.get("samples") is not None:
            samples = ", ".join(str(s) for s in where["samples"][:ROWS_SHOWN])
            more = ", ..." if where["rows_total"] > ROWS_SHOWN else ""
            part += f" ({'sample' if where['rows_total'] == 1 else 'samples'} {samples}{more})"
        parts.append(part)
        first = f"first at [{', '.join(str(i) for i in where['first'])}]"
        if where.get("token") is not None:
            first += f" (token {where['token']})"
        parts.append(first)
    nan, inf = where["nan"], where["posinf"] + where["neginf"]
    kinds = "nan" if not inf else "inf" if not nan else f"nan or inf ({nan:,} nan, {inf:,} inf)"
    parts.append(f"{nan + inf:,} of {where['numel']:,} elements {'is' if nan + inf == 1 else 'are'} {kinds}")
    return "Where: " + "; ".join(parts)


def _row_of(frame, ctx):
    """The hook's row of the entry ``ctx``, and its index among the call's tensors."""
    for kind, name, payload in frame.entries:
        if kind == TENSOR and name == ctx:
            return frame.rows[payload], payload
    raise LookupError(f"no tensor entry {ctx}")


def _tensor(frame, ctx, held):
    """``(tensor, None, how)``, or ``(None, why, None)``."""
    if held.tensors is not None:  # the very tensors its hook read (a call decided in its hook, the batch)
        for kind, name, payload in frame.entries:
            if kind == TENSOR and name == ctx:
                return held.tensors[payload], None, _HELD
    module = held.modules_by_name.get(frame.module_name)
    parameters = {name: parameter for parameter, name in own_parameters(module)} if module is not None else {}
    if frame.phase == BACKWARD and ctx.endswith(".grad"):
        name = ctx[:-len(".grad")]
        if name in parameters:
            grad = parameters[name].grad
            return (grad, None, _HELD) if grad is not None else (None, "the gradient is gone", None)
        calls = [call for call in held.kept_forward if call.module is module and module is not None]
        if not calls:
            return None, "the output's gradient is not kept: find_op=True keeps it until the backward ends", None
        if len(calls) > 1:
            return None, f"{frame.module_name or '(model)'} ran {len(calls)} times in that forward", None
        output = _entry_tensor(calls[0], name, held) if calls[0].kept else None
        grad = held.kept_gradients.get(id(output)) if output is not None else None
        return (grad, None, _HELD) if grad is not None else (None, "the output's gradient is not kept", None)
    if ctx in parameters:
        return parameters[ctx], None, _HELD
    call = held.kept_call
    if call is None or call.module is not module:
        return None, "the call's tensors are not kept: find_op=True keeps them until the pass is decided", None
    if not call.kept:  # let go of when it returned (no_grad, inference mode)
        tensor, why = _brought_back(call, ctx, held)
        return (tensor, None, _REPLAYED) if tensor is not None else (None, why, None)
    if ctx.startswith("output") and call.output_changed() or ctx.startswith("input") and call.changed():
        return None, CHANGED, None  # (its versions when it started and returned, where reads remember none)
    tensor = _entry_tensor(call, ctx, held)
    return (tensor, None, _HELD) if tensor is not None else (None, "not among the call's kept tensors", None)


def _entry_tensor(call, ctx, held, args=None, kwargs=None, output=None):
    """The tensor a kept call (``culprit.KeptCall``) has under the entry name ``ctx``, or the one
    ``args``, ``kwargs`` and ``output`` of that call's replay have."""
    if args is None:
        args, kwargs, output = call.args, call.kwargs, call.output
    items = forward_items(call.module, tuple(args), output, kwargs if held.kwargs else None, held.containers)
    entries, tensors, _ = entries_of(items)
    for kind, name, payload in entries:
        if kind == TENSOR and name == ctx:
            return tensors[payload]
    return None


def _brought_back(call, ctx, held):
    """``(tensor, None)`` of a call that let go of its tensors when it returned, as its pass made
    them: the pass run again from its outermost call (which keeps its inputs and RNG states until
    the pass is decided) up to that call's end, nothing read; or ``(None, why)``."""
    root = call.root
    if root is call or root.rng is None or not root.kept or root.changed():
        return None, "the call let go of its tensors when it returned (no_grad), and its pass cannot be run again"
    from ..replay.op_replay import arrive_at

    arrived = arrive_at(root.module, root.args, root.kwargs, root.rng, root.call_state(), call.module, call.ordinal,
                        end=True)
    if arrived is None:
        return None, "the call let go of its tensors when it returned (no_grad), and its pass did not run again"
    _, args, kwargs, output = arrived
    tensor = _entry_tensor(call, ctx, held, args, kwargs or {}, output)
    return (tensor, None) if tensor is not None else (None, "not among the tensors of the call run again")


def _counts(tensor):
    """``(nan, +inf, -inf, bad)`` as the engine counts them (complex: by parts, as torch.isnan and
    torch.isinf do), and the mask of the non-finite elements."""
    if tensor.dtype == torch.complex32:
        tensor = tensor.to(torch.complex64)
    elif tensor.is_floating_point() and tensor.element_size() == 1:  # the float8 kinds: few ops of their own
        tensor = tensor.to(torch.float32)
    nan = torch.isnan(tensor)
    if tensor.is_complex():
        inf = torch.isinf(tensor)
        return int(nan.sum()), int(inf.sum()), 0, nan | inf
    posinf, neginf = tensor == float("inf"), tensor == float("-inf")
    return int(nan.sum()), int(posinf.sum()), int(neginf.sum()), nan | posinf | neginf


def _read(tensor, row, ctx, frame, held, how, index):
    if type(tensor) not in PLAIN_TYPES or tensor.layout != torch.strided or tensor.is_meta:
        kind = type(tensor).__name__ if type(tensor) not in PLAIN_TYPES else f"{tensor.layout} tensor"
        return {"entry": ctx, "why": f"a {kind}: its elements are not read here"}
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return {"entry": ctx, "why": f"a {tensor.dtype} tensor holds no nan/inf"}
    unchanged = held.unchanged(tensor, index) if how == _HELD else None
    if unchanged is False:
        return {"entry": ctx, "why": CHANGED}
    if how == _REPLAYED or (how == _HELD and unchanged is None):  # no version to go by: its whole row
        if [int(value) for value in tensor_stats([tensor.detach()]).host_rows()[0]] != list(row):
            why = ("its pass run again made other values than the hook read" if how == _REPLAYED else
                   "it changed after its hook: its statistics differ from what the hook read")
            return {"entry": ctx, "why": why}
    with torch.no_grad():
        tensor = tensor.detach()
        nan, posinf, neginf, bad = _counts(tensor)
        if (nan, posinf, neginf, tensor.numel()) != (row[NAN], row[POSINF], row[NEGINF], row[NUMEL]):
            return {"entry": ctx, "why": "it changed after its hook: its nan/inf counts differ from what the hook read"}
        shape = list(tensor.shape)
        facts = {"entry": ctx, "shape": shape, "rows": [], "rows_total": 0, "batch": False, "first": [],
                 "token": None, "samples": None, "nan": nan, "posinf": posinf, "neginf": neginf,
                 "numel": tensor.numel()}
        if not shape:
            return facts
        flat = bad.reshape(-1)
        first = int(torch.argmax(flat.to(torch.uint8)))  # the first maximum: the first bad element
        facts["first"] = _unravel(first, shape)
        bad_rows = bad.reshape(shape[0], -1).any(dim=1) if shape[0] else bad.new_zeros(0)
        facts["rows"] = bad_rows.nonzero().reshape(-1)[:ROWS_KEPT].tolist()
        facts["rows_total"] = int(bad_rows.sum())
    batch, sequence = _layout(frame, ctx, shape, held)
    facts["batch"] = batch
    if batch and held.samples is not None and len(held.samples) == shape[0]:
        facts["samples"] = [held.samples[r] for r in facts["rows"]]
    if sequence:
        facts["token"] = facts["first"][1]
    return facts


def _unravel(index, shape):
    """The multi-index of a flat (row-major) index."""
    position = []
    for size in reversed(shape):
        index, at = divmod(index, size)
        position.append(at)
    return position[::-1]


def _layout(frame, ctx, shape, held):
    """``(batch, sequence)``: whether dim 0 of this tensor is the batch, and dim 1 the sequence."""
    if not ctx.startswith(("input", "output")):
        return False, False  # a parameter or its gradient has no batch
    known = _transformers_batch(held)
    if held.samples is not None:
        batch = shape[0] == len(held.samples)
    else:
        batch = known is not None and shape[0] == known[0]
    sequence = batch and known is not None and len(shape) >= 2 and shape[:2] == [known[0], known[1]]
    return batch, sequence


def _transformers_batch(held):
    """``(batch size, sequence length or None)`` of a Hugging Face transformers model's input, from
    the model's call that find_op kept; None for another model, or when it was not kept."""
    model = held.modules_by_name.get("")
    if model is None or not any(cls.__module__.startswith("transformers.") for cls in type(model).__mro__):
        return None
    root = held.kept_call
    while root is not None and root.parent is not None:
        root = root.parent
    if root is None or root.module is not model:
        root = next((call for call in held.kept_forward if call.module is model and call.parent is None), None)
    if root is None:
        return None
    values = dict(root.kwargs or {})
    if root.args and isinstance(root.args[0], torch.Tensor):
        values.setdefault("input_ids", root.args[0])
    for name in _SEQUENCE_INPUTS:
        value = values.get(name)
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return value.shape[0], value.shape[1]
    return None
