"""Trainers: a real Hugging Face Trainer run on a tiny GPT-2 (random weights, nothing downloaded)
through both integration routes, and Accelerate's prepare() with the detector attached."""

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import models
from compat import read_back

transformers = pytest.importorskip("transformers")

from overflow_fast import DebugUnderflowOverflow  # noqa: E402
from overflow_fast.integrations import transformers as integration  # noqa: E402

REPORT = "Detected inf/nan during batch_number="
ERROR = "DebugUnderflowOverflow: inf/nan detected"
HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def hooks(model):
    """Every module's hooks, by name (empty lists for a model nobody hooked)."""
    return {name: [len(getattr(module, attribute)) for attribute in HOOK_DICTS]
            for name, module in model.named_modules()}


def no_hooks(model):
    return all(counts == [0, 0, 0, 0] for counts in hooks(model).values())


class _Data(torch.utils.data.Dataset):
    def __init__(self, size=16, length=8):
        self.items = [models.token_batch(seed, batch=1, length=length)[0] for seed in range(size)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        return {"input_ids": self.items[index], "labels": self.items[index]}


class _PoisonAt(transformers.TrainerCallback):
    """Sets one weight to inf at the end of training step ``step``."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step:
            with torch.no_grad():
                model.transformer.h[1].mlp.c_fc.weight[0, 0] = math.inf


def _trainer(tmp_path, callbacks=(), debug="", steps=4):
    model = models.gpt2().train()
    assert no_hooks(model)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=2, learning_rate=1e-3,
        report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True,
        debug=debug, dataloader_num_workers=0,
    )
    return transformers.Trainer(model=model, args=args, train_dataset=_Data(), callbacks=list(callbacks))


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    yield
    try:
        from accelerate.state import AcceleratorState
        AcceleratorState._reset_state(True)
    except Exception:
        pass


@pytest.mark.parametrize("check", ["module", "batch"])
def test_callback_inf_mid_training_raises_prints_and_leaves_no_hook(tmp_path, capsys, check):
    callback = integration.DetectorCallback(check=check)
    trainer = _trainer(tmp_path, [callback, _PoisonAt(2)])
    with pytest.raises(ValueError, match=ERROR):
        trainer.train()
    out = capsys.readouterr().out
    assert REPORT in out and "transformer.h.1.mlp.c_fc Conv1D" in out and "weight has infs" in out
    assert trainer.state.global_step == 2  # the forward of step 3 stopped it
    assert no_hooks(trainer.model)
    assert callback.detector is None


def test_callback_clean_run_leaves_no_hook(tmp_path, capsys):
    callback = integration.DetectorCallback(max_frames_to_save=5)
    seen = []

    class Spy(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            seen.append(isinstance(callback.detector, DebugUnderflowOverflow) and not no_hooks(model))

    trainer = _trainer(tmp_path, [callback, Spy()], steps=3)
    trainer.train()
    assert seen == [True, True, True]  # attached while training ran
    assert REPORT not in capsys.readouterr().out
    assert no_hooks(trainer.model)


def test_callback_other_errors_leave_no_hook(tmp_path):
    class Boom(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            raise KeyError("boom")

    trainer = _trainer(tmp_path, [integration.DetectorCallback(), Boom()])
    with pytest.raises(KeyError, match="boom"):
        trainer.train()
    assert no_hooks(trainer.model)


def test_use_in_trainer_builds_overflow_fast_and_undo_restores(tmp_path, capsys):
    module = __import__(transformers.Trainer.__module__, fromlist=["DebugUnderflowOverflow"])
    original = module.DebugUnderflowOverflow
    with integration.use_in_trainer(check="batch", max_frames_to_save=3) as handle:
        assert module.DebugUnderflowOverflow is not original
        trainer = _trainer(tmp_path, [_PoisonAt(2)], debug="underflow_overflow")
        with pytest.raises(ValueError, match=ERROR):
            trainer.train()
        [detector] = handle.detectors
        assert isinstance(detector, DebugUnderflowOverflow) and detector.check == "batch"
        assert detector.frames.maxlen == 3
    assert module.DebugUnderflowOverflow is original
    out = capsys.readouterr().out
    assert REPORT in out and "Last 3 forward frames:" in out and "weight has infs" in out
    assert no_hooks(trainer.model)
    handle.undo()  # idempotent
    assert module.DebugUnderflowOverflow is original


def test_use_in_trainer_clean_run_leaves_no_hook(tmp_path):
    handle = integration.use_in_trainer()
    try:
        trainer = _trainer(tmp_path, debug="underflow_overflow", steps=2)
        trainer.train()
        assert len(handle.detectors) == 1
        assert no_hooks(trainer.model)
    finally:
        handle.undo()


# -- Accelerate --------------------------------------------------------------------------------


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_accelerate_prepare_with_the_detector(when, precision, capsys):
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision=precision)
    model = models.gpt2().train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    detector = DebugUnderflowOverflow(model) if when == "before" else None
    prepared, optimizer = accelerator.prepare(model, optimizer)
    if detector is None:
        detector = DebugUnderflowOverflow(prepared)
    batch = models.token_batch(0)
    loss = prepared(input_ids=batch, labels=batch).loss
    accelerator.backward(loss)
    optimizer.step()
    assert detector.batch_number == 1
    with torch.no_grad():
        accelerator.unwrap_model(prepared).transformer.h[0].attn.c_attn.weight[1, 1] = math.nan
    with pytest.raises(ValueError, match=ERROR):
        prepared(input_ids=batch, labels=batch)
    out = capsys.readouterr().out
    assert REPORT in out and "transformer.h.0.attn.c_attn Conv1D" in out
    detector.remove()
    assert no_hooks(accelerator.unwrap_model(prepared))


@pytest.mark.parametrize("order", ["first-last", "last-first"])
def test_use_in_trainer_handles_undone_in_any_order(order):
    module = __import__(transformers.Trainer.__module__, fromlist=["DebugUnderflowOverflow"])
    original = module.DebugUnderflowOverflow
    a = integration.use_in_trainer(max_frames_to_save=3)
    b = integration.use_in_trainer(max_frames_to_save=4)
    try:
        assert module.DebugUnderflowOverflow is b._build
        first, second = (a, b) if order == "first-last" else (b, a)
        first.undo()
        assert module.DebugUnderflowOverflow is second._build  # the one still active builds
        model = models.gpt2()
        detector = module.DebugUnderflowOverflow(model)
        assert detector.frames.maxlen == second.detector_kwargs["max_frames_to_save"]
        detector.remove()
        second.undo()
        assert module.DebugUnderflowOverflow is original  # the last one gone: the Trainer's own
        first.undo()  # idempotent
        assert module.DebugUnderflowOverflow is original
    finally:
        a.undo()
        b.undo()
    assert module.DebugUnderflowOverflow is original


def test_use_in_trainer_leaves_a_name_set_by_someone_else():
    module = __import__(transformers.Trainer.__module__, fromlist=["DebugUnderflowOverflow"])
    original = module.DebugUnderflowOverflow
    handle = integration.use_in_trainer()
    try:
        def theirs(model, *args, **kwargs):
            return None

        module.DebugUnderflowOverflow = theirs
        handle.undo()
        assert module.DebugUnderflowOverflow is theirs
    finally:
        handle.undo()
        module.DebugUnderflowOverflow = original


# -- watch()'s options, the trainer's steps, skip, report_to ------------------------------------------


class _HookAtStep(transformers.TrainerCallback):
    """During training step ``step`` only, the hook that ``hook(model)`` registers."""

    def __init__(self, step):
        self.step = step
        self.handle = None

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step:
            self.handle = self.hook(model)

    def on_step_end(self, args, state, control, **kwargs):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


class _InfGradientAt(_HookAtStep):
    """At training step ``step`` one weight's gradient comes out inf (a finite forward)."""

    def hook(self, model):
        return model.transformer.h[1].mlp.c_fc.weight.register_hook(lambda grad: grad * math.inf)


@pytest.mark.parametrize("route", ["callback", "use_in_trainer"])
def test_integrations_default_to_watch_and_stop_a_gradient_overflow_before_the_update(tmp_path, route):
    if route == "callback":
        trainer = _trainer(tmp_path, [integration.DetectorCallback(), _InfGradientAt(1)])
        handle = None
    else:
        handle = integration.use_in_trainer()
        trainer = _trainer(tmp_path, [_InfGradientAt(1)], debug="underflow_overflow")
    try:
        with pytest.raises(ValueError, match=ERROR) as caught:
            trainer.train()
    finally:
        if handle is not None:
            handle.undo()
    assert caught.value.phase == "backward" and caught.value.global_step == 1 and caught.value.mode == "train"
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())  # the update never ran
    assert no_hooks(trainer.model)


def test_the_forward_only_option_is_still_there(tmp_path):
    trainer = _trainer(tmp_path, [integration.DetectorCallback(backward=False), _InfGradientAt(1)])
    with pytest.raises(ValueError, match=ERROR) as caught:
        trainer.train()
    assert caught.value.phase == "forward" and caught.value.global_step == 2  # one step too late


class _EvalData(_Data):
    pass


def test_optimizer_steps_and_eval_as_the_trainer_counts_them(tmp_path, capsys):
    model = models.gpt2().train()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=2, learning_rate=1e-3, report_to=[],
        use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Data(size=32), eval_dataset=_EvalData(4),
                                   callbacks=[integration.DetectorCallback(log=str(tmp_path / "run.jsonl")),
                                              _PoisonAt(3)])
    with pytest.raises(ValueError, match=ERROR) as caught:
        trainer.train()
    # the console names the optimizer step beside the reference's batch number
    assert "\nStep: optimizer step 3 (train), batch_number 8\n" in capsys.readouterr().out
    records = read_back(tmp_path / "run.jsonl")  # every record fits the report's schema
    assert {r.get("global_step") for r in records[1:]} == {0, 1, 2, 3}
    assert any(r["record"] == "entry" and r["phase"] == "backward" for r in records)
    # the weight goes inf at the end of optimizer step 3: the next forward (of step 3's successor,
    # counted 3 until it completes) reports it; the model's own forwards (train micro-batches and
    # evaluation) are the reference's batch_number
    assert caught.value.global_step == 3 and caught.value.mode == "train"
    assert caught.value.batch_number == 3 * 2 + 2 * 1  # six micro-batches and one evaluation of two batches


def test_a_detection_in_evaluation_is_tagged_eval(tmp_path):
    model = models.gpt2().train()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2, eval_strategy="steps", eval_steps=2,
        per_device_eval_batch_size=2, learning_rate=1e-3, report_to=[], use_cpu=True, save_strategy="no",
        logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Data(), eval_dataset=_EvalData(4),
                                   callbacks=[integration.DetectorCallback(), _PoisonAt(2)])
    with pytest.raises(ValueError, match=ERROR) as caught:
        trainer.train()
    assert caught.value.mode == "eval" and caught.value.global_step == 2


class _NanActivationAt(_HookAtStep):
    """At training step ``step`` the first block's output holds a nan."""

    def hook(self, model):
        def poison(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            hidden = hidden.clone()
            hidden[0, 0, 0] = math.nan
            return (hidden,) + tuple(output[1:]) if isinstance(output, tuple) else hidden

        return model.transformer.h[0].register_forward_hook(poison)


def test_skip_in_the_trainer_keeps_counting_steps_and_applies_no_bad_update(tmp_path, capsys):
    callback = integration.DetectorCallback(on_detect="skip")
    trainer = _trainer(tmp_path, [callback, _NanActivationAt(2)], steps=5)
    trainer.train()
    assert trainer.state.global_step == 5
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    steps = {int(state["step"]) for state in trainer.optimizer.state.values()}
    assert steps == {4}  # AdamW stepped 4 times: the skipped step left its state alone
    assert capsys.readouterr().out.count("skipping this step") == 1
    assert no_hooks(trainer.model)


def test_report_to_forwards_the_scalars_to_the_trainers_tensorboard(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    model = models.gpt2().train()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, learning_rate=1e-3,
        report_to=["tensorboard"], use_cpu=True, save_strategy="no",
        logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Data(),
                                   callbacks=[integration.DetectorCallback(report_to=True)])
    trainer.train()
    files = [str(path.parent) for path in (tmp_path / "tb").rglob("events.out.tfevents.*")]
    events = EventAccumulator(files[0])
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "overflow_fast/headroom_bits/transformer.h.0.mlp.c_fc" in tags
    assert sorted({e.step for e in events.Scalars("overflow_fast/headroom_bits/lm_head")}) == [0, 1, 2]


# -- without transformers ----------------------------------------------------------------------------

_IMPORT_WITHOUT = """
import sys
{setup}
try:
    import overflow_fast.integrations.transformers
except ImportError as error:
    print(type(error).__name__, error, sep=": ")
    print("cause", type(error.__cause__).__name__, error.__cause__, sep=": ")
else:
    print("imported")
"""


def _import_without(setup, tmp_path=None):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path or ""), root,
                                                                    os.environ.get("PYTHONPATH", "")])))
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(_IMPORT_WITHOUT.format(setup=setup))],
                           env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr
    return child.stdout.splitlines()


def test_without_transformers_the_error_says_what_to_install():
    lines = _import_without("sys.modules['transformers'] = None  # not installed")
    assert lines[0].startswith("ImportError: overflow_fast.integrations.transformers needs Hugging Face "
                               "transformers: pip install transformers (import transformers failed: ")
    assert lines[1].startswith("cause: ModuleNotFoundError: ") and "transformers" in lines[1]


def test_a_broken_transformers_is_named_with_its_own_error(tmp_path):
    # installed, but its own import fails (a dependency missing): the reason is kept, and the fix
    (tmp_path / "transformers").mkdir()
    (tmp_path / "transformers" / "__init__.py").write_text("import a_dependency_that_is_not_there\n")
    lines = _import_without("", tmp_path)
    assert lines[0].startswith("ImportError: overflow_fast.integrations.transformers needs Hugging Face "
                               "transformers: pip install transformers")
    assert "No module named 'a_dependency_that_is_not_there'" in lines[0]
    assert lines[1] == "cause: ModuleNotFoundError: No module named 'a_dependency_that_is_not_there'"


class _Embeds(torch.utils.data.Dataset):
    """GPT-2 inputs as embeddings; sample ``POISONED_SAMPLE`` holds a nan at position 5."""

    def __init__(self, size=32, length=8):
        generator = torch.Generator().manual_seed(0)
        self.embeds = torch.randn(size, length, 16, generator=generator)
        self.embeds[POISONED_SAMPLE, 5, 3] = math.nan
        self.labels = torch.randint(0, 64, (size, length), generator=generator)

    def __len__(self):
        return len(self.embeds)

    def __getitem__(self, index):
        return {"inputs_embeds": self.embeds[index], "labels": self.labels[index]}


POISONED_SAMPLE = 13


@pytest.mark.parametrize("route, batch, accumulate, workers", [
    ("callback", 8, 1, 0), ("use_in_trainer", 8, 1, 0), ("callback", 4, 2, 2)])
def test_the_trainer_names_the_dataset_index_of_the_poisoned_sample(tmp_path, capsys, route, batch, accumulate,
                                                                     workers):
    """Shuffled batches from 32 samples: whichever batch and row sample 13 lands in, the Where line
    and the detection record name that sample (with gradient accumulation and worker processes
    loading ahead too)."""
    log = tmp_path / "run.jsonl"
    handle = integration.use_in_trainer(log=str(log)) if route == "use_in_trainer" else None
    callbacks = [integration.DetectorCallback(log=str(log))] if handle is None else []
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=batch, gradient_accumulation_steps=accumulate,
        learning_rate=1e-3, report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True,
        dataloader_num_workers=workers, debug="underflow_overflow" if handle is not None else "")
    trainer = transformers.Trainer(model=models.gpt2().train(), args=args, train_dataset=_Embeds(),
                                   callbacks=callbacks)
    try:
        with pytest.raises(ValueError, match=ERROR) as caught:
            trainer.train()
    finally:
        if handle is not None:
            handle.undo()
    where = caught.value.detection["where"]
    row = where["rows"][0]
    assert where["samples"] == [POISONED_SAMPLE] and where["rows"] == [row] and where["first"] == [row, 5, 3]
    line = f"Where: batch row {row} of {batch} (sample {POISONED_SAMPLE}); first at [{row}, 5, 3] (token 5); " \
           f"1 of {batch * 8 * 16:,} elements is nan"
    assert line in capsys.readouterr().out.splitlines()
    [record] = [r for r in read_back(log) if r["record"] == "detection"]
    assert record["where"] == where
    assert no_hooks(trainer.model)
    # the training loader's sampler has its own class back
    assert type(trainer.callback_handler.train_dataloader.base_dataloader.batch_sampler) is \
        torch.utils.data.BatchSampler


def test_check_step_in_the_trainer_guards_the_root_alone_and_replays_the_step(tmp_path, capsys):
    callback = integration.DetectorCallback(check="step")
    seen = []

    class Spy(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            seen.append({name: counts for name, counts in hooks(model).items() if any(counts)})

    trainer = _trainer(tmp_path, [callback, Spy(), _PoisonAt(2)])
    with pytest.raises(ValueError, match=ERROR) as caught:
        trainer.train()
    assert seen and all(set(hooked) == {""} for hooked in seen)  # the root's two hooks, nothing below
    out = capsys.readouterr().out
    assert "transformer.h.1.mlp.c_fc Conv1D" in out and "weight has infs" in out
    assert out.splitlines()[-1] == "Replay: reproduced"
    assert caught.value.global_step == 2 and caught.value.detection["check"] == "step"
    assert no_hooks(trainer.model)
