"""The table kernels' path: ``compute`` (the table built in Python), ``scan`` and ``compute_scanned``
(the table built by the C++ loop), the pinned staging of the table's upload, and the launch of the
two table kernels."""

import collections
import contextlib
import itertools
import struct

import torch

from . import triton_common, triton_kernels
from .kinds import tensor_device
from .layout import NUM_COLUMNS, host_bytes
from .triton_common import (_ALIGNED_BIT, _CODE_MASK, _FORMAT_WORD, _PLAIN_TYPES, BLOCK_SIZE, BLOCKS_PER_CHUNK,
                            COMBINE_BLOCK, NUM_WARPS, _functorch_interpreter, _REGISTER_CAP, _triton_table,
                            format_groups)


def table_words(device: torch.device) -> dict:
    """{dtype: format word} of the dtypes whose table of plain tensors on ``device`` this backend
    builds in one C++ loop (``scan``); empty without the extension."""
    if _triton_table() is None:
        return {}
    # supports() looks only at the device, dtype and layout: an empty probe answers for all
    return {dtype: word for dtype, word in _FORMAT_WORD.items()
            if triton_common.supports(torch.empty(0, dtype=dtype, device=device))}



def _is_dense(tensor: torch.Tensor) -> bool:
    """True when the elements fill exactly numel slots from data_ptr() on, in any order."""
    dims = sorted((stride, size) for size, stride in zip(tensor.shape, tensor.stride()) if size != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _flat_source(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor whose memory holds exactly the elements of ``tensor``, flat from data_ptr()."""
    if tensor.is_neg():
        return tensor.detach().resolve_neg()  # the memory holds the values before a lazy negation
    if tensor.is_contiguous() or _is_dense(tensor):
        return tensor  # only its data_ptr() is used: no autograd involved
    # overlapping (expanded) or gapped (sliced) layouts: one device copy, no sync
    return tensor.detach().contiguous()


def _slot(source, word):
    """What a kernel is told of a flat tensor whose format word is ``word``: (address, numel, word
    with the alignment bit set where it starts on a 16-byte boundary, which allows vector loads).
    The Python side of table.cpp's pack_tensor, for where the extension is not loaded; ``_table``
    and ``_read`` describe tensors with it."""
    address = source.data_ptr()
    return address, source.numel(), word | _ALIGNED_BIT if address & 15 == 0 else word


def _table(sources, words, chunk):
    """The kernels' table for ``sources`` (flat tensors) whose format words are ``words``, as a
    list of 4 * T + 1 ints (the Python path; ``scan`` writes the same ints from C++):

        address[T], numel[T], format word[T] (alignment bit set), first chunk[T + 1]

    where first chunk is the prefix sum of the chunk counts (its last entry: all chunks). Also the
    bitmasks of the format codes present and of those of a tensor starting unaligned, and the
    number of chunks. The per-tensor cost is a few attribute reads, nothing per chunk.
    """
    slots = [_slot(s, w) for s, w in zip(sources, words)]
    addresses = [slot[0] for slot in slots]
    numels = [slot[1] for slot in slots]
    words = [slot[2] for slot in slots]
    formats = unaligned = 0
    for word in set(words):
        formats |= 1 << (word & _CODE_MASK)
        if not word & _ALIGNED_BIT:
            unaligned |= 1 << (word & _CODE_MASK)
    firsts = [0, *itertools.accumulate([-(-n // chunk) for n in numels])]
    return addresses + numels + words + firsts, formats, unaligned, firsts[-1]


class _PinnedStaging:
    """Pinned host buffers for the table uploads to one CUDA device, reused across calls.

    A buffer is rewritten only once the copy that last read it has run (its event has completed).
    Waiting for that event instead would stall the host whenever it runs ahead of the GPU, which
    is the normal state of an asynchronous training step, so a buffer still being read is left
    alone and another one is taken; buffers are added as needed, up to MAX_BUFFERS, beyond which
    the oldest copy is waited for. Oldest first: copies on one stream complete in order.
    """

    MAX_BUFFERS = 64
    MIN_INTS = 1024

    def __init__(self, pinned_empty=None, event=None):
        # the allocator and event factory are parameters only so that tests run without a GPU
        self._pinned_empty = pinned_empty or (lambda n: torch.empty(n, dtype=torch.int64, pin_memory=True))
        self._event = event or torch.cuda.Event
        self.buffers = collections.deque()  # [pinned int64 tensor, a view of its bytes, event], oldest use first

    def take(self, n):
        """A pinned buffer of at least ``n`` int64 that no pending copy reads, now the newest."""
        buffers = self.buffers
        entry = None
        if buffers and buffers[0][2].query():
            entry = buffers.popleft()
        elif len(buffers) >= self.MAX_BUFFERS:
            entry = buffers.popleft()
            entry[2].synchronize()
        if entry is None or entry[0].numel() < n:
            pinned = self._pinned_empty(max(n, self.MIN_INTS, entry[0].numel() * 2 if entry else 0))
            entry = [pinned, host_bytes(pinned), self._event()]
        buffers.append(entry)
        return entry

    def upload(self, table, device_buffer):
        """Copy ``table`` (ints) into the start of ``device_buffer`` (int64, on the current device),
        asynchronously on the current stream."""
        n = len(table)
        entry = self.take(n)
        struct.pack_into(f"{n}q", entry[1], 0, *table)
        self.send(entry, n, device_buffer)

    @staticmethod
    def send(entry, n, device_buffer):
        """Copy the first ``n`` int64 of ``entry``'s buffer (from ``take``, already written) into
        the start of ``device_buffer``, asynchronously on the current stream."""
        pinned, _, event = entry
        device_buffer[:n].copy_(pinned[:n], non_blocking=True)
        event.record()  # on the current stream: the copy above


_STAGING = {}  # CUDA device (as its tensors report it) -> _PinnedStaging


def _buffer(table, num_chunks, device):
    """A device int64 buffer holding ``table`` then room for ``num_chunks`` partial rows.

    From the caching allocator, on every call: it hands back the same memory call after call at
    no cost, and its reuse follows the order of the current stream (the stream may change between
    calls, where a buffer of our own would need an event or a sync)."""
    n = len(table)
    buffer = torch.empty(n + num_chunks * NUM_COLUMNS, dtype=torch.int64, device=device)
    if device.type == "cpu":  # the interpreter reads host memory: write the table in place
        struct.pack_into(f"{n}q", host_bytes(buffer), 0, *table)
    else:
        _staging(device).upload(table, buffer)
    return buffer


def _staging(device):
    staging = _STAGING.get(device)
    if staging is None:
        device = tensor_device(device)
        staging = _STAGING.get(device)
        if staging is None:
            staging = _STAGING[device] = _PinnedStaging()
    return staging


def compute(tensors, out=None, block_size=BLOCK_SIZE, blocks_per_chunk=BLOCKS_PER_CHUNK,
            num_warps=NUM_WARPS) -> torch.Tensor:
    """Statistics rows, ``[len(tensors), 8]`` int64 on the tensors' (common) device, no host sync;
    written into ``out`` when given (every column of every row is written).

    ``block_size``, ``blocks_per_chunk`` and ``num_warps`` override the launch shape (tests use
    small chunks; gpu_check's sweep tries others), read at each call.
    """
    reason = triton_common.unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"triton backend: {reason}")
    tensors = list(tensors)
    if not tensors:
        return torch.zeros((0, NUM_COLUMNS), dtype=torch.int64)
    device = tensors[0].device
    if _triton_table() is not None and triton_common.supports(tensors[0]):
        scanned = scan(tensors, _FORMAT_WORD, block_size * blocks_per_chunk)
        if scanned is not None:  # else some tensor is not plain: the Python path below decides
            return compute_scanned(scanned, out, block_size, blocks_per_chunk, num_warps)
    # supports() for every tensor, with the device type checked once (a few attribute reads per
    # tensor are most of the host cost of a call)
    words = [_FORMAT_WORD.get(t.dtype) for t in tensors]
    if not triton_common.supports(tensors[0]) or None in words or any(t.device != device or t.layout != torch.strided
                                                         for t in tensors):
        bad = next(t for t in tensors if t.device != device or not triton_common.supports(t))
        raise ValueError(f"triton backend cannot read a {bad.dtype} tensor on {bad.device} in this batch")

    sources = [_flat_source(t) for t in tensors]  # kept alive until the kernels are enqueued
    table, formats, unaligned, num_chunks = _table(sources, words, block_size * blocks_per_chunk)
    with on_device(device):  # the upload and the launches go to the tensors' device and stream
        buffer = _buffer(table, num_chunks, device)
        if out is None:
            out = torch.empty((len(tensors), NUM_COLUMNS), dtype=torch.int64, device=device)
        _launch(buffer, out, len(tensors), num_chunks, formats, unaligned, block_size, blocks_per_chunk, num_warps)
    return out


class Scanned:
    """The table of a call, built by ``_C.triton_table`` in a host int64 tensor (``scan``), with
    what the launch needs; ``flat`` ([(index, copy)] or None) keeps the copies of the tensors read
    through one alive until the kernels are enqueued."""

    __slots__ = ("tensors", "device", "table", "staged", "formats", "unaligned", "num_chunks",
                 "flat", "overlaps", "empties", "dtypes")


def scan(tensors, words, chunk, out_storage=None, list_empty=False):
    """The table of ``tensors`` (a list of plain strided tensors on the device of the first, whose
    dtypes are keys of ``words``, {dtype: format word}) in one C++ loop, or None when some tensor
    is not such a tensor (nothing was launched or changed: take the general path).

    ``out_storage``: (first, last) bytes of a rows buffer; ``overlaps`` lists the non-empty tensors
    that start inside it (their exact extents are the caller's to check). ``list_empty``: list the
    empty tensors in ``empties``. Needs ``overflow_fast._C`` (``_TRITON_TABLE`` not None).
    """
    if _functorch_interpreter() is not None:
        return None  # inside vmap/grad even the table's own tensor would be wrapped
    device = tensors[0].device
    n = 4 * len(tensors) + 1
    if device.type == "cuda":  # written where the upload copies from
        staged = _staging(device).take(n)
        table = staged[0]
    else:  # the interpreter (CPU tensors), or a device the loop will refuse
        staged = None
        table = torch.empty(n, dtype=torch.int64)
    first, last = out_storage if out_storage is not None else (0, 0)
    result = _triton_table()(tensors, _PLAIN_TYPES, device, words, chunk, table, _ALIGNED_BIT, first, last,
                           list_empty)
    if result is None:
        return None
    scanned = Scanned()
    scanned.tensors = tensors
    scanned.device = device
    scanned.table = table
    scanned.staged = staged
    (scanned.formats, scanned.unaligned, scanned.num_chunks, flat, scanned.overlaps, scanned.empties,
     scanned.dtypes) = result
    scanned.flat = None
    if flat:
        # Rare (a transposed slice, an expanded bias, a lazy negation): read through a flat copy,
        # whose address and alignment replace the tensor's (numel, word and chunks are the same).
        count = len(tensors)
        scanned.flat = []
        for index in flat:
            source = _flat_source(tensors[index])
            scanned.flat.append((index, source))
            address = source.data_ptr()
            table[index] = address
            if address & 15:
                table[2 * count + index] &= ~_ALIGNED_BIT
                scanned.unaligned |= 1 << (int(table[2 * count + index]) & _CODE_MASK)
            else:
                table[2 * count + index] |= _ALIGNED_BIT
    return scanned


def compute_scanned(scanned, out=None, block_size=BLOCK_SIZE, blocks_per_chunk=BLOCKS_PER_CHUNK, num_warps=NUM_WARPS):
    """``compute`` of the tensors of ``scanned`` (from ``scan`` with the same launch shape)."""
    device = scanned.device
    num_tensors = len(scanned.tensors)
    n = 4 * num_tensors + 1
    with on_device(device):  # the upload and the launches go to the tensors' device and stream
        buffer = torch.empty(n + scanned.num_chunks * NUM_COLUMNS, dtype=torch.int64, device=device)
        if scanned.staged is None:  # the interpreter reads host memory
            buffer[:n].copy_(scanned.table[:n])
        else:
            _PinnedStaging.send(scanned.staged, n, buffer)
        if out is None:
            out = torch.empty((num_tensors, NUM_COLUMNS), dtype=torch.int64, device=device)
        _launch(buffer, out, num_tensors, scanned.num_chunks, scanned.formats, scanned.unaligned,
                block_size, blocks_per_chunk, num_warps)
    return out


def on_device(device: torch.device):
    """Triton launches on the current CUDA device: make it the tensors' one (cuda:1 under
    ``device_map="auto"``), as ATen's device guards do."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _launch(buffer, out, num_tensors, num_chunks, formats, unaligned, block_size, blocks_per_chunk,
            num_warps=NUM_WARPS):
    """The table kernels' launches: the partials kernel once per group of at most MAX_FORMATS
    formats (each chunk's partial row is written by the launch holding its format), then the
    combine kernel."""
    if num_chunks:  # a batch of empty tensors has no chunks
        for group, any_unaligned in format_groups(formats, unaligned):
            triton_kernels._stats_partials_kernel[(num_chunks,)](
                buffer, num_tensors, FORMATS=group, ANY_UNALIGNED=any_unaligned,
                SEARCH_STEPS=(num_tensors - 1).bit_length(), BLOCK_SIZE=block_size,
                BLOCKS_PER_CHUNK=blocks_per_chunk, num_warps=num_warps, **_REGISTER_CAP,
            )
    triton_kernels._stats_combine_kernel[(num_tensors,)](buffer, out, num_tensors, BLOCK_SIZE=COMBINE_BLOCK,
                                                         num_warps=2)

