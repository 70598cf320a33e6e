"""torch does not depend on numpy, so neither may anything that runs in a user's training: the
detector, the accelerators' table upload and the distributed agreement, with numpy unimportable."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys
    sys.modules["numpy"] = None  # import numpy raises ImportError, as in a venv without it
    import os, tempfile
    import torch
    import torch.distributed as dist
    from torch import nn
    from overflow_fast import DebugUnderflowOverflow, distributed
    from overflow_fast.stats import kinds
    from overflow_fast.stats import triton_backend, triton_table  # noqa: F401 - the whole backend imports

    # the detector on the accelerators' path (per-device buffers read to the host)
    kinds.CPU_AS_DEVICE = True
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    DebugUnderflowOverflow(model, check="batch")
    model(torch.ones(1, 2))
    try:
        model(torch.full((1, 2), float("inf")))
        raise SystemExit("no detection")
    except ValueError:
        pass

    # the pinned staging of the table upload, with a host allocator and events that never wait
    class Event:
        def record(self): pass
        def query(self): return True
        def synchronize(self): pass
    staging = triton_table._PinnedStaging(pinned_empty=lambda n: torch.empty(n, dtype=torch.int64), event=Event)
    device_buffer = torch.zeros(8, dtype=torch.int64)
    staging.upload([3, -1, 2 ** 62], device_buffer)
    assert device_buffer[:3].tolist() == [3, -1, 2 ** 62], device_buffer

    # an agreement on a one-rank gloo group
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    agreement = distributed.Agreement()
    assert agreement.agree(False) == [] and agreement.agree(True) == [0]
    dist.destroy_process_group()
    print("ok without numpy")
""")


def test_training_paths_run_without_numpy():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ok without numpy" in proc.stdout, proc.stdout + proc.stderr
