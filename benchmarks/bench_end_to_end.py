"""End-to-end overhead of the detectors on transformers models.

GPT-2-style and T5-style models built from configs (random weights), forward (no grad) and a
training step (forward + backward + SGD), with: no detector, transformers' reference detector,
overflow_fast check="module" (the drop-in default) and check="batch", ``watch()`` (gradient
checks, keyword inputs and containers on; check="batch", and "watch-module" with check="module"),
and ``watch(check="step")`` (the root's outputs and the gradients read once per pass). ``--memory``
adds the peak of live tensor bytes in one step of each variant (allocations counted under a
dispatch mode, each storage once, until it is freed) against "none".
``--anomaly`` adds ``torch.autograd.detect_anomaly`` for comparison; ``--log`` adds ``watch()`` with
the flight recorder writing every step (``log_every=1``) and every 100th, and with TensorBoard
scalars every 100th step. Every variant has its own
copy of the model (the reference's hooks cannot be removed); the variants run round-robin in one
process and the table reports medians and overheads against "none".

    python benchmarks/bench_end_to_end.py [--device cuda] [--quick] [--repeats N]
"""

import argparse
import contextlib
import copy
import os
import tempfile
import sys

import torch
import transformers
from transformers.debug_utils import DebugUnderflowOverflow as ReferenceDetector

from overflow_fast import DebugUnderflowOverflow, watch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402
import _shared  # noqa: E402

VARIANTS = ("none", "reference", "module", "batch", "watch", "watch-module", "step")
BREAKDOWN = ("module-noreuse",)  # --breakdown: what reading each tensor once per forward saves


def gpt2(quick):
    model = _shared.gpt2(layers=4, width=256 if not quick else 128, heads=4, vocab=2048, positions=256)
    seq = 128 if not quick else 64

    def make_batch(device):
        ids = torch.randint(0, model.config.vocab_size, (8, seq), device=device)
        return {"input_ids": ids, "labels": ids}

    return model, make_batch


def t5(quick):
    config = transformers.T5Config(
        vocab_size=2048, d_model=256 if not quick else 128, d_kv=32, d_ff=1024 if not quick else 512,
        num_layers=3, num_decoder_layers=3, num_heads=8, decoder_start_token_id=0, pad_token_id=0,
    )
    model = transformers.T5ForConditionalGeneration(config)
    seq = 128 if not quick else 64

    def make_batch(device):
        ids = torch.randint(0, config.vocab_size, (8, seq), device=device)
        return {"input_ids": ids, "labels": ids[:, : seq // 2].contiguous()}

    return model, make_batch


MODELS = {"gpt2": gpt2, "t5": t5}


def attach(variant, model):
    if variant == "reference":
        ReferenceDetector(model)
    elif variant in ("module", "batch"):
        DebugUnderflowOverflow(model, check=variant)
    elif variant == "module-noreuse":
        DebugUnderflowOverflow(model, check="module", reuse_stats=False)
    elif variant == "watch":
        watch(model)
    elif variant == "watch-module":
        watch(model, check="module")
    elif variant == "step":
        watch(model, check="step")
    elif variant.startswith("watch-log"):
        log = os.path.join(tempfile.mkdtemp(prefix="overflow_fast_bench_"), "run.jsonl")
        watch(model, log=log, log_every=int(variant[len("watch-log"):]))
    elif variant.startswith("watch-tensorboard"):
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(tempfile.mkdtemp(prefix="overflow_fast_bench_"))
        watch(model, log=writer, log_every=int(variant[len("watch-tensorboard"):]))


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(name, quick, device, repeats, mode, variants):
    torch.manual_seed(0)
    base, make_batch = MODELS[name](quick)
    base = base.to(device)
    batch = make_batch(device)
    runs = {}
    for variant in variants:
        model = copy.deepcopy(base)
        model.train(mode == "train")
        attach(variant, model)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4) if mode == "train" else None

        def step(index, model=model, optimizer=optimizer, anomaly=variant == "anomaly"):
            if optimizer is None:
                with torch.no_grad():
                    model(**batch)
            else:
                optimizer.zero_grad(set_to_none=True)
                with torch.autograd.detect_anomaly(check_nan=True) if anomaly else contextlib.nullcontext():
                    model(**batch).loss.backward()
                optimizer.step()

        runs[variant] = step
    return _shared.round_robin(runs, repeats, synchronize=lambda: synchronize(device))


class _LiveBytes:
    """The peak of live tensor storage bytes while it is entered (a TorchDispatchMode counting each
    new storage an op returns until it is freed); the bytes alive before it are not counted."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        import weakref

        tracker = self
        self.live = self.peak = 0
        self.seen = set()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                result = func(*args, **(kwargs or {}))
                for tensor in torch.utils._pytree.tree_leaves(result):
                    if isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided:
                        storage = tensor.untyped_storage()
                        key = storage.data_ptr()
                        if key and key not in tracker.seen:
                            tracker.seen.add(key)
                            tracker.live += storage.nbytes()
                            tracker.peak = max(tracker.peak, tracker.live)
                            weakref.finalize(storage, tracker._freed, key, storage.nbytes())
                return result

        self.mode = Mode

    def _freed(self, key, size):
        self.seen.discard(key)
        self.live -= size


def peak_bytes(name, quick, device, variants):
    """The peak of live tensor bytes during one training step (after a first one) of each variant."""
    torch.manual_seed(0)
    base, make_batch = MODELS[name](quick)
    batch = make_batch(device)
    peaks = {}
    for variant in variants:
        model = copy.deepcopy(base).to(device).train()
        attach(variant, model)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        for measured in (False, True):
            tracker = _LiveBytes()
            with tracker.mode() if measured else contextlib.nullcontext():
                optimizer.zero_grad(set_to_none=True)
                model(**batch).loss.backward()
                optimizer.step()
        peaks[variant] = tracker.peak
    return peaks


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="smaller models and fewer repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--models", default="gpt2,t5")
    parser.add_argument("--breakdown", action="store_true", help="also check='module' with reuse_stats=False")
    parser.add_argument("--anomaly", action="store_true", help="also torch.autograd.detect_anomaly")
    parser.add_argument("--log", action="store_true",
                        help="also watch() with log_every=1 and log_every=100, and to TensorBoard every 100th step")
    parser.add_argument("--memory", action="store_true", help="also the peak live tensor bytes of a training step")
    parser.add_argument("--variants", default=None, help="comma-separated (default: all)")
    parser.add_argument("--csv", default=None, help="append machine-readable rows to this CSV")
    args = parser.parse_args(argv)
    variants = (VARIANTS + (BREAKDOWN if args.breakdown else ()) + (("anomaly",) if args.anomaly else ())
                + (("watch-log1", "watch-log100", "watch-tensorboard100") if args.log else ()))
    if args.variants:
        variants = tuple(v for v in ["none"] + args.variants.split(",") if v in variants or v == "none")
        variants = tuple(dict.fromkeys(variants))
    device = torch.device(args.device)
    repeats = args.repeats or (5 if args.quick else 15)
    print(f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, "
          f"{repeats} round-robin repeats, medians")
    rows = []
    for name in args.models.split(","):
        for mode in ("forward", "train"):
            medians = measure(name, args.quick, device, repeats, mode, variants)
            base = medians["none"]
            rows.append((name, mode, base, {v: medians[v] / base - 1 for v in variants[1:]}))
            print(f"  {name} {mode}: " + ", ".join(f"{v} {medians[v] * 1e3:.2f} ms" for v in variants),
                  flush=True)
    print()
    print("| model | step | none (ms) | " + " | ".join(variants[1:]) + " |")
    print("|---|---|---|" + "---|" * (len(variants) - 1))
    for name, mode, base, overheads in rows:
        cells = " | ".join(f"{overheads[v] * 100:+.0f}%" for v in variants[1:])
        print(f"| {name} | {mode} | {base * 1e3:.1f} | {cells} |")
    csv_rows = []
    for name, mode, base, overheads in rows:
        csv_rows.append((f"{name} {mode}: none", base * 1e3, "ms"))
        csv_rows += [(f"{name} {mode}: {v} overhead", overheads[v] * 100, "%") for v in variants[1:]]
    if args.memory:
        print()
        print("| model | peak live tensor bytes in a training step: none (MB) | " + " | ".join(variants[1:]) + " |")
        print("|---|---|" + "---|" * (len(variants) - 1))
        for name in args.models.split(","):
            peaks = peak_bytes(name, args.quick, device, variants)
            cells = " | ".join(f"{(peaks[v] / peaks['none'] - 1) * 100:+.1f}%" for v in variants[1:])
            print(f"| {name} | {peaks['none'] / 1e6:.1f} | {cells} |")
            csv_rows += [(f"{name} train: {v} peak memory", (peaks[v] / peaks["none"] - 1) * 100, "%")
                         for v in variants[1:]]
    _results.write_rows(args.csv, "end_to_end" + ("_quick" if args.quick else ""), csv_rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
