"""A first day without surprises: a misspelled option names the nearest one, a second detector on a
model is warned about, a removed detector says so, the kernel builds when the detector is made,
the backward report counts its gradient frames, every command is described, and a demo leaves
the tracked files alone."""

import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from compat import capture
from overflow_fast import DebugUnderflowOverflow, OverflowDetected, cli, watch
from overflow_fast.stats import cpu_build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.abspath(__file__)


# -- a misspelled option ----------------------------------------------------------------------------

@pytest.mark.parametrize("make, wrong, right", [
    (lambda **kw: DebugUnderflowOverflow(nn.Linear(2, 2), **kw), "chek", "check"),
    (lambda **kw: watch(nn.Linear(2, 2), **kw), "on_detct", "on_detect"),
    (lambda **kw: watch(nn.Linear(2, 2), **kw), "max_frame_to_save", "max_frames_to_save"),
])
def test_a_misspelled_option_names_the_nearest_one(make, wrong, right):
    with pytest.raises(TypeError, match=re.escape(f"unknown option {wrong!r} (did you mean {right!r}?)")):
        make(**{wrong: 1})


def test_the_trainer_callbacks_name_the_nearest_option_too():
    pytest.importorskip("transformers")
    from overflow_fast.integrations import transformers

    with pytest.raises(TypeError, match=re.escape("'reportto' (did you mean 'report_to'?)")):
        transformers.DetectorCallback(reportto=True)
    with pytest.raises(TypeError, match=re.escape("'bakward' (did you mean 'backward'?)")):
        transformers.DetectorCallback(bakward=False)
    with pytest.raises(TypeError, match=re.escape("'find_ops' (did you mean 'find_op'?)")):
        transformers.use_in_trainer(find_ops=False)


def test_the_lightning_callback_names_the_nearest_option_too():
    pytest.importorskip("lightning")
    from overflow_fast.integrations import lightning

    with pytest.raises(TypeError, match=re.escape("'sync_timout' (did you mean 'sync_timeout'?)")):
        lightning.DetectorCallback(sync_timout=5)


def test_a_name_like_no_option_is_listed_plainly():
    with pytest.raises(TypeError, match=r"unknown options 'xyz', 'chekc' \(did you mean 'check'\?\); every option"):
        watch(nn.Linear(2, 2), xyz=1, chekc="batch")


# -- a second detector, a removed one ---------------------------------------------------------------

def hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_a_second_detector_on_a_model_is_warned_about_naming_the_first():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    first = watch(model); line = sys._getframe().f_lineno  # noqa: E702 - the line that made it
    once = hook_count(model)
    with pytest.warns(RuntimeWarning, match=re.escape(f"a detector is already attached to this model: the one "
                                                      f"made at {HERE}:{line}, not removed")) as caught:
        second = watch(model)
    assert caught[0].filename == HERE  # the warning points at the line that made the second one
    assert "read twice (twice the cost); a nan/inf is reported once" in str(caught[0].message)
    assert hook_count(model) == 2 * once  # as the warning says: every hook twice
    second.remove()
    first.remove()
    inner = DebugUnderflowOverflow(model[0])
    with pytest.warns(RuntimeWarning, match=r"already attached to 1 of this model's 3 modules: the one made at"):
        watch(model).remove()  # a model one of whose modules is watched already
    inner.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        watch(model).remove()  # the first one is gone: nothing to say


def test_a_removed_detector_used_again_says_so():
    model = nn.Linear(2, 2)
    with watch(model) as detector:
        model(torch.ones(1, 2))
    assert hook_count(model) == 0
    with pytest.raises(RuntimeError, match=r"this detector \(made at .*\) was removed .* make a new one"):
        with detector:
            pass
    detector.remove()  # removing twice is harmless


# -- the kernel builds when the detector is made ---------------------------------------------------

def test_the_kernel_is_loaded_or_built_when_the_detector_is_made(tmp_path, monkeypatch):
    """An empty cache where building is forbidden, the extension not loaded yet in this process:
    the attempt, and its one warning, come when the detector is made, not inside the first forward."""
    from overflow_fast.stats import cpu_backend, dispatch

    for name, value in (("_state", None), ("_compute", None)):  # as before its first use; put back after
        monkeypatch.setattr(cpu_backend, name, value)
    for name, value in (("_loaded", {}), ("_warned", set()), ("_choices", {})):
        monkeypatch.setattr(dispatch, name, value)
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(cpu_build.JIT_ENV, "0")
    monkeypatch.setenv("CXX", str(tmp_path / "no-compiler"))
    monkeypatch.delenv(cpu_build.WITHOUT_ENV, raising=False)
    model = nn.Linear(2, 2)
    with warnings.catch_warnings(record=True) as made:
        warnings.simplefilter("always")
        detector = watch(model)
    with warnings.catch_warnings(record=True) as ran:
        warnings.simplefilter("always")
        model(torch.ones(1, 2))
    detector.remove()

    def unavailable(caught):
        return sum("'cpu' backend is unavailable" in str(w.message) for w in caught)

    assert (unavailable(made), unavailable(ran)) == (1, 0), [str(w.message) for w in made + ran]


# -- the backward's report --------------------------------------------------------------------------

def test_a_backward_report_counts_its_gradient_frames():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).half()
    with torch.no_grad():
        model[0].weight.fill_(1e-3)
        model[1].weight.fill_(10.0)
    watch(model)
    x = torch.full((8, 4), 300.0, dtype=torch.float16)
    out, error = capture(lambda: model(x).float().sum().backward())
    assert isinstance(error, OverflowDetected)
    lines = out.splitlines()
    header = lines.index("Detected inf/nan during the backward of batch_number=0")
    # the forward's three frames, then the gradients up to layer 0's weight gradient
    assert lines[header + 1] == "Last 9 frames (6 gradient, 3 forward):"
    assert not any(line.startswith("Last ") and "forward frames" in line for line in lines)


def test_a_report_of_gradient_frames_only_says_so():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).half()
    with torch.no_grad():
        model[0].weight.fill_(1e-3)
        model[1].weight.fill_(10.0)
    watch(model, max_frames_to_save=2)
    out, _ = capture(lambda: model(torch.full((8, 4), 300.0, dtype=torch.float16)).float().sum().backward())
    assert "\nLast 2 gradient frames:\n" in out


# -- the commands -----------------------------------------------------------------------------------

def test_help_describes_every_command(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "flight-recorder logs (JSONL)." not in text.split("positional arguments")[0]  # not the report's alone
    [commands] = [action for action in cli.build_parser()._actions if action.dest == "command"]
    for action in commands._choices_actions:
        assert f"{action.dest} {' '.join(action.help.split())}" in text, action.dest


def test_info_says_what_the_per_hook_read_line_is_about():
    """Without a GPU path (no CUDA device, no Triton interpreter) the line says it is about GPU
    tensors, that there is none here, and why."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT
    proc = subprocess.run([sys.executable, "-m", "overflow_fast", "info"], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("per-hook read")]
    if torch.cuda.is_available():
        pytest.skip("a GPU path is there: its lines name each device")
    assert len(lines) == 1 and lines[0].startswith(
        "per-hook read (gpu): none here (the triton backend, which reads each hook's GPU tensors, is unavailable: "), \
        proc.stdout


def test_the_report_demo_writes_under_build_only(tmp_path, monkeypatch, capsys):
    from overflow_fast import report_demo

    monkeypatch.chdir(tmp_path)
    report_demo.main(["--steps", "2", "--tensorboard", ""])
    written = sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*") if path.is_file())
    assert written and all(path.startswith("build" + os.sep) for path in written), written


# -- a quiet traceback ------------------------------------------------------------------------------

class _InfGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


@pytest.mark.parametrize("check", ["module", "batch", "step"])
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_reports_traceback_holds_no_dynamo_frame_and_one_of_the_package(check, phase):
    import traceback

    # no ReLU: its mask could drop the inf gradient before any parameter, where check="step" looks
    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
    watch(model, check=check)
    x = torch.tensor([[float("inf") if phase == "forward" else 1.0, 1.0]])
    _, error = capture(lambda: _InfGradient.apply(model(x)).sum().backward())
    assert isinstance(error, OverflowDetected), error
    files = [frame.filename for frame in traceback.extract_tb(error.__traceback__)]
    package = os.path.join(ROOT, "overflow_fast")
    assert not any(os.sep + "_dynamo" + os.sep in name for name in files), files
    assert sum(name.startswith(package) for name in files) <= 2, files


# -- mistakes said at once --------------------------------------------------------------------------

def test_an_ignore_pattern_that_matches_no_module_is_warned_about_naming_the_nearest():
    model = nn.Sequential()
    model.add_module("encoder", nn.Sequential(nn.Linear(2, 2)))
    model.add_module("rotary_emb", nn.Identity())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watch(model, ignore=["rotary_embb", "encoder.*:input[mask]", "rotary_emb"]).remove()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert messages == ["overflow_fast: ignore='rotary_embb' matches no module of this model (did you mean "
                        "'rotary_emb'?): it ignores nothing"], messages
    assert caught[0].filename == HERE  # the user's line that made the detector


@pytest.mark.parametrize("log", ["/nonexistent/overflow_fast/run.jsonl", ["/nonexistent/overflow_fast/run.jsonl"]])
def test_a_log_whose_folder_does_not_exist_is_a_clear_error(log):
    with pytest.raises(ValueError, match="its folder /nonexistent/overflow_fast does not exist"):
        watch(nn.Linear(2, 2), log=log)
    assert not os.path.exists("/nonexistent/overflow_fast")


def test_a_report_never_starts_inside_a_progress_bars_line():
    tqdm = pytest.importorskip("tqdm")
    import contextlib
    import io
    import sys as system

    model = nn.Sequential(nn.Linear(2, 2))
    watch(model)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        bar = tqdm.tqdm(total=4, file=system.stdout, ascii=True)
        bar.update(1)  # the bar's line is drawn, with no newline
        try:
            model(torch.tensor([[float("inf"), 1.0]]))
        except OverflowDetected:
            pass
        bar.close()
    text = out.getvalue()
    start = text.index("input[0] has infs")
    assert text[start - 1] in "\r\n", repr(text[max(0, start - 80):start + 20])  # cleared first
    assert "Detected inf/nan" in text


class Outer(nn.Module):
    """A module of the user's around a Linear whose weights overflow fp16."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        with torch.no_grad():
            self.fc.weight.fill_(300.0)

    def forward(self, x):
        return self.fc(x * 2).relu()


def test_the_replay_command_names_the_call_it_replays():
    """An overflow in a Linear (torch's own code) inside a module of the user's: its Op line comes
    from replaying that module, and the reproducer's label says so."""
    import tempfile

    model = nn.Sequential(Outer()).half()
    folder = tempfile.mkdtemp()
    watch(model, repro=folder)
    _, error = capture(lambda: model(torch.full((2, 4), 30.0, dtype=torch.float16)))
    path = error.detection["repro"]
    replayed = subprocess.run([sys.executable, "-m", "overflow_fast", "replay", path], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.dirname(HERE)])},
                              timeout=300)
    first = replayed.stdout.splitlines()[0]
    assert first.startswith(f"{path}: forward of 0 (Outer), where 0.fc (Linear) first showed it, rank 0"), \
        replayed.stdout + replayed.stderr
