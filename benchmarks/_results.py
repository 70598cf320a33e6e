"""Machine-readable benchmark output shared by the scripts in benchmarks/ (``--csv PATH``).

Every row is ``benchmark, metric, value, unit`` plus the machine it ran on: CPU model, AVX level,
torch's thread count, torch version and the date, so that a figure quoted in RESULTS.md can be
traced to the run and the machine that produced it. Rows are appended (a header is written when
the file is new), so several scripts can write into one file.
"""

import csv
import datetime
import os
import platform

COLUMNS = ("benchmark", "metric", "value", "unit", "cpu_model", "avx", "threads", "torch", "date")


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def avx_level():
    """The widest AVX the CPU reports: AVX-512, AVX2, AVX or none (unknown off Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
            else:
                return "unknown"
    except OSError:
        return "unknown"
    for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX")):
        if flag in flags:
            return name
    return "none"


def machine():
    import torch

    return {
        "cpu_model": cpu_model(),
        "avx": avx_level(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def machine_line():
    m = machine()
    return (f"CPU {m['cpu_model']} ({m['avx']}, {os.cpu_count()} logical cores), "
            f"{m['threads']} torch threads, torch {m['torch']}")


def write_rows(path, benchmark, rows):
    """Append ``rows`` (tuples ``(metric, value, unit)``) of ``benchmark`` to the CSV at ``path``."""
    if not path:
        return
    m = machine()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    with open(path, "a", newline="") as f:
        writer = csv.writer(f)
        if new:
            writer.writerow(COLUMNS)
        for metric, value, unit in rows:
            if isinstance(value, float):
                value = f"{value:.6g}"
            writer.writerow((benchmark, metric, value, unit, m["cpu_model"], m["avx"], m["threads"],
                             m["torch"], m["date"]))
