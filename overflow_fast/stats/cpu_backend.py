"""The C++ backend (csrc/): not built yet."""

import torch

NAME = "cpu"


def unavailable_reason():
    return "the C++ extension overflow_fast._C is not built"


def supports(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu"


def compute(tensors):
    raise RuntimeError(unavailable_reason())
