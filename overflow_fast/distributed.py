"""torch.distributed building blocks for the detector: which rank speaks, every rank stopping
together, and whole-tensor numbers for DTensor shards. Only torch.distributed is used (process
groups, DeviceMesh, DTensor placements); nothing here starts or owns a process group.

- :func:`world` / :func:`rank_prefix`: ``(rank, world_size)`` and the ``"[rank 1/2] "`` that a
  rank-aware report starts its lines with; both None in a single process (world size 1 or no
  process group), so single-process output stays byte-identical to the reference.
- :func:`agree`: one tiny collective (an all_reduce of ``world_size`` int32) after which every rank
  knows which ranks detected a nan/inf; :class:`OverflowOnRanks` is the ValueError every rank then
  raises, naming them.
- :func:`global_rows`: the rows of DTensor entries made the whole tensor's rows, combined across
  the mesh from each rank's local-shard rows with ONE all_gather per call (not one per tensor).

Hazards of a collective inside the detector (read before wiring or enabling it)
------------------------------------------------------------------------------
A collective returns only when every rank of its group has called it, in the same order as the
other collectives on that group. The detector calls :func:`agree` at points every rank reaches
the same number of times in SPMD training: the end of each forward of the top-level model (and
the end of each backward pass once backward checks exist). That breaks when ranks run different
numbers of forwards:

- generation, evaluation or logging run on rank 0 only (``if rank == 0: model.generate(...)``),
  uneven last batches with ``drop_last=False`` and ``Join``, early-exit loops, pipeline stages with
  different modules: the rank with the extra forward waits in ``agree()`` for partners that never
  come, and the others may instead meet it inside their next collective (DDP's gradient all-reduce),
  with mismatched sizes. Opt out around such code with ``with local_only(): ...`` (this thread's
  calls decide alone, no collective), or turn the synchronisation off for a detector (the detector's
  option); detection then works per rank as in the reference.
- A decision per module (``check="module"``) must not run a collective at the module: FSDP2 and
  tensor parallel issue their own collectives inside the forward (parameter all-gathers, TP
  all-reduces), and a rank that stopped at module k to agree would meet its peers' all-gather for
  module k+1 (hang or garbage). So a detecting rank prints its report at once but raises only after
  the agreement at the end of the top-level forward, with everybody else.
- A rank that dies (OOM, a crash) never reaches the collective: the others wait for the process
  group's timeout, ``init_process_group(timeout=...)`` (NCCL: 10 minutes by default; with
  ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``, the default, the watchdog then aborts the job; gloo: 30
  minutes, then a RuntimeError). :func:`agree` takes its own ``timeout=`` (an async work's
  ``wait(timeout)``) and raises a RuntimeError that says what probably happened. Torchrun's elastic
  agent also ends the other ranks when one exits with an error.
- The collective runs on the group's own device: the current CUDA device for NCCL (the flag goes
  up in a tiny host-to-device copy and comes back in one sync; the detector has already synced for
  its read), the CPU for gloo. A job may also pass a gloo side group (``dist.new_group(
  backend="gloo")``) to keep the agreement off the GPU streams.

DTensor placements in :func:`global_rows`
-----------------------------------------
``Shard(d)`` (and strided shards): the shards along that mesh dimension are disjoint pieces of
the tensor, merged exactly (:func:`overflow_fast.stats.layout.merge_rows`: min/max, counts added,
empty shards ignored). ``Replicate``: every rank holds the same values; this rank's own coordinate
is used. ``Partial``: each rank holds a term of an elementwise sum that no one has computed yet;
reading the sum would need a reduction of the whole tensor per tensor (``full_tensor()``), far too
costly in a hook. The terms are merged as if they were shards, so a nan/inf in any term is seen
by every rank (a sum with a nan term is nan; an inf term gives inf or nan), but abs-min/abs-max and
counts describe the terms, not their sum (finite terms whose sum overflows are not seen).
:func:`is_exact` tells whether a tensor's combined row is exact.
"""

import contextlib
import datetime
import threading

import torch

from .stats.kinds import is_zero3_released
from .stats.layout import NAN, NEGINF, NUM_COLUMNS, POSINF, is_integer_dtype, merge_rows_tensor

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
    """Within this block, :func:`agree` and :func:`global_rows` on this thread run no collective:
    each rank decides alone and DTensor rows stay local. Wrap code that only some ranks run
    (generation or evaluation on rank 0) so that it cannot hang in a collective."""
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


def agree(detected, group=None, timeout=None):
    """The sorted ranks of ``group`` (global ranks) that passed ``detected=True``.

    Every rank of the group must call it at the same points. One all_reduce of ``world_size`` int32
    and one host read. Without an initialized process group, in a group of one rank, or inside
    :func:`local_only`, no collective runs: ``[this rank]`` or ``[]``.
    ``timeout`` (seconds or a timedelta): how long to wait for the other ranks before raising a
    RuntimeError (otherwise the process group's own timeout applies).
    """
    detected = bool(detected)
    dist = _dist()
    where = world(group) if dist is not None else None
    if where is None or is_local_only():
        rank = dist.get_rank() if dist is not None else 0
        return [rank] if detected else []
    rank, size = where
    flags = torch.zeros(size, dtype=torch.int32, device=collective_device(group))
    if detected:
        flags[rank] = 1
    if timeout is None:
        dist.all_reduce(flags, group=group)
    else:
        if not isinstance(timeout, datetime.timedelta):
            timeout = datetime.timedelta(seconds=float(timeout))
        work = dist.all_reduce(flags, group=group, async_op=True)
        try:
            work.wait(timeout)
        except Exception as error:
            raise RuntimeError(
                f"overflow_fast: rank {rank} waited {timeout.total_seconds():g} s for the other ranks to "
                "agree on nan/inf detection; some rank runs forwards the others do not (generation or "
                "evaluation on one rank?), or died. Wrap such code in overflow_fast.distributed.local_only() "
                f"or turn the detector's synchronisation off. ({type(error).__name__}: {error})"
            ) from error
    ranks = [index for index, flag in enumerate(flags.tolist()) if flag]
    if group is not None:
        ranks = [dist.get_global_rank(group, index) for index in ranks]
    return ranks


# -- whole-tensor rows for DTensor shards ------------------------------------------------------


class ShardInfo:
    """What :func:`global_rows` needs to know of a DTensor (no reference to its data): its mesh,
    placements and dtype."""

    __slots__ = ("mesh", "placements", "dtype")

    def __init__(self, mesh, placements, dtype):
        self.mesh = mesh
        self.placements = tuple(placements)
        self.dtype = dtype

    def key(self):
        return (id(self.mesh), self.placements)


class Zero3Info(ShardInfo):
    """A DeepSpeed ZeRO-3 parameter released outside its module's forward: its partitions, one
    per rank of its process group, are disjoint pieces of it (merged like shards)."""

    __slots__ = ()

    def __init__(self, group, dtype):
        super().__init__(group, ("zero3",), dtype)

    def merge_ranks(self, dist, group):
        ranks = dist.get_process_group_ranks(self.mesh)  # global ranks of the partition group
        return ranks if group is None else [dist.get_group_rank(group, rank) for rank in ranks]


def shard_info(tensor):
    """A :class:`ShardInfo` for a DTensor or a released ZeRO-3 parameter, None for anything else."""
    if isinstance(tensor, torch.Tensor) and is_zero3_released(tensor):
        return Zero3Info(getattr(tensor, "ds_process_group", None) or _dist().group.WORLD, tensor.dtype)
    try:
        from torch.distributed.tensor import DTensor
    except Exception:
        return None
    if not isinstance(tensor, DTensor):
        return None
    return ShardInfo(tensor.device_mesh, tensor.placements, tensor.dtype)


def is_exact(info):
    """True when :func:`global_rows` gives the whole tensor's exact row (no Partial placement)."""
    if not isinstance(info, ShardInfo):
        info = shard_info(info)
    if info is None or isinstance(info, Zero3Info):
        return True
    return not any(placement.is_partial() for placement in info.placements)


def _merge_ranks(info, dist, group):
    """The group ranks whose local rows make up the whole tensor, for this rank: all mesh
    coordinates along Shard/Partial dims, this rank's own coordinate along Replicate dims.
    None when this rank is not in the mesh."""
    coordinate = info.mesh.get_coordinate()
    if coordinate is None:
        return None
    mesh = info.mesh.mesh  # global ranks, shaped like the mesh
    index = []
    for dim, placement in enumerate(info.placements):
        index.append(coordinate[dim] if placement.is_replicate() else slice(None))
    global_ranks = mesh[tuple(index)].reshape(-1).tolist()
    if group is None:
        return global_ranks
    return [dist.get_group_rank(group, rank) for rank in global_ranks]


_merge_ranks_cache = {}  # (mesh, placements, group, device) -> ranks tensor (or None)


def _cached_merge_ranks(info, dist, group, device):
    key = (info.mesh, info.placements, group, device)
    try:
        return _merge_ranks_cache[key]
    except (KeyError, TypeError):  # TypeError: an unhashable mesh, never cached
        pass
    ranks = info.merge_ranks(dist, group) if isinstance(info, Zero3Info) else _merge_ranks(info, dist, group)
    if ranks is not None:
        ranks = torch.tensor(ranks, dtype=torch.int64, device=device)
    try:
        if len(_merge_ranks_cache) > 256:
            _merge_ranks_cache.clear()
        _merge_ranks_cache[key] = ranks
    except TypeError:
        pass
    return ranks


def _all_gather_single(dist):
    # torch >= 2.13 names it all_gather_single; all_gather_into_tensor before (same semantics)
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def global_rows(rows, tensors, group=None, bad_shards=None):
    """Rows of whole tensors from rows of local shards, with one all_gather per call.

    ``rows``: the ``[N, 8]`` int64 rows (on any device) that ``tensor_stats`` computed for
    ``tensors`` (it reads a DTensor's local shard), or the same as a list of N host rows.
    ``tensors``: N entries, each a DTensor, a :class:`ShardInfo`, or anything else (None, a plain
    tensor) whose row is kept as it is. Returns rows of the same kind (a new tensor on ``rows``'
    device, or a new list); when no entry is a DTensor, ``rows`` itself and no collective.

    Every rank of ``group`` (default: the world) must call it at the same point with the same
    number of DTensor entries (true in SPMD training: every rank runs the same modules). Within
    :func:`local_only`, or without a process group, rows stay local.
    ``bad_shards``: a dict to fill with ``index -> [global ranks]`` whose shard of ``tensors[index]``
    holds a nan/inf (what a report names: which shard it comes from).
    """
    infos = [(index, entry if isinstance(entry, ShardInfo) else shard_info(entry))
             for index, entry in enumerate(tensors)]
    infos = [(index, info) for index, info in infos if info is not None]
    dist = _dist()
    if not infos or dist is None or is_local_only() or world(group) is None:
        return rows
    host = not isinstance(rows, torch.Tensor)
    values = torch.tensor(rows, dtype=torch.int64) if host else rows
    if values.shape[0] != len(tensors) or (values.numel() and values.shape[1] != NUM_COLUMNS):
        raise ValueError(f"global_rows: {len(tensors)} tensors but rows of shape {tuple(values.shape)}")
    positions = torch.tensor([index for index, _ in infos], dtype=torch.int64)
    device = collective_device(group)
    local = values.index_select(0, positions.to(values.device)).to(device)  # [K, 8]
    size = dist.get_world_size(group)
    gathered = torch.empty((size * local.shape[0], NUM_COLUMNS), dtype=torch.int64, device=device)
    _all_gather_single(dist)(gathered, local, group=group)  # one collective
    gathered = gathered.view(size, local.shape[0], NUM_COLUMNS)  # [W, K, 8]
    merged = local.clone()
    by_layout = {}  # tensors with the same mesh and placements merge the same ranks, in one go
    for slot, (_, info) in enumerate(infos):
        by_layout.setdefault(info.key(), (info, []))[1].append(slot)
    for info, slots in by_layout.values():
        ranks = _cached_merge_ranks(info, dist, group, device)
        if ranks is None:
            continue
        slot_index = torch.tensor(slots, dtype=torch.int64, device=device)
        shards = gathered.index_select(0, ranks)
        shards = shards.index_select(1, slot_index)  # [S, G, 8]
        integer = torch.tensor([is_integer_dtype(infos[slot][1].dtype) for slot in slots], device=device)
        merged.index_copy_(0, slot_index, merge_rows_tensor(shards, integer))
        if bad_shards is not None:
            bad = (shards[:, :, NAN] + shards[:, :, POSINF] + shards[:, :, NEGINF]) > 0  # [S, G]
            for column, rank_rows in enumerate(bad.t().tolist()):
                holders = [rank for rank, hit in zip(ranks.tolist(), rank_rows) if hit]
                if holders:
                    if group is not None:
                        holders = [dist.get_global_rank(group, rank) for rank in holders]
                    bad_shards[infos[slots[column]][0]] = holders
    if host:
        result = [list(row) for row in rows]
        for (index, _), row in zip(infos, merged.tolist()):
            result[index] = row
        return result
    result = values.clone()
    result.index_copy_(0, positions.to(values.device), merged.to(values.device))
    return result


__all__ = [
    "OverflowOnRanks", "ShardInfo", "agree", "collective_device", "global_rows", "is_exact", "is_local_only",
    "local_only", "rank_prefix", "shard_info", "stop_message", "with_prefix", "world",
]
