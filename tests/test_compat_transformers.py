"""Byte-for-byte comparison with transformers' DebugUnderflowOverflow on real model classes
built from small configs with random weights, in both check modes."""

import copy

import pytest
import torch

import models
from compat import ReferenceDetector, assert_identical, run
from overflow_fast import DebugUnderflowOverflow

CHECKS = ["module", "batch"]


def seq2seq_batch(seed):
    ids = models.token_batch(seed)
    return {"input_ids": ids, "decoder_input_ids": ids[:, :4]}


@pytest.mark.parametrize("check", CHECKS)
def test_t5_fp16_real_overflow(check):
    # the second block's feed-forward output passes fp16's 65504: the report ends at that Linear
    model = models.t5(torch.float16, overflow_scale=6e4)
    out, outcomes, _ = assert_identical(model, [seq2seq_batch(0), seq2seq_batch(1)], check=check)
    assert "output has infs" in out and "DenseReluDense.wo Linear" in out
    assert outcomes[0][0] == "ValueError"


@pytest.mark.parametrize("check", CHECKS)
def test_t5_fp16_trace_then_overflow(check):
    model = models.t5(torch.float16, overflow_scale=6e4)
    batches = [seq2seq_batch(i) for i in range(3)]
    out, outcomes, _ = assert_identical(model, batches, check=check, trace_batch_nums=[0])
    assert "*** Starting batch number=0 ***" in out


@pytest.mark.parametrize("check", CHECKS)
def test_gpt2_clean_run_with_trace_and_abort(check):
    model = models.gpt2()
    batches = [models.token_batch(i) for i in range(4)]
    out, outcomes, _ = assert_identical(
        model, batches, check=check, trace_batch_nums=[1, 2], abort_after_batch_num=2, max_frames_to_save=1000
    )
    assert outcomes[:2] == [None, None] and outcomes[2][0] == "ValueError"
    assert "not a tensor output" in out  # a ModelOutput is printed as the reference prints it


@pytest.mark.parametrize("check", CHECKS)
def test_gpt2_tuple_outputs_fp16_overflow(check):
    model = models.gpt2(torch.float16)
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight.mul_(1e5)
        model.transformer.h[1].mlp.c_proj.weight.mul_(1e3)  # the MLP output overflows fp16
    batches = [(models.token_batch(i), None, None) for i in range(2)]

    def steps(m, batch):
        with torch.no_grad():
            m(batch[0], return_dict=False)

    out, outcomes, _ = assert_identical(model, batches, steps=steps, check=check, max_frames_to_save=7)
    assert outcomes[0] is not None


@pytest.mark.parametrize("check", CHECKS)
def test_bert_traced_batches(check):
    model = models.bert()
    batches = [models.token_batch(i) for i in range(3)]
    out, outcomes, _ = assert_identical(model, batches, check=check, trace_batch_nums=[0, 2])
    assert outcomes == [None, None, None]
    assert "pooler.dense Linear" in out


@pytest.mark.parametrize("check", CHECKS)
def test_bert_bf16_nan_in_weight(check):
    model = models.bert(torch.bfloat16)
    with torch.no_grad():
        model.encoder.layer[1].attention.self.value.weight[0, 0] = float("nan")
    out, outcomes, _ = assert_identical(model, [models.token_batch(0)], check=check)
    assert "weight has nans" in out


@pytest.mark.parametrize("check", CHECKS)
def test_llama_fp16_overflow(check):
    model = models.llama(torch.float16)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(2e3)
        model.model.layers[0].mlp.gate_proj.weight.mul_(2e3)  # gate * up overflows fp16
    batches = [models.token_batch(i) for i in range(2)]
    out, outcomes, _ = assert_identical(model, batches, check=check)
    assert outcomes[0] is not None and "has infs" in out


def train_both(model, batches, loss, lr, check, **kwargs):
    """(stdout, outcomes) of training identical copies of ``model`` with SGD under the reference
    and under overflow_fast: each copy gets its own optimizer."""
    results = []
    for cls, extra in ((ReferenceDetector, {}), (DebugUnderflowOverflow, {"check": check})):
        copy_of_model = copy.deepcopy(model)
        optimizer = torch.optim.SGD(copy_of_model.parameters(), lr=lr)

        def step(m, batch, optimizer=optimizer):
            optimizer.zero_grad()
            loss(m, batch).backward()
            optimizer.step()

        results.append(run(cls, copy_of_model, batches, step, **kwargs, **extra)[:2])
    return results


@pytest.mark.parametrize("check", CHECKS)
def test_llama_training_steps(check):
    # forward + backward + optimizer step: parameters change between batches; batch 2 is traced
    model = models.llama()
    model.train()
    batches = [models.token_batch(i) for i in range(3)]
    want, got = train_both(model, batches, lambda m, b: m(input_ids=b, labels=b).loss, 0.1, check,
                           trace_batch_nums=[2])
    assert got == want
    assert "*** Starting batch number=2 ***" in want[0]


@pytest.mark.parametrize("check", CHECKS)
def test_bert_bf16_training_with_dropout_until_it_overflows(check):
    # dropout draws from the RNG (each run reseeds it); a huge loss scale makes batch 1's
    # gradients inf, so the SGD step poisons the weights that batch 2 reads
    model = models.bert(torch.bfloat16)
    model.train()
    batches = [models.token_batch(i) for i in range(3)]

    def loss(m, batch):
        return m(input_ids=batch).last_hidden_state.float().pow(2).mean().mul(1e30)

    want, got = train_both(model, batches, loss, 10.0, check, trace_batch_nums=[0])
    assert got == want
    assert want[1][0] is None and want[1][1][0] == "ValueError"


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("name", sorted(models.MORE_MODELS))
def test_more_model_classes_fp16_overflow(name, check):
    make_model, make_batch = models.MORE_MODELS[name]
    models.seeded(4)
    model = make_model().to(torch.float16).eval()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weight = linears[len(linears) // 2].weight
    with torch.no_grad():
        weight.mul_(6e4 / weight.abs().max())  # sums of such weights pass fp16's 65504
    batches = []
    for seed in range(3):
        batch = make_batch(seed)
        batches.append({k: v.half() if v.is_floating_point() else v for k, v in batch.items()})
    out, outcomes, _ = assert_identical(model, batches, check=check, trace_batch_nums=[0], max_frames_to_save=9)
    assert outcomes[0] is None and outcomes[1][0] == "ValueError"
