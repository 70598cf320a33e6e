"""What differs between the torch versions the package supports, in one place: the rest of the
package asks here and never compares versions itself. Imports torch only, so that every folder
may use it (tests/test_layout.py)."""

import torch

# ---- what this torch has: dtypes and APIs that only some supported versions have --------------
# The floor is pyproject's (torch 2.7); docs/install.md lists the versions the suite passed on.
# Older versions' differences stay where they cost a line (DTensor's module before 2.5).


def dtypes(*names):
    """The dtypes of these names that this torch has, in order: float8_e8m0fnu from torch 2.7,
    uint16, uint32 and uint64 from 2.3."""
    return tuple(getattr(torch, name) for name in names if isinstance(getattr(torch, name, None), torch.dtype))


def dtensor_api():
    """torch's DTensor module (DTensor, Shard, Replicate, distribute_tensor, ...): public as
    torch.distributed.tensor from torch 2.5, torch.distributed._tensor before; None in a torch
    built without distributed."""
    import importlib

    for name in ("torch.distributed.tensor", "torch.distributed._tensor"):
        try:
            module = importlib.import_module(name)
        except Exception:
            continue
        if hasattr(module, "DTensor"):
            return module
    return None
