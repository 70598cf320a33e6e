"""The Triton kernels: the table kernels (``_stats_partials_kernel``, ``_stats_combine_kernel``) and
the list kernel (``_list_kernel``: a call's few tensors passed by value), with the jitted helpers
they share. How they classify and combine is told in triton_backend's docstring. Defined only where Triton imports."""

from .triton_common import tl, triton

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
        ``MERGE`` merged into its tensor's row (the list kernel, ``_merge``)."""
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
        """The list kernel's end of a program: its chunk's partial (``_chunk_partial``) made
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
    def _list_kernel(
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
