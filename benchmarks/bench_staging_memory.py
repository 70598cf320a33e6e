"""Peak memory of deferral: what check="batch" with ``defer=True`` keeps alive by reading a forward's
tensors when it ends instead of in each hook (the sound default reads in each hook).

Deferral is for accelerators (CPU tensors are read in their hooks); its memory does not depend on
the device, so it is measured here on CPU tensors with ``kinds.CPU_AS_DEVICE`` on.
Each variant runs in a fresh process: GPT-2 small (12 layers, n_embd 768, random weights) in
fp32 on the CPU, one warm-up pass, then freed memory is returned to the OS (``malloc_trim``), the
peak resident memory is reset (``/proc/self/clear_refs``) and one pass measured: the peak above
the resident memory before it (VmHWM - VmRSS). Passes:
``no_grad`` (a forward of --batch x --seq tokens: staging alone keeps the activations the forward
would free, up to ``stage_bytes``) and ``train`` (forward and backward: autograd keeps most
activations until backward anyway). Variants: no detector; check="module"; check="batch" (the
sound default, reading in each hook); check="batch", defer=True (default ``stage_bytes``,
256 MiB); and defer=True with ``stage_bytes=1 GiB``.

    .venv/bin/python benchmarks/bench_staging_memory.py [--batch 4] [--seq 384] [--csv PATH]
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _results  # noqa: E402

VARIANTS = {
    "none": None,
    "module": {"check": "module"},
    "batch, read in hooks (the default)": {"check": "batch"},
    "batch, defer=True (stage_bytes=256 MiB, the default)": {"check": "batch", "defer": True},
    "batch, defer=True (stage_bytes=1 GiB)": {"check": "batch", "defer": True, "stage_bytes": 1 << 30},
}


def _status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def child(options, mode, batch, seq):
    import ctypes

    import torch

    import _shared
    import overflow_fast.stats.kinds
    from overflow_fast import DebugUnderflowOverflow

    overflow_fast.stats.kinds.CPU_AS_DEVICE = True  # these CPU tensors stand for a GPU's
    libc = ctypes.CDLL("libc.so.6")

    model = _shared.gpt2(**_shared.GPT2_SMALL)
    if options is not None:
        DebugUnderflowOverflow(model, **options)
    ids = torch.randint(0, 50257, (batch, seq))

    def step():
        if mode == "train":
            model(ids).logits.float().mean().backward()
            model.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                model(ids)

    step()
    libc.malloc_trim(0)  # what the warm-up freed goes back to the OS: RSS is what is live
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    step()
    return _status("VmHWM") - before


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=384)
    parser.add_argument("--csv", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        options, mode = json.loads(args.child)
        print(json.dumps(child(options, mode, args.batch, args.seq)))
        return 0
    print(_results.machine_line(), flush=True)
    print(f"GPT-2 small, fp32, CPU, batch {args.batch} x {args.seq} tokens; peak resident memory of one pass "
          "above the memory before it (MB), each variant in its own process")
    print()
    print("| variant | no_grad forward (MB) | training step (MB) |")
    print("|---|---|---|")
    rows = []
    for name, options in VARIANTS.items():
        cells = []
        for mode in ("no_grad", "train"):
            out = subprocess.run([sys.executable, __file__, "--batch", str(args.batch), "--seq", str(args.seq),
                                  "--child", json.dumps([options, mode])], capture_output=True, text=True, check=True)
            peak = json.loads(out.stdout.strip().splitlines()[-1]) / 1e6
            cells.append(peak)
            rows.append((f"{name}: peak {mode}", peak, "MB"))
        print(f"| {name} | {cells[0]:.0f} | {cells[1]:.0f} |", flush=True)
    _results.write_rows(args.csv, "staging_memory", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
