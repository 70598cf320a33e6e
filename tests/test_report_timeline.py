"""`overflow-fast report` on logs that carry the trainer's optimizer step and train/eval: the
timeline's unit, train and eval told apart, the three kinds of empty cells, the underflow panel's
data, the curve labels' placement; the plain and DuckDB readers agreeing on all of it. Tiny logs
written by the recorder's own functions (the writer -> both readers)."""

import json
import random

import pytest

from overflow_fast.report.engine import Logs
from overflow_fast.report.summary import (
    ALL_ZERO,
    HEADROOM,
    INTEGER_ONLY,
    NONFINITE,
    NOT_RECORDED,
    Picture,
    Summary,
    headroom,
)
from overflow_fast.report.timeline import OPTIMIZER
from overflow_fast.recording.recorder import Recorder, detection_record, entry_record
from test_report_cli import F16_MAX, int_row, row
from test_report_robust import ENGINES, both

needs_duckdb = pytest.mark.skipif("duckdb" not in ENGINES, reason="DuckDB not installed")


def trainer_run(path, with_steps=True):
    """What a Trainer with gradient accumulation 2 and evaluation every 2 optimizer steps records:
    optimizer steps 0-3 in train (two micro-batches each), evaluation at steps 2 and 4 (two
    batches each), 12 batches in all. ``h.1``'s output overflows in the first micro-batch of
    optimizer step 3: batch 8. Evaluation sees larger values (less headroom) than training, so
    an eval value in a train cell would show. ``with_steps=False``: the same run, as a loop that
    never names its steps writes it (no global_step, no mode)."""
    passes = [(0, "train"), (0, "train"), (1, "train"), (1, "train"), (2, "eval"), (2, "eval"),
              (2, "train"), (2, "train"), (3, "train"), (3, "train"), (4, "eval"), (4, "eval")]
    with Recorder(path) as recorder:
        for batch, (step, mode) in enumerate(passes):
            known = dict(global_step=step, mode=mode) if with_steps else {}
            h1 = 2.0 ** (10 + step) * (4 if mode == "eval" else 1)
            bad = batch == 8
            records = [
                entry_record(batch, "forward", 0, "emb", "Embedding", "input[0]", "int64", int_row(0, 63), **known),
                entry_record(batch, "forward", 0, "emb", "Embedding", "weight", "float16", row(0.01, 1.0), **known),
                entry_record(batch, "forward", 1, "h.0", "Block", "weight", "float16",
                             row(1e-7, 2.0, subnormal=step + 1, zero=step, numel=10), **known),
                entry_record(batch, "forward", 2, "h.1", "Block", "output", "float16",
                             row(0.1, float("inf") if bad else min(h1, F16_MAX), posinf=int(bad)), **known),
            ]
            if mode == "train":
                records.append(entry_record(batch, "backward", 3, "h.1", "Block", "weight.grad", "float16",
                                            row(1e-3, 8.0), **known))
            recorder.write(records)
            if bad:
                recorder.write([detection_record(batch, "forward", "h.1", "Block", ["output"], **known)])
    return path


def summaries(paths, **options):
    """The summary of each engine (with the picture's bins)."""
    result = []
    for engine in ENGINES:
        with Logs([[str(p) for p in paths]], engine) as logs:
            result.append(Summary(logs, bins=True, **options))
    return result


def same_picture(plain, other):
    """Everything the picture is drawn from, equal between two engines' summaries."""
    for name in ("unit", "width", "first_x", "last_x", "eval_bins", "underflow", "first_nonfinite", "eval_nonfinite",
                 "eval_best", "steps_per_column"):
        assert getattr(plain, name) == getattr(other, name), name
    assert plain.drawn == other.drawn and sorted(plain.cells, key=repr) == sorted(other.cells, key=repr)
    assert vars(Picture(plain)) == vars(Picture(other))


# -- the new fields, writer -> both readers ---------------------------------------------------------------------

def test_the_optimizer_step_and_mode_round_trip_through_both_readers(tmp_path, capsys):
    path = trainer_run(tmp_path / "run.jsonl")
    code, out, err = both(capsys, path)
    assert code == 0, err
    assert "steps recorded: 12 (first 0, last 11), the detector's batch numbers" in out
    assert "optimizer steps recorded: 5 (first 0, last 4): 4 in train, 2 in eval" in out
    assert "modes: train (40 entries), eval (16 entries)" in out
    assert ("first non-finite value: optimizer step 3 (train, batch 8), forward, module h.1 (Block), "
            "entry output [float16]: 1 +inf") in out
    assert "detection record: optimizer step 3 (train, batch 8), forward, module h.1 (Block)" in out
    evals = out.split("eval (kept apart")[1].split("closest to the dtype's limit")[0]
    assert "16 tensor entries at 2 optimizer steps (2, 4)" in evals
    # eval at step 4 saw h.1 at 2**14 * 4 -> the fp16 limit: no headroom left
    assert "lowest headroom in eval: 0.00 bits" in evals and "at optimizer step 4 (eval, batch 10)" in evals
    assert "first non-finite value in eval: none" in evals
    table = out.split("closest to the dtype's limit")[1].split("underflow hot spots")[0].splitlines()
    assert table[1].split()[4:7] == ["opt", "step", "batch"]
    assert "h.1 (Block) output (forward, eval)" in table[2] and table[2].split()[3:5] == ["4", "10"]
    assert "at optimizer step       4 (eval, batch 10)  h.0 weight" in out  # the largest fraction, first seen

    for summary in summaries([path]):
        assert summary.unit == OPTIMIZER
        assert (summary.global_steps, summary.modes) == (56, {"train": 40, "eval": 16})
        assert summary.train_steps == 4 and summary.eval_steps == [2, 4]
        first = summary.first_nonfinite
        assert (first["step"], first["global_step"], first["mode"], first["module"]) == (8, 3, "train", "h.1")
        (name, _, best), = [row for row in summary.hottest() if row[0] == "h.1"]
        assert best[6:8] == (4, "eval")  # (..., global_step, mode) of its lowest headroom


def test_old_logs_without_the_fields_read_as_before(tmp_path, capsys):
    path = trainer_run(tmp_path / "old.jsonl", with_steps=False)
    assert all("global_step" not in json.loads(line) for line in path.read_text().splitlines())
    code, out, err = both(capsys, path)
    assert code == 0, err
    assert "optimizer steps" not in out and "modes:" not in out and "eval (" not in out
    assert "first non-finite value: step 8, forward, module h.1 (Block), entry output [float16]: 1 +inf" in out
    assert f"  {'bits':>6}  {'abs max':>9}  {'dtype':<9} {'step':>7}  module / entry" in out
    for summary in summaries([path]):
        picture = Picture(summary)
        assert picture.unit == "batch" and picture.xlabel.startswith("batch number")
        assert picture.columns == list(range(12)) and picture.eval_x == []
        assert picture.first["x"] == 8 and picture.first["row"] == picture.modules.index("h.1")


# -- the timeline ----------------------------------------------------------------------------------------------

def test_the_x_axis_is_the_optimizer_step_and_eval_stays_off_the_train_cells(tmp_path):
    path = trainer_run(tmp_path / "run.jsonl")
    for summary in summaries([path]):
        picture = Picture(summary)
        assert picture.unit == OPTIMIZER and picture.xlabel.startswith("optimizer step")
        # two micro-batches per column: the label says how many steps a column holds only when more than one
        assert "a column covers" not in picture.xlabel
        assert picture.columns == [0, 1, 2, 3] and picture.centres == [0, 1, 2, 3]
        assert picture.eval_x == [2, 4]
        h1 = picture.values[picture.modules.index("h.1")]
        # train's h.1 at step s: 2**(10 + s); eval's (4x larger) is in no cell
        assert h1[:3] == [pytest.approx(headroom(F16_MAX / 2.0 ** (10 + s))) for s in range(3)]
        assert picture.kinds[picture.modules.index("h.1")][3] == NONFINITE
        assert picture.first["x"] == 3 and picture.first["row"] == picture.modules.index("h.1")
        assert "optimizer step 3 (train, batch 8)" in picture.first["text"]
    if "duckdb" in ENGINES:
        same_picture(*summaries([path]))


def test_a_nan_first_seen_in_eval_is_named_but_not_circled_in_a_train_cell(tmp_path, capsys):
    path = tmp_path / "eval.jsonl"
    with Recorder(path) as recorder:
        for batch, (step, mode) in enumerate([(0, "train"), (1, "eval"), (1, "train"), (2, "train")]):
            bad = mode == "eval"
            recorder.write([entry_record(batch, "forward", 0, "h.0", "Block", "output", "float16",
                                         row(0.1, float("nan") if bad else 100.0, nan=int(bad)),
                                         global_step=step, mode=mode)])
    code, out, _ = both(capsys, path)
    assert "first non-finite value: optimizer step 1 (eval, batch 1), forward" in out
    assert "first non-finite value in eval: optimizer step 1 (eval, batch 1), forward" in out
    for summary in summaries([path]):
        picture = Picture(summary)
        assert picture.first["x"] == 1 and picture.first["row"] is None and "eval" in picture.first["text"]
        assert NONFINITE not in picture.kinds[0]  # the train cells are all finite
        assert picture.eval_x == [1]
    if "duckdb" in ENGINES:
        same_picture(*summaries([path]))


def test_records_before_the_first_optimizer_step_are_off_the_timeline(tmp_path, capsys):
    """A log whose first batches carry no optimizer step (a forward before the trainer names its
    steps): once any record has one, the timeline is the optimizer step, and those are left off."""
    path = tmp_path / "mixed.jsonl"
    with Recorder(path) as recorder:
        for batch in range(6):
            known = dict(global_step=batch - 2, mode="train") if batch >= 2 else {}
            recorder.write([entry_record(batch, "forward", 0, "h.0", "Block", "output", "float16",
                                         row(0.1, 2.0 ** (batch + 1)), **known)])
    code, out, _ = both(capsys, path)
    assert "optimizer steps recorded: 4 (first 0, last 3): 4 in train" in out
    assert "2 tensor entries carry no optimizer step" in out
    for summary in summaries([path]):
        picture = Picture(summary)
        assert picture.columns == [0, 1, 2, 3]
        assert picture.values[0] == [pytest.approx(headroom(F16_MAX / 2.0 ** (s + 3))) for s in range(4)]
    if "duckdb" in ENGINES:
        same_picture(*summaries([path]))


def test_wide_runs_bin_optimizer_steps_and_both_readers_agree(tmp_path):
    path = tmp_path / "wide.jsonl"
    with Recorder(path) as recorder:
        batch = 0
        for step in range(300):
            for mode in ("train", "train") + (("eval",) if step % 50 == 49 else ()):
                recorder.write([
                    entry_record(batch, "forward", 0, "h.0", "Block", "output", "float16",
                                 row(0.1, 1.0 + step * (3 if mode == "eval" else 1)), global_step=step, mode=mode),
                    entry_record(batch, "forward", 1, "h.1", "Block", "weight", "float16",
                                 row(1e-7, 1.0, subnormal=step % 10, zero=step // 60), global_step=step, mode=mode)])
                batch += 1
    plain, *others = summaries([path], max_columns=20)
    assert plain.width == 8 and plain.unit == OPTIMIZER
    picture = Picture(plain)
    assert "a column covers 8 steps, up to 8 of them recorded" in picture.xlabel
    assert picture.eval_x == [(s // 8) * 8 + 3.5 for s in range(49, 300, 50)]
    assert picture.values[0][-1] == pytest.approx(headroom(F16_MAX / 300.0))  # train's, not eval's 898
    for other in others:
        same_picture(plain, other)


# -- the three kinds of empty cells --------------------------------------------------------------------------------

def empty_cells_run(path):
    """Per step 0-7: ``ids`` has only integer entries, ``gate`` only all-zero float ones, ``empty``
    an empty float tensor, ``aux`` runs on even steps only, ``mix`` has an integer input and a
    float output (headroom), ``late`` is all zero on steps 0-3 and integer on 4-7."""
    with Recorder(path) as recorder:
        for step in range(8):
            records = [
                entry_record(step, "forward", 0, "ids", "Positions", "output", "int64", int_row(0, 15)),
                entry_record(step, "forward", 0, "ids", "Positions", "mask", "bool", int_row(0, 1)),
                entry_record(step, "forward", 1, "gate", "ZeroGate", "weight", "float16", row(0.0, 0.0, zero=10)),
                entry_record(step, "forward", 2, "empty", "Slice", "output", "float32", [0] * 8),
                entry_record(step, "forward", 3, "mix", "Embedding", "input[0]", "int64", int_row(0, 9)),
                entry_record(step, "forward", 3, "mix", "Embedding", "output", "float16", row(0.5, 64.0)),
                entry_record(step, "forward", 4, "late", "Late", "output", *(
                    ("float16", row(0.0, 0.0, zero=10)) if step < 4 else ("int32", int_row(1, 2)))),
            ]
            if step % 2 == 0:
                records.append(entry_record(step, "forward", 5, "aux", "Linear", "output", "float16", row(0.5, 8.0)))
            recorder.write(records)
    return path


def test_not_recorded_all_zero_and_integer_cells_are_told_apart(tmp_path):
    path = empty_cells_run(tmp_path / "cells.jsonl")
    for summary in summaries([path]):
        picture = Picture(summary)
        kinds = dict(zip(picture.modules, picture.kinds))
        assert kinds["ids"] == [INTEGER_ONLY] * 8
        assert kinds["gate"] == [ALL_ZERO] * 8 and kinds["empty"] == [ALL_ZERO] * 8
        assert kinds["mix"] == [HEADROOM] * 8
        assert kinds["aux"] == [HEADROOM, NOT_RECORDED] * 4
        assert kinds["late"] == [ALL_ZERO] * 4 + [INTEGER_ONLY] * 4
        values = dict(zip(picture.modules, picture.values))
        assert values["gate"] == [None] * 8 and values["aux"][1] is None
    if "duckdb" in ENGINES:
        same_picture(*summaries([path]))


def test_merged_columns_keep_what_decides_a_cell(tmp_path):
    """Steps binned 4 to a column: headroom anywhere in a column wins; all zero wins over integer."""
    path = empty_cells_run(tmp_path / "cells.jsonl")
    with open(path, "a") as f:  # a far step widens the columns
        f.write(json.dumps(entry_record(40, "forward", 0, "ids", "Positions", "output", "int64", int_row(0, 1))) + "\n")
    for summary in summaries([path], max_columns=3):
        assert summary.width == 8
        picture = Picture(summary)
        kinds = dict(zip(picture.modules, picture.kinds))
        assert picture.columns == [0, 5]
        assert kinds["aux"] == [HEADROOM, NOT_RECORDED]
        assert kinds["late"] == [ALL_ZERO, NOT_RECORDED]  # zero (steps 0-3) and integer (4-7) in one column
        assert kinds["ids"] == [INTEGER_ONLY, INTEGER_ONLY]
    if "duckdb" in ENGINES:
        same_picture(*summaries([path], max_columns=3))


def test_a_column_with_headroom_anywhere_shows_it(tmp_path):
    """Steps binned 4 to a column: a ratio in one step and integers in another of the same column
    make a headroom cell; a column of integers alone an integer one."""
    path = tmp_path / "m.jsonl"
    with Recorder(path) as recorder:
        for step, dtype, amax in ((0, "int64", 1), (1, "float16", 8.0), (2, "float16", 0.0), (9, "int64", 3)):
            record = entry_record(step, "forward", 0, "m", "M", "output", "int64", int_row(0, 1))
            recorder.write([dict(record, dtype=dtype, abs_max=amax)])
    for summary in summaries([path], max_columns=2):
        picture = Picture(summary)
        assert summary.width == 4 and picture.columns == [0, 2]
        assert picture.kinds[0] == [HEADROOM, INTEGER_ONLY] and picture.values[0][0] == headroom(F16_MAX / 8.0)


# -- the underflow panel -------------------------------------------------------------------------------------------

def test_the_underflow_panel_follows_the_top_hot_spots_from_their_first_subnormal(tmp_path):
    path = trainer_run(tmp_path / "run.jsonl")
    for summary in summaries([path]):
        (key, bins), = summary.underflow  # only h.0's weight has subnormals
        assert key == ("h.0", "weight")
        # train only (eval's step 4 is not there), the largest fraction of each step's micro-batches
        assert bins == {0: (0.1, 0.0), 1: (0.2, 0.1), 2: (0.3, 0.2), 3: (0.4, 0.3)}
        (pair, xs, subs, zeros), = Picture(summary).underflow
        assert (pair, xs, subs, zeros) == (key, [0, 1, 2, 3], [0.1, 0.2, 0.3, 0.4], [0.0, 0.1, 0.2, 0.3])


def test_the_underflow_panel_draws_the_hot_spots_table_first_rows(tmp_path):
    path = tmp_path / "many.jsonl"
    with Recorder(path) as recorder:
        for step in range(10):
            recorder.write([
                entry_record(step, "forward", 0, f"m{i}", "M", "weight", "float16",
                             row(1e-7, 1.0, subnormal=(i * 7) % 10 if step >= i % 3 else 0, numel=10))
                for i in range(12)])
    for summary in summaries([path], underflow_rows=3):
        curves = summary.underflow
        assert [key for key, _ in curves] == [(row[2], row[3]) for row in summary.subnormal[:3]]
        for (module, _), bins in curves:
            i = int(module[1:])
            assert min(bins) == i % 3  # from the first subnormal on, not before
            assert all(sub == (i * 7) % 10 / 10 for sub, _ in bins.values())
    if "duckdb" in ENGINES:
        same_picture(*summaries([path], underflow_rows=3))


# -- labels at the curves' ends --------------------------------------------------------------------------------------

def _place_labels():
    pytest.importorskip("matplotlib")
    from overflow_fast.report.plot import place_labels

    return place_labels


def test_labels_apart_stay_where_they_are():
    place_labels = _place_labels()
    assert place_labels([0.1, 0.5, 0.9], 0.05, 0.0, 1.0) == [0.1, 0.5, 0.9]
    assert place_labels([], 0.05) == []


def test_overlapping_labels_are_nudged_apart_around_their_targets():
    place_labels = _place_labels()
    # three curves ending at the same height (the measured case: three of five overlapped)
    placed = place_labels([0.5, 0.5, 0.5, 0.2, 0.9], 0.1, 0.0, 1.0)
    assert placed[3] == pytest.approx(0.2) and placed[4] == pytest.approx(0.9)
    assert sorted(placed[:3]) == pytest.approx([0.4, 0.5, 0.6])  # centred on their common target
    # at the edge: pushed inside the bounds
    assert place_labels([0.0, 0.0, 0.01], 0.1, 0.0, 1.0) == pytest.approx([0.0, 0.1, 0.2])
    assert place_labels([1.0, 1.0], 0.1, 0.0, 1.0) == pytest.approx([0.9, 1.0])


def test_labels_never_overlap_and_keep_their_order():
    place_labels = _place_labels()
    rng = random.Random(7)
    for _ in range(500):
        n = rng.randint(1, 12)
        gap = rng.choice([0.01, 0.05, 0.08, 0.15])
        targets = [rng.choice([rng.random(), 0.0, 1.0, 0.5]) for _ in range(n)]
        placed = place_labels(targets, gap, 0.0, 1.0)
        order = sorted(range(n), key=lambda i: (targets[i], i))
        ys = [placed[i] for i in order]
        assert all(b - a >= gap - 1e-9 for a, b in zip(ys, ys[1:]))  # no overlap, and in the targets' order
        if (n - 1) * gap <= 1.0:
            assert all(-1e-9 <= y <= 1.0 + 1e-9 for y in ys)
        else:
            assert ys[0] == pytest.approx(0.0)  # too many for the height: they run upward from the bottom
