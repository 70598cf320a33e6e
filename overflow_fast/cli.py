"""``overflow-fast`` / ``python -m overflow_fast``: commands over flight-recorder logs.

``report RUN.jsonl [RUN.rank1.jsonl ...] [--png OUT.png]`` streams the records line by line
(bounded memory: aggregates per module and per step bin, never the records themselves) and prints
a summary; ``--png`` draws headroom per module over steps (matplotlib, ``overflow_fast[plot]``).

Exit codes: 0 ok, 1 a file that cannot be read or has no records (or matplotlib missing for
``--png``), 2 a usage error.
"""

import argparse
import json
import math
import os
import sys
import time

MAX_COLUMNS = 200  # step bins are merged in pairs when there would be 2 * MAX_COLUMNS (400) or more
TOP = 10
PROGRESS_BYTES = 32 << 20  # files above this show progress (on a terminal)

_DTYPE_MAX = {}


def dtype_max(name):
    """Largest finite value of a floating (or complex) dtype by name; None for integers, bool and
    unknown names."""
    if name not in _DTYPE_MAX:
        value = None
        try:
            import torch

            dtype = getattr(torch, name, None)
            if isinstance(dtype, torch.dtype) and (dtype.is_floating_point or dtype.is_complex):
                value = float(torch.finfo(dtype).max)
        except Exception:
            value = None
        _DTYPE_MAX[name] = value
    return _DTYPE_MAX[name]


def _number(value):
    if isinstance(value, str):
        return float(value)  # "nan", "inf", "-inf"
    return value


class BadFile(Exception):
    pass


class Summary:
    """Everything the report needs, aggregated record by record in bounded memory."""

    def __init__(self, max_columns=MAX_COLUMNS):
        self.max_columns = max_columns
        self.lines = 0
        self.records = 0
        self.entries = 0
        self.malformed = 0
        self.malformed_lines = []  # the first few, as (file, line number)
        self.metas = []
        self.phases = {}
        self.ranks = set()
        self.step_bits = bytearray()  # one bit per step number seen
        self.negative_steps = set()
        self.first_step = None
        self.last_step = None
        self.first_nonfinite = None  # the entry record
        self.first_nonfinite_key = None
        self.detections = []  # the first few detection records
        self.detection_count = 0
        # per module (first-appearance order): class and its lowest-headroom entry
        self.modules = {}  # name -> {"class", "row", "min": (headroom, record summary)}
        # per (module, entry): the worst subnormal fraction, all-zero steps
        self.subnormal = {}  # (module, entry) -> (frac, step, dtype, numel)
        self.all_zero = {}  # (module, entry) -> [count, first step, dtype, numel]
        # heatmap: per module a list of bins (min headroom, or None), and non-finite bins
        self.origin = None
        self.width = 1
        self.bins = {}  # module -> list of float|None
        self.bad_bins = {}  # module -> set of bin indices that had a nan/inf
        self.nonfinite_bin = None

    # -- steps and bins --

    def _see_step(self, step):
        if step < 0:
            self.negative_steps.add(step)
        else:
            byte = step >> 3
            if byte >= len(self.step_bits):
                self.step_bits.extend(bytes(max(byte + 1 - len(self.step_bits), len(self.step_bits))))
            self.step_bits[byte] |= 1 << (step & 7)
        self.first_step = step if self.first_step is None else min(self.first_step, step)
        self.last_step = step if self.last_step is None else max(self.last_step, step)

    @property
    def step_count(self):
        return sum(bin(b).count("1") for b in self.step_bits) + len(self.negative_steps)

    def steps_in(self, first, last):
        """How many recorded steps lie in [first, last]."""
        count = sum(1 for step in self.negative_steps if first <= step <= last)
        return count + sum(1 for step in range(max(first, 0), min(last, 8 * len(self.step_bits) - 1) + 1)
                           if self.step_bits[step >> 3] >> (step & 7) & 1)

    def _bin(self, step):
        if self.origin is None:
            self.origin = step
        if step < self.origin:  # an earlier step than any before: move the origin down by whole bins
            shift = -(-(self.origin - step) // self.width)
            self.origin -= shift * self.width
            for module, cells in self.bins.items():
                cells[:0] = [None] * shift
            for module, bad in self.bad_bins.items():
                self.bad_bins[module] = {b + shift for b in bad}
            if self.nonfinite_bin is not None:
                self.nonfinite_bin += shift
        index = (step - self.origin) // self.width
        while index >= 2 * self.max_columns:
            self._merge()
            index = (step - self.origin) // self.width
        return index

    def _merge(self):
        self.width *= 2
        for module, cells in self.bins.items():
            merged = []
            for i in range(0, len(cells), 2):
                pair = [c for c in cells[i:i + 2] if c is not None]
                merged.append(min(pair) if pair else None)
            self.bins[module] = merged
        for module, bad in self.bad_bins.items():
            self.bad_bins[module] = {b // 2 for b in bad}
        if self.nonfinite_bin is not None:
            self.nonfinite_bin //= 2

    def bin_steps(self, index):
        """The steps [first, last] that bin ``index`` covers."""
        start = self.origin + index * self.width
        return start, start + self.width - 1

    # -- records --

    def add_line(self, raw, source, number):
        self.lines += 1
        if not raw.strip():
            return
        try:
            record = json.loads(raw)
            if not isinstance(record, dict):
                raise ValueError("not an object")
            kind = record.get("record")
            if kind == "entry":
                self._add_entry(record, source)
            elif kind == "meta":
                if len(self.metas) < 64:
                    self.metas.append(record)
                if isinstance(record.get("rank"), int):
                    self.ranks.add(record["rank"])
            elif kind == "detection":
                self.detection_count += 1
                if len(self.detections) < 5:
                    self.detections.append(record)
            else:
                raise ValueError(f"unknown record {kind!r}")
            self.records += 1
        except (ValueError, TypeError, KeyError, OverflowError):
            self.malformed += 1
            if len(self.malformed_lines) < 5:
                self.malformed_lines.append((source, number))

    def _add_entry(self, record, source):
        step = record["step"]
        if not isinstance(step, int) or isinstance(step, bool):
            raise ValueError("step is not an integer")
        module = record["module"]
        entry = record["entry"]
        dtype = record["dtype"]
        numel = record["numel"]
        abs_max = _number(record["abs_max"])
        nonfinite = (record["nan"] or record["posinf"] or record["neginf"]
                     or (isinstance(abs_max, float) and not math.isfinite(abs_max)))
        zero_frac = float(record["zero_frac"])
        subnormal_frac = float(record["subnormal_frac"])
        phase = record["phase"]
        rank = record.get("rank")

        self.entries += 1
        self._see_step(step)
        self.phases[phase] = self.phases.get(phase, 0) + 1
        if isinstance(rank, int):
            self.ranks.add(rank)
        info = self.modules.get(module)
        if info is None:
            info = self.modules[module] = {"class": record["class"], "min": None}
            self.bins[module] = []
        column = self._bin(step)
        cells = self.bins[module]

        if nonfinite:  # headroom used up: 0 in the heatmap (drawn black) and the curves
            self.bad_bins.setdefault(module, set()).add(column)
            if column >= len(cells):
                cells.extend([None] * (column + 1 - len(cells)))
            cells[column] = 0.0
            key = (step, rank if isinstance(rank, int) else -1)
            if self.first_nonfinite is None or key < self.first_nonfinite_key:
                self.first_nonfinite = {k: record.get(k) for k in
                                        ("step", "phase", "module", "class", "entry", "dtype", "rank",
                                         "nan", "posinf", "neginf", "abs_max")}
                self.first_nonfinite["source"] = source
                self.first_nonfinite_key = key
                self.nonfinite_bin = column
        else:
            limit = dtype_max(dtype)
            if limit is not None and abs_max is not None and abs_max > 0:
                headroom = math.log2(limit / abs_max) if abs_max <= limit else 0.0
                if column >= len(cells):
                    cells.extend([None] * (column + 1 - len(cells)))
                if cells[column] is None or headroom < cells[column]:
                    cells[column] = headroom
                if info["min"] is None or headroom < info["min"][0]:
                    info["min"] = (headroom, entry, dtype, step, phase, abs_max)

        if numel:
            key = (module, entry)
            if subnormal_frac > 0:
                best = self.subnormal.get(key)
                if best is None or subnormal_frac > best[0]:
                    self.subnormal[key] = (subnormal_frac, step, dtype, numel)
            if zero_frac >= 1.0:
                zero = self.all_zero.get(key)
                if zero is None:
                    self.all_zero[key] = [1, step, dtype, numel]
                else:
                    zero[0] += 1

    # -- results --

    def hottest(self, n=TOP):
        """(module, class, (headroom, entry, dtype, step, phase, abs_max)), lowest headroom first."""
        rows = [(name, info["class"], info["min"]) for name, info in self.modules.items() if info["min"]]
        rows.sort(key=lambda row: row[2][0])
        return rows[:n]

    def columns(self):
        """Indices of the step bins that hold any record, in order."""
        used = set()
        for cells in self.bins.values():
            used.update(i for i, c in enumerate(cells) if c is not None)
        for bad in self.bad_bins.values():
            used.update(bad)
        return sorted(used)


def read_files(paths, summary, progress=None):
    """Stream every line of every file into ``summary``; raise BadFile for a missing file."""
    total = 0
    for path in paths:
        try:
            total += os.path.getsize(path)
        except OSError as error:
            raise BadFile(f"cannot read {path}: {error.strerror or error}") from None
    bar = _progress(total, progress)
    try:
        for path in paths:
            try:
                handle = open(path, "rb")
            except OSError as error:
                raise BadFile(f"cannot read {path}: {error.strerror or error}") from None
            with handle:
                pending = 0
                for number, raw in enumerate(handle, 1):
                    summary.add_line(raw, path, number)
                    pending += len(raw)
                    if pending >= 1 << 20:
                        bar.update(pending)
                        pending = 0
                bar.update(pending)
    finally:
        bar.close()


class _NoProgress:
    def update(self, n):
        pass

    def close(self):
        pass


class _PlainProgress:
    """A periodic line on stderr when tqdm is not installed."""

    def __init__(self, total):
        self.total = max(total, 1)
        self.done = 0
        self.last = 0.0

    def update(self, n):
        self.done += n
        now = time.monotonic()
        if now - self.last >= 2.0:
            self.last = now
            sys.stderr.write(f"reading: {self.done / 1e6:.0f} / {self.total / 1e6:.0f} MB "
                             f"({100 * self.done / self.total:.0f}%)\n")
            sys.stderr.flush()

    def close(self):
        sys.stderr.write(f"reading: done, {self.done / 1e6:.0f} MB\n")


def _progress(total, forced):
    """tqdm (or a plain line) on stderr: for big files on a terminal, or always with --progress."""
    if forced is False:
        return _NoProgress()
    if forced is None and not (total >= PROGRESS_BYTES and sys.stderr.isatty()):
        return _NoProgress()
    try:
        from tqdm import tqdm
    except ImportError:
        return _PlainProgress(total)
    return tqdm(total=total, unit="B", unit_scale=True, desc="reading", file=sys.stderr, mininterval=0.5)


def _module_label(name, class_name=None):
    label = name if name else "(model)"
    return f"{label} ({class_name})" if class_name else label


def summary_text(summary, paths):
    out = []
    if len(paths) == 1:
        out.append(f"flight recorder log: {paths[0]}")
    else:
        out.append(f"flight recorder logs: {len(paths)} files")
    out.append(f"records: {summary.records} ({summary.entries} tensor entries)"
               + (f", malformed lines: {summary.malformed}" if summary.malformed else ""))
    if summary.malformed_lines:
        where = ", ".join(f"{os.path.basename(s)}:{n}" for s, n in summary.malformed_lines)
        out.append(f"  malformed lines skipped (first): {where}")
    if summary.entries:
        out.append(f"steps recorded: {summary.step_count} (first {summary.first_step}, last {summary.last_step})")
        phases = ", ".join(f"{p} ({n} entries)" for p, n in summary.phases.items())
        out.append(f"phases: {phases}")
    else:
        out.append("steps recorded: 0")
    ranks = sorted(summary.ranks)
    out.append(f"ranks: {', '.join(map(str, ranks)) if ranks else 'none (not distributed)'}")
    out.append("")

    first = summary.first_nonfinite
    if first is None:
        out.append("first non-finite value: no nan/inf recorded")
    else:
        kinds = [k for k in ("nan", "posinf", "neginf") if first.get(k)]
        what = ", ".join(f"{first[k]} {'+inf' if k == 'posinf' else '-inf' if k == 'neginf' else 'nan'}"
                         for k in kinds) or f"abs max {first.get('abs_max')}"
        rank = f", rank {first['rank']}" if isinstance(first.get("rank"), int) else ""
        out.append(f"first non-finite value: step {first['step']}, {first['phase']}{rank}, "
                   f"module {_module_label(first['module'], first['class'])}, entry {first['entry']} "
                   f"[{first['dtype']}]: {what}")
    for det in summary.detections[:1]:
        out.append(f"detection record: step {det.get('step')}, {det.get('phase')}, module "
                   f"{_module_label(det.get('module', ''), det.get('class'))}, entries {det.get('entries')}")
    out.append("")

    hottest = summary.hottest()
    out.append("closest to the dtype's limit (headroom = log2(dtype max / abs max), in bits; lowest first):")
    if not hottest:
        out.append("  (no finite floating-point values recorded)")
    else:
        out.append(f"  {'bits':>6}  {'abs max':>9}  {'dtype':<9} {'step':>7}  module / entry")
        for name, class_name, (headroom, entry, dtype, step, phase, abs_max) in hottest:
            out.append(f"  {headroom:6.2f}  {abs_max:9.3g}  {dtype:<9} {step:>7}  "
                       f"{_module_label(name, class_name)} {entry} ({phase})")
    out.append("")

    out.append("underflow hot spots (largest fraction of subnormal values):")
    subnormal = sorted(summary.subnormal.items(), key=lambda kv: -kv[1][0])[:TOP]
    if not subnormal:
        out.append("  (no subnormal values recorded)")
    for (module, entry), (frac, step, dtype, numel) in subnormal:
        out.append(f"  {100 * frac:6.2f}%  of {numel:>9} {dtype:<9} at step {step:>7}  {_module_label(module)} {entry}")
    zeros = sorted(summary.all_zero.items(), key=lambda kv: (-kv[1][0], kv[1][1]))
    out.append("entries that are all zeros:")
    if not zeros:
        out.append("  (none)")
    for (module, entry), (count, step, dtype, numel) in zeros[:TOP]:
        out.append(f"  {count:>6} step(s) from step {step:>7}  {_module_label(module)} {entry} "
                   f"[{dtype}, {numel} elements]")
    if len(zeros) > TOP:
        out.append(f"  ... and {len(zeros) - TOP} more")
    return "\n".join(out)


def build_parser():
    parser = argparse.ArgumentParser(
        prog="overflow-fast", description="Commands over overflow_fast flight-recorder logs (JSONL).")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    report = commands.add_parser(
        "report", help="summarise a recorded run; --png draws headroom per module over steps",
        description="Summarise a flight-recorder log: steps, the first nan/inf, the modules closest to "
                    "their dtype's limit, underflow hot spots. With --png, draw a heatmap of headroom "
                    "(bits below the dtype's largest finite value) per module over steps.")
    report.add_argument("logs", nargs="+", metavar="RUN.jsonl", help="log file(s), e.g. one per rank")
    report.add_argument("--png", metavar="OUT.png", help="write a picture (needs matplotlib: "
                                                         "pip install overflow_fast[plot])")
    report.add_argument("--size", metavar="WxH", type=_size, default=None,
                        help="picture size in pixels (default: from the number of modules)")
    report.add_argument("--curves", type=int, default=5, metavar="N",
                        help="headroom curves of the N hottest modules under the heatmap (default 5)")
    progress = report.add_mutually_exclusive_group()
    progress.add_argument("--progress", dest="progress", action="store_true", default=None,
                          help="always show progress on stderr")
    progress.add_argument("--no-progress", dest="progress", action="store_false",
                          help="never show progress")
    commands.add_parser("info", help="what runs here: versions, the C++ kernel, backends, devices")
    return parser


def _size(text):
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT in pixels, e.g. 1600x1000, got {text!r}")
    if not (100 <= width <= 10000 and 100 <= height <= 10000):
        raise argparse.ArgumentTypeError("width and height must be between 100 and 10000 pixels")
    return width, height


def run_report(args):
    plot = None
    if args.png:  # fail before reading a big file
        try:
            from . import plot
        except ImportError as error:
            print(f"overflow-fast: --png needs matplotlib ({error}); install it with: "
                  f"pip install overflow_fast[plot]", file=sys.stderr)
            return 1
    summary = Summary()
    try:
        read_files(args.logs, summary, progress=args.progress)
    except BadFile as error:
        print(f"overflow-fast: {error}", file=sys.stderr)
        return 1
    if summary.records == 0:
        print(f"overflow-fast: no flight-recorder records in {', '.join(args.logs)}"
              + (f" ({summary.malformed} malformed lines)" if summary.malformed else ""), file=sys.stderr)
        return 1
    print(summary_text(summary, args.logs))
    if plot is not None:
        if not summary.entries:
            print("overflow-fast: no tensor entries to draw", file=sys.stderr)
            return 1
        try:
            size = plot.draw(summary, args.png, size=args.size, curves=args.curves,
                             title_source=", ".join(os.path.basename(p) for p in args.logs))
        except OSError as error:
            print(f"overflow-fast: cannot write {args.png}: {error.strerror or error}", file=sys.stderr)
            return 1
        print(f"\npicture: {args.png} ({size[0]}x{size[1]} pixels)")
    return 0


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)  # usage errors exit with 2
    if args.command == "report":
        return run_report(args)
    if args.command == "info":
        from .info import main as info_main
        return info_main()
    parser.error(f"unknown command {args.command!r}")


if __name__ == "__main__":
    sys.exit(main())
