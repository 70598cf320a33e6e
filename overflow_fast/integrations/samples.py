"""Which dataset samples the rows of each training batch hold, where the data loader can tell, so
that a detection's ``Where:`` line names them (``detector.set_batch(ids)``).

A torch ``DataLoader`` over a map-style dataset draws each batch's dataset indices from its index
sampler (``batch_sampler``) and yields the batches in that order (``in_order``, the default). A
``Tape`` records the index lists that sampler gives for the loader, in order; the trainer pairs
them, one by one, with the batches the loader yields (``pair``), and ``samples_of`` then finds a
batch's ids from any tensor of it that reaches the model (the same tensor object: the loader
already placed it on the device).

Nothing is paired where the order could differ, rather than risk naming the wrong samples:
``in_order=False``, an iterable dataset (no sampler), a loader that sends one rank's batch to the
others (accelerate's ``DataLoaderDispatcher``), a batch sampler that is not a Python class, a pass
the trainer does not start from its first batch (a resumed epoch skips the batches already
trained), or any count that does not match.
"""

import threading
import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

_TAPES = weakref.WeakKeyDictionary()  # index sampler -> its Tape
_CLASSES = {}  # sampler class -> its recording subclass
_lock = threading.Lock()


class Tape:
    """The index lists one loader's sampler gave in its current pass, not yet paired with a batch."""

    def __init__(self):
        self.lists = []
        self.valid = False  # False until a pass starts, and after a mismatch until the next one
        self.passes_to_skip = 0

    def new_pass(self):
        self.lists = []
        if self.passes_to_skip:
            self.passes_to_skip -= 1
            self.valid = False
        else:
            self.valid = True

    def record(self, indices):
        if self.valid:
            if isinstance(indices, (list, tuple)) and all(isinstance(i, int) for i in indices):
                self.lists.append(list(indices))
            else:
                self.valid = False  # not one list of ints per batch: unknown from here on

    def take(self, count):
        """The next ``count`` index lists, or None (and nothing more this pass) when it cannot tell."""
        if not self.valid or len(self.lists) < count:
            self.valid = False
            return None
        taken, self.lists = self.lists[:count], self.lists[count:]
        return taken


def _recording(cls):
    """A subclass of the sampler's class whose passes are recorded (isinstance checks still hold)."""
    with _lock:
        sub = _CLASSES.get(cls)
        if sub is None:
            def __iter__(self):
                tape = _TAPES.get(self)
                if tape is not None:
                    tape.new_pass()
                for indices in cls.__iter__(self):
                    if tape is not None:
                        tape.record(indices)
                    yield indices

            sub = _CLASSES[cls] = type(cls.__name__, (cls,), {"__iter__": __iter__, "__module__": cls.__module__,
                                                              "__qualname__": cls.__qualname__})
    return sub


def _index_sampler(loader):
    """The sampler that gives the loader's batches their dataset indices, or None where the batches
    cannot be paired with them (see the module's docstring)."""
    base = loader
    if type(loader).__name__ == "DataLoaderShard":  # accelerate: the loader it wraps does the loading
        base = getattr(loader, "base_dataloader", None)
    if type(base) is not torch.utils.data.DataLoader or getattr(base, "in_order", True) is False:
        return None
    if isinstance(base.dataset, torch.utils.data.IterableDataset):
        return None
    sampler = base.batch_sampler if base.batch_sampler is not None else base.sampler
    if sampler is None or getattr(type(sampler), "__iter__", None) is None or not hasattr(sampler, "__dict__"):
        return None
    return sampler


def attach(loader, skip_first_pass=False):
    """Record ``loader``'s index lists from its next pass on (``skip_first_pass``: from the one after).
    Returns the Tape, or None where the loader cannot tell which samples its batches hold."""
    sampler = _index_sampler(loader)
    if sampler is None:
        return None
    try:
        if type(sampler) not in _CLASSES.values():
            sampler.__class__ = _recording(type(sampler))
    except TypeError:  # a class whose layout forbids it
        return None
    tape = Tape()
    tape.passes_to_skip = int(skip_first_pass)
    _TAPES[sampler] = tape
    return tape


def detach(loader):
    """Stop recording (the sampler gets its own class back)."""
    sampler = _index_sampler(loader)
    if sampler is None:
        return
    _TAPES.pop(sampler, None)
    if type(sampler) in _CLASSES.values():
        sampler.__class__ = type(sampler).__mro__[1]


class Batches:
    """The dataset ids of the batches paired so far, by their tensors (held weakly)."""

    def __init__(self):
        self._ids = WeakIdKeyDictionary()

    def pair(self, tape, batches):
        """Pair the batches a loader just yielded with the tape's next index lists."""
        lists = tape.take(len(batches)) if tape is not None else None
        if lists is None:
            return
        for batch, ids in zip(batches, lists):
            for tensor in _tensors(batch):
                if tensor.dim() >= 1 and tensor.shape[0] == len(ids):
                    self._ids[tensor] = ids

    def samples_of(self, args, kwargs):
        """The ids of the batch whose tensors a model call got, or None."""
        for value in list(args) + list((kwargs or {}).values()):
            if isinstance(value, torch.Tensor):
                ids = self._ids.get(value)
                if ids is not None:
                    return ids
        return None


def _tensors(batch):
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict) or hasattr(batch, "items"):
        return [value for value in batch.values() if isinstance(value, torch.Tensor)]
    if isinstance(batch, (list, tuple)):
        return [value for value in batch if isinstance(value, torch.Tensor)]
    return []
