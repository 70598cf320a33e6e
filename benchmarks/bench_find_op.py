"""What ``find_op`` costs on the normal path: a GPT-2 training step under ``watch()`` with it on
and off, and the memory its kept references hold.

- **step time:** two copies of the same model (same weights, same batches), one watched with
  ``find_op=True``, one with ``find_op=False``, stepped in alternation in one process (this
  machine's speed drifts between runs): medians over steps, and their ratio;
- **memory:** each variant in a fresh process, its peak resident set (``ru_maxrss``) over the same
  steps, medians over runs: what the references kept until a pass ends add to the peak. Also the
  bytes of the distinct storages those references reach at the end of a backward pass (most are
  activations and gradients autograd holds anyway).

    .venv/bin/python benchmarks/bench_find_op.py [--layers N] [--width W] [--batch B] [--seq S]
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _results  # noqa: E402

from overflow_fast import watch  # noqa: E402


def gpt2(layers, width, seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=max(1, width // 64), n_positions=512, vocab_size=512)
    return GPT2LMHeadModel(config)


def batches(count, batch, seq):
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 512, (batch, seq), generator=generator) for _ in range(count)]


def step(model, optimizer, ids):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def step_times(args):
    """Median ms per step with find_op on and off, stepped in alternation."""
    variants = {}
    for find_op in (True, False):
        model = gpt2(args.layers, args.width)
        watch(model, find_op=find_op)
        variants[find_op] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    times = {True: [], False: []}
    data = batches(args.steps + 2, args.batch, args.seq)
    for index, ids in enumerate(data):
        for find_op in ((True, False) if index % 2 else (False, True)):
            model, optimizer = variants[find_op]
            start = time.perf_counter()
            step(model, optimizer, ids)
            if index >= 2:  # the first steps warm up
                times[find_op].append((time.perf_counter() - start) * 1e3)
    return {find_op: statistics.median(values) for find_op, values in times.items()}


def kept_bytes(model, optimizer, ids):
    """Bytes of the distinct storages the kept references reach when a backward pass ends."""
    from overflow_fast.hooks import passes

    seen = {}
    real = passes.Passes._backward_ended

    def measured(self):
        storages = {}
        for call in self.kept_forward:
            for value in list(call.args) + list((call.kwargs or {}).values()) + [call.output]:
                for tensor in _tensors(value):
                    storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        for grad in self.kept_gradients.values():
            if grad is not None:
                storages[grad.untyped_storage().data_ptr()] = grad.untyped_storage().nbytes()
        seen["bytes"] = sum(storages.values())
        return real(self)

    passes.Passes._backward_ended = measured
    try:
        step(model, optimizer, ids)
    finally:
        passes.Passes._backward_ended = real
    return seen.get("bytes", 0)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []


def peak_child(args):
    """In a fresh process: one variant's steps, then its peak RSS (and kept bytes) as JSON."""
    find_op = args.child == "on"
    model = gpt2(args.layers, args.width)
    watch(model, find_op=find_op)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = batches(args.steps, args.batch, args.seq)
    for ids in data[:-1]:
        step(model, optimizer, ids)
    kept = kept_bytes(model, optimizer, data[-1]) if find_op else 0
    print(json.dumps({"peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "kept": kept}))
    return 0


def peaks(args):
    shared = ["--layers", str(args.layers), "--width", str(args.width), "--batch", str(args.batch),
              "--seq", str(args.seq), "--steps", str(args.steps)]
    found = {"on": [], "off": []}
    kept = []
    for _ in range(args.runs):
        for variant in ("off", "on"):
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", variant] + shared,
                                 capture_output=True, text=True, check=True)
            result = json.loads(out.stdout.splitlines()[-1])
            found[variant].append(result["peak_kib"] / 1024)
            if variant == "on":
                kept.append(result["kept"] / 2**20)
    return {variant: statistics.median(values) for variant, values in found.items()}, statistics.median(kept)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--child", choices=("on", "off"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return peak_child(args)
    print(_results.machine_line(), flush=True)
    print(f"GPT-2 {args.layers} layers, n_embd {args.width}, batch {args.batch} x {args.seq}, AdamW, "
          f"bf16 autocast, watch() (check='batch', backward=True)", flush=True)
    times = step_times(args)
    memory, kept = peaks(args)
    print("| measure | find_op on | find_op off | on / off |")
    print("|---|---|---|---|")
    print(f"| step ms (median of {args.steps}, alternated) | {times[True]:.1f} | {times[False]:.1f} | "
          f"{times[True] / times[False]:.3f} |")
    print(f"| peak RSS MiB (median of {args.runs} processes) | {memory['on']:.1f} | {memory['off']:.1f} | "
          f"{memory['on'] - memory['off']:+.1f} MiB |")
    print(f"| storages the kept references reach at backward end | {kept:.1f} MiB | - | - |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
