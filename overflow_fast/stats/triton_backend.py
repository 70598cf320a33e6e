"""The Triton backend: not written yet."""

import torch

NAME = "triton"


def unavailable_reason():
    return "the Triton backend is not implemented yet"


def supports(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cuda"


def compute(tensors):
    raise RuntimeError(unavailable_reason())
