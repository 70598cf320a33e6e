"""Host time of one ``triton_backend.compute()`` call, launches stubbed (the GPU path's
host cost), for 1, 8, 64 and 200 tensors of mixed dtypes at GPT-2-small sizes, side by side with
the previous implementation (per-dtype groups, one table entry per 64K-element chunk, two launches
per group), which is kept here only, as ``old_compute``.

The tensors are uninitialised CPU tensors (virtual memory, never read): what is timed is the
host work of a call, the kernels' ``kernel[grid](...)`` calls replaced by counting stubs
(bench_host_path's). On CPU tensors neither version uploads its table: the old one builds it with
``torch.tensor(list)`` (on CUDA it then added ``pin_memory().to(device)``), the new one packs it
into its buffer (on CUDA: into a pinned staging buffer, then one ``copy_``); that CUDA-only part
is not in these figures for either.

    .venv/bin/python benchmarks/bench_triton_host.py [--counts 1,8,64,200] [--calls 200] [--rounds 7]
"""

import argparse
import itertools
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402
from bench_host_path import COUNT, _StubKernel, patched  # noqa: E402

from overflow_fast.stats import triton_backend as tb  # noqa: E402
from overflow_fast.stats.layout import NUM_COLUMNS  # noqa: E402

# One GPT-2-small layer's worth of hooked tensors at batch 8 x 1024, bf16, cycled to N tensors.
POOL = (
    (torch.bfloat16, (8, 1024, 768)),  # hidden states
    (torch.bfloat16, (8, 1024, 3072)),  # MLP activations
    (torch.bfloat16, (768, 2304)),  # c_attn weight
    (torch.int64, (8, 1024)),  # input_ids
    (torch.bfloat16, (2304,)),  # c_attn bias
    (torch.bfloat16, (8, 1024, 2304)),  # qkv
    (torch.float32, (8, 1024)),  # an fp32 tensor (loss terms, norms)
    (torch.bool, (8, 1024)),  # an attention mask
)


def make_tensors(n):
    pool = [torch.empty(shape, dtype=dtype) for dtype, shape in POOL]
    return list(itertools.islice(itertools.cycle(pool), n))


# -- the previous implementation, host side (kept for this comparison only) ------------------------

def _old_load_dtype():
    tl = tb.tl
    table = {
        torch.float64: tl.int64, torch.float32: tl.int32, torch.float16: tl.int16, torch.bfloat16: tl.int16,
        torch.float8_e4m3fn: tl.int8, torch.float8_e5m2: tl.int8, torch.uint8: tl.uint8, torch.int8: tl.int8,
        torch.int16: tl.int16, torch.int32: tl.int32, torch.int64: tl.int64, torch.bool: tl.uint8,
    }
    for name, tl_type in (("uint16", tl.uint16), ("uint32", tl.uint32), ("uint64", tl.uint64)):
        if hasattr(torch, name):
            table[getattr(torch, name)] = tl_type
    return table


_OLD_FLOAT_FORMAT = {
    torch.float64: (11, 52, True), torch.float32: (8, 23, True), torch.float16: (5, 10, True),
    torch.bfloat16: (8, 7, True), torch.float8_e4m3fn: (4, 3, False), torch.float8_e5m2: (5, 2, True),
}


def _old_kernel_args(dtype):
    tl = tb.tl
    if dtype in _OLD_FLOAT_FORMAT:
        exp_bits, mant_bits, has_inf = _OLD_FLOAT_FORMAT[dtype]
        kind, flip = 0, False
        key_dtype = tl.int64 if mant_bits == 52 else tl.int32
    else:
        exp_bits, mant_bits, has_inf = 0, 0, False
        size = dtype.itemsize
        kind = 3 if dtype == torch.bool else 2 if not dtype.is_signed else 1
        flip = size == 8
        key_dtype = tl.int64 if size >= 4 else tl.int32
    return dict(kind=kind, exp_bits=exp_bits, mant_bits=mant_bits, has_inf=has_inf,
                key_dtype=key_dtype, flip=flip)


def old_compute(tensors, out=None, block_size=None, blocks_per_chunk=None, load_dtype=None):
    """The previous compute(): dtype/alignment groups, per-chunk lists, torch.tensor(list), seven
    table slices and two launches per group."""
    block_size = block_size or tb.BLOCK_SIZE
    blocks_per_chunk = blocks_per_chunk or tb.BLOCKS_PER_CHUNK
    chunk = block_size * blocks_per_chunk
    tensors = list(tensors)
    device = tensors[0].device
    for t in tensors:
        if t.device != device or not tb.supports(t):
            raise ValueError(f"cannot read a {t.dtype} tensor on {t.device}")
    sources = [tb._flat_source(t) for t in tensors]
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
    tables = torch.tensor(host, dtype=torch.int64)
    partials = torch.empty((max(total_chunks, 1), NUM_COLUMNS), dtype=torch.int64, device=device)
    if out is None:
        out = torch.empty((len(tensors), NUM_COLUMNS), dtype=torch.int64, device=device)
    for dtype, aligned, n_tensors, n_chunks, base, chunk_base in plan:
        sizes = [n_tensors] * 5 + [n_chunks] * 2
        offsets = [base + sum(sizes[:k]) for k in range(len(sizes) + 1)]
        t_ptrs, t_numel, t_first, t_count, t_rows, c_tensor, c_start = (
            tables[offsets[k]: offsets[k + 1]] for k in range(len(sizes)))
        args = _old_kernel_args(dtype)
        group_partials = partials[chunk_base: chunk_base + n_chunks]
        if n_chunks:
            tb._stats_partials_kernel[(n_chunks,)](
                t_ptrs, t_numel, c_tensor, c_start, group_partials,
                LOAD_DTYPE=load_dtype[dtype], KIND=args["kind"], EXP_BITS=args["exp_bits"],
                MANT_BITS=args["mant_bits"], HAS_INF=args["has_inf"], KEY_DTYPE=args["key_dtype"],
                FLIP=args["flip"], ALIGNED=aligned, BLOCK_SIZE=block_size, BLOCKS_PER_CHUNK=blocks_per_chunk,
                num_warps=tb.NUM_WARPS)
        # the stub zeroes args[1] of a combine launch: hand it the rows (the real one takes them 6th)
        tb._stats_combine_kernel[(n_tensors,)](group_partials, out)
    return out, len(host)


# -- main ------------------------------------------------------------------------------------------

def time_per_call(f, calls, rounds):
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            f()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples), min(samples)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="1,8,64,200", help="tensors per compute() call")
    parser.add_argument("--calls", type=int, default=200, help="calls per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--csv", default=None, help="append machine-readable rows to this CSV")
    args = parser.parse_args(argv)
    if tb.triton is None:
        raise SystemExit(f"triton is needed for its kernels' constexpr types: {tb._IMPORT_ERROR}")
    load_dtype = _old_load_dtype()

    def supports(tensor):
        return tensor.device.type == "cpu" and tensor.dtype in tb.SUPPORTED_DTYPES and tensor.layout == torch.strided

    print(_results.machine_line())
    print("compute() host time per call, launches stubbed, uninitialised CPU tensors cycling through "
          + ", ".join(f"{str(d)[6:]}{list(s)}" for d, s in POOL)
          + f"; median (min) of {args.rounds} rounds of {args.calls} calls")
    print()
    print("| tensors | chunks | old us/call | new us/call | old launches | new launches | old table ints "
          "| new table ints |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    with patched(tb, "supports", supports), patched(tb, "unavailable_reason", lambda: None), \
            patched(tb, "_stats_partials_kernel", _StubKernel("partials")), \
            patched(tb, "_stats_combine_kernel", _StubKernel("combine")):
        for n in (int(c) for c in args.counts.split(",")):
            tensors = make_tensors(n)
            out = torch.empty((n, NUM_COLUMNS), dtype=torch.int64)

            def old():
                old_compute(tensors, out=out, load_dtype=load_dtype)

            def new():
                tb.compute(tensors, out=out)

            COUNT.reset()
            _, old_ints = old_compute(tensors, out=out, load_dtype=load_dtype)
            old_launches, old_programs = COUNT.launches, COUNT.programs
            COUNT.reset()
            new()
            new_launches = COUNT.launches
            assert COUNT.programs == old_programs  # one per chunk, one per tensor
            chunks = COUNT.programs - n
            new_ints = 4 * n + 1  # the table (_table)
            times = {}
            for _ in range(2):  # interleaved
                for name, f in (("old", old), ("new", new)):
                    times.setdefault(name, []).append(time_per_call(f, args.calls, max(1, args.rounds // 2)))
            (old_med, old_min), (new_med, new_min) = (
                (statistics.median(m for m, _ in times[k]), min(m for _, m in times[k])) for k in ("old", "new"))
            print(f"| {n} | {chunks} | {old_med:.1f} ({old_min:.1f}) | {new_med:.1f} ({new_min:.1f}) | "
                  f"{old_launches} | {new_launches} | {old_ints} | {new_ints} |", flush=True)
            rows += [(f"compute host old {n} tensors", old_med, "us"), (f"compute host new {n} tensors", new_med, "us"),
                     (f"launches old {n} tensors", old_launches, "per call"),
                     (f"launches new {n} tensors", new_launches, "per call")]
    _results.write_rows(args.csv, "triton_host", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
