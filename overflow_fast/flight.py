"""The detector's side of the flight recorder (``log=PATH``): which frames become records. Every
frame replayed with host rows is recorded when its step is one ``log_every`` keeps; the frames of
other steps wait until the step ends, and are written only if the step detects. The rows are the
ones the detector already read: no extra host sync."""

from . import distributed
from .recorder import Recorder, detection_record, frame_records


class StepLog:
    def __init__(self, path, log_every=1):
        if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1:
            raise ValueError(f"log_every must be a positive int, got {log_every!r}")
        where = distributed.world()
        self.recorder = Recorder(path, rank=where[0] if where else None,
                                 world_size=where[1] if where else None, log_every=log_every)
        self._step = None
        self._call = 0
        self._held = []  # frames of a step log_every skips, kept until the step ends

    def _rank(self):
        where = distributed.world()
        return where[0] if where else None

    def frame(self, frame, step):
        if step != self._step:
            self._step, self._call, self._held = step, 0, []
        call, self._call = self._call, self._call + 1
        if self.recorder.should_record(step):
            self.recorder.write(frame_records(step, frame.phase, call, frame, self._rank()))
        else:
            self._held.append((call, frame))

    def detection(self, detection):
        """Write the records of the detecting step that ``log_every`` held back, the detection
        record, and wait until all of it is on disk (the error comes next)."""
        rank = self._rank()
        step = detection["batch_number"]
        records = []
        for call, frame in self._held if self._step == step else []:
            records.extend(frame_records(step, frame.phase, call, frame, rank))
        self._held = []
        records.append(detection_record(step, detection["phase"], detection["module"], detection["class"],
                                        detection["entries"], rank))
        self.recorder.write(records)
        self.recorder.flush()

    def close(self):
        self.recorder.close()
