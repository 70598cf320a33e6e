"""Where a check="batch" hook's host time goes, on bench_host_path's GPT-2 small
hook sequence (a meta-device forward replayed on uninitialised CPU tensors, Triton launches
stubbed: the GPU path's host work without a GPU).

Two measurements, each side by side in one process (this machine's speed drifts ~2x between
runs minutes apart, so only figures from the same process compare):

- **pieces:** timers around the detector's post hook (the whole hook), ``Passes.forward_returned``
  (the call counted, read and queued, and within it ``Reads.add_forward``: the hook layer's one C++
  call, which makes the call's entries, its rows and, by the device's bound launcher, the launch),
  ``Reads.add`` (what the one call hands back to be added again: a full buffer), the Python engine
  call for what the launcher hands back (``tensor_stats``: the device's first read, declined
  calls), ``flush`` and the pre hook,
  medians over forwards (each timer adds about 0.1 us to what it wraps);
- **garbage collection:** the detector with the collector on and off, with the no-hook replay and
  the floor hook, in round-robin rounds: the gap is what gen-0 collections cost per hook.

    .venv/bin/python benchmarks/bench_hook_breakdown.py [--layers N] [--rounds R]
"""

import argparse
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _results  # noqa: E402
import _shared  # noqa: E402
import bench_host_path as host  # noqa: E402

from overflow_fast import DebugUnderflowOverflow  # noqa: E402
from overflow_fast.hooks import reads as reads_module  # noqa: E402
from overflow_fast.hooks.passes import Passes  # noqa: E402


def hook_sequence(layers, batch, seq):
    """The replay of GPT-2 small's forward hook sequence: (model, run, hooks per forward)."""
    meta_model = host.gpt2_small(layers, "meta", torch.bfloat16)
    ids = torch.zeros((batch, seq), dtype=torch.long, device="meta")

    def forward():
        with torch.no_grad():
            meta_model(input_ids=ids)

    events, _ = host.record(meta_model, forward)
    model = host.gpt2_small(layers, "meta", torch.bfloat16).to_empty(device="cpu")
    events = host.materialize(events, requires_grad=True)
    hooks = sum(1 for event in events if event[0] == "post")
    return model, lambda: host.replay(model, events), hooks


def pieces(model, run, hooks, forwards):
    """us per hook in each timed piece, medians over ``forwards`` forwards."""
    spent = {}

    def timer(real, label):
        def call(*args, **kwargs):
            start = time.perf_counter_ns()
            try:
                return real(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0) + time.perf_counter_ns() - start
        return call

    def timed(owner, name, label):
        return host.patched(owner, name, timer(getattr(owner, name), label))

    Detector = DebugUnderflowOverflow
    samples = []
    labels = ("whole hook", "Passes.forward_returned", "Reads.add_forward", "Reads.add", "tensor_stats", "flush",
              "pre hook")
    with timed(Detector, "_after", "whole hook"), timed(Passes, "forward_returned", "Passes.forward_returned"), \
            timed(reads_module.Reads, "add_forward", "Reads.add_forward"), timed(reads_module.Reads, "add", "Reads.add"), \
            timed(reads_module.Reads, "_stats", "tensor_stats"), timed(Passes, "flush", "flush"), \
            timed(Detector, "_before", "pre hook"):
        detector = Detector(model, check="batch")
        run()
        run()
        for _ in range(forwards):
            spent.clear()
            spent.update(dict.fromkeys(labels, 0))  # a piece that never ran: 0
            run()
            samples.append(dict(spent))
        detector.remove()
    return {label: statistics.median(sample.get(label, 0) for sample in samples) / 1e3 / hooks
            for label in samples[0]}


def collector_cost(model, run, hooks, rounds):
    """us per hook of: the floor hook, the detector with the collector on, and off."""
    def step(variant):
        def timed(index):
            if variant == "none":
                detach = None
            elif variant == "floor":
                detach = host.attach("floor", model)
            else:
                detach = DebugUnderflowOverflow(model, check="batch").remove
            enabled = gc.isenabled()
            try:
                run()
                if variant == "collector off":
                    gc.disable()
                start = time.perf_counter()
                for _ in range(3):
                    run()
                return (time.perf_counter() - start) / 3
            finally:
                if enabled:
                    gc.enable()
                if detach is not None:
                    detach()
        return timed

    variants = ("none", "floor", "collector on", "collector off")
    medians = _shared.round_robin({variant: step(variant) for variant in variants}, rounds, warm_up=0,
                                  self_timed=True)
    return {variant: (medians[variant] - medians["none"]) / hooks * 1e6 for variant in variants[1:]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=25, help="round-robin rounds of the collector A/B")
    parser.add_argument("--forwards", type=int, default=15, help="forwards timed piece by piece")
    args = parser.parse_args(argv)
    print(_results.machine_line(), flush=True)
    model, run, hooks = hook_sequence(args.layers, args.batch, args.seq)
    with host.triton_on_cpu():
        split = pieces(model, run, hooks, args.forwards)
        collector = collector_cost(model, run, hooks, args.rounds)
    print(f"GPT-2 small hook sequence ({args.layers} layers, {args.batch} x {args.seq}), {hooks} hooks per "
          f"forward, check='batch'; us per hook")
    print("| piece | us/hook |")
    print("|---|---|")
    for label, value in split.items():
        print(f"| {label} | {value:.2f} |")
    inside = split["Passes.forward_returned"] + split["flush"]
    print(f"| whole hook less Passes.forward_returned and flush | {split['whole hook'] - inside:.2f} |")
    print(f"| gen-0 collections (collector on - off) | {collector['collector on'] - collector['collector off']:.2f} |")
    print(f"floor hook {collector['floor']:.2f}; detector {collector['collector on']:.2f} with the collector on, "
          f"{collector['collector off']:.2f} off")


if __name__ == "__main__":
    main()
