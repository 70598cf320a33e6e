"""The detector under ``torch.compile``.

While dynamo traces a model, a forward hook must neither take the lock, nor read the detector's
counters (each value read would become a guard, and every batch a recompile), nor sync. It only
computes its rows inside the graph (one engine op node) and records the call's entries; the
records are replayed through the reference's state machine by the first eager hook after the
compiled region (the model's own hook is kept out of the graph: it always runs eagerly).
"""

import torch

from .decisions import NO_ROWS, Pending
from .frames import FORWARD, entries_of, forward_items
from ..stats import tensor_stats


class Traced:
    """The records of hooks traced by torch.compile, not replayed yet."""

    def __init__(self):
        # one list for the detector's life: its identity is a guard of the compiled graph
        self.records = []

    def __bool__(self):
        return bool(self.records)

    def record(self, module, input, output, kwargs, containers, backend):
        """The hook, as traced: the call's rows computed in the graph, its entries kept."""
        entries, tensors, dtypes = entries_of(forward_items(module, input, output, kwargs, containers))
        rows = tensor_stats(tensors, backend).values if tensors else None
        self.records.append((module, entries, dtypes, rows))

    def absorb(self, passes, current, model, around=None):
        """Queue the records of a compiled region into the pass ``current``: one host read per
        device for all of them. ``around``: with find_op, the eager call whose hook absorbs them
        (``culprit.KeptCall``; the region ran inside it or inside one of its parents), for a
        replay of the region's calls, which kept no inputs of their own."""
        records = list(self.records)
        self.records.clear()
        host = {}
        for device in {rows.device for _, _, _, rows in records if rows is not None}:
            host[device] = iter(torch.cat([rows for *_, rows in records
                                           if rows is not None and rows.device == device]).tolist())
        for module, entries, dtypes, rows in records:
            if current.stopping:
                return
            sources = current.reads.host([next(host[rows.device]) for _ in dtypes]) if rows is not None else NO_ROWS
            call = passes.decisions.state.count(module is model)
            passes.queue(current, Pending(call, module, entries, dtypes, sources, FORWARD, None, kept_call=around),
                         passes.decides_now(call))
