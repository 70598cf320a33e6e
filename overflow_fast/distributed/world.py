"""Which rank speaks: ``(rank, world_size)``, the ``"[rank 1/2] "`` prefix of a rank-aware report
(None in a single process, so its output stays byte-identical to the reference), the error every
rank raises together, and ``local_only()`` for code that only some ranks run."""

import contextlib
import threading

import torch

_local = threading.local()


def _dist():
    try:
        import torch.distributed as dist
    except Exception:  # torch built without distributed support
        return None
    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def world(group=None):
    """``(rank, world_size)`` in ``group`` (the default group when None), or None when
    torch.distributed is not initialized or the group has a single rank."""
    dist = _dist()
    if dist is None:
        return None
    size = dist.get_world_size(group)
    if size <= 1:
        return None
    return dist.get_rank(group), size


def rank(group=None):
    """This process's rank in ``group``, or None outside a process group of several ranks."""
    where = world(group)
    return where[0] if where else None


def rank_prefix(group=None):
    """``"[rank R/W] "`` for the lines of a rank-aware report, or None in a single process."""
    where = world(group)
    return None if where is None else f"[rank {where[0]}/{where[1]}] "


def with_prefix(text, prefix):
    """``text`` with ``prefix`` in front of every line (unchanged when ``prefix`` is None)."""
    if not prefix:
        return text
    return "\n".join(prefix + line for line in text.split("\n"))


# -- all ranks stop together -------------------------------------------------------------------


class OverflowOnRanks(ValueError):
    """Raised on every rank once the ranks have agreed that some of them detected a nan/inf."""

    def __init__(self, ranks, world_size=None):
        self.ranks = list(ranks)
        self.world_size = world_size
        super().__init__(stop_message(self.ranks))


def stop_message(ranks):
    """The reference's error message, naming the rank(s) that detected."""
    names = ", ".join(str(rank) for rank in ranks)
    return (f"DebugUnderflowOverflow: inf/nan detected on rank(s) {names}, aborting as there is no point "
            "running further. Please scroll up above this traceback to see the activation values prior "
            "to this event.")


@contextlib.contextmanager
def local_only():
    """Within this block, :func:`agree`, :meth:`Agreement.agree` and :func:`global_rows` on this
    thread run no collective: each rank decides alone and DTensor rows stay local. Wrap code that
    only some ranks run (generation or evaluation on rank 0) so that it cannot hang in a
    collective."""
    previous = getattr(_local, "off", False)
    _local.off = True
    try:
        yield
    finally:
        _local.off = previous


def is_local_only():
    return getattr(_local, "off", False)


def collective_device(group=None):
    """The device a collective on ``group`` takes its tensors on: the current CUDA device for
    NCCL, the CPU otherwise (gloo; a ``cpu:gloo,cuda:nccl`` group uses gloo for CPU tensors)."""
    dist = _dist()
    backend = str(dist.get_backend(group)).lower() if dist is not None else "gloo"
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
