"""Text of the reference detector, built from raw statistics only when something is printed.

Nothing here runs a torch kernel: it formats host rows (see ``stats.layout``) and frame records.
"""

from ..recording.schema import NONE, NOT_A_TENSOR, TENSOR, UNREADABLE  # noqa: F401 - the entry kinds
from ..stats.layout import NAN, NEGINF, NUMEL, POSINF, decode_row

PREFIX = " " * 17
COLUMN_HEADER = f"{'abs min':8} {'abs max':8} metadata"


def tensor_line(row, dtype, ctx: str) -> str:
    if row[NUMEL] == 0:
        return f"{'empty tensor':>17} {ctx}"
    stats = decode_row(row, dtype)
    return f"{stats['abs_min']:8.2e} {stats['abs_max']:8.2e} {ctx}"


def overflow_lines(row, ctx: str):
    """The reference's immediate "has nans" / "has infs" lines for one tensor."""
    lines = []
    if row[NAN]:
        lines.append(f"{ctx} has nans")
    if row[POSINF] or row[NEGINF]:
        lines.append(f"{ctx} has infs")
    return lines


def bad_shards_line(ctx: str, ranks) -> str:
    """Under torch.distributed, for a DTensor: the ranks whose shard holds the nan/inf."""
    return f"{ctx} has them in the shard of rank(s) {', '.join(str(rank) for rank in ranks)}"


def entry_line(kind: int, ctx: str, payload) -> str:
    """The line of a non-tensor entry (``payload`` is the reason for UNREADABLE)."""
    if kind == NONE:
        return f"{'None':>17} {ctx}"
    if kind == NOT_A_TENSOR:
        return f"{'not a tensor':>17} {ctx}"
    return f"{'unreadable':>17} {ctx} ({payload})"


def frame_header(module_name: str, class_name: str) -> str:
    return f"{PREFIX} {module_name} {class_name}"


def batch_start_lines(batch_number: int):
    return [f"\n\n{PREFIX} *** Starting batch number={batch_number} ***", COLUMN_HEADER]


def batch_end_line(batch_number: int) -> str:
    return f"{PREFIX} *** Finished batch number={batch_number} ***\n\n"


def dump_text(batch_number: int, frames, during=None, backward=False) -> str:
    """What the reference prints on detection (four print() calls, joined); ``during`` replaces
    ``batch_number=N`` (e.g. the backward pass of a batch); ``backward``: a detection in a backward
    pass (gradient checks, beyond the reference), whose count of frames says how many are
    gradient frames."""
    return "\n".join(
        [
            f"\nDetected inf/nan during {during or f'batch_number={batch_number}'}",
            _frames_count(frames) if backward else f"Last {len(frames)} forward frames:",
            COLUMN_HEADER,
            "\n".join(str(frame) for frame in frames),
            "\n\n",
        ]
    )


def _frames_count(frames) -> str:
    """A backward report's count of its frames: gradient frames and the forward frames among them
    (the forward before it, or recomputed by activation checkpointing)."""
    gradient = sum(1 for frame in frames if getattr(frame, "phase", None) == "backward")
    if gradient == len(frames) and gradient:
        return f"Last {gradient} gradient frames:"
    if gradient == 0:
        return f"Last {len(frames)} forward frames:"
    return f"Last {len(frames)} frames ({gradient} gradient, {len(frames) - gradient} forward):"


OVERFLOW_ERROR = (
    "DebugUnderflowOverflow: inf/nan detected, aborting as there is no point running further. "
    "Please scroll up above this traceback to see the activation values prior to this event."
)


def abort_error(batch_number: int, abort_after_batch_num) -> str:
    return (
        f"DebugUnderflowOverflow: aborting after {batch_number} batches due to"
        f" `abort_after_batch_num={abort_after_batch_num}` arg"
    )


def frame_text(frame) -> str:
    """One frame as the reference stores it: optional batch-start lines, the header, one line per entry."""
    lines = list(frame.lead)
    computed_in = getattr(frame, "computed_in", None)
    header = frame_header(frame.module_name, frame.class_name)
    lines.append(header if computed_in is None else f"{header} (autocast {str(computed_in).replace('torch.', '')})")
    for kind, ctx, payload in frame.entries:
        if kind == TENSOR:
            lines.append(tensor_line(frame.rows[payload], frame.dtypes[payload], ctx))
        else:
            lines.append(entry_line(kind, ctx, payload))
    return "\n".join(lines)


def frame_data(frame) -> dict:
    """One frame as data (for errors and logs): the tensor entries' statistics, decoded."""
    entries = []
    for kind, ctx, payload in frame.entries:
        if kind == TENSOR:
            entries.append({"entry": ctx, "dtype": str(frame.dtypes[payload]).replace("torch.", ""),
                            **decode_row(frame.rows[payload], frame.dtypes[payload])})
    return {"module": frame.module_name, "class": frame.class_name, "phase": frame.phase, "entries": entries}
