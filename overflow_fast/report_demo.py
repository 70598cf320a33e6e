"""`make report-demo`: record a run that drifts into an fp16 overflow, then draw its report.

The demo's small transformer (``overflow_fast.demo.TinyTransformer``, gain 1) runs in float16;
after every step one MLP's output weight grows by 4% (a slow drift toward the fp16 limit) and the
first block's input weight shrinks by 4% (into subnormals). The detector records every frame
with ``log=PATH`` (``on_detect="record"``: the run is not interrupted, it stops at the first
nan/inf) and, where TensorBoard is installed, to a ``SummaryWriter`` too (the dashboard scalars;
``tensorboard --logdir build/report-demo-tensorboard``).

Everything it writes goes under build/ (ignored by git): a demo never changes a tracked file. The
picture in the README is ``docs/report-demo.png``; to refresh it, run it with
``--png docs/report-demo.png`` and commit the result.

Run: python -m overflow_fast.report_demo [--log PATH] [--png PATH] [--steps N] [--tensorboard DIR]
"""

import argparse
import os

import torch

from . import cli
from .demo import TinyTransformer
from .hooks.detector import DebugUnderflowOverflow


def record_run(path, steps=400, grow=1.04, shrink=0.96, seed=0, dashboard=None):
    """Write the log of the drifting run to ``path`` (and ``dashboard``, a SummaryWriter, if
    given); returns the step of the first nan/inf (or None)."""
    torch.manual_seed(seed)
    model = TinyTransformer(gain=1.0).half().eval()
    ids = torch.randint(0, 128, (2, 16))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # float16 on a busy CPU: one thread is 100x faster than two fighting
    log = path if dashboard is None else [path, dashboard]
    detector = DebugUnderflowOverflow(model, check="batch", on_detect="record", log=log)
    try:
        with torch.no_grad():
            for step in range(steps):
                detector.set_step(step, "train")  # a hand-written loop names its optimizer steps
                model(ids)
                if detector.detections:
                    break
                model.blocks[2].fc_out.weight.mul_(grow)
                model.blocks[0].fc_in.weight.mul_(shrink)
    finally:
        torch.set_num_threads(threads)
        detector.remove()
    return detector.detections[0]["batch_number"] if detector.detections else None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", default=os.path.join("build", "report-demo.jsonl"))
    parser.add_argument("--png", default=os.path.join("build", "report-demo.png"))
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--tensorboard", default=os.path.join("build", "report-demo-tensorboard"),
                        help="where the dashboard scalars go (needs tensorboard); '' for none")
    args = parser.parse_args(argv)
    for path in (args.log, args.png):
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)  # build/, which git ignores
    writer = None
    if args.tensorboard:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            print("(tensorboard is not installed: no dashboard scalars)")
        else:
            writer = SummaryWriter(args.tensorboard)
    first = record_run(args.log, steps=args.steps, dashboard=writer)
    print(f"recorded {args.log} (first nan/inf at step {first})")
    if writer is not None:
        writer.close()
        print(f"dashboard scalars: tensorboard --logdir {args.tensorboard}  (overflow_fast/headroom_bits/<module>, "
              f"overflow_fast/subnormal_frac/<module>, overflow_fast/detection)")
    print()
    return cli.main(["report", args.log, "--png", args.png, "--no-progress"])


if __name__ == "__main__":
    raise SystemExit(main())
