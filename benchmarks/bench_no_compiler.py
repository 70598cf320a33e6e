"""What the detectors cost where the C++ kernel cannot be had (no compiler, no prebuilt build).

A GPT-2 training step (GPT2LMHeadModel from a GPT2Config: 4 layers, n_embd 256, 4 heads, vocab
2048, sequence 128, batch 4, fp32, AdamW, random weights, nothing downloaded) with: no detector,
transformers' DebugUnderflowOverflow (the reference), overflow_fast's drop-in
``DebugUnderflowOverflow(model)`` and ``watch(model)``. Every variant has its own copy of the
model (the reference's hooks cannot be removed); the variants take turns step by step in one
process; the table gives median step times and each detector's overhead over "none".

By default the kernel is made unavailable as on a machine without a compiler: ``CXX=false`` and an
empty cache folder (``OVERFLOW_FAST_CACHE_DIR``), set before overflow_fast loads, so the build is
tried, fails, and the 'torch' backend serves. ``--kernel`` leaves the environment alone (the
kernel, built or cached), for the comparison.

    .venv/bin/python benchmarks/bench_no_compiler.py [--kernel] [--steps N] [--threads T]
"""

import argparse
import copy
import functools
import os
import sys
import tempfile
import warnings


def parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", action="store_true", help="keep the C++ kernel (the comparison)")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per variant (after 2 warm-up steps)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: all)")
    parser.add_argument("--csv", default=None, help="append machine-readable rows to this CSV")
    return parser.parse_args()


ARGS = parse()
if not ARGS.kernel:  # before overflow_fast reads them
    os.environ["CXX"] = "false"
    os.environ["OVERFLOW_FAST_CACHE_DIR"] = tempfile.mkdtemp(prefix="overflow_fast_nocxx_")
    os.environ.pop("OVERFLOW_FAST_BACKEND", None)

import torch  # noqa: E402
from transformers.debug_utils import DebugUnderflowOverflow as ReferenceDetector  # noqa: E402

import overflow_fast  # noqa: E402
from overflow_fast.stats import cpu_backend  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402
import _shared  # noqa: E402

VARIANTS = ("none", "reference", "drop-in", "watch")


def attach(variant, model):
    if variant == "reference":
        ReferenceDetector(model)
    elif variant == "drop-in":
        overflow_fast.DebugUnderflowOverflow(model)
    elif variant == "watch":
        overflow_fast.watch(model)


def main():
    if ARGS.threads:
        torch.set_num_threads(ARGS.threads)
    print(_results.machine_line(), flush=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reason = cpu_backend.unavailable_reason()
    if ARGS.kernel and reason is not None:
        raise SystemExit(f"--kernel: the cpu backend is unavailable: {reason}")
    if not ARGS.kernel and reason is None:
        raise SystemExit("the C++ kernel loaded despite CXX=false and an empty cache (a prebuilt copy?)")
    print("C++ kernel: " + ("loaded" if reason is None else f"unavailable ({reason[:90]}...)"))
    for w in caught:
        print(f"warning: {str(w.message)[:160]}...")
    base = _shared.gpt2(layers=4, width=256, heads=4, vocab=2048, positions=128, bos_token_id=0, eos_token_id=0)
    base.train()
    setups = {}
    for variant in VARIANTS:
        model = copy.deepcopy(base)
        attach(variant, model)
        setups[variant] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    ids = torch.randint(0, base.config.vocab_size, (4, 128), generator=torch.Generator().manual_seed(1))

    def step(index, variant):
        model, optimizer = setups[variant]
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()

    median = _shared.round_robin({variant: functools.partial(step, variant=variant) for variant in VARIANTS},
                                 ARGS.steps)
    over = {variant: median[variant] - median["none"] for variant in VARIANTS}
    print(f"GPT-2 (4 layers, n_embd 256, vocab 2048), seq 128, batch 4, fp32, AdamW training step; "
          f"kernel {'on' if ARGS.kernel else 'off'}; medians of {ARGS.steps} steps, variants taking turns")
    print(f"{'variant':<12}{'step ms':>10}{'overhead ms':>13}{'overhead':>10}{'/ reference':>13}")
    rows = []
    for variant in VARIANTS:
        share = over[variant] / median["none"]
        versus = over[variant] / over["reference"] if variant not in ("none", "reference") else None
        print(f"{variant:<12}{median[variant] * 1e3:>10.1f}{over[variant] * 1e3:>13.1f}{share * 100:>9.0f}%"
              + (f"{versus:>12.2f}x" if versus is not None else ""))
        rows.append((f"{variant}: step", median[variant] * 1e3, "ms"))
        if versus is not None:
            rows.append((f"{variant}: overhead / reference's", versus, "x"))
    if ARGS.csv:
        _results.write_rows(ARGS.csv, "no_compiler" if not ARGS.kernel else "no_compiler_kernel", rows)


if __name__ == "__main__":
    main()
