"""One command for an NVIDIA machine: is the Triton backend exact there, and what does it cost?

    python benchmarks/gpu_check.py            # under 8 minutes on one H200 (--budget 420 s)
    python benchmarks/gpu_check.py --dry-run  # no GPU: the same code paths, tiny sizes, interpreter

Phases, in order, each time-boxed (a share of ``--budget`` seconds; a phase that finds the budget
spent prints a "skipped" line and its rows read "skipped (budget)"):
1. Exactness on the device: the triton backend against the torch backend for every dtype
   (random bit patterns, special values, tails, views, empty, 0-dim, mixed-dtype batches, one
   tensor over 2**31 elements), against the CPU backend (the C++ kernel, on host copies; when
   it is built) and against the float64 oracle of tests/oracle.py on the small ones. Any mismatch
   prints it and exits with status 1 before anything is timed.
2. Device-copy bandwidth (``dst.copy_(src)`` on 1 GiB; read + write bytes over time), then
   timings (``triton.testing.do_bench`` medians, L2 flushed between runs) of the triton backend,
   the torch backend and the reference's op sequence per tensor
   (``x.abs()``; ``f"{a.min():8.2e} {a.max():8.2e}"``; ``torch.isnan(x).any().item()``;
   ``torch.isinf(x).any().item()``) at 4K..1G elements, fp32 and bf16, and on 300 mixed
   tensors of 256..270K elements.
3. Host us per hook on the device: GPT-2 small's hook sequence (12 layers, n_embd 768, 12 heads,
   bf16, batch 8 x 1024, no grad) recorded on the meta device and replayed on zero-filled device
   tensors with benchmarks/bench_host_path.py's machinery (``record``, ``materialize``,
   ``replay``, ``attach``, ``measure``), ``torch.cuda.synchronize()`` after each replayed forward:
   (replay time - replay time without hooks) / hooks, for check="module", check="batch" and
   ``watch()`` (forward hooks only). The kernels run for real, so this is the wall time a hook adds
   when nothing overlaps it.
4. Training-step overhead on GPT-2 small (random weights from a config, nothing downloaded), bf16,
   batch 8 x 1024, AdamW: no detector, the reference (transformers' DebugUnderflowOverflow),
   check="module", check="batch" and ``watch()``, each on its own copy of the model; medians of
   round-robin steps after warm-up, ``torch.cuda.synchronize()`` around each step; peak memory
   per variant.
5. A small sweep of the launch shape at 256M elements (``--skip-sweep``), and with ``--e2e``
   ``benchmarks/bench_end_to_end.py --device cuda --quick`` in a subprocess, if budget is left.
6. The kernel table, then the summary table (markdown, for RESULTS.md), last.

``--dry-run`` runs every phase on the CPU: the kernels through ``TRITON_INTERPRET=1``, the host
phase with the Triton launches stubbed (bench_host_path.triton_on_cpu), a 1-layer tiny GPT-2,
batch 2 x 16, 2 steps; every figure in its table is marked "dry-run" (not GPU figures).
"""

import argparse
import contextlib
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
    parser.add_argument("--budget", type=float, default=420.0,
                        help="seconds for the whole run; each phase gets a share, later ones what is left")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed round-robin training steps per variant (default 8; dry run 2)")
    parser.add_argument("--skip-host", action="store_true", help="do not measure host us per hook")
    parser.add_argument("--skip-train", action="store_true", help="do not measure the training step")
    parser.add_argument("--skip-sweep", action="store_true", help="do not sweep the launch shape")
    parser.add_argument("--e2e", action="store_true",
                        help="also run bench_end_to_end.py --device cuda --quick if budget is left")
    parser.add_argument("--skip-e2e", action="store_true", help=argparse.SUPPRESS)  # the default now
    return parser.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else parse_args([])
if ARGS.dry_run:
    # the interpreter is chosen when the kernels are decorated, i.e. before the backend is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import copy  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "tests"))
if ROOT not in sys.path:
    sys.path.append(ROOT)  # overflow_fast from this checkout when it is not installed
from oracle import random_bits, reference_stats, same_stats, special_values  # noqa: E402

from overflow_fast.stats import StatsBatch  # noqa: E402
from overflow_fast.stats import cpu_backend as cpu_be  # noqa: E402
from overflow_fast.stats import torch_backend as torch_be  # noqa: E402
from overflow_fast.stats import triton_backend as triton_be  # noqa: E402

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
    torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu,  # AMD's fp8 formats
]
WIDE_UNSIGNED = [getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)]


# --------------------------------------------------------------------------- exactness

class Mismatch(AssertionError):
    pass


def _dicts(rows, tensors):
    return StatsBatch([t.dtype for t in tensors], [(list(range(len(tensors))), rows)]).tolist()


EXACT = {"cpu": 0}  # tensors also compared with the CPU backend


def _cpu_backend_dicts(tensors):
    """The CPU backend's statistics of host copies of the tensors it supports: {index: dict}."""
    if cpu_be.unavailable_reason() is not None:
        return {}
    index = [i for i, t in enumerate(tensors) if t.dtype in cpu_be.SUPPORTED_DTYPES]
    host = [tensors[i].cpu() for i in index]
    return dict(zip(index, _dicts(cpu_be.compute(host), host))) if host else {}


def check_batch(tensors, label, oracle_max=5000):
    """Triton equals the torch backend and the CPU backend on every tensor, and the oracle on the
    small ones."""
    table_rows = triton_be.compute(tensors)
    got = _dicts(table_rows, tensors)
    want = _dicts(torch_be.compute(tensors), tensors)
    if len(tensors) <= triton_be.MAX_SLOTS * triton_be.MAX_READ_LAUNCHES:
        read_rows = _read_rows(tensors)
        if not torch.equal(read_rows, table_rows):
            bad = next(i for i in range(len(tensors)) if not torch.equal(read_rows[i], table_rows[i]))
            raise Mismatch(f"{label}[{bad}] {tensors[bad].dtype} {tuple(tensors[bad].shape)}: per-hook kernel "
                           f"{read_rows[bad].tolist()} != table kernels {table_rows[bad].tolist()}")
    on_cpu = _cpu_backend_dicts(tensors)
    EXACT["cpu"] += len(on_cpu)
    for i, (g, w, t) in enumerate(zip(got, want, tensors)):
        if not same_stats(g, w):
            raise Mismatch(f"{label}[{i}] {t.dtype} {tuple(t.shape)}: triton {g} != torch backend {w}")
        if i in on_cpu and not same_stats(g, on_cpu[i]):
            raise Mismatch(f"{label}[{i}] {t.dtype} {tuple(t.shape)}: triton {g} != cpu backend {on_cpu[i]}")
        if t.numel() <= oracle_max and t.dtype in _ORACLE_DTYPES:
            r = reference_stats(t.cpu())
            if not same_stats(g, r):
                raise Mismatch(f"{label}[{i}] {t.dtype} {tuple(t.shape)}: triton {g} != oracle {r}")
    return len(tensors)


_ORACLE_DTYPES = set(DTYPES)


def _read_rows(tensors):
    """The per-hook kernel's rows (``read_into``, whatever the device's self-check said)."""
    rows = torch.full((len(tensors), 8), -1, dtype=torch.int64, device=tensors[0].device)
    state = triton_be._DEVICES.get((rows.device.type, rows.device.index)) or triton_be.check_device(rows.device)
    if not triton_be._read(tensors, rows, state):
        raise Mismatch(f"the per-hook kernel did not take {len(tensors)} tensors")
    return rows


def _readable(dtype, device):
    """Whether the Triton backend takes ``dtype`` and the torch backend (the reference here) can
    read it on ``device``."""
    probe = torch.zeros(2, dtype=dtype, device=device)
    if not triton_be.supports(probe):  # an overflow_fast older than this script
        return False
    try:
        torch_be.compute([probe])
        return True
    except Exception:  # e.g. no float8 -> float32 copy kernel for this dtype on this device
        return False


def check_exactness(device, tiny, deadline=math.inf):
    """Tensors checked, and whether every case ran (False: the phase's time ran out; at least one
    dtype is always checked)."""
    gen = torch.Generator().manual_seed(0)
    chunk = triton_be.BLOCK_SIZE * triton_be.BLOCKS_PER_CHUNK
    sizes = [1, 7, 100, 4097] if tiny else [1, 7, 100, 4097, chunk - 1, chunk + 1, 2 * chunk + 77]
    checked = 0
    dtypes = [dtype for dtype in DTYPES if _readable(dtype, device)]
    for dtype in sorted(set(DTYPES) - set(dtypes), key=str):
        print(f"  {dtype}: skipped, not readable by the triton or the torch backend on {device}")
    for dtype in dtypes + WIDE_UNSIGNED:
        if checked and time.perf_counter() > deadline:
            print(f"  time box spent: stopped before {dtype}")
            return checked, False
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
    mixed = [random_bits(d, (50 + 31 * i,), gen) for i, d in enumerate(dtypes * 2)]
    checked += check_batch([t.to(device) for t in mixed], "mixed dtypes")
    if not tiny:
        if time.perf_counter() > deadline:
            print("  time box spent: the tensor over 2**31 elements was not checked")
            return checked, False
        checked += check_huge(device)
    return checked, True


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
    if not torch.equal(_read_rows([x]), triton_be.compute([x])):
        raise Mismatch(f"fp16 tensor of {n} elements: the per-hook kernel differs from the table kernels")
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


def bench_sizes(device, timer, sizes, dtypes, copy_gbps, deadline=math.inf):
    rows = []
    for dtype in dtypes:
        for numel in sizes:
            if time.perf_counter() > deadline:
                print(f"  skip {dtype} {numel}: time box spent")
                continue
            if not fits(numel, dtype, device):
                print(f"  skip {dtype} {numel}: does not fit comfortably")
                continue
            x = torch.randn(numel, device=device).to(dtype)
            out = torch.empty(1, 8, dtype=torch.int64, device=device)
            t_triton = timer(lambda x=x, out=out: triton_be.read_into([x], out))  # the per-hook kernel
            t_torch = timer(lambda x=x: torch_be.compute([x]))
            t_ref = timer(lambda x=x: reference_ops([x]))
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


def sweep_launch_shape(device, timer, numel, copy_gbps, deadline=math.inf):
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
                    if time.perf_counter() > deadline:
                        lines.append(f"{str(dtype)[6:]:>9} BLOCK_SIZE={block:<5} NUM_WARPS={warps}: skipped, time box spent")
                        continue
                    triton_be.BLOCK_SIZE, triton_be.NUM_WARPS = block, warps
                    seconds = timer(lambda x=x: triton_be.compute([x]))
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


def run_end_to_end(device, timeout):
    script = os.path.join(HERE, "bench_end_to_end.py")
    if not os.path.exists(script):
        return "bench_end_to_end.py not found: skipped"
    try:
        result = subprocess.run([sys.executable, script, "--device", device.type, "--quick"],
                                capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return f"stopped after {timeout:.0f} s (time box)"
    return f"exit status {result.returncode}\n{result.stdout}{result.stderr[-3000:]}"


# --------------------------------------------------------------------------- GPT-2: host and training step

HOST_VARIANTS = ("none", "module", "batch", "watch", "defer")
TRAIN_VARIANTS = ("none", "reference", "module", "batch", "watch", "defer", "compiled", "compiled reduce-overhead")


def gpt2_config(tiny):
    import transformers

    if tiny:  # the dry run: 1 layer, everything small
        return transformers.GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=512, n_positions=64,
                                       bos_token_id=0, eos_token_id=0)
    return transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _zero_storages(values, seen):
    """Fill the storage under every tensor in ``values`` (nested tuples, lists, dicts) with zero
    bytes: uninitialised device memory may hold nan/inf bit patterns the detector would report."""
    if isinstance(values, torch.Tensor):
        storage = values.untyped_storage()
        if storage.data_ptr() not in seen and storage.nbytes():
            seen.add(storage.data_ptr())
            storage.fill_(0)
    elif isinstance(values, (tuple, list)):
        for value in values:
            _zero_storages(value, seen)
    elif isinstance(values, dict):
        for value in values.values():
            _zero_storages(value, seen)


def host_per_hook(device, tiny, batch, seq, repeats, inner, deadline):
    """Phase 3: {variant: (us per hook, compute() calls per forward, us per hook inside compute())},
    the number of hooks and the no-hook replay time (s)."""
    import bench_host_path as hp

    config = gpt2_config(tiny)
    import transformers

    with torch.device("meta"):
        meta_model = transformers.GPT2LMHeadModel(config).to(torch.bfloat16).eval()
    ids = torch.zeros((batch, seq), dtype=torch.long, device="meta")

    def forward():
        with torch.no_grad():
            meta_model(input_ids=ids)

    events, ops = hp.record(meta_model, forward)
    target = "cpu" if device.type != "cuda" else device
    model = copy.deepcopy(meta_model).to_empty(device=target)  # the same tree, on the device
    events = hp.materialize(events, empty_on=target)
    if device.type == "cuda":
        seen = set()
        for _, _, args, kwargs, output in events:
            _zero_storages((args, kwargs, output), seen)
        _zero_storages(list(model.parameters()) + list(model.buffers()), seen)
    hooks = sum(1 for event in events if event[0] == "post")
    print(f"  {hooks} hooks, {ops} ATen ops per forward ({config.n_layer} layers, n_embd {config.n_embd}, "
          f"batch {batch} x {seq}, bf16)", flush=True)

    def run():
        hp.replay(model, events)
        _sync(device)

    results = {}
    # the dry run: CPU tensors through the triton backend's host path, launches stubbed
    routing = hp.triton_on_cpu() if device.type != "cuda" else contextlib.nullcontext()
    with routing:
        times = {v: [] for v in HOST_VARIANTS}
        for round_ in range(repeats):  # round-robin rounds, stopped by the time box after the first
            if round_ and time.perf_counter() > deadline:
                print(f"  time box spent after {round_} rounds")
                break
            for variant, seconds in hp.measure(model, run, HOST_VARIANTS, 1, inner).items():
                times[variant].append(seconds)
        medians = {v: statistics.median(t) for v, t in times.items()}
        for variant in HOST_VARIANTS[1:]:
            launches = [0]
            real_read, real_table = triton_be._launch_read, triton_be._launch

            def read_launch(*a, **k):
                launches[0] += 1
                return real_read(*a, **k)

            def table_launch(*a, **k):
                launches[0] += 2
                return real_table(*a, **k)

            if device.type == "cuda":
                triton_be._launch_read, triton_be._launch = read_launch, table_launch
            try:
                counts = hp.counted(model, run, variant, passes=1)
            finally:
                triton_be._launch_read, triton_be._launch = real_read, real_table
            counts["launches"] = max(counts["launches"], launches[0])
            per_hook = (medians[variant] - medians["none"]) / hooks * 1e6
            results[variant] = (per_hook, counts["compute_calls"], counts["compute_s"] / hooks * 1e6, counts["launches"])
            print(f"  {variant}: {medians[variant] * 1e3:.2f} ms per replayed forward, {per_hook:.1f} us/hook, "
                  f"{counts['compute_calls']} compute() calls, {results[variant][2]:.1f} us/hook inside compute()",
                  flush=True)
    return results, hooks, medians["none"]


def _attach_train(variant, model):
    import overflow_fast

    if variant == "reference":
        from transformers.debug_utils import DebugUnderflowOverflow as ReferenceDetector

        ReferenceDetector(model)  # its hooks cannot be removed: this copy keeps them
        return model
    elif variant in ("module", "batch"):
        overflow_fast.DebugUnderflowOverflow(model, check=variant)
    elif variant == "watch":
        overflow_fast.watch(model)
    elif variant == "defer":
        overflow_fast.DebugUnderflowOverflow(model, check="batch", defer=True)
    elif variant == "compiled":
        overflow_fast.DebugUnderflowOverflow(model, check="batch")
        return torch.compile(model)
    elif variant == "compiled reduce-overhead":
        overflow_fast.DebugUnderflowOverflow(model, check="batch")
        return torch.compile(model, mode="reduce-overhead")
    elif variant != "none":
        raise ValueError(variant)
    return model


def train_step_overhead(device, tiny, batch, seq, warmup, steps, deadline):
    """Phase 4: {variant: (median seconds per step or None, peak bytes or None, note)}."""
    import transformers

    config = gpt2_config(tiny)
    torch.manual_seed(0)
    with torch.device(device):
        base = transformers.GPT2LMHeadModel(config)
    base = base.to(torch.bfloat16).train()
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    print(f"  GPT-2 {sum(p.numel() for p in base.parameters()) / 1e6:.1f}M parameters "
          f"({config.n_layer} layers, n_embd {config.n_embd}), bf16, batch {batch} x {seq}, AdamW", flush=True)
    runs, notes, peaks = {}, {}, {}
    for variant in TRAIN_VARIANTS:
        model = copy.deepcopy(base)
        forward = _attach_train(variant, model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def step(forward=forward, optimizer=optimizer):
            optimizer.zero_grad(set_to_none=True)
            forward(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()

        runs[variant] = step
    del base
    times = {v: [] for v in TRAIN_VARIANTS}

    def timed(variant):
        step = runs[variant]
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        try:
            step()
            _sync(device)
        except Exception as error:  # a detection (ValueError) or anything else: report, go on
            notes[variant] = f"raised {type(error).__name__}: {str(error).splitlines()[0][:80]}"
            del runs[variant]
            return None
        if device.type == "cuda":
            peaks[variant] = max(peaks.get(variant, 0), torch.cuda.max_memory_allocated())
        return time.perf_counter() - start

    for _ in range(warmup):  # allocator, kernels' compilation, lazy buffers
        for variant in list(runs):
            timed(variant)
    for round_ in range(steps):
        if round_ and time.perf_counter() > deadline:
            print(f"  time box spent after {round_} rounds")
            break
        for variant in list(runs):
            seconds = timed(variant)
            if seconds is not None:
                times[variant].append(seconds)
    results = {}
    for variant in TRAIN_VARIANTS:
        median = statistics.median(times[variant]) if times[variant] else None
        results[variant] = (median, peaks.get(variant), notes.get(variant, f"median of {len(times[variant])} steps"))
        shown = f"{median * 1e3:.1f} ms" if median is not None else "-"
        print(f"  {variant}: {shown} ({results[variant][2]})", flush=True)
    runs.clear()
    return results


# --------------------------------------------------------------------------- the budget and the table

class Budget:
    """``--budget`` seconds from the start; a phase gets ``share`` of the total, at most what is left."""

    def __init__(self, seconds):
        self.total = seconds
        self.start = time.perf_counter()

    def left(self):
        return self.total - (time.perf_counter() - self.start)

    def deadline(self, share):
        return time.perf_counter() + max(0.0, min(self.left(), share * self.total))

    def skip(self, label, need=1.0):
        """True (and a printed line) when less than ``need`` seconds are left for phase ``label``."""
        if self.left() >= need:
            return False
        print(f"{label}: skipped, budget spent ({max(self.left(), 0):.0f} s of {self.total:.0f} s left)", flush=True)
        return True


SKIPPED = "skipped (budget)"


def summary_table(rows, source):
    """Markdown: ``| measure | value | detail | run |`` with ``run`` = ``source`` on every row."""
    lines = ["| measure | value | detail | run |", "|---|---|---|---|"]
    lines += [f"| {measure} | {value} | {detail} | {source} |" for measure, value, detail in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------- main

def main(args):
    started = time.perf_counter()
    budget = Budget(args.budget)
    if args.dry_run:
        device = torch.device("cpu")
        if triton_be.unavailable_reason() is not None:
            print(f"dry run impossible: {triton_be.unavailable_reason()}")
            return 2
        sizes, mixed_spec, copy_numel, sweep_numel = [4096, 65536], (12, 256, 4000), 2**20, 0
        host_shape, host_repeats, host_inner = (2, 16), 3, 1
        train_shape, warmup, steps = (2, 16), 1, args.steps or 2
        source = "dry-run (CPU, not GPU figures)"
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --dry-run to exercise this script without one")
            return 2
        if triton_be.unavailable_reason() is not None:
            print(f"the triton backend is unavailable: {triton_be.unavailable_reason()}")
            return 2
        device = torch.device("cuda")
        print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; "
              f"triton {triton_be.triton.__version__}; budget {args.budget:.0f} s")
        sizes = [s for s in (2**12, 2**16, 2**20, 2**24, 2**26, 2**28, 2**30) if s <= args.max_numel]
        mixed_spec, copy_numel, sweep_numel = (300, 256, 270_000), 2**28, 2**28
        host_shape, host_repeats, host_inner = (8, 1024), 5, 3
        train_shape, warmup, steps = (8, 1024), 2, args.steps or 8
        source = torch.cuda.get_device_name()
    cpu_note = ("cpu backend" if cpu_be.unavailable_reason() is None
                else f"not the cpu backend ({cpu_be.unavailable_reason()})")
    table = []

    print(f"1. exactness against the torch backend, the {cpu_note} and the float64 oracle", flush=True)
    try:
        checked, complete = check_exactness(device, tiny=args.dry_run, deadline=budget.deadline(0.30))
    except Mismatch as error:
        print(f"EXACTNESS MISMATCH: {error}", flush=True)
        return 1
    _sync(device)
    print(f"  {checked} tensors exact, {EXACT['cpu']} of them also against the cpu backend "
          f"({time.perf_counter() - started:.0f} s)", flush=True)
    table.append(("exactness", f"{checked} tensors exact, 0 mismatches" + ("" if complete else " (time box: partial)"),
                  f"triton = torch backend = oracle (small ones); = cpu backend on {EXACT['cpu']}"
                  + ("" if cpu_be.unavailable_reason() is None else f" ({cpu_note})")))

    # the per-hook kernel's self-check, as on a device's first use, then again with its kernels compiled
    for attempt in ("first use", "warm"):
        triton_be.forget_devices()
        state = triton_be.check_device(device, read=None if device.type == "cuda" else triton_be._read)
        print(f"  self-check ({attempt}): {state.self_check}, {state.check_ms:.0f} ms; path {state.path}; "
              f"launch {state.launch}", flush=True)
    table.append(("self-check", state.self_check,
                  f"{state.check_ms:.1f} ms with its kernels compiled (target <= 50 ms); path {state.path}; "
                  f"launch {state.launch}"))
    if state.path != triton_be.PER_HOOK:
        print(f"SELF-CHECK FAILED: {state.self_check}", flush=True)
        return 1

    timer = make_timer(device)
    rows, copy_gbps = [], None
    if not budget.skip("2. bandwidth"):
        deadline = budget.deadline(0.20)
        print("2. device copy bandwidth, then kernel timings (medians)", flush=True)
        copy_gbps, copy_bytes = copy_bandwidth(device, timer, copy_numel)
        print(f"  copy_ of {copy_bytes / 2**20:.0f} MiB: {copy_gbps:.0f} GB/s (read + write)", flush=True)
        table.append(("copy bandwidth", f"{copy_gbps:.0f} GB/s", f"dst.copy_(src), {copy_bytes / 2**20:.0f} MiB fp32, read + write"))
        rows = bench_sizes(device, timer, sizes, (torch.float32, torch.bfloat16), copy_gbps, deadline)
        if time.perf_counter() < deadline:
            rows.append(bench_mixed(device, timer, mixed_tensors(device, *mixed_spec), copy_gbps))
        largest = {}
        for row in rows:
            largest[row["case"]] = row  # sizes ascend: the last one of a case is its largest
        for case, row in largest.items():
            table.append((f"bandwidth {case.strip()} {row['numel']}",
                          f"{row['GB/s']:.0f} GB/s ({row['%copy']:.0f}% of copy)",
                          f"triton {row['triton_us']:.1f} us; {row['x_torch']:.1f}x faster than the torch backend, "
                          f"{row['x_ref']:.1f}x than the reference's ops"))
    else:
        table += [("copy bandwidth", SKIPPED, ""), ("bandwidth", SKIPPED, "")]

    if args.skip_host:
        table += [(f"host us/hook {v}", "skipped (--skip-host)", "") for v in HOST_VARIANTS[1:]]
    elif not budget.skip("3. host us per hook"):
        print(f"3. host us per hook: GPT-2 {'tiny' if args.dry_run else 'small'} hook sequence replayed on "
              f"{device.type} tensors" + (" (triton launches stubbed)" if args.dry_run else ""), flush=True)
        host, hooks, none_s = host_per_hook(device, args.dry_run, *host_shape, host_repeats, host_inner,
                                            budget.deadline(0.12))
        for variant, (per_hook, calls, in_compute, launches) in host.items():
            table.append((f"host us/hook {variant}", f"{per_hook:.1f} us",
                          f"{hooks} hooks, batch {host_shape[0]} x {host_shape[1]}, synced replay "
                          f"(no hooks: {none_s * 1e3:.2f} ms); {calls} engine calls and {launches} launches per "
                          f"forward, {in_compute:.1f} us/hook inside the engine"))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    else:
        table += [(f"host us/hook {v}", SKIPPED, "") for v in HOST_VARIANTS[1:]]

    if args.skip_train:
        table += [(f"train step {v}", "skipped (--skip-train)", "") for v in TRAIN_VARIANTS]
    elif not budget.skip("4. training step"):
        print(f"4. training step, GPT-2 {'tiny' if args.dry_run else 'small'}: "
              + ", ".join(TRAIN_VARIANTS), flush=True)
        train = train_step_overhead(device, args.dry_run, *train_shape, warmup, steps, budget.deadline(0.30))
        base = train["none"][0]
        for variant, (median, peak, note) in train.items():
            if median is None:
                value = "-"
            elif variant == "none" or base is None:
                value = f"{median * 1e3:.1f} ms"
            else:
                value = f"{median * 1e3:.1f} ms ({100 * (median / base - 1):+.1f}%)"
            detail = f"bf16, batch {train_shape[0]} x {train_shape[1]}, AdamW; {note}"
            if peak is not None:
                detail += f"; peak {peak / 2**30:.1f} GiB"
            table.append((f"train step {variant}", value, detail))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    else:
        table += [(f"train step {v}", SKIPPED, "") for v in TRAIN_VARIANTS]

    sweep = []
    if not args.skip_sweep and sweep_numel and copy_gbps and not budget.skip("5. launch-shape sweep", 10):
        print("5. launch-shape sweep", flush=True)
        sweep = sweep_launch_shape(device, timer, sweep_numel, copy_gbps, budget.deadline(1.0))

    if args.e2e and not args.dry_run and not budget.skip("6. bench_end_to_end.py", 30):
        print("6. benchmarks/bench_end_to_end.py --device cuda --quick", flush=True)
        print(run_end_to_end(device, max(budget.left(), 1)), flush=True)

    elapsed = time.perf_counter() - started
    print()
    print(f"== summary ({'DRY RUN, CPU interpreter: not GPU figures' if args.dry_run else torch.cuda.get_device_name()}; "
          f"{elapsed:.0f} s of a {args.budget:.0f} s budget) ==")
    if sweep:
        print("launch-shape sweep at 256M elements:\n  " + "\n  ".join(sweep))
    if rows:
        print("targets: >=85% of copy at >=256 MB, >=10x ref on mixed")
        print(format_table(rows))
        print()
    print(summary_table(table, source))
    if os.environ.get("OUT"):  # the lent machine's folder of results
        with open(os.path.join(os.environ["OUT"], "gpu_check.md"), "w") as f:
            f.write(summary_table(table, source) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
