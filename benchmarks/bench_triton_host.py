"""Host time of one ``triton_backend.compute()`` call, launches stubbed (the GPU path's
host cost), for 1, 8, 64 and 200 tensors of mixed dtypes at GPT-2-small sizes.

The tensors are uninitialised CPU tensors (virtual memory, never read): what is timed is the
host work of a call, the kernels' ``kernel[grid](...)`` calls replaced by counting stubs
(bench_host_path's). On CPU tensors the table is packed into its buffer and not uploaded (on CUDA:
into a pinned staging buffer, then one ``copy_``); that CUDA-only part is not in these figures.

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

    def supports(tensor):
        return tensor.device.type == "cpu" and tensor.dtype in tb.SUPPORTED_DTYPES and tensor.layout == torch.strided

    print(_results.machine_line())
    print("compute() host time per call, launches stubbed, uninitialised CPU tensors cycling through "
          + ", ".join(f"{str(d)[6:]}{list(s)}" for d, s in POOL)
          + f"; median (min) of {args.rounds} rounds of {args.calls} calls")
    print()
    print("| tensors | chunks | us/call | launches | table ints |")
    print("|---|---|---|---|---|")
    rows = []
    with patched(tb, "supports", supports), patched(tb, "unavailable_reason", lambda: None), \
            patched(tb, "_stats_partials_kernel", _StubKernel("partials")), \
            patched(tb, "_stats_combine_kernel", _StubKernel("combine")):
        for n in (int(c) for c in args.counts.split(",")):
            tensors = make_tensors(n)
            out = torch.empty((n, NUM_COLUMNS), dtype=torch.int64)

            def compute():
                tb.compute(tensors, out=out)

            COUNT.reset()
            compute()
            launches, chunks = COUNT.launches, COUNT.programs - n  # one program per chunk, one per tensor
            median, low = time_per_call(compute, args.calls, args.rounds)
            print(f"| {n} | {chunks} | {median:.1f} ({low:.1f}) | {launches} | {4 * n + 1} |", flush=True)
            rows += [(f"compute host {n} tensors", median, "us"), (f"launches {n} tensors", launches, "per call")]
    _results.write_rows(args.csv, "triton_host", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
