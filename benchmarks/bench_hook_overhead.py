"""Fixed cost of one hook call: 200 tiny Linear(4, 4) modules in a Sequential, so the tensors
cost nothing to read and what is left is the per-hook work (Python, dispatch, the kernel call).

    python benchmarks/bench_hook_overhead.py [--repeats N]

Prints, per detector, the median forward time and the cost per hook against no detector.
"""

import argparse
import os
import sys

import torch
from torch import nn
from transformers.debug_utils import DebugUnderflowOverflow as ReferenceDetector

from overflow_fast import DebugUnderflowOverflow

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402
import _shared  # noqa: E402

DEPTH = 200


def build(variant):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(DEPTH)])
    if variant == "reference":
        ReferenceDetector(model)
    elif variant == "module-noreuse":
        DebugUnderflowOverflow(model, check="module", reuse_stats=False)
    elif variant != "none":
        DebugUnderflowOverflow(model, check=variant)
    return model


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--csv", default=None, help="append machine-readable rows to this CSV")
    args = parser.parse_args(argv)
    variants = ("none", "reference", "module", "module-noreuse", "batch")
    models = {v: build(v) for v in variants}
    x = torch.randn(2, 4)
    with torch.no_grad():
        medians = _shared.round_robin({v: lambda index, model=model: model(x) for v, model in models.items()},
                                      args.repeats, warm_up=1)
    hooks = DEPTH + 1
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {hooks} hooks per forward, "
          f"medians of {args.repeats} round-robin runs")
    print("| detector | forward (ms) | per hook (us) |")
    print("|---|---|---|")
    for variant in variants:
        per_hook = (medians[variant] - medians["none"]) / hooks * 1e6
        print(f"| {variant} | {medians[variant] * 1e3:.2f} | {per_hook:.1f} |")
    csv_rows = []
    for variant in variants:
        csv_rows.append((f"{variant}: forward", medians[variant] * 1e3, "ms"))
        csv_rows.append((f"{variant}: per hook", (medians[variant] - medians["none"]) / hooks * 1e6, "us"))
    _results.write_rows(args.csv, "hook_overhead", csv_rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
