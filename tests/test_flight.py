"""The flight recorder wired into the detector (log=, log_every=) and the structured error."""

import contextlib
import io
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from overflow_fast import DebugUnderflowOverflow, OverflowDetected, watch
from overflow_fast.recording.recorder import decode_float
from test_recorder import child_env, strict_lines

CHECKS = ("module", "batch")


class Amplify(nn.Module):
    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


def model_that_overflows_at(step_scale):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), Amplify(step_scale), nn.Linear(4, 2)).half()


def run(model, batches, **options):
    out = io.StringIO()
    error = None
    detector = DebugUnderflowOverflow(model, **options)
    with contextlib.redirect_stdout(out):
        try:
            for x in batches:
                with torch.no_grad():
                    model(x)
        except ValueError as caught:
            error = caught
    detector.remove()
    return out.getvalue(), error, detector


@pytest.mark.parametrize("check", CHECKS)
def test_records_equal_the_printed_frames_across_a_detection(check, tmp_path):
    path = tmp_path / "run.jsonl"
    batches = [torch.full((2, 4), v, dtype=torch.float16) for v in (1.0, 2.0, 3e4)]
    out, error, _ = run(model_that_overflows_at(10.0), batches, check=check, log=str(path))
    assert isinstance(error, OverflowDetected)
    records = strict_lines(path)
    assert records[0]["record"] == "meta" and records[0]["rank"] is None
    entries = [r for r in records if r["record"] == "entry"]
    assert sorted({r["step"] for r in entries}) == [0, 1, 2]
    detection = records[-1]
    where = detection.pop("where")
    assert detection == {"record": "detection", "step": 2, "phase": "forward", "module": "1", "class": "Amplify",
                         "entries": ["output"], "rank": None}
    # the detection's Where facts (the output is at hand when its hook decides it, not at the
    # forward's end without find_op)
    if check == "module":
        output = next(r for r in entries if (r["step"], r["module"], r["entry"]) == (2, "1", "output"))
        assert (where["entry"], where["shape"], where["rows"], where["rows_total"], where["batch"]) == (
            "output", [2, 4], [0, 1], 2, False)
        assert [where[k] for k in ("nan", "posinf", "neginf", "numel")] == [output[k] for k in
                                                                           ("nan", "posinf", "neginf", "numel")]
    else:
        assert where == {"entry": "output", "why": "the call's tensors are not kept: find_op=True keeps them until "
                                                   "the pass is decided"}
    # every line of the printed report's frames has its record with the same numbers
    report = out.split("Last ")[1]
    module = step = None
    checked = 0
    for line in report.splitlines():
        if "*** Starting batch number=" in line:
            step = int(line.split("=")[1].split(" ")[0])
        elif line.startswith(" " * 18):
            module = line.strip().rsplit(" ", 1)[0] if " " in line.strip() else ""
        elif step is not None and module is not None and len(line) > 18 and line[8] == " " \
                and not line.startswith((" ", "abs min")):
            lo, hi, ctx = line[:8], line[9:17], line[18:]
            record = [r for r in entries if r["step"] == step and r["module"] == module and r["entry"] == ctx][-1]
            assert f"{decode_float(record['abs_min']):8.2e}" == lo and f"{decode_float(record['abs_max']):8.2e}" == hi
            checked += 1
    assert checked >= 6
    assert {r["call"] for r in entries if r["step"] == 2} == set(range(len({(r["module"], r["call"])
                                                                          for r in entries if r["step"] == 2})))


@pytest.mark.parametrize("check", CHECKS)
def test_log_every_keeps_every_nth_step_and_the_step_that_detects(check, tmp_path):
    path = tmp_path / "run.jsonl"
    batches = [torch.full((2, 4), 1.0, dtype=torch.float16)] * 5 + [torch.full((2, 4), 3e4, dtype=torch.float16)]
    _, error, _ = run(model_that_overflows_at(10.0), batches, check=check, log=str(path), log_every=2)
    assert isinstance(error, OverflowDetected)
    records = strict_lines(path)
    steps = sorted({r["step"] for r in records if r["record"] == "entry"})
    assert steps == [0, 2, 4, 5]  # 5 is odd but detects
    assert records[-1]["record"] == "detection" and records[-1]["step"] == 5


@pytest.mark.parametrize("check", CHECKS)
def test_the_error_carries_the_detection_and_frames_as_data(check):
    batches = [torch.full((2, 4), 3e4, dtype=torch.float16)]
    out, error, _ = run(model_that_overflows_at(10.0), batches, check=check)
    assert (error.batch_number, error.phase, error.module_name, error.class_name, error.entries, error.rank) == \
        (0, "forward", "1", "Amplify", ["output"], None)
    assert [f["module"] for f in error.frames] == ["0", "1"]
    amplify = error.frames[1]
    assert amplify["class"] == "Amplify" and amplify["phase"] == "forward"
    assert amplify["entries"][-1]["entry"] == "output" and amplify["entries"][-1]["posinf"] > 0
    assert amplify["entries"][-1]["dtype"] == "float16" and amplify["entries"][-1]["abs_max"] == float("inf")


def test_watch_logs_backward_records(tmp_path):
    path = tmp_path / "run.jsonl"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    with watch(model, log=str(path)):
        model(torch.randn(2, 4)).sum().backward()
    records = strict_lines(path)
    phases = {(r["phase"], r["entry"]) for r in records if r["record"] == "entry"}
    assert ("backward", "weight.grad") in phases and ("backward", "output.grad") in phases
    assert ("forward", "input[0]") in phases


def test_a_killed_process_leaves_every_line_up_to_the_detection(tmp_path):
    path = tmp_path / "run.jsonl"
    script = textwrap.dedent(f"""
        import os, signal, torch
        from torch import nn
        from overflow_fast import DebugUnderflowOverflow
        model = nn.Sequential(nn.Linear(4, 4)).half()
        DebugUnderflowOverflow(model, check="batch", log={str(path)!r})
        try:
            for v in (1.0, 1.0, float("inf")):
                model(torch.full((1, 4), v, dtype=torch.float16))
        except ValueError:
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    result = subprocess.run([sys.executable, "-c", script], env=child_env(), capture_output=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr.decode()[-2000:]
    records = strict_lines(path)
    assert records[-1]["record"] == "detection" and records[-1]["step"] == 2
    assert sorted({r["step"] for r in records if r["record"] == "entry"}) == [0, 1, 2]


@pytest.mark.parametrize("check", CHECKS)
def test_records_carry_the_optimizer_step_and_mode_and_the_report_uses_them(check, tmp_path):
    from overflow_fast import cli

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    path = tmp_path / "run.jsonl"
    detector = watch(model, check=check, log=str(path), log_every=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [torch.randn(3, 4) for _ in range(8)]
    batches[6][0, 0] = float("nan")
    error = None
    for index, x in enumerate(batches):  # gradient accumulation 2: optimizer step = index // 2
        detector.set_step(index // 2, "train")
        try:
            model(x).sum().backward()
        except ValueError as caught:
            error = caught
            break
        if index % 2:
            optimizer.step()
            optimizer.zero_grad()
        if index == 3:  # an evaluation at step 2
            detector.set_step(2, "eval")
            with torch.no_grad():
                model(torch.randn(3, 4))
    detector.remove()
    assert error.global_step == 3 and error.mode == "train"
    records = strict_lines(path)
    entries = [r for r in records if r["record"] == "entry"]
    assert {(r["global_step"], r["mode"]) for r in entries} == {(0, "train"), (2, "train"), (2, "eval"), (3, "train")}
    [detection] = [r for r in records if r["record"] == "detection"]
    assert (detection["global_step"], detection["mode"], detection["step"]) == (3, "train", 7)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["report", str(path)]) == 0
    assert "optimizer step 3 (train" in out.getvalue()
