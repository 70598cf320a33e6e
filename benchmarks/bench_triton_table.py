"""Host time of one ``tensor_stats(tensors, out=...)`` call on the Triton path, with the table built
by the C++ loop (``_C.triton_table``) against the Python path (``_TRITON_TABLE = None``: dispatch's
per-tensor loop, ``_check_out``, ``_flat_source``, ``_table``, ``struct.pack_into``), side by side
in one process.

The tensors are those of one GPT-2 small check="batch" forward, by shape: the 148 parameters and
132 activations (batch 8 x 1024 tokens), bf16, uninitialised CPU tensors (never read). CPU
tensors are routed to the triton backend with its launches stubbed, as in bench_host_path.py
(``triton_on_cpu``); what is timed is the host work of the call.

    .venv/bin/python benchmarks/bench_triton_table.py [--rounds R] [--calls N]
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_host_path import triton_on_cpu  # noqa: E402

from overflow_fast import tensor_stats  # noqa: E402
from overflow_fast.stats import dispatch, triton_backend  # noqa: E402


def gpt2_small_tensors(batch=8, seq=1024, layers=12, embd=768, vocab=50257):
    bf16 = dict(dtype=torch.bfloat16)
    params = [torch.empty(vocab, embd, **bf16), torch.empty(1024, embd, **bf16)]
    activations = []
    for _ in range(layers):
        params += [torch.empty(embd, **bf16), torch.empty(embd, **bf16),
                   torch.empty(embd, 3 * embd, **bf16), torch.empty(3 * embd, **bf16),
                   torch.empty(embd, embd, **bf16), torch.empty(embd, **bf16),
                   torch.empty(embd, **bf16), torch.empty(embd, **bf16),
                   torch.empty(embd, 4 * embd, **bf16), torch.empty(4 * embd, **bf16),
                   torch.empty(4 * embd, embd, **bf16), torch.empty(embd, **bf16)]
        hidden = [torch.empty(batch, seq, embd, **bf16) for _ in range(9)]
        activations += hidden + [torch.empty(batch, seq, 3 * embd, **bf16), torch.empty(batch, seq, 4 * embd, **bf16)]
    params += [torch.empty(embd, **bf16), torch.empty(embd, **bf16)]
    return [torch.nn.Parameter(p, requires_grad=False) for p in params] + activations


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    tensors = gpt2_small_tensors()
    out_buffer = torch.zeros(len(tensors) + 4, 8, dtype=torch.int64)
    out = out_buffer[2:2 + len(tensors)]  # a slice of a larger buffer, as the detector's
    native = triton_backend._TRITON_TABLE
    variants = {"python": None, "c++": native}
    if native is None:
        sys.exit("overflow_fast._C is not loaded: nothing to compare")
    times = {name: [] for name in variants}
    real = {name: getattr(triton_backend, name) for name in ("scan", "_table", "_flat_source")}
    with triton_on_cpu():
        for name, function in real.items():  # without bench_host_path's counting
            setattr(triton_backend, name, function)
        for _ in range(args.rounds):
            for name, table in variants.items():
                triton_backend._TRITON_TABLE = table
                dispatch._choices.clear()
                tensor_stats(tensors, out=out)  # warm the caches of this variant
                start = time.perf_counter()
                for _ in range(args.calls):
                    tensor_stats(tensors, out=out)
                times[name].append((time.perf_counter() - start) / args.calls)
        triton_backend._TRITON_TABLE = native
        dispatch._choices.clear()
    for name, function in real.items():
        setattr(triton_backend, name, function)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"CPU {cpu}, torch {torch.__version__}, {len(tensors)} tensors, medians of {args.rounds} rounds "
          f"of {args.calls} calls")
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, median in medians.items():
        print(f"{name:>7}: {median * 1e6:8.1f} us per call, {median * 1e6 / len(tensors):6.3f} us per tensor")
    print(f"python / c++: {medians['python'] / medians['c++']:.1f}x")


if __name__ == "__main__":
    main()
