"""The pictures' timeline: its unit, and bins of a power-of-two number of steps.

Its x is the trainer's optimizer step (``OPTIMIZER``) where the records carry one, else the
detector's batch number (``BATCH``). Steps go into bins of ``width`` steps, aligned to its
multiples, so that a picture has fewer than ``2 * max_columns`` columns.
"""

BATCH, OPTIMIZER = "batch", "optimizer"  # the timeline's unit


def bin_width(first, last, max_columns):
    """The smallest power of two such that bins of that many steps, aligned to multiples of it,
    cover [first, last] in fewer than 2 * max_columns columns."""
    width = 1
    while last // width - first // width >= 2 * max_columns:
        width *= 2
    return width
