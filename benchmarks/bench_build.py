"""How long the C++ kernel's build takes, and what the compiler says.

Builds the kernel from the checkout's csrc/ exactly as the first use does (cpu_build.build:
torch.utils.cpp_extension.load, ninja, every unit with this instruction set's flags), into an
empty folder, in a child process, and reports the wall time, the CPU time of the compilers
(user + sys of the child and its children), each unit's time from ninja's log, the compiler
warnings printed and the load average before and after (the machine is shared: other sessions'
compilers slow a build down, never the CPU time much).

    .venv/bin/python benchmarks/bench_build.py [--isa avx512|avx2|baseline] [--jobs 2] [--csv PATH]
"""

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

_CHILD = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("cpu_build", sys.argv[1])
cpu_build = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cpu_build)
cpu_build.build(sys.argv[2], sys.argv[3], verbose=True)
"""


def unit_times(build_dir):
    """{output: seconds} from ninja's log (start and end in ms on its lines)."""
    times = {}
    log = Path(build_dir) / ".ninja_log"
    for line in log.read_text().splitlines()[1:]:
        start, end, _, output, _ = line.split("\t")
        times[output] = (int(end) - int(start)) / 1000
    return times


def _cpu_build():
    # by path: importing the package would load (or build) the kernel in this process first
    import importlib.util

    spec = importlib.util.spec_from_file_location("cpu_build", ROOT / "overflow_fast" / "stats" / "cpu_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None):
    cpu_build = _cpu_build()

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--isa", default=None, help="default: this CPU's best (cpu_build.detect_isa())")
    parser.add_argument("--jobs", type=int, default=2, help="MAX_JOBS, ninja's parallel compilers (default 2)")
    parser.add_argument("--csv", metavar="PATH")
    args = parser.parse_args(argv)
    isa = args.isa or cpu_build.detect_isa()
    env = dict(os.environ, MAX_JOBS=str(args.jobs))
    with tempfile.TemporaryDirectory() as scratch:
        load_before = os.getloadavg()[0]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(ROOT / "overflow_fast" / "stats" / "cpu_build.py"),
                               isa, scratch], env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        load_after = os.getloadavg()[0]
        if proc.returncode != 0:
            sys.exit(proc.stdout[-3000:] + proc.stderr[-3000:])
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        output = proc.stdout + proc.stderr
        warnings = [line for line in output.splitlines() if "warning:" in line]
        units = unit_times(scratch)
    print(f"CPU: {_results.cpu_model()} ({_results.avx_level()}), {os.cpu_count()} cores; build for {isa}, "
          f"MAX_JOBS={args.jobs}")
    print(f"load average (1 min) before {load_before:.2f}, after {load_after:.2f}")
    print(f"wall {wall:.1f} s, CPU {cpu:.1f} s (user + sys, every process of the build)")
    print(f"compiler warnings: {len(warnings)}")
    for line in warnings[:10]:
        print("  " + line)
    for output_name, seconds in sorted(units.items(), key=lambda item: -item[1]):
        print(f"  {output_name:28s} {seconds:6.1f} s")
    if args.csv:
        rows = [(f"wall {isa}", wall, "s"), (f"cpu {isa}", cpu, "s"), (f"warnings {isa}", len(warnings), "lines"),
                (f"load before {isa}", load_before, "1-min load")]
        rows += [(f"unit {name}", seconds, "s") for name, seconds in units.items()]
        _results.write_rows(args.csv, "build", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
