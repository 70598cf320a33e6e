"""`overflow-fast diff` on generated logs: MB/s and peak RSS, per engine, beside `overflow-fast
report` reading the same bytes, and beside another checkout (``--against``: the same commands, run
for run alternated; that checkout's `diff` runs as its own default does).

Two logs written together under a temporary directory (never in the repository), reused when
present: the report benchmark's shape (one rank, 150 modules x 3 entries a step, lines as the
recorder writes them), the same values in both until 60% of the steps, then one module and every
module after it drifting apart in B, and B stopping 5% of the steps early. Default: 512 MB each,
1 GB in all (`--mb` per log). With `--extra`, also a B that records one module more than A every
step.

Each run is `python -m overflow_fast diff A B --engine E` (or `report A B --engine duckdb`) in a
child process; its wall time gives MB/s (both files' bytes / seconds), its CPU seconds and peak RSS
come from wait4(). The json reader is timed on 1/10 of the logs' size (``--python``: it reads at
about a tenth of DuckDB's speed).

Run: python benchmarks/bench_diff.py [--dir /tmp/overflow_fast_bench] [--runs 3] [--mb 512] [--quick]
     [--python] [--against PATH_OF_ANOTHER_CHECKOUT]
"""

import argparse
import os
import random
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _results  # noqa: E402
import _shared  # noqa: E402
from bench_report import _LINE  # noqa: E402

MODULES = 150
ENTRIES = ("weight", "output", "weight.grad")


def write_pair(path_a, path_b, size, seed=0, extra=False):
    """Write ``size`` bytes of records to A and about as many to B (see the module's docstring);
    ``extra``: B also records a module that A does not have, every step (the alignment then
    leaves and takes up again its record-by-record pace each step)."""
    rng = random.Random(seed)
    names = [f"model.layers.{i // 8}.{('attn', 'mlp', 'norm', 'proj')[i % 4]}.{i % 8}" for i in range(MODULES)]
    classes = ("Linear", "LayerNorm", "Attention", "MLP")
    step_bytes = MODULES * len(ENTRIES) * 300  # about
    steps = max(size // step_bytes, 10)
    part_at, b_ends = int(steps * 0.6), int(steps * 0.95)
    meta = '{"record":"meta","version":1,"rank":null,"world_size":null,"started":"bench","pid":1,"torch":"bench"}\n'
    with open(path_a + ".part", "w") as fa, open(path_b + ".part", "w") as fb:
        fa.write(meta)
        fb.write(meta)
        written = 0
        step = 0
        while written < size:
            lines_a, lines_b = [], []
            for m, name in enumerate(names):
                if extra and m == 20 and step < b_ends:
                    lines_b.extend(_LINE.format(step=step, phase="forward", call=m, module="model.extra",
                                                cls="Linear", entry=entry, dtype="float32", numel=64,
                                                amin="0.001", amax="1.0", nan=0, posinf=0, zf=0.0, sf=0.0,
                                                rank="null") for entry in ENTRIES[:2])
                for e, entry in enumerate(ENTRIES):
                    amax = rng.uniform(0.5, 8.0) * (1.0 + step / 50.0) * (1 + m % 7)
                    fields = dict(step=step, phase="forward" if e < 2 else "backward", call=m, module=name,
                                  cls=classes[m % 4], entry=entry, dtype="float16" if m % 3 else "bfloat16",
                                  numel=4096 * (1 + m % 5), amin=repr(rng.uniform(0, 1e-3)), nan=0, posinf=0,
                                  zf=0.0, sf=repr(rng.uniform(0, 0.05)) if m % 11 == 0 else 0.0, rank="null")
                    lines_a.append(_LINE.format(amax=repr(min(amax, 60000.0)), **fields))
                    if step < b_ends:
                        drift = 1.0 + 0.01 * (step - part_at + 1) if step >= part_at and m >= 40 else 1.0
                        lines_b.append(_LINE.format(amax=repr(min(amax * drift, 60000.0)), **fields))
            text = "".join(lines_a)
            fa.write(text)
            fb.write("".join(lines_b))
            written += len(text)
            step += 1
    os.replace(path_a + ".part", path_a)
    os.replace(path_b + ".part", path_b)


def logs(directory, mb, extra):
    """[(label, A, B)]: the pair of logs of ``mb`` MB each (written once), and with ``extra`` the
    A against a B with one module more."""
    os.makedirs(directory, exist_ok=True)
    a, b = (os.path.join(directory, f"diff-{mb}mb-{side}.jsonl") for side in "ab")
    if not (os.path.exists(a) and os.path.exists(b)):
        write_pair(a, b, mb << 20)
    pairs = [("same modules", a, b)]
    if extra:
        b_extra = os.path.join(directory, f"diff-{mb}mb-b-extra.jsonl")
        if not os.path.exists(b_extra):
            write_pair(b_extra + ".a", b_extra, mb << 20, extra=True)
            os.remove(b_extra + ".a")  # the same A as above
        pairs.append(("B: one module more", a, b_extra))
    return pairs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "overflow_fast_bench"))
    parser.add_argument("--runs", type=int, default=3, help="runs per case; the median is reported")
    parser.add_argument("--mb", type=int, default=512, help="MB per log (default 512: 1 GB in all)")
    parser.add_argument("--quick", action="store_true", help="2 MB logs, one run (a smoke test)")
    parser.add_argument("--extra", action="store_true", help="also diff against a B with one module more")
    parser.add_argument("--python", action="store_true", help="also time the json reader (on logs a tenth the size)")
    parser.add_argument("--against", metavar="PATH", help="another checkout, timed beside this one")
    args = parser.parse_args(argv)
    if args.quick:
        args.runs, args.mb, args.python = 1, 2, True
    try:
        import duckdb
        duck = duckdb.__version__
    except ImportError:
        duck = None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"CPU: {_results.cpu_model()} ({_results.avx_level()}), {cpus} cores; DuckDB {duck or 'not installed'}; "
          f"Python {sys.version.split()[0]}; medians of {args.runs} runs; load average {os.getloadavg()[0]:.2f}")
    cases = []
    for label, path_a, path_b in logs(args.dir, args.mb, args.extra):
        size = (os.path.getsize(path_a) + os.path.getsize(path_b)) / 1e6
        if duck:
            cases.append((f"{label}: diff --engine duckdb", size, ["diff", path_a, path_b, "--engine", "duckdb"],
                          ["diff", path_a, path_b]))
            report = ["report", path_a, path_b, "--engine", "duckdb", "--no-progress"]
            cases.append((f"{label}: report A B --engine duckdb", size, report, report))
    if args.python:
        label, path_a, path_b = logs(args.dir, max(args.mb // 10, 1), False)[0]
        size = (os.path.getsize(path_a) + os.path.getsize(path_b)) / 1e6
        cases.append((f"{label} (1/10): diff --engine python", size, ["diff", path_a, path_b, "--engine", "python"],
                      ["diff", path_a, path_b, "--jobs", "1"], {"OVERFLOW_FAST_WITHOUT_EXTENSION": "1"}))
    print(f"logs: {args.mb} MB each ({MODULES} modules x {len(ENTRIES)} entries a step; B parts at 60% of the steps "
          f"and ends at 95%)")
    outputs = _shared.compare_commands(cases, args.runs, args.against, label_width=46)
    for label, _, _ in logs(args.dir, args.mb, args.extra):
        for tree in ("now", "before"):
            texts = {out for (case, which), out in outputs.items() if which == tree and case.startswith(f"{label}: diff")}
            first = next((line for line in next(iter(texts), "").splitlines() if line.startswith("first parting")), "?")
            if texts:
                print(f"{label} ({tree}): the diffs' texts are {'identical' if len(texts) == 1 else 'DIFFERENT'}; {first}")


if __name__ == "__main__":
    main()
