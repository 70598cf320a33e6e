"""Whole-tensor rows for DTensor and ZeRO-3 shards: ``global_rows`` combines each rank's local-shard
rows across the mesh with ONE all_gather per call (not one per tensor).

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

import torch

from .._compat import dtensor_api
from ..stats.kinds import PLAIN_TYPES, is_zero3_released
from ..stats.layout import NAN, NEGINF, NUM_COLUMNS, POSINF, is_integer_dtype, merge_rows_tensor
from .world import _dist, collective_device, is_local_only, world


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
    api = dtensor_api()
    if api is None or not isinstance(tensor, api.DTensor):
        return None
    return ShardInfo(tensor.device_mesh, tensor.placements, tensor.dtype)


def local_shard(tensor):
    """What this rank holds of a DTensor (its local tensor), any other tensor as it is."""
    if type(tensor) in PLAIN_TYPES:
        return tensor
    info = shard_info(tensor)
    return tensor._local_tensor if info is not None and not isinstance(info, Zero3Info) else tensor


def holds_sharded_parameters(module):
    """Whether ``module`` has a parameter of its own that is a DTensor sharded across ranks (not
    replicated on every mesh dimension): FSDP2's outside their forward, tensor parallelism's."""
    for parameter in module.parameters(recurse=False):
        info = shard_info(parameter)
        if info is not None and not isinstance(info, Zero3Info) and not all(
                placement.is_replicate() for placement in info.placements):
            return True
    return False


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

