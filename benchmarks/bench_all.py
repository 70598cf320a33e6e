"""The whole benchmark suite in one command (``make bench``).

Runs each benchmark script in its own process with quick settings (the suite stays under ten
minutes on a 2-core machine), prints a line per benchmark with its elapsed time, then one table of
every figure, and writes them to one CSV (default ``benchmarks/results/bench.csv``, replaced on
each run) whose rows carry benchmark, metric, value, unit, CPU model, AVX level, torch threads,
torch version and date (``benchmarks/_results.py``). Each script's own output goes to
``benchmarks/results/<name>.log``.

    .venv/bin/python benchmarks/bench_all.py [--only kernel,hook,host,e2e,compile,memory,forward] [--out PATH] [--smoke]

``--smoke`` (tests): the smallest settings of each benchmark run; its figures mean nothing.
"""

import argparse
import csv
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _results  # noqa: E402

# name -> (script, quick arguments, smoke arguments)
SUITE = {
    "kernel": ("bench_cpu_kernel.py", ["--quick"], ["--quick", "--repeats", "1"]),
    "hook": ("bench_hook_overhead.py", ["--repeats", "30"], ["--repeats", "2"]),
    "host": ("bench_host_path.py", ["--repeats", "5", "--inner", "2"], ["--quick", "--no-cpu", "--repeats", "1"]),
    "e2e": ("bench_end_to_end.py", ["--quick"], ["--quick", "--models", "gpt2", "--repeats", "1"]),
    "compile": ("bench_compile.py", ["--calls", "5"], ["--models", "mlp", "--backend", "aot_eager", "--calls", "1"]),
    "memory": ("bench_staging_memory.py", [], ["--batch", "1", "--seq", "8"]),
    "forward": ("bench_cpu_forward.py", ["--repeats", "15"], ["--batch", "1", "--seq", "16", "--repeats", "1"]),
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(SUITE), help="comma-separated subset of " + ",".join(SUITE))
    parser.add_argument("--out", default=os.path.join(HERE, "results", "bench.csv"))
    parser.add_argument("--smoke", action="store_true", help="smallest settings (tests); figures mean nothing")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in SUITE]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {list(SUITE)}")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    print(_results.machine_line(), flush=True)
    try:
        from overflow_fast.stats.dispatch import backend_status
        cpu_reason = backend_status()["cpu"]
    except Exception as error:  # reported, not fatal: the scripts say what they can run
        cpu_reason = f"{type(error).__name__}: {error}"
    if cpu_reason is not None:
        print(f"WARNING: the cpu backend is unavailable ({cpu_reason}); the detector figures below are "
              "the torch backend's, not the C++ kernel's", flush=True)
    total_start = time.perf_counter()
    rows = []
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        for index, name in enumerate(names, 1):
            script, quick, smoke = SUITE[name]
            part = os.path.join(tmp, f"{name}.csv")
            log = os.path.join(out_dir, f"{name}.log")
            command = [sys.executable, os.path.join(HERE, script), *(smoke if args.smoke else quick), "--csv", part]
            print(f"[{index}/{len(names)}] {name}: {' '.join(os.path.relpath(c) if c.endswith('.py') else c for c in command[1:-2])} ...",
                  end="", flush=True)
            start = time.perf_counter()
            with open(log, "w") as f:
                code = subprocess.call(command, stdout=f, stderr=subprocess.STDOUT)
            elapsed = time.perf_counter() - start
            status = "ok" if code == 0 else f"FAILED (exit {code}, see {os.path.relpath(log)})"
            print(f" {status}, {elapsed:.0f} s (total {time.perf_counter() - total_start:.0f} s)", flush=True)
            if code != 0:
                failed.append(name)
            if os.path.exists(part):
                with open(part, newline="") as f:
                    rows.extend(csv.DictReader(f))
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=_results.COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    print()
    print("| benchmark | metric | value | unit |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['benchmark']} | {r['metric']} | {r['value']} | {r['unit']} |")
    print()
    print(f"{len(rows)} rows -> {os.path.relpath(args.out)}; {time.perf_counter() - total_start:.0f} s in all"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
