"""Where the detector's records go (``log=``): a path (a JSONL file, ``recorder.Recorder``), a
dashboard (a TensorBoard ``SummaryWriter`` or a W&B run, ``dashboards.Dashboard``) or a list of
them. ``Sinks`` writes what it is given into every one of them; which frames are given, and when,
is the hook layer's (``hooks/step_log``). Frames are ``schema.RecordedFrame``s with host rows: no
extra host sync."""

from .. import distributed
from .dashboards import Dashboard, is_dashboard
from .recorder import Recorder, backoff_record, detection_record, frame_records


class Sinks:
    def __init__(self, log, log_every=1, check=None):
        """``log`` and ``log_every`` as ``options.Options`` validated them (the JSONL logs' meta
        record carries ``log_every``, and ``check``: the mode that writes them)."""
        targets = list(log) if isinstance(log, (list, tuple)) else [log]
        where = distributed.world()
        self.dashboards = [Dashboard(target) for target in targets if is_dashboard(target)]
        self.recorders = []
        try:
            for target in targets:
                if not is_dashboard(target):
                    self.recorders.append(Recorder(target, rank=where[0] if where else None,
                                                   world_size=where[1] if where else None, log_every=log_every,
                                                   check=check))
        except BaseException:
            self.close()  # one refused path (another writer has it): release the others
            raise

    def frame(self, call, frame, batch, step, global_step=None, mode=None):
        """A frame, the ``call``-th of its ``step`` (the dashboards' x axis), of ``batch`` (the
        detector's batch number), and of the trainer's ``global_step`` and ``mode`` where known."""
        if self.recorders:
            records = frame_records(batch, frame.phase, call, frame, distributed.rank(), global_step, mode)
            for recorder in self.recorders:
                recorder.write(records)
        for dashboard in self.dashboards:
            dashboard.frame(frame, step, mode)

    def detection(self, detection, step):
        """Write the detection (a dict: batch_number, phase, module, class, entries, and where
        known global_step, mode, op, transient, repro, where, scaler, check, replay) of ``step``, and wait until
        everything written is on disk (the error comes next)."""
        record = detection_record(detection["batch_number"], detection["phase"], detection["module"],
                                  detection["class"], detection["entries"], distributed.rank(),
                                  detection.get("global_step"), detection.get("mode"))
        for field in ("op", "transient", "repro", "where", "scaler", "check", "replay"):  # the readers pass over them
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
