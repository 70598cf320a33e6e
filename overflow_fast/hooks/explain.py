"""What a detection's report says beyond the reference's, for ``passes``: where the first nan/inf
sits (``where``), whether it came in with the batch (the model's own inputs, read before anything
runs), whether the gradient arriving at a module was read, what a GradScaler could not recover,
and with find_op the op and the line (``replay.culprit``) and the reproducer. Each takes the
detector's ``Passes`` (its options, decisions and what find_op keeps) and never fails the run."""

import warnings

from . import source, where
from .. import distributed
from ..replay import culprit
from ..stats.layout import holds_nonfinite
from .frames import BACKWARD, Frame, class_name, entries_of, input_items
from .text import TENSOR


def read_model_inputs(passes, args, kwargs):
    """The model's own call's inputs (keyword ones too), read before anything runs, as rows of this
    thread's forward pass: a nan/inf among them came in with the batch, whichever module first
    shows it."""
    entries, tensors, dtypes = entries_of(input_items(args, kwargs, passes.options.containers))
    if not tensors:
        return
    current = passes.forward_pass()
    sources = current.reads.add(tensors)
    if sources is not None:
        current.model_inputs = (entries, dtypes, sources, tensors)


def beyond_the_reference(passes, current, found):
    """The detection ``found`` (``decisions.Found``) of ``current`` (a pass) with what its report
    says beyond the reference's: ``where``, ``scaler``, with find_op ``op`` and ``transient``, with
    repro ``repro``; its first frame the model's own inputs' where it came in with the batch."""
    decisions, options = passes.decisions, passes.options
    found = _from_the_batch(passes.model, current, found)
    frame = found.first_frame
    if frame.phase == BACKWARD and found.bad and not any(ctx.startswith("output") for ctx in found.bad):
        # whether the gradient arriving at the module's outputs was read (the Source line's claim)
        frame.incoming_read = (passes.gradients is None or passes.gradients.incoming_read(
            decisions.modules_by_name().get(frame.module_name)))
    if found.bad:  # where in the tensor the Source line names
        sources, reads = found.sources, current.reads
        unchanged = (None if sources is None or reads is None else
                     lambda tensor, index: reads.unchanged(sources, index, tensor))
        found.detection["where"] = where.facts(
            found.first_frame, source.source_entry(found.first_frame, found.bad),
            where.Held(found.tensors, found.kept_call, passes.kept_forward, passes.kept_gradients,
                       decisions.modules_by_name(), options.kwargs, options.containers, decisions.samples,
                       unchanged))
    scaler = current.scaling.unrecoverable() if current.scaling is not None else None
    if scaler is not None and found.first_frame.phase == BACKWARD:
        found.detection["scaler"] = scaler  # a GradScaler's backward that no backoff recovers
    if options.keeps_calls:
        _op(passes, found)
    return found


def _from_the_batch(model, current, found):
    """A detection whose first nan/inf was among the model's own inputs (``read_model_inputs``)
    came in with the batch: its Source, Where and Op are about that input (the model's frame,
    that entry), whichever module first showed it."""
    if current.model_inputs is None or not found.bad or source.origin(found.first_frame, found.bad) != "before":
        return found
    entries, dtypes, sources, tensors = current.model_inputs
    frame = Frame("", class_name(model), entries, dtypes)
    current.reads.resolve(frame, sources)
    bad = [ctx for kind, ctx, payload in frame.entries if kind == TENSOR and holds_nonfinite(frame.rows[payload])]
    if not bad:
        return found
    return found._replace(first_frame=frame, bad=bad, tensors=tensors, sources=sources)


def _op(passes, found):
    """find_op: the op and the line that made the detection's first nan/inf (its replay), and
    whether it is transient, into the detection; repro: the reproducer file of that call."""
    decisions, options = passes.decisions, passes.options
    try:
        explained = culprit.op_of(found, source.origin(found.first_frame, found.bad), passes.kept_forward,
                                  passes.kept_gradients, decisions.modules_by_name(), class_name)
    except Exception as error:  # noqa: BLE001 - a replay must never break training
        explained = culprit.failed(found.first_frame.phase, error)
    if explained is None:
        return
    if options.find_op:
        found.detection["op"] = explained.record()
        found.detection["transient"] = explained.transient
    if options.repro is not None and explained.call is not None:
        from ..replay.repro import ReproError

        try:
            found.detection["repro"] = explained.write_repro(
                options.repro, distributed.rank(), decisions.step_of(found.batch), found.detection,
                decisions.module_names.get(explained.call.module))
        except ReproError as error:
            warnings.warn(f"overflow_fast: {error}", RuntimeWarning, stacklevel=3)
