"""One command for an NVIDIA machine: is the Triton backend exact there, and how fast is it?

    python benchmarks/gpu_check.py            # about 3-5 minutes on one GPU
    python benchmarks/gpu_check.py --dry-run  # no GPU: the same code paths, tiny sizes, interpreter

Steps, in order:
1. Exactness on the device: the triton backend against the torch backend for every dtype
   (random bit patterns, special values, tails, views, empty, 0-dim, mixed-dtype batches, one
   tensor over 2**31 elements), and against the float64 oracle of tests/oracle.py on the small
   ones. Any mismatch prints it and exits with status 1 before anything is timed.
2. Device-copy bandwidth (``dst.copy_(src)`` on 1 GiB; read + write bytes over time).
3. Timings (``triton.testing.do_bench`` medians, L2 flushed between runs) of the triton backend,
   the torch backend and the reference's op sequence per tensor
   (``x.abs()``; ``f"{a.min():8.2e} {a.max():8.2e}"``; ``torch.isnan(x).any().item()``;
   ``torch.isinf(x).any().item()``) at 4K..1G elements, fp32 and bf16, and on 300 mixed
   tensors of 256..270K elements; a small sweep of the launch shape at 256M elements.
4. ``benchmarks/bench_end_to_end.py --device cuda --quick`` in a subprocess, if that file exists.
5. The summary table, last.
"""

import argparse
import math
import os
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU needed: tiny sizes on CPU through TRITON_INTERPRET=1")
    parser.add_argument("--max-numel", type=float, default=2**30, help="largest benchmarked tensor")
    parser.add_argument("--skip-e2e", action="store_true", help="do not run bench_end_to_end.py")
    parser.add_argument("--skip-sweep", action="store_true", help="do not sweep the launch shape")
    return parser.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else parse_args([])
if ARGS.dry_run:
    # the interpreter is chosen when the kernels are decorated, i.e. before the backend is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "tests"))
from oracle import random_bits, reference_stats, same_stats, special_values  # noqa: E402

from overflow_fast.stats import StatsBatch  # noqa: E402
from overflow_fast.stats import torch_backend as torch_be  # noqa: E402
from overflow_fast.stats import triton_backend as triton_be  # noqa: E402

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
]
WIDE_UNSIGNED = [getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)]


# --------------------------------------------------------------------------- exactness

class Mismatch(AssertionError):
    pass


def _dicts(rows, tensors):
    return StatsBatch([t.dtype for t in tensors], [(list(range(len(tensors))), rows)]).tolist()


def check_batch(tensors, label, oracle_max=5000):
    """Triton equals the torch backend on every tensor, and the oracle on the small ones."""
    got = _dicts(triton_be.compute(tensors), tensors)
    want = _dicts(torch_be.compute(tensors), tensors)
    for i, (g, w, t) in enumerate(zip(got, want, tensors)):
        if not same_stats(g, w):
            raise Mismatch(f"{label}[{i}] {t.dtype} {tuple(t.shape)}: triton {g} != torch backend {w}")
        if t.numel() <= oracle_max and t.dtype in _ORACLE_DTYPES:
            r = reference_stats(t.cpu())
            if not same_stats(g, r):
                raise Mismatch(f"{label}[{i}] {t.dtype} {tuple(t.shape)}: triton {g} != oracle {r}")
    return len(tensors)


_ORACLE_DTYPES = set(DTYPES)


def check_exactness(device, tiny):
    gen = torch.Generator().manual_seed(0)
    chunk = triton_be.BLOCK_SIZE * triton_be.BLOCKS_PER_CHUNK
    sizes = [1, 7, 100, 4097] if tiny else [1, 7, 100, 4097, chunk - 1, chunk + 1, 2 * chunk + 77]
    checked = 0
    for dtype in DTYPES + WIDE_UNSIGNED:
        if dtype in WIDE_UNSIGNED:
            signed = {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
            make = lambda shape: random_bits(signed, shape, gen).view(dtype)  # noqa: E731
            special = torch.tensor([0, -1, 1, torch.iinfo(signed).min], dtype=signed).view(dtype)
        else:
            make = lambda shape: random_bits(dtype, shape, gen)  # noqa: E731
            special = special_values(dtype)
        tensors = [make((n,)) for n in sizes]
        tensors += [special, torch.cat([make((chunk + 3,) if not tiny else (45,)), special])]
        tensors += [torch.empty(0, dtype=dtype), make(()), make((40, 30)).t(), make((40, 30))[:, ::7],
                    make((1001,))[1:]]
        checked += check_batch([t.to(device) for t in tensors], f"{dtype}")
    mixed = [random_bits(d, (50 + 31 * i,), gen) for i, d in enumerate(DTYPES * 2)]
    checked += check_batch([t.to(device) for t in mixed], "mixed dtypes")
    if not tiny:
        checked += check_huge(device)
    return checked


def check_huge(device):
    """A tensor over 2**31 elements, its only NaN / -inf / subnormal past element 2**31: the int64 offsets."""
    n = 2**31 + 4099
    free, _ = torch.cuda.mem_get_info()
    if free < 6 * n * 2:
        print(f"  skipped the {n}-element check: {free / 2**30:.0f} GiB free")
        return 0
    x = torch.ones(n, dtype=torch.float16, device=device)
    x[2**31 + 5] = float("nan")
    x[-1] = float("-inf")
    x[-2] = 2.0**-20
    got = _dicts(triton_be.compute([x]), [x])[0]
    want = {"abs_min": math.nan, "abs_max": math.nan, "nan": 1, "posinf": 0, "neginf": 1, "zero": 0,
            "subnormal": 1, "numel": n}
    if not same_stats(got, want):
        raise Mismatch(f"fp16 tensor of {n} elements: triton {got}, want {want}")
    x[2**31 + 5] = 3.0
    got = _dicts(triton_be.compute([x]), [x])[0]
    want.update(abs_min=2.0**-20, abs_max=math.inf, nan=0)
    if not same_stats(got, want):
        raise Mismatch(f"fp16 tensor of {n} elements: triton {got}, want {want}")
    del x
    y = torch.zeros(n, dtype=torch.int8, device=device)
    y[-1] = -128
    got = _dicts(triton_be.compute([y]), [y])[0]
    if (got["abs_max"], got["zero"]) != (128, n - 1):
        raise Mismatch(f"int8 tensor of {n} elements: {got}")
    return 3


# --------------------------------------------------------------------------- timing

def make_timer(device):
    if device.type == "cuda":
        import triton.testing

        def timer(fn):
            return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e-3
    else:
        def timer(fn):
            fn()
            samples = []
            for _ in range(3):
                start = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - start)
            return statistics.median(samples)
    return timer


def reference_ops(tensors):
    """The reference's per-tensor work: abs, formatted min/max (two syncs), nan and inf checks."""
    for x in tensors:
        a = x.abs()
        _ = f"{a.min():8.2e} {a.max():8.2e}"
        torch.isnan(x).any().item()
        torch.isinf(x).any().item()


def copy_bandwidth(device, timer, numel):
    src = torch.ones(numel, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = timer(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / seconds / 1e9, numel * 4


def fits(numel, dtype, device):
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info()
    return 8 * numel * dtype.itemsize < 0.8 * free  # the reference and torch backend make temporaries


def bench_sizes(device, timer, sizes, dtypes, copy_gbps):
    rows = []
    for dtype in dtypes:
        for numel in sizes:
            if not fits(numel, dtype, device):
                print(f"  skip {dtype} {numel}: does not fit comfortably")
                continue
            x = torch.randn(numel, device=device).to(dtype)
            t_triton = timer(lambda: triton_be.compute([x]))
            t_torch = timer(lambda: torch_be.compute([x]))
            t_ref = timer(lambda: reference_ops([x]))
            rows.append(result_row(f"{str(dtype)[6:]} x1", numel, numel * dtype.itemsize,
                                   t_triton, t_torch, t_ref, copy_gbps))
            print("  " + format_row(rows[-1]), flush=True)
            del x
    return rows


def mixed_tensors(device, count, lo, hi, seed=0):
    """A model's worth of tensors: log-uniform sizes, two thirds bf16, one third fp32."""
    rng = random.Random(seed)
    tensors = []
    for i in range(count):
        numel = int(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        dtype = torch.float32 if i % 3 == 2 else torch.bfloat16
        tensors.append(torch.randn(numel, device=device).to(dtype))
    return tensors


def bench_mixed(device, timer, tensors, copy_gbps):
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    numel = sum(t.numel() for t in tensors)
    t_triton = timer(lambda: triton_be.compute(tensors))
    t_torch = timer(lambda: torch_be.compute(tensors))
    t_ref = timer(lambda: reference_ops(tensors))
    row = result_row(f"mixed x{len(tensors)}", numel, nbytes, t_triton, t_torch, t_ref, copy_gbps)
    print("  " + format_row(row), flush=True)
    return row


def sweep_launch_shape(device, timer, numel, copy_gbps):
    """GB/s of a few (BLOCK_SIZE, NUM_WARPS) at one size: evidence for the module defaults."""
    lines = []
    saved = triton_be.BLOCK_SIZE, triton_be.NUM_WARPS
    try:
        for dtype in (torch.float32, torch.bfloat16):
            if not fits(numel, dtype, device):
                continue
            x = torch.randn(numel, device=device).to(dtype)
            for block in (2048, 4096, 8192):
                for warps in (4, 8):
                    triton_be.BLOCK_SIZE, triton_be.NUM_WARPS = block, warps
                    seconds = timer(lambda: triton_be.compute([x]))
                    gbps = numel * dtype.itemsize / seconds / 1e9
                    lines.append(f"{str(dtype)[6:]:>9} BLOCK_SIZE={block:<5} NUM_WARPS={warps}: "
                                 f"{gbps:7.0f} GB/s ({100 * gbps / copy_gbps:3.0f}% of copy)")
                    print("  " + lines[-1], flush=True)
            del x
    finally:
        triton_be.BLOCK_SIZE, triton_be.NUM_WARPS = saved
    return lines


def result_row(name, numel, nbytes, t_triton, t_torch, t_ref, copy_gbps):
    gbps = nbytes / t_triton / 1e9
    return {
        "case": name, "numel": numel, "MB": nbytes / 1e6,
        "triton_us": t_triton * 1e6, "GB/s": gbps, "%copy": 100 * gbps / copy_gbps,
        "torch_us": t_torch * 1e6, "ref_us": t_ref * 1e6,
        "x_ref": t_ref / t_triton, "x_torch": t_torch / t_triton,
    }


COLUMNS = [("case", "{:>12}"), ("numel", "{:>11}"), ("MB", "{:>9.2f}"), ("triton_us", "{:>10.1f}"),
           ("GB/s", "{:>7.0f}"), ("%copy", "{:>6.0f}"), ("torch_us", "{:>10.1f}"), ("ref_us", "{:>10.1f}"),
           ("x_ref", "{:>7.1f}"), ("x_torch", "{:>7.1f}")]


def format_row(row):
    return " ".join(fmt.format(row[key]) for key, fmt in COLUMNS)


def format_table(rows):
    header = " ".join(f"{key:>{len(fmt.format(rows[0][key])) if rows else 8}}" for key, fmt in COLUMNS)
    return "\n".join([header] + [format_row(r) for r in rows])


def run_end_to_end(device):
    script = os.path.join(HERE, "bench_end_to_end.py")
    if not os.path.exists(script):
        return "bench_end_to_end.py not found: skipped"
    result = subprocess.run([sys.executable, script, "--device", device.type, "--quick"],
                            capture_output=True, text=True, timeout=240, cwd=ROOT)
    return f"exit status {result.returncode}\n{result.stdout}{result.stderr[-3000:]}"


# --------------------------------------------------------------------------- main

def main(args):
    started = time.perf_counter()
    if args.dry_run:
        device = torch.device("cpu")
        if triton_be.unavailable_reason() is not None:
            print(f"dry run impossible: {triton_be.unavailable_reason()}")
            return 2
        sizes, mixed_spec, copy_numel, sweep_numel = [4096, 65536], (12, 256, 4000), 2**20, 0
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --dry-run to exercise this script without one")
            return 2
        if triton_be.unavailable_reason() is not None:
            print(f"the triton backend is unavailable: {triton_be.unavailable_reason()}")
            return 2
        device = torch.device("cuda")
        print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; "
              f"triton {triton_be.triton.__version__}")
        sizes = [s for s in (2**12, 2**16, 2**20, 2**24, 2**26, 2**28, 2**30) if s <= args.max_numel]
        mixed_spec, copy_numel, sweep_numel = (300, 256, 270_000), 2**28, 2**28

    print("1. exactness against the torch backend and the float64 oracle", flush=True)
    try:
        checked = check_exactness(device, tiny=args.dry_run)
    except Mismatch as error:
        print(f"EXACTNESS MISMATCH: {error}", flush=True)
        return 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"  {checked} tensors exact ({time.perf_counter() - started:.0f} s)", flush=True)

    timer = make_timer(device)
    print("2. device copy bandwidth", flush=True)
    copy_gbps, copy_bytes = copy_bandwidth(device, timer, copy_numel)
    print(f"  copy_ of {copy_bytes / 2**20:.0f} MiB: {copy_gbps:.0f} GB/s (read + write)", flush=True)

    print("3. timings (medians)", flush=True)
    rows = bench_sizes(device, timer, sizes, (torch.float32, torch.bfloat16), copy_gbps)
    rows.append(bench_mixed(device, timer, mixed_tensors(device, *mixed_spec), copy_gbps))
    sweep = [] if args.skip_sweep or not sweep_numel else sweep_launch_shape(device, timer, sweep_numel, copy_gbps)

    e2e = "skipped (dry run)" if args.dry_run else "skipped (--skip-e2e)" if args.skip_e2e else None
    if e2e is None:
        print("4. benchmarks/bench_end_to_end.py --device cuda --quick", flush=True)
        e2e = run_end_to_end(device)
        print(e2e, flush=True)

    print()
    print(f"== summary ({'DRY RUN, CPU interpreter: not GPU figures' if args.dry_run else torch.cuda.get_device_name()}; "
          f"{time.perf_counter() - started:.0f} s) ==")
    print(f"exactness: {checked} tensors equal to the torch backend (and the oracle where small)")
    print(f"copy bandwidth: {copy_gbps:.0f} GB/s; targets: >=85% of copy at >=256 MB, >=10x ref on mixed")
    if sweep:
        print("launch-shape sweep at 256M elements:\n  " + "\n  ".join(sweep))
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
