"""Run the same script against the reference detector and ours and capture everything they show."""

import contextlib
import copy
import io

import torch
from torch.overrides import TorchFunctionMode
from transformers.debug_utils import DebugUnderflowOverflow as ReferenceDetector

from overflow_fast import DebugUnderflowOverflow


def run(detector_cls, model, batches, steps, **kwargs):
    """Attach ``detector_cls`` to ``model``, run ``steps(model, batch)`` for each batch.

    Returns (stdout text, list of (exception type name, message) or None per batch, detector).
    An exception raised while building the detector counts as the first outcome. The type is the
    nearest builtin class: overflow_fast raises a ValueError subclass where the reference raises
    ValueError (same message), so that ``except ValueError`` holds for both.
    """
    out = io.StringIO()
    outcomes = []
    torch.manual_seed(1234)  # dropout in training mode draws the same masks in every run
    with contextlib.redirect_stdout(out):
        try:
            detector = detector_cls(model, **kwargs)
        except Exception as error:  # noqa: BLE001 - the outcome itself is compared
            return out.getvalue(), [(_builtin_name(error), str(error))], None
        for batch in batches:
            try:
                steps(model, batch)
                outcomes.append(None)
            except Exception as error:  # noqa: BLE001
                outcomes.append((_builtin_name(error), str(error)))
    return out.getvalue(), outcomes, detector


def _builtin_name(error):
    return next(cls.__name__ for cls in type(error).__mro__ if cls.__module__ == "builtins")


def forward(model, batch):
    with torch.no_grad():
        if isinstance(batch, dict):
            model(**batch)
        else:
            model(*batch) if isinstance(batch, tuple) else model(batch)


def compare(model, batches, steps=forward, check="module", ours=None, **kwargs):
    """Run the reference and overflow_fast on identical copies of ``model``; return both captures.
    ``kwargs`` go to both detectors, ``ours`` (a dict) to overflow_fast's alone."""
    reference_model = copy.deepcopy(model)
    ours_model = copy.deepcopy(model)
    want = run(ReferenceDetector, reference_model, batches, steps, **kwargs)
    got = run(DebugUnderflowOverflow, ours_model, batches, steps, check=check, **kwargs, **(ours or {}))
    return want, got


def assert_identical(model, batches, steps=forward, check="module", ours=None, **kwargs):
    (want_out, want_outcomes, _), (got_out, got_outcomes, detector) = compare(
        model, batches, steps, check=check, ours=ours, **kwargs
    )
    assert got_outcomes == want_outcomes
    assert got_out == want_out, _first_difference(got_out, want_out)
    return got_out, got_outcomes, detector


def _first_difference(got, want):
    got_lines, want_lines = got.splitlines(), want.splitlines()
    for i, (g, w) in enumerate(zip(got_lines, want_lines)):
        if g != w:
            return f"line {i}: got {g!r}, want {w!r}"
    return f"lengths differ: got {len(got_lines)} lines, want {len(want_lines)}"


def capture(fn, catch=ValueError):
    """(stdout of ``fn()``, the ``catch`` it raised or None)."""
    out = io.StringIO()
    error = None
    with contextlib.redirect_stdout(out):
        try:
            fn()
        except catch as caught:
            error = caught
    return out.getvalue(), error


_HOST_READS = {"item", "tolist", "__bool__", "__format__", "cpu", "numpy", "__int__", "__float__", "__index__"}


class HostReads(TorchFunctionMode):
    """Records every tensor method that moves data to the host (``names``, in order)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _HOST_READS:
            self.names.append(name)
        return func(*args, **(kwargs or {}))


def read_back(path):
    """Every record of a JSONL log, each checked against the project's own schema (the report's)."""
    import json

    from overflow_fast.recording import schema

    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            record = json.loads(line)
            try:
                schema.check(record)
            except schema.Malformed as error:
                raise AssertionError(f"{path}:{number}: {error}: {line[:300]}") from None
            records.append(record)
    return records
