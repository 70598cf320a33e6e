"""Per-call host cost of the CPU kernel's entry points, side by side in one
process: the pybind function ``_C.compute`` (what cpu_backend and the detector's hooks call)
against the torch ops ``overflow_fast::tensor_stats`` / ``tensor_stats_out`` through the
dispatcher, and ``tensor_stats`` (the Python face) on top. 3 tiny tensors per call, the shape of a
hook's call, so the kernel's own work is negligible and the difference is pure call overhead.

    .venv/bin/python benchmarks/bench_torch_ops.py [--calls 10000] [--rounds 15]

Rounds are interleaved; the table shows the minimum and the median µs per call of each.
"""

import argparse
import os
import statistics
import sys
import time

import torch

from overflow_fast import _C, tensor_stats

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=10000)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    xs = [torch.randn(4), torch.randn(3, 2).half(), torch.randn(5)]
    out = torch.zeros(3, 8, dtype=torch.int64)
    op = torch.ops.overflow_fast.tensor_stats.default
    op_out = torch.ops.overflow_fast.tensor_stats_out.default
    candidates = {
        "_C.compute(tensors)  [pybind]": lambda: _C.compute(xs, None),
        "tensor_stats [op]": lambda: op(xs),
        "_C.compute(tensors, out)  [pybind]": lambda: _C.compute(xs, out),
        "tensor_stats_out [op]": lambda: op_out(xs, out),
        "tensor_stats(tensors)  [Python face]": lambda: tensor_stats(xs),
        "tensor_stats(tensors, out=)  [Python face]": lambda: tensor_stats(xs, out=out),
    }
    for f in candidates.values():
        f()
    times = {name: [] for name in candidates}
    for _ in range(args.rounds):
        for name, f in candidates.items():
            start = time.perf_counter()
            for _ in range(args.calls):
                f()
            times[name].append((time.perf_counter() - start) / args.calls * 1e6)
    print(_results.machine_line())
    print(f"{args.calls} calls x {args.rounds} rounds, 3 tiny tensors (fp32[4], fp16[3,2], fp32[5])")
    print("| entry point | min µs/call | median µs/call |")
    print("|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {min(values):.2f} | {statistics.median(values):.2f} |")


if __name__ == "__main__":
    main()
