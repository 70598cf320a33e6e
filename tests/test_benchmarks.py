"""Smoke tests of the benchmark scripts: they run in their smallest mode and print their output in
the agreed format. No timing is asserted (the machine is shared; figures are for RESULTS.md)."""

import csv
import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")

LAST_LINE = re.compile(
    r"^host us/hook: -?\d+(\.\d+)?; launches/forward: \d+; uploads/forward: \d+; "
    r"projected H200 step overhead: -?\d+(\.\d+)?%$"
)


def _run(args, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_last_line_format_regex():
    assert LAST_LINE.match("host us/hook: 336.5; launches/forward: 208; uploads/forward: 102; "
                           "projected H200 step overhead: 92.5%")
    assert not LAST_LINE.match("host us/hook: 336.5; launches/forward: 208; uploads/forward: 102")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the host-path benchmark needs triton")
@pytest.mark.parametrize("activations", [[], ["--fresh-activations"]], ids=["replayed", "fresh"])
def test_bench_host_path_quick_last_line(tmp_path, activations):
    out = tmp_path / "host.csv"
    result = _run([os.path.join(BENCH, "bench_host_path.py"), "--quick", "--no-cpu", "--repeats", "1",
                   "--csv", str(out), *activations])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert LAST_LINE.match(lines[-1]), lines[-1]
    launches = int(re.search(r"launches/forward: (\d+)", lines[-1]).group(1))
    assert launches > 0  # the triton backend's host path ran (its launches were counted)
    # the projection gives every mode's reads their kernels' GPU time (the hooks' reads are counted
    # where they are made, the one-call forward hook's included)
    for mode in ("module", "batch", "watch", "defer"):
        gpu_ms = re.search(rf"^\| GPU-bound [^|]* \| {mode} \| [\d.]+ \| [\d.]+ \| ([\d.]+) \|", result.stdout, re.M)
        assert gpu_ms and float(gpu_ms.group(1)) > 0, mode
    assert re.search(r"^\| watch \| \d+, [\d.]+ \| \d+, [\d.]+ \| \d+, [\d.]+ \| [\d.]+ \|$", result.stdout, re.M)
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and all(r["benchmark"] == "host_path" for r in rows)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the host-path benchmark needs triton")
def test_bench_host_path_targets_prints_the_ratios():
    result = _run([os.path.join(BENCH, "bench_host_path.py"), "--quick", "--targets"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(r"^targets \(3 rounds of 1 forwards\): floor [\d.]+ us/hook; check='batch' [\d.]+ us = [\d.]+x; "
                     r"watch\(\) [\d.]+ us = [\d.]+x$", result.stdout, re.M), result.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the hook breakdown needs triton")
def test_bench_hook_breakdown_prints_its_table():
    result = _run([os.path.join(BENCH, "bench_hook_breakdown.py"), "--layers", "1", "--batch", "1", "--seq", "8",
                   "--rounds", "1", "--forwards", "2"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for piece in ("whole hook", "Passes.forward_returned", "Reads.add_forward", "Reads.add", "tensor_stats", "flush",
                  "pre hook", "gen-0 collections (collector on - off)"):
        assert re.search(rf"^\| {re.escape(piece)} \| -?\d+\.\d+ \|$", result.stdout, re.M), piece
    assert re.search(r"^floor hook -?\d+\.\d+; detector ", result.stdout, re.M)


@pytest.mark.slow
def test_bench_all_csv_columns(tmp_path):
    # one benchmark is enough to check the table's columns (bench_compile alone takes ~20 s; its
    # graph breaks are tests/test_compile.py's)
    out = tmp_path / "bench.csv"
    result = _run([os.path.join(BENCH, "bench_all.py"), "--smoke", "--only", "hook", "--out", str(out)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(r"\[1/1\] hook: .* ok, \d+ s", result.stdout)
    with open(out, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames == ["benchmark", "metric", "value", "unit", "cpu_model", "avx", "threads",
                                 "torch", "date"]
    assert {r["benchmark"] for r in rows} == {"hook_overhead"}
    assert all(r["cpu_model"] and r["threads"] and r["torch"] and r["date"] for r in rows)


def test_bench_report_quick(tmp_path):
    result = _run([os.path.join(BENCH, "bench_report.py"), "--quick", "--dir", str(tmp_path)], timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if re.search(r"\b(duckdb|python)\s+now\s+\d+ ", line)]
    assert rows and all(len(row.split()) >= 10 for row in rows)
    if importlib.util.find_spec("duckdb") is not None:
        assert result.stdout.count("summaries are identical") == 2, result.stdout


def test_bench_diff_quick(tmp_path):
    result = _run([os.path.join(BENCH, "bench_diff.py"), "--quick", "--extra", "--dir", str(tmp_path)], timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if re.search(r"(diff --engine \w+|report A B)", line)]
    assert len(rows) >= 5 and all(len(row.split()) >= 10 for row in rows)
    assert result.stdout.count("(now): the diffs' texts are identical; first parting: step") == 2, result.stdout


@pytest.mark.slow
def test_bench_reuse_bytes_counts_what_the_engine_reads():
    result = _run([os.path.join(BENCH, "bench_reuse_bytes.py"), "--batch", "1", "--seq", "8"], timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = re.findall(r"^\| (.+?) \| (train|eval) \| (\d+) MB, (\d+) calls \|", result.stdout, re.M)
    assert len(rows) == 4, result.stdout
    # GPT-2 small's weights alone are about 500 MB in fp32: every detector reads them once a forward
    assert all(int(mb) > 400 and int(calls) > 0 for _, _, mb, calls in rows), rows


@pytest.mark.slow
def test_bench_find_op_prints_training_and_evaluation():
    result = _run([os.path.join(BENCH, "bench_find_op.py"), "--layers", "1", "--width", "64", "--seq", "16",
                   "--eval-layers", "2", "--eval-width", "64", "--eval-rows", "8", "--steps", "2", "--runs", "1"],
                  timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for mode in ("training", "evaluation"):
        assert re.search(rf"^\| {mode} \| step ms .* \| -?\d+\.\d+ \| -?\d+\.\d+ \| - \| \d+\.\d+ \|$", result.stdout,
                         re.M), result.stdout
        number = r"[+-]\d+\.\d+"
        assert re.search(rf"^\| {mode} \| peak .* \| {number} \| {number} \| {number} \| {number} MiB \|$",
                         result.stdout, re.M), result.stdout


def test_the_shared_timing_loop_warms_up_alternates_and_returns_each_variants_median():
    spec = importlib.util.spec_from_file_location("bench_shared", os.path.join(BENCH, "_shared.py"))
    shared = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shared)
    calls = []
    medians = shared.round_robin({"a": lambda index: calls.append(("a", index)),
                                  "b": lambda index: calls.append(("b", index))}, repeats=3, warm_up=2)
    # two untimed rounds, then three timed; the order reversed every other round
    assert calls == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2), ("b", 3), ("a", 3),
                     ("a", 4), ("b", 4)]
    assert set(medians) == {"a", "b"} and all(seconds >= 0 for seconds in medians.values())


def test_a_self_timed_step_counts_the_seconds_it_returns():
    spec = importlib.util.spec_from_file_location("bench_shared", os.path.join(BENCH, "_shared.py"))
    shared = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shared)
    # each step says how long its timed part took: the median of what it returned after the warm-up
    said = {"a": iter([9.0, 1.0, 3.0, 2.0]), "b": iter([9.0, 5.0, 4.0, 6.0])}
    medians = shared.round_robin({name: lambda index, name=name: next(said[name]) for name in said}, repeats=3,
                                 warm_up=1, self_timed=True)
    assert medians == {"a": 2.0, "b": 5.0}
