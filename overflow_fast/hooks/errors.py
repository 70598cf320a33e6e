"""The errors a detection raises: the reference's ValueError, carrying what was detected as data."""

import sys

from .. import distributed
from .text import OVERFLOW_ERROR


def say(text):
    """Print a report's lines: under torch.distributed each says which rank it comes from; flushed,
    since a rank killed by its launcher right after the error must leave its report. Where a tqdm
    progress bar is drawn (the trainers'), it is cleared first and drawn again after: a report never
    starts inside a bar's line."""
    text = distributed.with_prefix(text, distributed.rank_prefix())
    tqdm = sys.modules.get("tqdm")
    bars = getattr(getattr(tqdm, "tqdm", None), "_instances", None)
    if bars:
        with tqdm.tqdm.external_write_mode(file=sys.stdout):
            print(text, flush=True)
        return
    print(text, flush=True)


class OverflowDetected(ValueError):
    """The reference's ValueError on a detected inf/nan (same message, so ``except ValueError``
    and the text hold), carrying what was detected as data for a trainer to log or checkpoint:
    ``batch_number``, ``phase``, ``module_name``, ``class_name``, ``entries`` (of the first frame
    holding a nan/inf), ``global_step`` and ``mode`` (the trainer's optimizer step and "train" or
    "eval", where known: ``set_step``), ``rank`` (None in a single process), ``detection`` (those
    as a dict, with ``where``: where the nan/inf sits in the tensor the Source line names, and with
    find_op ``op``) and
    ``frames``: the reported frames, each ``{"module", "class", "phase", "entries": [{"entry",
    "dtype", "abs_min", "abs_max", "nan", "posinf", "neginf", "zero", "subnormal", "numel"}]}``.
    Other detectors on the same model tell by this class that the report is already printed."""

    def __init__(self, message, detection=None, frames=()):
        ValueError.__init__(self, message)  # not super(): a subclass also derives from OverflowOnRanks
        self.detection = detection
        detection = detection or {}
        self.batch_number = detection.get("batch_number")
        self.phase = detection.get("phase")
        self.module_name = detection.get("module")
        self.class_name = detection.get("class")
        self.entries = detection.get("entries", [])
        self.global_step = detection.get("global_step")
        self.mode = detection.get("mode")
        self.rank = distributed.rank()
        self.frames = list(frames)


class OverflowDetectedOnRanks(OverflowDetected, distributed.OverflowOnRanks):
    """Raised on every rank once the ranks agreed that some of them detected a nan/inf; the
    message names them (``error.ranks``). On a rank that detected, ``detection`` and ``frames``
    are its own; elsewhere None and empty."""

    def __init__(self, ranks, world_size, detection=None, frames=()):
        distributed.OverflowOnRanks.__init__(self, ranks, world_size)
        OverflowDetected.__init__(self, str(self), detection, frames)


def overflow_error(detection, frames):
    return OverflowDetected(OVERFLOW_ERROR, detection, frames)
