"""What a healthy step of ``check="step"`` reads (``step_guard``): the root's outputs after each forward
(the hook layer's rows: one C++ call, one host read) and every parameter's gradient after each
backward (one ``tensor_stats`` call, one host read), and at a detection what holds the nan/inf,
by name (``ignore`` aside), as the guard's own frame."""

import collections

import torch

from .. import distributed
from ..stats import tensor_stats, unreadable_reason
from ..stats.layout import NAN, NEGINF, POSINF
from .frames import BACKWARD, FORWARD, Frame, class_name, entries_of, output_items, own_parameters
from .reads import Reads
from .text import TENSOR

OUTPUT_ROWS = 1 << 10  # rows for a forward's outputs (more: read apart, one by one)
_FEW_ROWS = 8  # rows read as a list (more: counted on their device, and one number read)
SHOWN_GRADIENTS = 20  # gradient entries the guard's own frame shows (the first ones holding a nan/inf)

# What a read found: the frame of the entries to show, with host rows; the names of the entries
# that count (``ignore`` aside), in order.
Seen = collections.namedtuple("Seen", ("frame", "bad"))


class StepReads:
    """The reads of one guard on ``model`` (``decisions``: its module names and ``ignore``;
    ``backend``: the one its reads ask for)."""

    def __init__(self, model, decisions, backend):
        self.model = model
        self.decisions = decisions
        self.backend = backend
        self.reads = None  # the rows of the root's outputs (made at the first forward: the extension may be built then)
        # the parameters whose gradients are read, with their module's and entry's names, and whether
        # any is sharded: found at the first backward (a copy of the model is still being made before)
        self.parameters = self.owners = self.sharded = None

    def outputs_nonfinite(self, outputs):
        """Whether a root output holds a nan/inf: the hook layer's rows (``reads``: one C++ call that
        reads them, one host read)."""
        if not outputs:
            return False
        if self.reads is None:
            self.reads = Reads(self.backend, OUTPUT_ROWS, False, 0)
        reads = self.reads
        try:
            reads.add(outputs)
            return reads.read()
        finally:
            reads.reset()

    def outputs_seen(self, output):
        """At a detection in a forward: the root's output entries, read again (``seen``)."""
        entries, tensors, dtypes = entries_of(output_items(output, containers=True))
        return self.seen(tensors, dtypes, FORWARD, entries=entries)

    def gradients(self):
        """Every parameter's gradient in one engine call (this rank's shards of sharded ones: the
        agreement tells the other ranks): what holds a nan/inf, or None."""
        if self.parameters is None:
            gradients = _parameters(self.model, self.decisions.module_names)
            self.parameters = [parameter for parameter, _, _ in gradients]
            self.owners = [(name, ctx) for _, name, ctx in gradients]
            self.sharded = any(distributed.local_shard(p) is not p for p in self.parameters)
        grads = [grad for parameter in self.parameters if (grad := parameter.grad) is not None]
        if self.sharded:
            grads = [distributed.local_shard(grad) for grad in grads]
        if not self.nonfinite(grads):
            return None
        held = [(grad, owner) for parameter, owner in zip(self.parameters, self.owners)
                if (grad := parameter.grad) is not None]
        grads = [distributed.local_shard(grad) for grad, _ in held] if self.sharded else [grad for grad, _ in held]
        return self.seen(grads, [grad.dtype for grad in grads], BACKWARD, owners=[owner for _, owner in held])

    def nonfinite(self, tensors):
        """Whether a tensor of ``tensors`` holds a nan/inf: one engine call, one host read."""
        if not tensors:
            return False
        try:
            stats = tensor_stats(tensors, backend=self.backend)
        except TypeError:  # a tensor the engine cannot read: the others are read
            tensors = [tensor for tensor in tensors if unreadable_reason(tensor) is None]
            if not tensors:
                return False
            stats = tensor_stats(tensors, backend=self.backend)
        for _, values in stats.groups:
            if len(values) <= _FEW_ROWS:  # a handful of rows: to the host as they are
                if any(row[NAN] or row[POSINF] or row[NEGINF] for row in values.tolist()):
                    return True
            elif torch.count_nonzero(values[:, NAN:NEGINF + 1]):
                return True
        return False

    def seen(self, tensors, dtypes, phase, entries=None, owners=None):
        """Read ``tensors`` again, at a detection: what holds a nan/inf that counts (``ignore``
        aside), or None. A forward's ``entries`` are its outputs'; a backward's tensors are
        gradients of the parameters named by ``owners`` (module, entry)."""
        rows = tensor_stats(tensors, backend=self.backend).host_rows() if tensors else []
        if entries is None:
            entries = [(TENSOR, f"{name}.{ctx}" if name else ctx, index) for index, (name, ctx) in enumerate(owners)]
        counting = self.decisions.counting
        bad = []
        for kind, ctx, payload in entries:
            row = rows[payload] if kind == TENSOR else None
            if row is None or not (row[NAN] or row[POSINF] or row[NEGINF]):
                continue
            module, entry = owners[payload] if owners is not None else ("", ctx)
            if not (counting.ignore and counting.ignored(module, entry)):
                bad.append((kind, ctx, payload))
        if not bad:
            return None
        shown = entries if phase == FORWARD else bad[:SHOWN_GRADIENTS]
        frame = Frame("", class_name(self.model), [(kind, ctx, i if kind == TENSOR else payload)
                                                   for i, (kind, ctx, payload) in enumerate(shown)],
                      [dtypes[payload] if kind == TENSOR else None for kind, _, payload in shown], phase)
        frame.rows = [rows[payload] if kind == TENSOR else None for kind, _, payload in shown]
        return Seen(frame, [ctx for _, ctx, _ in bad])


def _parameters(model, module_names):
    """``(parameter, its module's name, "name.grad")`` of each parameter that takes a gradient,
    under its first owner, as the gradient frames name them."""
    seen, found = set(), []
    for module in model.modules():
        for parameter, name in own_parameters(module):
            if id(parameter) in seen or not parameter.requires_grad or not parameter.is_leaf:
                continue
            seen.add(id(parameter))
            found.append((parameter, module_names.get(module, "?"), f"{name}.grad"))
    return found
