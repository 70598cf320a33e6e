"""`overflow-fast report` / `python -m overflow_fast report`: the summary of a recorded run, the
picture, bounded-memory binning, malformed lines, exit codes, the console script."""

import json
import math
import os
import struct
import subprocess
import sys
import warnings

import pytest

from overflow_fast import cli
from overflow_fast.report.engine import Logs, available_engines
from overflow_fast.report.logfile import check_readable
from overflow_fast.report.summary import Picture, Summary, headroom
from overflow_fast.recording.recorder import Recorder, detection_record, entry_record
from test_recorder import child_env

F16_MAX = 65504.0


def _bits(value):
    return struct.unpack("<q", struct.pack("<d", value))[0]


def row(abs_min, abs_max, nan=0, posinf=0, neginf=0, zero=0, subnormal=0, numel=10):
    return [_bits(abs_min), _bits(abs_max), nan, posinf, neginf, zero, subnormal, numel]


def int_row(abs_min, abs_max, numel=10):
    return [abs_min, abs_max, 0, 0, 0, 0, 0, numel]


def write_run(path, steps=10, rank=None, world_size=None):
    """A synthetic run: h.1's output grows toward the fp16 limit and overflows at step 8
    (forward); the model's output is nan at step 9; h.0's weight is half subnormal at step 3; h.0's
    bias is all zeros. Module order of first appearance: emb, h.0, h.1, (model)."""
    with Recorder(path, rank=rank, world_size=world_size) as recorder:
        for step in range(steps):
            h1 = min(F16_MAX, 2.0 ** (8 + step))  # headroom 16 - (8 + step) bits... until inf
            records = [
                entry_record(step, "forward", 0, "emb", "Embedding", "weight", "float32", row(0.01, 1.0), rank),
                entry_record(step, "forward", 0, "emb", "Embedding", "input[0]", "int64", int_row(0, 63), rank),
                entry_record(step, "forward", 1, "h.0", "Block", "weight", "float16",
                             row(1e-7, 2.0, subnormal=5 if step == 3 else 0), rank),
                entry_record(step, "forward", 1, "h.0", "Block", "bias", "float16", row(0.0, 0.0, zero=10), rank),
                entry_record(step, "forward", 1, "h.0", "Block", "output", "float16", row(0.5, 1000.0), rank),
            ]
            if step < 8:
                records.append(entry_record(step, "forward", 2, "h.1", "Block", "output", "float16",
                                            row(0.1, h1), rank))
            else:
                records.append(entry_record(step, "forward", 2, "h.1", "Block", "output", "float16",
                                            row(0.1, float("inf"), posinf=1), rank))
            out = float("nan") if step >= 9 else 30.0
            records.append(entry_record(step, "forward", 3, "", "Model", "output", "float16",
                                        row(0.2, out, nan=int(step >= 9)), rank))
            records.append(entry_record(step, "backward", 4, "h.0", "Block", "weight.grad", "bfloat16",
                                        row(1e-3, 4.0), rank))
            recorder.write(records)
            if step == 8:
                recorder.write([detection_record(8, "forward", "h.1", "Block", ["output"], rank)])
    return path


def report(capsys, *args):
    code = cli.main(["report", *map(str, args), "--no-progress"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_summary_names_the_first_nonfinite_module_and_orders_headroom(tmp_path, capsys):
    path = write_run(tmp_path / "run.jsonl")
    code, out, err = report(capsys, path)
    assert code == 0, err
    assert "steps recorded: 10 (first 0, last 9)" in out
    assert "forward (" in out and "backward (" in out
    assert "ranks: none" in out
    assert ("first non-finite value: step 8, forward, module h.1 (Block), entry output [float16]: 1 +inf"
            in out)
    assert "detection record: step 8, forward, module h.1 (Block)" in out
    table = out.split("closest to the dtype's limit")[1].split("underflow hot spots")[0]
    lines = [line for line in table.splitlines()[2:] if line.strip()]
    # h.1 reached 2**15 (1 - log2(65504/32768) ~ 1.0 bit), h.0 1000 (~6.03 bits), the model 30
    # (~11.1 bits), h.0 weight.grad in bfloat16 4.0 (~126 bits), emb float32 1.0 (128 bits);
    # the int64 input has no headroom
    names = [line.split()[4] for line in lines]
    assert names == ["h.1", "h.0", "(model)", "emb"]
    assert float(lines[0].split()[0]) == pytest.approx(1.0, abs=0.01)
    assert "h.1 (Block) output (forward)" in lines[0] and lines[0].split()[3] == "7"
    assert float(lines[1].split()[0]) == pytest.approx(6.03, abs=0.01)
    hot = out.split("underflow hot spots")[1]
    assert "50.00%" in hot and "h.0 weight" in hot.splitlines()[1]
    zeros = out.split("entries that are all zeros (latest first):")[1]
    assert "last at step       9  h.0 bias [float16, 10 elements]" in zeros


def test_no_nonfinite_and_rank_files(tmp_path, capsys):
    paths = [write_run(tmp_path / "run.jsonl", steps=5, rank=r, world_size=2) for r in (0, 1)]
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["run.rank0.jsonl", "run.rank1.jsonl"]
    code, out, _ = report(capsys, *(tmp_path / f for f in files))
    assert code == 0
    assert "first non-finite value: no nan/inf recorded" in out
    assert "ranks: 0, 1" in out and "flight recorder logs: 2 files" in out
    assert paths


def test_malformed_lines_are_counted_not_fatal(tmp_path, capsys):
    path = write_run(tmp_path / "run.jsonl", steps=3)
    with open(path, "a") as f:
        f.write("not json\n")
        f.write('{"record": "entry", "step": 3, "module": "x"}\n')  # fields missing
        f.write('{"record": "entry", "step": 3, "phase": "forwa')  # a cut line, no newline
    code, out, _ = report(capsys, path)
    assert code == 0
    assert "malformed lines: 3" in out and "run.jsonl:" in out
    assert "steps recorded: 3 (first 0, last 2)" in out


def test_exit_codes(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path / "missing.jsonl")]) == 1
    assert "cannot read" in capsys.readouterr().err
    junk = tmp_path / "junk.jsonl"
    junk.write_text("hello\nworld\n")
    assert cli.main(["report", str(junk)]) == 1
    assert "no flight-recorder records" in capsys.readouterr().err
    for argv in ([], ["report"], ["frobnicate", "x"], ["report", "x", "--size", "big"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        assert exit_info.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_progress_on_request(tmp_path, capsys):
    path = write_run(tmp_path / "run.jsonl", steps=3)
    assert cli.main(["report", str(path), "--progress"]) == 0
    assert "reading" in capsys.readouterr().err
    assert cli.main(["report", str(path)]) == 0  # not a terminal: no progress
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("engine", available_engines())
def test_step_bins_stay_bounded(tmp_path, engine):
    line = {"record": "entry", "phase": "forward", "call": 0, "module": "m", "class": "Linear",
            "entry": "output", "dtype": "float16", "numel": 4, "abs_min": 0.5, "nan": 0, "posinf": 0,
            "neginf": 0, "zero_frac": 0.0, "subnormal_frac": 0.0, "rank": None}
    steps = list(range(1000, 6000)) + [10]  # and one step before all others
    path = tmp_path / "wide.jsonl"
    path.write_text("".join(json.dumps(dict(line, step=step, abs_max=float(step))) + "\n" for step in steps))
    with Logs([[str(path)]], engine) as logs:
        summary = Summary(logs, bins=True, max_columns=50)
    assert summary.step_count == 5001 and (summary.first_step, summary.last_step) == (10, 5999)
    picture = Picture(summary)
    assert len(picture.columns) <= 100 and summary.width == 64  # bins aligned to multiples of the width
    # the lowest headroom of a bin is its largest value: the last bin holds step 5999
    assert picture.columns[-1] * 64 <= 5999 < picture.columns[-1] * 64 + 64
    assert picture.values[0][-1] == pytest.approx(math.log2(F16_MAX / 5999))
    assert picture.columns[0] == 0 and picture.values[0][0] == pytest.approx(math.log2(F16_MAX / 10))


def _png_size_and_colours(path):
    import matplotlib.image
    import numpy as np

    image = matplotlib.image.imread(str(path))
    rgb = (image[..., :3] * 255).astype(np.uint32).reshape(-1, 3)
    colours = np.unique(rgb[:, 0] << 16 | rgb[:, 1] << 8 | rgb[:, 2])  # one integer per colour: a flat sort
    return image.shape[1], image.shape[0], len(colours)


def test_png_has_the_requested_size_and_is_not_blank(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = write_run(tmp_path / "run.jsonl", steps=40)
    out_png = tmp_path / "out.png"
    code, out, err = report(capsys, path, "--png", out_png, "--size", "900x700")
    assert code == 0, err
    assert "picture:" in out and "900x700" in out
    width, height, colours = _png_size_and_colours(out_png)
    assert (width, height) == (900, 700)
    assert colours > 20
    # the default size (from the number of modules) too
    code, out, err = report(capsys, path, "--png", tmp_path / "default.png")
    assert code == 0, err
    width, height, colours = _png_size_and_colours(tmp_path / "default.png")
    assert width == 1400 and 400 < height < 3000 and colours > 20


@pytest.mark.parametrize("command", ["report", "diff"])
def test_clear_error_without_matplotlib(tmp_path, command):
    path = write_run(tmp_path / "run.jsonl", steps=3)
    out_png = tmp_path / "out.png"
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from overflow_fast.cli import main\n"
            "sys.exit(main(sys.argv[1:]))")
    logs = [str(path)] if command == "report" else [str(path), str(path)]
    result = subprocess.run([sys.executable, "-c", code, command, *logs, "--png", str(out_png)],
                            capture_output=True, text=True, env=child_env(), timeout=120)
    assert result.returncode == 1
    assert "pip install overflow_fast[plot]" in result.stderr and "matplotlib" in result.stderr
    assert not out_png.exists()


@pytest.mark.parametrize("engine", ["python", "duckdb"])
def test_a_log_without_tensor_entries_prints_its_summary_and_draws_nothing(tmp_path, capsys, engine):
    pytest.importorskip("matplotlib")
    if engine == "duckdb":
        pytest.importorskip("duckdb")
    path = tmp_path / "run.jsonl"
    with Recorder(path) as recorder:
        recorder.write([detection_record(2, "forward", "h.1", "Linear", ["output"])])
    out_png = tmp_path / "out.png"
    code, out, err = report(capsys, path, "--png", out_png, "--engine", engine)
    assert code == 1 and "no tensor entries to draw" in err
    assert "first non-finite" in out  # the summary itself is printed
    assert not out_png.exists()


def test_python_dash_m_and_the_console_script(tmp_path):
    path = write_run(tmp_path / "run.jsonl")
    result = subprocess.run([sys.executable, "-m", "overflow_fast", "report", str(path)],
                            capture_output=True, text=True, env=child_env(), timeout=120)
    assert result.returncode == 0, result.stderr
    assert "module h.1 (Block), entry output" in result.stdout

    script = os.path.join(os.path.dirname(sys.executable), "overflow-fast")
    assert os.path.exists(script), "overflow-fast is installed by `pip install -e .`"
    result = subprocess.run([script, "report", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "--png" in result.stdout
    result = subprocess.run([script, "report", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "module h.1 (Block), entry output" in result.stdout
    result = subprocess.run([script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "usage:" in result.stderr


@pytest.mark.parametrize("unbuffered", [True, False])
def test_a_reader_that_leaves_early_gets_no_traceback(tmp_path, unbuffered):
    import os
    import subprocess
    import sys

    path = write_run(tmp_path / "run.jsonl", steps=3)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    env.pop("PYTHONUNBUFFERED", None)
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    read, write = os.pipe()
    os.close(read)  # `overflow-fast report run.jsonl | head -0`: nobody reads
    try:
        child = subprocess.run([sys.executable, "-m", "overflow_fast", "report", str(path), "--engine", "python"],
                               stdout=write, stderr=subprocess.PIPE, text=True, env=env, timeout=300)
    finally:
        os.close(write)
    assert child.returncode == 1 and child.stderr == ""


def test_progress_of_a_compressed_log_counts_its_bytes_as_stored(tmp_path):
    import bz2
    import gzip

    class Counted:
        done = 0

        def update(self, n):
            self.done += n

    run = write_run(tmp_path / "run.jsonl", steps=40)
    for name, data in (("run.jsonl", run.read_bytes()), ("run.jsonl.gz", gzip.compress(run.read_bytes())),
                       ("run.jsonl.bz2", bz2.compress(run.read_bytes()))):
        path = tmp_path / name
        path.write_bytes(data)
        for engine in available_engines():
            progress = Counted()
            Logs([[str(path)]], engine, progress=progress).close()
            assert progress.done == len(data) == check_readable([str(path)]), (name, engine)


# -- pictures of hostile logs ----------------------------------------------------------------------------

def _long_names_run(path, name, steps=6, scale=1.0):
    """A run whose names are long: the first module's is ``name`` (its class's and entry's 5,000
    characters), and it overflows at step 4; ``scale`` its values."""
    with Recorder(path) as recorder:
        for step in range(steps):
            recorder.write([
                entry_record(step, "forward", 0, name, "C" * 5000, "output" + "E" * 5000, "float16",
                             row(0.1, float("inf") if step == 4 else 100.0 * (step + 1) * scale, posinf=int(step == 4))),
                entry_record(step, "forward", 1, "short", "Linear", "output", "float16", row(0.1, 2.0)),
            ])
    return path


def test_pictures_of_a_log_with_huge_names_cut_the_labels_and_keep_the_names_in_the_text(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from overflow_fast.report import diff as diffing
    from overflow_fast.report.text import LABEL_CHARS

    name = "layers." + "x" * (256 << 10) + ".tail"  # 256 KiB
    path = _long_names_run(tmp_path / "run.jsonl", name)
    other = _long_names_run(tmp_path / "other.jsonl", name, steps=5, scale=1.5)
    with Logs([[str(path)]], available_engines()[0]) as logs:
        picture = Picture(Summary(logs, bins=True))
    assert all(len(label) <= LABEL_CHARS for label in picture.modules)
    assert picture.modules[0].startswith("layers.xxx") and picture.modules[0].endswith("xxx.tail")
    assert all(len(line) <= 2 * LABEL_CHARS + 1 for line in picture.first["text"].splitlines())
    assert all(len(text) <= 2 * LABEL_CHARS + 4 for _, text in picture.curves)
    with Logs([[str(path)], [str(other)]], available_engines()[0]) as logs:
        drawn = diffing.Picture(diffing.Diff(logs, grid=True))
    assert all(len(label) <= LABEL_CHARS for label in drawn.labels)
    for command, logs in (("report", [path]), ("diff", [path, other])):
        png = tmp_path / f"{command}.png"
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (matplotlib says so when the labels squeeze the axes to nothing)
            assert cli.main([command, *map(str, logs), "--png", str(png), "--no-progress"]) == 0
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert name in capsys.readouterr().out  # the text keeps the whole name


# -- the command line, and pictures per dtype ------------------------------------------------------------------

def test_version_and_each_commands_own_usage_on_its_mistakes(capsys):
    from overflow_fast import __version__

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out == f"overflow-fast {__version__}\n"
    for argv, usage in ((["report", "run.jsonl", "--pgn", "x.png"], "report"), (["report", "--size", "big", "x"], "report"),
                        (["diff", "a.jsonl"], "diff"), (["replay"], "replay"), (["info", "--verbose"], "info")):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.startswith(f"usage: overflow-fast {usage} "), (argv, err)
        assert ("unrecognized arguments: --pgn x.png" in err) == ("--pgn" in argv)


@pytest.mark.parametrize("engine", available_engines())
def test_headroom_colours_are_each_dtypes_own(tmp_path, engine):
    """An autocast run: fp32 weights at 1.0 (128 bits below float32's limit) and fp16 activations at 8
    (13 bits below float16's): both far from their limits, so neither is coloured as close to it;
    an fp16 activation at 16,384 (2 bits) is. A cell holding both dtypes shows the one nearer."""
    path = tmp_path / "autocast.jsonl"
    with Recorder(path) as recorder:
        for step in range(4):
            recorder.write([
                entry_record(step, "forward", 0, "fc", "Linear", "weight", "float32", row(0.01, 1.0)),
                entry_record(step, "forward", 0, "fc", "Linear", "output", "float16", row(0.01, 8.0)),
                entry_record(step, "forward", 1, "hot", "Linear", "output", "float16", row(0.01, 16384.0)),
                entry_record(step, "forward", 2, "cool", "Linear", "weight", "float32", row(0.01, 1.0))])
    with Logs([[str(path)]], engine) as logs:
        picture = Picture(Summary(logs, bins=True))
    share = dict(zip(picture.modules, (shares[0] for shares in picture.shares)))
    bits = dict(zip(picture.modules, (values[0] for values in picture.values)))
    assert bits["fc"] == pytest.approx(math.log2(F16_MAX / 8)) and bits["cool"] == pytest.approx(128.0, abs=0.01)
    assert share["fc"] == pytest.approx(math.log2(F16_MAX / 8) / math.log2(F16_MAX))  # its fp16 output's, not fp32's
    assert share["cool"] == pytest.approx(1.0, abs=0.01) and share["fc"] > 0.75 and share["hot"] < 0.15


@pytest.mark.parametrize("engine", available_engines())
def test_an_entry_is_judged_against_the_dtype_its_call_computed_in(tmp_path, capsys, engine):
    """Under autocast a float32 weight of 81,900 is cast to float16, past its 65,504: the report's
    table, its eval line and the picture judge it against float16 (no headroom left), and say so."""
    import torch

    path = tmp_path / "autocast.jsonl"
    with Recorder(path) as recorder:
        for step in range(3):
            recorder.write([
                entry_record(step, "forward", 0, "fc", "Linear", "weight", "float32", row(0.01, 81900.0),
                             computed_in=torch.float16),
                entry_record(step, "forward", 0, "fc", "Linear", "output", "float16", row(0.01, 8.0),
                             computed_in=torch.float16),
                entry_record(step, "forward", 1, "norm", "LayerNorm", "weight", "float32", row(0.01, 81900.0)),
            ])
    code, out, err = report(capsys, path, "--engine", engine)
    table = out.split("closest to the dtype's limit")[1].splitlines()
    assert code == 0 and table[2].split()[:3] == ["0.00", "8.19e+04", "float16"], table
    assert table[2].endswith("fc (Linear) weight (forward; a float32 computed in it)")
    assert table[3].split()[2] == "float32" and "norm (LayerNorm) weight (forward)" in table[3]
    with Logs([[str(path)]], engine) as logs:
        picture = Picture(Summary(logs, bins=True))
    share = dict(zip(picture.modules, (shares[0] for shares in picture.shares)))
    assert share["fc"] == 0.0 and share["norm"] > 0.85
