"""The detector's cost in a CPU forward, against its floors.

A GPT-2-style model (transformers GPT2LMHeadModel: 4 layers, n_embd 256, 4 heads, vocab 2048,
random weights: the end-to-end benchmark's sizes, with 512 positions for 384 tokens) in fp32 on
the CPU, one no_grad forward of
batch 4 x 384 tokens. Variants, each on its own copy of the model, round-robin in one process,
medians:

- ``none``: no hooks.
- ``noop hooks``: a forward hook that does nothing on every module (what hooking alone costs).
- ``read-once floor``: hooks that only collect each call's parameters, inputs and outputs, then,
  after the forward, one ``tensor_stats`` call over the distinct tensors (what any detector must
  read, read once, in one engine call: the floor of an exact detector).
- ``module`` / ``batch``: ``DebugUnderflowOverflow(model, check=...)``.

    .venv/bin/python benchmarks/bench_cpu_forward.py [--batch 4] [--seq 384] [--repeats 21] [--csv PATH]
"""

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402
import _shared  # noqa: E402

from overflow_fast import DebugUnderflowOverflow, tensor_stats  # noqa: E402

VARIANTS = ("none", "noop hooks", "read-once floor", "module", "batch")


def build():
    return _shared.gpt2(layers=4, width=256, heads=4, vocab=2048, positions=512).eval()


def attach(variant, model):
    """Hooks for ``variant``; returns what runs after each forward (None: nothing)."""
    if variant == "noop hooks":
        model.apply(lambda m: m.register_forward_hook(lambda *a: None))
    elif variant == "read-once floor":
        seen = {}

        def collect(module, args, output):
            for t in [*module._parameters.values(), *args, *(output if isinstance(output, tuple) else (output,))]:
                if isinstance(t, torch.Tensor):
                    seen[id(t)] = t

        model.apply(lambda m: m.register_forward_hook(collect))

        def read_once():
            tensor_stats(list(seen.values())).host_rows()
            seen.clear()

        return read_once
    elif variant in ("module", "batch"):
        DebugUnderflowOverflow(model, check=variant)
    return None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--csv", default=None)
    args = parser.parse_args(argv)
    print(_results.machine_line(), flush=True)
    base = build()
    ids = torch.randint(0, 2048, (args.batch, args.seq))
    steps = {}
    for variant in VARIANTS:
        model = copy.deepcopy(base)
        after = attach(variant, model)

        def step(index, model=model, after=after):
            with torch.no_grad():
                model(input_ids=ids)
            if after is not None:
                after()

        steps[variant] = step
    medians = _shared.round_robin(steps, args.repeats)
    none = medians["none"]
    print(f"GPT-2-style (4 layers, n_embd 256, vocab 2048), fp32, no_grad forward of {args.batch} x {args.seq} "
          f"tokens, {torch.get_num_threads()} threads; medians of {args.repeats} round-robin runs")
    print()
    print("| variant | forward (ms) | overhead vs none |")
    print("|---|---|---|")
    rows = []
    for v in VARIANTS:
        print(f"| {v} | {medians[v] * 1e3:.2f} | {(medians[v] / none - 1) * 100:+.1f}% |")
        rows.append((f"{v}: forward", medians[v] * 1e3, "ms"))
        rows.append((f"{v}: overhead", (medians[v] / none - 1) * 100, "%"))
    _results.write_rows(args.csv, "cpu_forward", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
