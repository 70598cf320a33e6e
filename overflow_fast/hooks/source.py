"""The report's ``Source:`` line: where the first non-finite values were born, judged from the first
frame (in execution order) that holds one. Pure host logic over a frame's entries."""

from .frames import BACKWARD


def origin(frame, bad):
    """Where the first non-finite values were born, judged from the first frame (in execution
    order) that holds one, ``bad`` its entries (every frame before it was finite): one of
    "loss" (the model's output gradient came in non-finite), "gradient" (made by the backward of
    the modules that consume an output: ``frame.consumers``), "backward" (the module's own backward,
    from a finite incoming gradient), "weight" (already non-finite before this forward), "outside"
    (in the input batch), "before" (in code between modules) or "forward" (the module's forward,
    from finite inputs and weights)."""
    if frame.phase == BACKWARD:
        if any(ctx.startswith("output") for ctx in bad):
            return "loss" if frame.module_name == "" else "gradient"
        return "backward"
    if any(not ctx.startswith(("input", "output")) for ctx in bad):
        return "weight"
    if any(ctx.startswith("input") for ctx in bad):
        return "outside" if frame.module_name == "" else "before"
    return "forward"


def source_entry(frame, bad):
    """The entry the Source line names: the first weight when a weight was already non-finite,
    the first input when it came in from outside or was made before the module, else the first
    entry that counted."""
    kind = origin(frame, bad)
    if kind == "weight":
        return next(ctx for ctx in bad if not ctx.startswith(("input", "output")))
    if kind in ("outside", "before"):
        return next(ctx for ctx in bad if ctx.startswith("input"))
    return bad[0]


def source_line(frame, bad):
    """The report's line saying where the first non-finite values were born (``origin``), naming
    ``source_entry``."""
    where = f"{frame.module_name or '(model)'} ({frame.class_name})"
    kind = origin(frame, bad)
    if kind == "loss":
        return "Source: the gradient of the model's output came in non-finite (the loss or its scaling)"
    if kind == "gradient":
        consumers = ", ".join(name or "(model)" for name in frame.consumers or [])
        if not consumers:
            return (f"Source: born in backward, in the gradient arriving at {where} {bad[0]}: made by the backward "
                    "of code outside any hooked module that used it (the enclosing module's own code, or a "
                    "torch.compile region)")
        return (f"Source: born in backward, in the gradient arriving at {where} {bad[0]}: "
                f"made by the backward of {consumers}")
    if kind == "backward":
        if frame.incoming_read is False:
            return (f"Source: born in backward, first seen in {where} {bad[0]}: the gradient arriving at its "
                    "outputs was not read (e.g. in a torch.compile region), so which backward made it is not known")
        return f"Source: born in backward of {where}: {bad[0]} from a finite incoming gradient"
    if kind == "weight":
        weights = [ctx for ctx in bad if not ctx.startswith(("input", "output"))]
        return f"Source: a weight already non-finite before this forward: {where} {weights[0]}"
    inputs = [ctx for ctx in bad if ctx.startswith("input")]
    if kind == "outside":
        return f"Source: came in from outside, in the input batch: {where} {inputs[0]}"
    if kind == "before":
        return (f"Source: born outside any module, in the code before {where} {inputs[0]}: every module "
                "run before it was finite (an operation in a parent's forward, or an input from outside)")
    return f"Source: born in forward of {where}: {bad[0]} from finite inputs and weights"
