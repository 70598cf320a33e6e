"""The reference detector's state machine, as an explicit object: the ring of frames, the lines
waiting for the next frame, the batch counter and the detection flag.

transformers' ``DebugUnderflowOverflow.forward_hook`` advances its counters and decides in the same
call. Here the two halves are apart, so that a hook can count its call at once and have its rows
read later: ``count`` runs in the hook and returns its :class:`CallCounters`; ``save`` replays it
once the frame's rows are on the host, in hook order.
"""

import collections
import functools

from . import text
from .frames import FORWARD


# One hook call as the reference's counters saw it when it ran.
CallCounters = collections.namedtuple("CallCounters", ("trace_mode", "first_call", "last_frame_of_batch",
                                                       "batch_before", "batch_after", "total_calls"))
# tuple.__new__ in C: namedtuple's own __new__ and _make are Python calls (this runs at every hook)
_counters = functools.partial(tuple.__new__, CallCounters)


class ReferenceState:
    def __init__(self, max_frames_to_save, trace_batch_nums):
        self.trace_batch_nums = trace_batch_nums
        # The reference swaps its deque for an unbounded list after tracing or a dump; this stays bounded.
        self.frames = collections.deque([], max_frames_to_save)
        self.frame = []  # lines waiting for the next forward frame (batch markers)
        self.batch_number = 0
        self.total_calls = 0
        # the reference's flag: a nan/inf was seen, and not acted on yet (every call is decided at once
        # until a strategy goes on). Read at every hook: a plain attribute, written by ``set_detected_overflow``
        self.detected_overflow = False
        self.forward_batch = 0  # the batch of the last forward call (not one recomputed in backward)

    def set_detected_overflow(self, detected):
        """The one writer of the flag: a frame counted, another rank detected, a strategy went on."""
        self.detected_overflow = detected

    def count(self, last_frame_of_batch, recomputed=False):
        """The counters of one forward hook call (``last_frame_of_batch``: the model's own).
        ``recomputed``: run during a backward pass (activation checkpointing's recompute), so it
        belongs to the batch whose forward ran last and never counts one."""
        trace_mode = self.batch_number in self.trace_batch_nums
        batch_before = self.batch_number
        self.total_calls += 1
        if recomputed:
            last_frame_of_batch = False
        else:
            self.forward_batch = batch_before
        if last_frame_of_batch:
            self.batch_number += 1
        return _counters((trace_mode, self.total_calls == 1, last_frame_of_batch, batch_before, self.batch_number,
                      self.total_calls))

    def count_backward(self):
        """A gradient frame's call: it belongs to the batch whose forward ran last (the model's
        own, or a submodule's run alone, as a LightningModule's inner network is) and moves no
        counter (after it, they are as they were: ``batch_after``)."""
        batch = self.forward_batch
        return _counters((batch in self.trace_batch_nums, False, False, batch, self.batch_number, self.total_calls))

    def rewind(self, call):
        """The counters as they were right after ``call`` (the calls after it are not replayed)."""
        self.batch_number = call.batch_after
        self.total_calls = call.total_calls

    def open(self, call):
        """Before a call's frame is saved: a traced batch starts the ring afresh, the first call
        opens the first batch."""
        if call.trace_mode:
            self.frames.clear()
        if call.first_call:
            self.frame.extend(text.batch_start_lines(call.batch_before))

    def save(self, frame):
        """Keep ``frame`` in the ring; a forward frame takes the waiting lines as its lead."""
        if frame.phase == FORWARD:  # backward frames leave the next batch's markers where they are
            frame.lead, self.frame = self.frame, []
        self.frames.append(frame)

    def close(self, call):
        """After a call's frame is saved: the model's own frame opens the next batch."""
        if call.last_frame_of_batch:
            self.frame.extend(text.batch_start_lines(call.batch_after))

    def drop_calls(self, pendings):
        """``open``, ``save`` and ``close`` of calls (``decisions.Pending``, none in a traced batch)
        whose frames the ring would push out before anyone reads them: only their lead goes. A
        forward call takes every line waiting before it, and a gradient frame's counters never open
        or close a batch (``count_backward``), so only the last forward call among them leaves
        lines. Most calls of a pass take this way."""
        for pending in reversed(pendings):
            if pending.phase == FORWARD:
                self.frame = []  # (what its open added, its lead took)
                if pending.call.last_frame_of_batch:
                    self.close(pending.call)
                return
