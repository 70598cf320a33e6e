"""What a detection does, one strategy per ``on_detect`` value: which of its entries are reported
and how often a pass detects (``reports``, ``once_per``: read by ``counting``), whether the calls
after it never happened (``rewinds``: read by ``decisions``), and, once the detection is reported
(the reference's text), whether it ``stops`` (raise now, as the reference does) or what follows
when training goes on (``went_on``).

- ``Raise`` ("raise", the reference): report, then raise.
- ``Warn`` ("warn"): report each offending (module, entry) once, warn, go on.
- ``Record`` ("record"): record only (``detector.detections``), go on.
- ``Skip`` ("skip"): report, then the step applies no update (``skip_step``); after ``max_skips``
  skipped steps in a row it raises as "raise" does.
- ``Call`` (a callable): report, then call it with the detection as an ``OverflowDetected``.

Except with "raise", a pass reports one detection (later frames only pass the values on); with
"skip", a step does.
"""

import warnings

from .errors import overflow_error, say
from .skip_step import SkipStep


class Raise:
    """The reference: report, then raise. Under torch.distributed the ranks agree first."""

    name = "raise"
    agreed = True  # its decisions are agreed between ranks
    rewinds = True  # it raised at the detection: the calls after it never happened
    reports = "every"  # which nan/inf entries get their lines: "every", "new" (each (module, entry) once), "none"
    once_per = None  # how often detections count: None (each), "pass" or "step" (the first of each)

    def stops(self):
        return True

    def went_on(self, detection, frames, first_frame, bad, report_due):
        raise AssertionError("raise never goes on")

    def skipping(self):
        return False

    def ranks_detected(self):
        """Other ranks detected in this pass: True when that is handled here (else raise)."""
        return False

    def new_step(self):
        pass

    def close(self):
        pass


class Warn(Raise):
    name = "warn"
    agreed = False
    rewinds = False
    reports = "new"
    once_per = "pass"

    def stops(self):
        return False

    def went_on(self, detection, frames, first_frame, bad, report_due):
        if report_due:
            warnings.warn(f"overflow_fast: inf/nan in {first_frame.module_name or '(model)'} {', '.join(bad)} "
                          f"({first_frame.phase}, batch_number={detection['batch_number']}); training goes on "
                          "(on_detect='warn')", RuntimeWarning, stacklevel=2)


class Record(Warn):
    name = "record"
    reports = "none"

    def went_on(self, detection, frames, first_frame, bad, report_due):
        pass


class Call(Warn):
    name = "callable"
    reports = "every"

    def __init__(self, function):
        self.function = function

    def went_on(self, detection, frames, first_frame, bad, report_due):
        self.function(overflow_error(detection, frames))


class Skip(Raise):
    name = "skip"
    rewinds = False
    once_per = "step"

    def __init__(self, model, max_skips):
        self.step = SkipStep(model, max_skips)

    def stops(self):
        return self.step.due_to_raise

    def went_on(self, detection, frames, first_frame, bad, report_due):
        self.step.begin()
        say(f"overflow_fast: skipping this step: it applies no update ({self.step.in_a_row + 1} skipped in a "
            f"row, at most {self.step.max_skips})")

    def skipping(self):
        return self.step.skipping

    def ranks_detected(self):
        self.step.begin()  # every rank skips the step
        return True

    def new_step(self):
        if self.step.skipping:
            self.step.end()  # the trainer moved on: the skipped step is over (its scaler may have skipped it)

    def close(self):
        self.step.close()


def kind(on_detect):
    """The strategy's class of a (validated) ``on_detect`` value."""
    return Call if callable(on_detect) else {"raise": Raise, "warn": Warn, "record": Record, "skip": Skip}[on_detect]


def strategy(on_detect, model, max_skips):
    """The strategy of a (validated) ``on_detect`` value."""
    if callable(on_detect):
        return Call(on_detect)
    if on_detect == "skip":
        return Skip(model, max_skips)
    return kind(on_detect)()
