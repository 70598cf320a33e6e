"""The direct launch's first use is never the user's process: a probe in a child process judges it
once per kind of GPU, driver, Triton and build, its verdict kept under the build cache's trust
rules, and until a passed verdict is known a device launches through Triton.

The probe's child is stood in for by small programs here (the real one needs a GPU to launch
anything directly; gpu_check's dry run runs it under the interpreter). The gate is the real C++
launcher's, with the benchmark's counting driver standing for the GPU's (made to wait for a
verdict, as the cuda driver does)."""

import json
import os
import sys
import time

import pytest
import torch

from oracle import assert_stats_equal, random_bits
from overflow_fast.stats import StatsBatch
from overflow_fast.stats import triton_backend as tb
from overflow_fast.stats import triton_common, triton_devices, triton_launch, triton_verdicts

needs_interpreter = pytest.mark.skipif(
    tb.unavailable_reason() is not None or not triton_common._INTERPRET or triton_common._EXTENSION is None,
    reason="the interpreter's kernels and the C++ launcher")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Verdicts in a cache of this test's own (never the user's)."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("OVERFLOW_FAST_CACHE_DIR", str(cache))
    yield cache
    triton_verdicts.wait(30)
    triton_verdicts._probes.clear()


def _child(code):
    return [sys.executable, "-c", code]


PASSED = {"passed": True, "stage": "direct", "direct_launches": 5, "launch": "direct (cuLaunchKernel from C++)"}


def _key():
    return triton_verdicts.verdict_key("cpu")


def test_a_probe_that_passes_is_recorded_and_read_back():
    verdict = triton_verdicts.run_probe("cpu", 60, _child(f"print('DIRECT'); print('PROBE ' + {json.dumps(PASSED)!r})"))
    assert verdict["outcome"] == "passed" and verdict["recorded"], verdict
    assert verdict["detail"] == "5 direct launches exact"
    cached, problem = triton_verdicts.cached(_key())
    assert problem is None and cached["outcome"] == "passed" and cached["key"] == _key()
    other = dict(_key(), triton="another version")
    assert triton_verdicts.cached(other) == (None, None)  # another key: no verdict


def test_a_child_that_dies_in_its_direct_launches_fails_the_device_kind():
    """An illegal address ends the child's CUDA context (here: abort after its first direct
    launch): the verdict is failed, and kept."""
    code = "import os, sys; print('DIRECT', flush=True); print('an illegal memory access', file=sys.stderr); os.abort()"
    verdict = triton_verdicts.run_probe("cpu", 60, _child(code))
    assert verdict["outcome"] == "failed" and verdict["detail"].startswith("the probe died of SIGABRT"), verdict
    assert "an illegal memory access" in verdict["output"]
    assert triton_verdicts.cached(_key())[0]["outcome"] == "failed"


def test_a_child_that_fails_before_any_direct_launch_judges_nothing():
    """An import error, or a GPU without memory for the child, says nothing of the direct launch:
    no verdict is kept, and the next process probes again."""
    code = "raise MemoryError('CUDA out of memory')"
    verdict = triton_verdicts.run_probe("cpu", 60, _child(code))
    assert verdict["outcome"] == "not measured" and "before any direct launch" in verdict["detail"], verdict
    assert not verdict["recorded"] and triton_verdicts.cached(_key()) == (None, None)


def test_a_probe_that_runs_out_of_time_is_not_measured_never_failed():
    started = time.monotonic()
    code = "import time; print('DIRECT', flush=True); time.sleep(600)"
    verdict = triton_verdicts.run_probe("cpu", 2, _child(code))
    assert time.monotonic() - started < 30
    assert verdict["outcome"] == "not measured" and "ran past its 2 s" in verdict["detail"], verdict
    assert triton_verdicts.cached(_key()) == (None, None)


def test_a_verdict_others_could_have_written_is_not_read(_private_cache):
    triton_verdicts.run_probe("cpu", 60, _child(f"print('PROBE ' + {json.dumps(PASSED)!r})"))
    path = _private_cache / triton_verdicts.FOLDER / f"{triton_verdicts.key_name(_key())}.json"
    assert path.is_file()
    os.chmod(path, 0o666)
    verdict, problem = triton_verdicts.cached(_key())
    assert verdict is None and "writable by its group and others" in problem


def _dicts(rows, tensors):
    return StatsBatch([t.dtype for t in tensors], [(list(range(len(tensors))), rows)]).tolist()


@needs_interpreter
def test_until_its_probe_passed_a_device_launches_through_triton(tmp_path, monkeypatch):
    """A device whose kind has no verdict starts a probe at its first use and reads through
    Triton's own launch meanwhile (exact rows, the interpreter's); once the probe passed its
    launcher launches directly; a later process (here: the device set up again) takes the kept
    verdict at once, without a probe."""
    monkeypatch.setattr(triton_launch, "VERDICT_DRIVERS", ("cuda", "count"))  # the stand-in waits too
    monkeypatch.setattr(triton_launch, "_launcher_driver", lambda device: ("count", None))
    go = tmp_path / "go"
    code = (f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.05)\n"
            f"print('DIRECT'); print('PROBE ' + {json.dumps(PASSED)!r})")
    monkeypatch.setattr(triton_verdicts, "probe_command", lambda device: _child(code))
    x = random_bits(torch.bfloat16, (70,), torch.Generator().manual_seed(5))
    rows = torch.full((1, 8), -1, dtype=torch.int64)
    tb.forget_devices()
    try:
        assert tb.read_into([x], rows)
        state = triton_devices.lookup("cpu")
        launcher = state.launcher
        assert (launcher.direct_launches, launcher.ordinary_launches) == (0, 1)
        assert_stats_equal(_dicts(rows, [x]), [x], "through Triton while the probe runs")
        assert tb.launch_path(state).startswith("ordinary (the direct launch waits for its probe")
        go.touch()
        triton_verdicts.wait(60)
        assert launcher.direct_allowed and tb.launch_path(state) == tb.DIRECT
        assert tb.read_into([x], rows) and launcher.direct_launches == 1 and (rows == 0).all()  # the count driver's

        monkeypatch.setattr(triton_verdicts, "probe_command", lambda device: _child("raise SystemExit(3)"))
        tb.forget_devices()
        assert tb.read_into([x], rows)
        again = triton_devices.lookup("cpu")
        assert again.launcher.direct_allowed and again.launcher.direct_launches == 1
        assert again.probe.startswith("passed its probe")
    finally:
        tb.forget_devices()


@needs_interpreter
def test_a_failed_verdict_keeps_every_launch_triton_s(monkeypatch):
    monkeypatch.setattr(triton_launch, "VERDICT_DRIVERS", ("cuda", "count"))
    monkeypatch.setattr(triton_launch, "_launcher_driver", lambda device: ("count", None))
    triton_verdicts.run_probe("cpu", 60, _child("import os; print('DIRECT', flush=True); os.abort()"))
    x = torch.ones(5)
    rows = torch.full((1, 8), -1, dtype=torch.int64)
    tb.forget_devices()
    try:
        assert tb.read_into([x], rows) and tb.read_into([x], rows)
        state = triton_devices.lookup("cpu")
        assert state.launcher.direct_launches == 0 and state.launcher.ordinary_launches == 2
        assert "failed its probe (the probe died of SIGABRT" in tb.launch_path(state), tb.launch_path(state)
        assert_stats_equal(_dicts(rows, [x]), [x], "through Triton")
    finally:
        tb.forget_devices()
