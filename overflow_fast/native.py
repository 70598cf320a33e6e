"""The C++ twins of the loops a detector hook runs per tensor (csrc/staging.cpp, in the extension
``overflow_fast._C``): ``frame_entries`` (frames.py's ``entries_of(forward_items(...))``),
``stage_tensors`` (rows.py's ``_stage``), ``stage_call`` (rows.py's ``DeferredRows.stage``: the
common case of ``must_read_before`` and ``add``), ``all_unchanged`` (``_all_unchanged``),
``read_rows`` (``to_host``) and ``resolve_rows`` (``resolve``);
the constructors of the two objects a hook makes, ``make_frame`` and ``make_call`` (frames.py's
``Frame`` and ``Call``, registered by frames.py through ``frame_setup``); and ``hook_frame``,
frames.py's ``hook_frame`` in one call.

On a GPU the host only issues kernels, and a hook's per-tensor Python (a dozen attribute reads
per tensor at ~100 ns each) is the detector's cost there. The Python functions stay the
specification and the fallback: each name here is None where the extension is unavailable.
"""

from .reuse import MAX_REMEMBERED
from .stats import unreadable_reason
from .stats.cpu_backend import extension
from .stats.kinds import PLAIN_TYPES, SUPPORTED_DTYPES

# ctx names of the first positional inputs and outputs, built once (frames.py uses them too)
INPUT_NAMES = [f"input[{i}]" for i in range(16)]
OUTPUT_NAMES = [f"output[{i}]" for i in range(16)]

_C = extension()
if _C is not None:
    _C.hook_setup(tuple(PLAIN_TYPES), SUPPORTED_DTYPES, INPUT_NAMES, OUTPUT_NAMES, unreadable_reason, MAX_REMEMBERED)

frame_entries = _C.frame_entries if _C is not None else None
stage_tensors = _C.stage_tensors if _C is not None else None
stage_call = _C.stage_call if _C is not None else None
all_unchanged = _C.all_unchanged if _C is not None else None
read_rows = _C.read_rows if _C is not None else None
resolve_rows = _C.resolve_rows if _C is not None else None
frame_setup = _C.frame_setup if _C is not None else None
make_frame = _C.make_frame if _C is not None else None
hook_frame = _C.hook_frame if _C is not None else None
make_call = _C.make_call if _C is not None else None
