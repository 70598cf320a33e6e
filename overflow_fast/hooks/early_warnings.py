"""Early warnings (``warn_above``): a line for an entry nearing its dtype's largest finite value (the
warning before an fp16/fp8 overflow), and one for a module whose entries underflow (an activation or
gradient all zeros, any entry mostly subnormal). Pure host logic over frames' rows."""

import torch

from ..stats.layout import ABS_MAX, NUMEL, SUBNORMAL, ZERO, decode_row, holds_nonfinite

# Subnormals above this fraction of an entry's elements get an underflow line.
SUBNORMAL_FRACTION = 0.5
UNDERFLOW_EVERY = 100  # steps between two underflow lines of one module


class EarlyWarnings:
    """``warn_above`` (a fraction of the dtype's largest finite value) and ``warn_gradients`` (whether
    gradients get underflow lines) as ``options.Options`` validated them."""

    def __init__(self, warn_above, warn_gradients):
        self.warn_above = warn_above
        self.warn_gradients = warn_gradients
        self._warned = set()  # (module, entry) already warned of nearing the dtype's largest value
        self._underflow_at = {}  # module -> the step of its last underflow line

    def lines(self, frame, batch_number, step=None):
        """Lines for entries crossing ``warn_above`` of their dtype's largest finite value (each
        (module, entry) once), and one line for a module whose entries underflow (an activation
        or gradient all zeros, any entry mostly subnormal), at most once per UNDERFLOW_EVERY
        steps (``step``, else the batch number); gradients only with ``warn_gradients``."""
        lines = []
        underflows = []
        where = f"{frame.module_name or '(model)'} {frame.class_name}"
        for ctx, row, dtype in frame.tensor_entries():
            if not dtype.is_floating_point or row[NUMEL] == 0 or holds_nonfinite(row):
                continue
            key = (frame.module_name, ctx)
            limit = torch.finfo(dtype).max
            abs_max = decode_row(row, dtype)["abs_max"]
            if abs_max >= self.warn_above * limit and key not in self._warned:
                self._warned.add(key)
                lines.append(f"{where} {ctx}: abs max {abs_max:.2e} is {abs_max / limit:.0%} of the largest "
                             f"{str(dtype).replace('torch.', '')} ({limit:.2e}) at batch_number={batch_number}")
            gradient = ctx.endswith(".grad")
            if gradient and not self.warn_gradients:
                continue
            # parameters are often all zeros by design (biases at initialisation): only activations
            # and gradients count as having underflowed to zeros
            if row[ZERO] == row[NUMEL] and row[ABS_MAX] == 0 and (gradient or ctx.startswith(("input", "output"))):
                underflows.append(f"{ctx}: all {row[NUMEL]} elements are zero")
            elif row[SUBNORMAL] > SUBNORMAL_FRACTION * row[NUMEL]:
                underflows.append(f"{ctx}: {row[SUBNORMAL] / row[NUMEL]:.0%} of {row[NUMEL]} elements are subnormal")
        if underflows:
            step = batch_number if step is None else step
            last = self._underflow_at.get(frame.module_name)
            if last is None or not 0 <= step - last < UNDERFLOW_EVERY:
                self._underflow_at[frame.module_name] = step
                lines.append(f"{where} underflows at batch_number={batch_number}: {'; '.join(underflows)}")
        return lines
