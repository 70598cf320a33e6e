"""The Triton backend: every statistic in one pass over each tensor, all tensors of a call at once.

A ``compute`` call makes two launches and one host-to-device upload per device, whatever the mix of
dtypes and alignments of its tensors, and no host sync:

1. ``_stats_partials_kernel``: one program per chunk (a fixed run of ``BLOCK_SIZE *
   BLOCKS_PER_CHUNK`` elements of one tensor), writing one partial row of 8 int64.
2. ``_stats_combine_kernel``: one program per tensor, folding that tensor's partial rows into its
   result row (layout.py). Two stages instead of atomics: deterministic, and no float atomics
   (Triton has them only for fp32/fp64).

The host describes the tensors in one int64 table that grows with the tensors, not with the chunks
(as grouped GEMMs do): per tensor its address, numel, format word and the prefix sum of chunk
counts (see ``_table``). A partials program finds its tensor by a binary search over the prefix
sums (``SEARCH_STEPS``, a constexpr: log2 of the tensor count rounded up to a power of two) and its
chunk within the tensor from the same sums. The same device buffer holds the partial rows after the
table: one allocation, one upload.

On a GPU a call's host work is its cost, and building the table was most of it: a few microseconds
of Python per tensor. When the extension ``overflow_fast._C`` is loaded, one C++ loop
(``_C.triton_table``, csrc/table.cpp; ``scan`` here) checks every tensor and writes the table
straight into the host tensor the upload reads; ``dispatch.tensor_stats`` calls it directly for
lists of plain tensors on one device, so that its own per-tensor checks run in the same loop. Its
per-tensor step (table.cpp's ``pack_tensor``) is also the list read's launcher's. Calls it does
not take (any tensor not plain, or no extension) build the same table in Python (``_table``, whose
per-tensor step ``_slot`` the Python list read shares).

The format word of a tensor carries its format code, its 16-byte alignment and the parameters of
its format. The partials kernel branches on the code at run time to a loop specialised for that
format (the load dtype and the classification constants are constexprs of each branch); a
constexpr bitmask ``FORMATS`` of the formats present in the launch gates the branches, so only
those are compiled (the set of formats of a model's forward is stable: the compile cache stays
small). Aligned tensors take a loop with 16-byte alignment hints (vector loads); the unaligned
variant is compiled only when the launch has an unaligned tensor (``ANY_UNALIGNED``). The kernel
takes the registers of its widest branch, so they are capped (``MAX_REGISTERS``) to keep the
occupancy of the bf16 loop when an int64 tensor shares the launch. The combine kernel reads the
format's parameters from the word as run-time scalars.

Floating values are classified on their raw bits, never converted: with the sign bit cleared,
the bits of a float order like its magnitude, so abs-min/abs-max are integer min/max, and NaN,
inf, zero and subnormal are integer compares against constants of the format. That is exact
for every format (fp8 included, without relying on Triton's fp8 conversions) and makes NaN
explicit: ``tl.min``/``tl.max`` would drop NaN on floats, while here a NaN is counted and the
result is poisoned from the count. The combine kernel turns the winning bits into float64 bits.

Integers use exact magnitudes: 8/16-bit values widen to int32, 32-bit values to int64, and 64-bit
magnitudes (|-2**63| = 2**63) are compared as unsigned by flipping the sign bit.

Element offsets, chunk indices and counts are int64 in both kernels, so tensors over 2**31 elements
do not wrap.

Complex tensors are left to the torch backend (``supports`` is False): their magnitude is
torch's hypot, whose rounding this kernel would have to reproduce bit for bit.

Tensors that are not contiguous but non-overlapping and dense are read flat over their memory
span (the statistics do not depend on element order); other strided tensors are copied with
``.contiguous()`` first (one extra device read and write of that tensor, still no sync).

On CUDA the table is written into a pinned host buffer reused across calls (``_PinnedStaging``)
and copied asynchronously into a device buffer from the caching allocator.

Under ``TRITON_INTERPRET=1`` (set before this module is imported) the kernels run on CPU
tensors through Triton's interpreter; that is how the tests run without a GPU. The table is then
a plain CPU tensor: no staging, no upload.

The backend's files, one concern each (this module is their face, re-exporting what callers use):
triton_common (Triton's import, the interpreter switch, launch shape, formats, the extension loaded
on first use), triton_kernels (the kernels), triton_table (``compute``, ``scan``, the pinned
staging), triton_launch (the list kernel's launch through the C++ launcher), triton_devices
(the list read's state on each device), triton_list (``read_into`` and its first use on a device:
the set-up and the self-check). A test or benchmark that
replaces a name replaces it in the module that owns it (and here too where the engine's dispatch
reads it).
"""

from .triton_common import (BLOCK_SIZE, BLOCKS_PER_CHUNK, COMBINE_BLOCK, MAX_FORMATS, MAX_REGISTERS, NUM_WARPS,
                            SUPPORTED_DTYPES, supports, unavailable_reason)
from .triton_devices import LIST, TABLE, device_report, forget_devices
from .triton_launch import (DIRECT, MAX_READ_LAUNCHES, MAX_SLOTS, SLOT_VARIANTS, STREAM_GROUPS, direct_mismatch,
                            launch_path, metadata_mismatch, ptx_parameters)
from .triton_list import check_device, launcher, read_into, self_check
from .triton_table import Scanned, compute, compute_scanned, on_device, scan, table_words

NAME = "triton"

__all__ = [
    "BLOCK_SIZE", "BLOCKS_PER_CHUNK", "COMBINE_BLOCK", "DIRECT", "MAX_FORMATS", "MAX_READ_LAUNCHES", "MAX_REGISTERS",
    "MAX_SLOTS",
    "LIST", "NAME", "NUM_WARPS", "SLOT_VARIANTS", "STREAM_GROUPS", "SUPPORTED_DTYPES", "Scanned", "TABLE",
    "check_device", "compute", "compute_scanned", "device_report", "direct_mismatch", "forget_devices",
    "launch_path", "launcher", "metadata_mismatch", "on_device", "ptx_parameters", "read_into", "scan",
    "self_check", "supports", "table_words", "unavailable_reason",
]
