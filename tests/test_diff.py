"""`overflow-fast diff` on real recorded runs of a small GPT-2 (a transformers config, nothing
downloaded), trained a few steps under `watch(log=...)`: fp32 against bf16 autocast, and one
where a single layer's weights are perturbed at step 5."""

import os
import subprocess
import sys

import pytest
import torch

import overflow_fast
from models import gpt2, token_batch
from overflow_fast import cli
from overflow_fast.report.diff import IDENTICAL, Diff, Picture
from overflow_fast.report.engine import Logs, available_engines
from test_recorder import child_env

STEPS = 6
PERTURBED_STEP = 5
PERTURBED = "transformer.h.1.mlp.c_fc"


def record(path, autocast=False, perturb=False):
    """Train the small GPT-2 for STEPS steps under watch(log=path), every step logged."""
    model = gpt2(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with overflow_fast.watch(model, log=str(path)):
        for step in range(STEPS):
            if perturb and step == PERTURBED_STEP:
                with torch.no_grad():
                    model.get_submodule(PERTURBED).weight.mul_(1.5)
            ids = token_batch(step)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model(ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("runs")
    return {
        "fp32": record(folder / "fp32.jsonl"),
        "again": record(folder / "again.jsonl"),
        "bf16": record(folder / "bf16.jsonl", autocast=True),
        "perturbed": record(folder / "perturbed.jsonl", perturb=True),
    }


def diff_of(runs, a, b, engine=available_engines()[0], **options):
    with Logs([[runs[a]], [runs[b]]], engine) as logs:
        return Diff(logs, **options)


def where(diff):
    a = diff.first[0]
    return a["step"], a["phase"], a["module"], a["entry"]


def test_a_perturbed_layer_is_named_first_at_its_step(runs, capsys):
    diff = diff_of(runs, "fp32", "perturbed")
    assert where(diff) == (PERTURBED_STEP, "forward", PERTURBED, "weight")
    assert diff.pairs == diff.sides[0].entries == diff.sides[1].entries
    assert not diff.sides[0].only and not diff.sides[1].only
    # every module parts at that step or later, none before it
    assert all(row[5] is None or row[5]["step"] >= PERTURBED_STEP for row in diff.largest)
    assert cli.main(["diff", runs["fp32"], runs["perturbed"]]) == 0
    out = capsys.readouterr().out
    assert (f"first parting: step {PERTURBED_STEP}, forward, module {PERTURBED} (Conv1D), entry weight" in out)
    assert "abs max differs by 33.3%" in out  # the weights times 1.5: |x - 1.5x| / 1.5x


def test_fp32_against_bf16_autocast_parts_at_the_first_op_autocast_runs_in_bf16(runs):
    """Where the dtypes differ, abs max alone is compared: the first op autocast runs in bf16
    differs by its rounding, within rtol, and the runs part where that rounding has grown."""
    with Logs([[runs["fp32"]], [runs["bf16"]]], available_engines()[0]) as logs:
        diff = Diff(logs, rtol=0.01)
        # the embeddings, dropout and the first LayerNorm run in fp32 under autocast: identical
        early = logs.rows("SELECT count(*) FROM pairs WHERE step = 0 AND high + low > 0 AND module IN "
                          "('transformer.wte', 'transformer.wpe', 'transformer.drop', 'transformer.h.0.ln_1') "
                          "AND apos < (SELECT min(apos) FROM pairs WHERE dtypes_differ = 1)")[0][0]
    assert early == 0
    a, b = diff.first_dtype
    assert (a["module"], a["entry"], a["dtype"], b["dtype"]) == ("transformer.h.0.attn.c_attn", "output", "float32",
                                                                 "bfloat16")
    assert diff.compared == "abs_max" and diff.first is not None and diff.first[3] == 1  # abs min: not compared
    assert diff.pairs == diff.sides[0].entries and not diff.sides[0].only and not diff.sides[1].only
    assert "so abs max only is compared" in diff.text()


def test_two_runs_of_the_same_code_never_part(runs):
    diff = diff_of(runs, "fp32", "again", rtol=0.0)
    assert diff.first is None and diff.parted == 0 and diff.pairs == STEPS * 148
    assert "(no aligned pair differs)" in diff.text()


def test_both_engines_the_same_diff(runs):
    texts = {diff_of(runs, "fp32", "perturbed", engine).text() for engine in available_engines()}
    assert len(texts) == 1


def test_the_picture_of_the_perturbed_run(runs, tmp_path):
    pytest.importorskip("matplotlib")
    diff = diff_of(runs, "fp32", "perturbed", grid=True, stat="abs_max")
    picture = Picture(diff)
    row = picture.modules.index(PERTURBED)
    assert picture.first["x"] == PERTURBED_STEP and picture.first["row"] == row
    assert picture.columns == list(range(STEPS))
    assert all(kinds[:PERTURBED_STEP] == [IDENTICAL] * PERTURBED_STEP for kinds in picture.kinds)
    assert PERTURBED in [picture.modules[row] for row in picture.curves]
    png = tmp_path / "diff.png"
    assert cli.main(["diff", runs["fp32"], runs["perturbed"], "--png", str(png), "--size", "1200x900"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.read_bytes()[16:24] == (1200).to_bytes(4, "big") + (900).to_bytes(4, "big")


def test_the_console_script_lists_diff(tmp_path):
    script = os.path.join(os.path.dirname(sys.executable), "overflow-fast")
    command = [script] if os.path.exists(script) else [sys.executable, "-m", "overflow_fast"]
    listed = subprocess.run(command + ["--help"], capture_output=True, text=True, timeout=120, env=child_env())
    assert listed.returncode == 0 and "diff" in listed.stdout and "first part" in " ".join(listed.stdout.split())
    helped = subprocess.run(command + ["diff", "--help"], capture_output=True, text=True, timeout=120, env=child_env())
    assert helped.returncode == 0 and "--rtol" in helped.stdout and "--png" in helped.stdout
