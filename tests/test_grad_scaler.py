"""GradScaler: an inf/nan gradient in a backward whose loss a GradScaler scaled is the scaler's
backoff (one line with the scale, one JSONL record), not a detection; the detector stops only where
the scaler cannot recover (a non-finite loss, the scale at its floor, too many backoffs in a row).
Real setups on CPU: torch.amp.GradScaler("cpu") under fp16 autocast, a subclass with its own
``scale``, Accelerate, the HF Trainer, Lightning's 16-mixed precision; torch.cuda.amp's on a GPU
(FSDP's ShardedGradScaler under DDP: test_distributed_detector)."""

import math
import re

import pytest
import torch
from torch import nn

import overflow_fast
import overflow_fast.stats.kinds
import overflow_fast.stats.torch_backend
from compat import HostReads, capture, read_back
from overflow_fast import DebugUnderflowOverflow, OverflowDetected, watch

BACKOFF = "GradScaler backoff in the backward of batch_number="
INIT_SCALE = 2.0 ** 30  # far too high for fp16 gradients: the scaler backs off about ten steps in a row


def tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def batch(step, micro=0):
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + micro))


def train(attach=None, steps=16, init_scale=INIT_SCALE, scaler=None, accumulate=1, loss_factor=None,
          nan_input_at=None, input_scale=1.0, wrap=None):
    """A standard fp16 loop (autocast, GradScaler, SGD) on CPU: (stdout, error, scales after each
    step, the weights at the end, the detector). ``wrap``: what the model runs in (DDP)."""
    model = tiny() if wrap is None else wrap(tiny())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = scaler or torch.amp.GradScaler("cpu", init_scale=init_scale)
    detector = attach(model) if attach is not None else None
    scales = []

    def loop():
        for step in range(steps):
            optimizer.zero_grad()
            for micro in range(accumulate):
                x = batch(step, micro) * input_scale
                if step == nan_input_at:
                    x[0, 0] = math.nan
                with torch.autocast("cpu", dtype=torch.float16):
                    out = model(x)
                loss = out.float().square().mean()
                if loss_factor is not None and step == loss_factor[0]:
                    loss = loss * loss_factor[1]  # a loss made non-finite outside the model
                scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())

    out, error = capture(loop, catch=Exception)
    return out, error, scales, [p.detach().clone() for p in model.parameters()], detector


def backoff_lines(out):
    return [line for line in out.splitlines() if line.startswith(BACKOFF)]


def backoffs_of(scales, init_scale=INIT_SCALE):
    """The scales at which the scaler backed off (each step whose scale then dropped)."""
    before = [init_scale] + scales[:-1]
    return [old for old, new in zip(before, scales) if new < old]


ATTACH = {
    "watch": lambda m: watch(m),
    "watch-skip": lambda m: watch(m, on_detect="skip"),
    "module": lambda m: DebugUnderflowOverflow(m, backward=True),
    "batch": lambda m: DebugUnderflowOverflow(m, backward=True, check="batch"),
}


@pytest.mark.parametrize("attach", sorted(ATTACH))
def test_a_scaler_backoff_is_one_line_and_training_goes_on_as_without_the_detector(attach):
    alone = train()
    out, error, scales, weights, _ = train(ATTACH[attach])
    assert alone[1] is None and error is None, out
    backed_off = backoffs_of(alone[2])
    assert len(backed_off) >= 5 and alone[2][-1] < INIT_SCALE  # the scaler backed off, then recovered
    assert not all(torch.equal(a, b) for a, b in zip(alone[3], tiny().parameters()))  # and trained
    # the scaler does what it does alone: same scales, same weights
    assert scales == alone[2] and all(torch.equal(a, b) for a, b in zip(weights, alone[3]))
    lines = backoff_lines(out)
    assert len(lines) == len(backed_off), out
    assert lines[0] == (f"{BACKOFF}0: inf gradient at scale {INIT_SCALE:.1e}, first in (model) (Sequential) "
                        "output.grad; the scaler skips this step and lowers its scale (1 in a row)")
    for index, (line, scale) in enumerate(zip(lines, backed_off)):
        assert f"at scale {scale:.1e}," in line and line.endswith(f"({index + 1} in a row)"), line
    # nothing else: no report, no "has infs" line, no skip
    assert "Detected inf/nan" not in out and "has infs" not in out and "has nans" not in out and "skipping" not in out


def test_backoffs_go_to_the_jsonl_log_not_as_detections(tmp_path):
    from overflow_fast.cli import main

    path = tmp_path / "run.jsonl"
    out, error, scales, _, detector = train(lambda m: watch(m, log=str(path)))
    detector.remove()
    assert error is None
    records = read_back(path)  # every line checked against the schema
    backoffs = [r for r in records if r["record"] == "backoff"]
    assert not [r for r in records if r["record"] == "detection"]
    assert [r["scale"] for r in backoffs] == backoffs_of(scales)
    assert [r["in_a_row"] for r in backoffs] == list(range(1, len(backoffs) + 1))
    assert backoffs[0]["step"] == 0 and backoffs[0]["module"] == "" and backoffs[0]["entries"] == ["output.grad"]
    report, _ = capture(lambda: main(["report", str(path)]), catch=SystemExit)
    assert f"GradScaler backoffs (inf/nan gradients the scaler recovered from, not detections): {len(backoffs)}," \
        in report


def test_gradient_accumulation_backs_off_once_per_scaler_step():
    alone = train(accumulate=3)
    out, error, scales, _, _ = train(lambda m: watch(m), accumulate=3)
    assert error is None and scales == alone[2]
    lines = backoff_lines(out)
    assert len(lines) == len(backoffs_of(scales)) and lines[-1].endswith(f"({len(lines)} in a row)")


# -- where the scaler cannot recover: a detection -------------------------------------------------

def test_a_non_finite_loss_is_a_detection_no_scale_explains_it():
    out, error, _, _, _ = train(lambda m: watch(m), init_scale=2.0 ** 8, loss_factor=(2, math.inf))
    assert isinstance(error, OverflowDetected) and error.phase == "backward" and error.batch_number == 2
    assert not backoff_lines(out)
    assert "Source: the gradient of the model's output came in non-finite (the loss or its scaling)" in out
    assert ("GradScaler: the loss given to scaler.scale() is non-finite: born in the forward, which no scale "
            "explains") in out
    assert error.detection["scaler"]["scale"] == 2.0 ** 8


def test_a_gradient_that_overflows_at_the_floor_is_a_detection():
    # gradients too large for fp16 at any scale (inputs of 1e3): the scaler backs off at 16, 8, 4, 2;
    # at 1.0 no backoff helps
    out, error, _, _, _ = train(lambda m: watch(m), init_scale=16.0, input_scale=3e3)
    assert isinstance(error, OverflowDetected) and error.phase == "backward", out
    assert [re.search(r"at scale (\S+),", line).group(1) for line in backoff_lines(out)] == \
        ["1.6e+01", "8.0e+00", "4.0e+00", "2.0e+00"]
    assert ("GradScaler: the scale is 1.0e+00, at or below min_loss_scale=1: the gradient overflows unscaled, "
            "which no backoff recovers") in out
    # the floor is an option
    out, error, _, _, _ = train(lambda m: watch(m, min_loss_scale=8.0), init_scale=16.0, input_scale=3e3)
    assert isinstance(error, OverflowDetected) and len(backoff_lines(out)) == 1


def test_too_many_backoffs_in_a_row_is_a_detection():
    out, error, scales, _, _ = train(lambda m: watch(m, max_backoffs=3))
    assert isinstance(error, OverflowDetected) and error.phase == "backward" and error.batch_number == 3
    assert len(backoff_lines(out)) == 3 and len(scales) == 3  # stopped inside the fourth step's backward
    assert "GradScaler: the scaler backed off 4 steps in a row, more than max_backoffs=3" in out
    assert error.detection["scaler"] == {"scale": INIT_SCALE / 8, "in_a_row": 4,
                                         "why": "the scaler backed off 4 steps in a row, more than max_backoffs=3"}
    # max_backoffs=0: every backoff is a detection
    _, error, scales, _, _ = train(lambda m: watch(m, max_backoffs=0))
    assert isinstance(error, OverflowDetected) and scales == []


def test_a_nan_born_in_the_forward_is_detected_under_a_scaler():
    out, error, _, _, _ = train(lambda m: watch(m), init_scale=2.0 ** 8, nan_input_at=3)
    assert isinstance(error, OverflowDetected) and error.phase == "forward" and error.batch_number == 3
    assert not backoff_lines(out)


def test_skip_counts_only_the_skips_the_scaler_would_not_make():
    # max_skips=0: the first step the detector itself skips raises; ten backoffs before it never do
    out, error, scales, _, _ = train(lambda m: watch(m, on_detect="skip", max_skips=0), nan_input_at=14)
    assert len(backoff_lines(out)) >= 5 and "skipping" not in out
    assert isinstance(error, OverflowDetected) and error.phase == "forward" and error.batch_number == 14
    assert len(scales) == 14
    # a skipped step's gradients are not a backoff of their own
    out, error, _, _, _ = train(lambda m: watch(m, on_detect="skip"), init_scale=2.0 ** 8, nan_input_at=3)
    assert error is None and not backoff_lines(out) and out.count("overflow_fast: skipping this step") == 1


# -- the scalers of the usual setups ----------------------------------------------------------------

def test_a_scaler_subclass_with_its_own_scale_defined_after_the_detector():
    # as FSDP's ShardedGradScaler does: its own scale(), never calling GradScaler's
    model = tiny()
    detector = watch(model)

    class OwnScale(torch.amp.GradScaler):
        def scale(self, outputs):
            if self._scale is None:
                self._lazy_init_scale_growth_tracker(outputs.device)
            return outputs * self._scale.to(outputs.device)

    out, error, scales, _, _ = train(lambda m: watch(m), scaler=OwnScale("cpu", init_scale=INIT_SCALE))
    detector.remove()
    assert error is None and len(backoff_lines(out)) == len(backoffs_of(scales)) >= 5


def test_recognising_the_scaler_adds_no_host_read(monkeypatch):
    # the scale is read only in a backward that found a nan/inf: a clean scaled step reads the
    # host exactly as a clean unscaled one does
    monkeypatch.setattr(overflow_fast.stats.kinds, "CPU_AS_DEVICE", True)
    monkeypatch.setattr(overflow_fast.stats.torch_backend, "HOST_DEVICE_TYPES", frozenset())

    def reads_of_a_step(scaled):
        model = tiny()
        watch(model, find_op=False)
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        reads = HostReads()
        with reads:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(batch(0)).float().square().mean()
            (scaler.scale(loss) if scaled else loss).backward()
        return reads.names

    assert reads_of_a_step(True) == reads_of_a_step(False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.cuda.amp.GradScaler scales only on CUDA")
def test_torch_cuda_amp_grad_scaler():
    model = tiny().cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(FutureWarning):
        scaler = torch.cuda.amp.GradScaler(init_scale=INIT_SCALE)
    watch(model)

    def loop():
        for step in range(16):
            optimizer.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(batch(step).cuda()).float().square().mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

    out, error = capture(loop, catch=Exception)
    assert error is None and len(backoff_lines(out)) >= 5


@pytest.mark.one_path  # the integration hands the scaler over; its reads: the tests above
def test_accelerate():
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="fp16")
    # what Accelerator() itself sets up where fp16 runs (an accelerator): autocast and a GradScaler
    accelerator.native_amp = True
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    try:
        model = tiny()
        watch(model)
        prepared, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))

        def loop():
            for step in range(16):
                loss = prepared(batch(step)).float().square().mean()
                assert loss.dtype == torch.float32 and prepared(batch(0)).dtype == torch.float32
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()

        out, error = capture(loop, catch=Exception)
    finally:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(True)
    assert error is None, out
    assert len(backoff_lines(out)) >= 5 and accelerator.scaler.get_scale() < INIT_SCALE


@pytest.mark.one_path  # the integration hands the scaler over; its reads: the tests above
def test_hf_trainer(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers' Trainer refuses to start without it
    import models
    from overflow_fast.integrations.transformers import DetectorCallback

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, index):
            ids = models.token_batch(index, batch=1, length=8)[0]
            return {"input_ids": ids, "labels": ids}

    model = models.gpt2().train()
    before = [p.detach().clone() for p in model.parameters()]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, learning_rate=1e-3, report_to=[],
        use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        fp16=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Data(), callbacks=[DetectorCallback()])
    # what the Trainer's Accelerator sets up where fp16 runs (an accelerator): autocast and a GradScaler
    trainer.accelerator.native_amp = True
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)
    try:
        out, error = capture(trainer.train, catch=Exception)
    finally:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(True)
    assert error is None, out
    lines = backoff_lines(out)
    assert [re.search(r"\(optimizer step (\d+)\)", line).group(1) for line in lines] == ["0", "1", "2"], out
    assert trainer.accelerator.scaler.get_scale() == 2.0 ** 37
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the scaler skipped every step


@pytest.mark.one_path  # the integration hands the scaler over; its reads: the tests above
def test_lightning_16_mixed():
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.plugins import MixedPrecision

    from overflow_fast.integrations.lightning import DetectorCallback

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = tiny()

        def training_step(self, batch_, batch_idx):
            return self.net(batch_[0]).float().square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 8)), batch_size=4)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    trainer = pl.Trainer(callbacks=[DetectorCallback()], max_epochs=1, accelerator="cpu", devices=1, logger=False,
                         enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                         plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    out, error = capture(lambda: trainer.fit(Module(), data), catch=Exception)
    assert error is None, out
    assert len(backoff_lines(out)) == 4 and scaler.get_scale() == INIT_SCALE / 16


class _NanGradient(torch.autograd.Function):
    """The identity forward; its backward makes a nan of every gradient (at any scale)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * math.nan


class _NanInBackward(nn.Module):
    def forward(self, x):
        return _NanGradient.apply(x)


@pytest.mark.parametrize("check", ["module", "batch", "step"])
def test_a_nan_at_the_same_entry_at_every_scale_is_its_own_fault_after_three_backoffs(check):
    def attach(model):
        model.insert(1, _NanInBackward())  # after the first Linear: its backward makes the nan
        return watch(model, check=check)

    out, error, scales, _, _ = train(attach, init_scale=2.0 ** 8)
    assert isinstance(error, OverflowDetected) and error.phase == "backward", out
    lines = backoff_lines(out)
    assert [re.search(r": (.*) gradient at scale (\S+),", line).groups() for line in lines] == \
        [("nan", "2.6e+02"), ("nan", "1.3e+02")], lines  # said as a nan, at two scales; the third is a fault
    assert "the same entry at every scale is its own fault" in error.detection["scaler"]["why"]
    report = out.splitlines()
    assert report.index(next(line for line in report if line.startswith("GradScaler: a nan first in"))) > \
        report.index(next(line for line in report if line.startswith("Source:")))  # the documented order
