"""The statistics engine as torch ops: the kernels show by name in profiler
traces, trace under FakeTensor / ``make_fx`` / ``torch.compile``, and can sit inside compiled
graphs.

- ``overflow_fast::tensor_stats(Tensor[] tensors) -> Tensor`` and
  ``overflow_fast::tensor_stats_out(Tensor[] tensors, Tensor(a!) out) -> ()``: the C++ kernel
  (csrc/binding.cpp, ``TORCH_LIBRARY``), CPU tensors. Loaded with ``overflow_fast._C``. (Why the
  out variant is an op of its own rather than an ``.out`` overload: see binding.cpp.)
- ``overflow_fast::tensor_stats_triton(Tensor[] tensors) -> Tensor``,
  ``overflow_fast::tensor_stats_triton_out(Tensor[] tensors, Tensor(a!) out) -> ()`` and the read of
  a few tensors into rows, ``overflow_fast::read_into(Tensor[] tensors, Tensor(a!) rows, int first) -> ()``:
  the Triton kernels (CUDA tensors; CPU tensors under ``TRITON_INTERPRET=1``; the list kernel where it
  takes the tensors, else the table kernels), registered with ``torch.library.custom_op``.

Why ``custom_op`` and not ``torch.library.triton_op`` for Triton: a ``triton_op`` body is traced
into the graph, and Inductor sees only the tensors passed to each ``wrap_triton`` launch. The
backend's launches do not take the input tensors: they take a table of their raw addresses
(``data_ptr()``, built on the host, the multi-tensor design). Traced, ``data_ptr()``
does not exist on FakeTensors, and the inputs would not be arguments of any kernel in the graph,
so nothing would keep them alive or ordered before the launch. ``custom_op`` keeps the launch
opaque, with every input a declared argument of one node.

Every op has a fake implementation: an uninitialised ``[len(tensors), 8]`` int64 tensor on the
tensors' device (the out variants only mutate ``out``). ``tensor_stats`` (dispatch.py) stays
the Python face; it calls these ops while ``torch.compile`` traces it (``compute`` below) and the
pybind entry point otherwise, whose per-call cost is lower (benchmarks/RESULTS.md, "Torch ops").

Importing this module never raises: without the C++ extension the ``tensor_stats`` ops simply
do not exist (``HAVE_CPU_OPS`` is False).
"""

from typing import List

import torch

from .layout import NUM_COLUMNS

# The ops' signatures say typing.List: torch before 2.5 infers a custom op's schema from typing's
# generics only, not from the builtin list[...].
NAMESPACE = "overflow_fast"

try:
    from . import cpu_backend as _cpu_backend
    HAVE_CPU_OPS = _cpu_backend.unavailable_reason() is None and hasattr(torch.ops.overflow_fast, "tensor_stats")
except Exception:  # pragma: no cover - cpu_backend never raises on import
    HAVE_CPU_OPS = False


def _rows_like(tensors):
    """The [N, 8] int64 result of a call, on the tensors' device (the CPU for an empty list)."""
    device = tensors[0].device if len(tensors) else torch.device("cpu")
    return torch.empty((len(tensors), NUM_COLUMNS), dtype=torch.int64, device=device)


if HAVE_CPU_OPS:

    @torch.library.register_fake("overflow_fast::tensor_stats")
    def _tensor_stats_fake(tensors):
        return _rows_like(tensors)

    @torch.library.register_fake("overflow_fast::tensor_stats_out")
    def _tensor_stats_out_fake(tensors, out):
        return None


# -- Triton ------------------------------------------------------------------------------------


@torch.library.custom_op("overflow_fast::tensor_stats_triton", mutates_args=())
def tensor_stats_triton(tensors: List[torch.Tensor]) -> torch.Tensor:
    """Rows of ``tensors`` from the Triton kernels (triton_backend.compute), no host sync."""
    from . import triton_backend

    if tensors:
        rows = torch.empty((len(tensors), NUM_COLUMNS), dtype=torch.int64, device=tensors[0].device)
        if triton_backend.read_into(tensors, rows):  # one launch per 8 tensors, nothing uploaded
            return rows
    rows = triton_backend.compute(tensors)
    if not tensors:  # an op's output must be on a device the caller can know: the CPU
        return rows.cpu()
    return rows


@tensor_stats_triton.register_fake
def _tensor_stats_triton_fake(tensors):
    return _rows_like(tensors)


@torch.library.custom_op("overflow_fast::tensor_stats_triton_out", mutates_args=("out",))
def tensor_stats_triton_out(tensors: List[torch.Tensor], out: torch.Tensor) -> None:
    """The rows of ``tensors`` written into ``out`` (``[len(tensors), 8]`` int64, on their device)."""
    from . import triton_backend

    if tuple(out.shape) != (len(tensors), NUM_COLUMNS) or out.dtype != torch.int64 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous int64 tensor of shape ({len(tensors)}, {NUM_COLUMNS})")
    if tensors and not triton_backend.read_into(tensors, out):
        triton_backend.compute(tensors, out=out)


@tensor_stats_triton_out.register_fake
def _tensor_stats_triton_out_fake(tensors, out):
    return None


@torch.library.custom_op("overflow_fast::read_into", mutates_args=("rows",))
def read_into(tensors: List[torch.Tensor], rows: torch.Tensor, first: int) -> None:
    """The read of a few tensors: the rows of ``tensors`` written into ``rows[first:first + len(tensors)]``
    (``rows``: a contiguous ``[R, 8]`` int64 buffer on their device). On CUDA one launch per 8
    tensors with nothing uploaded and no host sync, into a buffer the op mutates: safe to capture
    in a CUDA graph (``torch.compile(mode="reduce-overhead")``) once a first eager call has set up
    the device. Tensors that kernel does not take go through the table kernels."""
    from . import triton_backend

    if rows.dtype != torch.int64 or rows.dim() != 2 or rows.shape[1] != NUM_COLUMNS or not rows.is_contiguous() \
            or not 0 <= first <= rows.shape[0] - len(tensors):
        raise ValueError(f"rows must be a contiguous int64 [R, {NUM_COLUMNS}] tensor with room for "
                         f"{len(tensors)} rows from row {first}")
    out = rows[first:first + len(tensors)]
    if tensors and not triton_backend.read_into(tensors, out):
        triton_backend.compute(tensors, out=out)


@read_into.register_fake
def _read_into_fake(tensors, rows, first):
    return None


# -- the traceable path of tensor_stats ---------------------------------------------------------


def op_for(device_type):
    """(functional op, out op) that compute a device's rows, or None."""
    if device_type == "cpu" and HAVE_CPU_OPS:
        return torch.ops.overflow_fast.tensor_stats.default, torch.ops.overflow_fast.tensor_stats_out.default
    if device_type == "cuda":
        return torch.ops.overflow_fast.tensor_stats_triton.default, torch.ops.overflow_fast.tensor_stats_triton_out.default
    return None


def traceable(backend_name, tensors):
    """True when the op of ``backend_name`` ("cpu" or "triton") reads every tensor's dtype."""
    if backend_name == "cpu":
        return HAVE_CPU_OPS and all(t.dtype in _cpu_backend.SUPPORTED_DTYPES for t in tensors)
    if backend_name == "triton":
        from . import triton_backend

        return triton_backend.unavailable_reason() is None and all(
            t.dtype in triton_backend.SUPPORTED_DTYPES for t in tensors)
    return False


def compute(tensors, out=None):
    """Rows of plain strided tensors on one device through the ops (traceable), into ``out`` if
    given. The caller (dispatch.tensor_stats) has checked that one device holds them all."""
    device_type = tensors[0].device.type
    functional, out_op = op_for(device_type)
    if out is None:
        return functional(list(tensors))
    out_op(list(tensors), out)
    return out
