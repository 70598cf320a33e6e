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
        self._values = (None, set())  # (batch, the abs-max values warned of in it): their copies are not births
        self._underflow_at = {}  # module -> the step of its last underflow line

    def lines(self, frame, batch_number, step=None, global_step=None):
        """Lines for entries crossing ``warn_above`` of the largest finite value of the dtype they
        are computed in (under autocast, a float32 weight cast to float16: float16's), each
        (module, entry) once and each value once per batch (a copy passed on to the next module
        is not a new birth), named by the trainer's optimizer step where it is known; and one line
        for a module whose entries underflow (an activation or gradient all zeros, any entry
        mostly subnormal), at most once per UNDERFLOW_EVERY steps (``step``, else the batch
        number); gradients only with ``warn_gradients``."""
        lines = []
        underflows = []
        where = f"{frame.module_name or '(model)'} {frame.class_name}"
        when = f"optimizer step {global_step}" if global_step is not None else f"batch_number={batch_number}"
        if self._values[0] != batch_number:
            self._values = (batch_number, set())
        values = self._values[1]
        for ctx, row, dtype in frame.tensor_entries():
            if not dtype.is_floating_point or row[NUMEL] == 0 or holds_nonfinite(row):
                continue
            key = (frame.module_name, ctx)
            judged = _judged(dtype, frame.computed_in)
            limit = torch.finfo(judged).max
            abs_max = decode_row(row, dtype)["abs_max"]
            if abs_max >= self.warn_above * limit and key not in self._warned:
                self._warned.add(key)
                if (abs_max, judged) not in values:
                    values.add((abs_max, judged))
                    cast = " it is cast to under autocast" if judged is not dtype else ""
                    lines.append(f"{where} {ctx}: abs max {abs_max:.2e} is {abs_max / limit:.0%} of the largest "
                                 f"{str(judged).replace('torch.', '')}{cast} ({limit:.2e}) at {when}")
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


def _judged(dtype, computed_in):
    """The dtype an entry's headroom is judged against: the one its call computed in under autocast,
    where that is narrower than its own (``schema.judged_in``, for torch dtypes)."""
    if computed_in is None or not computed_in.is_floating_point or torch.finfo(computed_in).max >= torch.finfo(dtype).max:
        return dtype
    return computed_in
