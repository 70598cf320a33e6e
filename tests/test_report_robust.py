"""`overflow-fast report` on damaged logs: every line checked against the schema, malformed lines
counted and named (never a traceback), memory bounded whatever the input, and the two readers
(plain Python, DuckDB) giving the same summary on the same files."""

import bz2
import gzip
import json
import lzma
import os
import random
import warnings
from pathlib import Path

import pytest

from overflow_fast import cli
from overflow_fast.recording import schema
from overflow_fast.report import engine as reader
from overflow_fast.report import logfile
from overflow_fast.report.engine import Logs, available_engines
from overflow_fast.report.logfile import read_chunks
from overflow_fast.report.records import parse_line
from overflow_fast.report.summary import PLOT_ROWS, TOP, Picture, Summary
from overflow_fast.recording.recorder import Recorder, backoff_record, detection_record, encode_line, entry_record
from test_report_cli import F16_MAX, row, write_run

ENGINES = sorted(available_engines(), reverse=True)  # python first: the others are compared with it


def summary_of(paths, engine, **options):
    with Logs([[str(p) for p in paths]], engine) as logs:
        return Summary(logs, **options)


def report(capsys, engine, *paths, png=None):
    argv = ["report", *map(str, paths), "--no-progress", "--engine", engine]
    if png:
        argv += ["--png", str(png)]
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def both(capsys, *paths):
    """The report of every reader; asserts they are the same and returns it."""
    results = [report(capsys, engine, *paths) for engine in ENGINES]
    for other in results[1:]:
        assert other == results[0]
    return results[0]


def entry(**changes):
    record = entry_record(3, "forward", 0, "h.0", "Block", "output", "float16", row(0.5, 100.0))
    record.update(changes)
    return record


def lines_of(*records):
    return b"".join(r if isinstance(r, bytes) else (json.dumps(r) + "\n").encode() for r in records)


def malformed_names(out):
    line = next((l for l in out.splitlines() if "malformed lines skipped" in l), "")
    return line


# -- the cases measured in the issue ------------------------------------------------------------------------

@pytest.mark.parametrize("engine", ENGINES)
def test_deeply_nested_json_is_malformed_not_a_recursion_error(tmp_path, capsys, engine):
    path = tmp_path / "nested.jsonl"
    deep = b"[" * 100_000 + b"]" * 100_000
    path.write_bytes(lines_of(entry(), deep + b"\n", b'{"record": "entry", "step": ' + deep + b"}\n", entry(step=4)))
    code, out, err = report(capsys, engine, path)
    assert code == 0, err
    assert "records: 2 (2 tensor entries), malformed lines: 2" in out
    assert "nested.jsonl:2 (" in out and "nested.jsonl:3 (" in out


@pytest.mark.parametrize("engine", ENGINES)
def test_null_dtype_and_list_numel_are_malformed(tmp_path, capsys, engine):
    path = tmp_path / "types.jsonl"
    path.write_bytes(lines_of(entry(), entry(dtype=None), entry(numel=[1, 2]), entry(numel={"a": 1})))
    code, out, err = report(capsys, engine, path)
    assert code == 0 and "Traceback" not in err
    assert "malformed lines: 3" in out
    assert "types.jsonl:2 (dtype is null)" in out and "types.jsonl:3 (numel is not an integer)" in out


@pytest.mark.parametrize("engine", ENGINES)
def test_huge_and_negative_steps(tmp_path, capsys, engine):
    path = tmp_path / "steps.jsonl"
    path.write_bytes(lines_of(
        entry(step=0), entry(step=-1e11), entry(step=-1), entry(step=2 ** 36), entry(step=2 ** 31),
        entry(step=2 ** 40), entry(step=2 ** 40 + 1), entry(step=10 ** 30), entry(step=1.0), entry(step=True),
        entry(step="5")))
    code, out, err = report(capsys, engine, path, png=tmp_path / "steps.png")
    assert code == 0, err
    # -1e11, -1, 2**40 + 1, 10**30, 1.0, true, "5" are malformed; 2**36, 2**31 and 2**40 are steps
    assert "records: 4 (4 tensor entries), malformed lines: 7" in out
    assert f"steps recorded: 4 (first 0, last {2 ** 40})" in out
    assert "steps.jsonl:2 (step is not an integer)" in out and "steps.jsonl:3 (step out of range)" in out


@pytest.mark.parametrize("engine", ENGINES)
def test_far_apart_steps_keep_few_bins(tmp_path, engine):
    path = tmp_path / "far.jsonl"
    path.write_bytes(lines_of(*[entry(step=step) for step in (0, 2 ** 31, 2 ** 36, 2 ** 40, 17)]))
    summary = summary_of([path], engine, bins=True, max_columns=50)
    assert summary.step_count == 5 and summary.width >= 2 ** 40 // 100
    assert len(Picture(summary).columns) <= 100


@pytest.mark.parametrize("engine", ENGINES)
def test_30k_modules_give_exact_tables(tmp_path, engine):
    """However many modules, the tables are exact (checked against all of them): 30k modules, 30
    times what the picture draws."""
    rng = random.Random(0)
    truth, subnormal, records = {}, {}, []
    for i in range(30_000):
        name = f"m{i}"
        amax = rng.uniform(1.0, 60000.0)
        frac = rng.random() * 0.5 if i % 3 == 0 else 0.0
        records.append(entry(module=name, abs_max=amax, step=i % 1000, subnormal_frac=frac,
                             zero_frac=1.0 if i % 5 == 0 else 0.0))
        truth[name] = (max(F16_MAX / amax, 1.0), i)
        if frac:
            subnormal[(name, "output")] = (-frac, i)
    path = tmp_path / "wide.jsonl"
    path.write_bytes(lines_of(*records))
    summary = summary_of([path], engine, bins=True)
    assert summary.module_count == 30_000 and summary.modules_dropped == 30_000 - PLOT_ROWS
    assert summary.zero_count == 6_000
    assert [name for name, _, _ in summary.hottest()] == sorted(truth, key=truth.get)[:TOP]
    assert [(row[2], row[3]) for row in summary.subnormal] == sorted(subnormal, key=subnormal.get)[:TOP]
    assert {name for _, name in summary.drawn} == set(sorted(truth, key=truth.get)[:PLOT_ROWS])
    assert [first for first, _ in summary.drawn] == sorted(first for first, _ in summary.drawn)  # in log order


@pytest.mark.parametrize("engine", ENGINES)
def test_a_line_over_the_limit_is_malformed_and_never_held_whole(tmp_path, capsys, engine):
    path = tmp_path / "long.jsonl"
    with open(path, "wb") as f:
        f.write(lines_of(entry(step=1)))
        f.write(b'{"record": "entry", "module": "' + b"x" * (schema.MAX_LINE_BYTES + 10) + b'"}\n')
        f.write(lines_of(entry(step=2)))
    with open(path, "rb") as f:
        pieces = list(read_chunks(f))
    assert pieces.count(None) == 1
    assert max(len(p) for p in pieces if p is not None) < 1 << 20
    code, out, err = report(capsys, engine, path)
    assert code == 0, err
    assert "records: 2 (2 tensor entries), malformed lines: 1" in out
    assert f"long.jsonl:2 (longer than {schema.MAX_LINE_BYTES} bytes)" in out


def test_read_chunks_keeps_every_line():
    rng = random.Random(1)
    lines = [b"x" * rng.choice([0, 1, 5, 40, 70, 200]) for _ in range(500)]
    data = b"\n".join(lines)  # no newline at the end
    import io

    for size in (1, 7, 64, 1000):
        chunks = list(read_chunks(io.BytesIO(data), limit=100, size=size))
        parts = []
        for chunk in chunks:
            if chunk is None:
                parts.append(None)
            else:
                parts.extend(chunk.split(b"\n")[:-1] if chunk.endswith(b"\n") else chunk.split(b"\n"))
        assert parts == [None if len(line) > 100 else line for line in lines]


def test_line_starts_finds_every_asked_line_and_counts_them_all(tmp_path, monkeypatch):
    rng = random.Random(2)
    for block, piece in ((1 << 20, 1 << 14), (64, 16), (7, 3), (50, 50)):
        monkeypatch.setattr(logfile, "BLOCK", block)
        monkeypatch.setattr(logfile, "_PIECE", piece)
        for trial in range(20):
            lines = [b"x" * rng.choice([0, 1, 2, 15, 16, 17, 63, 64, 65, 100, 300]) for _ in range(rng.randrange(1, 200))]
            data = b"\n".join(lines) + rng.choice([b"", b"\n"])
            path = tmp_path / "lines.jsonl"
            path.write_bytes(data)
            expected = data.count(b"\n") + (not data.endswith(b"\n"))
            numbers = sorted(rng.sample(range(1, expected + 1), rng.randrange(0, expected + 1)))
            starts, count = logfile.line_starts(str(path), numbers)
            assert count == expected and logfile.line_starts(str(path), numbers, to_end=False)[0] == starts
            assert logfile.survey(str(path))[0] == expected
            assert list(logfile.read_lines_at(str(path), starts, limit=100)) == [
                None if len(lines[n - 1]) > 100 else lines[n - 1] for n in numbers]


# -- further classes of damage ------------------------------------------------------------------------------

def _wrong_values():
    """For every field of every kind, a line whose value there has the wrong type or range."""
    bad = {
        "int": ["x", 1.5, True, None, [1], {"a": 1}, -1, 2 ** 64],
        "str": [1, None, True, ["a"], {"a": "b"}],
        "abs": ["big", True, [1.0], -1.0, {"a": 1}, 1e400],
        "frac": ["0.5", None, 1.5, -0.1, "nan", True],
        "strlist": ["output", [1], None, [["a"]], {"a": 1}],
        "object": ["rows 3", [1], 3, True],
    }
    base = {
        "meta": {"record": "meta", "version": 1, "rank": 0, "world_size": 2, "started": "x", "pid": 1, "torch": "2"},
        "entry": entry(),
        "detection": detection_record(3, "forward", "h.0", "Block", ["output"], 0),
        "backoff": backoff_record(3, "h.0", "Block", ["output.grad"], 65536.0, 1, 0),
    }
    for kind, fields in schema.RECORDS.items():
        for field in fields:
            for value in bad[field.kind]:
                if value is None and field.nullable:
                    continue
                if field.kind == "int" and type(value) is int and field.lo <= value <= field.hi:
                    continue
                yield kind, field.name, dict(base[kind], **{field.name: value})


def test_every_field_of_every_kind_is_checked():
    cases = list(_wrong_values())
    assert len({(kind, name) for kind, name, _ in cases}) == sum(len(f) for f in schema.RECORDS.values())
    for kind, name, record in cases:
        with pytest.raises(schema.Malformed, match=name):
            schema.check(record)


@pytest.mark.parametrize("engine", ENGINES)
def test_wrong_types_in_every_field(tmp_path, capsys, engine):
    cases = list(_wrong_values())
    path = tmp_path / "wrong.jsonl"
    path.write_bytes(lines_of(entry(), *[record for _, _, record in cases]))
    code, out, err = report(capsys, engine, path)
    assert code == 0, err
    assert f"records: 1 (1 tensor entries), malformed lines: {len(cases)}" in out


def test_the_writers_records_fit_the_schema(tmp_path):
    import torch

    path = tmp_path / "run.jsonl"
    write_run(path)
    with open(path, "rb") as f:
        kinds = [parse_line(line)[0] for line in f]
    assert kinds[0] == "meta" and set(kinds) == {"meta", "entry", "detection"}
    for dtype in (torch.float16, torch.int64, torch.bool, torch.complex64, torch.uint64):
        record = entry_record(0, "backward", 1, "m", "M", "weight.grad", dtype, [0] * 7 + [0])
        assert schema.check(json.loads(encode_line(record))) == "entry"
        # the schema's order; global_step and mode are left out when unknown
        assert list(record) == [k for k in schema.KEYS["entry"] if k not in schema.WHEN_KNOWN]
        record = entry_record(0, "backward", 1, "m", "M", "weight.grad", dtype, [0] * 8, global_step=5, mode="train",
                              computed_in=torch.float16)
        assert schema.check(json.loads(encode_line(record))) == "entry"
        assert list(record) == list(schema.KEYS["entry"])


def damaged_files(tmp_path):
    """Small logs with one kind of damage each, and a clean one, all valid paths."""
    files = {}

    def put(name, data):
        files[name] = tmp_path / name
        files[name].write_bytes(data)

    run = write_run(tmp_path / "run.jsonl", steps=12)
    good = run.read_bytes()
    put("truncated.jsonl", good[: len(good) - 40])
    put("empty.jsonl", b"")
    put("blank.jsonl", b"\n \n\t\r\n" + good.replace(b"\n", b"\n\n", 3) + b"\x0b\n")
    put("crlf.jsonl", good.replace(b"\n", b"\r\n"))
    rng = random.Random(3)
    put("garbage.bin", bytes(rng.randrange(256) for _ in range(20_000)))
    put("mixed.jsonl", good[:2000] + bytes(rng.randrange(256) for _ in range(500)) + b"\n" + good[2000:])
    put("nonfinite.jsonl", lines_of(
        entry(abs_max="nan", nan=1), entry(abs_max="inf", posinf=1, step=2), entry(abs_max="-inf", step=1),
        entry(abs_min="nan"), entry(zero_frac="nan"), entry(abs_max="NaN"), entry(abs_max="Infinity"),
        b'{"record": "entry", "step": 5, "abs_max": NaN}\n',
        (json.dumps(entry(step=6))[:-1] + ', "extra": NaN}\n').encode(),
        (json.dumps(entry(step=7, abs_max=0.5))[:-1].replace('"abs_max": 0.5', '"abs_max": 1e999') + "}\n").encode(),
        entry(abs_max=18446744073709551615, dtype="uint64"), entry(abs_max=2 ** 64 + 1, dtype="uint64")))
    put("unicode.jsonl", lines_of(
        entry(module="блок.0", entry="вход[0]"), entry(module="h.\u00e9\U0001F600", abs_max=65000.0),
        json.dumps(entry(module="plain.é"), ensure_ascii=False).encode() + b"\n",
        b'{"record": "entry", "module": "\\ud800"}\n',
        json.dumps(entry(module="bad\ud800")).encode() + b"\n",
        entry(module="ctl\x1b[31mred\x07"), entry(module="nul\x00", step=4),
        b'{"record": "entry", "module": "\xff\xfe"}\n', b"\xef\xbb\xbf" + lines_of(entry(step=9)),
        entry(module='quote"back\\slash', abs_max=64000.0)))
    put("shapes.jsonl", lines_of(
        b"[1, 2]\n", b"5\n", b'"text"\n', b"null\n", b"{}\n", b'{"record": "telemetry"}\n', b'{"record": 3}\n',
        b'{"record": "entry"}{"record": "entry"}\n', b'{"record": "entry", "step": 1} trailing\n',
        (json.dumps(entry(step=8))[:-1] + ', "step": "dup"}\n').encode(),
        (json.dumps(entry(step=8))[:-1] + ', "future_field": {"a": [1, {"b": 2}]}}\n').encode(),
        {"record": "meta", "version": 1}, {"record": "meta", "version": 0},
        detection_record(8, "forward", "h.1", "Block", ["output"] * 3, None),
        dict(detection_record(8, "forward", "h.1", "Block", ["output"], None), entries=["x"] * 5000)))
    put("fields.jsonl", lines_of(  # the optimizer step and mode: valid, missing, null, and wrong
        entry(global_step=3, mode="train"), entry(step=4), entry(step=5, global_step=None, mode=None),
        entry(step=6, global_step=4, mode="eval", abs_max="inf", posinf=1), entry(step=7, mode="eval"),
        entry(global_step=-1), entry(global_step=2 ** 40 + 1), entry(global_step=True), entry(global_step=1.0),
        entry(global_step="3"), entry(mode="training"), entry(mode=1), entry(mode=["eval"]),
        detection_record(6, "forward", "h.0", "Block", ["output"], None, 4, "eval"),
        dict(detection_record(6, "forward", "h.0", "Block", ["output"]), mode="test")))
    # compressed logs, told by their first bytes (not their names), intact, cut and damaged
    # (the meta line made constant, and gzip's time stamp: the same bytes, the same damage, every run)
    meta = json.dumps({"record": "meta", "version": 1, "rank": None, "world_size": None,
                       "started": "2024-01-01T00:00:00+00:00", "pid": 1, "torch": "2"}).encode()
    good = meta + good[good.index(b"\n"):]
    packed = {"gz": gzip.compress(good, mtime=0), "bz2": bz2.compress(good), "xz": lzma.compress(good)}
    for suffix, data in packed.items():
        put(f"run.jsonl.{suffix}", data)
        put(f"cut.jsonl.{suffix}", data[: len(data) * 2 // 3])
    put("gzip-without-suffix.log", packed["gz"])
    put("plain-named.jsonl.gz", good)
    put("multi-member.jsonl.gz", gzip.compress(good[:3001], mtime=0) + gzip.compress(good[3001:], mtime=0))
    put("padded.jsonl.gz", packed["gz"] + b"\0" * 64)  # as tape and some tools leave them
    put("trailing-garbage.jsonl.gz", packed["gz"] + b"garbage\n")
    put("cut-header.jsonl.gz", packed["gz"][:6])
    put("empty.jsonl.gz", gzip.compress(b"", mtime=0))
    bad_crc = bytearray(packed["gz"])
    bad_crc[-8] ^= 0xFF  # the trailer's CRC32: the data inflates, its checksum does not match
    put("bad-crc.jsonl.gz", bytes(bad_crc))
    flipped = bytearray(packed["gz"])
    flipped[len(flipped) // 2] ^= 0x55  # mid-stream: DuckDB alone inflates this to wrong lines, silently
    put("flipped.jsonl.gz", bytes(flipped))
    put("nonfinite.jsonl.gz", gzip.compress(files["nonfinite.jsonl"].read_bytes(), mtime=0))
    put("run.jsonl.zst", b"\x28\xb5\x2f\xfd" + bytes(rng.randrange(256) for _ in range(100)))
    return files


DAMAGED = (  # every file of damaged_files, each a case of the test below
    "truncated.jsonl", "empty.jsonl", "blank.jsonl", "crlf.jsonl", "garbage.bin", "mixed.jsonl", "nonfinite.jsonl",
    "unicode.jsonl", "shapes.jsonl", "fields.jsonl", "run.jsonl.gz", "cut.jsonl.gz", "run.jsonl.bz2",
    "cut.jsonl.bz2", "run.jsonl.xz", "cut.jsonl.xz", "gzip-without-suffix.log", "plain-named.jsonl.gz",
    "multi-member.jsonl.gz", "padded.jsonl.gz", "trailing-garbage.jsonl.gz", "cut-header.jsonl.gz",
    "empty.jsonl.gz", "bad-crc.jsonl.gz", "flipped.jsonl.gz", "nonfinite.jsonl.gz", "run.jsonl.zst")
INTACT = ("run.jsonl.gz", "run.jsonl.bz2", "run.jsonl.xz", "gzip-without-suffix.log", "plain-named.jsonl.gz",
          "multi-member.jsonl.gz", "padded.jsonl.gz")  # read as the plain run.jsonl is
REFUSED = ("run.jsonl.zst",)
# damaged before the first line could be decompressed: a gzip header, a bzip2 block (900 kB: all
# of a small log), gzip's first 8 KiB
NOTHING_LEFT = ("cut-header.jsonl.gz", "cut.jsonl.bz2")


def test_every_damaged_file_is_a_case():
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        assert sorted(damaged_files(Path(directory))) == sorted(DAMAGED)


@pytest.mark.parametrize("name", DAMAGED)
def test_damaged_files_never_crash_and_both_readers_agree(tmp_path, capsys, name):
    """Every engine, the same exit code, summary and error on every damaged file."""
    files = damaged_files(tmp_path)
    code, out, err = both(capsys, files[name])
    assert "Traceback" not in err
    if name in ("empty.jsonl", "garbage.bin", "empty.jsonl.gz"):
        assert code == 1 and "no flight-recorder records" in err
        return
    if name in REFUSED:
        assert code == 1 and out == ""
        assert err == (f"overflow-fast: cannot read {files[name]}: it is zstd-compressed, which the report cannot "
                       f"decompress (plain, gzip, bzip2 and xz logs it can): decompress it first (zstd -d)\n")
        return
    if name in NOTHING_LEFT:  # nothing before the damage decompresses: the damage is all there is, and said
        why = {"cut-header.jsonl.gz": "the gzip stream ends early: the file is cut",
               "cut.jsonl.bz2": "the bzip2 stream ends early: the file is cut"}[name]
        assert code == 1 and err.startswith(f"overflow-fast: no flight-recorder records in {files[name]} "
                                            f"(1 malformed lines; first: {name}:1 ({why}")
        return
    if name == "flipped.jsonl.gz":  # zlib stops at the flipped byte, or the checksum finds it: said either way
        assert (code, "flipped.jsonl.gz:1 (gzip data damaged (" in err) == (1, True) or (
            code == 0 and "malformed lines: 1" in out and "(gzip data damaged (" in out), (code, out, err)
        return
    assert code == 0, err
    if name in INTACT:
        plain = report(capsys, "python", tmp_path / "run.jsonl")
        assert (code, out.replace(str(files[name]), "LOG"), err) == (
            plain[0], plain[1].replace(str(tmp_path / "run.jsonl"), "LOG"), plain[2])
        assert "first non-finite value: step 8, forward, module h.1 (Block)" in out
    if name.startswith("cut.jsonl."):
        kind = {"gz": "gzip", "bz2": "bzip2", "xz": "xz"}[name.rsplit(".", 1)[1]]
        assert "malformed lines: 1" in out and f"(the {kind} stream ends early: the file is cut)" in out
    if name in ("bad-crc.jsonl.gz", "trailing-garbage.jsonl.gz"):
        assert "malformed lines: 1" in out and "(gzip data damaged (" in out
    if name == "bad-crc.jsonl.gz":  # every line is there, and so is the damage
        assert "records: 98 (96 tensor entries), malformed lines: 1" in out
    if name == "truncated.jsonl":
        assert "malformed lines: 1" in out and "truncated.jsonl:" in out
    if name in ("blank.jsonl", "crlf.jsonl"):
        assert "malformed" not in out and "records: 98 (96 tensor entries)" in out
    if name == "unicode.jsonl":
        assert "блок.0" in out or "h.\u00e9\U0001F600" in out
        assert "\x1b" not in out and "\x07" not in out and "\x00" not in out  # escaped, not sent to the terminal
        assert "records: 6 (6 tensor entries), malformed lines: 4" in out
    if name.startswith("nonfinite.jsonl"):
        assert "first non-finite value: step 1, forward, module h.0 (Block), entry output [float16]: abs max -inf" in out
    if name == "shapes.jsonl":
        assert "records: 4 (2 tensor entries), malformed lines: 11" in out and "detection record: step 8" in out
    if name == "fields.jsonl":
        assert "records: 6 (5 tensor entries), malformed lines: 9" in out
        assert "fields.jsonl:6 (global_step out of range)" in out and "fields.jsonl:8 (global_step is not" in out
        assert "optimizer steps recorded: 2 (first 3, last 4): 1 in train, 1 in eval" in out
        assert "modes: train (1 entries), eval (2 entries), unknown (2 entries)" in out
        assert "first non-finite value: optimizer step 4 (eval, batch 6), forward" in out


def test_all_damaged_files_at_once_agree(tmp_path, capsys):
    files = damaged_files(tmp_path)
    paths = [files[name] for name in sorted(files) if name not in REFUSED] + [tmp_path / "run.jsonl"]
    code, out, err = both(capsys, *paths)
    assert code == 0, err
    assert "malformed lines skipped (first): bad-crc.jsonl.gz:99 (gzip data damaged (CRC check failed" in out
    # one file that cannot be read among them: the same refusal, before anything is read
    code, out, err = both(capsys, *paths, files["run.jsonl.zst"])
    assert code == 1 and out == "" and "it is zstd-compressed" in err


def test_a_run_read_partly_by_each_reader_counts_each_name_once(tmp_path, capsys):
    # under DuckDB, the .bz2 file is the plain reader's: the names both sides saw count once
    run = write_run(tmp_path / "run.jsonl", steps=6)
    (tmp_path / "more.jsonl.bz2").write_bytes(bz2.compress(run.read_bytes()))
    code, out, err = both(capsys, run, tmp_path / "more.jsonl.bz2")
    assert code == 0, err
    assert "\nmodules: 4\n" in out and "entries that are all zeros (latest first):\n  last at step" in out
    assert "more\n" not in out.split("entries that are all zeros")[1]  # one all-zero pair, not two


def _spied(monkeypatch):
    """(files the json reader read whole, files whose lines it looked up by offset), from now on."""
    walked, sought = [], []
    real_read_log, real_line_starts = reader.read_log, reader.line_starts

    def read_log(path, *args, wanted=None, **kwargs):
        if wanted is None:
            walked.append(os.path.basename(path))
        return real_read_log(path, *args, wanted=wanted, **kwargs)

    def line_starts(path, numbers, **options):
        sought.append((os.path.basename(path), list(numbers)))
        return real_line_starts(path, numbers, **options)

    monkeypatch.setattr(reader, "read_log", read_log)
    monkeypatch.setattr(reader, "line_starts", line_starts)
    return walked, sought


@pytest.mark.skipif("duckdb" not in ENGINES, reason="DuckDB not installed (pip install overflow_fast[logs])")
def test_duckdb_reads_an_intact_gzip_log_itself_and_a_damaged_one_never(tmp_path, monkeypatch):
    run = write_run(tmp_path / "run.jsonl", steps=12)
    data = gzip.compress(run.read_bytes())
    (tmp_path / "run.jsonl.gz").write_bytes(data)
    damaged = bytearray(data)
    damaged[-8] ^= 0xFF
    (tmp_path / "crc.jsonl.gz").write_bytes(bytes(damaged))
    walked, sought = _spied(monkeypatch)
    intact, crc = (summary_of([path], "duckdb") for path in (tmp_path / "run.jsonl.gz", tmp_path / "crc.jsonl.gz"))
    assert walked == ["crc.jsonl.gz"] and sought == []  # the intact one: DuckDB's, its rows re-read by walking
    assert intact.entries == crc.entries == 96 and intact.malformed == 0 and crc.malformed == 1
    assert intact.first_nonfinite["step"] == 8


@pytest.mark.skipif("duckdb" not in ENGINES, reason="DuckDB not installed (pip install overflow_fast[logs])")
def test_the_engines_fill_the_same_picture(tmp_path):
    write_run(tmp_path / "run.jsonl", steps=700, rank=0, world_size=2)
    write_run(tmp_path / "run.jsonl", steps=700, rank=1, world_size=2)
    paths = [os.path.join(tmp_path, f"run.rank{r}.jsonl") for r in (0, 1)]
    with open(paths[1], "ab") as f:
        f.write(b"garbage\n" + lines_of(entry(step=900, module="late", abs_max=60000.0)))
    plain, duck = (summary_of(paths, engine, bins=True) for engine in ("python", "duckdb"))
    assert plain.width == duck.width > 1
    assert vars(Picture(plain)) == vars(Picture(duck)) and Picture(plain).underflow


@pytest.mark.skipif("duckdb" not in ENGINES, reason="DuckDB not installed (pip install overflow_fast[logs])")
def test_duckdb_reads_several_ranks_at_once_and_hands_back_only_what_it_cannot_take(tmp_path, monkeypatch):
    paths = []
    for rank in range(3):
        with Recorder(tmp_path / "run.jsonl", rank=rank, world_size=3) as recorder:
            recorder.write([entry(step=s, rank=rank) for s in range(50)])
        paths.append(recorder.path)
    with open(paths[2], "ab") as f:
        f.write(b"oops\n")
    walked, sought = _spied(monkeypatch)
    summary = summary_of(paths, "duckdb")
    assert summary.entries == 150 and summary.metas == 3 and summary.malformed == 1
    assert summary.malformed_lines == [(paths[2], 52, "not JSON")]
    # the json reader saw the meta lines and the bad one: no file whole
    assert walked == []
    assert sought == [("run.rank0.jsonl", [1]), ("run.rank1.jsonl", [1]), ("run.rank2.jsonl", [1, 52])]


@pytest.mark.skipif("duckdb" not in ENGINES, reason="DuckDB not installed (pip install overflow_fast[logs])")
def test_a_duckdb_failure_falls_back_to_the_json_reader(tmp_path, capsys, monkeypatch):
    path = write_run(tmp_path / "run.jsonl", steps=3)
    expected = report(capsys, "python", path)[1]
    monkeypatch.setattr(reader, "_scan_sql", lambda scans: "SELECT no_such_function_in_this_duckdb()")
    code, out, err = report(capsys, "auto", path)
    assert code == 0 and out == expected and "reading with Python's json instead" in err
    code, out, err = report(capsys, "duckdb", path)
    assert code == 1 and "DuckDB could not read the logs" in err and "Traceback" not in err


@pytest.mark.skipif("duckdb" not in ENGINES, reason="DuckDB not installed (pip install overflow_fast[logs])")
def test_duckdb_out_of_memory_scans_again_on_one_thread(tmp_path, capsys, monkeypatch):
    path = write_run(tmp_path / "run.jsonl", steps=3)
    expected = report(capsys, "python", path)[1]
    threads = []
    connect = reader.duckdb.connect

    class ShortOfMemory:
        def __init__(self, con):
            self.con = con

        def __getattr__(self, name):
            return getattr(self.con, name)

        def execute(self, sql, *args):
            if sql.startswith("CREATE TEMP TABLE entries AS") and "row_number() OVER ()" in sql:
                threads.append(self.con.execute("SELECT current_setting('threads')").fetchone()[0])
                if threads[-1] > 1:
                    raise reader.duckdb.OutOfMemoryException("failed to allocate data of size 32.0 MiB")
            return self.con.execute(sql, *args)

    monkeypatch.setattr(reader.duckdb, "connect", lambda config: ShortOfMemory(connect(config=dict(config, threads=2))))
    walked, _ = _spied(monkeypatch)
    code, out, err = report(capsys, "duckdb", path)
    assert (code, out, err) == (0, expected, "") and threads == [2, 1] and walked == []


# -- where the reader writes -------------------------------------------------------------------------------

def test_the_reader_writes_only_into_a_private_folder_and_says_when_it_passes_one_over(tmp_path, monkeypatch, capsys):
    """The reader's temporary files (DuckDB's spill files, sqlite's database) go into a fresh folder
    that passes the rule the C++ kernel's cache follows; a temporary folder others can change is
    passed over with a warning that names it and why, as the kernel's cache is."""
    import stat
    import tempfile

    from overflow_fast import build_cache

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # anyone may rename our folder away and put theirs in its place: no sticky bit
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    monkeypatch.setenv(build_cache.CACHE_ENV, str(tmp_path / "cache"))
    with pytest.warns(RuntimeWarning, match=f"not using {shared} for the log reader's temporary files: {shared} is "
                                            f"writable by its group and others"):
        folder = reader.scratch_folder()
    assert folder.startswith(str(tmp_path / "cache")) and build_cache.private_folder(folder) == (Path(folder), None)
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700 and not os.listdir(shared)
    path = write_run(tmp_path / "run.jsonl", steps=3)
    for engine in ENGINES:
        with pytest.warns(RuntimeWarning, match="not using"):
            code, out, err = report(capsys, engine, path)
        assert code == 0 and "first non-finite value:" in out
    shared.chmod(0o1777)  # sticky, as /tmp: a folder made there stays ours
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        folder = reader.scratch_folder()
    assert folder.startswith(str(shared))
    os.rmdir(folder)


@pytest.mark.skipif("duckdb" not in ENGINES, reason="DuckDB not installed")
def test_duckdb_loads_no_extension_and_spills_only_into_the_private_folder(tmp_path):
    path = write_run(tmp_path / "run.jsonl", steps=3)
    with Logs([[str(path)]], "duckdb") as logs:
        settings = {name: str(logs.one(f"SELECT current_setting('{name}')")[0]) for name in (
            "autoload_known_extensions", "autoinstall_known_extensions", "temp_directory", "extension_directory")}
        folder = logs.scratch
        assert settings["autoload_known_extensions"] == settings["autoinstall_known_extensions"] == "False"
        assert settings["temp_directory"].startswith(folder) and settings["extension_directory"].startswith(folder)
    assert not os.path.exists(folder)  # removed with the reader
    with Logs([[str(path)]], "python") as logs:
        folder = logs.scratch
        assert logs.one("PRAGMA temp_store_directory") == (folder,) and os.listdir(folder) == ["logs.db"]
    assert not os.path.exists(folder)


def test_with_no_private_folder_the_reader_says_so_and_still_reads(tmp_path, monkeypatch, capsys):
    import tempfile

    monkeypatch.setattr(reader.build_cache, "private_folder", lambda path, create=False: (Path(path), "it is not ours"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    path = write_run(tmp_path / "run.jsonl", steps=3)
    for engine in ENGINES:
        with pytest.warns(RuntimeWarning, match="no private folder for the log reader's temporary files"):
            code, out, _ = report(capsys, engine, path)
        assert code == 0 and "first non-finite value:" in out


@pytest.mark.parametrize("command", ["report", "diff"])
def test_without_duckdb_both_commands_read_with_json_and_say_what_it_costs(tmp_path, command):
    """The same reader for both commands: DuckDB missing, the json reader reads, gives what
    --engine python gives, and says on stderr what it costs and what to install."""
    import subprocess
    import sys

    from test_recorder import child_env

    path = write_run(tmp_path / "run.jsonl", steps=4)
    logs = [str(path)] if command == "report" else [str(path), str(path)]
    code = ("import sys; sys.modules['duckdb'] = None\n"
            "from overflow_fast.cli import main\n"
            "sys.exit(main(sys.argv[1:]))")
    results = [subprocess.run([sys.executable, "-c", code, command, *logs, *extra], capture_output=True, text=True,
                              env=child_env(), timeout=300) for extra in ([], ["--engine", "python"])]
    missing, chosen = results
    assert missing.returncode == chosen.returncode == 0 and missing.stdout == chosen.stdout and chosen.stderr == ""
    assert missing.stderr == f"overflow-fast: {reader.FALLBACK_NOTE}\n"
    assert "pip install 'overflow_fast[logs]'" in missing.stderr and "a tenth of DuckDB's speed" in missing.stderr
    asked = subprocess.run([sys.executable, "-c", code, command, *logs, "--engine", "duckdb"], capture_output=True,
                           text=True, env=child_env(), timeout=300)
    assert asked.returncode == 1 and "needs DuckDB" in asked.stderr


def _fed(fifo, data):
    """A thread that writes ``data`` into the named pipe ``fifo`` once a reader opens it."""
    import threading

    def feed():
        try:
            with open(fifo, "wb") as f:
                f.write(data)
        except OSError:  # the reader left: said by the command's own result
            pass

    thread = threading.Thread(target=feed, daemon=True)
    thread.start()
    return thread


def _release(fifo):
    """Unblock a writer still waiting on ``fifo`` for a reader (a command that never opened it)."""
    try:
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
    except OSError:
        pass


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
@pytest.mark.parametrize("engine", ENGINES)
def test_logs_in_named_pipes_read_as_the_files_do(tmp_path, engine):
    """`overflow-fast report <(zcat run.jsonl.gz)` and the like: a pipe, compressed or not, is opened
    once (its writer sees no reader come and go) and read as the file is, by both commands."""
    import subprocess
    import sys

    from test_recorder import child_env

    run = write_run(tmp_path / "run.jsonl", steps=30)
    other = write_run(tmp_path / "other.jsonl", steps=25)
    cases = [("report", [run.read_bytes()]), ("report", [gzip.compress(run.read_bytes())]),
             ("diff", [run.read_bytes(), gzip.compress(other.read_bytes())])]
    for command, contents in cases:
        fifos = []
        for k, data in enumerate(contents):
            fifo = str(tmp_path / f"pipe{k}")
            if os.path.exists(fifo):
                os.remove(fifo)
            os.mkfifo(fifo)
            fifos.append(fifo)
            _fed(fifo, data)
        try:
            piped = subprocess.run([sys.executable, "-m", "overflow_fast", command, *fifos, "--engine", engine],
                                   capture_output=True, text=True, env=child_env(), timeout=120)
        finally:
            for fifo in fifos:
                _release(fifo)
        files = [str(run)] if command == "report" else [str(run), str(other)]
        plain = subprocess.run([sys.executable, "-m", "overflow_fast", command, *files, "--engine", engine],
                               capture_output=True, text=True, env=child_env(), timeout=120)
        normalized = plain.stdout
        for fifo, path in zip(fifos, files):
            normalized = normalized.replace(path, fifo)
        assert (piped.returncode, piped.stdout, piped.stderr) == (0, normalized, ""), (command, piped.stderr)
