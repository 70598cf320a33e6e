"""The replay: hook calls whose rows are on the host go through the reference's state machine in
hook order, each as a frame; ``counting`` says which of its entries count, and a frame that counts
is a detection, which this reports (the reference's text, then the lines beyond it).

What a detection does next (raise, go on, skip) is the strategy's (``on_detect``), which the
passes ask: this module only finds and reports. It holds what a copy of the detector carries:
the ring, the counters, what counting and the early warnings remember, the detections so far.
"""

import collections
import operator

from . import text
from .errors import say
from .step_log import timeline_step
from .frames import BACKWARD, Frame, class_name
from .source import source_line
from .where import line as where_line
from .scaling import backoff_line, entry_kind, scaler_line


def op_line(op):
    from ..replay.op_replay import op_line as line  # torch's dispatch machinery: only once a detection needs it

    return line(op if op.get("op") is not None else {**op, "why": op["what"]})

NO_ROWS = (None, [], None)  # the sources of a call without tensors
_TRACE_MODE = operator.attrgetter("call.trace_mode")  # (a pending call's, in C: asked of every call of a pass)

# A hook call waiting for its rows: what the reference's counters said (``call``), its module,
# entries and dtypes, where its rows are (``sources``), its phase, for an output gradient the
# modules whose backward produced it, with find_op its inputs (``culprit.KeptCall``), and for a
# call decided in its own hook its tensors (for a detection's Where line; like the inputs, kept
# with the last clean pass's calls until the next pass begins), and under autocast the dtype it
# computed in (``passes.computed_in``).
Pending = collections.namedtuple("Pending", ("call", "module", "entries", "dtypes", "sources", "phase", "consumers",
                                             "kept_call", "tensors", "computed_in"), defaults=(None, None, None))

# A detection found by the replay, for the strategy to act on.
# ``frame``: where it was found; ``first_frame`` and ``bad``: the first frame that counted and its
# entries; ``frames``: the ring as data; ``report_due``: whether counting wants it reported.
Found = collections.namedtuple("Found", ("detection", "frames", "frame", "first_frame", "bad", "batch",
                                         "shown_batch", "report_due", "kept_call", "tensors", "sources"))


class Decisions:
    def __init__(self, state, counting, early_warnings, log, module_names, explain, rewinds):
        self.state = state  # reference.ReferenceState
        self.counting = counting  # counting.Counting
        self.early_warnings = early_warnings  # early_warnings.EarlyWarnings, or None without warn_above
        self.log = log  # step_log.StepLog or None
        self.module_names = module_names
        self.explain = explain  # beyond the drop-in: the Source line
        self.rewinds = rewinds  # "raise": the calls after a detection never happened
        self.global_step = None  # the trainer's optimizer step, where known (set_step)
        self.mode = None  # "train" or "eval", where known
        self.detections = []  # what was detected: batch_number, phase, module, class, entries
        self.samples = None  # the dataset indices of the batch's rows, where known (set_batch)

    def modules_by_name(self):
        """Each module by its qualified name (the first name wins, as in frames)."""
        return {name: module for module, name in self.module_names.items()}

    def frame(self, reads, pending):
        frame = Frame(self.module_names.get(pending.module, "?"), class_name(pending.module), pending.entries,
                      pending.dtypes, pending.phase, pending.consumers)
        reads.resolve(frame, pending.sources)
        if self.explain or self.early_warnings is not None:  # (the drop-in prints the reference's frames)
            frame.computed_in = pending.computed_in
        return frame

    def quiet(self, queue):
        """Whether a queue whose rows count no nan/inf may take ``replay_finite``: nothing to trace,
        warn or log, and no detection pending."""
        return not (self.log is not None or self.early_warnings is not None or self.state.detected_overflow
                    or any(map(_TRACE_MODE, queue)))

    def replay(self, pass_key, reads, pending, scaling=None):
        """The reference's bookkeeping for one call whose rows are on the host: a ``Found`` when it
        detects (reported already), else None. ``pass_key(batch)``: which pass it belongs to;
        ``scaling``: a GradScaler's backward (``Counting.check``)."""
        call = pending.call
        frame = self.frame(reads, pending)
        state = self.state
        state.open(call)
        batch = call.batch_before  # a backward frame's call was counted with its forward's batch
        self.save(frame, batch, pass_key(batch), pending.kept_call, pending.tensors, scaling, pending.sources)
        if self.log is not None:
            self.log.frame(frame, batch, self.global_step, self.mode)
        if call.trace_mode:
            # the reference's ring holds just this frame now, whatever max_frames_to_save says
            say(str(frame))
            state.frames.clear()
        state.close(call)
        if not state.detected_overflow or call.trace_mode:
            return None
        if self.rewinds:
            state.rewind(call)  # later calls may have run: they never happened
        return self.found(frame, batch, call.batch_after, pass_key(batch))

    def replay_finite(self, reads, queue):
        """``replay`` of calls none of whose rows counts a nan/inf, when ``quiet``: only the ring and
        the waiting batch lines change, and the ring keeps the last frames alone, so only those are
        made."""
        state = self.state
        keep = state.frames.maxlen
        first_kept = 0 if keep is None else max(len(queue) - keep, 0)
        state.drop_calls(queue[:first_kept])
        for pending in queue[first_kept:]:
            state.open(pending.call)
            state.save(self.frame(reads, pending))
            state.close(pending.call)

    def save(self, frame, batch=None, pass_key=None, kept_call=None, tensors=None, scaling=None, sources=None):
        """Print the frame's nan/inf lines, keep it in the ring (with the waiting lines as its lead).
        ``kept_call`` (with find_op, the call kept for its replay), ``tensors`` (a call decided in its hook) and
        ``sources`` (where its rows are) are kept on a frame that counts until its detection;
        ``scaling``: a GradScaler's backward, whose backoff this reports."""
        lines, detected = self.counting.check(frame, batch, self.step_of(batch), pass_key, scaling)
        if self.early_warnings is not None:
            lines.extend(self.early_warnings.lines(frame, batch, self.step_of(batch), self.global_step))
        backoff = scaling.take_backoff() if scaling is not None else None
        if backoff is not None:
            self.backoff(backoff, batch)
        for line in lines:
            say(line)
        if detected:
            self.state.set_detected_overflow(True)
            frame.kept_call, frame.tensors, frame.sources = kept_call, tensors, sources
        self.state.save(frame)

    def backoff(self, backoff, batch):
        """A GradScaler's backoff (``scaling``): its one line, and its record into the flight recorder."""
        frame, entries, verdict = backoff
        say(backoff_line(frame.module_name, frame.class_name, entries, verdict, batch, self.global_step,
                         entry_kind(frame, entries)))
        if self.log is not None:
            self.log.backoff({"batch_number": batch, "module": frame.module_name, "class": frame.class_name,
                              "entries": list(entries), "scale": verdict.scale, "in_a_row": verdict.in_a_row,
                              "global_step": self.global_step, "mode": self.mode})

    def step_of(self, batch):
        """The training step a batch belongs to: the trainer's, where known."""
        return timeline_step(batch, self.global_step)

    def found(self, frame, batch, shown_batch, pass_key):
        """A nan/inf counted in ``frame`` (or earlier, in a traced batch): recorded, reported when due."""
        detection, first_frame, bad, report_due = self.counting.conclude(frame, batch, self.step_of(batch), pass_key)
        if self.global_step is not None:
            detection["global_step"] = self.global_step
        if self.mode is not None:
            detection["mode"] = self.mode
        self.detections.append(detection)
        frames = [text.frame_data(f) for f in self.state.frames if not isinstance(f, str)]
        kept_call, tensors, sources = first_frame.kept_call, first_frame.tensors, first_frame.sources
        for kept in (first_frame, frame):  # the ring keeps no tensors
            kept.kept_call = kept.tensors = kept.sources = None
        return Found(detection, frames, frame, first_frame, bad, batch, shown_batch, report_due, kept_call, tensors,
                     sources)

    def log_detection(self, found):
        """The detection into the flight recorder (after what the passes add to it: its op)."""
        if self.log is not None:
            self.log.detection(found.detection)

    def dump(self, found):
        """The reference's report (its batch number is the one its state had at that call), then
        the lines beyond it: the trainer's step where known, where the values were born."""
        if found.frame.phase == BACKWARD:
            during = f"the backward of batch_number={found.batch}"
        else:
            during = f"batch_number={found.shown_batch}"
        say(text.dump_text(self.state.batch_number, self.state.frames, during, found.frame.phase == BACKWARD))
        self.state.frames.clear()
        if self.global_step is not None:
            mode = f" ({self.mode})" if self.mode is not None else ""
            say(f"Step: optimizer step {self.global_step}{mode}, batch_number {found.batch}")
        if self.explain and "where" in found.detection:
            say(where_line(found.detection["where"]))
        if self.explain and found.bad:
            say(source_line(found.first_frame, found.bad))
        if "op" in found.detection:
            say(op_line(found.detection["op"]))
        if "repro" in found.detection:
            say(f"Repro: {found.detection['repro']} (overflow-fast replay {found.detection['repro']})")
        if "scaler" in found.detection:
            say(scaler_line(found.detection["scaler"]))
