"""The Triton backend: every statistic in one pass over each tensor, many tensors per launch.

Per dtype group of a ``compute`` call there are two launches and no host sync:

1. ``_stats_partials_kernel``: one program per chunk (a fixed run of elements of one tensor,
   found through a pointer table and a chunk table), writing one partial row of 8 int64.
2. ``_stats_combine_kernel``: one program per tensor, folding that tensor's partial rows into its
   result row (layout.py). Two stages instead of atomics: deterministic, and no float atomics
   (Triton has them only for fp32/fp64).

Floating values are classified on their raw bits, never converted: with the sign bit cleared,
the bits of a float order like its magnitude, so abs-min/abs-max are integer min/max, and NaN,
inf, zero and subnormal are integer compares against constants of the format. That is exact
for every format (fp8 included, without relying on Triton's fp8 conversions) and makes NaN
explicit: ``tl.min``/``tl.max`` would drop NaN on floats, while here a NaN is counted and the
result is poisoned from the count. The combine kernel turns the winning bits into float64 bits.

Integers use exact magnitudes: 8/16-bit values widen to int32, 32-bit values to int64, and 64-bit
magnitudes (|-2**63| = 2**63) are compared as unsigned by flipping the sign bit.

Complex tensors are left to the torch backend (``supports`` is False): their magnitude is
torch's hypot, whose rounding this kernel would have to reproduce bit for bit.

Tensors that are not contiguous but non-overlapping and dense are read flat over their memory
span (the statistics do not depend on element order); other strided tensors are copied with
``.contiguous()`` first (one extra device read and write of that tensor, still no sync).

Under ``TRITON_INTERPRET=1`` (set before this module is imported) the kernels run on CPU
tensors through Triton's interpreter; that is how the tests run without a GPU.
"""

import contextlib
import os

import torch

from .layout import NUM_COLUMNS

NAME = "triton"

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

# Element kinds, a constexpr of the kernels.
_FLOAT, _SIGNED, _UNSIGNED, _BOOL = 0, 1, 2, 3

# Launch shape. A chunk is BLOCK_SIZE * BLOCKS_PER_CHUNK elements of one tensor: large enough that
# the partials are a tiny fraction of the traffic, small enough that a 256 MB tensor gives
# thousands of programs. BLOCKS_PER_CHUNK <= 31 because the per-lane counters are 5-bit fields.
BLOCK_SIZE = 4096
BLOCKS_PER_CHUNK = 16
NUM_WARPS = 8
COMBINE_BLOCK = 128

if triton is not None:
    _LOAD_DTYPE = {
        # floats load as same-width signed ints: classification works on the bits
        torch.float64: tl.int64,
        torch.float32: tl.int32,
        torch.float16: tl.int16,
        torch.bfloat16: tl.int16,
        torch.float8_e4m3fn: tl.int8,
        torch.float8_e5m2: tl.int8,
        torch.uint8: tl.uint8,
        torch.int8: tl.int8,
        torch.int16: tl.int16,
        torch.int32: tl.int32,
        torch.int64: tl.int64,
        torch.bool: tl.uint8,  # torch stores bool as one byte holding 0 or 1
    }
    for _name, _tl_type in (("uint16", tl.uint16), ("uint32", tl.uint32), ("uint64", tl.uint64)):
        if hasattr(torch, _name):
            _LOAD_DTYPE[getattr(torch, _name)] = _tl_type
else:
    _LOAD_DTYPE = {}

# (exponent bits, mantissa bits, has infinities) of each floating format
_FLOAT_FORMAT = {
    torch.float64: (11, 52, True),
    torch.float32: (8, 23, True),
    torch.float16: (5, 10, True),
    torch.bfloat16: (8, 7, True),
    torch.float8_e4m3fn: (4, 3, False),  # no inf; NaN is S.1111.111
    torch.float8_e5m2: (5, 2, True),
}


def unavailable_reason():
    if triton is None:
        return f"triton is not importable ({_IMPORT_ERROR})"
    if _INTERPRET or torch.cuda.is_available():
        return None
    return "no CUDA device, and TRITON_INTERPRET=1 was not set before overflow_fast loaded the backend"


def supports(tensor: torch.Tensor) -> bool:
    # The interpreter reads the pointer table as host addresses, so it takes CPU tensors only;
    # compiled kernels take CUDA tensors only.
    device_ok = tensor.device.type == ("cpu" if _INTERPRET else "cuda")
    return device_ok and tensor.dtype in _LOAD_DTYPE and tensor.layout == torch.strided


if triton is not None:

    @triton.jit
    def _classify(x, KIND: tl.constexpr, EXP_BITS: tl.constexpr, MANT_BITS: tl.constexpr,
                  HAS_INF: tl.constexpr, KEY_DTYPE: tl.constexpr, FLIP: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr):
        """Per element: the magnitude key (ordered like |x|) and one count in a 5-bit class field."""
        if KIND == 0:
            ABS_MASK: tl.constexpr = (1 << (EXP_BITS + MANT_BITS)) - 1
            INF_BITS: tl.constexpr = ((1 << EXP_BITS) - 1) << MANT_BITS
            MIN_NORMAL_BITS: tl.constexpr = 1 << MANT_BITS
            bits = x.to(KEY_DTYPE)  # sign-extends, so bits < 0 is the sign
            key = bits & ABS_MASK
            if HAS_INF:
                is_inf = key == INF_BITS
                is_nan = key > INF_BITS
                cls = ((key != 0).to(tl.int32) + (key >= MIN_NORMAL_BITS).to(tl.int32)
                       + is_inf.to(tl.int32) + 2 * is_nan.to(tl.int32)
                       + 2 * (is_inf & (bits < 0)).to(tl.int32))
            else:
                # float8_e4m3fn: no infinities, the all-ones magnitude is NaN
                cls = ((key != 0).to(tl.int32) + (key >= MIN_NORMAL_BITS).to(tl.int32)
                       + 2 * (key == ABS_MASK).to(tl.int32))
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
    def _stats_partials_kernel(
        Ptrs_ptr,  # int64[T]: address of each tensor's first element
        Numel_ptr,  # int64[T]
        ChunkTensor_ptr,  # int64[C]: which tensor (index into Ptrs) the chunk reads
        ChunkStart_ptr,  # int64[C]: the chunk's first element within that tensor
        Partials_ptr,  # int64[C, 8]: one partial row per chunk
        LOAD_DTYPE: tl.constexpr,
        KIND: tl.constexpr,
        EXP_BITS: tl.constexpr,
        MANT_BITS: tl.constexpr,
        HAS_INF: tl.constexpr,
        KEY_DTYPE: tl.constexpr,  # int32, or int64 where int32 cannot hold the magnitude
        FLIP: tl.constexpr,  # 64-bit integers: keys compared as unsigned via a sign-bit flip
        ALIGNED: tl.constexpr,  # every tensor of the launch starts on a 16-byte boundary
        BLOCK_SIZE: tl.constexpr,
        BLOCKS_PER_CHUNK: tl.constexpr,
    ):
        tl.static_assert(BLOCKS_PER_CHUNK <= 31)
        # int64 from the start: element offsets of tensors over 2**31 elements must not wrap.
        chunk = tl.program_id(0).to(tl.int64)
        tensor = tl.load(ChunkTensor_ptr + chunk)
        start = tl.load(ChunkStart_ptr + chunk)
        numel = tl.load(Numel_ptr + tensor)
        end = tl.minimum(start + BLOCK_SIZE * BLOCKS_PER_CHUNK, numel)
        X = tl.load(Ptrs_ptr + tensor).to(tl.pointer_type(LOAD_DTYPE))

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

        # Full blocks load without a mask: with the alignment hints below, Triton emits 16-byte
        # vector loads (a masked load whose bound is only known at run time stays scalar).
        if ALIGNED:
            X = tl.multiple_of(X, 16)
        start = tl.multiple_of(start, BLOCK_SIZE)  # chunks start at multiples of the chunk size
        n_full = (end - start) // BLOCK_SIZE
        for i in range(n_full):
            offsets = start + i * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
            x = tl.load(X + offsets)
            key, counts = _classify(x, KIND, EXP_BITS, MANT_BITS, HAS_INF, KEY_DTYPE, FLIP, BLOCK_SIZE)
            key_min = tl.minimum(key_min, key)
            key_max = tl.maximum(key_max, key)
            packed += counts
        # The tensor's last chunk may end inside a block: one masked block.
        if start + n_full * BLOCK_SIZE < end:
            offsets = start + n_full * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
            mask = offsets < end
            # padding lanes read 0: counted in the unused zero field, below every max
            x = tl.load(X + offsets, mask=mask, other=0)
            key, counts = _classify(x, KIND, EXP_BITS, MANT_BITS, HAS_INF, KEY_DTYPE, FLIP, BLOCK_SIZE)
            key_min = tl.minimum(key_min, tl.where(mask, key, KEY_MAX))
            key_max = tl.maximum(key_max, key)
            packed += counts

        count = end - start
        subnormal = tl.sum((packed >> 5) & 31, axis=0).to(tl.int64)
        normal = tl.sum((packed >> 10) & 31, axis=0).to(tl.int64)
        posinf = tl.sum((packed >> 15) & 31, axis=0).to(tl.int64)
        nan = tl.sum((packed >> 20) & 31, axis=0).to(tl.int64)
        neginf = tl.sum((packed >> 25) & 31, axis=0).to(tl.int64)
        out = Partials_ptr + chunk * 8
        tl.store(out + 0, tl.min(key_min, axis=0).to(tl.int64))
        tl.store(out + 1, tl.max(key_max, axis=0).to(tl.int64))
        tl.store(out + 2, nan)
        tl.store(out + 3, posinf)
        tl.store(out + 4, neginf)
        if KIND == 0:
            tl.store(out + 5, count - (subnormal + normal + posinf + nan + neginf))
            tl.store(out + 6, subnormal)
        else:
            tl.store(out + 5, count - subnormal)  # field 1 counted the nonzero values
            tl.store(out + 6, normal)  # 0
        tl.store(out + 7, count)

    @triton.jit
    def _stats_combine_kernel(
        Partials_ptr,  # int64[C, 8]
        FirstChunk_ptr,  # int64[T]: first partial row of each tensor
        NumChunks_ptr,  # int64[T]
        Numel_ptr,  # int64[T]
        Row_ptr,  # int64[T]: the tensor's row in Out
        Out_ptr,  # int64[N, 8]
        KIND: tl.constexpr,
        EXP_BITS: tl.constexpr,
        MANT_BITS: tl.constexpr,
        HAS_INF: tl.constexpr,
        FLIP: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
    ):
        tensor = tl.program_id(0).to(tl.int64)
        first = tl.load(FirstChunk_ptr + tensor)
        num_chunks = tl.load(NumChunks_ptr + tensor)
        numel = tl.load(Numel_ptr + tensor)
        row = tl.load(Row_ptr + tensor)

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
            p = Partials_ptr + (first + index) * 8
            key_min = tl.minimum(key_min, tl.load(p + 0, mask=mask, other=2**63 - 1))
            key_max = tl.maximum(key_max, tl.load(p + 1, mask=mask, other=-(2**63)))
            nan += tl.load(p + 2, mask=mask, other=0)
            posinf += tl.load(p + 3, mask=mask, other=0)
            neginf += tl.load(p + 4, mask=mask, other=0)
            zero += tl.load(p + 5, mask=mask, other=0)
            subnormal += tl.load(p + 6, mask=mask, other=0)
        lo = tl.min(key_min, axis=0)
        hi = tl.max(key_max, axis=0)
        nan_count = tl.sum(nan, axis=0)

        if KIND == 0:
            # magnitude bits of the format -> float64 bits
            if MANT_BITS != 52:
                lo = _float_bits_to_f64(lo, EXP_BITS, MANT_BITS, HAS_INF)
                hi = _float_bits_to_f64(hi, EXP_BITS, MANT_BITS, HAS_INF)
            # any NaN poisons both, as torch's abs().min()/max() do
            lo = tl.where(nan_count > 0, 0x7FF8000000000000, lo)
            hi = tl.where(nan_count > 0, 0x7FF8000000000000, hi)
        elif KIND == 3:
            lo = tl.where(lo != 0, 0x3FF0000000000000, 0)  # 1.0 : 0.0
            hi = tl.where(hi != 0, 0x3FF0000000000000, 0)
        elif FLIP:
            lo = lo ^ (-(2**63))
            hi = hi ^ (-(2**63))

        # an empty tensor has no chunks and a row of zeros
        empty = numel == 0
        out = Out_ptr + row * 8
        tl.store(out + 0, tl.where(empty, 0, lo))
        tl.store(out + 1, tl.where(empty, 0, hi))
        tl.store(out + 2, nan_count)
        tl.store(out + 3, tl.sum(posinf, axis=0))
        tl.store(out + 4, tl.sum(neginf, axis=0))
        tl.store(out + 5, tl.sum(zero, axis=0))
        tl.store(out + 6, tl.sum(subnormal, axis=0))
        tl.store(out + 7, numel)

    @triton.jit
    def _float_bits_to_f64(a, EXP_BITS: tl.constexpr, MANT_BITS: tl.constexpr, HAS_INF: tl.constexpr):
        """Float64 bits of the non-negative value whose bits (sign cleared) in a narrower format are a."""
        BIAS: tl.constexpr = (1 << (EXP_BITS - 1)) - 1
        exponent = a >> MANT_BITS
        mantissa = a & ((1 << MANT_BITS) - 1)
        normal = ((exponent + (1023 - BIAS)) << 52) | (mantissa << (52 - MANT_BITS))
        # subnormal: mantissa * 2**(1 - BIAS - MANT_BITS); the int -> float64 conversion is exact
        # and the scaling by a power of two is an exponent subtraction, so no rounding anywhere
        scaled = mantissa.to(tl.float64).to(tl.int64, bitcast=True) - ((BIAS + MANT_BITS - 1) << 52)
        result = tl.where(exponent == 0, tl.where(mantissa == 0, 0, scaled), normal)
        if HAS_INF:
            result = tl.where(a == ((1 << EXP_BITS) - 1) << MANT_BITS, 0x7FF0000000000000, result)
        return result


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


def _kernel_args(dtype):
    """The constexprs describing ``dtype`` to both kernels."""
    if dtype in _FLOAT_FORMAT:
        exp_bits, mant_bits, has_inf = _FLOAT_FORMAT[dtype]
        kind, flip = _FLOAT, False
        key_dtype = tl.int64 if mant_bits == 52 else tl.int32
    else:
        exp_bits, mant_bits, has_inf = 0, 0, False
        size = dtype.itemsize
        kind = _BOOL if dtype == torch.bool else _UNSIGNED if not dtype.is_signed else _SIGNED
        flip = size == 8
        key_dtype = tl.int64 if size >= 4 else tl.int32
    return dict(kind=kind, exp_bits=exp_bits, mant_bits=mant_bits, has_inf=has_inf,
                key_dtype=key_dtype, flip=flip)


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
    chunk = block_size * blocks_per_chunk
    tensors = list(tensors)
    if not tensors:
        return torch.zeros((0, NUM_COLUMNS), dtype=torch.int64)
    device = tensors[0].device
    for t in tensors:
        if t.device != device or not supports(t):
            raise ValueError(f"triton backend cannot read a {t.dtype} tensor on {t.device} in this batch")

    # Group by dtype (and by 16-byte alignment, which allows vector loads): one launch pair per
    # group. All groups' tables share one int64 host buffer: one host-to-device copy per call.
    sources = [_flat_source(t) for t in tensors]  # kept alive until the kernels are enqueued
    groups = {}
    for row, t in enumerate(sources):
        groups.setdefault((t.dtype, t.data_ptr() % 16 == 0), []).append(row)
    host = []
    plan = []
    total_chunks = 0
    for (dtype, aligned), rows in groups.items():
        ptrs, numels, firsts, counts = [], [], [], []
        chunk_tensor, chunk_start = [], []
        for local, row in enumerate(rows):
            n = sources[row].numel()
            starts = range(0, n, chunk)
            ptrs.append(sources[row].data_ptr() if n else 0)
            numels.append(n)
            firsts.append(len(chunk_tensor))
            counts.append(len(starts))
            chunk_tensor.extend([local] * len(starts))
            chunk_start.extend(starts)
        base = len(host)
        host += ptrs + numels + firsts + counts + rows + chunk_tensor + chunk_start
        plan.append((dtype, aligned, len(rows), len(chunk_tensor), base, total_chunks))
        total_chunks += len(chunk_tensor)

    with on_device(device):  # the upload and the launches go to the tensors' device and stream
        tables = torch.tensor(host, dtype=torch.int64)
        if device.type != "cpu":
            # torch.tensor(list, device=cuda) would copy synchronously. A pinned source copies
            # asynchronously, and the caching host allocator keeps it until the copy has run.
            tables = tables.pin_memory().to(device, non_blocking=True)
        partials = torch.empty((max(total_chunks, 1), NUM_COLUMNS), dtype=torch.int64, device=device)
        if out is None:
            out = torch.empty((len(tensors), NUM_COLUMNS), dtype=torch.int64, device=device)
        _launch(plan, tables, partials, out, block_size, blocks_per_chunk)
    return out


def on_device(device: torch.device):
    """Triton launches on the current CUDA device: make it the tensors' one (cuda:1 under
    ``device_map="auto"``), as ATen's device guards do."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _launch(plan, tables, partials, out, block_size, blocks_per_chunk):
    for dtype, aligned, n_tensors, n_chunks, base, chunk_base in plan:
        sizes = [n_tensors] * 5 + [n_chunks] * 2
        offsets = [base + sum(sizes[:k]) for k in range(len(sizes) + 1)]
        t_ptrs, t_numel, t_first, t_count, t_rows, c_tensor, c_start = (
            tables[offsets[k]: offsets[k + 1]] for k in range(len(sizes))
        )
        args = _kernel_args(dtype)
        group_partials = partials[chunk_base: chunk_base + n_chunks]
        if n_chunks:
            _stats_partials_kernel[(n_chunks,)](
                t_ptrs, t_numel, c_tensor, c_start, group_partials,
                LOAD_DTYPE=_LOAD_DTYPE[dtype], KIND=args["kind"], EXP_BITS=args["exp_bits"],
                MANT_BITS=args["mant_bits"], HAS_INF=args["has_inf"], KEY_DTYPE=args["key_dtype"],
                FLIP=args["flip"], ALIGNED=aligned, BLOCK_SIZE=block_size, BLOCKS_PER_CHUNK=blocks_per_chunk,
                num_warps=NUM_WARPS,
            )
        _stats_combine_kernel[(n_tensors,)](
            group_partials if n_chunks else partials, t_first, t_count, t_numel, t_rows, out,
            KIND=args["kind"], EXP_BITS=args["exp_bits"], MANT_BITS=args["mant_bits"],
            HAS_INF=args["has_inf"], FLIP=args["flip"], BLOCK_SIZE=COMBINE_BLOCK, num_warps=2,
        )
