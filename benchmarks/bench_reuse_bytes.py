"""Bytes the detector reads per forward of GPT-2 small, with and without reusing rows within a pass:
what closing the hole of writes that bypass the version counter would cost.

A row read at one hook is reused at a later hook of the same pass when it sees the same tensor
with the same version counter and data pointer (a module's output is the next module's input and
its parent's output). A write that bumps no version counter (a custom kernel writing through a raw
pointer) between the two hooks makes that reuse stale. Two ways to close it, measured here:

- "outputs read again": a module's output is never trusted from an earlier hook's read (what a
  module wrote into a tensor it returns is always seen); computed from the default run: its bytes
  plus every output whose row came from an earlier hook;
- ``reuse_stats=False``: nothing is reused (also closes writes into a tensor between two modules).

GPT-2 small (12 layers, n_embd 768, vocab 50257, random weights) in fp32 on the CPU, --batch x
--seq tokens; "train" is a forward in train mode (dropout on, autograd on), "eval" one under
``torch.no_grad()`` in eval mode. What is counted: the bytes of every tensor handed to the engine
(``Reads``' launches and calls read apart), for the drop-in with check="batch" and for ``watch()``
(keyword inputs and containers too). Bytes do not depend on the device or the machine.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_reuse_bytes.py [--batch 1] [--seq 1024] [--csv PATH]
"""

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _results  # noqa: E402
import _shared  # noqa: E402


class Counter:
    """Counts what the engine is handed, by wrapping (not replacing) ``Reads``' ways in: a forward
    hook call's one call (``add_forward``), the launches it leaves to ``Reads``, reads apart."""

    def __init__(self):
        from overflow_fast.hooks import reads
        from overflow_fast.hooks.text import TENSOR

        self.read_bytes = 0
        self.reused_output_bytes = 0
        self.launches = 0  # engine calls: one per hook with something to read
        self.extra_launches = 0  # hooks that would read only because an output is read again
        self._launched = None
        counter = self
        launch, apart, add_forward = reads.Reads._launch, reads.Reads.read_apart, reads.Reads.add_forward

        def counted_launch(self, key, first, tensors):
            counter.read_bytes += sum(t.numel() * t.element_size() for t in tensors)
            counter.launches += 1
            if counter._launched is not None:
                counter._launched.update(id(t) for t in tensors)
            return launch(self, key, first, tensors)

        def counted_apart(self, tensors):
            counter.read_bytes += sum(t.numel() * t.element_size() for t in tensors)
            counter.launches += 1
            return apart(self, tensors)

        def counted_add_forward(self, *args):  # a forward hook call's reads, then its entries
            counter._launched = set()
            entries, tensors, dtypes, sources = add_forward(self, *args)
            fresh, counter._launched = counter._launched, None
            again = [tensors[payload] for kind, ctx, payload in entries
                     if kind == TENSOR and ctx.startswith("output") and id(tensors[payload]) not in fresh]
            # their rows came from an earlier hook
            counter.reused_output_bytes += sum(t.numel() * t.element_size() for t in again)
            counter.extra_launches += bool(again) and not fresh
            return entries, tensors, dtypes, sources

        reads.Reads._launch = counted_launch
        reads.Reads.read_apart = counted_apart
        reads.Reads.add_forward = counted_add_forward
        # no launcher bound to the core: what it decides to read comes back to Reads._launch, counted
        # there (a bound launcher reads the same tensors inside the core's call, uncounted)
        reads.rows_launcher = lambda backend, device: None

    def take(self):
        counts = (self.read_bytes, self.reused_output_bytes, self.launches, self.extra_launches)
        self.read_bytes = self.reused_output_bytes = self.launches = self.extra_launches = 0
        return counts


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--csv", default=None)
    args = parser.parse_args()

    import torch

    from overflow_fast import DebugUnderflowOverflow, watch

    counter = Counter()
    model = _shared.gpt2(**_shared.GPT2_SMALL)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq))
    detectors = {"drop-in, check=batch": lambda **o: DebugUnderflowOverflow(model, check="batch", **o),
                 "watch()": lambda **o: watch(model, backward=False, find_op=False, **o)}
    print(_results.machine_line())
    print(f"GPT-2 small, fp32, {args.batch} x {args.seq} tokens; MB (1e6 bytes) read per forward, "
          "and engine calls (launches on a GPU)")
    print("| detector | forward | reuse (default) | outputs read again | reuse_stats=False |")
    print("|---|---|---|---|---|")
    rows = []
    for name, attach in detectors.items():
        for mode in ("train", "eval"):
            model.train(mode == "train")
            measured = {}
            for reuse in (True, False):
                detector = attach(reuse_stats=reuse)
                with torch.set_grad_enabled(mode == "train"):
                    model(ids)  # warm-up: the first pass builds buffers
                    counter.take()
                    model(ids)
                measured[reuse] = counter.take()
                detector.remove()
            default, reused_outputs, launches, extra_launches = measured[True]
            outputs_again, no_reuse, no_reuse_launches = default + reused_outputs, *measured[False][::2]
            print(f"| {name} | {mode} | {default / 1e6:.0f} MB, {launches} calls | {outputs_again / 1e6:.0f} MB "
                  f"({outputs_again / default:.2f}x), {launches + extra_launches} calls | {no_reuse / 1e6:.0f} MB "
                  f"({no_reuse / default:.2f}x), {no_reuse_launches} calls |")
            for variant, value in (("reuse", default), ("outputs read again", outputs_again),
                                   ("reuse_stats=False", no_reuse)):
                rows.append((f"{name}, {mode}, {variant}", value, "bytes per forward"))
    _results.write_rows(args.csv, "reuse_bytes", rows)


if __name__ == "__main__":
    main()
