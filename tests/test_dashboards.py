"""log= to TensorBoard and W&B: per module, at each logged step, the lowest headroom of its
floating-point entries and its largest subnormal fraction, from the rows the detector read (the
JSONL records of the same run are the ground truth); detections as text."""

import json
import math

import pytest
import torch
from torch import nn

from overflow_fast import DebugUnderflowOverflow, watch
from overflow_fast.recording.dashboards import HEADROOM, SUBNORMAL_FRACTION

NAN = float("nan")


def model_and_data(bad_at=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    batches = [torch.randn(3, 4) for _ in range(6)]
    if bad_at is not None:
        batches[bad_at][0, 0] = NAN
    return model, batches


def expected_from_records(path):
    """{(step, module): (lowest headroom, largest subnormal fraction)} from the JSONL records."""
    want = {}
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            if record["record"] != "entry" or not record["dtype"].startswith("float") or not record["numel"]:
                continue
            key = (record["step"], record["module"] or "(model)")
            abs_max = record["abs_max"]
            bits = None if not abs_max else math.log2(torch.finfo(getattr(torch, record["dtype"])).max / abs_max)
            headroom, subnormal = want.get(key, (math.inf, 0.0))
            want[key] = (min(headroom, bits) if bits is not None else headroom,
                         max(subnormal, record["subnormal_frac"]))
    return want


@pytest.mark.parametrize("check", ["module", "batch"])
def test_tensorboard_scalars_equal_the_records(check, tmp_path):
    tensorboard = pytest.importorskip("torch.utils.tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = tensorboard.SummaryWriter(str(tmp_path / "tb"))
    model, batches = model_and_data()
    detector = DebugUnderflowOverflow(model, check=check, log=[writer, str(tmp_path / "run.jsonl")], log_every=2)
    for x in batches:
        with torch.no_grad():
            model(x)
    detector.remove()
    writer.close()
    want = expected_from_records(tmp_path / "run.jsonl")
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert f"{HEADROOM}0" in tags and f"{SUBNORMAL_FRACTION}(model)" in tags
    for (step, module), (headroom, subnormal) in want.items():
        got = {e.step: e.value for e in events.Scalars(HEADROOM + module)}
        assert got[step] == pytest.approx(headroom, rel=1e-6), (step, module)
        got = {e.step: e.value for e in events.Scalars(SUBNORMAL_FRACTION + module)}
        assert got[step] == pytest.approx(subnormal), (step, module)
    assert sorted({step for step, _ in want}) == [0, 2, 4]  # log_every=2


def test_tensorboard_gets_the_detection_as_text_and_the_optimizer_step(tmp_path):
    tensorboard = pytest.importorskip("torch.utils.tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = tensorboard.SummaryWriter(str(tmp_path / "tb"))
    model, batches = model_and_data(bad_at=3)
    detector = watch(model, log=writer, log_every=100, on_detect="record")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for index, x in enumerate(batches):
        detector.set_step(100 + index, "train")
        model(x).sum().backward()
        optimizer.zero_grad()
    detector.remove()
    writer.close()
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    events.Reload()
    texts = events.Tags()["tensors"]
    assert any(tag.startswith("overflow_fast/detection") for tag in texts), events.Tags()
    headroom = events.Scalars(HEADROOM + "0")
    # log_every=100 over optimizer steps 100..105: step 100 is logged, and the detecting step 103
    assert [e.step for e in headroom] == [100, 103]


def test_wandb_offline_run(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(mode="offline", dir=str(tmp_path), project="overflow-fast-test")
    try:
        model, batches = model_and_data()
        detector = DebugUnderflowOverflow(model, check="batch", log=run)
        for x in batches:
            with torch.no_grad():
                model(x)
        detector.remove()
        assert run.summary[f"{HEADROOM}0"] > 0
        assert 0 <= run.summary[f"{SUBNORMAL_FRACTION}0"] <= 1
    finally:
        run.finish()


def test_log_rejects_what_it_cannot_write_to():
    with pytest.raises(TypeError, match="SummaryWriter"):
        DebugUnderflowOverflow(nn.Linear(2, 2), log=42)
    with pytest.raises(ValueError, match="empty"):
        DebugUnderflowOverflow(nn.Linear(2, 2), log=[])
