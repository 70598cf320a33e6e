"""Which frames reach the flight recorder (``log=``, ``log_every``): every frame replayed with host
rows is written when its step is one ``log_every`` keeps; the frames of other steps wait until the
step ends, and are written only if the step detects. A step is the trainer's optimizer step where
the detector knows it (``set_step``), else its batch number. The writing is ``recording.sinks``'."""

from ..recording.sinks import Sinks


def timeline_step(batch, global_step):
    """The step a frame counts under (``log_every``, the dashboards' x axis): the trainer's
    optimizer step where it names one, else the detector's batch number."""
    return batch if global_step is None else global_step


class StepLog:
    def __init__(self, log, log_every=1, check=None):
        """``log``, ``log_every`` and ``check`` (the mode, which the logs' meta record names) as
        ``options.Options`` validated them."""
        self.log_every = log_every
        self.sinks = Sinks(log, log_every, check)
        self._step = None
        self._call = 0
        self._held = []  # (call, frame, batch, global_step, mode) of a step log_every skips, until it ends

    def wants(self, step):
        return step % self.log_every == 0

    def frame(self, frame, batch, global_step=None, mode=None):
        """A frame replayed with host rows, of ``batch`` (the detector's batch number), and of the
        trainer's ``global_step`` and ``mode`` ("train" or "eval") where known."""
        step = timeline_step(batch, global_step)
        if step != self._step:
            self._step, self._call, self._held = step, 0, []
        call, self._call = self._call, self._call + 1
        if not self.wants(step):
            self._held.append((call, frame, batch, global_step, mode))
            return
        self._write(call, frame, batch, global_step, mode)

    def _write(self, call, frame, batch, global_step, mode):
        self.sinks.frame(call, frame, batch, timeline_step(batch, global_step), global_step, mode)

    def detection(self, detection):
        """Write the frames of the detecting step that ``log_every`` held back, then the detection,
        and wait until all of it is on disk (the error comes next)."""
        step = timeline_step(detection["batch_number"], detection.get("global_step"))
        for held in self._held if self._step == step else []:
            self._write(*held)
        self._held = []
        self.sinks.detection(detection, step)

    def backoff(self, backoff):
        """A GradScaler's backoff (a dict: batch_number, module, class, entries, scale, in_a_row,
        global_step, mode) into the JSONL logs; written with the frames, not waited for."""
        self.sinks.backoff(backoff)

    def close(self):
        self.sinks.close()
