import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

# Under `pytest -n 2` each worker runs its kernels and torch ops on one thread (the processes it
# starts too): two workers' OpenMP threads on two cores crowded each other out, the kernel tests
# taking half as long again. The tests of thread counts set their own.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)

# Without CUDA the Triton kernels run through Triton's interpreter on CPU tensors; it is chosen when
# the backend module is imported, so before any test imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    # `make test` stays within minutes; .ci/run runs the slow tests too
    if os.environ.get("OVERFLOW_FAST_SLOW_TESTS") == "1":
        return
    import pytest

    skip = pytest.mark.skip(reason="slow; set OVERFLOW_FAST_SLOW_TESTS=1 (.ci/run does)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _detectors_left_attached():
    """A detector a test leaves on its model (watch() without remove(), a drop-in, as users write
    it) must not reach the next test in this worker: its hooks, and the listeners it registered
    (a GradScaler's backoffs, a skipped step), are process-wide. Take each off after the test."""
    yield
    detector = sys.modules.get("overflow_fast.hooks.detector")
    if detector is None:
        return
    for left in list(detector._ATTACHED):
        left.remove()
