"""The Lightning callback on CPU: a LightningModule whose training_step drives an inner network
(its own forward never runs) is decided at the nan's step, in both check modes and with gradient
checks; no hook is left after fit() returns or raises; on_detect="skip" lets fit() complete; and
the DDP strategy on 2 CPU processes stops every rank at the same step."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from overflow_fast.integrations.lightning import DetectorCallback  # noqa: E402

NAN = float("nan")


class Module(pl.LightningModule):
    def __init__(self, bad_step=None, bad="batch", validate=False):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.bad_step, self.bad = bad_step, bad
        self.steps = []
        self.validate = validate

    def training_step(self, batch, batch_idx):
        x, = batch
        self.steps.append(self.global_step)
        if self.global_step == self.bad_step:
            if self.bad == "batch":
                x = x.clone()
                x[0, 0] = NAN
            elif self.bad == "weight":
                with torch.no_grad():
                    self.net[2].weight[0, 0] = NAN
        loss = self.net(x).square().mean()
        if self.bad == "gradient" and self.global_step == self.bad_step:
            loss = loss * float("inf")  # a finite forward, non-finite gradients
        return loss

    def validation_step(self, batch, batch_idx):
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def loader(count=8):
    torch.manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(count * 2, 4))
    return torch.utils.data.DataLoader(data, batch_size=2, shuffle=False)


def trainer(callback, steps=6, **kwargs):
    return pl.Trainer(callbacks=[callback], max_steps=steps, accelerator="cpu", devices=1, logger=False,
                      enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                      num_sanity_val_steps=0, **kwargs)


def hooks_left(module):
    return any(m._forward_hooks or m._forward_pre_hooks for m in module.modules()) or any(
        p._post_accumulate_grad_hooks for p in module.parameters())


@pytest.mark.parametrize("options", [{}, {"check": "module"}, {"check": "batch", "backward": False}],
                         ids=["watch", "module", "batch-forward-only"])
@pytest.mark.parametrize("bad", ["batch", "weight"])
def test_a_nan_stops_fit_at_its_step(options, bad, capsys):
    module = Module(bad_step=3, bad=bad)
    callback = DetectorCallback(**options)
    with pytest.raises(ValueError, match="inf/nan detected") as caught:
        trainer(callback).fit(module, loader())
    assert module.steps == [0, 1, 2, 3]  # stopped inside step 3, before its optimizer step
    assert caught.value.global_step == 3 and caught.value.mode == "train"
    assert caught.value.batch_number == 0  # the LightningModule's own forward never ran
    assert "Detected inf/nan" in capsys.readouterr().out
    assert callback.detector is None and not hooks_left(module)


@pytest.mark.parametrize("bad", ["batch", "gradient"])
def test_every_record_the_callback_writes_fits_the_schema_and_the_report_names_the_step(bad, tmp_path, capsys):
    from compat import read_back

    module = Module(bad_step=3, bad=bad)
    log = tmp_path / "fit.jsonl"
    with pytest.raises(ValueError, match="inf/nan detected"):
        trainer(DetectorCallback(log=str(log)), val_check_interval=2, limit_val_batches=1).fit(
            module, loader(), loader(2))
    records = read_back(log)
    assert {record["record"] for record in records} == {"meta", "entry", "detection"}
    gradients = [r for r in records if r["record"] == "entry" and r["phase"] == "backward"]
    assert gradients and {r["step"] for r in gradients} == {0}  # the batch_number of the inner network's forwards
    # step 3's forward raised before its backward when its batch was bad
    assert {r["global_step"] for r in gradients} == ({0, 1, 2} if bad == "batch" else {0, 1, 2, 3})
    assert {r["mode"] for r in records[1:]} == {"train", "eval"}
    assert "\nStep: optimizer step 3 (train), batch_number 0\n" in capsys.readouterr().out


def test_a_gradient_overflow_stops_fit_before_its_update():
    module = Module(bad_step=2, bad="gradient")
    with pytest.raises(ValueError) as caught:
        trainer(DetectorCallback()).fit(module, loader())
    assert caught.value.phase == "backward" and caught.value.global_step == 2
    assert all(torch.isfinite(p).all() for p in module.parameters())  # the update never ran
    assert not hooks_left(module)


def test_a_clean_fit_leaves_no_hook_and_validation_is_eval():
    module = Module()
    callback = DetectorCallback(on_detect="record")
    trainer(callback, steps=4, val_check_interval=2, limit_val_batches=2).fit(module, loader(), loader(2))
    assert module.steps == [0, 1, 2, 3] and not hooks_left(module)


def test_validation_detections_are_tagged_eval(capsys):
    module = Module()
    seen = []
    callback = DetectorCallback(on_detect=seen.append)
    val = loader(2)
    val.dataset.tensors[0][1, 1] = NAN
    trainer(callback, steps=2, val_check_interval=2, limit_val_batches=1).fit(module, loader(), val)
    assert seen and seen[0].mode == "eval" and seen[0].global_step == 2


def test_skip_lets_fit_complete_without_the_bad_update():
    control = Module()
    trainer(DetectorCallback(), steps=5).fit(control, loader(5))

    module = Module(bad_step=2, bad="batch")
    callback = DetectorCallback(on_detect="skip")
    fit = trainer(callback, steps=6)
    fit.fit(module, loader(6))
    assert fit.global_step == 6 and module.steps == [0, 1, 2, 3, 4, 5]
    assert not hooks_left(module)


_DDP = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, sys.argv[1])
    import torch
    import lightning.pytorch as pl
    from test_lightning import Module, loader
    from overflow_fast.integrations.lightning import DetectorCallback

    class OnRank1(Module):
        def training_step(self, batch, batch_idx):
            self.bad_step = 2 if self.global_rank == 1 else None
            return super().training_step(batch, batch_idx)

    module = OnRank1(bad="batch")
    trainer = pl.Trainer(callbacks=[DetectorCallback(check=sys.argv[2])], max_steps=6, accelerator="cpu",
                         devices=2, strategy="ddp", logger=False, enable_progress_bar=False,
                         enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0)
    try:
        trainer.fit(module, loader(8))
        result = f"RESULT rank {module.global_rank} finished {module.steps}"
    except ValueError as error:
        result = f"RESULT rank {module.global_rank} stopped {module.steps} {str(error)[:60]}"
    with open(f"result.rank{module.global_rank}", "w") as f:
        f.write(result)
""")


@pytest.mark.slow
@pytest.mark.parametrize("check", ["batch"])
def test_ddp_on_two_cpu_processes_stops_every_rank_at_the_step(check, tmp_path):
    script = tmp_path / "ddp_fit.py"
    script.write_text(_DDP)
    env = {**os.environ, "PL_DISABLE_FORK": "1", "OMP_NUM_THREADS": "1"}
    child = subprocess.run([sys.executable, str(script), os.path.dirname(__file__), check], capture_output=True,
                           text=True, timeout=300, env=env, cwd=tmp_path)
    results = [(tmp_path / f"result.rank{rank}").read_text() if (tmp_path / f"result.rank{rank}").exists()
               else None for rank in (0, 1)]
    assert None not in results, child.stdout[-3000:] + child.stderr[-3000:]
    for rank, line in enumerate(results):
        assert line.startswith(f"RESULT rank {rank} stopped [0, 1, 2]"), line
        assert "inf/nan detected on rank(s) 1" in line


# -- without Lightning ---------------------------------------------------------------------------------

_IMPORT_WITHOUT = """
import sys
{setup}
try:
    from overflow_fast.integrations.lightning import DetectorCallback
except ImportError as error:
    print(type(error).__name__, error, sep=": ")
    print("cause", type(error.__cause__).__name__, error.__cause__, sep=": ")
else:
    print("imported", DetectorCallback.__mro__[1].__module__)
"""


def _import_without(setup, path=None):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(path or ""), root,
                                                                    os.environ.get("PYTHONPATH", "")])))
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(_IMPORT_WITHOUT.format(setup=setup))],
                           env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr
    return child.stdout.splitlines()


def test_without_lightning_the_error_says_what_to_install():
    lines = _import_without("for name in ('lightning', 'lightning.pytorch', 'pytorch_lightning'):\n"
                            "    sys.modules[name] = None  # neither package installed")
    assert lines[0].startswith("ImportError: overflow_fast.integrations.lightning needs PyTorch Lightning 2.x: "
                               "pip install lightning (import lightning.pytorch failed: ")
    assert lines[0].endswith("nor is the older pytorch_lightning installed)")
    assert lines[1].startswith("cause: ModuleNotFoundError: ") and "lightning" in lines[1]


def test_the_older_pytorch_lightning_alone_still_serves(tmp_path):
    (tmp_path / "pytorch_lightning").mkdir()
    (tmp_path / "pytorch_lightning" / "__init__.py").write_text("class Callback:\n    pass\n")
    lines = _import_without("sys.modules['lightning'] = sys.modules['lightning.pytorch'] = None", tmp_path)
    assert lines == ["imported pytorch_lightning"]


@pytest.mark.parametrize("bad", ["batch", "gradient"])
def test_check_step_drives_the_guard_from_the_steps_and_replays_the_training_step(bad, capsys):
    module = Module(bad_step=3, bad=bad)
    callback = DetectorCallback(check="step")
    seen = []

    class Spy(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(hooks_left(pl_module))

    with pytest.raises(ValueError, match="inf/nan detected") as caught:
        pl.Trainer(callbacks=[callback, Spy()], max_steps=6, accelerator="cpu", devices=1, logger=False,
                   enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                   num_sanity_val_steps=0).fit(module, loader())
    assert seen == [False, False, False]  # no module had a hook while the steps were healthy
    assert caught.value.global_step == 3 and caught.value.detection["check"] == "step"
    assert caught.value.phase == "forward"  # the training step's own output, its loss, is what went bad
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == ("Replay: reproduced" if bad == "batch" else
                                    "Replay: reproduced: made outside every module, in the step's own code"), out
    assert all(torch.isfinite(p).all() for p in module.parameters())  # stopped before the update
    assert callback.detector is None and not hooks_left(module)
