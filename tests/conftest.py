import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

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
