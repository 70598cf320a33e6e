"""How much faster is the C++ kernel than the reference's op sequence, and how close to a plain read?

Side by side in one process, each row times, on the same tensors:
- ref:   the reference's sequence per tensor (transformers' get_abs_min_max + detect_overflow):
         x.abs(); f"{a.min():8.2e} {a.max():8.2e}"; torch.isnan(x).any().item(); torch.isinf(x).any().item()
- torch: the torch backend (tensor_stats(..., backend="torch") rows, one host copy)
- cpu:   the C++ backend (same, backend="cpu")
- sum:   a plain read, x.sum() per tensor (the floor the kernel is measured against)
Every figure is the median of repeated runs; GB/s counts each tensor's bytes once.

    .venv/bin/python benchmarks/bench_cpu_kernel.py [--repeats N] [--threads T] [--quick]
    .venv/bin/python benchmarks/bench_cpu_kernel.py --complex    complex64/complex128 only
    .venv/bin/python benchmarks/bench_cpu_kernel.py --vs-sum     kernel / x.sum() per dtype, size, kernel build
    .venv/bin/python benchmarks/bench_cpu_kernel.py --vs-sum --only float8   the cases whose name holds "float8"
    .venv/bin/python benchmarks/bench_cpu_kernel.py --public     tensor_stats([x]) and _C.compute([x]) / x.sum()
    .venv/bin/python benchmarks/bench_cpu_kernel.py --torch-vs-ref   the torch backend / the reference's ops

``--vs-sum``: the kernel alone (``_C.compute([x])``, no host copy of the rows) against ``x.sum()``
on the same tensor with the same threads, per dtype at 256 KB (in cache) and 64 MB (out of cache),
on every kernel build this CPU runs. torch has no CPU sum for float8: their ``x.sum()`` column is
the same bytes summed as uint8 (``x.view(torch.uint8).sum()``).
"""

import argparse
import statistics
import sys
import time

import torch

from overflow_fast.stats import cpu_backend, tensor_stats, torch_backend

sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
import _results  # noqa: E402
import _shared  # noqa: E402


def plain_read(tensors):
    for x in tensors:
        x.sum()


def torch_backend_rows(tensors):
    torch_backend.compute(tensors).tolist()


def cpu_backend_rows(tensors):
    cpu_backend.compute(tensors).tolist()


METHODS = {"ref": _shared.reference_reads, "torch": torch_backend_rows, "cpu": cpu_backend_rows, "sum": plain_read}


def median_seconds(fn, tensors, repeats, min_time=0.2):
    """Median of `repeats` timings, each of enough back-to-back calls to last about min_time/repeats."""
    fn(tensors)  # warm up (allocator, thread pool)
    start = time.perf_counter()
    fn(tensors)
    once = max(time.perf_counter() - start, 1e-7)
    inner = max(1, int(min_time / repeats / once))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn(tensors)
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)


def interleaved(tensors, repeats):
    """Median seconds per method, the methods' runs interleaved so that machine noise hits all."""
    samples = {name: [] for name in METHODS}
    for _ in range(repeats):
        for name, fn in METHODS.items():
            samples[name].append(median_seconds(fn, tensors, 1, min_time=0.05))
    return {name: statistics.median(values) for name, values in samples.items()}


def realistic(numel, dtype, generator):
    # activations-like values: normal, a few exact zeros; no NaN/inf (the common, fast path)
    x = torch.randn(numel, generator=generator).mul_(3).to(dtype)
    x[:: 97] = 0
    return x


def mixed_model(generator, count=300):
    """A model's worth of tensors: sizes 256..270K elements, fp32/bf16/fp16."""
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    sizes = torch.randint(256, 270_000, (count,), generator=generator).tolist()
    return [realistic(n, dtypes[i % 3], generator) for i, n in enumerate(sizes)]


def row(label, tensors, repeats):
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    t = interleaved(tensors, repeats)
    return {
        "case": label,
        "MB": nbytes / 1e6,
        **{f"{k}_us": v * 1e6 for k, v in t.items()},
        "cpu_GBs": nbytes / t["cpu"] / 1e9,
        "sum_GBs": nbytes / t["sum"] / 1e9,
        "ref/cpu": t["ref"] / t["cpu"],
        "torch/cpu": t["torch"] / t["cpu"],
        "cpu/sum": t["cpu"] / t["sum"],
    }


def print_table(rows):
    header = (f"{'case':<26}{'MB':>8}{'ref us':>11}{'torch us':>11}{'cpu us':>10}{'sum us':>10}"
              f"{'cpu GB/s':>10}{'sum GB/s':>10}{'ref/cpu':>9}{'torch/cpu':>10}{'cpu/sum':>9}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['case']:<26}{r['MB']:>8.2f}{r['ref_us']:>11.1f}{r['torch_us']:>11.1f}{r['cpu_us']:>10.1f}"
              f"{r['sum_us']:>10.1f}{r['cpu_GBs']:>10.2f}{r['sum_GBs']:>10.2f}{r['ref/cpu']:>8.1f}x"
              f"{r['torch/cpu']:>9.1f}x{r['cpu/sum']:>8.2f}x")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: all)")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    parser.add_argument("--complex", action="store_true",
                        help="complex64 and complex128 tensors (the kernel's scalar path) instead")
    parser.add_argument("--vs-sum", action="store_true",
                        help="kernel / x.sum() per dtype and size (256 KB, 64 MB), per kernel build, instead")
    parser.add_argument("--public", action="store_true",
                        help="the public tensor_stats([x]) and the raw kernel against x.sum() on 16M fp32/bf16")
    parser.add_argument("--torch-vs-ref", action="store_true",
                        help="the torch backend against the reference's ops: 16M fp32, 300 mixed tensors")
    parser.add_argument("--only", default=None, help="--vs-sum: only the cases whose name holds this text")
    parser.add_argument("--csv", default=None, help="append machine-readable rows to this CSV")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(_results.machine_line(), flush=True)
    if args.torch_vs_ref:
        torch_vs_ref(3 if args.quick else args.repeats, args.csv)
        return
    reason = cpu_backend.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"the cpu backend is unavailable: {reason}")
    repeats = 3 if args.quick else args.repeats
    generator = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, kernel {cpu_backend._C.capability()}, "
          f"medians of {repeats} interleaved runs")
    if args.public:
        public_vs_sum(repeats, args.csv)
        return
    if args.vs_sum:
        vs_sum(repeats, args.quick, args.csv, args.only)
        return
    rows = []
    if args.complex:
        for dtype in (torch.complex64, torch.complex128):
            for numel in (65536, 1 << 20, 1 << 22):
                x = torch.randn(numel, generator=generator, dtype=dtype).mul_(3)
                x[::97] = 0
                label = f"{str(dtype).replace('torch.', '')} {numel >> 10}K" if numel < (1 << 20) else \
                    f"{str(dtype).replace('torch.', '')} {numel >> 20}M"
                rows.append(row(label, [x], repeats))
        print_table(rows)
        _results.write_rows(args.csv, "cpu_kernel_complex", csv_rows(rows))
        return
    sizes = (4096, 65536, 1 << 20, 1 << 24) if not args.quick else (4096, 1 << 24)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for numel in sizes:
            x = realistic(numel, dtype, generator)
            label = f"{str(dtype).replace('torch.', '')} {numel // 1024}K" if numel < (1 << 20) else \
                f"{str(dtype).replace('torch.', '')} {numel >> 20}M"
            rows.append(row(label, [x], repeats))
    rows.append(row("300 mixed (256..270K)", mixed_model(generator), repeats))
    print_table(rows)
    _results.write_rows(args.csv, "cpu_kernel", csv_rows(rows))


# name -> (dtype, maker(numel, generator)); the values the kernel meets in a model's tensors
def _randn(dtype):
    return lambda n, g: torch.randn(n, generator=g).mul_(3).to(dtype)


def _relu(dtype):
    # ReLU outputs: half the elements exact zeros, so every block is read a second time to count them
    return lambda n, g: torch.randn(n, generator=g).mul_(3).relu_().to(dtype)


def _every97(dtype):
    return lambda n, g: _randn(dtype)(n, g).index_fill_(0, torch.arange(0, n, 97), 0)


def _ints(dtype, bound):
    return lambda n, g: torch.randint(-bound, bound, (n,), generator=g, dtype=torch.int64).to(dtype)


VS_SUM_CASES = {
    "float32": (torch.float32, _randn(torch.float32)),
    "float16": (torch.float16, _randn(torch.float16)),
    "bfloat16": (torch.bfloat16, _randn(torch.bfloat16)),
    "float64": (torch.float64, _randn(torch.float64)),
    "float8_e4m3fn": (torch.float8_e4m3fn, _randn(torch.float8_e4m3fn)),
    "float8_e5m2": (torch.float8_e5m2, _randn(torch.float8_e5m2)),
    # AMD's: fnuz (NaN 0x80, read on unsigned lanes with its own key), e8m0fnu (a bare exponent)
    "float8_e4m3fnuz": (torch.float8_e4m3fnuz, _randn(torch.float8_e4m3fnuz)),
    "float8_e5m2fnuz": (torch.float8_e5m2fnuz, _randn(torch.float8_e5m2fnuz)),
    "float8_e8m0fnu": (torch.float8_e8m0fnu, _randn(torch.float8_e8m0fnu)),
    # int8 over its whole range: a zero every 256 elements on average, so every block holds one
    "int8": (torch.int8, _ints(torch.int8, 128)),
    "int32": (torch.int32, _ints(torch.int32, 1 << 20)),
    "int64": (torch.int64, _ints(torch.int64, 1 << 20)),
    "bool": (torch.bool, lambda n, g: torch.rand(n, generator=g) < 0.5),
    "float32 relu": (torch.float32, _relu(torch.float32)),
    "float16 relu": (torch.float16, _relu(torch.float16)),
    "bfloat16 relu": (torch.bfloat16, _relu(torch.bfloat16)),
    "bfloat16 1/97 zero": (torch.bfloat16, _every97(torch.bfloat16)),
    "float8_e4m3fn relu": (torch.float8_e4m3fn, _relu(torch.float8_e4m3fn)),
    "float8_e4m3fnuz relu": (torch.float8_e4m3fnuz, _relu(torch.float8_e4m3fnuz)),
}
# torch has no CPU sum for these: their bytes are summed as uint8
_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
           torch.float8_e8m0fnu)
VS_SUM_SIZES = {"256KB": 256 * 1024, "64MB": 64 << 20}


def _kernel(x):
    cpu_backend._C.compute([x])


def _sum(x):
    if x.dtype in _FLOAT8:
        x.view(torch.uint8).sum()
    else:
        x.sum()


def alternating_calls(fns, x, budget=0.05):
    """{name: [seconds of each call]}: the functions called in turn, one call each, each call timed
    alone, about `budget` seconds in all (at least 3 calls each). Taking turns call by call puts
    every function under the same load from other processes; on a shared machine a call whose
    OpenMP team waits for a descheduled thread stalls for a scheduler tick (~10 ms), and the
    median of single calls leaves those out, where the mean of a batch would not."""
    for fn in fns.values():
        fn(x)  # warm up (allocator, thread pool)
    start = time.perf_counter()
    for fn in fns.values():
        fn(x)
    count = max(3, int(budget / max(time.perf_counter() - start, 1e-7)))
    samples = {name: [] for name in fns}
    for _ in range(count):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn(x)
            samples[name].append(time.perf_counter() - start)
    return samples


def vs_sum(repeats, quick, csv_path, only=None):
    """kernel / x.sum() per dtype and size, on every kernel build this CPU runs: the median of
    single calls pooled over `repeats` interleaved rounds; `only`: the cases whose name holds it."""
    builds = [name for name, why in cpu_backend._C.capabilities() if not why]
    skipped = [f"{name} ({why})" for name, why in cpu_backend._C.capabilities() if why]
    cases = VS_SUM_CASES if not quick else {k: VS_SUM_CASES[k] for k in ("float32", "bfloat16", "int8")}
    if only:
        cases = {k: v for k, v in cases.items() if only in k}
    sizes = VS_SUM_SIZES if not quick else {"256KB": VS_SUM_SIZES["256KB"]}
    generator = torch.Generator().manual_seed(0)
    previous = cpu_backend._C.capability()
    print("kernel = _C.compute([x]); sum = x.sum() (float8: x.view(torch.uint8).sum()); ratio = kernel / sum; "
          f"medians of single calls, kernel and sum in turn, {repeats} rounds; builds {builds}"
          + (f"; not run: {'; '.join(skipped)}" if skipped else ""))
    header = f"{'case':<22}{'size':>7}" + "".join(f"{b + ' us':>12}{'ratio':>8}" for b in builds) + f"{'sum us':>11}"
    print(header)
    print("-" * len(header))
    out = []
    try:
        for label, (dtype, make) in cases.items():
            for size_label, nbytes in sizes.items():
                x = make(nbytes // torch.empty(0, dtype=dtype).element_size(), generator)
                kernel_samples = {b: [] for b in builds}
                sum_samples = []
                for _ in range(repeats):
                    for b in builds:
                        cpu_backend._C.set_capability(b)
                        got = alternating_calls({"kernel": _kernel, "sum": _sum}, x)
                        kernel_samples[b] += got["kernel"]
                        sum_samples += got["sum"]
                t_sum = statistics.median(sum_samples)
                line = f"{label:<22}{size_label:>7}"
                for b in builds:
                    t = statistics.median(kernel_samples[b])
                    line += f"{t * 1e6:>12.1f}{t / t_sum:>7.2f}x"
                    out.append((f"{label} {size_label}: {b} / sum", t / t_sum, "x"))
                    out.append((f"{label} {size_label}: {b}", t * 1e6, "us"))
                print(line + f"{t_sum * 1e6:>11.1f}", flush=True)
                out.append((f"{label} {size_label}: sum", t_sum * 1e6, "us"))
                del x
    finally:
        cpu_backend._C.set_capability(previous)
    _results.write_rows(csv_path, "cpu_kernel_vs_sum", out)


def _public(x):
    tensor_stats([x]).host_rows()


def _raw(x):
    cpu_backend._C.compute([x])


def public_vs_sum(repeats, csv_path):
    """The public path (``tensor_stats([x]).host_rows()``: dispatch, the output, the host copy)
    and the raw kernel against the same ``x.sum()``, calls taking turns; 16M elements."""
    generator = torch.Generator().manual_seed(0)
    print(f"public = tensor_stats([x]).host_rows(); raw = _C.compute([x]); sum = x.sum(); ratio = / sum; "
          f"medians of single calls taking turns, {repeats} rounds; 16M elements")
    header = f"{'case':<22}{'public us':>11}{'ratio':>8}{'raw us':>11}{'ratio':>8}{'sum us':>11}"
    print(header)
    print("-" * len(header))
    out = []
    for label, make in (("float32", _randn(torch.float32)), ("float32 1/97 zero", _every97(torch.float32)),
                        ("bfloat16", _randn(torch.bfloat16)), ("bfloat16 1/97 zero", _every97(torch.bfloat16))):
        x = make(1 << 24, generator)
        samples = {"public": [], "raw": [], "sum": []}
        for _ in range(repeats):
            for name, values in alternating_calls({"public": _public, "raw": _raw, "sum": _sum}, x, 0.3).items():
                samples[name] += values
        t = {name: statistics.median(values) for name, values in samples.items()}
        print(f"{label:<22}{t['public'] * 1e6:>11.1f}{t['public'] / t['sum']:>7.2f}x{t['raw'] * 1e6:>11.1f}"
              f"{t['raw'] / t['sum']:>7.2f}x{t['sum'] * 1e6:>11.1f}", flush=True)
        out += [(f"{label} 16M: public / sum", t["public"] / t["sum"], "x"),
                (f"{label} 16M: raw / sum", t["raw"] / t["sum"], "x"),
                (f"{label} 16M: sum", t["sum"] * 1e6, "us")]
    _results.write_rows(csv_path, "cpu_kernel_public_vs_sum", out)


def _torch_rows(tensors):
    torch_backend.compute(tensors).tolist()


def torch_vs_ref(repeats, csv_path):
    """The torch backend (its rows on the host) against the reference's op sequence, interleaved."""
    generator = torch.Generator().manual_seed(0)
    methods = {"ref": _shared.reference_reads, "torch": _torch_rows}
    print(f"ref = the reference's ops per tensor (abs, min, max, isnan().any(), isinf().any()); torch = "
          f"torch_backend.compute(tensors).tolist(); medians of {repeats} interleaved runs")
    header = f"{'case':<26}{'ref us':>12}{'torch us':>12}{'torch/ref':>11}"
    print(header)
    print("-" * len(header))
    cases = [("float32 16M", [realistic(1 << 24, torch.float32, generator)]),
             ("float32 16M relu", [torch.randn(1 << 24, generator=generator).relu_()]),
             ("300 mixed (256..270K)", mixed_model(generator))]
    out = []
    for label, tensors in cases:
        samples = {name: [] for name in methods}
        for _ in range(repeats):
            for name, fn in methods.items():
                samples[name].append(median_seconds(fn, tensors, 1, min_time=0.1))
        t = {name: statistics.median(values) for name, values in samples.items()}
        print(f"{label:<26}{t['ref'] * 1e6:>12.1f}{t['torch'] * 1e6:>12.1f}{t['torch'] / t['ref']:>10.2f}x", flush=True)
        out += [(f"{label}: ref", t["ref"] * 1e6, "us"), (f"{label}: torch", t["torch"] * 1e6, "us"),
                (f"{label}: torch / ref", t["torch"] / t["ref"], "x")]
    _results.write_rows(csv_path, "torch_backend_vs_ref", out)


def csv_rows(rows):
    out = []
    for r in rows:
        for key, unit in (("ref_us", "us"), ("torch_us", "us"), ("cpu_us", "us"), ("sum_us", "us"),
                          ("cpu_GBs", "GB/s"), ("ref/cpu", "x"), ("cpu/sum", "x")):
            out.append((f"{r['case']}: {key.replace('_us', '').replace('_GBs', '')}", r[key], unit))
    return out


if __name__ == "__main__":
    main()
