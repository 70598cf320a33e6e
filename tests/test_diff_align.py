"""`overflow-fast diff` on written logs: how records align (runs of different lengths, ranks,
modules and calls in one run only, logs out of step order), the tolerance, dtypes that differ, the
two engines reading every line alike, and the command line."""

import gzip
import json
import os
import random
import re

import pytest

from overflow_fast import cli
from overflow_fast.recording import schema
from overflow_fast.recording.recorder import encode_line, meta_record
from overflow_fast.report.diff import ABS_MAX, ABS_MIN, BAD, Diff, Picture
from overflow_fast.report.engine import Logs, available_engines
from overflow_fast.report.records import POSITION_BITS, parse_line

ENGINES = available_engines()


def rec(step, module, entry="output", abs_max=1.0, abs_min=0.5, rank=None, phase="forward", nan=0, posinf=0,
        dtype="float32", numel=10, call=0, **known):
    values = dict(record="entry", step=step, phase=phase, call=call, module=module, **{"class": "Linear"},
                  entry=entry, dtype=dtype, numel=numel, abs_min=abs_min, abs_max=abs_max, nan=nan, posinf=posinf,
                  neginf=0, zero_frac=0.0, subnormal_frac=0.0, rank=rank)
    values.update(known)
    return values


def write(path, records, rank=None):
    with open(path, "wb") as f:
        f.write(encode_line(meta_record(rank, None)))
        for record in records:
            f.write(encode_line(record) if isinstance(record, dict) else record)
    return str(path)


def steps_of(steps, modules=("embed", "h.0", "h.1", "head"), scale=lambda step, module: 1.0, **kw):
    """Every step's records of ``modules`` (weight and output each), in order."""
    out = []
    for step in steps:
        for call, module in enumerate(modules):
            for entry in ("weight", "output"):
                out.append(rec(step, module, entry, abs_max=2.0 * scale(step, module), call=call, **kw))
    return out


def run(path_a, path_b, engine=ENGINES[0], **options):
    with Logs([[path_a], [path_b]], engine) as logs:
        return Diff(logs, **options)


def first_of(diff):
    if diff.first is None:
        return None
    a, _, _, field = diff.first
    return a["step"], a["module"], a["entry"], field


def largest(diff):
    """{module: (divergence, the step it first parted at)}"""
    return {row[0]: (row[1], row[5] and row[5]["step"]) for row in diff.largest}


# -- alignment -----------------------------------------------------------------------------------

def test_the_first_parting_is_the_earliest_step_then_the_order_of_a(tmp_path):
    drift = lambda step, module: 1.5 if (module == "h.1" and step >= 4) or (module == "head" and step >= 6) else 1.0
    a = write(tmp_path / "a.jsonl", steps_of(range(10)))
    b = write(tmp_path / "b.jsonl", steps_of(range(10), scale=drift))
    diff = run(a, b)
    assert first_of(diff) == (4, "h.1", "weight", ABS_MAX)
    assert diff.pairs == 80 and diff.parted == 6 * 2 + 4 * 2
    rows = largest(diff)
    assert set(rows) == {"h.1", "head"} and rows["h.1"][1] == 4 and rows["head"][1] == 6
    assert abs(rows["h.1"][0] - 1 / 3) < 1e-12  # |2 - 3| / 3


def test_runs_of_different_lengths_and_log_every_name_the_steps_one_run_only_has(tmp_path):
    a = write(tmp_path / "a.jsonl", steps_of(range(10)))
    b = write(tmp_path / "b.jsonl", steps_of(range(0, 6, 2)))  # log_every=2, and it stopped at step 5
    diff = run(a, b)
    assert diff.pairs == 3 * 8 and diff.first is None
    side_a, side_b = diff.sides
    assert side_a.only == 7 * 8 and side_b.only == 0
    assert side_a.only_steps[:2] == (56, 7) and not side_a.only_modules and not side_a.only_other
    text = diff.text()
    assert "steps B did not record: 1, 3, 5, 6, 7, 8, 9 (7 steps, 56 entries)" in text and "in B only: nothing" in text
    c = write(tmp_path / "c.jsonl", steps_of(range(20)))  # many: a range, its count said as one
    assert "steps A did not record: 10 to 19 (10 steps, 80 entries)" in run(a, c).text()


def test_modules_in_one_run_only_are_named_apart_and_the_rest_aligns(tmp_path):
    a = write(tmp_path / "a.jsonl", steps_of(range(5), modules=("embed", "h.0", "extra", "h.1", "head")))
    b = write(tmp_path / "b.jsonl", steps_of(range(5), modules=("embed", "h.0", "h.1", "head", "new")))
    diff = run(a, b)
    assert diff.pairs == 5 * 4 * 2 and diff.first is None
    side_a, side_b = diff.sides
    assert side_a.only_modules == [("extra", "Linear", 10)] and side_a.only_other == 0 and not side_a.only_steps[0]
    assert side_b.only_modules == [("new", "Linear", 10)] and side_b.only_other == 0
    text = diff.text()
    assert "modules B did not record (1 module): extra (Linear, 10 entries)" in text
    assert "modules A did not record (1 module): new (Linear, 10 entries)" in text


def test_a_module_called_twice_aligns_call_by_call(tmp_path):
    """The k-th record of a key in A with the k-th in B: a second call in A only is one-sided."""
    def calls(twice, grow=1.0):
        out = []
        for step in range(4):
            out.append(rec(step, "shared", "output", abs_max=1.0))
            if twice:
                out.append(rec(step, "shared", "output", abs_max=3.0 * grow))
            out.append(rec(step, "head", "output", abs_max=5.0))
        return out
    a = write(tmp_path / "a.jsonl", calls(twice=True))
    b = write(tmp_path / "b.jsonl", calls(twice=False))
    diff = run(a, b)
    assert diff.pairs == 8 and diff.first is None  # the first calls pair with the first calls
    assert diff.sides[0].only_other == 4 and [e["step"] for e in diff.sides[0].only_examples] == [0, 1, 2, 3]
    assert [e["line"] for e in diff.sides[0].only_examples] == [3, 6, 9, 12]
    c = write(tmp_path / "c.jsonl", calls(twice=True, grow=2.0))
    diff = run(a, c)
    assert diff.pairs == 12 and first_of(diff) == (0, "shared", "output", ABS_MAX)
    assert diff.first[0]["amax"] == 3.0  # the second call, not the first


def test_ranks_align_rank_by_rank_and_a_rank_in_one_run_only_is_named(tmp_path):
    # A: two ranks interleaved in one stream; B: rank 0 only, whose step 3 parts
    a_records, b_records = [], []
    for step in range(4):
        for rank in (0, 1):
            a_records += steps_of([step], rank=rank, modules=("h.0", "h.1"))
        b_records += steps_of([step], rank=0, modules=("h.0", "h.1"), scale=lambda s, m: 2.0 if s == 3 else 1.0)
    a = write(tmp_path / "a.jsonl", a_records)
    b = write(tmp_path / "b.jsonl", b_records)
    diff = run(a, b)
    assert diff.pairs == 16 and first_of(diff) == (3, "h.0", "weight", ABS_MAX)
    assert diff.sides[0].only_ranks == {1: 16} and not diff.sides[0].only_steps[0]
    text = diff.text()
    assert "ranks B did not record: 1 (1 rank, 16 entries)" in text and "rank 0, module h.0" in text


def test_a_log_without_ranks_is_rank_0(tmp_path):
    a = write(tmp_path / "a.jsonl", steps_of(range(3)))
    b = write(tmp_path / "b.jsonl", steps_of(range(3), rank=0))
    diff = run(a, b)
    assert diff.pairs == 24 and not diff.sides[0].only and not diff.sides[1].only


def test_a_nan_in_one_run_only_parts_whatever_the_tolerance(tmp_path):
    a = write(tmp_path / "a.jsonl", steps_of(range(4)))
    b_records = steps_of(range(4))
    b_records[13] = rec(1, "h.1", "output", abs_max="nan", abs_min="nan", nan=3, call=2)
    b = write(tmp_path / "b.jsonl", b_records)
    diff = run(a, b, rtol=1e9)
    assert first_of(diff) == (1, "h.1", "output", BAD)
    assert "a nan/inf in B only" in diff.text()
    both = write(tmp_path / "both.jsonl", b_records)
    assert run(b, both).first is None  # a nan in both runs: they agree


@pytest.mark.parametrize("engine", ENGINES)
def test_the_tolerance_is_relative_to_the_larger_and_atol_a_floor(tmp_path, engine):
    def divergence(a, b, **options):
        """(value, field) of one pair of records with these fields."""
        path_a = write(tmp_path / "a.jsonl", [b'{"record":"entry","step":0,"phase":"forward","call":0,"module":"m",'
                                              b'"class":"L","entry":"o","dtype":"float32","numel":10,' + a + b'}\n'])
        path_b = write(tmp_path / "b.jsonl", [b'{"record":"entry","step":0,"phase":"forward","call":0,"module":"m",'
                                              b'"class":"L","entry":"o","dtype":"float32","numel":10,' + b + b'}\n'])
        diff = run(path_a, path_b, engine, rtol=0.0, **options)
        return (0.0, None) if not diff.largest else (diff.largest[0][1], diff.largest[0][2])

    def fields(abs_max, abs_min=b"0.5", posinf=b"0"):
        return (b'"abs_min":' + abs_min + b',"abs_max":' + abs_max + b',"nan":0,"posinf":' + posinf +
                b',"neginf":0,"zero_frac":0.0,"subnormal_frac":0.0')

    assert divergence(fields(b"1.0"), fields(b"1")) == (0.0, None)  # the same number, written two ways
    assert divergence(fields(b"2.0"), fields(b"1.0")) == (0.5, ABS_MAX)
    assert divergence(fields(b"1.0", b"1e-9"), fields(b"1.0", b"0.0")) == (1.0, ABS_MIN)
    assert divergence(fields(b"1.0", b"1e-9"), fields(b"1.0", b"0.0"), atol=1e-6) == (0.0, None)
    assert divergence(fields(b"1.0", b"1e-9"), fields(b"2.0", b"0.0"), stat="abs_max") == (0.5, ABS_MAX)
    assert divergence(fields(b'"inf"', posinf=b"1"), fields(b"3.0"))[1] == BAD
    assert divergence(fields(b'"inf"', posinf=b"1"), fields(b'"nan"', posinf=b"1")) == (0.0, None)
    assert divergence(fields(b"null", b"null"), fields(b"1.0")) == (0.0, None)  # an empty tensor: counted apart
    assert divergence(fields(b"1.0", b'"nan"'), fields(b"1.0", b"0.5")) == (float("inf"), ABS_MIN)


def test_a_pair_exactly_at_the_tolerance_does_not_part(tmp_path):
    a = write(tmp_path / "a.jsonl", [rec(0, "m", abs_max=1.0), rec(1, "m", abs_max=1.0)])
    b = write(tmp_path / "b.jsonl", [rec(0, "m", abs_max=0.75), rec(1, "m", abs_max=0.7)])
    diff = run(a, b, rtol=0.25)
    assert first_of(diff) == (1, "m", "output", ABS_MAX) and diff.parted == 1


def test_dtype_and_element_counts_that_differ_are_counted(tmp_path):
    a = write(tmp_path / "a.jsonl", [rec(0, "m", dtype="float32", numel=10), rec(1, "m", numel=10)])
    b = write(tmp_path / "b.jsonl", [rec(0, "m", dtype="bfloat16", numel=10), rec(1, "m", numel=12)])
    text = run(a, b).text()
    assert "dtype differs in 1 pairs (first: step 0, m output: float32 in A, bfloat16 in B)" in text
    assert "element count differs in 1 pairs (first: step 1, m output: 10 in A, 12 in B)" in text


def test_runs_of_other_dtypes_compare_abs_max_only_and_say_so(tmp_path):
    """fp32 against a run partly in fp16: abs min, which rounding and underflow move (in the fp16
    tensors and in everything computed from them), is not compared unless asked for; abs max is."""
    a = write(tmp_path / "a.jsonl", [rec(s, m, abs_min=1e-6, abs_max=2.0 + (s == 3 and m == "late"))
                                     for s in range(5) for m in ("early", "late", "head")])
    b = write(tmp_path / "b.jsonl", [rec(s, m, abs_min=0.0 if m != "head" else 1e-7, abs_max=2.0,
                                         dtype="float32" if m == "head" else "float16")
                                     for s in range(5) for m in ("early", "late", "head")])
    diff = run(a, b)
    assert diff.compared == "abs_max" and first_of(diff) == (3, "late", "output", ABS_MAX)
    assert [row[0] for row in diff.largest] == ["late"] and largest(diff)["late"] == (pytest.approx(1 / 3), 3)
    text = diff.text()
    assert "they part where abs max differs by more than rtol" in text
    assert "dtype differs in 10 pairs (first: step 0, early output: float32 in A, float16 in B); so abs max only " \
           "is compared" in text
    with Logs([[a], [b]], ENGINES[0]) as logs:
        picture = Picture(Diff(logs, grid=True))
    assert picture.title.startswith("Where two runs part: divergence of abs max per module and step")
    assert "the runs' dtypes differ: abs min is not compared" in picture.explained
    asked = run(a, b, stat="abs_min")  # asked for: compared
    assert asked.compared == "abs_min" and first_of(asked) == (0, "early", "output", ABS_MIN)


def test_logs_out_of_step_order_align_as_whole_logs(tmp_path):
    records = steps_of(range(6))
    a = write(tmp_path / "a.jsonl", records)
    b = write(tmp_path / "b.jsonl", records[:16] + records[24:32] + records[16:24] + records[32:])  # 3 before 2
    diff = run(a, b)
    assert diff.pairs == 48 and diff.first is None and not diff.sides[0].only and not diff.sides[1].only
    c = write(tmp_path / "c.jsonl", steps_of([0], modules=[f"m{i}" for i in reversed(range(50))]))
    d = write(tmp_path / "d.jsonl", steps_of([0], modules=[f"m{i}" for i in range(50)]))
    assert run(c, d).pairs == 100  # reversed within a step: every record finds its partner


def test_a_module_in_one_run_only_leaves_the_rest_aligned(tmp_path):
    a = write(tmp_path / "a.jsonl", steps_of(range(300), modules=("embed", "h.0", "extra", "h.1", "head")))
    b = write(tmp_path / "b.jsonl", steps_of(range(300), modules=("embed", "h.0", "h.1", "head")))
    diff = run(a, b)
    assert diff.pairs == 300 * 8 and diff.sides[0].only_modules == [("extra", "Linear", 600)]


def test_the_module_table_is_the_largest_divergences_and_counts_the_rest(tmp_path):
    modules = [f"m{i}" for i in range(40)]
    grow = lambda step, module: 1.0 + int(module[1:]) / 100 * (1 + step)
    a = write(tmp_path / "a.jsonl", steps_of(range(3), modules=modules))
    b = write(tmp_path / "b.jsonl", steps_of(range(3), modules=modules, scale=grow))
    diff = run(a, b)
    assert [row[0] for row in diff.largest[:3]] == ["m39", "m38", "m37"] and diff.differing == 39
    assert "... and 29 more modules that differ" in diff.text()
    a = write(tmp_path / "a5.jsonl", [rec(0, f"n{i}") for i in range(5)])
    b = write(tmp_path / "b5.jsonl", [rec(0, f"n{i}", abs_max=1.0 + i) for i in range(5)])
    assert [row[0] for row in run(a, b).largest[:2]] == ["n4", "n3"]


def _random_run(rng, steps, ranks, modules):
    """A log in step order for each rank: per step, each rank's records (some left out, some extra,
    a module called twice, neighbours swapped), ranks interleaved step by step."""
    records = []
    for step in steps:
        for rank in rng.sample(ranks, len(ranks)):
            chosen = [m for m in modules if rng.random() < 0.85] + [f"x{rng.randrange(3)}"] * (rng.random() < 0.2)
            for _ in range(2):
                if chosen and rng.random() < 0.3:
                    chosen.insert(rng.randrange(len(chosen)), rng.choice(chosen))
            for i in range(len(chosen) - 1):
                if rng.random() < 0.1:
                    chosen[i], chosen[i + 1] = chosen[i + 1], chosen[i]
            for module in chosen:
                nan = int(rng.random() < 0.03)
                records.append(rec(step, module, "output", rank=rank, nan=nan,
                                   abs_max="nan" if nan else rng.choice([1.0, 1.0, 1.0, 1.5, 4.0]),
                                   phase="backward" if module.endswith("3") else "forward"))
    if rng.random() < 0.3:  # and a log not in step order
        rng.shuffle(records)
    return records


def _by_brute_force(a_records, b_records, rtol):
    """(pairs, parted, (step, rank, line in A) of the first parting, A only, B only): the k-th
    record of each key in A with the k-th in B, over the whole logs."""
    def keyed(records):
        groups = {}
        for line, r in enumerate(records, start=2):  # after the meta line
            groups.setdefault((r["rank"] or 0, r["step"], r["phase"], r["module"], r["entry"]), []).append((line, r))
        return groups
    ga, gb = keyed(a_records), keyed(b_records)
    pairs = set()
    parted = 0
    first = None
    for key in set(ga) | set(gb):
        for (line, x), (line_b, y) in zip(ga.get(key, []), gb.get(key, [])):
            pairs.add((line, line_b))
            if bool(x["nan"]) != bool(y["nan"]):
                value = float("inf")
            elif x["nan"]:
                value = 0.0
            else:
                value = abs(x["abs_max"] - y["abs_max"]) / max(x["abs_max"], y["abs_max"])
            if value > rtol:
                parted += 1
                order = (key[1], key[0], line)
                first = order if first is None or order < first else first
    return pairs, parted, first, len(a_records) - len(pairs), len(b_records) - len(pairs)


def test_a_repeated_key_pairs_by_occurrence_where_the_logs_differ(tmp_path):
    a = write(tmp_path / "a.jsonl", [rec(0, "k", abs_max=1.0), rec(0, "x"), rec(0, "k", abs_max=3.0)])
    b = write(tmp_path / "b.jsonl", [rec(0, "x"), rec(0, "k", abs_max=1.0), rec(0, "k", abs_max=3.0)])
    diff = run(a, b)
    assert diff.pairs == 3 and diff.first is None and not diff.sides[0].only and not diff.sides[1].only


@pytest.mark.parametrize("engine", ENGINES + ("python without FULL JOIN",))
def test_the_alignment_is_the_whole_logs_alignment(tmp_path, engine):
    """Random pairs of logs (steps and ranks in one run only, records left out, added, repeated,
    swapped within a step, shuffled): the diff pairs exactly what aligning the whole logs at once
    pairs."""
    rng = random.Random(3)
    mask = (1 << POSITION_BITS) - 1
    for case in range(40):
        pool = list(range(12))
        modules = [f"m{i}" for i in range(rng.randrange(1, 6))]
        runs = []
        for _ in range(2):
            steps = sorted(rng.sample(pool, rng.randrange(1, 9)))
            ranks = rng.sample([None, 1, 2], rng.randrange(1, 3))
            runs.append(_random_run(rng, steps, ranks, modules))
        a = write(tmp_path / f"a{case}.jsonl", runs[0])
        b = write(tmp_path / f"b{case}.jsonl", runs[1])
        with Logs([[a], [b]], engine.split()[0]) as logs:
            logs.full_join = logs.full_join and "without" not in engine  # as sqlite before 3.39
            diff = Diff(logs, rtol=0.1, stat="abs_max")
            lines = {(apos & mask, bpos & mask) for apos, bpos in logs.rows("SELECT apos, bpos FROM pairs")}
        first = None if diff.first is None else (diff.first[0]["step"], diff.first[0]["rank"] or 0,
                                                 diff.first[0]["line"])
        got = (lines, diff.parted, first, diff.sides[0].only, diff.sides[1].only)
        assert got == _by_brute_force(runs[0], runs[1], 0.1), case
        for side in diff.sides:
            assert side.only == (sum(side.only_ranks.values()) + side.only_steps[0] + side.only_other
                                 + (sum(n for _, _, n in side.only_modules) if side.only_module_count <= 5 else 0)
                                 ) or side.only_module_count > 5


def test_the_pictures_columns_stay_few(tmp_path):
    rng = random.Random(5)
    records = sorted((rec(step, f"m{rng.randrange(6)}", abs_max=rng.choice([1.0, 1.2])) for step in
                      rng.sample(range(5000), 600)), key=lambda r: r["step"])
    a = write(tmp_path / "a.jsonl", records)
    b = write(tmp_path / "b.jsonl", [dict(r, abs_max=1.0) for r in records])
    with Logs([[a], [b]], ENGINES[0]) as logs:
        diff = Diff(logs, grid=True)
    picture = Picture(diff)
    assert diff.width & (diff.width - 1) == 0 and 0 < len(picture.columns) < 400
    assert diff.width == 16  # the smallest power of two that fits [0, 5000) in fewer than 400 columns


# -- reading ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("engine", ENGINES)
def test_malformed_lines_are_named_and_compressed_logs_read(tmp_path, engine):
    records = steps_of(range(3))
    lines = [encode_line(r) for r in records]
    lines[2] = b'{"record": "entry", "step": 0}\n'
    lines[5] = b"not json\n"
    a = write(tmp_path / "a.jsonl", records)
    with gzip.open(tmp_path / "b.jsonl.gz", "wb") as f:
        f.write(b"".join(lines))
    diff = run(a, str(tmp_path / "b.jsonl.gz"), engine)
    notes = diff.sides[1].notes
    assert notes.malformed == 2 and [line[1:] for line in notes.malformed_lines] == [(3, "phase missing"),
                                                                                     (6, "not JSON")]
    assert diff.pairs == 22 and diff.sides[0].only_other == 2
    assert "malformed lines skipped: 2 (first: line 3 (phase missing), 6 (not JSON))" in diff.text()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_cut_gzip_log_is_read_up_to_the_cut(tmp_path, engine):
    records = steps_of(range(40))
    a = write(tmp_path / "a.jsonl", records)
    data = gzip.compress(b"".join(encode_line(r) for r in records))
    (tmp_path / "cut.gz").write_bytes(data[:len(data) // 2])
    diff = run(a, str(tmp_path / "cut.gz"), engine)
    notes = diff.sides[1].notes
    assert notes.malformed == 1 and "ends early" in notes.malformed_lines[0][2] and 0 < diff.pairs < len(records)
    assert diff.first is None and diff.sides[0].only_steps[0]


def _line(rng):
    """A record as JSON, most often valid, with values at and beyond the schema's limits."""
    def pick(usual, edges):
        return rng.choice(edges) if rng.random() < 0.15 else usual

    def magnitude_value():
        kind = rng.randrange(4)
        if kind == 0:
            return rng.randrange(0, 2 ** 64)  # an integer dtype's
        if kind == 1:
            return rng.uniform(0, 10) * 10.0 ** rng.randrange(-320, 300)
        return pick(rng.uniform(0, 1e4), [0, 0.0, -0.0, "nan", "inf", "-inf", None, -1.0, 1e308, "NaN", True])

    record = rec(pick(rng.randrange(0, 10 ** 6), [0, 2 ** 40, 2 ** 40 + 1, 10 ** 12 - 1, 10 ** 12, -1, 1.0]),
                 pick("h.0.attn", ["", "a\u00e9b", 'q"x', "tab\tname", "back\\slash", 7, None]),
                 pick("output[0]", ["weight", "input[loss].grad", "\ud800"]),
                 abs_max=magnitude_value(), abs_min=magnitude_value(),
                 rank=pick(None, [0, 3, 2 ** 20 - 1, 2 ** 20, -1, "0"]),
                 phase=pick("forward", ["backward", "sideways"]),
                 nan=pick(0, [1, 2 ** 63 - 1, 2 ** 63, -1, False]), numel=pick(4096, [0, 10 ** 18, 2 ** 63]),
                 call=pick(3, [0, 2 ** 63]), dtype=pick("float32", ["bfloat16", 3]))
    record["zero_frac"] = pick(0.0, [1, 1.0, 0.5, 1e-05, 1.0000001, -0.0, 2, "0"])
    record["subnormal_frac"] = pick(0.25, [0, 5e-324, 9.999e-1, 1e-300])
    if rng.random() < 0.3:
        record["global_step"] = pick(rng.randrange(0, 10 ** 6), [2 ** 40, 2 ** 40 + 1, None, -3])
    if rng.random() < 0.3:
        record["mode"] = pick("train", ["eval", "test", None])
    if rng.random() < 0.05:
        del record[rng.choice(list(record))]
    return json.dumps(record, separators=pick((",", ":"), [(", ", ": ")]), ensure_ascii=rng.random() < 0.5)


def _mutated(line, rng, alphabet):
    at = rng.randrange(len(line))
    return line[:at] + bytes([rng.choice(alphabet)]) + line[at + 1:]


NUMBER_TEXTS = ["0", "00", "01", "7", "0.5", ".5", "1.", "1.0", "1.00", "1.5", "2", "10", "1e5", "1E5", "1e+5", "1e+05",
                "1e+123", "1e-5", "1e-005", "1e-1234", "1e-", "5e-007", "0e-5", "2.5e-3", "12345678901234567890",
                "-1", "-0.0", "-0", '"nan"', '"inf"', '"-inf"', '"Inf"', "null", "NaN", "inf", '""', "true", "0x1"]
INT_TEXTS = ["0", "00", "01", "9", "123456", "1099511627776", "1099511627777", "9223372036854775807",
             "9223372036854775808", "-1", "-0", "1.0", "1e3", "null", '"1"', ""]
TEXT_TEXTS = ['""', '"h.0"', '"forward"', '"backward"', '"train"', '"eval"', '"test"', '"Forward"', '"a\\"b"',
              '"\\u00e9"', '"\u00e9"', '"\u2028"', '"\x7f"', '"tab\tx"', '"\\ud800"', '"\\/"', "null", '"x', "7"]


def _replaced(line, name, text):
    """``line`` with the value of its field ``name`` written as ``text``."""
    head, _, rest = line.partition(f'"{name}":')
    value_end = min([i for i in (rest.find(',"'), rest.rfind("}")) if i >= 0])
    return head + f'"{name}":' + text + rest[value_end:]


def _hostile_lines(rng, count):
    """Random records, the same with a byte changed, and recorder lines with values of every form."""
    alphabet = b'0123456789.eE+-",:{}[]nulltrueabc \\\x00\x1f\x7f\xc3\xa9\xff\r\x0c\t'
    lines = []
    for _ in range(count):
        line = _line(rng).encode("utf-8", "surrogatepass")
        lines += [line, _mutated(line, rng, alphabet)]
        template = encode_line(rec(rng.randrange(10 ** 6), "h.0.attn", global_step=rng.randrange(100), mode="train",
                                   computed_in=rng.choice(["float16", "bfloat16", "int8"]))).rstrip(b"\n").decode()
        field = rng.choice(schema.RECORDS["entry"])
        texts = {"int": INT_TEXTS, "abs": NUMBER_TEXTS, "frac": NUMBER_TEXTS}.get(field.kind, TEXT_TEXTS)
        lines.append(_replaced(template, field.name, rng.choice(texts)).encode("utf-8", "surrogatepass"))
    return [line.replace(b"\n", b" ") for line in lines]


@pytest.mark.skipif("duckdb" not in ENGINES, reason="DuckDB not installed")
def test_duckdb_takes_the_lines_the_json_reader_takes_and_reads_them_alike(tmp_path):
    """Thousands of hostile lines: DuckDB's checks in SQL and the json reader make the same entries
    table, value for value, and name the same malformed lines for the same reasons."""
    lines = _hostile_lines(random.Random(11), 1500)
    path = tmp_path / "hostile.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    tables = []
    for engine in ("duckdb", "python"):
        with Logs([[str(path)]], engine) as logs:
            rows = logs.rows("SELECT log, file, pos, line, step, phase, module, cls, entry, dtype, numel, amin, amin_s, "
                             "amax, amax_s, nan, posinf, neginf, zf, sf, rank, gstep, mode, computed_in, bad, fmax, "
                             "ratio "
                             "FROM entries ORDER BY pos")
            tables.append((rows, vars(logs.notes[0])))
    assert tables[0] == tables[1]
    taken = len(tables[0][0])
    assert taken > 1000 and tables[0][1]["malformed"] > 2000, taken  # both kinds of line were there
    valid = sum(1 for line in lines if _kind(line) == "entry")
    assert taken == valid


def _kind(line):
    try:
        return parse_line(line)[0]
    except schema.Malformed:
        return None


@pytest.mark.parametrize("engine", ENGINES)
def test_the_same_entries_whatever_the_form_of_a_line(tmp_path, engine):
    records = steps_of(range(3))
    spaced = [json.dumps(r).encode() + b"\n" for r in records]  # spaces
    mixed = [encode_line(r) for r in records]
    mixed[3] = mixed[3].replace(b"\n", b"\r\n")
    mixed[7:7] = [b"\n", b"   \n", b'{"record":"detection","step":1,"phase":"forward","module":"m","class":"C",'
                  b'"entries":["output"],"rank":null}\n']
    paths = [write(tmp_path / "a.jsonl", records), write(tmp_path / "b.jsonl", spaced),
             write(tmp_path / "c.jsonl", mixed)]
    diff = run(paths[0], paths[1], engine, rtol=0.0)
    assert diff.pairs == 24 and diff.first is None and not diff.largest
    diff = run(paths[0], paths[2], engine, rtol=0.0)
    assert diff.pairs == 24 and diff.first is None and not diff.largest
    notes = diff.sides[1].notes
    assert notes.detection_count == 1 and notes.detections[0]["line"] == 11 and notes.malformed == 0
    b = write(tmp_path / "d.jsonl", mixed[:20] + [encode_line(rec(2, "embed", "extra"))])
    diff = run(paths[0], b, engine)
    assert [e["line"] for e in diff.sides[1].only_examples] == [22]  # its line, blank lines counted


def test_the_command_line(tmp_path, capsys):
    a = write(tmp_path / "a.jsonl", steps_of(range(3)))
    b = write(tmp_path / "b.jsonl", steps_of(range(3), scale=lambda s, m: 1.1 if s == 2 else 1.0))
    assert cli.main(["diff", a, b, "--rtol", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "first parting: step 2, forward, module embed (Linear), entry weight" in out
    assert cli.main(["diff", a, b, "--rtol", "0.2"]) == 0
    assert "first parting: none" in capsys.readouterr().out
    assert cli.main(["diff", a, str(tmp_path / "missing.jsonl")]) == 1
    assert "cannot read" in capsys.readouterr().err
    empty = write(tmp_path / "empty.jsonl", [])
    for logs in ([a, empty], [empty, empty]):
        assert cli.main(["diff", *logs, "--png", str(tmp_path / "d.png")]) == 1
        assert "no tensor entries in" in capsys.readouterr().err and not os.path.exists(tmp_path / "d.png")
    for bad in (["--rtol", "-1"], ["--rtol", "nan"], ["--jobs", "0"], ["--stat", "mean"], ["--pgn", "x.png"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["diff", a, b, *bad])
        assert exit_info.value.code == 2
        assert re.search(r"^usage: overflow-fast diff ", capsys.readouterr().err, re.M)  # the command's own usage
    texts = []
    for engine in ENGINES:
        assert cli.main(["diff", a, b, "--engine", engine, "--jobs", "1"]) == 0
        texts.append(capsys.readouterr().out)
    assert len(set(texts)) == 1


def test_the_picture_says_what_it_draws_in_optimizer_steps_where_the_logs_know_them(tmp_path, capsys):
    """With the trainer's steps in the records, the text, the x axis and the first parting's mark all
    speak of optimizer steps; the title names the statistics compared."""
    known = lambda step: dict(global_step=step // 2, mode="train")  # gradient accumulation 2
    a = write(tmp_path / "a.jsonl", [rec(s, m, abs_max=2.0, **known(s)) for s in range(8) for m in ("h.0", "h.1")])
    b = write(tmp_path / "b.jsonl", [rec(s, m, abs_max=2.0 + (s >= 5 and m == "h.1"), **known(s))
                                     for s in range(8) for m in ("h.0", "h.1")])
    with Logs([[a], [b]], ENGINES[0]) as logs:
        diff = Diff(logs, grid=True, stat="abs_max")
    picture = Picture(diff)
    assert picture.xlabel.startswith("optimizer step") and picture.title == (
        "Where two runs part: divergence of abs max per module and optimizer step")
    assert picture.first["x"] == 2 and picture.first["row"] == picture.modules.index("h.1")
    assert picture.columns == [0, 1, 2, 3] and "optimizer step 2 (train, batch 5)" in picture.first["text"]
    assert "first parting: optimizer step 2 (train, batch 5), forward, module h.1" in diff.text()
    assert cli.main(["diff", a, b, "--png", str(tmp_path / "d.png"), "--no-progress"]) == 0


def test_counts_in_the_text_never_read_as_steps(tmp_path):
    a = write(tmp_path / "a.jsonl", steps_of(range(40), rank=0) + steps_of(range(3), rank=1))
    b = write(tmp_path / "b.jsonl", steps_of([0, 1, 2, 3, 36, 37, 38, 39], rank=0))
    text = run(a, b).text()
    assert "steps B did not record: 4 to 35 (32 steps, 256 entries)" in text
    assert "ranks B did not record: 1 (1 rank, 24 entries)" in text
    c = write(tmp_path / "c.jsonl", steps_of([0, 1, 2, 3, 4, 36, 37, 38, 39], rank=0) + steps_of(range(3), rank=1))
    assert "steps A did not record: 4 (1 step, 8 entries)" in run(b, c).text()
