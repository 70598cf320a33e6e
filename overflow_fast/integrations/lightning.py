"""overflow_fast in PyTorch Lightning 2.x (``lightning.pytorch``, or ``pytorch_lightning`` where only
that is installed)::

    trainer = L.Trainer(callbacks=[DetectorCallback()])   # watch()'s options; any detector option overrides
    trainer.fit(model)   # on a nan/inf: the report, then the reference's ValueError out of fit()

The detector is attached to the LightningModule when fitting starts and removed when it ends or
raises. A LightningModule's ``training_step`` usually calls an inner network and never its own
forward: each call of that network is a pass that decides when it returns (and with gradient
checks, each backward pass), so a nan is reported at the step that made it. Detections, errors and
records carry the trainer's ``global_step`` and ``"train"`` or ``"eval"``.

With ``check="step"`` no module has a hook: each training (validation) step is the guard's root
call, from its batch's start to the loss its backward runs from (the validation step's outputs),
and a replay runs ``training_step`` again (``self.log`` does nothing inside it); the loss is read
before the backward, every gradient after it, before the optimizer step.
"""

import collections.abc
import contextlib
from typing import Any

from ..hooks.detector import DebugUnderflowOverflow
from ..hooks.options import WATCH_DEFAULTS, Options

try:
    import lightning.pytorch as pl
except ImportError as missing:
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef]  # the older package name
    except ImportError:
        raise ImportError(
            f"overflow_fast.integrations.lightning needs PyTorch Lightning 2.x: pip install lightning "
            f"(import lightning.pytorch failed: {missing}; nor is the older pytorch_lightning installed)") from missing

__all__ = ["DetectorCallback"]


class DetectorCallback(pl.Callback):
    """Attach ``DebugUnderflowOverflow(pl_module, **options)`` while fitting (``watch()``'s options
    unless overridden: ``check="batch"``, ``kwargs``, ``containers``, ``backward=True``). The
    detector is ``callback.detector`` while it is attached."""

    def __init__(self, **options: Any) -> None:
        self.options = Options.of(**{**WATCH_DEFAULTS, **options})  # a bad option fails here, not in fit()
        self.detector = None
        self.guard = None  # check="step": the detector's guard, which this callback drives

    def on_fit_start(self, trainer, pl_module):
        self._detach(quiet=False)
        self.detector = DebugUnderflowOverflow.from_options(pl_module, self.options)
        self.guard = self.detector._driven() if self.options.check == "step" else None

    def _batch_start(self, trainer, mode):
        if self.detector is not None:
            self.detector.set_step(trainer.global_step, mode)

    def _batch_end(self):
        if self.detector is not None:
            self.detector.flush()  # anything still pending is decided with its batch

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._batch_start(trainer, "train")
        if self.guard is not None:
            self.guard.begin(_replayed(pl_module, "training_step", trainer.accumulate_grad_batches), (batch, batch_idx))

    def on_before_backward(self, trainer, pl_module, loss):
        if self.guard is not None:
            self.guard.end(loss)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._batch_start(trainer, "eval")
        if self.guard is not None:
            self.guard.begin(_replayed(pl_module, "validation_step", 1), (batch, batch_idx))

    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._batch_start(trainer, "eval")

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._batch_start(trainer, "eval")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._batch_end()

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if self.guard is not None:
            self.guard.end(outputs)
        self._batch_end()

    def on_fit_end(self, trainer, pl_module):
        self._detach(quiet=False)

    def on_exception(self, trainer, pl_module, exception):
        self._detach(quiet=True)  # the exception already propagating is the one to see

    def teardown(self, trainer, pl_module, stage):
        self._detach(quiet=True)

    def _detach(self, quiet):
        detector, self.detector, self.guard = self.detector, None, None
        if detector is None:
            return
        try:
            detector.remove()
        except ValueError:
            if not quiet:
                raise


def _replayed(pl_module, step, accumulate):
    """What a replay of a training (validation) step runs: the LightningModule's step on the same
    batch, its loss as the backward took it (divided over accumulated batches, as Lightning does),
    logging nothing into the trainer."""
    def run(batch, batch_idx):
        with _not_logging(pl_module):
            output = getattr(pl_module, step)(batch, batch_idx)
        if isinstance(output, collections.abc.Mapping):
            output = output.get("loss")
        return output / accumulate if accumulate > 1 and output is not None else output
    return run


@contextlib.contextmanager
def _not_logging(pl_module):
    saved = {name: pl_module.__dict__[name] for name in ("log", "log_dict") if name in pl_module.__dict__}
    pl_module.__dict__["log"] = pl_module.__dict__["log_dict"] = lambda *args, **kwargs: None
    try:
        yield
    finally:
        for name in ("log", "log_dict"):
            pl_module.__dict__.pop(name, None)
        pl_module.__dict__.update(saved)
