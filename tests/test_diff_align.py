"""`overflow-fast diff` on written logs: how records align (runs of different lengths, ranks,
modules and calls in one run only, out-of-order logs, the bounded window), the tolerance, the
fast line reader against the schema's parser, its C twin against it, and a diff in parts against one
in one pass."""

import gzip
import json
import os
import random
import re
import shutil
import subprocess
import sys

import pytest

from overflow_fast import build_cache, cli
from overflow_fast.recording import schema
from overflow_fast.recording.recorder import encode_line, meta_record
from overflow_fast.report import diff_parts, entries, logscan
from overflow_fast.report.diff import _KEY, _WHERE, BAD, INF, STATS, Diff, Grid, _run_length, divergence
from overflow_fast.report.entries import FIELDS, LINE, EntryReader, key_of, magnitude, parse_entry
from overflow_fast.report.summary import parse_line


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


def run(path_a, path_b, **options):
    diff = Diff(**options)
    diff.run(EntryReader(path_a), EntryReader(path_b))
    diff.finish()
    return diff


def step_of(entry):
    return key_of(entry[FIELDS])[1]


def first_of(diff):
    if diff.first is None:
        return None
    _, a, _, value, field = diff.first
    key = key_of(a[FIELDS])
    return key[1], key[3], key[4], field


# -- alignment -----------------------------------------------------------------------------------

def test_the_first_parting_is_the_earliest_step_then_the_order_of_a(tmp_path):
    drift = lambda step, module: 1.5 if (module == "h.1" and step >= 4) or (module == "head" and step >= 6) else 1.0
    a = write(tmp_path / "a.jsonl", steps_of(range(10)))
    b = write(tmp_path / "b.jsonl", steps_of(range(10), scale=drift))
    diff = run(a, b)
    assert first_of(diff) == (4, "h.1", "weight", entries.ABS_MAX)
    assert diff.pairs == 80 and diff.parted == 6 * 2 + 4 * 2
    rows = dict(diff.largest())
    assert set(rows) == {"h.1", "head"} and step_of(rows["h.1"][3][0]) == 4 and step_of(rows["head"][3][0]) == 6
    assert abs(rows["h.1"][1] - 1 / 3) < 1e-12  # |2 - 3| / 3


def test_runs_of_different_lengths_and_log_every_name_the_steps_one_run_only_has(tmp_path):
    a = write(tmp_path / "a.jsonl", steps_of(range(10)))
    b = write(tmp_path / "b.jsonl", steps_of(range(0, 6, 2)))  # log_every=2, and it stopped at step 5
    diff = run(a, b)
    assert diff.pairs == 3 * 8 and diff.first is None
    side_a, side_b = diff.sides
    assert side_a.only == 7 * 8 and side_b.only == 0
    assert side_a.only_steps == {0: 7 * 8} and not side_a.only_modules and not side_a.only_other
    assert diff.steps_only_in(side_a, side_b) == (7, 1, 9)
    text = diff.text([a, b])
    assert "steps B did not record: 7, 1 to 9 (56 entries)" in text and "in B only: nothing" in text


def test_modules_in_one_run_only_are_named_apart_and_the_rest_aligns(tmp_path):
    a = write(tmp_path / "a.jsonl", steps_of(range(5), modules=("embed", "h.0", "extra", "h.1", "head")))
    b = write(tmp_path / "b.jsonl", steps_of(range(5), modules=("embed", "h.0", "h.1", "head", "new")))
    diff = run(a, b)
    assert diff.pairs == 5 * 4 * 2 and diff.first is None
    side_a, side_b = diff.sides
    assert side_a.only_modules == {"extra": [10, "Linear"]} and side_a.only_other == 0 and not side_a.only_steps
    assert side_b.only_modules == {"new": [10, "Linear"]} and side_b.only_other == 0
    text = diff.text([a, b])
    assert "modules B did not record: 1: extra (Linear, 10 entries)" in text
    assert "modules A did not record: 1: new (Linear, 10 entries)" in text


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
    assert diff.sides[0].only_other == 4 and [step_of(e) for e in diff.sides[0].only_examples] == [0, 1, 2, 3]
    c = write(tmp_path / "c.jsonl", calls(twice=True, grow=2.0))
    diff = run(a, c)
    assert diff.pairs == 12 and first_of(diff) == (0, "shared", "output", entries.ABS_MAX)
    assert magnitude(diff.first[1][FIELDS][entries.ABS_MAX]) == 3.0  # the second call, not the first


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
    assert diff.pairs == 16 and first_of(diff) == (3, "h.0", "weight", entries.ABS_MAX)
    assert diff.sides[0].only_ranks == {1: 16} and not diff.sides[0].only_steps
    text = diff.text([a, b])
    assert "ranks B did not record: 1 (16 entries)" in text and "rank 0, module h.0" in text


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
    assert "a nan/inf in B only" in diff.text([a, b])
    both = write(tmp_path / "both.jsonl", b_records)
    assert run(b, both).first is None  # a nan in both runs: they agree


def test_the_tolerance_is_relative_to_the_larger_and_atol_a_floor():
    def entry(abs_max, abs_min="0.5", posinf="0"):
        return ("0", "forward", "m", "Linear", "output", "float32", "10", abs_min, abs_max, "0", posinf, "0", "", "", "")
    assert divergence(entry("1.0"), entry("1")) == (0.0, None)  # the same number, written two ways
    assert divergence(entry("2.0"), entry("1.0")) == (0.5, entries.ABS_MAX)
    assert divergence(entry("1.0", "1e-9"), entry("1.0", "0.0")) == (1.0, entries.ABS_MIN)
    assert divergence(entry("1.0", "1e-9"), entry("1.0", "0.0"), atol=1e-6) == (0.0, None)
    assert divergence(entry("1.0", "1e-9"), entry("2.0", "0.0"), fields=(entries.ABS_MAX,)) == (0.5, entries.ABS_MAX)
    assert divergence(entry('"inf"', posinf="1"), entry("3.0"))[1] == BAD
    assert divergence(entry('"inf"', posinf="1"), entry('"nan"')) == (0.0, None)
    assert divergence(entry("null", "null"), entry("1.0")) == (0.0, None)  # an empty tensor: counted apart


def test_a_pair_exactly_at_the_tolerance_does_not_part(tmp_path):
    a = write(tmp_path / "a.jsonl", [rec(0, "m", abs_max=1.0), rec(1, "m", abs_max=1.0)])
    b = write(tmp_path / "b.jsonl", [rec(0, "m", abs_max=0.75), rec(1, "m", abs_max=0.7)])
    diff = run(a, b, rtol=0.25)
    assert first_of(diff) == (1, "m", "output", entries.ABS_MAX) and diff.parted == 1


def test_dtype_and_element_counts_that_differ_are_counted(tmp_path):
    a = write(tmp_path / "a.jsonl", [rec(0, "m", dtype="float32", numel=10), rec(1, "m", numel=10)])
    b = write(tmp_path / "b.jsonl", [rec(0, "m", dtype="bfloat16", numel=10), rec(1, "m", numel=12)])
    text = run(a, b).text([a, b])
    assert "dtype differs in 1 pairs (first: step 0, m output: float32 in A, bfloat16 in B)" in text
    assert "element count differs in 1 pairs (first: step 1, m output: 10 in A, 12 in B)" in text


def test_a_log_out_of_step_order_is_said(tmp_path):
    records = steps_of(range(6))
    a = write(tmp_path / "a.jsonl", records)
    b = write(tmp_path / "b.jsonl", records[:16] + records[24:32] + records[16:24] + records[32:])  # 3 before 2
    diff = run(a, b)
    assert diff.sides[1].out_of_order == 8 and diff.sides[1].first_out_of_order == (26, 2, 3)
    assert "note: B is not in step order (8 entries; first at line 26: step 2 after step 3)" in diff.text([a, b])


def test_the_window_bounds_what_waits_and_says_what_it_gave_up(tmp_path):
    a = write(tmp_path / "a.jsonl", steps_of([0], modules=[f"m{i}" for i in range(50)]))
    b = write(tmp_path / "b.jsonl", steps_of([0], modules=[f"m{i}" for i in reversed(range(50))]))
    assert run(a, b).pairs == 100  # reversed within a step: everything waits, then pairs
    diff = run(a, b, pending_cap=20)
    assert diff.pairs < 100 and diff.sides[0].window + diff.sides[1].window > 0
    assert diff.pairs * 2 + diff.sides[0].only + diff.sides[1].only == 200
    assert "given up on" in diff.text([a, b])


def test_what_waits_goes_step_by_step_so_a_module_in_one_run_only_never_fills_the_window(tmp_path):
    a = write(tmp_path / "a.jsonl", steps_of(range(300), modules=("embed", "h.0", "extra", "h.1", "head")))
    b = write(tmp_path / "b.jsonl", steps_of(range(300), modules=("embed", "h.0", "h.1", "head")))
    diff = run(a, b, pending_cap=4)
    assert diff.pairs == 300 * 8 and not diff.sides[0].window
    assert diff.sides[0].only_modules == {"extra": [600, "Linear"]}


def test_the_module_table_is_exact_when_modules_are_dropped(tmp_path):
    """Kept: the 8 with the largest divergence (6 after a drop); every module's divergence comes
    with its first record, the largest ones last."""
    modules = [f"m{i}" for i in range(40)]
    grow = lambda step, module: 1.0 + int(module[1:]) / 100 * (1 + step)
    a = write(tmp_path / "a.jsonl", steps_of(range(3), modules=modules))
    b = write(tmp_path / "b.jsonl", steps_of(range(3), modules=modules, scale=grow))
    whole, bounded = run(a, b), run(a, b, max_modules=8)
    assert bounded.modules_dropped > 0 and len(bounded.modules) <= 8 and not whole.modules_dropped
    assert [(name, info[1]) for name, info in bounded.largest(6)] == \
        [(name, info[1]) for name, info in whole.largest(6)]
    assert [name for name, _ in whole.largest(3)] == ["m39", "m38", "m37"]
    assert "note: more than 8 modules" in bounded.text([a, b])
    # the module that fills the bound, seen once, with the largest divergence: counted, then kept
    a = write(tmp_path / "a5.jsonl", [rec(0, f"n{i}") for i in range(5)])
    b = write(tmp_path / "b5.jsonl", [rec(0, f"n{i}", abs_max=1.0 + i) for i in range(5)])
    assert [name for name, _ in run(a, b, max_modules=4).largest(2)] == ["n4", "n3"]


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


class _Watched(Diff):
    """A Diff that also lists the line numbers of every pair (to compare with the brute force)."""

    def __init__(self, **options):
        super().__init__(**options)
        self.lines = set()

    def _pair(self, a, b):
        self.lines.add((a[LINE], b[LINE]))
        super()._pair(a, b)


def test_streaming_alignment_is_the_whole_logs_alignment(tmp_path):
    """Random pairs of logs (steps and ranks in one run only, records left out, added, repeated
    and swapped within a step): the streaming diff pairs exactly what aligning the whole logs
    at once pairs."""
    rng = random.Random(3)
    for case in range(150):
        pool = list(range(12))
        modules = [f"m{i}" for i in range(rng.randrange(1, 6))]
        runs = []
        for _ in range(2):
            steps = sorted(rng.sample(pool, rng.randrange(1, 9)))
            ranks = rng.sample([None, 1, 2], rng.randrange(1, 3))
            runs.append(_random_run(rng, steps, ranks, modules))
        a = write(tmp_path / f"a{case}.jsonl", runs[0])
        b = write(tmp_path / f"b{case}.jsonl", runs[1])
        diff = _Watched(rtol=0.1, stat="abs_max")
        diff.run(EntryReader(a), EntryReader(b))
        diff.finish()
        first = None if diff.first is None else diff.first[0]
        assert diff.pairs == len(diff.lines)
        got = (diff.lines, diff.parted, first, diff.sides[0].only, diff.sides[1].only)
        assert got == _by_brute_force(runs[0], runs[1], 0.1), case
        side_a, side_b = diff.sides
        for side in (side_a, side_b):
            assert side.only == (sum(side.only_ranks.values()) + sum(side.only_steps.values()) + side.only_other
                                 + sum(n for n, _ in side.only_modules.values()))
            assert not side.out_of_order and not side.window


def test_the_pictures_columns_stay_few_and_parts_merge_into_the_same_cells():
    rng = random.Random(5)
    cells = [(f"m{rng.randrange(6)}", rng.randrange(0, 5000), rng.choice([0.0, 0.2, 1e-5, INF])) for _ in range(3000)]
    whole, early, late = Grid(200), Grid(200), Grid(200)
    for module, step, value in cells:
        whole.add_x(step)
        whole.add(module, step, value)
        part = early if step < 700 else late  # the early part's bins stay narrower
        part.add_x(step)
        part.add(module, step, value)
    assert early.width < late.width == whole.width and whole.width & (whole.width - 1) == 0
    assert len({index for bins in whole.cells.values() for index in bins}) < 400
    early.merge(late)
    assert early.width == whole.width and early.cells == whole.cells


# -- reading ---------------------------------------------------------------------------------------

def test_malformed_lines_are_named_and_compressed_logs_read(tmp_path):
    records = steps_of(range(3))
    lines = [encode_line(r) for r in records]
    lines[2] = b'{"record": "entry", "step": 0}\n'
    lines[5] = b"not json\n"
    a = write(tmp_path / "a.jsonl", records)
    with gzip.open(tmp_path / "b.jsonl.gz", "wb") as f:
        f.write(b"".join(lines))
    diff = run(a, str(tmp_path / "b.jsonl.gz"))
    reader = diff.sides[1].reader
    assert reader.malformed == 2 and reader.malformed_lines == [(3, "phase missing"), (6, "not JSON")]
    assert diff.pairs == 22 and diff.sides[0].only_other == 2
    assert "malformed lines skipped: 2 (first: line 3 (phase missing), 6 (not JSON))" in diff.text([a, "b"])


def test_a_cut_gzip_log_is_read_up_to_the_cut(tmp_path):
    records = steps_of(range(40))
    a = write(tmp_path / "a.jsonl", records)
    data = gzip.compress(b"".join(encode_line(r) for r in records))
    (tmp_path / "cut.gz").write_bytes(data[:len(data) // 2])
    diff = run(a, str(tmp_path / "cut.gz"))
    reader = diff.sides[1].reader
    assert reader.damage is not None and reader.malformed == 1 and 0 < diff.pairs < len(records)
    assert diff.first is None and diff.sides[0].only_steps


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


def _same_entry(x, y):
    """The same fields (abs-min and abs-max by value: two texts may write one number)."""
    for i, (u, v) in enumerate(zip(x[FIELDS], y[FIELDS])):
        if i in (entries.ABS_MIN, entries.ABS_MAX):
            u, v = magnitude(u), magnitude(v)
            if u != v and not (u != u and v != v):
                return False
        elif u != v:
            return False
    return True


def test_the_fast_path_takes_only_lines_the_schema_takes_and_reads_them_alike():
    """Random records, and the same lines with a byte changed: wherever the fast expression
    matches, the schema's parser accepts the line and gives the same Entry."""
    rng = random.Random(7)
    alphabet = b'0123456789.eE+-",:{}[]nulltrueabc \\\x00\x7f\xc3\r\x0c'
    fast = slow_only = 0
    for _ in range(4000):
        line = _line(rng).encode("utf-8", "surrogatepass")
        for candidate in [line] + [_mutated(line, rng, alphabet) for _ in range(3)]:
            try:
                text = candidate.decode("utf-8")
            except UnicodeDecodeError:
                text = None
            match = None if text is None else entries._ENTRY.fullmatch(text)
            try:
                kind, record = parse_line(candidate)
            except schema.Malformed:
                assert match is None, candidate
                continue
            if match is None:
                slow_only += 1
                continue
            fast += 1
            assert kind == "entry"
            assert _same_entry((match.groups(""), 1), (entries._parsed(record), 1)), candidate
    assert fast > 1000 and slow_only > 500, (fast, slow_only)  # both paths were exercised


def _mutated(line, rng, alphabet):
    at = rng.randrange(len(line))
    return line[:at] + bytes([rng.choice(alphabet)]) + line[at + 1:]


def test_a_reader_gives_the_same_entries_whichever_path_reads_a_line(tmp_path):
    records = steps_of(range(3))
    spaced = [json.dumps(r).encode() + b"\n" for r in records]  # spaces: the schema's parser
    mixed = [encode_line(r) for r in records]
    mixed[3] = mixed[3].replace(b"\n", b"\r\n")
    mixed[7:7] = [b"\n", b"   \n", b'{"record":"detection","step":1,"phase":"forward","module":"m","class":"C",'
                  b'"entries":["output"],"rank":null}\n']
    paths = [write(tmp_path / "a.jsonl", records), write(tmp_path / "b.jsonl", spaced),
             write(tmp_path / "c.jsonl", mixed)]
    readers = [EntryReader(p) for p in paths]
    read = [[e for batch in reader.batches() for e in batch] for reader in readers]
    assert all(len(r) == 24 for r in read)
    assert all(_same_entry(x, y) for x, y in zip(read[0], read[1]))
    assert [e[LINE] for e in read[2]] == list(range(2, 9)) + list(range(12, 29))
    assert readers[2].detections == 1 and readers[2].detection["line"] == 11 and readers[2].malformed == 0
    assert all(_same_entry(x, y) for x, y in zip(read[0], read[2]))
    assert parse_entry(spaced[0].rstrip()) is not None and parse_entry(b'{"record": "meta"}') is None


# -- in parts --------------------------------------------------------------------------------------

def test_a_diff_in_parts_is_the_diff_in_one_pass(tmp_path):
    drift = lambda step, module: 1.0 + (step >= 30 and module == "h.1") * 0.5
    records_a = steps_of(range(60), modules=("embed", "h.0", "extra", "h.1", "head"))
    records_b = steps_of(range(0, 50), modules=("embed", "h.0", "h.1", "head"), scale=drift)
    records_b[100] = rec(12, "h.0", "output", abs_max="inf", posinf=1, call=1)
    records_b[300:300] = [b"not json\n", b'{"record":"entry","step":38}\n']  # lines named by number, in a later part
    records_a[400] = rec(40, "head", "output", dtype="float16", call=4)
    a = write(tmp_path / "a.jsonl", records_a)
    b = write(tmp_path / "b.jsonl", records_b)
    options = dict(rtol=0.01, grid=True)
    whole = diff_parts.diff_logs(a, b, options, jobs=1)
    parts = diff_parts.diff_logs(a, b, options, jobs=3, min_part_bytes=1)
    assert whole.parts == 1 and parts.parts == len(diff_parts.plan(a, b, 3 * diff_parts.PARTS_PER_JOB, 1)) > 3
    assert parts.text([a, b]) == whole.text([a, b])
    assert "malformed lines skipped: 2 (first: line 302 (not JSON), 303 (phase missing))" in whole.text([a, b])
    assert parts.grid.cells == whole.grid.cells and parts.grid.one_sided == whole.grid.one_sided
    for side, other in zip(parts.sides, whole.sides):  # every line named as in the whole file
        assert side.only_examples == other.only_examples and side.reader.lines == other.reader.lines


def test_logs_not_in_step_order_where_cut_are_compared_in_one_pass(tmp_path):
    records = []
    for step in range(40):  # two ranks, the second one step behind: not in step order overall
        records += steps_of([step], rank=0, modules=("h.0",)) + steps_of([max(step - 1, 0)], rank=1, modules=("h.0",))
    a = write(tmp_path / "a.jsonl", records)
    b = write(tmp_path / "b.jsonl", records)
    assert diff_parts.plan(a, b, 2, min_part_bytes=1) is not None  # cut in two, tried, and given up
    diff = diff_parts.diff_logs(a, b, dict(rtol=0.01), jobs=2, min_part_bytes=1)
    assert diff.parts == 1 and diff.first is None and diff.pairs == len(records)


def test_a_part_whose_process_dies_is_a_clear_failure(tmp_path):
    died = subprocess.Popen([sys.executable, "-c", "import os; os._exit(9)"], stdout=subprocess.PIPE)
    with pytest.raises(diff_parts.PartFailed, match="exit code 9"):
        diff_parts._result(died)
    died.stdout.close()


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
    assert cli.main(["diff", a, empty]) == 1
    assert "no tensor entries in" in capsys.readouterr().err
    for bad in (["--rtol", "-1"], ["--rtol", "nan"], ["--jobs", "0"], ["--stat", "mean"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["diff", a, b, *bad])
        assert exit_info.value.code == 2


# -- the C fast paths (csrc/logscan.c) against their Python twins ---------------------------------

def _native():
    native = logscan.native()
    asked_not_to = os.environ.get(build_cache.WITHOUT_ENV, "") not in ("", "0")
    if native is None and shutil.which(logscan.compiler()) and not asked_not_to:
        pytest.fail(f"a C compiler is here, yet the C fast path is not: {logscan.status()}")
    if native is None:
        pytest.skip(f"no C fast path here: {logscan.status()}")
    return native


def _c_fields(native, line):
    """The fields the C scan reads of one line (bytes, no newline), or None where it leaves the
    line to the slow path."""
    out, slow = [], []
    number = native.scan(line, 4, out, lambda raw, n, o: slow.append((raw, n)), entries._PROGRAM, len(entries._KEPT))
    assert number == 5 and len(out) + len(slow) == 1
    if slow:
        assert slow == [(line, 5)]
        return None
    assert out[0][1] == 5
    return out[0][0]


def _regex_fields(line):
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        return None
    match = entries._ENTRY.fullmatch(text)
    return None if match is None else match.groups("")


# values at and beyond the limits of each form: what JSON's own writer never writes included
NUMBER_TEXTS = ["0", "00", "01", "7", "0.5", ".5", "1.", "1.0", "1.00", "1.5", "2", "10", "1e5", "1E5", "1e+5", "1e+05",
                "1e+123", "1e-5", "1e-005", "1e-1234", "1e-", "1e+", "1e", "5e-0", "5e-007", "0e-5", "0.0e-12", "0e-1234",
                "2.5e-3", "9.99e-1", "1.0e-3", "1.00e-5", "12345678901234567890", "123456789012345678901", "-1", "-0.0",
                '"nan"', '"inf"', '"-inf"', '"Inf"', "null", "NaN", "inf", '"nan', '""', "true", "1,", " 1", "0x1"]
INT_TEXTS = ["0", "00", "01", "9", "123456", "1234567", "123456789012", "1234567890123", "123456789012345678",
             "1234567890123456789", "-1", "1.0", "1e3", "null", '"1"', ""]
TEXT_TEXTS = ['""', '"h.0"', '"forward"', '"backward"', '"train"', '"eval"', '"test"', '"Forward"', '"a\\"b"',
              '"\\u00e9"', '"é"', '"\u2028"', '"\x7f"', '"tab\tx"', "null", '"x', "7"]


def _replaced(line, name, text):
    """``line`` with the value of its field ``name`` written as ``text``."""
    head, _, rest = line.partition(f'"{name}":')
    value_end = min([i for i in (rest.find(',"'), rest.rfind("}")) if i >= 0])
    return head + f'"{name}":' + text + rest[value_end:]


def _template_lines(rng):
    """Entry lines as the recorder writes them, with one to three values replaced by texts of
    every form, optional fields dropped, and bytes around the record changed."""
    record = rec(rng.randrange(10 ** 6), "h.0.attn", global_step=rng.randrange(100), mode="train")
    line = encode_line(record).rstrip(b"\n").decode()
    for _ in range(rng.randrange(1, 4)):
        field = rng.choice(schema.RECORDS["entry"])
        line = _replaced(line, field.name, rng.choice(
            {"int": INT_TEXTS, "abs": NUMBER_TEXTS, "frac": NUMBER_TEXTS}.get(field.kind, TEXT_TEXTS)))
    for name in schema.WHEN_KNOWN:
        if rng.random() < 0.3:
            line = re.sub(f',"{name}":[^,}}]*', "", line)
    edit = rng.random()
    if edit < 0.05:
        line = line + rng.choice([" ", "\r", "}", ","])
    elif edit < 0.1:
        line = rng.choice([" ", "\ufeff", "x"]) + line
    return line.encode("utf-8", "surrogatepass")


def test_the_c_scan_takes_exactly_the_lines_the_expression_takes_and_reads_them_alike():
    """Every line, valid or not: the C scan takes it where the expression matches it, with the same
    texts, and leaves it to the slow path (with its number) where the expression does not."""
    native = _native()
    rng = random.Random(11)
    alphabet = b'0123456789.eE+-",:{}[]nulltrueabc \\\x00\x1f\x7f\xc3\xa9\xff\r\x0c\t'
    taken = left = 0
    for _ in range(6000):
        line = rng.choice([_line, _template_lines])(rng)
        if isinstance(line, str):
            line = line.encode("utf-8", "surrogatepass")
        for candidate in [line] + [_mutated(line, rng, alphabet) for _ in range(2)]:
            expected = _regex_fields(candidate)
            assert _c_fields(native, candidate) == expected, candidate
            taken += expected is not None
            left += expected is None
    assert taken > 1000 and left > 5000, (taken, left)
    # and each text of every form in each field, one at a time
    line = encode_line(rec(12, "h.0", global_step=3, mode="eval")).rstrip(b"\n").decode()
    for field in schema.RECORDS["entry"]:
        for text in {"int": INT_TEXTS, "abs": NUMBER_TEXTS, "frac": NUMBER_TEXTS}.get(field.kind, TEXT_TEXTS):
            candidate = _replaced(line, field.name, text).encode()
            assert _c_fields(native, candidate) == _regex_fields(candidate), candidate


def test_the_c_scan_reads_a_chunk_as_the_python_scan_does():
    """Chunks of lines of every kind (entries, blank, other records, the last one without its
    newline): the same entries, the same slow lines, in the same order, numbered alike."""
    native = _native()
    rng = random.Random(5)
    others = [b"", b"   ", b'{"record":"meta","version":1}', b'{"record":"entry"}', b"not json", b"\r"]
    for _ in range(300):
        lines = []
        for _ in range(rng.randrange(0, 40)):
            kind = rng.random()
            if kind < 0.7:
                lines.append(encode_line(rec(rng.randrange(100), f"h.{rng.randrange(3)}",
                                             abs_max=rng.choice([1.5, "inf", None, 1e-30]))).rstrip(b"\n"))
            elif kind < 0.85:
                lines.append(_template_lines(rng))
            else:
                lines.append(rng.choice(others))
        chunk = b"\n".join(lines) + (b"\n" if rng.random() < 0.7 else b"")
        if not chunk.decode("utf-8", "replace").encode() == chunk:
            continue  # the Python scan reads a chunk that is not all UTF-8 line by line: checked above
        results = []
        for scan in (lambda *args: native.scan(*args, entries._PROGRAM, len(entries._KEPT)), entries.scan_python):
            out = []
            number = scan(chunk, 10, out, lambda raw, n, o: o.append(("slow", raw, n)))
            results.append((number, out))
        assert results[0] == results[1], chunk


def _stat_texts(rng):
    texts = ["0", "0.0", "1", "1.0", "2.5", "1e5", "100000.0", "1e-30", "3e+38", "65504.0", "null", '"nan"', '"inf"',
             '"-inf"', "-0.0", "1e308", "4.9e-324"]
    return rng.choice(texts) if rng.random() < 0.6 else repr(rng.uniform(0, 10) * 10.0 ** rng.randrange(-40, 40))


def _fields(rng):
    counts = ["0"] * 3
    if rng.random() < 0.15:
        counts[rng.randrange(3)] = rng.choice(["1", "12"])
    fields = ["7", "forward", "h.0", "Linear", "output", "float32", "10", _stat_texts(rng), _stat_texts(rng),
              *counts, "", "", ""]
    return tuple(fields)


def test_the_c_divergence_is_diff_s_divergence():
    """Random pairs of statistics' texts, special values among them, every tolerance and set of
    statistics: the same (value, where from), or the same error."""
    native = _native()
    rng = random.Random(3)
    counts = (entries.NAN, entries.POSINF, entries.NEGINF)
    for _ in range(20000):
        a, b = _fields(rng), _fields(rng)
        if rng.random() < 0.3:
            b = a[:entries.ABS_MIN] + (a[entries.ABS_MIN],) + b[entries.ABS_MAX:]
        atol = rng.choice([0.0, 0.0, 1e-3, 10.0])
        stats = rng.choice(list(STATS.values()))
        results = []
        for compute in (lambda: native.divergence(a, b, atol, stats, counts, entries.ABS_MAX, BAD),
                        lambda: divergence(a, b, atol, stats)):
            try:
                results.append(compute())
            except Exception as error:  # noqa: BLE001 - compared: the same kind of error
                results.append(type(error))
        assert results[0] == results[1], (a, b, atol, stats)


def test_the_c_run_length_is_diff_s():
    """Batches that pair for a while, then part by a key field or a step: the same length."""
    native = _native()
    rng = random.Random(9)
    for _ in range(3000):
        length = rng.randrange(0, 12)
        batch_a = [((str(rng.randrange(2)), "forward", f"h.{i}", "L", "output") + ("",) * 7 + (str(rng.randrange(2)),)
                    + ("", ""), i) for i in range(length)]
        batch_a.sort(key=lambda entry: (entry[0][entries.RANK], entry[0][entries.STEP]))
        batch_b = [(list(fields), line) for fields, line in batch_a]
        for fields, _ in batch_b:
            if rng.random() < 0.1:
                at = rng.choice([entries.MODULE, entries.NAME, entries.STEP, entries.PHASE, entries.RANK, entries.DTYPE])
                fields[at] = "x"
        batch_b = [(tuple(fields), line) for fields, line in batch_b]
        a, b = rng.randrange(0, length + 1), rng.randrange(0, length + 1)
        assert native.run_length(batch_a, a, batch_b, b, _KEY, _WHERE) == _run_length(batch_a, a, batch_b, b)
    with pytest.raises(TypeError, match="fields are str"):  # an Entry's texts: nothing else is compared
        native.run_length([((1,) * 15, 1)], 0, [((2,) * 15, 1)], 0, _KEY, _WHERE)
