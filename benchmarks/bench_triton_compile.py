"""What a first use of the Triton kernels stalls for: the compile of each variant, measured here
without a GPU, and the worst stall of one call.

A variant of a kernel is compiled the first time a launch asks for it, on the launching thread, so
that call waits for it (then Triton's on-disk cache holds it for every later process on the
machine). What a variant costs grows with the formats it holds (``FORMATS``: one specialised loop
each, two where a tensor starts unaligned). The engine caps a launch's formats at
``MAX_FORMATS`` (triton_common): a call with more formats takes one launch per group of them.

Measured: ``triton.compile`` of the list kernel (K=8 slots) and of the table kernels' partials
kernel for sm_90 (an H100/H200 target, compiled without a GPU: Triton's front end, LLVM and
ptxas, all on this CPU; what a GPU machine adds is the module load, milliseconds), each variant
in a fresh Triton cache, for 1, 2, 4 and 8 formats and all of them, aligned and with an unaligned
tensor. Then the worst first-use stall of one call under the cap: a call of 8 tensors of 8
different formats, all unaligned (two variants of 4 where the cap is 4), against the same call
without the cap (one variant of 8).

Under ``TRITON_INTERPRET=1`` (this machine's tests) nothing is compiled: the interpreter runs the
kernel's Python at each launch, and ``--interpreter`` times a first and a second call of the same
shape there (the first pays the interpreter's own set-up per kernel).

    python benchmarks/bench_triton_compile.py [--quick] [--interpreter]
"""

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from _results import cpu_model  # noqa: E402


def compile_seconds(kernel, constexprs, num_warps, extra):
    """Seconds of one ``triton.compile`` of ``kernel`` with ``constexprs`` for sm_90, in a fresh cache."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    signature = {name: ("constexpr" if name in constexprs else extra.get(name, "i64")) for name in names}
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        from triton import knobs

        previous = knobs.cache.dir
        knobs.cache.dir = cache
        try:
            started = time.perf_counter()
            triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": num_warps, **extra.get("options", {})})
            return time.perf_counter() - started
        finally:
            knobs.cache.dir = previous


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1, 4 and 8 formats of the list kernel only")
    parser.add_argument("--interpreter", action="store_true", help="time first and second calls under the interpreter")
    args = parser.parse_args(argv)
    if args.interpreter:
        return interpreter()
    os.environ.pop("TRITON_INTERPRET", None)
    import torch
    import triton

    from overflow_fast.stats import triton_common, triton_kernels
    from overflow_fast.stats.triton_common import _CODE_MASK, _FORMAT_WORD, MAX_FORMATS

    codes = sorted(_FORMAT_WORD[d] & _CODE_MASK for d in _FORMAT_WORD)
    order = [torch.bfloat16, torch.float32, torch.int64, torch.bool, torch.float16, torch.float8_e4m3fn,
             torch.int32, torch.uint8]  # a model's most common first
    first = [_FORMAT_WORD[d] & _CODE_MASK for d in order if d in _FORMAT_WORD]

    def mask(count):
        chosen = first[:count] if count <= len(first) else codes
        return sum(1 << code for code in chosen)

    counts = [1, 4, 8] if args.quick else [1, 2, 3, 4, 8, len(codes)]
    print(f"# triton.compile for sm_90 on {cpu_model()} x {os.cpu_count()}; torch {torch.__version__}, "
          f"triton {triton.__version__}, Python {platform.python_version()}; MAX_FORMATS={MAX_FORMATS}")
    cap = dict(options=triton_common._REGISTER_CAP)
    results = {}
    print(f"{'kernel':>9} {'formats':>7} {'unaligned':>9} {'seconds':>8}")
    for name, kernel, constexprs, extra in (
        ("list", triton_kernels._list_kernel,
         lambda f, u: dict(K=8, FORMATS=f, ANY_UNALIGNED=u, BLOCK_SIZE=triton_common.BLOCK_SIZE,
                           BLOCKS_PER_CHUNK=triton_common.BLOCKS_PER_CHUNK), cap),
        ("partials", triton_kernels._stats_partials_kernel,
         lambda f, u: dict(FORMATS=f, ANY_UNALIGNED=u, SEARCH_STEPS=5, BLOCK_SIZE=triton_common.BLOCK_SIZE,
                           BLOCKS_PER_CHUNK=triton_common.BLOCKS_PER_CHUNK),
         dict(cap, Table_ptr="*i64", num_tensors="i64")),
    ):
        if args.quick and name != "list":
            continue
        for count in counts:
            for unaligned in (False, True):
                seconds = compile_seconds(kernel, constexprs(mask(count), unaligned), triton_common.NUM_WARPS, extra)
                results[name, count, unaligned] = seconds
                print(f"{name:>9} {min(count, len(codes)):>7} {str(unaligned):>9} {seconds:>8.1f}", flush=True)
    if not args.quick:
        worst_call(results, codes, mask, cap, constexprs_list=lambda f, u: dict(
            K=8, FORMATS=f, ANY_UNALIGNED=u, BLOCK_SIZE=triton_common.BLOCK_SIZE,
            BLOCKS_PER_CHUNK=triton_common.BLOCKS_PER_CHUNK))
    return 0


def worst_call(results, codes, mask, cap, constexprs_list):
    """The worst first-use stall of one call: the variants it compiles, each timed (a variant met
    twice is compiled once). A call of 8 tensors in 8 formats, and one of 32 tensors (4 launches,
    the most a call takes) holding all the formats, 8 different ones a launch, all unaligned."""
    from overflow_fast.stats import triton_common, triton_kernels
    from overflow_fast.stats.triton_common import MAX_FORMATS, format_groups

    launches = [codes[(8 * i) % len(codes):][:8] + codes[:max(0, 8 - len(codes[(8 * i) % len(codes):]))]
                for i in range(4)]
    for name, calls in (("8 tensors in 8 formats", [[c for c in codes if mask(8) >> c & 1]]),
                        (f"32 tensors in all {len(codes)} formats", launches)):
        variants = set()
        for launch in calls:
            every = sum(1 << code for code in launch)
            variants.update(format_groups(every, every))
        seconds = 0.0
        for formats, unaligned in sorted(variants):
            count = bin(formats).count("1")
            known = results.get(("list", count, unaligned)) if formats == mask(count) else None
            seconds += known if known is not None else compile_seconds(
                triton_kernels._list_kernel, constexprs_list(formats, unaligned), triton_common.NUM_WARPS, cap)
        whole = sum(1 << code for launch in calls for code in launch)
        uncapped = compile_seconds(triton_kernels._list_kernel, constexprs_list(whole, True), triton_common.NUM_WARPS,
                                   cap) if bin(whole).count("1") not in (8, len(codes)) else \
            results[("list", min(bin(whole).count("1"), len(codes)), True)]
        print(f"worst first-use stall, one call of {name}, all unaligned: {seconds:.1f} s under MAX_FORMATS="
              f"{MAX_FORMATS} ({len(variants)} variants of at most {MAX_FORMATS} formats), {uncapped:.1f} s as one "
              f"variant of {bin(whole).count('1')} formats (a call's formats in one variant)", flush=True)


def interpreter():
    """First and second calls of the same shapes under the interpreter (no compile)."""
    os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from overflow_fast.stats import triton_backend as tb

    tensors = [torch.randn(4096).to(d) for d in (torch.bfloat16, torch.float32, torch.float16, torch.int64,
                                                  torch.bool, torch.int32, torch.uint8, torch.float8_e4m3fn)]
    rows = torch.empty(len(tensors), 8, dtype=torch.int64)
    times = []
    for _ in range(3):
        started = time.perf_counter()
        assert tb.read_into(tensors, rows)
        times.append(time.perf_counter() - started)
    print(f"# interpreter, {cpu_model()}: read_into of 8 tensors in 8 formats: first {times[0]:.2f} s, "
          f"then median {statistics.median(times[1:]):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
