"""find_op in the setups people train with: dropout (the replay draws the run's very numbers),
transformers models in training mode, a parent's own code in backward, torch.compile, reentrant
checkpointing, classes defined in the training script; never a guess; and a transient fault told
from a deterministic nan/inf."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from compat import capture
from overflow_fast import OverflowDetected, _compat, watch

CHECKS = ["module", "batch"]
HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
SAME = "; reproduced on the same inputs"
TRANSIENT = "Op: not reproduced on the same inputs: a transient fault (hardware, a race, memory corruption) is likely"


def line_of(function, offset):
    return function.__code__.co_firstlineno + offset


def op_of(out, error):
    assert isinstance(error, OverflowDetected), out[-2000:]
    lines = out.splitlines()
    assert lines[-1].startswith("Op: "), out[-2000:]
    return lines[-1], error.detection["op"]


# -- random ops: the run's very draws --------------------------------------------------------------

class DropThenExp(nn.Module):
    def forward(self, x):
        return torch.exp(F.dropout(x, 0.5, training=True) * 4)


DROP_EXP_LINE = line_of(DropThenExp.forward, 1)


@pytest.mark.parametrize("check", CHECKS)
def test_a_random_op_never_makes_a_deterministic_nan_look_transient(check):
    # one element, dropped half the time: exp(30 * 2 * 4) overflows only where the mask kept it.
    # Drawn afresh, half of these replays would come out finite and the fault look transient.
    seen = 0
    for seed in range(8):
        model = nn.Sequential(nn.Linear(1, 1), DropThenExp())
        with torch.no_grad():
            model[0].weight.fill_(1.0)
            model[0].bias.zero_()
        watch(model, check=check)
        torch.manual_seed(seed)
        torch.rand(seed)  # the generator elsewhere than at its seed
        out, error = capture(lambda: model(torch.full((1, 1), 30.0)))
        if error is None:
            continue  # dropped: finite
        seen += 1
        line, op = op_of(out, error)
        assert line.startswith(f"Op: aten.exp at {HERE}:{DROP_EXP_LINE}: inf from finite inputs"), line
        assert line.endswith(SAME), line
        assert error.detection["transient"] is False
    assert seen >= 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("check", CHECKS)
def test_a_cuda_dropout_replays_the_runs_very_draws(check):
    # CUDA's generator (Philox: a seed and an offset) is taken once per forward as the CPU one is
    for seed in range(4):
        model = nn.Sequential(nn.Linear(64, 64), DropThenExp()).cuda()
        with torch.no_grad():
            model[0].weight.copy_(torch.eye(64))
            model[0].bias.zero_()
        watch(model, check=check)
        torch.manual_seed(seed)
        x = torch.rand(2, 64, device="cuda") * 30  # some elements overflow, where the mask kept them
        out, error = capture(lambda: model(x))
        line, op = op_of(out, error)
        assert line.startswith(f"Op: aten.exp at {HERE}:{DROP_EXP_LINE}: inf from finite inputs"), line
        assert line.endswith(SAME), line


def gpt2(**config):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    settings = dict(vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**settings, **config})).half()


def gpt2_step(model):
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    return lambda: model(input_ids=ids, labels=ids).loss.backward()


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_gpt2_in_training_replays_its_attention_dropout_exactly(check, attention):
    # values of 60000 and uniform attention: a row overflows fp16 where the dropout mask kept every
    # weight (1 / 0.9 of 60000). The replay of the attention runs the model again from its start
    # (nothing read) to the attention's call: its cache as the call had it, its dropout's draws.
    model = gpt2(attn_implementation=attention).train()
    with torch.no_grad():
        c_attn = model.transformer.h[1].attn.c_attn
        c_attn.weight.zero_()
        c_attn.bias.zero_()
        c_attn.bias[32:] = 60000.0
    watch(model, check=check)
    torch.manual_seed(3)
    out, error = capture(gpt2_step(model))
    line, op = op_of(out, error)
    assert out.splitlines()[-2].startswith("Source: born outside any module, in the code before "
                                           "transformer.h.1.attn.c_proj (Conv1D) input[0]")
    assert line.endswith(SAME) and op["reproduced"] == "on the same inputs", line
    assert os.path.basename(os.path.dirname(op["file"])) in ("gpt2", "integrations"), op
    # sdpa casts its result back to float16, where the row that did not fit becomes inf
    assert op["what"].startswith("inf from finite inputs" if attention == "eager" else
                                 "a cast to float16: inf from finite values"), op
    assert error.detection["transient"] is False


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_gpt2_layernorm_overflow_names_the_models_line_never_the_users_call(check, mode):
    model = getattr(gpt2(), mode)()
    with torch.no_grad():
        model.transformer.h[1].ln_1.weight.fill_(60000.0)
        model.transformer.h[1].ln_1.bias.fill_(60000.0)
    watch(model, check=check)
    out, error = capture(gpt2_step(model))
    line, op = op_of(out, error)
    assert out.splitlines()[-2] == ("Source: born in forward of transformer.h.1.ln_1 (LayerNorm): output from "
                                    "finite inputs and weights")
    # the block's line that calls ln_1, replayed on its inputs as they were (its cache too)
    assert op["op"] == "aten.native_layer_norm" and os.path.basename(op["file"]) == "modeling_gpt2.py", op
    assert HERE not in line and line.endswith(SAME)


# -- never a guess ---------------------------------------------------------------------------------

@pytest.mark.parametrize("check", CHECKS)
def test_an_op_that_only_torch_code_ran_names_its_module_not_the_line_that_called_the_model(check):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).half()
    with torch.no_grad():
        model[0].weight.fill_(100.0)
    watch(model, check=check)
    out, error = capture(lambda: model(torch.full((2, 4), 300.0, dtype=torch.float16)))
    line, op = op_of(out, error)
    assert line.startswith("Op: aten.addmm in 0 (Linear), torch's own code: inf from finite inputs"), line
    assert HERE not in line and (op["file"], op["line"]) == (None, None)


# -- a parent's own code in backward ---------------------------------------------------------------

class SqrtInParent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return torch.sqrt(h * h)


SQRT_LINE = line_of(SqrtInParent.forward, 2)


def zero_fc(model):
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.bias.zero_()
    return model


@pytest.mark.parametrize("check", CHECKS)
def test_parent_code_in_backward_is_replayed_in_the_enclosing_call(check):
    model = nn.Sequential(nn.Linear(4, 4), zero_fc(SqrtInParent()))
    watch(model, check=check)
    out, error = capture(lambda: model(torch.ones(2, 4)).sum().backward())
    line, op = op_of(out, error)
    assert out.splitlines()[-2].startswith("Source: born in backward, in the gradient arriving at 1.fc (Linear) "
                                           "output.grad: made by the backward of code outside any hooked module")
    assert line == f"Op: SqrtBackward0 at {HERE}:{SQRT_LINE}: inf from finite inputs (input abs max 1.0e+00){SAME}"
    assert error.detection["transient"] is False


# -- reentrant checkpointing -----------------------------------------------------------------------

class Checkpointed(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.block = zero_fc(SqrtInParent())
        self.reentrant = reentrant

    def forward(self, x):
        return checkpoint(self.block, self.pre(x), use_reentrant=self.reentrant)


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("reentrant", [True, False])
def test_a_checkpointed_blocks_backward_is_replayed_from_its_recompute(check, reentrant):
    model = Checkpointed(reentrant)
    watch(model, check=check)
    x = torch.ones(2, 4, requires_grad=True)
    out, error = capture(lambda: model(x).sum().backward())
    line, op = op_of(out, error)
    assert line == f"Op: SqrtBackward0 at {HERE}:{SQRT_LINE}: inf from finite inputs (input abs max 1.0e+00){SAME}"


# -- torch.compile ---------------------------------------------------------------------------------

class Exp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.exp(self.fc(x) * 100)


EXP_LINE = line_of(Exp.forward, 1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.block = Exp()
        self.post = nn.Linear(4, 4)

    def forward(self, x):
        return self.post(self.block(self.pre(x)))


def compiled(what):
    """(the model the detector watches, the callable the loop calls)."""
    torch.manual_seed(0)
    model = Net()
    if what == "model":
        return model, torch.compile(model, backend="aot_eager")
    model.block.compile(backend="aot_eager")
    return model, model


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("what, grad", [("model", True), ("model", False), ("block", True)])
def test_a_compiled_model_or_module_is_replayed_eagerly(check, what, grad):
    torch._dynamo.reset()
    model, run = compiled(what)
    watch(model, check=check)
    x = torch.full((2, 4), 10.0)
    with torch.set_grad_enabled(grad):
        out, error = capture(lambda: run(x))
    line, op = op_of(out, error)
    assert out.splitlines()[-2] == "Source: born in forward of block (Exp): output from finite inputs and weights"
    assert line.startswith(f"Op: aten.exp at {HERE}:{EXP_LINE}: inf from finite inputs"), line


class Norm(nn.Module):
    def forward(self, x):
        return torch.sqrt((x * x).sum(-1))


@pytest.mark.parametrize("check", CHECKS)
def test_under_compile_the_source_line_says_finite_only_of_what_was_read(check):
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(4, 4), Norm())
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.zero_()
    watch(model, check=check)
    run = torch.compile(model, backend="aot_eager")
    out, error = capture(lambda: run(torch.ones(2, 4)).sum().backward())
    line, op = op_of(out, error)
    # the gradient arriving at 0's output is not collected in a compiled region: no "finite" claim
    # (torch versions accumulate the weight's or the bias's gradient first); where dynamo leaves
    # the nn.Sequential's hooks to run eagerly (torch 2.11 and older), that gradient was read, and
    # its maker is named
    assert re.fullmatch(r"Source: born in backward, first seen in 0 \(Linear\) (weight|bias)\.grad: the gradient "
                        r"arriving at its outputs was not read \(e\.g\. in a torch\.compile region\), so which "
                        r"backward made it is not known", out.splitlines()[-2]) or \
        out.splitlines()[-2] == "Source: born in backward, in the gradient arriving at 0 (Linear) output.grad: made by " \
                                "the backward of 1", out.splitlines()[-2]
    assert line.startswith("Op: SqrtBackward0 at "), line


@pytest.mark.skipif(not _compat.COMPILES_A_WATCHED_MODEL_WHOLE,
                    reason="this torch runs a compiled model with a detector eagerly: no compiled region")
def test_a_compiled_gpt2s_tied_embedding_is_not_called_the_birthplace(check="batch"):
    # the fp16 gradient of the logits overflows in lm_head's backward, into the weight it shares
    # with wte; the gradients arriving at modules are not read under compile: no "finite" claim,
    # and the replay of the model's own call names the matmul of lm_head's line
    model = gpt2(attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0).train()
    watch(model, check=check)
    torch._dynamo.reset()
    run = torch.compile(model, backend="aot_eager")
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    out, error = capture(lambda: (run(input_ids=ids).logits.float() * 3e4).sum().backward())
    line, op = op_of(out, error)
    # which weight's gradient is read first depends on where compile broke the graph (the
    # detector's own traced reads differ without the C++ extension): wte's, or ln_f's
    source = out.splitlines()[-2]
    assert source.startswith("Source: born in backward, first seen in transformer."), source
    assert source.endswith(" weight.grad: the gradient arriving at its outputs was not read (e.g. in a "
                           "torch.compile region), so which backward made it is not known"), source
    assert op["op"] == "MmBackward0" and os.path.basename(op["file"]) == "modeling_gpt2.py", op
    assert line.endswith(SAME)


# -- transient or deterministic ---------------------------------------------------------------------

class FlipsOnce(nn.Module):
    """Returns an inf in its first call only: a stand-in for a flipped bit."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        y = x * 2
        if self.calls == 1:
            y.view(-1)[3] = float("inf")
        return y


@pytest.mark.parametrize("check", CHECKS)
def test_a_fault_that_the_same_inputs_do_not_reproduce_is_transient(check, tmp_path):
    log = tmp_path / "run.jsonl"
    model = nn.Sequential(nn.Linear(4, 4), FlipsOnce(), nn.Linear(4, 4))
    watch(model, check=check, log=str(log))
    out, error = capture(lambda: model(torch.ones(2, 4)))
    line, op = op_of(out, error)
    assert out.splitlines()[-2] == "Source: born in forward of 1 (FlipsOnce): output from finite inputs and weights"
    assert line == TRANSIENT
    assert error.detection["transient"] is True and op["op"] is None and op["reproduced"] is None
    records = [json.loads(text) for text in log.read_text().splitlines()]
    assert [r["transient"] for r in records if r.get("record") == "detection"] == [True]


@pytest.mark.parametrize("check", CHECKS)
def test_an_output_changed_in_place_after_the_call_cannot_tell(check):
    # ReLU(inplace=True) rewrites the flipped call's output: decided when the pass ends, the
    # replay cannot be compared with what the call returned
    model = nn.Sequential(nn.Linear(4, 4), FlipsOnce(), nn.ReLU(inplace=True))
    watch(model, check=check)
    out, error = capture(lambda: model(torch.randn(2, 4, generator=torch.Generator().manual_seed(0))))
    line, op = op_of(out, error)
    if check == "module":  # decided in the call's hook, before the ReLU
        assert line == TRANSIENT and error.detection["transient"] is True
    else:
        assert line == "Op: not reproduced on replay (no op made a nan/inf from finite inputs)"
        assert error.detection["transient"] is None


class Doubler(nn.Module):
    def forward(self, x):
        return x * 2


@pytest.mark.parametrize("check", CHECKS)
def test_inputs_changed_unseen_are_never_taken_for_a_transient_fault(check):
    # the call's input is scaled in place after the call with no version bump (as an in-place
    # collective writes): a replay from it, finite, differs from the run elsewhere too
    class Parent(nn.Module):
        def __init__(self):
            super().__init__()
            self.doubler = Doubler()

        def forward(self, x):
            y = self.doubler(x)
            with torch.autograd._unsafe_preserve_version_counter(x):
                x.mul_(0.5)
            return y

    model = Parent()
    watch(model, check=check)
    x = torch.ones(2, 4, dtype=torch.float16)
    x[0, 0] = 40000.0
    out, error = capture(lambda: model(x))
    line, op = op_of(out, error)
    if check == "module":  # decided in the hook, before the change: reproduced
        assert line.startswith(f"Op: aten.mul at {HERE}:{line_of(Doubler.forward, 1)}: inf from finite inputs"), line
        assert error.detection["transient"] is False
    else:
        assert line.startswith("Op: not reproduced on replay, whose finite values differ from the run's too"), line
        assert error.detection["transient"] is None


# -- a model defined in the training script --------------------------------------------------------

SCRIPT = """\
import sys

import torch
from torch import nn
from overflow_fast import watch

SCALE = 100.0


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.exp(self.fc(x) * SCALE)


OFFSET = float(sys.argv[2])  # set by running code: the script's definitions alone have no OFFSET


class Shifted(nn.Module):
    def forward(self, x):
        return torch.exp(x + OFFSET)


torch.manual_seed(0)
for index, model in enumerate((nn.Sequential(Block()), nn.Sequential(nn.Identity(), Shifted()))):
    watch(model, repro=f"{sys.argv[1]}/{index}", on_detect="warn")
    model(torch.full((2, 4), 10.0))
print("trained")
"""


@pytest.mark.slow  # a training script and its replay, each a fresh process; .ci/run runs it
def test_a_reproducer_of_classes_defined_in_the_training_script_replays_in_a_fresh_process(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": ROOT}
    ran = subprocess.run([sys.executable, str(script), str(tmp_path / "repro"), "1000"], capture_output=True,
                         text=True, env=env, timeout=300, cwd=tmp_path)
    assert ran.returncode == 0 and "trained" in ran.stdout, ran.stdout + ran.stderr
    # the second model's class reads a name that only running the script sets: said when written
    assert "will not replay in a fresh process: Shifted in " in ran.stderr, ran.stderr
    assert "define them in a module and import them" in ran.stderr
    assert "Block" not in ran.stderr.split("will not replay")[1]
    op_line = next(line for line in ran.stdout.splitlines() if line.startswith("Op: "))
    assert op_line.startswith(f"Op: aten.exp at {script}:16: inf from finite inputs"), op_line
    path = tmp_path / "repro" / "0" / "overflow-rank0-step0.pt"
    replayed = subprocess.run([sys.executable, "-m", "overflow_fast", "replay", str(path)], capture_output=True,
                              text=True, env=env, timeout=300, cwd=ROOT)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert replayed.stdout.splitlines()[-1] == op_line, replayed.stdout + ran.stdout
    assert "trained" not in replayed.stdout  # the script's training never ran in the replay


# -- data parallel: replays never run the wrapper, nor communicate -----------------------------------

@pytest.fixture
def one_rank(tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist
    dist.destroy_process_group()


class DropThenExpLarge(nn.Module):
    def forward(self, x):
        return torch.exp(F.dropout(x, 0.5) * 1000)


DROP_EXP_LARGE_LINE = line_of(DropThenExpLarge.forward, 1)


@pytest.mark.parametrize("check", CHECKS)
def test_under_ddp_the_wrapped_module_replays_the_runs_draws(one_rank, check):
    # the RNG states are taken where the wrapped module's call starts: DDP's own forward (its
    # reducer, its buffer broadcast) never runs again in a replay, and the next steps train on
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), DropThenExpLarge()))
    detector = watch(model, check=check, on_detect="skip")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for step in range(3):
            out, error = capture(lambda: model(torch.randn(4, 8)).sum().backward())
            assert error is None
            optimizer.step()
            optimizer.zero_grad()
            if step == 0:
                line = next(line for line in out.splitlines() if line.startswith("Op: "))
                assert line.startswith(f"Op: aten.exp at {HERE}:{DROP_EXP_LARGE_LINE}: inf from finite inputs"), line
                assert line.endswith(SAME), line
    finally:
        detector.remove()  # a detector holds the collectives' hooks until removed or collected


class Reduced(nn.Module):
    def forward(self, x):
        h = x * 2
        torch.distributed.all_reduce(h)
        return h


@pytest.mark.parametrize("check", CHECKS)
def test_the_run_to_a_call_never_communicates(one_rank, check):
    # the pass's run to the dropout's call would all_reduce: it stops there, and the replay draws
    # afresh and says so
    torch.manual_seed(0)
    model = nn.Sequential(Reduced(), DropThenExpLarge())
    detector = watch(model, check=check)
    try:
        out, error = capture(lambda: model(torch.full((8,), 1.0)))
    finally:
        detector.remove()
    line, op = op_of(out, error)
    assert line.startswith(f"Op: aten.exp at {HERE}:{DROP_EXP_LARGE_LINE}: inf from finite inputs"), line
    assert line.endswith("; reproduced with fresh random draws (aten.bernoulli_)"), line
