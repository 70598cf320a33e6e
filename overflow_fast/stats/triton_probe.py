"""The direct launch's probe, a child process: ``python -m overflow_fast.stats.triton_probe DEVICE``
(triton_verdicts starts it; benchmarks/gpu_check.py runs it as its first phase).

It sets ``DEVICE`` up with direct launches allowed and runs the self-check (each variant through
Triton's launch, which compiles and registers it, then directly), then reads of 1 to 17 tensors
(one to three launches; an unaligned view, a transposed one, a strided one read through a copy)
through ``read_into``, twice each, on torch's stream and on a side stream, each against the torch
backend, and a sync. It prints ``DIRECT`` before its first direct launch (a crash after it judges
the direct launch) and its report as one ``PROBE <json>`` line; exit status 0 passed, 1 not.
"""

import json
import random
import sys
import traceback

import torch

from . import torch_backend, triton_backend, triton_list
from .kinds import tensor_device
from .layout import NUM_COLUMNS


def probe(device):
    """The probe's report on ``device``: {"passed", "stage" (set-up, or direct once direct launches
    began), "self_check", "check_ms", "launch", "reads", "direct_launches", "ordinary_launches",
    "error"}."""
    result = {"passed": False, "stage": "set-up"}

    def before_direct():
        result["stage"] = "direct"
        print("DIRECT", flush=True)

    try:
        if triton_backend.unavailable_reason() is not None:
            raise RuntimeError(f"the triton backend is unavailable: {triton_backend.unavailable_reason()}")
        device = tensor_device(device)
        # on the CPU (the interpreter) the check runs through the Python read: no launch hook to gate
        read = None if device.type == "cuda" else triton_list._read
        state = triton_list.check_device(device, read=read, direct=True, before_direct=before_direct)
        result.update(self_check=state.self_check, check_ms=state.check_ms or 0.0, launch=state.launch)
        if state.self_check != "passed":
            raise RuntimeError(f"the self-check {state.self_check}")
        result["reads"] = reads(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        launcher = state.launcher
        result.update(launch=state.launch, passed=True,
                      direct_launches=launcher.direct_launches if launcher is not None else 0,
                      ordinary_launches=launcher.ordinary_launches if launcher is not None else 0)
    except Exception as error:  # noqa: BLE001 - the parent judges it
        traceback.print_exc()
        message = str(error).strip().splitlines()
        result["error"] = f"{type(error).__name__}: {message[0][:300] if message else ''}"
    return result


def reads(device):
    """Reads of 1, 3, 9 and 17 fp32 and bf16 tensors (one to three launches, of 1, 4 and 8 slots;
    views of tensors made on the device: an unaligned one, a transposed one, a strided slice read
    through a copy) through ``read_into``, each twice (the first launch of a variant is Triton's,
    which compiles it; the second direct), on torch's stream and, on CUDA, on a side stream, each
    against the torch backend: how many."""
    gen = torch.Generator().manual_seed(1)
    rng = random.Random(1)
    streams = [None] + ([torch.cuda.Stream(device)] if device.type == "cuda" else [])
    done = 0
    for stream in streams:
        for count in (1, 3, 9, 17):
            tensors = []
            for i in range(count):
                dtype = (torch.bfloat16, torch.float32)[i % 2]
                bits = torch.randint(-128, 128, (40 * rng.randint(1, 80) * dtype.itemsize,), generator=gen,
                                     dtype=torch.int8)
                tensor = bits.to(device).view(dtype)  # on the device first: its views are the device's
                kind = i % 4
                if kind == 1:
                    tensor = tensor[1:]  # unaligned
                elif kind == 2:
                    tensor = tensor.view(40, -1).t()  # transposed: dense, read in place
                elif kind == 3:
                    tensor = tensor[::3]  # strided: read through a flat copy
                tensors.append(tensor)
            want = torch_backend.compute(tensors).cpu()
            where = "a side stream" if stream is not None else "torch's stream"
            for attempt in ("first", "second"):
                rows = torch.full((count, NUM_COLUMNS), -1, dtype=torch.int64, device=device)
                if stream is not None:
                    stream.wait_stream(torch.cuda.current_stream(device))
                    with torch.cuda.stream(stream):
                        taken = triton_backend.read_into(tensors, rows)
                    stream.synchronize()
                else:
                    taken = triton_backend.read_into(tensors, rows)
                if taken is not True:
                    raise RuntimeError(f"read_into did not take {count} tensors on {where}")
                problem = triton_list._row_difference(rows.cpu(), want, tensors)
                if problem is not None:
                    raise RuntimeError(f"the {attempt} read of {count} tensors on {where}: {problem}")
                done += 1
    return done


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    result = probe(argv[0] if argv else "cuda")
    print("PROBE " + json.dumps(result), flush=True)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
