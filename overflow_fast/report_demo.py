"""`make report-demo`: record a run that drifts into an fp16 overflow, then draw its report.

The demo's small transformer (``overflow_fast.demo.TinyTransformer``, gain 1) runs in float16;
after every step one MLP's output weight grows by 4% (a slow drift toward the fp16 limit) and the
first block's input weight shrinks by 4% (into subnormals). Forward hooks read each frame's
statistics with ``tensor_stats`` and write them with the flight recorder until the first nan/inf.

TODO(lead): once ``log=PATH`` is wired into the detector, record with
``DebugUnderflowOverflow(model, log=PATH)`` instead of the hooks below.

Run: python -m overflow_fast.report_demo [--log PATH] [--png PATH] [--steps N]
"""

import argparse
import os

import torch

from . import cli
from .demo import TinyTransformer
from .frames import forward_frame
from .recorder import Recorder, detection_record, frame_records
from .stats import tensor_stats
from .stats.layout import NAN, NEGINF, POSINF


def record_run(path, steps=400, grow=1.04, shrink=0.96, seed=0):
    """Write the log of the drifting run to ``path``; returns the step of the first nan/inf (or None)."""
    torch.manual_seed(seed)
    model = TinyTransformer(gain=1.0).half().eval()
    names = {module: name for name, module in reversed(list(model.named_modules()))}
    state = {"step": 0, "call": 0, "bad": None}
    recorder = Recorder(path)

    def hook(module, args, output):
        frame, tensors = forward_frame(names[module], module, args, output)
        frame.rows = tensor_stats(tensors).values.tolist() if tensors else []
        recorder.write(frame_records(state["step"], "forward", state["call"], frame))
        state["call"] += 1
        bad = [ctx for (kind, ctx, payload) in frame.entries if kind == 0
               and any(frame.rows[payload][i] for i in (NAN, POSINF, NEGINF))]
        if bad and state["bad"] is None:
            state["bad"] = state["step"]
            recorder.write([detection_record(state["step"], "forward", frame.module_name, frame.class_name, bad)])

    handles = [module.register_forward_hook(hook) for module in model.modules()]
    ids = torch.randint(0, 128, (2, 16))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # float16 on a busy CPU: one thread is 100x faster than two fighting
    try:
        with torch.no_grad():
            for step in range(steps):
                state["step"], state["call"] = step, 0
                model(ids)
                if state["bad"] is not None:
                    break
                model.blocks[2].fc_out.weight.mul_(grow)
                model.blocks[0].fc_in.weight.mul_(shrink)
    finally:
        torch.set_num_threads(threads)
        for handle in handles:
            handle.remove()
        recorder.close()
    return state["bad"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", default=os.path.join("build", "report-demo.jsonl"))
    parser.add_argument("--png", default=os.path.join("docs", "report-demo.png"))
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args(argv)
    first = record_run(args.log, steps=args.steps)
    print(f"recorded {args.log} (first nan/inf at step {first})\n")
    return cli.main(["report", args.log, "--png", args.png, "--no-progress"])


if __name__ == "__main__":
    raise SystemExit(main())
