"""How the report and the diff write what a log holds: names made printable (and, in pictures,
short), times in the timeline's unit, counts that never read as steps."""

from .timeline import OPTIMIZER

LABEL_CHARS = 48  # a name in a picture: longer ones are cut in the middle (the text keeps them whole)


def printable(text):
    """A name from a log as it may be printed: control characters escaped (a log must not drive
    the terminal)."""
    text = str(text)
    if text.isprintable():
        return text
    return text.encode("unicode_escape").decode("ascii")


def label(text, limit=LABEL_CHARS):
    """``printable(text)`` cut to ``limit`` characters, its middle left out (a module's path keeps
    its start and its last parts), for a picture: laying out a name of megabytes takes minutes."""
    text = str(text)
    if len(text) <= 4 * limit:
        whole = printable(text)
        if len(whole) <= limit:
            return whole
    head = (limit - 1) // 2
    tail = limit - 1 - head
    return printable(text[:head])[:head] + "\u2026" + printable(text[-tail:])[-tail:]


def cut(column, keep=4 * LABEL_CHARS):
    """SQL: a name no longer than about ``keep`` characters, its middle left out, for a label (a
    picture's names come from the engine cut: a log may hold names of megabytes)."""
    return (f"CASE WHEN length({column}) <= {2 * keep} THEN {column} "
            f"ELSE substr({column}, 1, {keep}) || '\u2026' || substr({column}, -{keep}) END")


def module_name(name, class_name=None):
    """"name (Class)", printable; the model itself is "(model)"."""
    text = printable(name) if name else "(model)"
    return f"{text} ({printable(class_name)})" if class_name else text


def when(step, global_step, mode, unit):
    """Where a record sits in time, in the timeline's unit: "step 8" (the batch number, in a log
    without optimizer steps), "optimizer step 3 (train, batch 8)"; the mode when known."""
    if unit == OPTIMIZER and global_step is not None:
        return f"optimizer step {global_step} ({mode + ', ' if mode else ''}batch {step})"
    text = f"batch {step} (no optimizer step)" if unit == OPTIMIZER else f"step {step}"
    return text + (f" ({mode})" if mode else "")
