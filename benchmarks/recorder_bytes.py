"""Bytes the flight recorder writes per step: one record per tensor entry of every frame of one
forward, encoded exactly as the recorder writes them (real statistics of a real forward).

Run: python benchmarks/recorder_bytes.py   (GPT-2 config of tests/models.py, and deeper variants)
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from overflow_fast.hooks.frames import Frame, class_name, entries_of, forward_items  # noqa: E402
from overflow_fast.recording.recorder import encode_line, frame_records  # noqa: E402
from overflow_fast.stats import tensor_stats  # noqa: E402
from tests import models  # noqa: E402


def bytes_per_step(model, batch, kwargs=False, containers=False):
    names = {module: name for name, module in reversed(list(model.named_modules()))}
    out = {"records": 0, "bytes": 0, "frames": 0}

    def hook(module, args, kw, output):
        entries, tensors, dtypes = entries_of(forward_items(module, args, output, kw if kwargs else None, containers))
        frame = Frame(names[module], class_name(module), entries, dtypes)
        frame.rows = tensor_stats(tensors).values.tolist() if tensors else []
        records = frame_records(123456, "forward", out["frames"], frame)
        out["frames"] += 1
        out["records"] += len(records)
        out["bytes"] += sum(len(encode_line(r)) for r in records)

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in model.modules()]
    with torch.no_grad():
        model(batch)
    for handle in handles:
        handle.remove()
    return out


def main():
    torch.set_num_threads(1)
    print("| model | options | frames | records/step | bytes/step | bytes/record |")
    print("|---|---|---:|---:|---:|---:|")
    for n_layer in (2, 12):
        # at 12 blocks: GPT-2 small's module tree at the test config's widths
        model = models.gpt2(torch.float16, n_layer=n_layer)
        for label, options in (("default", {}), ("kwargs, containers", {"kwargs": True, "containers": True})):
            r = bytes_per_step(model, models.token_batch(0), **options)
            print(f"| GPT-2 tests/models.py, n_layer={n_layer} | {label} | {r['frames']} | {r['records']} | "
                  f"{r['bytes']} | {r['bytes'] / max(r['records'], 1):.0f} |")


if __name__ == "__main__":
    main()
