"""find_op: the op and the line of code that made the first nan/inf, found by replaying the one
module call the Source line names; repro: the file that replays it in another process."""

import contextlib
import functools
import io
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from compat import capture
from overflow_fast import DebugUnderflowOverflow, OverflowDetected, watch

CHECKS = ["module", "batch"]
SAME = "; reproduced on the same inputs"
HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))


def first_line_of(function, offset):
    return function.__code__.co_firstlineno + offset


def run(model, x):
    return model(x)  # the line the model is called from


RUN_LINE = first_line_of(run, 1)


def train(model, x):
    model(x).float().sum().backward()  # the forward and the backward of one step


TRAIN_LINE = first_line_of(train, 1)


def op_of(out, error):
    assert isinstance(error, OverflowDetected), out[-2000:]
    lines = out.splitlines()
    if lines[-1].startswith("Repro: "):  # repro=: the file's path, after the Op line
        assert lines[-1] == f"Repro: {error.detection['repro']} (overflow-fast replay {error.detection['repro']})"
        lines = lines[:-1]
    assert lines[-2].startswith("Source: "), out[-2000:]
    assert lines[-1].startswith("Op: "), out[-2000:]
    return lines[-1], error.detection["op"]


# -- the cases ----------------------------------------------------------------------------------------

class SoftplusByHand(nn.Module):
    def forward(self, x):
        h = x * 4
        return torch.log1p(torch.exp(h))


EXP_LINE = first_line_of(SoftplusByHand.forward, 2)


@pytest.mark.parametrize("check", CHECKS)
def test_an_exp_that_overflows_inside_a_custom_module(check):
    model = nn.Sequential(nn.Linear(4, 4), SoftplusByHand()).half()
    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[0].bias.zero_()
    watch(model, check=check)
    out, error = capture(lambda: run(model, torch.full((2, 4), 7.5, dtype=torch.float16)))
    line, op = op_of(out, error)
    # 4 * 30 = 120: exp(120) overflows fp16 (its largest finite is 65504 = exp(11.09))
    assert line == f"Op: aten.exp at {HERE}:{EXP_LINE}: inf from finite inputs (input abs max 1.2e+02){SAME}"
    assert op == {"op": "aten.exp", "file": HERE, "line": EXP_LINE, "phase": "forward",
                  "what": "inf from finite inputs (input abs max 1.2e+02)", "module": None,
                  "reproduced": "on the same inputs"}
    assert error.detection["transient"] is False
    assert out.splitlines()[-2] == "Source: born in forward of 1 (SoftplusByHand): output from finite inputs and weights"


def overflowing_linear():
    """4 inputs of 300 times weights of 100: 120000 > 65504, in the matmul itself."""
    linear = nn.Linear(4, 4)
    with torch.no_grad():
        linear.weight.fill_(100.0)
        linear.bias.zero_()
    return linear


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.fc = overflowing_linear()

    def forward(self, x):
        h = self.norm(x) + x
        return self.fc(h).relu()


FC_LINE = first_line_of(Block.forward, 2)


@pytest.mark.parametrize("check", CHECKS)
def test_a_linear_whose_product_overflows_is_named_at_the_line_that_calls_it(check):
    # inside a module of the user's code: the line of that module's forward calling the Linear
    model = nn.Sequential(Block()).half()
    watch(model, check=check)
    out, error = capture(lambda: run(model, torch.full((2, 4), 300.0, dtype=torch.float16)))
    line, op = op_of(out, error)
    assert out.splitlines()[-2] == "Source: born in forward of 0.fc (Linear): output from finite inputs and weights"
    assert op["op"] == "aten.addmm" and (op["file"], op["line"]) == (HERE, FC_LINE), op
    assert op["what"].startswith("inf from finite inputs (input abs max 3.0e+02"), op
    # torch's own modules all the way up: no line of code ran it but torch's, and the line says so
    # (never the line that called the model, as if that were the op's)
    model = nn.Sequential(overflowing_linear(), nn.ReLU()).half()
    watch(model, check=check)
    out, error = capture(lambda: run(model, torch.full((2, 4), 300.0, dtype=torch.float16)))
    line, op = op_of(out, error)
    assert line == f"Op: aten.addmm in 0 (Linear), torch's own code: inf from finite inputs (input abs max 3.0e+02){SAME}"
    assert (op["file"], op["line"], op["module"]) == (None, None, "0 (Linear)")


class Attention(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.q = nn.Linear(width, width, bias=False)
        self.k = nn.Linear(width, width, bias=False)

    def forward(self, x):
        q, k = self.q(x), self.k(x)
        scores = q @ k.transpose(-1, -2)
        return F.softmax(scores, dim=-1) @ x


SCORES_LINE = first_line_of(Attention.forward, 2)


@pytest.mark.parametrize("check", CHECKS)
def test_softmax_of_fp16_scores_too_large_names_the_product_that_overflowed(check):
    torch.manual_seed(0)
    model = nn.Sequential(Attention(8)).half()
    with torch.no_grad():
        model[0].q.weight.copy_(torch.eye(8) * 30)
        model[0].k.weight.copy_(torch.eye(8) * 30)
    watch(model, check=check)
    x = torch.full((1, 3, 8), 4.0, dtype=torch.float16)  # each score 8 * 120 * 120 = 115200 > 65504
    out, error = capture(lambda: run(model, x))
    line, op = op_of(out, error)
    assert "nan" in out.splitlines()[0] or "inf" in out.splitlines()[0]
    assert out.splitlines()[-2] == "Source: born in forward of 0 (Attention): output from finite inputs and weights"
    # softmax turns the inf into nan; the first op that made a nan/inf from finite inputs is the product
    assert op["op"] in ("aten.bmm", "aten.mm", "aten.matmul") and (op["file"], op["line"]) == (HERE, SCORES_LINE), op
    assert op["what"] == "inf from finite inputs (input abs max 1.2e+02)", op


class Norm(nn.Module):
    def forward(self, x):
        return torch.sqrt((x * x).sum(-1))


SQRT_LINE = first_line_of(Norm.forward, 1)


def zero_input_norm():
    model = nn.Sequential(nn.Linear(4, 4), Norm())
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.zero_()
    return model


@pytest.mark.parametrize("check", CHECKS)
def test_a_sqrt_whose_gradient_at_zero_is_inf(check):
    model = zero_input_norm()
    watch(model, check=check)
    out, error = capture(lambda: train(model, torch.ones(2, 4)))
    line, op = op_of(out, error)
    assert error.detection["phase"] == "backward"
    assert out.splitlines()[-2] == ("Source: born in backward, in the gradient arriving at 0 (Linear) output.grad: "
                                    "made by the backward of 1")
    assert op["op"] == "SqrtBackward0" and op["phase"] == "backward", op
    assert (op["file"], op["line"]) == (HERE, SQRT_LINE), op  # the line of its forward op
    assert op["what"].startswith("inf from finite inputs"), op


class LogOfRelu(nn.Module):
    def forward(self, x):
        return torch.log(x.relu())


LOG_LINE = first_line_of(LogOfRelu.forward, 1)


@pytest.mark.parametrize("check", CHECKS)
def test_a_log_of_zero(check):
    model = nn.Sequential(nn.Linear(4, 4), LogOfRelu())
    with torch.no_grad():
        model[0].weight.fill_(-1.0)
        model[0].bias.zero_()
    watch(model, check=check)
    out, error = capture(lambda: run(model, torch.ones(2, 4)))
    line, op = op_of(out, error)
    assert line == f"Op: aten.log at {HERE}:{LOG_LINE}: inf from finite inputs (input abs max 0.0e+00){SAME}"


class ScaledInParent(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        h = h * 1e6
        return self.b(h)


SCALE_LINE = first_line_of(ScaledInParent.forward, 2)


@pytest.mark.parametrize("check", CHECKS)
def test_an_op_between_modules_is_found_in_the_parent_call(check):
    torch.manual_seed(0)
    model = ScaledInParent().half()
    watch(model, check=check)
    out, error = capture(lambda: run(model, torch.full((2, 4), 300.0, dtype=torch.float16)))
    line, op = op_of(out, error)
    assert out.splitlines()[-2].startswith("Source: born outside any module, in the code before b (Linear) input[0]")
    assert op["op"] == "aten.mul" and (op["file"], op["line"]) == (HERE, SCALE_LINE), op


@pytest.mark.parametrize("check", CHECKS)
def test_under_autocast_the_replay_runs_as_the_call_did(check):
    model = nn.Sequential(overflowing_linear(), nn.ReLU())  # float32 weights: overflows only in fp16
    watch(model, check=check)

    def step():
        with torch.autocast("cpu", dtype=torch.float16):
            return run(model, torch.full((2, 4), 300.0))
    out, error = capture(step)
    line, op = op_of(out, error)
    assert op["op"] == "aten.addmm" and op["module"] == "0 (Linear)" and op["reproduced"] == "on the same inputs", op


# -- where the replay cannot show it, the line says why --------------------------------------------

class ChangesItsInputAfter(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = SoftplusByHand()

    def forward(self, x):
        y = self.inner(x)
        x.zero_()  # after the inner call's hook: a later replay would read zeros
        return y


def test_inputs_changed_in_place_after_the_hook_are_said_not_guessed():
    x = torch.full((2, 4), 30.0, dtype=torch.float16)
    model = nn.Sequential(nn.Identity(), ChangesItsInputAfter())
    watch(model, check="batch")  # decided when the forward ends, after the change
    out, error = capture(lambda: run(model, x.clone()))
    line, op = op_of(out, error)
    assert line == "Op: not reproduced on replay (the module's inputs changed in place after its hook)"
    assert op == {"op": None, "file": None, "line": None, "phase": "forward", "module": None, "reproduced": None,
                  "what": "not reproduced on replay (the module's inputs changed in place after its hook)"}
    assert error.detection["transient"] is None
    model = nn.Sequential(nn.Identity(), ChangesItsInputAfter())
    watch(model, check="module")  # decided in the hook, before the change
    out, error = capture(lambda: run(model, x.clone()))
    line, op = op_of(out, error)
    assert op["op"] == "aten.exp" and op["line"] == EXP_LINE, op


class DropThenExp(nn.Module):
    def forward(self, x):
        return torch.exp(F.dropout(x, 0.5, training=True) * 4)


DROP_EXP_LINE = first_line_of(DropThenExp.forward, 1)


@pytest.mark.parametrize("check", CHECKS)
def test_a_random_op_before_the_nan_replays_its_very_draws(check):
    # the replay runs the pass again from its start (where the RNG states were taken) up to this
    # call, nothing read, then the call from there: the same mask, the same exp
    torch.manual_seed(0)
    model = nn.Sequential(nn.Identity(), DropThenExp())
    watch(model, check=check)
    out, error = capture(lambda: run(model, torch.full((64,), 30.0, dtype=torch.float16)))
    line, op = op_of(out, error)
    assert line == f"Op: aten.exp at {HERE}:{DROP_EXP_LINE}: inf from finite inputs (input abs max 2.4e+02){SAME}"
    assert error.detection["transient"] is False


@pytest.mark.parametrize("check", CHECKS)
def test_a_bad_weight_or_input_has_no_op_line(check):
    model = nn.Sequential(nn.Linear(4, 4))
    watch(model, check=check)
    with torch.no_grad():
        model[0].weight[0, 0] = float("inf")
    out, error = capture(lambda: run(model, torch.ones(1, 4)))
    assert isinstance(error, OverflowDetected) and "op" not in error.detection
    assert out.splitlines()[-1].startswith("Source: a weight already non-finite")


# -- the drop-in and the options ----------------------------------------------------------------------

@pytest.mark.parametrize("check", CHECKS)
def test_the_drop_in_prints_no_op_line_unless_asked(check):
    x = torch.full((2, 4), 7.5, dtype=torch.float16)
    model = nn.Sequential(SoftplusByHand())
    DebugUnderflowOverflow(model, check=check)
    out, error = capture(lambda: run(model, x))
    assert isinstance(error, ValueError) and "Op:" not in out and "op" not in error.detection
    model = nn.Sequential(SoftplusByHand())
    DebugUnderflowOverflow(model, check=check, find_op=True)
    out, error = capture(lambda: run(model, x))
    assert out.splitlines()[-1] == f"Op: aten.exp at {HERE}:{EXP_LINE}: inf from finite inputs (input abs max 3.0e+01){SAME}"
    model = nn.Sequential(SoftplusByHand())
    watch(model, check=check, find_op=False)
    out, error = capture(lambda: run(model, x))
    assert "Op:" not in out and "op" not in error.detection


def test_bad_find_op_and_repro_values_are_clear_errors():
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="find_op"):
        watch(model, find_op="yes")
    with pytest.raises(ValueError, match="repro"):
        watch(model, repro="")
    with pytest.raises(TypeError, match="repro"):
        watch(model, repro=3)


# -- the replay does not change the run ----------------------------------------------------------------

class Net(nn.Module):
    """BatchNorm (running statistics), dropout (the RNG), then a culprit in forward or backward."""

    def __init__(self, culprit):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.drop = nn.Dropout(0.25)
        self.culprit = culprit

    def forward(self, x):
        return self.culprit(self.drop(self.bn(self.fc(x))))


class Amplify(nn.Module):
    def forward(self, x):
        return torch.exp(x * 100)  # a normalized value above 0.89 overflows float32


class Zeroed(nn.Module):
    def forward(self, x):
        return x * 0


def state_after(find_op, check, culprit, steps=2):
    torch.manual_seed(0)
    model = Net(culprit)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    watch(model, check=check, on_detect="record", find_op=find_op)
    torch.manual_seed(1)
    for _ in range(steps):
        optimizer.zero_grad()
        out, error = capture(lambda: model(torch.randn(8, 4) * 3).sum().backward())
        assert error is None
        optimizer.step()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "buffers": {n: b.clone() for n, b in model.named_buffers()},
            "rng": torch.get_rng_state(), "random": torch.rand(3)}


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("culprit", [Amplify, Norm])
def test_the_replay_leaves_weights_buffers_gradients_and_rng_bit_identical(check, culprit):
    if culprit is Norm:  # its backward makes the inf: the gradient of a norm of zeros
        culprit_module = lambda: nn.Sequential(Zeroed(), Norm())  # noqa: E731
    else:
        culprit_module = culprit
    without = state_after(False, check, culprit_module())
    with_op = state_after(True, check, culprit_module())
    for kind in ("params", "grads", "buffers"):
        assert without[kind].keys() == with_op[kind].keys()
        for name in without[kind]:
            assert torch.equal(without[kind][name], with_op[kind][name]) or (
                without[kind][name].isnan().equal(with_op[kind][name].isnan())
                and torch.equal(without[kind][name].nan_to_num(), with_op[kind][name].nan_to_num())), (kind, name)
    assert torch.equal(without["rng"], with_op["rng"]) and torch.equal(without["random"], with_op["random"])


@pytest.mark.filterwarnings("ignore::FutureWarning")  # gc.get_objects meets deprecated torch objects
def test_the_replay_leaves_no_autograd_graph_behind():
    import gc

    def graph_tensors_after(find_op):
        model = zero_input_norm()
        seen = []
        watch(model, check="batch", on_detect=seen.append, find_op=find_op)
        out, error = capture(functools.partial(train, model, torch.ones(2, 4)))
        assert error is None and len(seen) == 1 and ("op" in seen[0].detection) == find_op
        del seen, model
        gc.collect()
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and in_a_graph(o))

    def in_a_graph(tensor):
        try:
            return tensor.grad_fn is not None
        except RuntimeError:  # an undefined tensor that torch 2.7 leaves to gc: in no graph
            return False

    assert graph_tensors_after(True) == graph_tensors_after(False)


# -- the data and the reproducer ----------------------------------------------------------------------

def test_the_flight_record_carries_the_op(tmp_path):
    log = tmp_path / "run.jsonl"
    model = nn.Sequential(nn.Linear(4, 4), SoftplusByHand()).half()
    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[0].bias.zero_()
    watch(model, log=str(log))
    out, error = capture(lambda: run(model, torch.full((2, 4), 7.5, dtype=torch.float16)))
    assert isinstance(error, OverflowDetected)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    detections = [r for r in records if r.get("record") == "detection"]
    assert detections and detections[-1]["op"] == error.detection["op"]
    assert detections[-1]["op"]["op"] == "aten.exp"


# one fresh process replays several files through the command's own entry, each followed by its exit code
REPLAY_EACH = ("import sys\nfrom overflow_fast.cli import main\n"
               "for path in sys.argv[1:]:\n    print('== exit', main(['replay', path]), flush=True)\n")


def replays_in_one_fresh_process(paths):
    """``[(exit code, stdout lines)]`` of ``overflow_fast replay`` on each path, in one process apart
    from this one (the recording's), so each starts from an import rather than this process's state."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.dirname(HERE)])}
    done = subprocess.run([sys.executable, "-c", REPLAY_EACH, *map(str, paths)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    results, lines = [], []
    for text in done.stdout.splitlines():
        if text.startswith("== exit "):
            results.append((int(text.split()[-1]), lines))
            lines = []
        else:
            lines.append(text)
    assert len(results) == len(paths), done.stdout + done.stderr
    return results, done.stderr


@pytest.mark.one_path  # the replay in a fresh process; the detection on each path: the tests above
@pytest.mark.parametrize("check", [c if c == "module" else pytest.param(c, marks=pytest.mark.slow) for c in CHECKS])
def test_a_reproducer_replays_the_same_op_line_in_a_fresh_process(check, tmp_path):
    cases = [("forward", nn.Sequential(nn.Linear(4, 4), SoftplusByHand()).half(),
              lambda model: run(model, torch.full((2, 4), 7.5, dtype=torch.float16))),
             ("backward", zero_input_norm(), lambda model: train(model, torch.ones(2, 4))),
             ("forward", nn.Sequential(overflowing_linear(), nn.ReLU()).half(),
              lambda model: run(model, torch.full((2, 4), 300.0, dtype=torch.float16)))]
    recorded = []
    for index, (phase, model, step) in enumerate(cases):
        if phase == "forward" and index == 0:
            with torch.no_grad():
                model[0].weight.fill_(1.0)
                model[0].bias.zero_()
        folder = tmp_path / f"case{index}"
        watch(model, check=check, repro=str(folder))
        out, error = capture(lambda: step(model))
        line, op = op_of(out, error)
        path = error.detection["repro"]
        assert path == str(folder / "overflow-rank0-step0.pt") and os.path.exists(path)
        recorded.append((phase, line, path))
    replayed, errors = replays_in_one_fresh_process([path for _, _, path in recorded])
    for (phase, line, _), (code, lines) in zip(recorded, replayed):
        assert code == 0, "\n".join(lines) + errors
        assert lines[-1] == line, lines
        assert f"{phase} of " in lines[0]


@pytest.mark.one_path
def test_replay_help_warns_that_a_pickle_runs_code_and_a_bad_file_is_a_clear_error(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT}
    helped = subprocess.run([sys.executable, "-m", "overflow_fast", "replay", "--help"], capture_output=True,
                            text=True, env=env, timeout=120)
    assert helped.returncode == 0 and "loading a pickle runs code" in " ".join(helped.stdout.split())
    bad = tmp_path / "bad.pt"
    torch.save({"not": "a reproducer"}, bad)
    for path in (bad, tmp_path / "missing.pt"):
        replayed = subprocess.run([sys.executable, "-m", "overflow_fast", "replay", str(path)], capture_output=True,
                                  text=True, env=env, timeout=120)
        assert replayed.returncode == 1 and str(path) in replayed.stderr and "Traceback" not in replayed.stderr


@pytest.mark.parametrize("check", CHECKS)
def test_a_bert_whose_intermediate_product_overflows_in_fp16(check):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32)
    model = transformers.BertForMaskedLM(config).half()
    with torch.no_grad():
        model.bert.encoder.layer[1].intermediate.dense.weight.normal_(0, 8000.0).clamp_(-60000, 60000)
    watch(model, check=check)
    ids = torch.randint(0, 64, (2, 8))
    out, error = capture(lambda: model(input_ids=ids, labels=ids).loss.backward())
    line, op = op_of(out, error)
    assert out.splitlines()[-2] == ("Source: born in forward of bert.encoder.layer.1.intermediate.dense (Linear): "
                                    "output from finite inputs and weights")
    # the Linear is torch's: the line is BertIntermediate's, the model's code that calls it
    assert op["op"] == "aten.addmm" and os.path.basename(op["file"]) == "modeling_bert.py", op
    assert op["what"].startswith("inf from finite inputs"), op


@pytest.mark.one_path
def test_a_reproducer_that_names_the_replays_earlier_module_still_loads(tmp_path, monkeypatch):
    """A file written when the reproducer's functions lived in ``overflow_fast.hooks.op_replay``."""
    import types

    from overflow_fast.replay import repro

    old = types.ModuleType("overflow_fast.hooks.op_replay")
    old.script_definition = repro.script_definition
    monkeypatch.setitem(sys.modules, old.__name__, old)
    monkeypatch.setattr(repro.script_definition, "__module__", old.__name__)
    script = tmp_path / "train.py"
    script.write_text("WIDTH = 4\n")
    payload = {"format": repro.REPRO_FORMAT, "format_version": repro.REPRO_VERSION,
               "width": None}
    path = tmp_path / "old.pt"

    class Named:
        def __reduce__(self):
            return repro.script_definition, ((str(script), None), "WIDTH")

    payload["width"] = Named()
    torch.save(payload, path)
    monkeypatch.delitem(sys.modules, old.__name__)
    monkeypatch.undo()
    assert repro.load_repro(path)["width"] == 4


class _PrivateDraws(nn.Module):
    """Dropout-like draws from a generator of its own; ``bad``: a division by zero after them."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.generator = torch.Generator().manual_seed(5)
        self.bad = False

    def forward(self, x):
        mask = torch.bernoulli(torch.full_like(x, 0.5), generator=self.generator)
        y = self.fc(x * mask)
        return y / (mask.sum() - mask.sum()) if self.bad else y


@pytest.mark.parametrize("check", CHECKS)
def test_a_replay_leaves_a_private_generator_as_it_was_and_says_its_draws_are_afresh(check):
    def run(attach):
        torch.manual_seed(0)
        model = nn.Sequential(_PrivateDraws(), nn.ReLU())
        detector = watch(model, check=check, on_detect="record") if attach else None
        with contextlib.redirect_stdout(io.StringIO()):
            for step in range(3):
                model[0].bad = step == 1
                model(torch.ones(2, 4)).sum().backward()
                model.zero_grad()
        return model[0].generator.get_state(), torch.rand(1), detector

    plain, watched = run(False), run(True)
    assert torch.equal(plain[0], watched[0]) and torch.equal(plain[1], watched[1])  # the run's draws are its own
    op = watched[2].detections[0]["op"]
    assert op["reproduced"] == "with fresh random draws (aten.bernoulli from a private torch.Generator)", op
    assert "version counter" not in str(watched[2].detections)


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("cache", [True, False])
def test_a_weight_autocast_casts_to_inf_is_named_as_the_cast(check, cache):
    """A float32 weight of 8.19e4 that float16 autocast casts to inf (65504 is float16's largest):
    the replay makes the cast again, whether the run's autocast cached it or not."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with torch.no_grad():
        model[2].weight[0, 0] = 8.19e4
    watch(model, check=check)

    def step():
        with torch.autocast("cpu", dtype=torch.float16, cache_enabled=cache):
            model(torch.randn(2, 4)).float().sum().backward()

    out, error = capture(step)
    lines = out.splitlines()
    assert "Source: born in forward of 2 (Linear): output from finite inputs and weights" in lines
    assert lines[-1] == ("Op: aten._to_copy in 2 (Linear), torch's own code: weight cast to float16: inf from finite "
                         "values (abs max 8.2e+04, beyond float16's largest, 6.6e+04); reproduced on the same inputs")
    assert "                  2 Linear (autocast float16)" in lines  # the frames say what each call computed in
