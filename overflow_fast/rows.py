"""Where a frame's statistics rows come from: read now (one engine call, one host read), or
deferred into a preallocated device buffer that is read once for many frames (check="batch").
Either way a tensor already read in this forward, unchanged, is not read again (``reuse``)."""

import warnings

import torch

from . import distributed
from .stats import tensor_stats
from .stats.kinds import PLAIN_TYPES, is_zero3_released, short_reason
from .stats.layout import NUM_COLUMNS


def _shard_infos(tensors):
    """Per tensor, what combining the rows of a DTensor's shards (or a ZeRO-3 parameter's
    partitions) across ranks needs (None for other tensors), or None when there is no such tensor
    among them (the common case: one type check per tensor)."""
    if all(type(t) in PLAIN_TYPES and not is_zero3_released(t) for t in tensors):
        return None
    infos = [distributed.shard_info(t) for t in tensors]
    return infos if any(info is not None for info in infos) else None


class RowReader:
    """Reads frames' tensors through ``tensor_stats``; if the engine fails on a frame, it warns
    once and reads that frame's tensors one at a time with the torch backend, so that only a
    tensor nothing can read loses its line."""

    def __init__(self, backend, reuse):
        self.backend = backend
        self.reuse = reuse
        self._warned = False

    def stats(self, frame, tensors, positions, out=None):
        """The StatsBatch of ``tensors`` (at ``positions`` among the frame's tensors), or their
        host rows if the engine failed."""
        try:
            return tensor_stats(tensors, self.backend, out=out)
        except Exception as error:
            if not self._warned:
                self._warned = True
                warnings.warn(f"overflow_fast: tensor_stats failed ({type(error).__name__}: {error}); "
                              "the detector reads such frames one tensor at a time with the 'torch' "
                              "backend, with a host sync each", RuntimeWarning, stacklevel=5)
        rows = []
        for position, tensor in zip(positions, tensors):
            try:
                rows.append(tensor_stats([tensor], "torch").host_rows()[0])
            except Exception as error:
                rows.append([0] * NUM_COLUMNS)
                frame.mark_unreadable(position, short_reason(f"{type(error).__name__}: {error}"))
        return rows

    def read_now(self, frame, tensors):
        """Set ``frame.rows`` to host rows: one engine call and one host read for what is new."""
        sources, fresh = self.reuse.lookup(tensors)
        if fresh:
            result = self.stats(frame, [tensors[i] for i in fresh], fresh)
            engine_read = not isinstance(result, list)  # rows of a failed read are not reused
            rows = result.host_rows() if engine_read else result
            infos = _shard_infos([tensors[i] for i in fresh])
            if infos is not None:  # DTensor shards: the whole tensors' rows (one collective)
                bad = {}
                rows = distributed.global_rows(rows, infos, bad_shards=bad)
                for index, ranks in bad.items():
                    frame.bad_shards[fresh[index]] = ranks
            for position, row in zip(fresh, rows):
                sources[position] = row
                if engine_read:
                    self.reuse.remember(tensors[position], row)
        frame.rows = sources


class DeferredRows:
    """Calls waiting for their rows, which the kernels write into per-device buffers of
    ``capacity`` rows; ``read()`` brings every buffer to the host in one copy per device."""

    def __init__(self, reader, capacity):
        self.reader = reader
        self.capacity = capacity
        self.pending = []  # calls in hook order
        self._buffers = {}  # device -> [int64 buffer (capacity, 8), rows used, shard infos or None]

    def __len__(self):
        return len(self.pending)

    def must_read_before(self, tensors):
        """True when adding a call with these tensors would overflow the queue or a buffer."""
        if len(self.pending) >= self.capacity:
            return True  # calls without tensors take no rows, but their frames wait all the same
        if tensors and len(tensors) <= self.capacity:
            state = self._buffers.get(tensors[0].device)
            return state is not None and state[1] + len(tensors) > self.capacity
        return False

    def add(self, call, tensors):
        """Queue a call; ``frame.rows`` holds, per tensor, a host row or the (device, slot) where its
        row waits. Call ``must_read_before`` first."""
        frame = call.frame
        if len(tensors) > self.capacity:
            self.reader.read_now(frame, tensors)
        elif tensors:
            state = self._buffer(tensors[0].device)
            sources, fresh = self.reader.reuse.lookup(tensors)
            if fresh:
                # the kernels write straight into the next free rows of the buffer
                start = state[1]
                rows = state[0][start:start + len(fresh)]
                result = self.reader.stats(frame, [tensors[i] for i in fresh], fresh, out=rows)
                if isinstance(result, list):  # the engine failed, or tensors on several devices
                    for position, row in zip(fresh, result):
                        sources[position] = row
                else:
                    infos = _shard_infos([tensors[i] for i in fresh])
                    if infos is not None or state[2] is not None:
                        # which slots hold DTensor shards, combined across ranks when read
                        state[2] = (state[2] or [None] * start) + (infos or [None] * len(fresh))
                    state[1] += len(fresh)
                    for offset, position in enumerate(fresh):
                        sources[position] = (rows.device, start + offset)
                        self.reader.reuse.remember(tensors[position], sources[position])
            frame.rows = sources
        else:
            frame.rows = []
        self.pending.append(call)

    def read(self):
        """The pending calls, in order, with host rows; the queue and the buffers start empty again."""
        host = {}
        bad = {}  # (device, slot) -> ranks whose DTensor shard holds a nan/inf
        for device, state in self._buffers.items():
            if state[1]:
                rows = state[0][:state[1]]
                if state[2] is not None:  # one collective per read, not per tensor
                    shards = {}
                    rows = distributed.global_rows(rows, state[2], bad_shards=shards)
                    bad.update(((device, slot), ranks) for slot, ranks in shards.items())
                host[device] = rows.tolist()
        calls = self.pending
        self.discard()
        for call in calls:
            frame = call.frame
            if bad:
                for index, source in enumerate(frame.rows):
                    if not isinstance(source, list) and source in bad:
                        frame.bad_shards[index] = bad[source]
            frame.rows = [s if isinstance(s, list) else host[s[0]][s[1]] for s in frame.rows]
        return calls

    def discard(self):
        self.pending = []
        self.reader.reuse.clear()  # the buffer slots are reused from here on
        for state in self._buffers.values():
            state[1] = 0
            state[2] = None

    def _buffer(self, device):
        state = self._buffers.get(device)
        if state is None:
            buffer = torch.empty((self.capacity, NUM_COLUMNS), dtype=torch.int64, device=device)
            state = self._buffers[device] = [buffer, 0, None]
        return state
