"""What ``overflow-fast report`` knows about flight-recorder logs: the plain-Python reader and the
bounded summary that both readers (this one and ``logsummary_duckdb``) fill.

Every line is checked against ``schema.py``; a line that does not fit is counted and named with
the reason, never raised. Lines are read in pieces of at most ``schema.MAX_LINE_BYTES``: a longer
line is skipped without being held whole.

Memory is bounded whatever the input. The summary keeps, with a count of the rest:
- the ``max_modules`` modules with the least headroom (their lowest-headroom entry; and, for the
  picture, their lowest headroom per step bin, at most ``2 * max_columns`` bins);
- the ``max_keys`` (module, entry) pairs with the largest subnormal fraction, and as many that
  were all zeros most recently;
- the distinct steps, modules and all-zero entries, counted exactly up to ``distinct_cap``.
When more modules come than are kept, the ones furthest from their limit are dropped (a quarter at
a time). Every table the report prints (the ``TOP`` lowest headroom, largest subnormal fraction,
latest all-zero) is then still exact: an item dropped once can only be in a table if its deciding
record came after it was dropped, and it is kept from then on. In the picture, a module dropped
and taken back shows the steps from where it came back (the DuckDB reader has no such limit: it
aggregates in SQL and hands over only the kept modules, whole).

Positions order everything that "comes first": a record's position is (file index, its ordinal
among the non-blank lines of its file), so files count in the order given.
"""

import json
import math
import os

from . import schema
from .schema import Malformed

MAX_COLUMNS = 200  # step bins: fewer than 2 * MAX_COLUMNS (400) columns, each a power-of-two run of steps
TOP = 10
MAX_MODULES = 1024
PLOT_ROWS = 512  # heatmap rows; below 3/4 of MAX_MODULES, so the rows drawn are exact (see above)
MAX_KEYS = 1024
DISTINCT_CAP = 1 << 20
MAX_NAMED = 5  # malformed lines named in the summary
BLOCK = 1 << 20

_INF = float("inf")
POSITION_BITS = 40  # ordinal bits in a position: (file index << 40) | ordinal


def position(file_index, ordinal):
    return (file_index << POSITION_BITS) | ordinal


class BadFile(Exception):
    pass


# -- reading lines in bounded pieces -------------------------------------------------------------------

def read_chunks(handle, limit=schema.MAX_LINE_BYTES, size=BLOCK):
    """The file as a sequence of ``bytes`` that each hold whole lines (the last one may lack its
    newline) and ``None``, which stands for one line longer than ``limit`` bytes (not counting its
    newline), skipped in pieces of ``size``."""
    size = min(size, limit)  # a line inside one block is then never over the limit
    carry = []  # the start of a line that no block so far has ended
    carry_len = 0
    skipping = False  # inside an over-long line, already reported
    while True:
        block = handle.read(size)
        if not block:
            if carry and not skipping:
                yield b"".join(carry)
            return
        if skipping:
            newline = block.find(b"\n")
            if newline < 0:
                continue
            block = block[newline + 1:]
            skipping = False
            if not block:
                continue
        last = block.rfind(b"\n")
        first = block.find(b"\n") if carry else last
        if last < 0:  # no line ends in this block
            carry.append(block)
            carry_len += len(block)
            if carry_len > limit:
                yield None
                carry, carry_len, skipping = [], 0, True
            continue
        if carry:
            if carry_len + first > limit:
                yield None
                head = b""
            else:
                head = b"".join(carry) + block[:first + 1]
            carry, carry_len = [], 0
            rest = block[first + 1:last + 1]
            chunk = head + rest if head else rest
        else:
            chunk = block[:last + 1]
        if chunk:
            yield chunk
        tail = block[last + 1:]
        if tail:
            carry.append(tail)
            carry_len = len(tail)
            if carry_len > limit:
                yield None
                carry, carry_len, skipping = [], 0, True


def is_blank(raw):
    return not raw.strip()  # JSON whitespace and \x0b, \x0c: DuckDB's NDJSON reader skips the same


def _first_wins(pairs):
    # a key written twice: the first value counts, as in DuckDB's reader
    return dict(reversed(pairs))


_decoder = json.JSONDecoder(object_pairs_hook=_first_wins)


def parse_line(raw):
    """A line (bytes) -> (kind, record); raises Malformed with the reason."""
    try:
        text = raw.strip().decode("utf-8")
    except UnicodeDecodeError:
        raise Malformed("not UTF-8") from None
    try:
        record = _decoder.decode(text)
    except RecursionError:
        raise Malformed("nested too deeply") from None
    except ValueError:
        raise Malformed("not JSON") from None
    return schema.check(record), record


# -- the summary -----------------------------------------------------------------------------------------

class _Distinct:
    """Distinct values counted exactly up to ``cap`` (then only "more than cap"); the values are
    hashes, and ``extra`` counts values counted elsewhere (by the DuckDB reader)."""

    def __init__(self, cap):
        self.cap = cap
        self.seen = set()
        self.extra = 0
        self.over = False

    def add(self, value):
        if not self.over:
            self.seen.add(value)
            if len(self.seen) + self.extra > self.cap:
                self.over, self.seen = True, set()

    def add_count(self, count):
        self.extra += count
        if len(self.seen) + self.extra > self.cap:
            self.over, self.seen = True, set()

    @property
    def count(self):
        return None if self.over else len(self.seen) + self.extra


class _Best:
    """The ``cap`` names with the smallest keys (a key only ever decreases), each with its value;
    over the cap the largest quarter goes."""

    def __init__(self, cap):
        self.cap = cap
        self.items = {}  # name -> (key, value)
        self.dropped = 0

    def offer(self, name, key, value):
        current = self.items.get(name)
        if current is None:
            self.items[name] = (key, value)
            if len(self.items) > self.cap:
                self._drop()
        elif key < current[0]:
            self.items[name] = (key, value)

    def _drop(self):
        ranked = sorted(self.items.items(), key=lambda item: item[1][0])
        keep = self.cap * 3 // 4
        self.dropped += len(ranked) - keep
        self.items = dict(ranked[:keep])

    def best(self, n):
        """[(name, key, value)] of the n smallest keys."""
        ranked = sorted(self.items.items(), key=lambda item: item[1][0])[:n]
        return [(name, key, value) for name, (key, value) in ranked]


class Summary:
    """Everything the report needs, in bounded memory. ``bins=False`` skips the picture's step
    bins (only ``--png`` needs them)."""

    def __init__(self, max_columns=MAX_COLUMNS, max_modules=MAX_MODULES, max_keys=MAX_KEYS,
                 distinct_cap=DISTINCT_CAP, bins=True, plot_rows=PLOT_ROWS):
        self.max_columns = max_columns
        self.max_modules = max_modules
        self.plot_rows = min(plot_rows, max_modules * 3 // 4)
        self.keep_bins = bins
        self.records = 0
        self.entries = 0
        self.metas = 0
        self.malformed = 0
        self.malformed_lines = []  # the first few: (file, line number, reason)
        self.phases = dict.fromkeys(schema.PHASES, 0)
        self.ranks = bytearray((schema.RANK_MAX + 8) // 8)  # one bit per rank
        self.steps = _Distinct(distinct_cap)
        self.first_step = None
        self.last_step = None
        self.first_nonfinite = None  # a dict of the entry record's fields, and "source"
        self._first_nonfinite_key = None
        self.detections = []  # the first few detection records
        self.detection_count = 0
        # modules: name -> [class, first position, lowest-headroom key or None, its record or None]
        self.modules = {}
        self.module_names = _Distinct(distinct_cap)
        self.modules_dropped = 0
        self.subnormal = _Best(max_keys)  # (module, entry) -> key (-frac, pos): (frac, step, dtype, numel)
        self.all_zero = _Best(max_keys)  # (module, entry) -> key (-step, pos): (step, dtype, numel)
        self.zero_keys = _Distinct(distinct_cap)
        # the picture: per kept module {bin index: lowest headroom ratio}, bins with a nan/inf
        self.width = 1
        self.cells = {}
        self.bad_cells = {}

    # -- one line (the plain reader) --

    def add_line(self, raw, file_index, source, number, ordinal):
        """One non-blank line: ``number`` its line number, ``ordinal`` its place among the
        non-blank lines of its file (its position)."""
        try:
            kind, record = parse_line(raw)
        except Malformed as error:
            self.add_malformed(source, number, str(error))
            return
        pos = position(file_index, ordinal)
        self.records += 1
        if kind == "entry":
            self.add_entry(record, pos, source)
        elif kind == "meta":
            self.metas += 1
            if record.get("rank") is not None:
                self.add_rank(record["rank"])
        else:
            self.detection_count += 1
            if len(self.detections) < MAX_NAMED:
                self.detections.append(record)

    def add_malformed(self, source, number, reason):
        self.malformed += 1
        if len(self.malformed_lines) < MAX_NAMED:
            self.malformed_lines.append((source, number, reason))

    def add_rank(self, rank):
        self.ranks[rank >> 3] |= 1 << (rank & 7)

    def add_entry(self, r, pos, source):
        step, module, entry, dtype, numel = r["step"], r["module"], r["entry"], r["dtype"], r["numel"]
        abs_max = r.get("abs_max")
        rank = r.get("rank")
        self.entries += 1
        self.phases[r["phase"]] += 1
        if rank is not None:
            self.add_rank(rank)
        self.add_steps(step, step)
        self.steps.add(step)
        nonfinite = bool(r["nan"] or r["posinf"] or r["neginf"] or type(abs_max) is str)
        ratio = None
        if not nonfinite:
            ratio = headroom_ratio(dtype, abs_max)
        best = None
        if ratio is not None:
            best = ((ratio, pos), (entry, dtype, step, r["phase"], float(abs_max)))
        self.add_module(module, r["class"], pos, best, new_name=hash(module))
        if nonfinite:
            self.add_nonfinite((step, -1 if rank is None else rank, pos), r, source)
        if self.keep_bins and module in self.modules:
            self.add_cell(module, step // self.width, 1.0 if nonfinite else ratio, nonfinite)
        if numel:
            key = (module, entry)
            frac = r["subnormal_frac"]
            if frac > 0:
                self.subnormal.offer(key, (-frac, pos), (frac, step, dtype, numel))
            if r["zero_frac"] >= 1:
                self.zero_keys.add(hash(key))
                self.all_zero.offer(key, (-step, pos), (step, dtype, numel))

    # -- aggregates (the DuckDB reader hands these over directly) --

    def add_steps(self, first, last):
        if self.first_step is None:
            self.first_step, self.last_step = first, last
        elif first < self.first_step or last > self.last_step:
            self.first_step = min(self.first_step, first)
            self.last_step = max(self.last_step, last)
        else:
            return
        if self.keep_bins:
            width = bin_width(self.first_step, self.last_step, self.max_columns)
            if width > self.width:
                self._coarsen(width)

    def add_module(self, name, class_name, first_pos, best, new_name=None):
        """``best``: ((ratio, pos), (entry, dtype, step, phase, abs_max)) of its lowest headroom."""
        info = self.modules.get(name)
        if info is None:
            if new_name is not None:
                self.module_names.add(new_name)
            self.modules[name] = [class_name, first_pos, best]
            if len(self.modules) > self.max_modules:
                self._drop_modules()
            return
        if first_pos < info[1]:
            info[0], info[1] = class_name, first_pos
        if best is not None and (info[2] is None or best[0] < info[2][0]):
            info[2] = best

    def module_key(self, info):
        return info[2][0] if info[2] is not None else (_INF, info[1])

    def _drop_modules(self):
        ranked = sorted(self.modules.items(), key=lambda item: self.module_key(item[1]))
        keep = self.max_modules * 3 // 4
        for name, _ in ranked[keep:]:
            self.cells.pop(name, None)
            self.bad_cells.pop(name, None)
        self.modules_dropped += len(ranked) - keep
        self.modules = dict(ranked[:keep])

    def add_nonfinite(self, key, record, source):
        if self._first_nonfinite_key is None or key < self._first_nonfinite_key:
            self._first_nonfinite_key = key
            self.first_nonfinite = {k: record.get(k) for k in
                                    ("step", "phase", "module", "class", "entry", "dtype", "rank",
                                     "nan", "posinf", "neginf", "abs_max")}
            self.first_nonfinite["source"] = source

    def add_cell(self, module, index, ratio, bad):
        """The lowest headroom ratio in bin ``index`` (at ``self.width``); ``bad``: a nan/inf."""
        cells = self.cells.setdefault(module, {})
        if ratio is not None:
            current = cells.get(index)
            if current is None or ratio < current:
                cells[index] = ratio
        if bad:
            self.bad_cells.setdefault(module, set()).add(index)

    def _coarsen(self, width):
        factor = width // self.width
        self.width = width
        for module, cells in self.cells.items():
            merged = {}
            for index, ratio in cells.items():
                index //= factor
                current = merged.get(index)
                if current is None or ratio < current:
                    merged[index] = ratio
            self.cells[module] = merged
        for module, bad in self.bad_cells.items():
            self.bad_cells[module] = {index // factor for index in bad}

    # -- results --

    @property
    def step_count(self):
        return self.steps.count

    @property
    def module_count(self):
        return self.module_names.count

    @property
    def rank_list(self):
        ranks = []
        for byte_index, byte in enumerate(self.ranks):
            if byte:
                ranks.extend(byte_index * 8 + bit for bit in range(8) if byte >> bit & 1)
        return ranks

    def hottest(self, n=TOP):
        """[(module, class, (headroom, entry, dtype, step, phase, abs_max))], lowest headroom first."""
        rows = [(name, info) for name, info in self.modules.items() if info[2] is not None]
        rows.sort(key=lambda row: row[1][2][0])
        return [(name, info[0], (headroom(info[2][0][0]),) + info[2][1]) for name, info in rows[:n]]

    def plot_modules(self):
        """The modules the picture draws, in the order they first appear: the ``plot_rows`` with
        the least headroom."""
        ranked = sorted(self.modules.items(), key=lambda item: self.module_key(item[1]))[:self.plot_rows]
        ranked.sort(key=lambda item: item[1][1])
        return [name for name, _ in ranked]

    def columns(self):
        """Indices of the step bins that hold any record, in order."""
        used = set()
        for cells in self.cells.values():
            used.update(cells)
        for bad in self.bad_cells.values():
            used.update(bad)
        return sorted(used)

    def bin_steps(self, index):
        """The steps [first, last] that bin ``index`` covers."""
        return index * self.width, index * self.width + self.width - 1

    def steps_per_column(self):
        """The most recorded steps in any one bin (None when the steps were too many to keep)."""
        if self.steps.over:
            return None
        counts = {}
        for step in self.steps.seen:
            counts[step // self.width] = counts.get(step // self.width, 0) + 1
        return max(counts.values(), default=0)


def bin_width(first, last, max_columns=MAX_COLUMNS):
    """The smallest power of two such that bins of that many steps, aligned to multiples of it,
    cover [first, last] in fewer than 2 * max_columns columns."""
    width = 1
    while last // width - first // width >= 2 * max_columns:
        width *= 2
    return width


def headroom_ratio(dtype, abs_max):
    """dtype max / abs max (at least 1: beyond the limit is no headroom), or None where headroom
    means nothing: integer dtypes, empty tensors, all zeros."""
    limit = schema.dtype_max(dtype)
    if limit is None or abs_max is None or type(abs_max) is str:
        return None
    value = float(abs_max)
    if value <= 0:
        return None
    return max(limit / value, 1.0)


def headroom(ratio):
    """Bits of headroom: log2(dtype max / abs max)."""
    return math.log2(ratio)


# -- the plain reader ------------------------------------------------------------------------------------

def unique_paths(paths):
    """The files in the order given, each once (a file named twice is read once)."""
    seen = set()
    result = []
    for path in paths:
        try:
            key = os.path.realpath(path)
        except (OSError, ValueError):
            key = path
        if key not in seen:
            seen.add(key)
            result.append(path)
    return result


def check_readable(paths):
    """Total size of the files; BadFile for one that cannot be read."""
    total = 0
    for path in paths:
        try:
            with open(path, "rb"):
                pass
            total += os.path.getsize(path)
        except (OSError, ValueError) as error:
            raise BadFile(f"cannot read {path}: {getattr(error, 'strerror', None) or error}") from None
    return total


def read_file(path, file_index, summary, progress=None, wanted=None, visit=None, blank_free=False):
    """Stream the lines of one file into ``summary``. With ``wanted`` (a sorted list of ordinals of
    non-blank lines), only those lines are read; the others are skipped, counted at C speed
    (``blank_free``: the caller knows the file has no blank line, so none is looked for).
    ``visit(number, ordinal, raw)`` replaces adding a line to the summary (``raw`` is None for a
    line over the size limit)."""
    if visit is None:
        def visit(number, ordinal, raw):
            if raw is None:
                summary.add_malformed(path, number, f"longer than {schema.MAX_LINE_BYTES} bytes")
            else:
                summary.add_line(raw, file_index, path, number, ordinal)
    try:
        handle = open(path, "rb")
    except OSError as error:
        raise BadFile(f"cannot read {path}: {error.strerror or error}") from None
    number = 0  # lines so far
    ordinal = 0  # non-blank lines so far
    next_wanted = 0
    with handle:
        for chunk in read_chunks(handle):
            if chunk is None:  # an over-long line: never held whole
                number += 1
                ordinal += 1
                if wanted is None:
                    visit(number, ordinal, None)
                elif next_wanted < len(wanted) and wanted[next_wanted] == ordinal:
                    next_wanted += 1
                    visit(number, ordinal, None)
                continue
            if progress is not None:
                progress.update(len(chunk))
            if wanted is not None:
                if next_wanted >= len(wanted):
                    return
                lines = chunk.count(b"\n") + (not chunk.endswith(b"\n"))
                if wanted[next_wanted] > ordinal + lines and (blank_free or not _may_have_blank(chunk)):
                    number += lines
                    ordinal += lines
                    continue
            parts = chunk.split(b"\n")
            if parts[-1] == b"":
                parts.pop()
            for raw in parts:
                number += 1
                if is_blank(raw):
                    continue
                ordinal += 1
                if wanted is not None:
                    if next_wanted >= len(wanted) or wanted[next_wanted] != ordinal:
                        continue
                    next_wanted += 1
                visit(number, ordinal, raw)


_BLANK_STARTS = (b"\n\n", b"\n ", b"\n\t", b"\n\r", b"\n\x0b", b"\n\x0c")


def _may_have_blank(chunk):
    if chunk[:1] in (b"\n", b" ", b"\t", b"\r", b"\x0b", b"\x0c"):
        return True
    return any(pattern in chunk for pattern in _BLANK_STARTS)


def count_lines(path):
    """Lines in the file (a last line without its newline counts), at C speed."""
    count = 0
    last = b"\n"
    with open(path, "rb") as handle:
        while True:
            block = handle.read(BLOCK)
            if not block:
                break
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")


def read_files(paths, summary, progress=None):
    """The plain reader: every line of every file into ``summary``."""
    for file_index, path in enumerate(paths):
        read_file(path, file_index, summary, progress)


# -- the text ----------------------------------------------------------------------------------------------

def printable(text):
    """A name from a log as it may be printed: control characters escaped (a log must not drive
    the terminal)."""
    text = str(text)
    if text.isprintable():
        return text
    return text.encode("unicode_escape").decode("ascii")


def _module_label(name, class_name=None):
    label = printable(name) if name else "(model)"
    return f"{label} ({printable(class_name)})" if class_name else label


def summary_text(summary, paths):
    out = []
    if len(paths) == 1:
        out.append(f"flight recorder log: {paths[0]}")
    else:
        out.append(f"flight recorder logs: {len(paths)} files")
    out.append(f"records: {summary.records} ({summary.entries} tensor entries)"
               + (f", malformed lines: {summary.malformed}" if summary.malformed else ""))
    if summary.malformed_lines:
        where = ", ".join(f"{printable(os.path.basename(s))}:{n} ({reason})" for s, n, reason in summary.malformed_lines)
        out.append(f"  malformed lines skipped (first): {where}")
    if summary.entries:
        count = summary.step_count
        count = f"more than {summary.steps.cap}" if count is None else count
        out.append(f"steps recorded: {count} (first {summary.first_step}, last {summary.last_step})")
        phases = ", ".join(f"{p} ({n} entries)" for p, n in summary.phases.items() if n)
        out.append(f"phases: {phases}")
        modules = summary.module_count
        modules = f"more than {summary.module_names.cap}" if modules is None else modules
        kept = "" if summary.modules_dropped == 0 else (
            " (too many to keep: the tables and the picture show the ones closest to their limit)")
        out.append(f"modules: {modules}{kept}")
    else:
        out.append("steps recorded: 0")
    ranks = summary.rank_list
    if not ranks:
        out.append("ranks: none (not distributed)")
    elif len(ranks) <= 32:
        out.append(f"ranks: {', '.join(map(str, ranks))}")
    else:
        out.append(f"ranks: {len(ranks)} ({ranks[0]} to {ranks[-1]})")
    out.append("")

    first = summary.first_nonfinite
    if first is None:
        out.append("first non-finite value: no nan/inf recorded")
    else:
        kinds = [k for k in ("nan", "posinf", "neginf") if first.get(k)]
        what = ", ".join(f"{first[k]} {'+inf' if k == 'posinf' else '-inf' if k == 'neginf' else 'nan'}"
                         for k in kinds) or f"abs max {first.get('abs_max')}"
        rank = f", rank {first['rank']}" if first.get("rank") is not None else ""
        out.append(f"first non-finite value: step {first['step']}, {first['phase']}{rank}, "
                   f"module {_module_label(first['module'], first['class'])}, entry {printable(first['entry'])} "
                   f"[{printable(first['dtype'])}]: {what}")
    for det in summary.detections[:1]:
        entries = [printable(e) for e in det.get("entries", ())[:20]]
        out.append(f"detection record: step {det.get('step')}, {det.get('phase')}, module "
                   f"{_module_label(det.get('module', ''), det.get('class'))}, entries {entries}")
    out.append("")

    hottest = summary.hottest()
    out.append("closest to the dtype's limit (headroom = log2(dtype max / abs max), in bits; lowest first):")
    if not hottest:
        out.append("  (no finite floating-point values recorded)")
    else:
        out.append(f"  {'bits':>6}  {'abs max':>9}  {'dtype':<9} {'step':>7}  module / entry")
        for name, class_name, (bits, entry, dtype, step, phase, abs_max) in hottest:
            out.append(f"  {bits:6.2f}  {abs_max:9.3g}  {printable(dtype):<9} {step:>7}  "
                       f"{_module_label(name, class_name)} {printable(entry)} ({phase})")
    out.append("")

    out.append("underflow hot spots (largest fraction of subnormal values):")
    subnormal = summary.subnormal.best(TOP)
    if not subnormal:
        out.append("  (no subnormal values recorded)")
    for (module, entry), _, (frac, step, dtype, numel) in subnormal:
        out.append(f"  {100 * frac:6.2f}%  of {numel:>9} {printable(dtype):<9} at step {step:>7}  "
                   f"{_module_label(module)} {printable(entry)}")
    zeros = summary.all_zero.best(TOP)
    out.append("entries that are all zeros (latest first):")
    if not zeros:
        out.append("  (none)")
    for (module, entry), _, (step, dtype, numel) in zeros:
        out.append(f"  last at step {step:>7}  {_module_label(module)} {printable(entry)} "
                   f"[{printable(dtype)}, {numel} elements]")
    total = summary.zero_keys.count
    if total is None:
        out.append(f"  ... and more than {summary.zero_keys.cap - len(zeros)} more")
    elif total > len(zeros):
        out.append(f"  ... and {total - len(zeros)} more")
    return "\n".join(out)
