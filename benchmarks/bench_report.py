"""`overflow-fast report` on generated logs: MB/s and peak RSS, per engine (DuckDB, the json reader),
beside another checkout's (``--against``: the same commands, run for run alternated).

Logs, written under a temporary directory (never in the repository) and reused when present:
- 100 MB: one rank, 150 modules x 3 entries a step (a GPT-2-small-sized forward), ~2,300 steps;
- 1 GB: four ranks' files of 256 MB, 300,000 modules (each rank records all of them, and half
  of them again in a second step);
- a hostile one: a few steps whose module name is 256 KiB, for the text and ``--png`` (the picture
  of a valid log, however hostile, within a few times the text's time).
Values drift so that headroom, subnormals, all-zero entries and one overflow all occur.

Each run is `python -m overflow_fast report FILES --engine E` in a child process; its wall time
gives MB/s (file bytes / seconds) and its peak RSS comes from wait4(). The json reader is timed on
the 100 MB log only (``--python-1gb`` times it on the 1 GB one: minutes).

Run: python benchmarks/bench_report.py [--dir /tmp/overflow_fast_bench] [--runs 3] [--png] [--quick]
     [--against PATH_OF_ANOTHER_CHECKOUT]
"""

import argparse
import os
import random
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402
import _shared  # noqa: E402

_LINE = ('{{"record":"entry","step":{step},"phase":"{phase}","call":{call},"module":"{module}",'
         '"class":"{cls}","entry":"{entry}","dtype":"{dtype}","numel":{numel},"abs_min":{amin},'
         '"abs_max":{amax},"nan":{nan},"posinf":{posinf},"neginf":0,"zero_frac":{zf},'
         '"subnormal_frac":{sf},"rank":{rank}}}\n')


def write_log(path, size, modules, entries, rank=None, world_size=None, seed=0):
    """Write ``size`` bytes of records: every step, every module, every entry, until full."""
    rng = random.Random(seed)
    names = [f"model.layers.{i // 8}.{('attn', 'mlp', 'norm', 'proj')[i % 4]}.{i % 8}" for i in range(modules)]
    classes = ("Linear", "LayerNorm", "Attention", "MLP")
    rank_text = "null" if rank is None else str(rank)
    with open(path + ".part", "w") as f:
        f.write(f'{{"record":"meta","version":1,"rank":{rank_text},"world_size":'
                f'{"null" if world_size is None else world_size},"started":"bench","pid":1,"torch":"bench"}}\n')
        written = 0
        step = 0
        batch = []
        while written < size:
            for m, name in enumerate(names):
                for e, entry in enumerate(entries):
                    amax = rng.uniform(0.5, 8.0) * (1.0 + step / 50.0) * (1 + m % 7)
                    bad = m == 7 and step == 700
                    line = _LINE.format(
                        step=step, phase="forward" if e < 2 else "backward", call=m, module=name,
                        cls=classes[m % 4], entry=entry, dtype="float16" if m % 3 else "bfloat16",
                        numel=4096 * (1 + m % 5), amin=repr(rng.uniform(0, 1e-3)),
                        amax='"inf"' if bad else repr(min(amax, 60000.0)), nan=0, posinf=int(bad),
                        zf=1.0 if (m % 97 == 0 and e == 0) else 0.0,
                        sf=repr(rng.uniform(0, 0.05)) if m % 11 == 0 else 0.0, rank=rank_text)
                    batch.append(line)
                    written += len(line)
                    if written >= size:
                        break
                if len(batch) >= 4096:
                    f.write("".join(batch))
                    batch = []
                if written >= size:
                    break
            step += 1
        f.write("".join(batch))
    os.replace(path + ".part", path)


def ensure_logs(directory, quick=False):
    """The two logs (written once; ``quick``: 1 MB and 4 MB ones with 3,000 modules, for tests)."""
    os.makedirs(directory, exist_ok=True)
    small_mb, large_mb, modules = (1, 4, 3000) if quick else (100, 1024, 300_000)
    small = os.path.join(directory, f"report-{small_mb}mb.jsonl")
    if not os.path.exists(small):
        write_log(small, small_mb << 20, modules=150, entries=("weight", "output", "weight.grad"))
    large = [os.path.join(directory, f"report-{large_mb}mb.rank{r}.jsonl") for r in range(4)]
    for rank, path in enumerate(large):
        if not os.path.exists(path):
            write_log(path, (large_mb << 20) // 4, modules=modules, entries=("weight", "output"), rank=rank,
                      world_size=4, seed=rank)
    large_label = "1 GB" if large_mb == 1024 else f"{large_mb} MB"
    return {f"{small_mb} MB (1 rank, 150 modules)": [small],
            f"{large_label} (4 ranks, {modules // 1000}k modules)": large}


def hostile_log(directory, name_bytes=256 << 10, steps=20):
    """A valid log whose first module's name is ``name_bytes`` long, written once."""
    path = os.path.join(directory, f"report-hostile-{name_bytes >> 10}k.jsonl")
    if not os.path.exists(path):
        name = "layers." + "x" * name_bytes
        with open(path, "w") as f:
            for step in range(steps):
                for module, amax in ((name, 100.0 * (step + 1)), ("short", 2.0)):
                    f.write(_LINE.format(step=step, phase="forward", call=0, module=module, cls="Linear",
                                         entry="output", dtype="float16", numel=64, amin="0.1", amax=amax, nan=0,
                                         posinf=0, zf=0.0, sf=0.0, rank="null"))
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "overflow_fast_bench"))
    parser.add_argument("--runs", type=int, default=3, help="runs per case; the median is reported")
    parser.add_argument("--png", action="store_true", help="also time --png (DuckDB)")
    parser.add_argument("--python-1gb", action="store_true", help="also time the json reader on 1 GB")
    parser.add_argument("--quick", action="store_true", help="1 MB and 4 MB logs, one run (a smoke test)")
    parser.add_argument("--against", metavar="PATH", help="another checkout, timed beside this one")
    args = parser.parse_args(argv)
    if args.quick:
        args.runs, args.python_1gb = 1, True
    logs = ensure_logs(args.dir, quick=args.quick)
    try:
        import duckdb
        duck = duckdb.__version__
    except ImportError:
        duck = None
    print(f"CPU: {_results.cpu_model()} ({_results.avx_level()}), {os.cpu_count()} cores; DuckDB "
          f"{duck or 'not installed'}; Python {sys.version.split()[0]}; medians of {args.runs} runs; load average "
          f"{os.getloadavg()[0]:.2f} (other work on this machine takes CPU from the runs: MB per CPU second is the "
          f"figure load changes least)")
    cases = []
    for label, files in logs.items():
        size = sum(os.path.getsize(f) for f in files) / 1e6
        engines = (["duckdb"] if duck else []) + (["python"] if "1 GB" not in label or args.python_1gb else [])
        for engine in engines:
            command = ["report", *files, "--engine", engine, "--no-progress"]
            cases.append((f"{label}, {engine}", size, command, command))
            if args.png and engine == "duckdb":
                png = command + ["--png", os.path.join(args.dir, "report.png")]
                cases.append((f"{label}, {engine} --png", size, png, png))
    hostile = hostile_log(args.dir)
    size = os.path.getsize(hostile) / 1e6
    for png in ([], ["--png", os.path.join(args.dir, "hostile.png")]):
        command = ["report", hostile, "--no-progress", *png]
        cases.append((f"256 KiB module name{' --png' if png else ''}", size, command, command))
    outputs = _shared.compare_commands(cases, args.runs, args.against, label_width=44)
    for label in logs:
        texts = [outputs[key] for key in ((f"{label}, duckdb", "now"), (f"{label}, python", "now")) if key in outputs]
        if len(texts) == 2:
            print(f"{label}: the two engines' summaries are {'identical' if texts[0] == texts[1] else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
