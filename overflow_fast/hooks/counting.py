"""Which of a frame's nan/inf entries count as a detection, and which of them are reported at once.

An entry does not count when ``ignore`` matches it, when it is a gradient's nan/inf that a
GradScaler recovers from (``scaling``), or when its pass (its step) already detected and the
``on_detect`` strategy reports once per pass (step): later frames only pass the values on. The
strategy also says which entries get their "has nans"/"has infs" lines (``on_detect``'s
``reports``). Pure host logic over frames' rows.
"""

import collections
import re

from . import text
from .frames import BACKWARD
from .text import TENSOR
from ..stats.layout import holds_nonfinite

REMEMBERED_PASSES = 256  # passes that detected, kept to tell their later frames from a new detection


def _glob(pattern):
    """fnmatch's * and ? only: entries hold brackets (input[0]) that fnmatch reads as classes."""
    return re.compile("".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern) + r"\Z")


class Counting:
    """``reports`` and ``once_per``: the ``on_detect`` strategy's (``on_detect.kind``).

    ``ignore``: patterns ``"MODULE"`` (every entry of the matching modules) or
    ``"MODULE:ENTRY"``, with * and ? as wildcards, matched against the module's qualified name
    ("" for the model itself) and the entry's name (``input[attention_mask]``, ``weight.grad``).
    Ignored entries keep their lines in frames but never count as a detection."""

    def __init__(self, reports, once_per, ignore):
        self.reports = reports
        self.once_per = once_per
        self.ignore = ignore
        self._ignore = [(_glob(m), _glob(e) if e is not None else None)
                        for m, _, e in (p.partition(":") if ":" in p else (p, None, None) for p in ignore)]
        self._ignored_cache = {}
        self._reported = set()  # (module, entry) already reported, with reports="new"
        self._first_bad = None  # (frame, entries) of the first frame that counts, until ``conclude``
        self._report_due = False  # an entry's lines were printed since the last ``conclude``
        # with once_per: the passes (or steps) that detected already, the latest last (several
        # threads' passes can be open at once)
        self._reported_passes = collections.OrderedDict()

    def _pass_of(self, frame, batch, step, pass_key):
        if self.once_per == "step":
            return ("step", step)
        return (frame.phase, batch) if pass_key is None else pass_key

    def check(self, frame, batch, step=None, pass_key=None, scaling=None):
        """``(lines, detected)``: the lines to print at once for ``frame`` (the reference's "has
        nans"/"has infs", the shards that hold them) and whether one of its entries counts as a
        detection. ``step``: the training step it belongs to (``once_per="step"``); ``pass_key``:
        the pass it belongs to (by default its phase and batch); ``scaling``: in a backward that a
        GradScaler scaled, its ``scaling.Scaling`` (a gradient's nan/inf that the scaler recovers
        from is its backoff, not a detection)."""
        lines = []
        detected = False
        for kind, ctx, payload in frame.entries:
            if kind != TENSOR or not holds_nonfinite(frame.rows[payload]):
                continue
            if self.ignore and self.ignored(frame.module_name, ctx):
                continue
            if self.once_per is not None and self._pass_of(frame, batch, step, pass_key) in self._reported_passes:
                self.new_reports(frame, [ctx])  # a consequence of what this pass reported
                continue
            if scaling is not None and frame.phase == BACKWARD and scaling.absorbs(frame, ctx):
                continue
            if self._first_bad is None:
                self._first_bad = (frame, [])  # where the source line looks
            if self._first_bad[0] is frame:
                self._first_bad[1].append(ctx)
            if self.reports == "new":
                report_it = bool(self.new_reports(frame, [ctx]))
            else:
                report_it = self.reports == "every"
            if report_it:
                lines.extend(text.overflow_lines(frame.rows[payload], ctx))
                if frame.bad_shards and payload in frame.bad_shards:  # a DTensor: whose shard holds them
                    lines.append(text.bad_shards_line(ctx, frame.bad_shards[payload]))
                self._report_due = True
            detected = True
        return lines, detected

    def conclude(self, frame, batch, step=None, pass_key=None):
        """A detection ends at ``frame`` (of ``batch``): ``(detection, first_frame, bad, report_due)``,
        the detection as data, the first frame that counted and its entries, and whether a report
        is due (with reports="new" only when an entry was new, never with "none"). With
        ``once_per``, later frames of the same pass (step) only pass the values on."""
        first_frame, bad = self._first_bad or (frame, [])
        self._first_bad = None
        report_due, self._report_due = self._report_due, False
        if self.once_per is not None:
            self._reported_passes[self._pass_of(frame, batch, step, pass_key)] = None
            while len(self._reported_passes) > REMEMBERED_PASSES:
                self._reported_passes.popitem(last=False)
        detection = {"batch_number": batch, "phase": first_frame.phase, "module": first_frame.module_name,
                     "class": first_frame.class_name, "entries": bad}
        return detection, first_frame, bad, report_due

    def unmatched(self, module_names):
        """The ``ignore`` patterns whose module part matches none of ``module_names`` (a typo ignores
        nothing), each with the nearest name: ``[(pattern, nearest or None)]``."""
        import difflib

        names = list(module_names)
        missing = []
        for pattern, (module, _) in zip(self.ignore, self._ignore):
            if not any(module.match(name) for name in names):
                wanted = pattern.partition(":")[0]
                near = difflib.get_close_matches(wanted, names, n=1, cutoff=0.6)
                if not near:  # the last part alone: "rotary_embb" for "model.layers.0.rotary_emb"
                    tails = {name.rpartition(".")[2]: name for name in names}
                    near = [tails[t] for t in difflib.get_close_matches(wanted.rpartition(".")[2], list(tails), n=1,
                                                                        cutoff=0.6)]
                missing.append((pattern, near[0] if near else None))
        return missing

    def ignored(self, module_name, ctx):
        key = (module_name, ctx)
        hit = self._ignored_cache.get(key)
        if hit is None:
            hit = self._ignored_cache[key] = any(
                m.match(module_name) and (e is None or e.match(ctx)) for m, e in self._ignore)
        return hit

    def new_reports(self, frame, bad):
        """The entries not reported before (each (module, entry) once)."""
        fresh = [ctx for ctx in bad if (frame.module_name, ctx) not in self._reported]
        self._reported.update((frame.module_name, ctx) for ctx in fresh)
        return fresh
