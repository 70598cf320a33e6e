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
per-tensor step (table.cpp's ``pack_tensor``) is also the per-hook launcher's (below). Calls it does
not take (any tensor not plain, or no extension) build the same table in Python (``_table``, whose
per-tensor step ``_slot`` the Python per-hook read shares).

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
"""

import collections
import contextlib
import itertools
import os
import struct
import sys
import weakref

import torch

from .. import _compat
from . import cpu_backend
from .kinds import PLAIN_TYPES, is_zero3_released
from .layout import NUM_COLUMNS, host_bytes

NAME = "triton"

# The extension (the table in one C++ loop, csrc/table.cpp, and the C++ launcher) is loaded, and
# built if need be, on first use, never at import: _extension() and _triton_table() (None where it
# is unavailable: the Python _table then). Both are module globals once loaded, so a test or a
# benchmark may set them.
_UNLOADED = object()


def _load_extension(name):
    value = globals().get(name, _UNLOADED)
    if value is _UNLOADED:
        extension = cpu_backend.extension()
        globals().setdefault("_EXTENSION", extension)
        globals().setdefault("_TRITON_TABLE", extension.triton_table if extension is not None else None)
        value = globals()[name]
    return value


def _extension():
    return _load_extension("_EXTENSION")


def _triton_table():
    return _load_extension("_TRITON_TABLE")


def __getattr__(name):
    if name in ("_EXTENSION", "_TRITON_TABLE"):
        return _load_extension(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Exact types the C++ loop reads (subclasses take the Python path).
_PLAIN_TYPES = tuple(PLAIN_TYPES)
_functorch_interpreter = torch._C._functorch.peek_interpreter_stack  # None outside vmap/grad

try:
    import triton
    import triton.language as tl
except Exception as error:  # Triton is optional: the package must import without it
    triton = tl = None
    _IMPORT_ERROR = f"{type(error).__name__}: {error}"
else:
    _IMPORT_ERROR = None

# The interpreter is chosen when triton.jit decorates a kernel, i.e. at import of this module.
_INTERPRET = triton is not None and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if _INTERPRET:
    _compat.interpreter_indexes_one_element_arrays()

# Element kinds.
_FLOAT, _SIGNED, _UNSIGNED, _BOOL = 0, 1, 2, 3

# The special values of a float format, which decide how its bits are classified:
# _IEEE: +-inf at the all-ones exponent, NaN above; _FN (float8_e4m3fn): no inf, NaN is the
# all-ones magnitude; _FNUZ (float8_e4m3fnuz, float8_e5m2fnuz): no inf, no -0, the one NaN is the
# sign bit alone, and the exponent bias is one more than IEEE's; _E8M0 (float8_e8m0fnu): no sign,
# no zero, no subnormal, no inf: the byte is an exponent (2^(x-127)), all ones NaN.
_IEEE, _FN, _FNUZ, _E8M0 = 0, 1, 2, 3

# Launch shape. A chunk is BLOCK_SIZE * BLOCKS_PER_CHUNK elements of one tensor: large enough that
# the partials are a tiny fraction of the traffic, small enough that a 256 MB tensor gives
# thousands of programs. BLOCKS_PER_CHUNK <= 31 because the per-lane counters are 5-bit fields.
BLOCK_SIZE = 4096
BLOCKS_PER_CHUNK = 16
NUM_WARPS = 8
COMBINE_BLOCK = 128
# The partials kernel holds the loop of every format present, and the compiler gives it the
# registers of the widest one: on sm90, 91 per thread for bf16 alone but ~140 once an int64 tensor
# (input_ids) is in the launch, one program of 8 warps per SM instead of two for the bf16 loop that
# moves most of the bytes. 128 keeps two, without spills (cuobjdump of every format for sm90:
# LOCAL:0). A CUDA option (HIP's Triton rejects it; the interpreter ignores it).
MAX_REGISTERS = 128
_REGISTER_CAP = {"maxnreg": MAX_REGISTERS} if getattr(torch.version, "hip", None) is None else {}

# The formats the kernels read, in the order of their codes; ``_stats_partials_kernel`` has one
# branch per code, in the same order. (dtype name, kind, exponent bits, mantissa bits, specials)
_FORMATS = (
    ("float64", _FLOAT, 11, 52, _IEEE),
    ("float32", _FLOAT, 8, 23, _IEEE),
    ("float16", _FLOAT, 5, 10, _IEEE),
    ("bfloat16", _FLOAT, 8, 7, _IEEE),
    ("float8_e4m3fn", _FLOAT, 4, 3, _FN),  # no inf; NaN is S.1111.111
    ("float8_e5m2", _FLOAT, 5, 2, _IEEE),
    ("uint8", _UNSIGNED, 0, 0, _IEEE),
    ("int8", _SIGNED, 0, 0, _IEEE),
    ("int16", _SIGNED, 0, 0, _IEEE),
    ("int32", _SIGNED, 0, 0, _IEEE),
    ("int64", _SIGNED, 0, 0, _IEEE),
    ("bool", _BOOL, 0, 0, _IEEE),  # torch stores bool as one byte holding 0 or 1
    ("uint16", _UNSIGNED, 0, 0, _IEEE),  # uint16/32/64: when this torch has them
    ("uint32", _UNSIGNED, 0, 0, _IEEE),
    ("uint64", _UNSIGNED, 0, 0, _IEEE),
    ("float8_e4m3fnuz", _FLOAT, 4, 3, _FNUZ),  # NaN is 0x80
    ("float8_e5m2fnuz", _FLOAT, 5, 2, _FNUZ),
    ("float8_e8m0fnu", _FLOAT, 8, 0, _E8M0),  # NaN is 0xFF
)

# The format word of a tensor (int64): bits 0-4 the format code, bit 5 set when the data starts on
# a 16-byte boundary, then the format's parameters for the combine kernel: bits 6-7 kind, bit 8
# flip (64-bit integers: unsigned order through a sign-bit flip), bits 9-10 specials, bits 11-14
# exponent bits, bits 15-20 mantissa bits. The C++ table (table.cpp) takes the code as the bits
# below _ALIGNED_BIT.
_ALIGNED_BIT = 1 << 5
_CODE_MASK = _ALIGNED_BIT - 1


def _format_word(code, dtype, kind, exp_bits, mant_bits, specials):
    flip = kind != _FLOAT and dtype.itemsize == 8
    return code | kind << 6 | flip << 8 | specials << 9 | exp_bits << 11 | mant_bits << 15


assert len(_FORMATS) <= _CODE_MASK + 1
_FORMAT_WORD = {}  # dtype -> its format word, alignment bit clear
for _code, (_name, _kind, _exp, _mant, _specials) in enumerate(_FORMATS):
    if hasattr(torch, _name):
        _dtype = getattr(torch, _name)
        _FORMAT_WORD[_dtype] = _format_word(_code, _dtype, _kind, _exp, _mant, _specials)

# The dtypes the kernels read (as the other backends' SUPPORTED_DTYPES).
SUPPORTED_DTYPES = frozenset(_FORMAT_WORD) if triton is not None else frozenset()


def unavailable_reason():
    if triton is None:
        return f"triton is not importable ({_IMPORT_ERROR})"
    if _INTERPRET or torch.cuda.is_available():
        return None
    return "no CUDA device, and TRITON_INTERPRET=1 was not set before overflow_fast loaded the backend"


def table_words(device: torch.device) -> dict:
    """{dtype: format word} of the dtypes whose table of plain tensors on ``device`` this backend
    builds in one C++ loop (``scan``); empty without the extension."""
    if _triton_table() is None:
        return {}
    # supports() looks only at the device, dtype and layout: an empty probe answers for all
    return {dtype: word for dtype, word in _FORMAT_WORD.items() if supports(torch.empty(0, dtype=dtype, device=device))}


def supports(tensor: torch.Tensor) -> bool:
    # The interpreter reads the pointer table as host addresses, so it takes CPU tensors only;
    # compiled kernels take CUDA tensors only.
    device_ok = tensor.device.type == ("cpu" if _INTERPRET else "cuda")
    return device_ok and tensor.dtype in SUPPORTED_DTYPES and tensor.layout == torch.strided


if triton is not None:

    @triton.jit
    def _classify(x, KIND: tl.constexpr, EXP_BITS: tl.constexpr, MANT_BITS: tl.constexpr,
                  SPECIALS: tl.constexpr, KEY_DTYPE: tl.constexpr, FLIP: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr):
        """Per element: the magnitude key (ordered like |x|) and one count in a 5-bit class field."""
        if KIND == 0:
            ABS_MASK: tl.constexpr = (1 << (EXP_BITS + MANT_BITS)) - 1
            INF_BITS: tl.constexpr = ((1 << EXP_BITS) - 1) << MANT_BITS
            MIN_NORMAL_BITS: tl.constexpr = 1 << MANT_BITS
            bits = x.to(KEY_DTYPE)  # sign-extends, so bits < 0 is the sign
            key = bits & ABS_MASK
            if SPECIALS == 0:  # IEEE
                is_inf = key == INF_BITS
                is_nan = key > INF_BITS
                cls = ((key != 0).to(tl.int32) + (key >= MIN_NORMAL_BITS).to(tl.int32)
                       + is_inf.to(tl.int32) + 2 * is_nan.to(tl.int32)
                       + 2 * (is_inf & (bits < 0)).to(tl.int32))
            elif SPECIALS == 1:
                # float8_e4m3fn: no infinities, the all-ones magnitude is NaN
                cls = ((key != 0).to(tl.int32) + (key >= MIN_NORMAL_BITS).to(tl.int32)
                       + 2 * (key == ABS_MASK).to(tl.int32))
            elif SPECIALS == 2:
                # fnuz: no infinities, no -0: the sign bit alone (magnitude 0) is the one NaN
                cls = ((key != 0).to(tl.int32) + (key >= MIN_NORMAL_BITS).to(tl.int32)
                       + 4 * (bits == -(1 << (EXP_BITS + MANT_BITS))).to(tl.int32))
            else:
                # float8_e8m0fnu: every value is normal (no sign: the key is the byte), all ones NaN
                cls = 2 + 2 * (key == ABS_MASK).to(tl.int32)
            counts = tl.full([BLOCK_SIZE], 1, tl.int32) << (5 * cls)
        else:
            if KIND == 3:
                key = (x != 0).to(KEY_DTYPE)
            elif FLIP:
                key = x.to(tl.int64, bitcast=True)
                if KIND == 1:
                    key = tl.where(key < 0, -key, key)  # -(-2**63) wraps to itself: its bits are 2**63
                key = key ^ (-(2**63))  # unsigned order as signed order
            else:
                key = x.to(KEY_DTYPE)  # widened before negation: exact |min|
                if KIND == 1:
                    key = tl.where(key < 0, -key, key)
            if FLIP:
                nonzero = key != -(2**63)
            else:
                nonzero = key != 0
            counts = nonzero.to(tl.int32) << 5
        return key, counts

    @triton.jit
    def _chunk_partial(X, start, end, KIND: tl.constexpr, EXP_BITS: tl.constexpr,
                       MANT_BITS: tl.constexpr, SPECIALS: tl.constexpr, KEY_DTYPE: tl.constexpr,
                       FLIP: tl.constexpr, BLOCK_SIZE: tl.constexpr):
        """The partial of elements [start, end) of the tensor at ``X``: (key min, key max, nan,
        +inf, -inf, zero, subnormal), int64 scalars; the keys order like magnitudes (see
        ``_classify``), 64-bit integers' with the sign bit flipped.

        The alignment hints of ``X`` and ``start`` are the caller's: ``tl.multiple_of`` marks the
        op that defines a value, so it has no effect on a function's parameter."""
        if KIND == 0:
            KEY_MAX: tl.constexpr = (1 << (EXP_BITS + MANT_BITS)) - 1
        elif FLIP:
            KEY_MAX: tl.constexpr = 2**63 - 1
        elif KEY_DTYPE == tl.int64:
            KEY_MAX: tl.constexpr = 2**62
        else:
            KEY_MAX: tl.constexpr = 2**31 - 1

        key_min = tl.full([BLOCK_SIZE], KEY_MAX, KEY_DTYPE)
        key_max = tl.full([BLOCK_SIZE], 0, KEY_DTYPE)
        if FLIP:
            key_max = tl.full([BLOCK_SIZE], -(2**63), KEY_DTYPE)
        # Per lane, six 5-bit counters packed in one int32 (fewer registers than six vectors), one
        # per class: 0 zero or padding (not read: zeros are the rest), 1 subnormal, 2 normal,
        # 3 +inf, 4 NaN, 5 -inf. Integers use field 1 only: nonzero values.
        packed = tl.zeros([BLOCK_SIZE], tl.int32)

        # Full blocks load without a mask: with the caller's alignment hints, Triton emits 16-byte
        # vector loads (a masked load whose bound is only known at run time stays scalar).
        n_full = (end - start) // BLOCK_SIZE
        for i in range(n_full):
            offsets = start + i * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
            x = tl.load(X + offsets)
            key, counts = _classify(x, KIND, EXP_BITS, MANT_BITS, SPECIALS, KEY_DTYPE, FLIP, BLOCK_SIZE)
            key_min = tl.minimum(key_min, key)
            key_max = tl.maximum(key_max, key)
            packed += counts
        # The tensor's last chunk may end inside a block: one masked block.
        if start + n_full * BLOCK_SIZE < end:
            offsets = start + n_full * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
            mask = offsets < end
            # padding lanes read 0: a key below every max, counted in the unused zero field (not
            # by their class: 0 is a normal value of e8m0fnu)
            x = tl.load(X + offsets, mask=mask, other=0)
            key, counts = _classify(x, KIND, EXP_BITS, MANT_BITS, SPECIALS, KEY_DTYPE, FLIP, BLOCK_SIZE)
            key_min = tl.minimum(key_min, tl.where(mask, key, KEY_MAX))
            key_max = tl.maximum(key_max, key)
            packed += tl.where(mask, counts, 1)

        count = (end - start).to(tl.int64)
        subnormal = tl.sum((packed >> 5) & 31, axis=0).to(tl.int64)
        normal = tl.sum((packed >> 10) & 31, axis=0).to(tl.int64)
        posinf = tl.sum((packed >> 15) & 31, axis=0).to(tl.int64)
        nan = tl.sum((packed >> 20) & 31, axis=0).to(tl.int64)
        neginf = tl.sum((packed >> 25) & 31, axis=0).to(tl.int64)
        lo = tl.min(key_min, axis=0).to(tl.int64)
        hi = tl.max(key_max, axis=0).to(tl.int64)
        if KIND == 0:
            zero = count - (subnormal + normal + posinf + nan + neginf)
        else:
            zero = count - subnormal  # field 1 counted the nonzero values
            subnormal = normal  # 0
        return lo, hi, nan, posinf, neginf, zero, subnormal

    @triton.jit
    def _chunk_stats(X, start, end, out, KIND: tl.constexpr, EXP_BITS: tl.constexpr,
                     MANT_BITS: tl.constexpr, SPECIALS: tl.constexpr, KEY_DTYPE: tl.constexpr,
                     FLIP: tl.constexpr, BLOCK_SIZE: tl.constexpr):
        """The partial row (8 int64 at ``out``) of elements [start, end) of the tensor at ``X``:
        ``_chunk_partial``'s values, then the element count."""
        lo, hi, nan, posinf, neginf, zero, subnormal = _chunk_partial(
            X, start, end, KIND, EXP_BITS, MANT_BITS, SPECIALS, KEY_DTYPE, FLIP, BLOCK_SIZE)
        tl.store(out + 0, lo)
        tl.store(out + 1, hi)
        tl.store(out + 2, nan)
        tl.store(out + 3, posinf)
        tl.store(out + 4, neginf)
        tl.store(out + 5, zero)
        tl.store(out + 6, subnormal)
        tl.store(out + 7, (end - start).to(tl.int64))

    @triton.jit
    def _chunk_out(X, start, end, out, programs, numel, word, acc, MERGE: tl.constexpr, KIND: tl.constexpr,
                   EXP_BITS: tl.constexpr, MANT_BITS: tl.constexpr, SPECIALS: tl.constexpr,
                   KEY_DTYPE: tl.constexpr, FLIP: tl.constexpr, BLOCK_SIZE: tl.constexpr):
        """The chunk's partial: stored as a partial row at ``out`` (the table kernels), or with
        ``MERGE`` merged into its tensor's row (the per-hook kernel, ``_merge``)."""
        if MERGE:
            lo, hi, nan, posinf, neginf, zero, subnormal = _chunk_partial(
                X, start, end, KIND, EXP_BITS, MANT_BITS, SPECIALS, KEY_DTYPE, FLIP, BLOCK_SIZE)
            _merge(lo, hi, nan, posinf, neginf, zero, subnormal, programs, numel, word, out, acc)
        else:
            _chunk_stats(X, start, end, out, KIND, EXP_BITS, MANT_BITS, SPECIALS, KEY_DTYPE, FLIP, BLOCK_SIZE)

    @triton.jit
    def _format_branch(address, code, aligned, start, end, out, programs, numel, word, acc,
                       FORMATS: tl.constexpr, ANY_UNALIGNED: tl.constexpr, MERGE: tl.constexpr,
                       CODE: tl.constexpr, LOAD_DTYPE: tl.constexpr, KIND: tl.constexpr,
                       EXP_BITS: tl.constexpr, MANT_BITS: tl.constexpr, SPECIALS: tl.constexpr,
                       KEY_DTYPE: tl.constexpr, FLIP: tl.constexpr, BLOCK_SIZE: tl.constexpr):
        """The chunk's statistics when its tensor has format ``CODE``. Compiled only when the
        launch has a tensor of that format; floats load as same-width integers (their bits)."""
        if (FORMATS >> CODE) & 1:
            if code == CODE:
                # ANY_UNALIGNED False (a constexpr) ends the `and` at compile time: no scalar loop
                if ANY_UNALIGNED and not aligned:
                    X = address.to(tl.pointer_type(LOAD_DTYPE))
                    _chunk_out(X, start, end, out, programs, numel, word, acc, MERGE, KIND, EXP_BITS, MANT_BITS,
                               SPECIALS, KEY_DTYPE, FLIP, BLOCK_SIZE)
                else:
                    # The hint must stay in this branch: a value merged from both would lose it.
                    X = tl.multiple_of(address.to(tl.pointer_type(LOAD_DTYPE)), 16)
                    _chunk_out(X, start, end, out, programs, numel, word, acc, MERGE, KIND, EXP_BITS, MANT_BITS,
                               SPECIALS, KEY_DTYPE, FLIP, BLOCK_SIZE)

    @triton.jit
    def _stats_partials_kernel(
        Table_ptr,  # int64: the table (see _table), then one partial row of 8 per chunk
        num_tensors,
        FORMATS: tl.constexpr,  # bit c set: a tensor of format code c is in this launch
        ANY_UNALIGNED: tl.constexpr,  # a tensor of this launch starts off a 16-byte boundary
        SEARCH_STEPS: tl.constexpr,  # 2**SEARCH_STEPS >= num_tensors
        BLOCK_SIZE: tl.constexpr,
        BLOCKS_PER_CHUNK: tl.constexpr,
    ):
        tl.static_assert(BLOCKS_PER_CHUNK <= 31)
        # int64 from the start: element offsets of tensors over 2**31 elements must not wrap.
        chunk = tl.program_id(0).to(tl.int64)
        T = num_tensors.to(tl.int64)
        Ptrs = Table_ptr
        Numels = Table_ptr + T
        Words = Table_ptr + 2 * T
        FirstChunk = Table_ptr + 3 * T  # T + 1 entries: the prefix sums of the chunk counts
        Partials = Table_ptr + 4 * T + 1

        # The chunk's tensor: the last t with FirstChunk[t] <= chunk (an empty tensor shares its
        # FirstChunk with the next one, so the last is the one that has chunks). Invariant: the
        # answer is in [tensor, tensor + 2**(SEARCH_STEPS - step)); FirstChunk[T] (all chunks)
        # > chunk stops a probe past the end.
        tensor = chunk * 0
        for step in tl.static_range(SEARCH_STEPS):
            probe = tl.minimum(tensor + (1 << (SEARCH_STEPS - 1 - step)), T)
            tensor = tl.where(tl.load(FirstChunk + probe) <= chunk, probe, tensor)

        start = (chunk - tl.load(FirstChunk + tensor)) * (BLOCK_SIZE * BLOCKS_PER_CHUNK)
        start = tl.multiple_of(start, BLOCK_SIZE)  # for the vector loads
        end = tl.minimum(start + BLOCK_SIZE * BLOCKS_PER_CHUNK, tl.load(Numels + tensor))
        word = tl.load(Words + tensor)
        code = word & 31  # _CODE_MASK
        aligned = (word & 32) != 0  # _ALIGNED_BIT
        address = tl.load(Ptrs + tensor)
        out = Partials + chunk * 8
        _every_format(address, code, aligned, start, end, out, 0, 0, 0, 0, FORMATS, ANY_UNALIGNED, False,
                      BLOCK_SIZE)

    @triton.jit
    def _every_format(address, code, aligned, start, end, out, programs, numel, word, acc, FORMATS: tl.constexpr,
                      ANY_UNALIGNED: tl.constexpr, MERGE: tl.constexpr, BLOCK_SIZE: tl.constexpr):
        """The chunk's statistics, by the branch of its format code (``_chunk_out``)."""
        # One branch per format code (_FORMATS, same order): code, load dtype (floats as their
        # bits), kind, exponent bits, mantissa bits, specials, key dtype (int64 where int32 cannot
        # hold the magnitude), flip (64-bit integers: unsigned order through a sign-bit flip).
        _format_branch(address, code, aligned, start, end, out, programs, numel, word, acc, FORMATS,
                       ANY_UNALIGNED, MERGE,
                       0, tl.int64, 0, 11, 52, 0, tl.int64, False, BLOCK_SIZE)  # float64
        _format_branch(address, code, aligned, start, end, out, programs, numel, word, acc, FORMATS,
                       ANY_UNALIGNED, MERGE,
                       1, tl.int32, 0, 8, 23, 0, tl.int32, False, BLOCK_SIZE)  # float32
        _format_branch(address, code, aligned, start, end, out, programs, numel, word, acc, FORMATS,
                       ANY_UNALIGNED, MERGE,
                       2, tl.int16, 0, 5, 10, 0, tl.int32, False, BLOCK_SIZE)  # float16
        _format_branch(address, code, aligned, start, end, out, programs, numel, word, acc, FORMATS,
                       ANY_UNALIGNED, MERGE,
                       3, tl.int16, 0, 8, 7, 0, tl.int32, False, BLOCK_SIZE)  # bfloat16
        _format_branch(address, code, aligned, start, end, out, programs, numel, word, acc, FORMATS,
                       ANY_UNALIGNED, MERGE,
                       4, tl.int8, 0, 4, 3, 1, tl.int32, False, BLOCK_SIZE)  # float8_e4m3fn
        _format_branch(address, code, aligned, start, end, out, programs, numel, word, acc, FORMATS,
                       ANY_UNALIGNED, MERGE,
                       5, tl.int8, 0, 5, 2, 0, tl.int32, False, BLOCK_SIZE)  # float8_e5m2
        _format_branch(address, code, aligned, start, end, out, programs, numel, word, acc, FORMATS,
                       ANY_UNALIGNED, MERGE,
                       6, tl.uint8, 2, 0, 0, 0, tl.int32, False, BLOCK_SIZE)  # uint8
        _format_branch(address, code, aligned, start, end, out, programs, numel, word, acc, FORMATS,
                       ANY_UNALIGNED, MERGE,
                       7, tl.int8, 1, 0, 0, 0, tl.int32, False, BLOCK_SIZE)  # int8
        _format_branch(address, code, aligned, start, end, out, programs, numel, word, acc, FORMATS,
                       ANY_UNALIGNED, MERGE,
                       8, tl.int16, 1, 0, 0, 0, tl.int32, False, BLOCK_SIZE)  # int16
        _format_branch(address, code, aligned, start, end, out, programs, numel, word, acc, FORMATS,
                       ANY_UNALIGNED, MERGE,
                       9, tl.int32, 1, 0, 0, 0, tl.int64, False, BLOCK_SIZE)  # int32
        _format_branch(address, code, aligned, start, end, out, programs, numel, word, acc, FORMATS,
                       ANY_UNALIGNED, MERGE,
                       10, tl.int64, 1, 0, 0, 0, tl.int64, True, BLOCK_SIZE)  # int64
        _format_branch(address, code, aligned, start, end, out, programs, numel, word, acc, FORMATS,
                       ANY_UNALIGNED, MERGE,
                       11, tl.uint8, 3, 0, 0, 0, tl.int32, False, BLOCK_SIZE)  # bool
        _format_branch(address, code, aligned, start, end, out, programs, numel, word, acc, FORMATS,
                       ANY_UNALIGNED, MERGE,
                       12, tl.uint16, 2, 0, 0, 0, tl.int32, False, BLOCK_SIZE)  # uint16
        _format_branch(address, code, aligned, start, end, out, programs, numel, word, acc, FORMATS,
                       ANY_UNALIGNED, MERGE,
                       13, tl.uint32, 2, 0, 0, 0, tl.int64, False, BLOCK_SIZE)  # uint32
        _format_branch(address, code, aligned, start, end, out, programs, numel, word, acc, FORMATS,
                       ANY_UNALIGNED, MERGE,
                       14, tl.uint64, 2, 0, 0, 0, tl.int64, True, BLOCK_SIZE)  # uint64
        _format_branch(address, code, aligned, start, end, out, programs, numel, word, acc, FORMATS,
                       ANY_UNALIGNED, MERGE,
                       15, tl.int8, 0, 4, 3, 2, tl.int32, False, BLOCK_SIZE)  # float8_e4m3fnuz
        _format_branch(address, code, aligned, start, end, out, programs, numel, word, acc, FORMATS,
                       ANY_UNALIGNED, MERGE,
                       16, tl.int8, 0, 5, 2, 2, tl.int32, False, BLOCK_SIZE)  # float8_e5m2fnuz
        _format_branch(address, code, aligned, start, end, out, programs, numel, word, acc, FORMATS,
                       ANY_UNALIGNED, MERGE,
                       17, tl.uint8, 0, 8, 0, 3, tl.int32, False, BLOCK_SIZE)  # float8_e8m0fnu

    @triton.jit
    def _stats_combine_kernel(
        Table_ptr,  # int64: the table, then the partial rows (as in the partials kernel)
        Out_ptr,  # int64[T, 8]
        num_tensors,
        BLOCK_SIZE: tl.constexpr,
    ):
        tensor = tl.program_id(0).to(tl.int64)
        T = num_tensors.to(tl.int64)
        numel = tl.load(Table_ptr + T + tensor)
        word = tl.load(Table_ptr + 2 * T + tensor)
        first = tl.load(Table_ptr + 3 * T + tensor)
        num_chunks = tl.load(Table_ptr + 3 * T + tensor + 1) - first
        Partials = Table_ptr + 4 * T + 1

        key_min = tl.full([BLOCK_SIZE], 2**63 - 1, tl.int64)
        key_max = tl.full([BLOCK_SIZE], -(2**63), tl.int64)
        nan = tl.zeros([BLOCK_SIZE], tl.int64)
        posinf = tl.zeros([BLOCK_SIZE], tl.int64)
        neginf = tl.zeros([BLOCK_SIZE], tl.int64)
        zero = tl.zeros([BLOCK_SIZE], tl.int64)
        subnormal = tl.zeros([BLOCK_SIZE], tl.int64)
        for c in range(0, num_chunks, BLOCK_SIZE):
            index = c + tl.arange(0, BLOCK_SIZE)
            mask = index < num_chunks
            p = Partials + (first + index) * 8
            key_min = tl.minimum(key_min, tl.load(p + 0, mask=mask, other=2**63 - 1))
            key_max = tl.maximum(key_max, tl.load(p + 1, mask=mask, other=-(2**63)))
            nan += tl.load(p + 2, mask=mask, other=0)
            posinf += tl.load(p + 3, mask=mask, other=0)
            neginf += tl.load(p + 4, mask=mask, other=0)
            zero += tl.load(p + 5, mask=mask, other=0)
            subnormal += tl.load(p + 6, mask=mask, other=0)
        _final_row(Out_ptr + tensor * 8, tl.min(key_min, axis=0), tl.max(key_max, axis=0), tl.sum(nan, axis=0),
                   tl.sum(posinf, axis=0), tl.sum(neginf, axis=0), tl.sum(zero, axis=0), tl.sum(subnormal, axis=0),
                   word, numel)

    @triton.jit
    def _final_row(out, lo, hi, nan_count, posinf, neginf, zero, subnormal, word, numel):
        """Store at ``out`` the row (layout.py) of a tensor from its merged partial: the winning
        keys made float64 bits (or integer magnitudes), NaN poisoning both; an empty tensor's row
        is zeros. ``word``: its format word (see _format_word), read as run-time scalars."""

        # the format's parameters, run-time scalars of the word (see _format_word)
        kind = (word >> 6) & 3
        flip = (word >> 8) & 1
        specials = (word >> 9) & 3
        exp_bits = (word >> 11) & 15
        mant_bits = (word >> 15) & 63
        if kind == 0:
            # magnitude bits of the format -> float64 bits
            if mant_bits != 52:
                lo = _float_bits_to_f64(lo, exp_bits, mant_bits, specials)
                hi = _float_bits_to_f64(hi, exp_bits, mant_bits, specials)
            # any NaN poisons both, as torch's abs().min()/max() do
            lo = tl.where(nan_count > 0, 0x7FF8000000000000, lo)
            hi = tl.where(nan_count > 0, 0x7FF8000000000000, hi)
        elif kind == 3:
            lo = tl.where(lo != 0, 0x3FF0000000000000, 0)  # 1.0 : 0.0
            hi = tl.where(hi != 0, 0x3FF0000000000000, 0)
        elif flip != 0:
            lo = lo ^ (-(2**63))
            hi = hi ^ (-(2**63))

        # an empty tensor has no elements and a row of zeros
        empty = numel == 0
        tl.store(out + 0, tl.where(empty, 0, lo))
        tl.store(out + 1, tl.where(empty, 0, hi))
        tl.store(out + 2, nan_count)
        tl.store(out + 3, posinf)
        tl.store(out + 4, neginf)
        tl.store(out + 5, zero)
        tl.store(out + 6, subnormal)
        tl.store(out + 7, numel)

    @triton.jit
    def _float_bits_to_f64(a, exp_bits, mant_bits, specials):
        """Float64 bits of the non-negative, non-NaN value whose bits (sign cleared) in a narrower
        format are ``a``; the format's parameters are run-time int64 scalars."""
        bias = (1 << (exp_bits - 1)) - 1 + (specials == 2).to(tl.int64)  # fnuz: one more
        exponent = a >> mant_bits
        mantissa = a & ((1 << mant_bits) - 1)
        normal = ((exponent + (1023 - bias)) << 52) | (mantissa << (52 - mant_bits))
        # subnormal: mantissa * 2**(1 - bias - mant_bits); the int -> float64 conversion is exact
        # and the scaling by a power of two is an exponent subtraction, so no rounding anywhere
        scaled = mantissa.to(tl.float64).to(tl.int64, bitcast=True) - ((bias + mant_bits - 1) << 52)
        # e8m0fnu has no zero and no subnormal: its exponent 0 is 2**-127
        result = tl.where((exponent == 0) & (specials != 3), tl.where(mantissa == 0, 0, scaled), normal)
        is_inf = (specials == 0) & (a == ((1 << exp_bits) - 1) << mant_bits)
        return tl.where(is_inf, 0x7FF0000000000000, result)


    @triton.jit
    def _merge(lo, hi, nan, posinf, neginf, zero, subnormal, programs, numel, word, out, acc):
        """The per-hook kernel's end of a program: its chunk's partial (``_chunk_partial``) made
        its tensor's row at ``out``. A tensor read by one program writes its row at once. Else
        every program merges its partial into the tensor's accumulator row ``acc`` with integer
        atomics (min/max of the keys, which order like magnitudes; adds of the counts), then
        counts itself done in ``acc[7]``; the last one takes the merged values, puts the
        accumulator back at its identity (keys at the ends of int64, counts and counter 0) for
        the next launch on this stream, and writes the row."""
        if programs == 1:
            _final_row(out, lo, hi, nan, posinf, neginf, zero, subnormal, word, numel)
        else:
            Acc = acc.to(tl.pointer_type(tl.int64))
            tl.atomic_min(Acc + 0, lo, sem="relaxed")
            tl.atomic_max(Acc + 1, hi, sem="relaxed")
            tl.atomic_add(Acc + 2, nan, sem="relaxed")
            tl.atomic_add(Acc + 3, posinf, sem="relaxed")
            tl.atomic_add(Acc + 4, neginf, sem="relaxed")
            tl.atomic_add(Acc + 5, zero, sem="relaxed")
            tl.atomic_add(Acc + 6, subnormal, sem="relaxed")
            # release: this program's merges are visible to whoever sees its count; acquire: the
            # last one sees every other program's merges
            done = tl.atomic_add(Acc + 7, 1, sem="acq_rel")
            if done == programs - 1:
                lo = tl.atomic_xchg(Acc + 0, 2**63 - 1, sem="relaxed")
                hi = tl.atomic_xchg(Acc + 1, -(2**63), sem="relaxed")
                nan = tl.atomic_xchg(Acc + 2, 0, sem="relaxed")
                posinf = tl.atomic_xchg(Acc + 3, 0, sem="relaxed")
                neginf = tl.atomic_xchg(Acc + 4, 0, sem="relaxed")
                zero = tl.atomic_xchg(Acc + 5, 0, sem="relaxed")
                subnormal = tl.atomic_xchg(Acc + 6, 0, sem="relaxed")
                tl.atomic_xchg(Acc + 7, 0, sem="relaxed")
                _final_row(out, lo, hi, nan, posinf, neginf, zero, subnormal, word, numel)

    @triton.jit
    def _pick(i, pid, first, address, numel, word, programs, start, slot, a, n, w, chunk):
        """Slot ``i`` (address ``a``, numel ``n``, format word ``w``), whose programs start at
        ``first``: where program ``pid`` is one of them, its tensor's values. Returns the first
        program of the next slot and the values picked so far."""
        n = n.to(tl.int64)
        # an empty tensor has one program too; an unused slot (numel -1) none
        count = tl.where(n < 0, 0, tl.maximum((n + chunk - 1) // chunk, 1))
        mine = (pid >= first) & (pid < first + count)
        address = tl.where(mine, a.to(tl.int64), address)
        numel = tl.where(mine, n, numel)
        word = tl.where(mine, w.to(tl.int64), word)
        programs = tl.where(mine, count, programs)
        start = tl.where(mine, (pid - first) * chunk, start)
        slot = tl.where(mine, i, slot)
        return first + count, address, numel, word, programs, start, slot

    @triton.jit(do_not_specialize=["Out", "Accumulators"] + [f"{c}{i}" for i in range(8) for c in "anw"])
    def _read_kernel(
        Out: tl.int64,  # address of the first of K destination rows (8 int64 each, consecutive)
        Accumulators: tl.int64,  # address of this stream's K accumulator rows, at their identity
        a0: tl.int64, n0: tl.int64, w0: tl.int64,  # slot 0
        a1: tl.int64, n1: tl.int64, w1: tl.int64,  # slot 1
        a2: tl.int64, n2: tl.int64, w2: tl.int64,  # slot 2
        a3: tl.int64, n3: tl.int64, w3: tl.int64,  # slot 3
        a4: tl.int64, n4: tl.int64, w4: tl.int64,  # slot 4
        a5: tl.int64, n5: tl.int64, w5: tl.int64,  # slot 5
        a6: tl.int64, n6: tl.int64, w6: tl.int64,  # slot 6
        a7: tl.int64, n7: tl.int64, w7: tl.int64,  # slot 7
        K: tl.constexpr,  # slots used (a variant: 1, 2, 4 or 8)
        FORMATS: tl.constexpr,  # bit c set: a tensor of format code c is in this launch
        ANY_UNALIGNED: tl.constexpr,  # a tensor of this launch starts off a 16-byte boundary
        BLOCK_SIZE: tl.constexpr,
        BLOCKS_PER_CHUNK: tl.constexpr,
    ):
        """The rows of K tensors in one launch, nothing uploaded: each tensor's address, element
        count and format word are scalar arguments. Program ``pid`` reads chunk ``pid - first``
        of the tensor whose programs it falls in (``_pick``, unrolled over the slots); ``_merge``
        makes the rows."""
        tl.static_assert(BLOCKS_PER_CHUNK <= 31)
        CHUNK: tl.constexpr = BLOCK_SIZE * BLOCKS_PER_CHUNK
        # int64 from the start: element offsets of tensors over 2**31 elements must not wrap.
        pid = tl.program_id(0).to(tl.int64)
        zero = pid * 0
        first, address, numel, word, programs, start, slot = _pick(
            0, pid, zero, zero, zero, zero, zero, zero, zero, a0, n0, w0, CHUNK)
        if K > 1:
            first, address, numel, word, programs, start, slot = _pick(
                1, pid, first, address, numel, word, programs, start, slot, a1, n1, w1, CHUNK)
        if K > 2:
            first, address, numel, word, programs, start, slot = _pick(
                2, pid, first, address, numel, word, programs, start, slot, a2, n2, w2, CHUNK)
        if K > 3:
            first, address, numel, word, programs, start, slot = _pick(
                3, pid, first, address, numel, word, programs, start, slot, a3, n3, w3, CHUNK)
        if K > 4:
            first, address, numel, word, programs, start, slot = _pick(
                4, pid, first, address, numel, word, programs, start, slot, a4, n4, w4, CHUNK)
        if K > 5:
            first, address, numel, word, programs, start, slot = _pick(
                5, pid, first, address, numel, word, programs, start, slot, a5, n5, w5, CHUNK)
        if K > 6:
            first, address, numel, word, programs, start, slot = _pick(
                6, pid, first, address, numel, word, programs, start, slot, a6, n6, w6, CHUNK)
        if K > 7:
            first, address, numel, word, programs, start, slot = _pick(
                7, pid, first, address, numel, word, programs, start, slot, a7, n7, w7, CHUNK)
        start = tl.multiple_of(start, BLOCK_SIZE)  # for the vector loads
        end = tl.minimum(start + CHUNK, numel)
        code = word & 31  # _CODE_MASK
        aligned = (word & 32) != 0  # _ALIGNED_BIT
        out = (Out.to(tl.int64) + slot * 64).to(tl.pointer_type(tl.int64))
        acc = Accumulators.to(tl.int64) + slot * 64
        _every_format(address, code, aligned, start, end, out, programs, numel, word, acc, FORMATS, ANY_UNALIGNED,
                      True, BLOCK_SIZE)

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
    FORMATS bitmask, whether a tensor is unaligned, and the number of chunks. The per-tensor cost
    is a few attribute reads, nothing per chunk.
    """
    slots = [_slot(s, w) for s, w in zip(sources, words)]
    addresses = [slot[0] for slot in slots]
    numels = [slot[1] for slot in slots]
    words = [slot[2] for slot in slots]
    formats = 0
    for word in set(words):
        formats |= 1 << (word & _CODE_MASK)
    any_unaligned = any(a & 15 for a in addresses)
    firsts = [0, *itertools.accumulate([-(-n // chunk) for n in numels])]
    return addresses + numels + words + firsts, formats, any_unaligned, firsts[-1]


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


_STAGING = {}  # CUDA device index -> _PinnedStaging


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
    staging = _STAGING.get(device.index)
    if staging is None:
        staging = _STAGING[device.index] = _PinnedStaging()
    return staging


def compute(tensors, out=None, block_size=None, blocks_per_chunk=None) -> torch.Tensor:
    """Statistics rows, ``[len(tensors), 8]`` int64 on the tensors' (common) device, no host sync;
    written into ``out`` when given (every column of every row is written).

    ``block_size`` and ``blocks_per_chunk`` override the launch shape (tests use small chunks).
    """
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"triton backend: {reason}")
    block_size = block_size or BLOCK_SIZE
    blocks_per_chunk = blocks_per_chunk or BLOCKS_PER_CHUNK
    tensors = list(tensors)
    if not tensors:
        return torch.zeros((0, NUM_COLUMNS), dtype=torch.int64)
    device = tensors[0].device
    if _triton_table() is not None and supports(tensors[0]):
        scanned = scan(tensors, _FORMAT_WORD, block_size * blocks_per_chunk)
        if scanned is not None:  # else some tensor is not plain: the Python path below decides
            return compute_scanned(scanned, out, block_size, blocks_per_chunk)
    # supports() for every tensor, with the device type checked once (a few attribute reads per
    # tensor are most of the host cost of a call)
    words = [_FORMAT_WORD.get(t.dtype) for t in tensors]
    if not supports(tensors[0]) or None in words or any(t.device != device or t.layout != torch.strided
                                                         for t in tensors):
        bad = next(t for t in tensors if t.device != device or not supports(t))
        raise ValueError(f"triton backend cannot read a {bad.dtype} tensor on {bad.device} in this batch")

    sources = [_flat_source(t) for t in tensors]  # kept alive until the kernels are enqueued
    table, formats, any_unaligned, num_chunks = _table(sources, words, block_size * blocks_per_chunk)
    with on_device(device):  # the upload and the launches go to the tensors' device and stream
        buffer = _buffer(table, num_chunks, device)
        if out is None:
            out = torch.empty((len(tensors), NUM_COLUMNS), dtype=torch.int64, device=device)
        _launch(buffer, out, len(tensors), num_chunks, formats, any_unaligned, block_size, blocks_per_chunk)
    return out


class Scanned:
    """The table of a call, built by ``_C.triton_table`` in a host int64 tensor (``scan``), with
    what the launch needs; ``flat`` ([(index, copy)] or None) keeps the copies of the tensors read
    through one alive until the kernels are enqueued."""

    __slots__ = ("tensors", "device", "table", "staged", "formats", "any_unaligned", "num_chunks",
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
    (scanned.formats, scanned.any_unaligned, scanned.num_chunks, flat, scanned.overlaps, scanned.empties,
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
                scanned.any_unaligned = True
            else:
                table[2 * count + index] |= _ALIGNED_BIT
    return scanned


def compute_scanned(scanned, out=None, block_size=None, blocks_per_chunk=None):
    """``compute`` of the tensors of ``scanned`` (from ``scan`` with the same launch shape)."""
    block_size = block_size or BLOCK_SIZE
    blocks_per_chunk = blocks_per_chunk or BLOCKS_PER_CHUNK
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
        _launch(buffer, out, num_tensors, scanned.num_chunks, scanned.formats, scanned.any_unaligned,
                block_size, blocks_per_chunk)
    return out


def on_device(device: torch.device):
    """Triton launches on the current CUDA device: make it the tensors' one (cuda:1 under
    ``device_map="auto"``), as ATen's device guards do."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _launch(buffer, out, num_tensors, num_chunks, formats, any_unaligned, block_size, blocks_per_chunk):
    if num_chunks:  # a batch of empty tensors has no chunks
        _stats_partials_kernel[(num_chunks,)](
            buffer, num_tensors, FORMATS=formats, ANY_UNALIGNED=any_unaligned,
            SEARCH_STEPS=(num_tensors - 1).bit_length(), BLOCK_SIZE=block_size,
            BLOCKS_PER_CHUNK=blocks_per_chunk, num_warps=NUM_WARPS, **_REGISTER_CAP,
        )
    _stats_combine_kernel[(num_tensors,)](buffer, out, num_tensors, BLOCK_SIZE=COMBINE_BLOCK, num_warps=2)


# -- the per-hook read: one launch per MAX_SLOTS tensors, nothing uploaded ------------------------
#
# ``read_into`` is what the hook layer calls for a hook's new tensors (and, through a launcher bound
# to its C++ core, what each hook's one C++ call does: ``launcher``). The tensors' addresses,
# element counts and format words go to ``_read_kernel`` as scalar arguments (as apex's and
# PyTorch's multi-tensor kernels pass their pointers by value), so nothing is uploaded and the
# launch is the call's only device work. Variants by tensor count (SLOT_VARIANTS); a call with more
# tensors than the largest takes one launch per MAX_SLOTS of them, up to MAX_READ_LAUNCHES, and the
# table kernels (``compute``: two launches and an upload whatever the count) past that.
#
# How one kernel writes final rows: a tensor read by one program (up to one chunk, most of a
# model's) writes its row directly. A tensor spanning several programs merges their partials with
# integer atomics into an accumulator row and the last program to finish writes the row (``_merge``).
# The accumulators are not the destination rows because a row's final form (float64 bits, NaN
# poisoning both extremes) is not a lattice the atomics can build in place, and because rows given
# by the caller hold anything. They belong to the stream: each CUDA stream that runs the kernel on
# a device gets its own group of MAX_SLOTS rows from a pool allocated (at identity) on the device's
# first use, and every launch leaves its group at identity again. Kernels of one stream run one
# after another, so no two launches share a group at once; a graph captured on a stream keeps that
# stream's group (replaying one graph on two streams at once is unsound for any graph). Integer
# atomics are exact and their order does not change the result: the rows are the table kernels'
# bit for bit.
#
# The launch itself, with the extension: the C++ ``Launcher`` of the device (csrc/table.cpp) checks
# and packs the tensors in one loop (the table kernels' loop) and launches. A variant's first launch
# goes through Triton's ordinary call (``_ordinary_launch``: it compiles the variant); its compiled
# kernel is then registered (``_register``) if its metadata is exactly what the direct launch passes
# (no scratch memory, one CTA, no cooperative or PDL launch, no instrumentation, 28 eight-byte
# parameters), and later launches of it call ``cuLaunchKernel`` on its CUfunction from C++, as
# AOTInductor's launchers do. Triton's launch hooks (a profiler's) decide per launch: while one is
# set, launches go through Triton so that it sees them. Without the extension, every launch is
# Triton's ordinary call. ``launch_path`` says which, with the same predicate.
#
# The first use of a CUDA device runs ``self_check``: a small fixed set of tensors through this
# path and through the torch backend, twice: first through Triton's launcher (which compiles the
# variants and checks the C++ packing against Triton's own argument handling), then through the
# direct launch. On any difference, or an error, it warns once and that device keeps the table
# kernels. Only after it passed does the launcher launch directly.

SLOT_VARIANTS = (1, 2, 4, 8)
MAX_SLOTS = SLOT_VARIANTS[-1]
MAX_READ_LAUNCHES = 4
STREAM_GROUPS = 64  # accumulator groups per device: the streams that can run the per-hook kernel
_IDENTITY_ROW = (2**63 - 1, -(2**63), 0, 0, 0, 0, 0, 0)  # keys at the ends of int64, counts and counter 0
_STRIDED = torch.strided
_is_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor

PER_HOOK = "per-hook kernel"
TABLE = "table kernels"
DIRECT = "direct (cuLaunchKernel from C++)"
# the per-hook kernel's parameters, in order: what the C++ launcher packs (csrc/launch.h)
_RUNTIME_ARGS = ("Out", "Accumulators", *(f"{c}{i}" for i in range(MAX_SLOTS) for c in "anw"))
_CONSTEXPRS = ("K", "FORMATS", "ANY_UNALIGNED", "BLOCK_SIZE", "BLOCKS_PER_CHUNK")
_SCRATCH_POINTERS = 2  # Triton's global and profile scratch, after the kernel's own parameters


def _runtime_knobs():
    """(triton.knobs.runtime, None) where launch hooks can be read, else (None, why not)."""
    try:
        from triton import knobs
        runtime = knobs.runtime
        knobs.HookChain  # noqa: B018 - the predicate tells an empty chain from a hook by this type
    except Exception as error:  # an older Triton
        return None, f"this Triton ({triton.__version__}) has no triton.knobs.runtime and HookChain ({error})"
    if not (hasattr(runtime, "launch_enter_hook") and hasattr(runtime, "launch_exit_hook")):
        return None, f"this Triton ({triton.__version__}) has no knobs.runtime.launch_enter_hook/launch_exit_hook"
    return runtime, None


def _launcher_driver(device):
    """The C++ launcher's driver for ``device`` and, where it cannot launch directly, why:
    ("cuda", None), or ("ordinary", why) (every launch through Triton)."""
    if _extension() is None:
        return None, "the C++ extension is unavailable"
    if _INTERPRET:
        return "ordinary", "the interpreter runs the kernels (TRITON_INTERPRET=1)"
    if device.type != "cuda":
        return "ordinary", f"no direct launch on {device.type}"
    if os.environ.get("OVERFLOW_FAST_DIRECT_LAUNCH", "1") == "0":
        return "ordinary", "OVERFLOW_FAST_DIRECT_LAUNCH=0"
    _, reason = _runtime_knobs()
    if reason is not None:
        return "ordinary", reason
    return "cuda", None


class _DeviceState:
    """What the per-hook read uses on one device."""

    __slots__ = ("device", "path", "self_check", "pool", "groups", "check_ms", "launcher", "launch_reason",
                 "compiled", "refused", "shapes", "warned", "__weakref__")

    def __init__(self, device):
        self.device = device
        self.path = PER_HOOK
        self.self_check = "not run"
        self.groups = {}  # stream handle -> address of its accumulator group (the Python read only)
        self.check_ms = None
        # (K, FORMATS, ANY_UNALIGNED, BLOCK_SIZE, BLOCKS_PER_CHUNK) -> the compiled kernel registered
        # for direct launches (kept: Triton unloads its CUfunction with it), or why it was refused
        self.compiled = {}
        self.refused = {}
        self.shapes = {}  # (block_size, blocks_per_chunk) -> (launcher, its accumulators) of a test's launch shape
        self.warned = False
        with on_device(device):
            identity = torch.tensor(_IDENTITY_ROW, dtype=torch.int64)
            self.pool = identity.repeat(STREAM_GROUPS * MAX_SLOTS, 1).to(device)
        self.launcher, self.launch_reason = _new_launcher(self, self.pool, BLOCK_SIZE, BLOCKS_PER_CHUNK)

    @property
    def launch(self):
        """How the per-hook kernel is launched here now (``launch_path``)."""
        return launch_path(self)

    def launcher_for(self, block_size, blocks_per_chunk):
        """The launcher of a launch shape: this device's own for the default one; tests' small chunks
        get one each, with accumulators of their own."""
        shape = (block_size or BLOCK_SIZE, blocks_per_chunk or BLOCKS_PER_CHUNK)
        if shape == (BLOCK_SIZE, BLOCKS_PER_CHUNK) or self.launcher is None:
            return self.launcher
        known = self.shapes.get(shape)
        if known is None:
            with on_device(self.device):
                pool = torch.tensor(_IDENTITY_ROW, dtype=torch.int64).repeat(STREAM_GROUPS * MAX_SLOTS, 1)
            pool = pool.to(self.device)
            known = self.shapes[shape] = (_new_launcher(self, pool, *shape)[0], pool)
            if self.launcher.driver == "cuda" and self.self_check == "passed":
                known[0].allow_direct()
        return known[0]


def _new_launcher(state, pool, block_size, blocks_per_chunk):
    """(the C++ launcher of ``state``'s device for a launch shape, or None; why it cannot launch
    directly, or None)."""
    driver, reason = _launcher_driver(state.device)
    if driver is None:
        return None, reason
    runtime, _ = _runtime_knobs()
    shape = (block_size, blocks_per_chunk)
    # weak: the launcher (C++, which Python's collector cannot see into) holds this callback, and
    # the state holds the launcher
    owner = weakref.ref(state)

    def ordinary(grid, args, slots, formats, any_unaligned):
        known = owner()
        if known is None:  # forget_devices() dropped it: a core that still holds this launcher unbinds it
            raise RuntimeError("the per-hook state of this device was forgotten")
        _ordinary_launch(known, known.launcher_for(*shape), grid, args, slots, formats, any_unaligned, *shape)

    try:
        launcher = _extension().Launcher(driver, state.device, _PLAIN_TYPES, _FORMAT_WORD, _ALIGNED_BIT,
                                       block_size * blocks_per_chunk, MAX_READ_LAUNCHES, pool, STREAM_GROUPS,
                                       runtime, _read_kernel, ordinary)
    except Exception as error:  # noqa: BLE001 - e.g. no libcuda.so.1: Triton's own launches
        driver, reason = "ordinary", f"{type(error).__name__}: {error}"
        launcher = _extension().Launcher(driver, state.device, _PLAIN_TYPES, _FORMAT_WORD, _ALIGNED_BIT,
                                       block_size * blocks_per_chunk, MAX_READ_LAUNCHES, pool, STREAM_GROUPS,
                                       runtime, _read_kernel, ordinary)
    return launcher, reason


def _ordinary_launch(state, launcher, grid, args, slots, formats, any_unaligned, block_size, blocks_per_chunk):
    """A launch the C++ launcher could not make directly, through Triton (``JITFunction.run``,
    which compiles the variant on its first launch); the compiled variant is then registered for
    direct launches where its metadata allows."""
    kernel = _read_kernel[(grid,)](*args, K=slots, FORMATS=formats, ANY_UNALIGNED=any_unaligned,
                                   BLOCK_SIZE=block_size, BLOCKS_PER_CHUNK=blocks_per_chunk, num_warps=NUM_WARPS,
                                   **_REGISTER_CAP)
    key = (slots, formats, any_unaligned, block_size, blocks_per_chunk)
    if launcher.driver == "cuda" and key not in state.compiled and key not in state.refused:
        _register(state, launcher, key, kernel)


def _register(state, launcher, key, kernel):
    """Register a compiled variant (``key``: K, FORMATS, ANY_UNALIGNED, then the launch shape) with
    the launcher, or note why its launch stays Triton's."""
    reason = direct_mismatch(kernel)
    if reason is None:
        metadata = kernel.metadata
        reason = launcher.add_variant(*key[:3], kernel.function, 32 * metadata.num_warps, metadata.shared) or None
    if reason is None:
        state.compiled[key] = kernel  # Triton unloads the CUfunction with its CompiledKernel
    else:
        state.refused[key] = reason


def direct_mismatch(kernel):
    """None when the compiled per-hook kernel ``kernel`` (loaded on its device) takes exactly what the
    direct launch passes, else what differs (``metadata_mismatch``)."""
    if not isinstance(getattr(kernel, "function", None), int):
        return "no CUfunction: not a compiled CUDA kernel"
    return metadata_mismatch(kernel)


def metadata_mismatch(kernel):
    """None when the compiled per-hook kernel's metadata and PTX say that it takes exactly what the
    direct launch passes (csrc/table.cpp, Launcher::launch_direct: grid (programs, 1, 1), 32 *
    num_warps threads, its dynamic shared memory, no launch attribute; the 26 int64 values, then
    the two scratch pointers, null), else what differs. Read in Triton 3.6's and 3.9's CUDA
    launchers (driver.py, driver.c): they add scratch memory, clusters (num_ctas), cooperative and
    PDL attributes and instrumentation arguments only where the metadata asks for them."""
    metadata = getattr(kernel, "metadata", None)
    if metadata is None:
        return "no metadata: not a compiled kernel"
    signature = getattr(getattr(kernel, "src", None), "signature", None)
    expected = {**{name: "i64" for name in _RUNTIME_ARGS}, **{name: "constexpr" for name in _CONSTEXPRS}}
    if signature != expected:
        return f"its signature {signature} is not the per-hook kernel's"
    for name, wanted in (("num_ctas", 1), ("launch_cooperative_grid", False), ("launch_pdl", False),
                         ("global_scratch_size", 0), ("profile_scratch_size", 0), ("instrumentation_mode", "")):
        value = getattr(metadata, name, wanted)  # absent or None: this Triton has no such feature
        if value not in (wanted, None):
            return f"its metadata asks for {name}={value!r}, which the direct launch does not pass"
    if getattr(metadata, "tensordesc_meta", None):
        return "it takes tensor descriptors"
    packed = tuple(getattr(kernel, "packed_metadata", ()))
    if packed != (metadata.num_warps, metadata.num_ctas, metadata.shared):
        return f"its launcher metadata {packed} is not (num_warps, num_ctas, shared)"
    params = ptx_parameters(getattr(kernel, "asm", {}).get("ptx"), getattr(metadata, "name", None))
    want = len(_RUNTIME_ARGS) + _SCRATCH_POINTERS
    if params is None:
        return "its PTX entry cannot be read"
    if len(params) != want or any(not p.startswith(".u64") and not p.startswith(".b64") for p in params):
        return f"its PTX entry takes {len(params)} parameters ({', '.join(sorted(set(params)))}), not {want} of 8 bytes"
    return None


def ptx_parameters(ptx, name):
    """The types of the parameters of kernel ``name``'s ``.entry`` in ``ptx`` (``.u64``, ``.u64 .ptr
    .global .align 1``, ...), or None when there is no such entry."""
    if not isinstance(ptx, str) or not name:
        return None
    import re

    match = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\((.*?)\)", ptx, re.S)
    if match is None:
        return None
    params = []
    for line in match.group(1).split(","):
        words = line.split()
        if not words:
            continue
        if words[0] != ".param":
            return None
        params.append(" ".join(words[1:-1]))  # the type and qualifiers, without the name
    return params


def launch_path(state=None):
    """How the per-hook kernel is launched on ``state``'s device now (default: a device not set up
    yet): ``DIRECT``, or "ordinary (why)" for Triton's own launch. The launch hooks are read now,
    by the C++ launcher's own predicate."""
    if state is not None and state.launcher is not None:
        launcher = state.launcher
        if launcher.disabled is not None:
            return f"none ({launcher.disabled}; the table kernels read)"
        reason = state.launch_reason or launcher.hooks_reason()
        if reason is None and state.self_check != "passed":
            reason = f"the direct launch is not self-checked ({state.self_check})"
        if reason is None and state.refused:
            reason = f"{len(state.refused)} variant(s) refused: {next(iter(state.refused.values()))}"
            return f"{DIRECT}, but {reason}"
        return DIRECT if reason is None else f"ordinary ({reason})"
    if triton is None:
        return f"ordinary ({_IMPORT_ERROR})"
    device = state.device if state is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    driver, reason = _launcher_driver(device)
    if reason is None:
        runtime, _ = _runtime_knobs()
        reason = _extension().launch_hooks_reason(runtime, _read_kernel)
    return f"{DIRECT} after its self-check" if reason is None else f"ordinary ({reason})"


_DEVICES = {}  # (device type, index) -> _DeviceState
_warned_devices = set()


def _state(device):
    key = (device.type, device.index)
    state = _DEVICES.get(key)
    if state is None:
        state = check_device(device)
    return state


def launcher(device):
    """The C++ launcher of the per-hook read on ``device`` (set up and self-checked on first use),
    for a hook's C++ core to launch through; None where that device does not take the per-hook
    kernel or there is no extension."""
    state = _state(torch.device(device))
    if state.path is not PER_HOOK or state.launcher is None or state.launcher.disabled is not None:
        return None
    return state.launcher


def check_device(device, read=None):
    """Set up the per-hook read on ``device`` and, on a CUDA device, run ``self_check`` (once per
    process and device; ``read``: the path checked, default this one; tests pass a wrong one).
    A failed check warns once and leaves the device on the table kernels. Returns its state."""
    device = torch.device(device)
    key = (device.type, device.index)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"overflow_fast: the first read on {device} is inside CUDA graph capture; its "
                           "self-check needs one eager call first (run one step before capturing)")
    state = _DEVICES[key] = _DeviceState(device)
    if device.type == "cuda" or read is not None:
        import time

        started = time.perf_counter()
        try:
            problem = self_check(device, read)
        except Exception as error:  # noqa: BLE001 - a failing fast path must not fail the read
            problem = f"{type(error).__name__}: {error}"
        state.check_ms = (time.perf_counter() - started) * 1e3
        if problem is None:
            state.self_check = "passed"
            if read is None and state.launcher is not None and state.launcher.driver == "cuda":
                state.launcher.allow_direct()
        else:
            state.self_check = f"failed: {problem}"
            state.path = TABLE
            if key not in _warned_devices:
                _warned_devices.add(key)
                import warnings

                warnings.warn(f"overflow_fast: the per-hook Triton kernel gave wrong statistics on {device} "
                              f"({problem}); that device uses the table kernels", RuntimeWarning, stacklevel=3)
    else:
        state.self_check = "not run (CPU tensors under the interpreter)"
    return state


def forget_devices():
    """Forget every device's state: the next read on each sets it up and checks it again."""
    _DEVICES.clear()
    _warned_devices.clear()


def device_report():
    """{device name: (path, self-check, launch)} of the devices used (or checked) so far."""
    return {str(state.device): (state.path, state.self_check, launch_path(state)) for state in _DEVICES.values()}
def _check_set(device):
    """The self-check's tensors: every dtype's special values and random bit patterns, empty and
    0-dim tensors, an unaligned view, a transposed (dense) one, and bf16 and int64 tensors that
    span several programs with their specials in the middle and last chunks."""
    gen = torch.Generator().manual_seed(0)
    tensors = []
    for dtype in sorted(SUPPORTED_DTYPES, key=str):
        size = dtype.itemsize
        if dtype.is_floating_point and size == 1:
            special = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)  # every byte
        elif dtype.is_floating_point:
            info = torch.finfo(dtype)
            special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), info.tiny, -info.tiny / 4,
                                    info.max, -info.max, 1.0, -2.5], dtype=torch.float64).to(dtype)
        elif dtype == torch.bool:
            special = torch.tensor([True, False, True])
        else:
            signed = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
            info = torch.iinfo(signed)
            special = torch.tensor([0, -1, 1, info.min, info.max, info.min + 1], dtype=signed)
            special = special.view(dtype) if dtype != torch.uint8 else special.view(torch.uint8)
        if dtype == torch.bool:
            noise = torch.randint(0, 2, (77,), generator=gen, dtype=torch.uint8).view(torch.bool)
        else:
            noise = torch.randint(-128, 128, (77 * size,), generator=gen, dtype=torch.int8).view(dtype)
        tensors += [special, noise]
    chunk = BLOCK_SIZE * BLOCKS_PER_CHUNK
    wide = torch.full((2 * chunk + 77,), 1.5, dtype=torch.bfloat16)
    wide[chunk + 5] = float("nan")
    wide[-1] = -float("inf")
    wide[-2] = 2.0**-130
    ints = torch.arange(chunk + 3, dtype=torch.int64)
    ints[-1] = -(2**63)
    square = torch.randint(-100, 100, (30, 40), generator=gen).to(torch.float16)
    tensors += [wide, wide[1:], ints, torch.empty(0, dtype=torch.float32), torch.tensor(-3.0), square.t(),
                torch.zeros(70, dtype=torch.float32)[1:]]
    return [t.to(device) for t in tensors]



def self_check(device, read=None):
    """None when the per-hook read (``read(tensors, rows)`` on up to MAX_SLOTS tensors at a time,
    default this device's per-hook read) gives the torch backend's rows for ``_check_set`` twice in
    a row, else the first difference. The default read goes through the device's C++ launcher, the
    hooks' own path: the first time through Triton's launch (which compiles each variant, then
    registers it), the second time directly wherever a variant is registered; where no launch of
    the second time could be direct, the device's launch path says why."""
    from . import torch_backend

    tensors = _check_set(device)
    want = torch_backend.compute(tensors).cpu()
    state = None
    if read is None:
        state = _DEVICES.get((device.type, device.index)) or _DeviceState(device)
        _check_stream(state)
    for attempt in ("first", "second"):
        reader = read if state is None else _checked_read(state, attempt)
        rows = torch.full((len(tensors), NUM_COLUMNS), -1, dtype=torch.int64, device=device)
        for begin in range(0, len(tensors), MAX_SLOTS):  # one launch each, as a hook's call
            if reader(tensors[begin:begin + MAX_SLOTS], rows[begin:begin + MAX_SLOTS]) is False:
                return f"the {attempt} read did not take the check's tensors"
        problem = _row_difference(rows.cpu(), want, tensors)
        if problem is not None:
            return f"{attempt} read: {problem}"
    return None


def _check_stream(state):
    """Raise unless the launcher's current stream is torch's (the stream its accumulators and
    launches follow)."""
    launcher = state.launcher
    if launcher is not None and launcher.driver == "cuda":
        stream = torch.cuda.current_stream(state.device).cuda_stream
        if launcher.current_stream() != stream:
            raise RuntimeError(f"the launcher's current stream {launcher.current_stream():#x} is not torch's "
                               f"{stream:#x}")


def _checked_read(state, attempt):
    """``self_check``'s default read on ``state``'s device, ``attempt`` "first" or "second": the
    launcher's (Triton's launch, then the direct one), or the Python read where there is none."""
    launcher = state.launcher
    if launcher is None:
        return lambda tensors, rows: _read(tensors, rows, state)

    def read(tensors, rows):
        before = launcher.direct_launches
        taken = launcher.read(tensors, rows, -1 if attempt == "first" else 1)
        if taken and attempt == "second" and launcher.driver == "cuda" and launcher.direct_launches == before:
            reason = next(iter(state.refused.values()), "no variant was registered")
            state.launch_reason = state.launch_reason or f"the self-check launched nothing directly: {reason}"
        return taken

    return read


def _row_difference(got, want, tensors):
    """The first row where ``got`` differs from ``want`` (host int64 [N, 8]), or None; NaN rows
    may hold another NaN pattern in the extremes."""
    for index, (g, w) in enumerate(zip(got.tolist(), want.tolist())):
        same = g[2:] == w[2:]
        if same and g[2] > 0 and tensors[index].is_floating_point():
            same = all((v & 0x7FFFFFFFFFFFFFFF) > 0x7FF0000000000000 for v in g[:2])
        elif same:
            same = g[:2] == w[:2]
        if not same:
            t = tensors[index]
            return f"tensors[{index}] {t.dtype} {tuple(t.shape)}: row {g}, torch backend {w}"
    return None



def read_into(tensors, out, block_size=None, blocks_per_chunk=None):
    """The rows of ``tensors`` (a list of plain strided tensors on one device) written into
    ``out`` (a contiguous ``[len(tensors), 8]`` int64 tensor on their device), by the per-hook
    kernel: one launch per MAX_SLOTS tensors, nothing uploaded, no host sync. False when it does
    not take the call (nothing was launched): a tensor of another kind, device or dtype, more
    than MAX_SLOTS * MAX_READ_LAUNCHES tensors, ``out`` not such a tensor or sharing memory with
    a tensor, or this device's self-check failed; the caller then takes the general path.
    ``block_size`` and ``blocks_per_chunk`` override the launch shape (tests use small chunks)."""
    if not tensors:
        return True
    if _functorch_interpreter() is not None:
        return False  # inside vmap/grad: the general path says what it can read
    device = out.device
    state = _DEVICES.get((device.type, device.index))
    if state is None:
        if not supports(tensors[0]):
            return False
        state = _state(device)
    if state.path is not PER_HOOK:
        return False
    launcher = state.launcher_for(block_size, blocks_per_chunk)
    if launcher is not None and launcher.disabled is not None:
        if not state.warned:
            state.warned = True
            import warnings

            warnings.warn(f"overflow_fast: the per-hook kernel's launch failed on {device} ({launcher.disabled}); "
                          "that device's reads take the table kernels", RuntimeWarning, stacklevel=2)
        return False
    return _read(tensors, out, state, block_size, blocks_per_chunk)


def _read(tensors, out, state=None, block_size=None, blocks_per_chunk=None):
    """``read_into`` on a device whose state is set up (``state``, default looked up), whatever its
    self-check said: its C++ launcher's read, the one owner of the device's accumulators, or
    without the extension the Python read."""
    if state is None:
        state = _DEVICES[(out.device.type, out.device.index)]
    launcher = state.launcher_for(block_size, blocks_per_chunk)
    if launcher is not None:
        return launcher.disabled is None and launcher.read(tensors if type(tensors) is list else list(tensors), out)
    return _python_read(tensors, out, state, block_size, blocks_per_chunk)


def _python_read(tensors, out, state, block_size=None, blocks_per_chunk=None):
    """The per-hook read in Python, where the C++ launcher is not available (no extension): the
    same checks and arguments, each launch Triton's ordinary call."""
    count = len(tensors)
    if count > MAX_SLOTS * MAX_READ_LAUNCHES or _functorch_interpreter() is not None:
        return False
    device = out.device
    if (type(out) not in _PLAIN_TYPES or out.dtype != torch.int64 or tuple(out.shape) != (count, NUM_COLUMNS)
            or not out.is_contiguous()):
        return False
    out_first = out.data_ptr()
    out_last = out_first + count * 64
    cuda = device.type == "cuda"
    index = device.index if cuda else -1
    zero3 = "deepspeed" in sys.modules
    words = _FORMAT_WORD
    block_size = block_size or BLOCK_SIZE
    blocks_per_chunk = blocks_per_chunk or BLOCKS_PER_CHUNK
    chunk = block_size * blocks_per_chunk
    slots = []  # (address, numel, word) per tensor
    programs = []  # per launch
    keep = None  # flat copies, alive until the launches are enqueued
    formats = 0
    any_unaligned = False
    for tensor in tensors:
        if (type(tensor) not in _PLAIN_TYPES or tensor.layout is not _STRIDED or tensor.is_cuda is not cuda
                or tensor.get_device() != index or tensor.is_meta):
            return False
        word = words.get(tensor.dtype)
        if word is None or tensor.is_nested or _is_functorch_wrapped(tensor):
            return False
        numel = tensor.numel()
        if numel == 0 and zero3 and is_zero3_released(tensor):
            return False  # a released ZeRO-3 parameter: the general path reads the whole one
        if not tensor.is_contiguous() and not _is_dense(tensor) or tensor.is_neg():
            tensor = _flat_source(tensor)
            keep = keep or []
            keep.append(tensor)
        elif numel and not _inside_storage(tensor):
            return False  # its memory was freed or shrunk: the general path says so
        slot = _slot(tensor, word)
        address = slot[0]
        if numel and address < out_last and out_first < address + numel * tensor.element_size():
            return False  # out shares memory with a tensor: the general path says so
        any_unaligned = any_unaligned or not slot[2] & _ALIGNED_BIT
        formats |= 1 << (word & _CODE_MASK)
        if len(slots) % MAX_SLOTS == 0:
            programs.append(0)
        programs[-1] += -(-numel // chunk) or 1
        slots.append(slot)
    stream = torch._C._cuda_getCurrentRawStream(index) if cuda else 0
    accumulators = state.groups.get(stream)
    if accumulators is None:
        if len(state.groups) >= STREAM_GROUPS:
            return False
        accumulators = state.groups[stream] = state.pool[len(state.groups) * MAX_SLOTS].data_ptr()
    # Triton launches on the current device: the tensors' one (cuda:1 under device_map="auto")
    guard = on_device(device) if cuda and torch._C._cuda_getDevice() != index else contextlib.nullcontext()
    with guard:
        for launch, begin in enumerate(range(0, count, MAX_SLOTS)):
            group = slots[begin:begin + MAX_SLOTS]
            args = [out_first + begin * 64, accumulators]
            for slot in group:
                args += slot
            args += _PADDING * (MAX_SLOTS - len(group))
            _launch_read(programs[launch], args, _variant(len(group)), formats, any_unaligned, block_size,
                         blocks_per_chunk)
    del keep
    return True


def _launch_read(programs, args, slots, formats, any_unaligned, block_size, blocks_per_chunk):
    """One launch of ``_read_kernel`` (Triton's ordinary call) of the Python read."""
    _read_kernel[(programs,)](*args, K=slots, FORMATS=formats, ANY_UNALIGNED=any_unaligned, BLOCK_SIZE=block_size,
                              BLOCKS_PER_CHUNK=blocks_per_chunk, num_warps=NUM_WARPS, **_REGISTER_CAP)


def _inside_storage(tensor):
    """Whether a dense tensor's elements lie inside its storage (a freed or shrunk storage would
    have the kernel read memory the tensor does not own)."""
    storage = tensor.untyped_storage()
    start = tensor.data_ptr() - storage.data_ptr()
    return storage.data_ptr() != 0 and 0 <= start and start + tensor.numel() * tensor.element_size() <= storage.nbytes()


def _variant(count):
    for slots in SLOT_VARIANTS:
        if slots >= count:
            return slots
    raise ValueError(count)


_PADDING = (0, -1, 0)  # an unused slot: no programs
