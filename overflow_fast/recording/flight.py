"""The detector's side of the flight recorder (``log=``): which frames become records, and where
they go. ``log`` is a path (a JSONL file, ``recorder.Recorder``), a dashboard (a TensorBoard
``SummaryWriter`` or a W&B run, ``dashboards.Dashboard``) or a list of them.

Every frame replayed with host rows is recorded when its step is one ``log_every`` keeps; the
frames of other steps wait until the step ends, and are written only if the step detects. A step
is the trainer's optimizer step where the detector knows it (``set_step``), else its batch number.
The rows are the ones the detector already read: no extra host sync."""

from .. import distributed
from .dashboards import Dashboard, is_dashboard
from .recorder import Recorder, backoff_record, detection_record, frame_records


def timeline_step(batch, global_step):
    """The step a frame counts under (``log_every``, the dashboards' x axis): the trainer's
    optimizer step where it names one, else the detector's batch number."""
    return batch if global_step is None else global_step


class StepLog:
    def __init__(self, log, log_every=1):
        """``log`` and ``log_every`` as ``options.Options`` validated them."""
        targets = list(log) if isinstance(log, (list, tuple)) else [log]
        self.log_every = log_every
        where = distributed.world()
        self.dashboards = [Dashboard(target) for target in targets if is_dashboard(target)]
        self.recorders = []
        try:
            for target in targets:
                if not is_dashboard(target):
                    self.recorders.append(Recorder(target, rank=where[0] if where else None,
                                                   world_size=where[1] if where else None, log_every=log_every))
        except BaseException:
            self.close()  # one refused path (another writer has it): release the others
            raise
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
        if self.recorders:
            records = frame_records(batch, frame.phase, call, frame, distributed.rank(), global_step, mode)
            for recorder in self.recorders:
                recorder.write(records)
        for dashboard in self.dashboards:
            dashboard.frame(frame, timeline_step(batch, global_step), mode)

    def detection(self, detection):
        """Write the frames of the detecting step that ``log_every`` held back, the detection,
        and wait until all of it is on disk (the error comes next)."""
        global_step, mode = detection.get("global_step"), detection.get("mode")
        step = timeline_step(detection["batch_number"], global_step)
        for held in self._held if self._step == step else []:
            self._write(*held)
        self._held = []
        record = detection_record(detection["batch_number"], detection["phase"], detection["module"],
                                  detection["class"], detection["entries"], distributed.rank(), global_step, mode)
        for field in ("op", "transient", "repro", "where", "scaler"):  # fields the report's readers pass over
            if field in detection:
                record[field] = detection[field]
        for recorder in self.recorders:
            recorder.write([record])
            recorder.flush()
        for dashboard in self.dashboards:
            dashboard.detection(detection, step)
            dashboard.flush()

    def backoff(self, backoff):
        """A GradScaler's backoff (a dict: batch_number, module, class, entries, scale, in_a_row,
        global_step, mode) into the JSONL logs; written with the frames, not waited for."""
        record = backoff_record(backoff["batch_number"], backoff["module"], backoff["class"], backoff["entries"],
                                backoff["scale"], backoff["in_a_row"], distributed.rank(), backoff["global_step"],
                                backoff["mode"])
        for recorder in self.recorders:
            recorder.write([record])

    def close(self):
        for sink in self.dashboards + self.recorders:
            sink.close()
