"""The JSONL flight recorder: strict JSON, off-thread writes, complete lines after flush, close,
exit, SIGTERM and SIGKILL, one file per rank, write errors that never crash."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch

from overflow_fast import recorder as rec_mod
from overflow_fast.frames import Frame, entries_of, forward_items
from overflow_fast.recorder import Recorder, decode_float, entry_record, frame_records, rank_path
from overflow_fast.stats import tensor_stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _reject(constant):
    raise ValueError(f"non-strict JSON constant {constant}")


def strict_lines(path):
    """Every line of the file parsed by a strict parser; the file must end with a newline."""
    with open(path, "rb") as f:
        data = f.read()
    assert data == b"" or data.endswith(b"\n"), "partial last line"
    return [json.loads(line, parse_constant=_reject) for line in data.decode("utf-8").splitlines()]


def _rows(tensors):
    return tensor_stats(tensors, backend="torch").values.tolist()


def child_env():
    """The environment of a child whose output must really be buffered (PYTHONUNBUFFERED unset)."""
    env = dict(os.environ)
    env.pop("PYTHONUNBUFFERED", None)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


# -- records ---------------------------------------------------------------------------------------

def test_every_line_is_strict_json(tmp_path):
    nan, inf = float("nan"), float("inf")
    tensors = [
        torch.tensor([1.0, nan, 2.0], dtype=torch.float16),
        torch.tensor([inf, -inf, 3.0]),
        torch.tensor([-inf, 1.0], dtype=torch.bfloat16),
        torch.empty(0, dtype=torch.float16),
        torch.tensor([-128, 5], dtype=torch.int8),
        torch.tensor([-(2**63), 1], dtype=torch.int64),
        torch.tensor([True, False, False]),
        torch.tensor([1e-40, 0.0, 0.0, 1.0]),
        torch.tensor([3 + 4j, 0j], dtype=torch.complex64),
    ]
    rows = _rows(tensors)
    # a uint64 magnitude of 2**64 - 1 (all bits set), as the kernels store it
    rows.append([-1, -1, 0, 0, 0, 0, 0, 2])
    dtypes = [t.dtype for t in tensors] + [torch.uint64]
    path = tmp_path / "run.jsonl"
    with Recorder(path) as recorder:
        recorder.write([entry_record(7, "forward", i, "h.0.mlp", "MLP", f"input[{i}]", dtype, row, rank=None)
                        for i, (dtype, row) in enumerate(zip(dtypes, rows))])
        recorder.write([{"record": "detection", "odd": [float("nan"), float("-inf")], "dtype": torch.float16}])
    lines = strict_lines(path)
    meta, entries, detection = lines[0], lines[1:-1], lines[-1]
    assert meta["record"] == "meta" and meta["version"] == 1 and meta["pid"] == os.getpid()
    assert meta["torch"] == torch.__version__ and meta["started"].endswith("+00:00")
    assert set(meta) == {"record", "version", "rank", "world_size", "started", "pid", "torch"}
    assert len(entries) == len(dtypes)
    keys = ["record", "step", "phase", "call", "module", "class", "entry", "dtype", "numel", "abs_min", "abs_max",
            "nan", "posinf", "neginf", "zero_frac", "subnormal_frac", "rank"]
    assert all(list(e) == keys for e in entries)
    e = entries
    assert e[0]["dtype"] == "float16" and e[0]["abs_max"] == "nan" and e[0]["nan"] == 1
    assert e[1]["abs_max"] == "inf" and e[1]["abs_min"] == 3.0 and (e[1]["posinf"], e[1]["neginf"]) == (1, 1)
    assert e[2]["abs_max"] == "inf" and e[2]["neginf"] == 1 and e[2]["dtype"] == "bfloat16"
    assert e[3]["numel"] == 0 and e[3]["abs_min"] is None and e[3]["abs_max"] is None
    assert e[3]["zero_frac"] == 0.0 and e[3]["subnormal_frac"] == 0.0
    assert e[4]["abs_max"] == 128 and isinstance(e[4]["abs_max"], int) and e[4]["abs_min"] == 5
    assert e[5]["abs_max"] == 2**63 and e[5]["abs_min"] == 1
    assert e[6]["abs_max"] == 1.0 and isinstance(e[6]["abs_max"], float) and e[6]["zero_frac"] == pytest.approx(2 / 3)
    assert e[7]["subnormal_frac"] == 0.25 and e[7]["zero_frac"] == 0.5
    assert e[8]["abs_max"] == 5.0 and e[8]["dtype"] == "complex64"
    assert e[9]["abs_max"] == 2**64 - 1 and e[9]["dtype"] == "uint64"
    assert all(x["step"] == 7 and x["phase"] == "forward" and x["module"] == "h.0.mlp" and x["class"] == "MLP"
               for x in e)
    assert [x["call"] for x in e] == list(range(len(dtypes)))
    assert detection["odd"] == ["nan", "-inf"] and detection["dtype"] == "float16"
    assert decode_float("nan") != decode_float("nan") and decode_float("-inf") == float("-inf")


def test_frame_records_cover_the_tensor_entries_of_a_frame():
    linear = torch.nn.Linear(3, 2)
    x = torch.ones(1, 3)
    entries, tensors, dtypes = entries_of(forward_items(linear, (x, None), linear(x)))
    frame = Frame("fc", "Linear", entries, dtypes)
    frame.rows = _rows(tensors)
    records = frame_records(3, "forward", 5, frame, rank=2)
    assert [r["entry"] for r in records] == ["weight", "bias", "input[0]", "output"]  # None has no record
    assert all(r["call"] == 5 and r["rank"] == 2 and r["class"] == "Linear" for r in records)
    assert records[-1]["numel"] == 2


def test_global_step_and_mode_are_written_when_known_and_left_out_when_not():
    from overflow_fast import schema
    from overflow_fast.recorder import detection_record, encode_line

    linear = torch.nn.Linear(3, 2)
    x = torch.ones(1, 3)
    entries, tensors, dtypes = entries_of(forward_items(linear, (x,), linear(x)))
    frame = Frame("fc", "Linear", entries, dtypes)
    frame.rows = _rows(tensors)
    old = frame_records(8, "forward", 0, frame, None)  # the positional signature as before
    new = frame_records(8, "forward", 0, frame, None, global_step=3, mode="eval")
    assert all("global_step" not in r and "mode" not in r for r in old)
    assert all(r["global_step"] == 3 and r["mode"] == "eval" and r["step"] == 8 for r in new)
    assert list(new[0]) == list(schema.KEYS["entry"])  # the schema's order, the new fields last
    assert list(old[0]) == [k for k in schema.KEYS["entry"] if k not in schema.WHEN_KNOWN]
    train = entry_record(8, "forward", 0, "fc", "Linear", "weight", "float32", frame.rows[0], 1, 2 ** 40, "train")
    assert (train["rank"], train["global_step"], train["mode"]) == (1, 2 ** 40, "train")
    only_mode = detection_record(8, "forward", "fc", "Linear", ["output"], None, mode="eval")
    assert "global_step" not in only_mode and only_mode["mode"] == "eval"
    detection = detection_record(8, "backward", "fc", "Linear", ["weight.grad"], 0, 3, "train")
    assert list(detection) == list(schema.KEYS["detection"])
    for record in old + new + [train, only_mode, detection]:
        assert schema.check(json.loads(encode_line(record))) == record["record"]
    with pytest.raises(schema.Malformed, match="mode"):
        schema.check(dict(new[0], mode="training"))
    with pytest.raises(schema.Malformed, match="global_step"):
        schema.check(dict(new[0], global_step=2 ** 40 + 1))


def test_log_every_must_be_positive():
    with pytest.raises(ValueError):
        Recorder(os.devnull, log_every=0)


def test_should_record(tmp_path):
    with Recorder(tmp_path / "a.jsonl", log_every=100) as recorder:
        assert [s for s in range(350) if recorder.should_record(s)] == [0, 100, 200, 300]


# -- threading and durability -------------------------------------------------------------------------

class _WaitsForTheWriter:
    """Encoded through ``item()`` (as numpy scalars are). ``item()`` waits until the writing
    thread's ``write()`` has returned: if ``write()`` encoded on the calling thread, the wait could
    only end by its timeout, and the record says so. No clock is read."""

    returned = threading.Event()
    seen = []  # (thread that encoded, whether write() had returned by then)

    def item(self):
        _WaitsForTheWriter.seen.append((threading.current_thread(), _WaitsForTheWriter.returned.wait(10)))
        return 1.5


def test_write_returns_at_once_and_encodes_off_the_calling_thread(tmp_path):
    path = tmp_path / "slow.jsonl"
    _WaitsForTheWriter.seen.clear()
    _WaitsForTheWriter.returned.clear()
    recorder = Recorder(path)
    recorder.write([{"record": "entry", "value": _WaitsForTheWriter()}])
    _WaitsForTheWriter.returned.set()
    recorder.flush()
    assert len(_WaitsForTheWriter.seen) == 1
    thread, write_had_returned = _WaitsForTheWriter.seen[0]
    assert thread is not threading.current_thread() and write_had_returned
    assert strict_lines(path)[-1] == {"record": "entry", "value": 1.5}
    recorder.close()


def test_complete_after_flush_and_close(tmp_path):
    path = tmp_path / "run.jsonl"
    recorder = Recorder(path)
    for step in range(50):
        recorder.write([{"record": "entry", "step": step, "i": i} for i in range(20)])
    recorder.flush()
    assert len(strict_lines(path)) == 1 + 50 * 20
    recorder.write([{"record": "entry", "step": 50}])
    recorder.close()
    lines = strict_lines(path)
    assert len(lines) == 1 + 50 * 20 + 1 and lines[-1]["step"] == 50
    recorder.close()  # idempotent
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recorder.write([{"record": "entry"}])  # after close: warned and dropped, never raised
        recorder.write([{"record": "entry"}])
    assert len([w for w in caught if "closed" in str(w.message)]) == 1
    assert len(strict_lines(path)) == 1 + 50 * 20 + 1


def test_write_error_warns_once_and_never_raises():
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recorder = Recorder("/dev/full")
        for step in range(5):
            recorder.write([{"record": "entry", "step": step}])
            recorder.flush()
        recorder.close()
    messages = [str(w.message) for w in caught if "could not write" in str(w.message)]
    assert len(messages) == 1 and "/dev/full" in messages[0]


def test_closed_file_descriptor_warns_and_drops(tmp_path):
    recorder = Recorder(tmp_path / "x.jsonl")
    recorder.flush()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        os.close(recorder._fd)
        recorder.write([{"record": "entry"}])
        recorder.flush()
        recorder.write([{"record": "entry"}])
        recorder.flush()
    assert len([w for w in caught if "could not write" in str(w.message)]) == 1
    recorder._fd = None
    recorder.close()


_CHILD = """
import os, sys, time, signal
from overflow_fast import recorder as R
{setup}
rec = R.Recorder(sys.argv[1])
for step in range({steps}):
    rec.write([{{"record": "entry", "step": step, "i": i, "pad": "x" * 40}} for i in range(10)])
{after}
"""


def _run_child(tmp_path, steps, setup="", after="", **kwargs):
    script = textwrap.dedent(_CHILD.format(steps=steps, setup=setup, after=after))
    path = tmp_path / "child.jsonl"
    return path, subprocess.Popen([sys.executable, "-c", script, str(path)], env=child_env(),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def test_complete_after_normal_exit_of_a_child(tmp_path):
    # the writer is slowed down so records are still queued when the script ends
    setup = "_enc = R.encode_line\nR.encode_line = lambda r: (time.sleep(0.001), _enc(r))[1]"
    path, child = _run_child(tmp_path, 100, setup=setup, after="sys.stdout.write('done\\n')")
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    lines = strict_lines(path)
    assert len(lines) == 1 + 100 * 10
    assert [l["step"] for l in lines[1::10]] == list(range(100))


def test_complete_after_sigterm_of_a_child(tmp_path):
    # a slow writer: most records are still queued when SIGTERM arrives
    setup = "_enc = R.encode_line\nR.encode_line = lambda r: (time.sleep(0.002), _enc(r))[1]"
    after = "print('ready', flush=True)\ntime.sleep(60)"
    path, child = _run_child(tmp_path, 100, setup=setup, after=after)
    assert child.stdout.readline().strip() == "ready"
    child.send_signal(signal.SIGTERM)
    child.communicate(timeout=120)
    assert child.returncode == -signal.SIGTERM  # still dies of SIGTERM (the default handler's behaviour)
    lines = strict_lines(path)
    assert len(lines) == 1 + 100 * 10


def test_sigterm_chains_to_the_previous_handler(tmp_path):
    setup = ("def previous(signum, frame):\n    os.write(1, b'previous handler\\n')\n    sys.exit(7)\n"
             "signal.signal(signal.SIGTERM, previous)")
    after = "print('ready', flush=True)\ntime.sleep(60)"
    path, child = _run_child(tmp_path, 30, setup=setup, after=after)
    assert child.stdout.readline().strip() == "ready"
    child.send_signal(signal.SIGTERM)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 7 and "previous handler" in out, err
    assert len(strict_lines(path)) == 1 + 30 * 10


def test_sigkill_leaves_only_complete_lines(tmp_path):
    after = textwrap.dedent("""
    rec.flush()
    print("flushed", 20 * 10 + 1, flush=True)
    step = 20
    while True:
        rec.write([{"record": "entry", "step": step, "i": i, "pad": "y" * 200} for i in range(50)])
        step += 1
    """)
    path, child = _run_child(tmp_path, 20, after=after)
    line = child.stdout.readline().split()
    assert line[0] == "flushed"
    time.sleep(0.3)  # the writer is busy writing when the kill comes
    child.kill()
    child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL
    lines = strict_lines(path)  # no partial line, whatever the moment of the kill
    assert len(lines) >= int(line[1])
    assert lines[0]["record"] == "meta"


# -- one file per rank ------------------------------------------------------------------------------

def test_rank_paths(tmp_path, monkeypatch):
    assert rank_path("run.jsonl") == "run.jsonl"
    assert rank_path("run.jsonl", 1, 1) == "run.jsonl"
    assert rank_path("logs/run.jsonl", 1, 4) == os.path.join("logs", "run.rank1.jsonl")
    assert rank_path("logs/run", 3, 4) == os.path.join("logs", "run.rank3")
    assert rank_path("run-{rank}.jsonl", 2, 4) == "run-2.jsonl"
    assert rank_path("run-{rank}.jsonl") == "run-0.jsonl"

    with Recorder(tmp_path / "r.jsonl", rank=1, world_size=2) as recorder:
        assert recorder.path == str(tmp_path / "r.rank1.jsonl")
    meta = strict_lines(tmp_path / "r.rank1.jsonl")[0]
    assert (meta["rank"], meta["world_size"]) == (1, 2)

    # under a launcher before init_process_group: RANK / WORLD_SIZE from the environment
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with Recorder(tmp_path / "e.jsonl") as recorder:
        recorder.write([entry_record(0, "backward", 0, "", "GPT2", "weight.grad", torch.float32,
                                     _rows([torch.ones(2)])[0], rank=recorder.rank)])
    lines = strict_lines(tmp_path / "e.rank3.jsonl")
    assert lines[0]["rank"] == 3 and lines[1]["rank"] == 3 and lines[1]["phase"] == "backward"
    assert not (tmp_path / "e.jsonl").exists()


def test_records_are_not_written_twice_by_a_forked_child(tmp_path):
    if not hasattr(os, "fork"):
        pytest.skip("needs fork")
    path = tmp_path / "fork.jsonl"
    recorder = Recorder(path)
    recorder.write([{"record": "entry", "step": 0}])
    recorder.flush()
    pid = os.fork()
    if pid == 0:  # the child writes nothing and flushes nothing of the parent's
        try:
            recorder.write([{"record": "entry", "step": 99}])
            recorder.flush()
            rec_mod._close_all_at_exit()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    recorder.close()
    assert [l.get("step") for l in strict_lines(path)] == [None, 0]


def test_a_stalled_writer_drops_beyond_max_pending(tmp_path):
    path = tmp_path / "full.jsonl"
    recorder = Recorder(path, max_pending=100)
    with recorder._io_lock:  # the writer is stuck (a stalled disk)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(30):
                recorder.write([{"record": "entry", "step": step, "i": i} for i in range(10)])
        assert len([w for w in caught if "waiting for a slow disk" in str(w.message)]) == 1
    recorder.close()
    lines = strict_lines(path)
    assert 1 + 90 <= len(lines) <= 1 + 100 and lines[-1]["step"] < 10


# -- one writer per file ------------------------------------------------------------------------------

def test_a_second_recorder_on_the_same_file_is_refused_in_this_process(tmp_path):
    path = tmp_path / "run.jsonl"
    first = Recorder(path)
    first.write([{"record": "entry", "step": 0}])
    first.flush()
    with pytest.raises(rec_mod.LogInUse, match=str(path)):
        Recorder(path)
    with pytest.raises(rec_mod.LogInUse):  # the same file under another name
        Recorder(tmp_path / "." / "run.jsonl")
    first.write([{"record": "entry", "step": 1}])
    first.close()
    # the refused one cut nothing: the first writer's lines are all there
    assert [line.get("step") for line in strict_lines(path)] == [None, 0, 1]
    with Recorder(path) as again:  # released on close
        again.write([{"record": "entry", "step": 2}])
    assert [line.get("step") for line in strict_lines(path)] == [None, 2]


def test_two_detectors_with_one_log_path(tmp_path):
    from overflow_fast import DebugUnderflowOverflow

    path = tmp_path / "run.jsonl"
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    detector = DebugUnderflowOverflow(a, log=str(path))
    try:
        with pytest.raises(rec_mod.LogInUse, match="already being written"):
            DebugUnderflowOverflow(b, log=str(path))
        assert not b._forward_hooks  # refused before any hook went on
        a(torch.ones(1, 2))
    finally:
        detector.remove()


_HOLDER = """
import sys, time
from overflow_fast.recorder import Recorder
recorder = Recorder(sys.argv[1])
recorder.write([{"record": "entry", "step": 0}])
recorder.flush()
print("holding", flush=True)
sys.stdin.readline()
"""


def test_a_second_recorder_on_the_same_file_is_refused_in_another_process(tmp_path):
    path = tmp_path / "run.jsonl"
    child = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)], env=child_env(), text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == "holding"
        with pytest.raises(rec_mod.LogInUse, match=str(path)):
            Recorder(path)
        assert [line.get("step") for line in strict_lines(path)] == [None, 0]
    finally:
        child.kill()  # dies without closing: the lock goes with the process
        child.communicate(timeout=60)
    with Recorder(path) as recorder:
        recorder.write([{"record": "entry", "step": 5}])
    assert [line.get("step") for line in strict_lines(path)] == [None, 5]


def test_a_forked_child_does_not_keep_the_lock(tmp_path):
    if not hasattr(os, "fork"):
        pytest.skip("needs fork")
    path = tmp_path / "run.jsonl"
    recorder = Recorder(path)
    read, write = os.pipe()
    ready_read, ready_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a DataLoader worker that outlives the parent's recorder
        try:
            os.close(write)
            os.write(ready_write, b"r")  # running: its at-fork hook has dropped its copy of the file
            os.read(read, 1)
        finally:
            os._exit(0)
    os.close(read)
    try:
        assert os.read(ready_read, 1) == b"r"
        recorder.close()
        Recorder(path).close()  # not refused while the child still runs
    finally:
        os.close(write)
        os.waitpid(pid, 0)
        os.close(ready_read)
        os.close(ready_write)
