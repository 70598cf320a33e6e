"""What ``find_op`` costs on the normal path, in training and in evaluation: step time and peak
memory under ``watch()`` with it on and off (and, for memory, with no detector at all).

- **training:** a GPT-2 step (bf16 autocast, AdamW); **evaluation:** a forward under
  ``torch.no_grad()`` of an MLP (``--eval-layers`` x Linear(``--eval-width``) + GELU on
  ``--eval-rows`` rows: by default the 24 x 2048 x 512 of the issue that found evaluation keeping
  every activation alive);
- **step time:** two copies of the same model (same weights, same batches), one watched with
  ``find_op=True``, one with ``find_op=False``, stepped in alternation in one process (this
  machine's speed drifts between runs): medians over steps, and their ratio;
- **memory:** each variant in a fresh process, its peak resident set above a warm baseline (the
  model, the detector, one small warm-up step done; the peak is reset there through
  ``/proc/self/clear_refs``), medians over runs. glibc's mmap threshold is fixed
  (``MALLOC_MMAP_THRESHOLD_``) so that freed tensors leave the resident set at once: the figure is
  what is held, not the allocator's heap. Also, in training, the bytes of the distinct storages the
  kept references reach at the end of a backward pass (most are activations and gradients autograd
  holds anyway).

    .venv/bin/python benchmarks/bench_find_op.py [--layers N] [--width W] [--batch B] [--seq S]
        [--eval-layers N] [--eval-width W] [--eval-rows R] [--steps N] [--runs N]
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _results  # noqa: E402
import _shared  # noqa: E402

from overflow_fast import watch  # noqa: E402

MMAP_THRESHOLD = str(64 << 10)


def gpt2(layers, width, seed=0):
    return _shared.gpt2(layers, width, heads=max(1, width // 64), vocab=512, positions=512, seed=seed)


def mlp(layers, width, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[module for _ in range(layers)
                                 for module in (torch.nn.Linear(width, width), torch.nn.GELU())])


def batches(count, batch, seq):
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 512, (batch, seq), generator=generator) for _ in range(count)]


def train_step(model, optimizer, ids):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class Variant:
    """One model under ``watch(find_op=...)`` (``find_op`` None: no detector) in one mode, and its step."""

    def __init__(self, args, mode, find_op):
        self.mode = mode
        if mode == "train":
            self.model = gpt2(args.layers, args.width)
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
            self.data = batches(args.steps + 2, args.batch, args.seq)
        else:
            self.model = mlp(args.eval_layers, args.eval_width)
            generator = torch.Generator().manual_seed(1)
            self.data = [torch.randn(args.eval_rows, args.eval_width, generator=generator)
                         for _ in range(2)]
        if find_op is not None:
            watch(self.model, find_op=find_op)

    def step(self, index):
        batch = self.data[index % len(self.data)]
        if self.mode == "train":
            train_step(self.model, self.optimizer, batch)
        else:
            with torch.no_grad():
                self.model(batch)

    def warm_up(self):
        """One small step: every lazy allocation (optimizer state, the detector's buffers) is made."""
        if self.mode == "train":
            train_step(self.model, self.optimizer, self.data[0][:1, :8])
        else:
            with torch.no_grad():
                self.model(self.data[0][:1])


def step_times(args, mode):
    """Median ms per step with find_op on and off, stepped in alternation."""
    variants = {find_op: Variant(args, mode, find_op) for find_op in (False, True)}
    medians = _shared.round_robin({find_op: variant.step for find_op, variant in variants.items()}, args.steps)
    return {find_op: seconds * 1e3 for find_op, seconds in medians.items()}


def kept_bytes(variant):
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
        variant.step(0)
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


def _status_kib(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return None


def _reset_peak():
    """Reset the resident set's peak (VmHWM) to now; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_child(args):
    """In a fresh process: one variant's steps, then its peak resident set above the warm baseline
    (and, training with find_op, the kept bytes) as JSON."""
    find_op = {"on": True, "off": False, "none": None}[args.child]
    variant = Variant(args, args.mode, find_op)
    variant.warm_up()
    baseline = _status_kib("VmRSS")
    exact = _reset_peak()
    for index in range(args.memory_steps):
        variant.step(index)
    peak = _status_kib("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kept = kept_bytes(variant) if args.mode == "train" and find_op else 0
    print(json.dumps({"above_kib": peak - baseline, "exact": exact, "kept": kept}))
    return 0


def peaks(args, mode):
    shared = ["--mode", mode, "--layers", str(args.layers), "--width", str(args.width), "--batch", str(args.batch),
              "--seq", str(args.seq), "--eval-layers", str(args.eval_layers), "--eval-width", str(args.eval_width),
              "--eval-rows", str(args.eval_rows), "--memory-steps", str(args.memory_steps)]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=MMAP_THRESHOLD)
    found = {"on": [], "off": [], "none": []}
    kept = []
    exact = True
    for _ in range(args.runs):
        for variant in ("none", "off", "on"):
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", variant] + shared,
                                 capture_output=True, text=True, check=True, env=env)
            result = json.loads(out.stdout.splitlines()[-1])
            found[variant].append(result["above_kib"] / 1024)
            exact = exact and result["exact"]
            if variant == "on":
                kept.append(result["kept"] / 2**20)
    return {variant: statistics.median(values) for variant, values in found.items()}, statistics.median(kept), exact


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--eval-layers", type=int, default=24)
    parser.add_argument("--eval-width", type=int, default=2048)
    parser.add_argument("--eval-rows", type=int, default=512)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--memory-steps", type=int, default=3)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--mode", choices=("train", "eval"), help=argparse.SUPPRESS)
    parser.add_argument("--child", choices=("on", "off", "none"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return peak_child(args)
    print(_results.machine_line(), flush=True)
    print(f"training: GPT-2 {args.layers} layers, n_embd {args.width}, batch {args.batch} x {args.seq}, AdamW, "
          f"bf16 autocast; evaluation: {args.eval_layers} x Linear({args.eval_width}) + GELU, {args.eval_rows} rows, "
          "torch.no_grad(); watch() (check='batch', backward=True)", flush=True)
    print("| mode | measure | find_op on | find_op off | no detector | on / off |")
    print("|---|---|---|---|---|---|")
    for mode, name in (("train", "training"), ("eval", "evaluation")):
        times = step_times(args, mode)
        memory, kept, exact = peaks(args, mode)
        print(f"| {name} | step ms (median of {args.steps}, alternated) | {times[True]:.1f} | {times[False]:.1f} | - | "
              f"{times[True] / times[False]:.3f} |")
        peak = "peak above warm baseline" if exact else "peak RSS growth (ru_maxrss: no clear_refs here)"
        print(f"| {name} | {peak}, MiB (median of {args.runs} processes) | {memory['on']:+.1f} | "
              f"{memory['off']:+.1f} | {memory['none']:+.1f} | {memory['on'] - memory['off']:+.1f} MiB |", flush=True)
        if mode == "train":
            print(f"| {name} | storages the kept references reach at backward end | {kept:.1f} MiB | - | - | - |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
