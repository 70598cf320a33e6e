"""torch.distributed building blocks for the detector: which rank speaks, every rank stopping
together, and whole-tensor numbers for DTensor shards. Only torch.distributed is used (process
groups, DeviceMesh, DTensor placements); nothing here starts the job's process group.

- ``world``: :func:`world` / :func:`rank_prefix`: ``(rank, world_size)`` and the ``"[rank 1/2] "`` that a
  rank-aware report starts its lines with; both None in a single process (world size 1 or no
  process group), so single-process output stays byte-identical to the reference.
- ``agreement``: :class:`Agreement`, created on every rank, it owns a gloo process group of its own; each
  ``agree(detected)`` is one tiny collective on it (an all_reduce of ``world_size`` x 4 int64: each
  rank's sequence number, flag, start time and timeout) after which every rank knows which ranks
  detected a nan/inf, or every rank raises an :class:`AgreementError` (misaligned, timed out).
  :func:`agree` is the same through an Agreement it creates at its first call.
  :class:`OverflowOnRanks` is the ValueError every rank then raises, naming the ranks.
- ``collectives``: :func:`seen_as_writes`, in-place collectives (``all_reduce``, ``broadcast``, ...)
  bump the version counters of the tensors they write, as torch's in-place ops do, and what an async
  one writes is in flight until its work completes (:func:`in_flight`);
  :class:`NoCommunication`, a guard inside which every collective raises :class:`CommunicationRefused`
  before it sends anything (find_op's replays run inside one).
- ``shards``: :func:`global_rows`, the rows of DTensor entries made the whole tensor's rows, combined across
  the mesh from each rank's local-shard rows with ONE all_gather per call (not one per tensor).

The hazards of a collective inside the detector: ``agreement``'s docstring; DTensor placements:
``shards``'.
"""

from .agreement import Agreement, AgreementError, AgreementMisaligned, AgreementTimeout, agree
from .collectives import (
    IN_FLIGHT,
    CommunicationRefused,
    NoCommunication,
    active_guard,
    communicating,
    in_flight,
    seen_as_writes,
)
from .shards import ShardInfo, Zero3Info, global_rows, holds_sharded_parameters, is_exact, local_shard, shard_info
from .world import (
    OverflowOnRanks,
    collective_device,
    is_local_only,
    local_only,
    rank,
    rank_prefix,
    stop_message,
    with_prefix,
    world,
)

__all__ = [
    "IN_FLIGHT", "Agreement", "AgreementError", "AgreementMisaligned", "AgreementTimeout", "CommunicationRefused",
    "NoCommunication", "OverflowOnRanks", "ShardInfo", "Zero3Info", "active_guard", "agree", "collective_device",
    "communicating", "global_rows", "holds_sharded_parameters", "in_flight", "is_exact", "is_local_only", "local_only",
    "local_shard", "rank", "rank_prefix", "seen_as_writes", "shard_info", "stop_message", "with_prefix", "world",
]
