import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

# Without CUDA the Triton kernels run through Triton's interpreter on CPU tensors; it is chosen when
# the backend module is imported, so before any test imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
