"""What ``overflow-fast report`` knows about flight-recorder logs: the plain-Python reader and the
bounded summary that both readers (this one and ``logsummary_duckdb``) fill.

Every line is checked against ``schema.py``; a line that does not fit is counted and named with
the reason, never raised. Lines are read in pieces of at most ``schema.MAX_LINE_BYTES``: a longer
line is skipped without being held whole.

Compressed logs (gzip, bzip2, xz: told by their first bytes, never by their names) are read
decompressed (``LogFile``). One that is cut or damaged is read up to the damage, which then counts
as one malformed line where the readable lines end (a last line cut in two is part of it); zstd,
which Python's standard library cannot decompress, is refused (``BadFile``).

Memory is bounded whatever the input. The summary keeps, with a count of the rest:
- the ``max_modules`` modules with the least headroom (their lowest-headroom entry; and, for the
  picture, their lowest headroom per step bin, at most ``2 * max_columns`` bins);
- the ``max_keys`` (module, entry) pairs with the largest subnormal fraction, and as many that
  were all zeros most recently;
- the distinct steps (batch numbers, and optimizer steps per mode), modules and all-zero entries,
  counted exactly up to ``distinct_cap``;
- for the picture, per kept module and bin: why a bin has no headroom (integer entries, all-zero
  floating ones), and the bins where evaluation ran; the subnormal and zero fractions per bin of
  the ``UNDERFLOW_TRACK`` (module, entry) pairs with the most subnormals.
When more modules come than are kept, the ones furthest from their limit are dropped (a quarter at
a time). Every table the report prints (the ``TOP`` lowest headroom, largest subnormal fraction,
latest all-zero) is then still exact: an item dropped once can only be in a table if its deciding
record came after it was dropped, and it is kept from then on. In the picture, a module dropped
and taken back shows the steps from where it came back, and so does a tracked underflow pair (the
DuckDB reader has no such limit: it aggregates in SQL and hands over only the kept modules and
the drawn pairs, whole).

Positions order everything that "comes first": a record's position is (file index, its ordinal
among the non-blank lines of its file), so files count in the order given.
"""

import bz2
import gzip
import json
import lzma
import math
import os
import stat
import zlib

from ..recording import schema
from ..recording.schema import Malformed
from .timeline import INTEGER, OPTIMIZER, ZERO, Timeline  # noqa: F401 - the report's names

MAX_COLUMNS = 200  # step bins: fewer than 2 * MAX_COLUMNS (400) columns, each a power-of-two run of steps
TOP = 10
MAX_MODULES = 1024
PLOT_ROWS = 512  # heatmap rows; below 3/4 of MAX_MODULES, so the rows drawn are exact (see above)
MAX_KEYS = 1024
DISTINCT_CAP = 1 << 20
MAX_NAMED = 5  # malformed lines named in the summary
UNDERFLOW_ROWS = 4  # (module, entry) pairs of the picture's underflow panel
UNDERFLOW_TRACK = 64  # pairs whose fractions the plain reader keeps per bin; the top 48 are exact
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


def _widen(span_first, span_last, first, last):
    """The span [span_first, span_last] (None: nothing yet) widened to hold [first, last]."""
    if span_first is None:
        return first, last
    return min(span_first, first), max(span_last, last)


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
    over the cap the largest quarter goes (``on_drop(names)`` hears of them)."""

    def __init__(self, cap, on_drop=None):
        self.cap = cap
        self.items = {}  # name -> (key, value)
        self.dropped = 0
        self.on_drop = on_drop

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
        if self.on_drop is not None:
            self.on_drop([name for name, _ in ranked[keep:]])

    def best(self, n):
        """[(name, key, value)] of the n smallest keys."""
        ranked = sorted(self.items.items(), key=lambda item: item[1][0])[:n]
        return [(name, key, value) for name, (key, value) in ranked]


class Summary:
    """Everything the report needs, in bounded memory. ``bins=False`` skips the picture's step
    bins (only ``--png`` needs them).

    The picture's timeline is the trainer's optimizer step when any entry record carries one
    (``unit == OPTIMIZER``; entries without it are then off the timeline), else the detector's
    batch number. Its cells are the train timeline: records with ``mode`` "eval" only mark the
    bins where evaluation ran (``eval_bins``), and records without a mode count as train.
    """

    def __init__(self, max_columns=MAX_COLUMNS, max_modules=MAX_MODULES, max_keys=MAX_KEYS,
                 distinct_cap=DISTINCT_CAP, bins=True, plot_rows=PLOT_ROWS, underflow_rows=UNDERFLOW_ROWS):
        self.max_modules = max_modules
        self.plot_rows = min(plot_rows, max_modules * 3 // 4)
        self.records = 0
        self.entries = 0
        self.metas = 0
        self.malformed = 0
        self.malformed_lines = []  # the first few: (file, line number, reason)
        self.phases = dict.fromkeys(schema.PHASES, 0)
        self.modes = dict.fromkeys(schema.MODES, 0)  # entries per mode (the others: mode unknown)
        self.ranks = bytearray((schema.RANK_MAX + 8) // 8)  # one bit per rank
        self.steps = _Distinct(distinct_cap)
        self.first_step = None
        self.last_step = None
        self.global_steps = 0  # entries that carry the optimizer step
        self.opt_steps = _Distinct(distinct_cap)  # 2 * global_step + (mode == "eval")
        self.first_global_step = None
        self.last_global_step = None
        self.first_nonfinite = None  # a dict of the entry record's fields, and "source"
        self._first_nonfinite_key = None
        self.eval_nonfinite = None  # the same, of the first in eval
        self._eval_nonfinite_key = None
        self.eval_best = None  # ((ratio, pos), (module, class, entry, dtype, step, phase, abs_max, global_step, mode))
        self.detections = []  # the first few detection records
        self.detection_count = 0
        self.backoffs = []  # the first few GradScaler backoff records
        self.backoff_count = 0
        # modules: name -> [class, first position, lowest-headroom key or None, its record or None]
        self.modules = {}
        self.module_names = _Distinct(distinct_cap)
        self.modules_dropped = 0
        # (module, entry) -> key (-frac, pos): (frac, step, dtype, numel, global_step, mode)
        self.subnormal = _Best(max_keys)
        # (module, entry) -> key (-step, pos): (step, dtype, numel, global_step, mode)
        self.all_zero = _Best(max_keys)
        self.zero_keys = _Distinct(distinct_cap)
        # the picture's train timeline; the (module, entry) pairs with the most subnormals, whose
        # fractions it keeps per bin
        self.timeline = Timeline(max_columns, bins)
        self.underflow_rows = underflow_rows
        self.sub_track = _Best(max(UNDERFLOW_TRACK, underflow_rows * 2), on_drop=self.timeline.forget_underflow)

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
        elif kind == "backoff":
            self.backoff_count += 1
            if len(self.backoffs) < MAX_NAMED:
                self.backoffs.append(record)
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
        global_step, mode = r.get("global_step"), r.get("mode")
        is_eval = mode == "eval"
        self.entries += 1
        self.phases[r["phase"]] += 1
        if mode is not None:
            self.modes[mode] += 1
        if rank is not None:
            self.add_rank(rank)
        self.add_steps(step, step)
        self.steps.add(step)
        if global_step is not None:
            self.global_steps += 1
            self.opt_steps.add(2 * global_step + is_eval)
            self.add_global_steps(global_step, global_step)
        timeline = self.timeline
        x = global_step if timeline.unit == OPTIMIZER else step
        if x is not None:
            timeline.add_x(x, x)
        nonfinite = bool(r["nan"] or r["posinf"] or r["neginf"] or type(abs_max) is str)
        ratio = None
        if not nonfinite:
            ratio = headroom_ratio(dtype, abs_max)
        best = None
        if ratio is not None:
            best = ((ratio, pos), (entry, dtype, step, r["phase"], float(abs_max), global_step, mode))
            if is_eval:
                self.add_eval_best(module, r["class"], best)
        self.add_module(module, r["class"], pos, best, new_name=hash(module))
        if nonfinite:
            key = (step, -1 if rank is None else rank, pos)
            self.add_nonfinite(key, r, source)
            if is_eval:
                self.add_nonfinite(key, r, source, in_eval=True)
        if timeline.keep_bins and x is not None:
            index = x // timeline.width
            if is_eval:
                timeline.add_eval_bin(index)
            elif module in self.modules:
                flags = 0
                if ratio is None and not nonfinite:
                    flags = INTEGER if schema.dtype_max(dtype) is None else ZERO
                timeline.add_cell(module, index, 1.0 if nonfinite else ratio, nonfinite, flags)
        if numel:
            key = (module, entry)
            frac = r["subnormal_frac"]
            if frac > 0:
                self.subnormal.offer(key, (-frac, pos), (frac, step, dtype, numel, global_step, mode))
                if timeline.keep_bins:
                    self.sub_track.offer(key, (-frac, pos), None)
                    if key not in timeline.sub_bins and key in self.sub_track.items:
                        timeline.track_underflow(key)
            if r["zero_frac"] >= 1:
                self.zero_keys.add(hash(key))
                self.all_zero.offer(key, (-step, pos), (step, dtype, numel, global_step, mode))
            if timeline.keep_bins and x is not None and not is_eval and key in timeline.sub_bins:
                timeline.add_underflow(key, x // timeline.width, frac, r["zero_frac"])

    # -- aggregates (the DuckDB reader hands these over directly) --

    def add_steps(self, first, last):
        """The detector's batch numbers seen (the picture's timeline is ``add_x``'s)."""
        self.first_step, self.last_step = _widen(self.first_step, self.last_step, first, last)

    def add_global_steps(self, first, last):
        """Optimizer steps seen: from the first, the picture's timeline is the optimizer step."""
        self.first_global_step, self.last_global_step = _widen(self.first_global_step, self.last_global_step,
                                                               first, last)
        self.set_unit(OPTIMIZER)

    def set_unit(self, unit):
        """The timeline's x from now on (``Timeline.set_unit``)."""
        self.timeline.set_unit(unit)

    @property
    def unit(self):
        return self.timeline.unit

    def add_module(self, name, class_name, first_pos, best, new_name=None):
        """``best``: ((ratio, pos), (entry, dtype, step, phase, abs_max, global_step, mode)) of its
        lowest headroom."""
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
        self.timeline.forget_modules(name for name, _ in ranked[keep:])
        self.modules_dropped += len(ranked) - keep
        self.modules = dict(ranked[:keep])

    def add_nonfinite(self, key, record, source, in_eval=False):
        """``key``: (step, rank or -1, position): the first by batch number, then rank."""
        current = self._eval_nonfinite_key if in_eval else self._first_nonfinite_key
        if current is not None and key >= current:
            return
        fields = {k: record.get(k) for k in ("step", "phase", "module", "class", "entry", "dtype", "rank",
                                             "nan", "posinf", "neginf", "abs_max", "global_step", "mode")}
        fields["source"] = source
        if in_eval:
            self._eval_nonfinite_key, self.eval_nonfinite = key, fields
        else:
            self._first_nonfinite_key, self.first_nonfinite = key, fields

    def add_eval_best(self, module, class_name, best):
        """The lowest headroom in eval (``best`` as ``add_module`` takes it)."""
        if self.eval_best is None or best[0] < self.eval_best[0]:
            self.eval_best = (best[0], (module, class_name) + best[1])

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

    def optimizer_steps(self, mode):
        """The distinct optimizer steps of ``mode`` ("train": and records without a mode; "eval"),
        sorted; None when there were too many to keep."""
        if self.opt_steps.over or self.opt_steps.extra:
            return None
        low = 1 if mode == "eval" else 0
        return sorted(value >> 1 for value in self.opt_steps.seen if value & 1 == low)

    def hottest(self, n=TOP):
        """[(module, class, (headroom, entry, dtype, step, phase, abs_max, global_step, mode))],
        lowest headroom first."""
        rows = [(name, info) for name, info in self.modules.items() if info[2] is not None]
        rows.sort(key=lambda row: row[1][2][0])
        return [(name, info[0], (headroom(info[2][0][0]),) + info[2][1]) for name, info in rows[:n]]

    def plot_modules(self):
        """The modules the picture draws, in the order they first appear: the ``plot_rows`` with
        the least headroom."""
        ranked = sorted(self.modules.items(), key=lambda item: self.module_key(item[1]))[:self.plot_rows]
        ranked.sort(key=lambda item: item[1][1])
        return [name for name, _ in ranked]

    def steps_per_column(self):
        """The most recorded train steps (of the timeline's unit) in any one bin (None when the
        steps were too many to keep)."""
        if self.timeline.unit == OPTIMIZER:
            steps = self.optimizer_steps("train")
        else:
            steps = None if self.steps.over else self.steps.seen
        if steps is None:
            return None
        counts = {}
        for step in steps:
            width = self.timeline.width
            counts[step // width] = counts.get(step // width, 0) + 1
        return max(counts.values(), default=0)

    def underflow_curves(self):
        """[((module, entry), {bin index: (subnormal fraction, zero fraction)})] of the
        ``underflow_rows`` pairs with the largest subnormal fractions (the hot spots table's
        first rows), on the train timeline from each pair's first subnormal value: in each bin
        the largest of each fraction."""
        return [(key, {index: tuple(value) for index, value in sorted(self.timeline.sub_bins.get(key, {}).items())})
                for key, _, _ in self.subnormal.best(self.underflow_rows)]


# what a cell of the picture's heatmap shows
HEADROOM = "headroom"  # the lowest headroom of the module's floating-point entries in that column
NONFINITE = "nan/inf"  # a nan or inf was recorded there
ALL_ZERO = "all zero"  # only floating-point entries whose largest |value| is 0 (or empty tensors)
INTEGER_ONLY = "integer"  # only entries without headroom (integer or bool dtypes)
NOT_RECORDED = "not recorded"  # no record of the module in that column


def heatmap_columns(modules, tables, width):
    """A heatmap's columns: the bins of ``width`` steps that ``tables`` (module name -> bins) hold
    for ``modules``, sorted; their centres in steps; each bin's column; and, per module, a row of
    values (None) and a row of kinds (NOT_RECORDED) for the caller to fill."""
    used = set()
    for table in tables:
        for name in modules:
            used.update(table.get(name, ()))
    columns = sorted(used)
    centres = [c * width + (width - 1) / 2 for c in columns]
    position = {c: j for j, c in enumerate(columns)}
    return (columns, centres, position, [[None] * len(columns) for _ in modules],
            [[NOT_RECORDED] * len(columns) for _ in modules])


class Picture:
    """What ``report --png`` draws, as plain data (``plot.py`` only draws it): the heatmap's rows
    (``modules``), columns (bins of ``width`` steps of ``unit``), and per cell ``values`` (headroom
    in bits, or None) and ``kinds`` (one of HEADROOM, NONFINITE, ALL_ZERO, INTEGER_ONLY,
    NOT_RECORDED); ``eval_x`` the columns' centres where evaluation ran; ``first`` the first
    nan/inf (``x``, ``row``: None when it is not on the heatmap, ``text``); ``curves`` the
    modules closest to overflow; ``underflow`` the top underflow hot spots' fractions."""

    def __init__(self, summary, curves=5):
        timeline = summary.timeline
        unit = self.unit = timeline.unit
        self.width = width = timeline.width
        self.modules = modules = summary.plot_modules()
        self.classes = [summary.modules[name][0] for name in modules]
        self.columns, self.centres, position, self.values, self.kinds = heatmap_columns(
            modules, (timeline.cells, timeline.bad_cells, timeline.quiet), width)
        for i, name in enumerate(modules):
            values, kinds = self.values[i], self.kinds[i]
            for c, ratio in timeline.cells.get(name, {}).items():
                values[position[c]], kinds[position[c]] = headroom(ratio), HEADROOM
            for c, flags in timeline.quiet.get(name, {}).items():
                kinds[position[c]] = ALL_ZERO if flags & ZERO else INTEGER_ONLY
            for c in timeline.bad_cells.get(name, ()):
                values[position[c]], kinds[position[c]] = 0.0, NONFINITE
        self.eval_x = [c * width + (width - 1) / 2 for c in sorted(timeline.eval_bins)]
        self.eval_entries = summary.modes["eval"]
        what = "steps" if unit == OPTIMIZER else "batches"
        self.xlabel = ("optimizer step" if unit == OPTIMIZER else
                       "batch number (the detector's count of forwards: the records carry no optimizer step)")
        per_column = summary.steps_per_column()
        per_column = width if per_column is None else per_column
        if per_column > 1:
            self.xlabel += (f"; a column covers {width} {what}, up to {per_column} of them recorded: "
                            f"its lowest headroom is shown")
        self.first = None
        first = summary.first_nonfinite
        if first is not None:
            x = first.get("global_step") if unit == OPTIMIZER else first["step"]
            on_map = x is not None and first.get("mode") != "eval" and first["module"] in modules
            name = printable(first["module"]) or "(model)"
            self.first = {
                "x": x, "row": modules.index(first["module"]) if on_map else None,
                "text": (f"first nan/inf: {when(first['step'], first.get('global_step'), first.get('mode'), unit)}, "
                         f"{first['phase']}\n{name} {printable(first['entry'])}"
                         + ("" if on_map or x is None else "\n(not on the heatmap: eval)" if first.get("mode") == "eval"
                            else "\n(not on the heatmap: not among the modules drawn)")),
            }
        drawn = set(modules)
        self.curves = [(name, class_name) for name, class_name, _ in summary.hottest(max(curves, 0))
                       if name in drawn] if curves else []
        self.underflow = []
        for (module, entry), bins in summary.underflow_curves():
            if bins:
                xs = [index * width + (width - 1) / 2 for index in bins]
                self.underflow.append(((module, entry), xs, [v[0] for v in bins.values()],
                                       [v[1] for v in bins.values()]))


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
    """Total size of the files (as stored: compressed where they are); BadFile for one that cannot
    be read, and for one compressed in a way this reader cannot undo."""
    total = 0
    for path in paths:
        try:
            with open(path, "rb") as handle:
                if _is_regular(handle):  # a pipe's first bytes must not be read here: they would be lost
                    compression_of(handle, path)
            total += os.path.getsize(path)
        except (OSError, ValueError) as error:
            raise BadFile(f"cannot read {path}: {getattr(error, 'strerror', None) or error}") from None
    return total


def _is_regular(handle):
    try:
        return stat.S_ISREG(os.fstat(handle.fileno()).st_mode)
    except (OSError, ValueError):
        return False


# compressed logs, told by their first bytes (a name can say anything): what opens each
_MAGIC = ((b"\x1f\x8b", "gzip"), (b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"))
_OPENERS = {"gzip": lambda raw: gzip.GzipFile(fileobj=_Pieces(raw), mode="rb"), "bzip2": bz2.BZ2File,
            "xz": lzma.LZMAFile}
# what a damaged compressed stream raises as it is read (a cut one: EOFError)
_DAMAGED = (OSError, EOFError, zlib.error, lzma.LZMAError)


class _Pieces:
    """A file read at most 8 KiB at a time: gzip decompresses what it reads in one call, and a
    call that meets damage gives nothing, so the lines before the damage are lost only up to
    that much of the file (not gzip's own 128 KiB, megabytes of lines)."""

    def __init__(self, raw):
        self.raw = raw

    def read(self, size=-1):
        return self.raw.read(8192 if size is None or size < 0 else min(size, 8192))


def compression_of(handle, path):
    """``"gzip"``, ``"bzip2"``, ``"xz"`` or None (not compressed), from the first bytes of
    ``handle`` (a buffered binary file, not moved); BadFile for zstd, which Python's standard
    library cannot decompress."""
    head = handle.peek(6)[:6]
    kind = next((name for magic, name in _MAGIC if head.startswith(magic)), None)
    if kind is None and head[:3] == b"BZh" and head[3:4].isdigit() and head[3:4] != b"0":
        kind = "bzip2"
    if kind == "zstd":
        raise BadFile(f"cannot read {path}: it is zstd-compressed, which the report cannot decompress "
                      f"(plain, gzip, bzip2 and xz logs it can): decompress it first (zstd -d)")
    return kind


class LogFile:
    """A log opened for reading: ``read(size)`` gives its lines' bytes, decompressed where the file
    is compressed (``compression``). A compressed stream that is cut or damaged ends there:
    ``damage`` then says why (its last line, if cut in two, is part of that damage, not a line)."""

    def __init__(self, path):
        try:
            self._raw = open(path, "rb")
        except OSError as error:
            raise BadFile(f"cannot read {path}: {error.strerror or error}") from None
        try:
            self.compression = compression_of(self._raw, path)
        except BaseException:
            self._raw.close()
            raise
        if self.compression:
            # read1: a read that stops at the damage keeps what it decompressed (read() would lose it)
            self._read = _OPENERS[self.compression](self._raw).read1
        else:
            self._read = self._raw.read
        self.damage = None

    def read(self, size):
        if self.damage is not None:
            return b""
        try:
            return self._read(size)
        except _DAMAGED as error:
            if self.compression is None:
                raise
            if isinstance(error, EOFError):
                self.damage = f"the {self.compression} stream ends early: the file is cut"
            else:
                self.damage = f"{self.compression} data damaged ({error})"
            return b""

    def consumed(self):
        """Bytes of the file itself read so far (the progress of a compressed one)."""
        try:
            return self._raw.tell()
        except (OSError, ValueError):
            return 0

    def close(self):
        self._raw.close()  # the decompressor holds no resource of its own

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _open(path):
    try:
        return open(path, "rb")
    except OSError as error:
        raise BadFile(f"cannot read {path}: {error.strerror or error}") from None


def read_file(path, file_index, summary, progress=None, wanted=None, visit=None):
    """Stream the lines of one file (decompressed: ``LogFile``) into ``summary``. With ``wanted``
    (a sorted list of ordinals of non-blank lines), only those lines are read. ``visit(number,
    ordinal, raw)`` replaces adding a line to the summary (``raw`` is None for a line over the size
    limit). A compressed stream cut or damaged counts as one malformed line, where it ends."""
    if visit is None:
        def visit(number, ordinal, raw):
            if raw is None:
                summary.add_malformed(path, number, f"longer than {schema.MAX_LINE_BYTES} bytes")
            else:
                summary.add_line(raw, file_index, path, number, ordinal)
    number = 0  # lines so far
    ordinal = 0  # non-blank lines so far
    next_wanted = 0
    read = 0  # of the file itself, for the progress
    with LogFile(path) as handle:
        for chunk in read_chunks(handle):
            if wanted is not None and next_wanted >= len(wanted):
                return
            if chunk is None:  # an over-long line: never held whole
                number += 1
                ordinal += 1
                if wanted is None:
                    visit(number, ordinal, None)
                elif wanted[next_wanted] == ordinal:
                    next_wanted += 1
                    visit(number, ordinal, None)
                continue
            if progress is not None:
                done = handle.consumed() if handle.compression else read + len(chunk)
                progress.update(done - read)
                read = done
            parts = chunk.split(b"\n")
            cut = parts[-1] != b"" and handle.damage is not None  # the last line, cut in two by the damage
            if parts[-1] == b"" or cut:
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
        if handle.damage is not None and wanted is None:
            summary.add_malformed(path, number + 1, handle.damage)


def intact(path):
    """Whether the whole file reads without damage (a compressed one: to its end, checksums and
    all); for a file another reader (DuckDB) decompresses with fewer checks."""
    with LogFile(path) as handle:
        while handle.read(BLOCK):
            pass
        return handle.damage is None


# newlines are counted in pieces this size: a wanted line is then looked for, newline by
# newline, only inside the piece that holds it
_PIECE = 1 << 14


def line_starts(path, numbers):
    """(the byte offset where each line of ``numbers`` starts, the file's line count), in one pass
    that counts newlines at C speed. ``numbers``: sorted line numbers (from 1), none above the
    count. A last line without its newline counts."""
    starts = []
    targets = iter(numbers)
    target = next(targets, None)
    newlines = 0  # before the piece at hand
    base = 0  # the block's offset in the file
    last = b"\n"
    with _open(path) as handle:
        while True:
            block = handle.read(BLOCK)
            if not block:
                break
            for piece in range(0, len(block), _PIECE):
                count = block.count(b"\n", piece, piece + _PIECE)
                if target is not None and target - 1 <= newlines + count:  # line `target` follows newline target - 1
                    seen, at = newlines, piece - 1
                    while target is not None and target - 1 <= newlines + count:
                        while seen < target - 1:
                            at = block.find(b"\n", at + 1)
                            seen += 1
                        starts.append(base + at + 1)
                        target = next(targets, None)
                newlines += count
            base += len(block)
            last = block[-1:]
    return starts, newlines + (last != b"\n")


def read_lines_at(path, starts, limit=schema.MAX_LINE_BYTES):
    """The line that starts at each offset of ``starts``, without its newline; None for a line over
    ``limit`` bytes (never read whole)."""
    with _open(path) as handle:
        for start in starts:
            handle.seek(start)
            line = handle.readline(limit + 1)
            if line.endswith(b"\n"):
                yield line[:-1]
            else:
                yield None if len(line) > limit else line


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


def when(step, global_step, mode, unit):
    """Where a record sits in time, in the timeline's unit: "step 8" (the batch number, in a log
    without optimizer steps), "optimizer step 3 (train, batch 8)"; the mode when known."""
    if unit == OPTIMIZER and global_step is not None:
        return f"optimizer step {global_step} ({mode + ', ' if mode else ''}batch {step})"
    text = f"batch {step} (no optimizer step)" if unit == OPTIMIZER else f"step {step}"
    return text + (f" ({mode})" if mode else "")


def _steps_list(steps, limit=8):
    if len(steps) <= limit:
        return ", ".join(map(str, steps))
    return f"{steps[0]} to {steps[-1]}"


def summary_text(summary, paths):
    """The report's text: what was recorded, the first nan/inf, eval, the modules closest to their
    dtype's limit, underflow hot spots."""
    out = []
    for section in (_recorded_lines(summary, paths), _nonfinite_lines(summary), _eval_lines(summary),
                    _headroom_lines(summary), _underflow_lines(summary)):
        out.extend(section)
    return "\n".join(out)


def _recorded_lines(summary, paths):
    out = []
    if len(paths) == 1:
        out.append(f"flight recorder log: {paths[0]}")
    else:
        out.append(f"flight recorder logs: {len(paths)} files")
    out.append(f"records: {summary.records} ({summary.entries} tensor entries)"
               + (f", malformed lines: {summary.malformed}" if summary.malformed else ""))
    if summary.malformed_lines:
        out.append(f"  malformed lines skipped (first): {malformed_names(summary)}")
    if summary.entries:
        count = summary.step_count
        count = f"more than {summary.steps.cap}" if count is None else count
        out.append(f"steps recorded: {count} (first {summary.first_step}, last {summary.last_step}), "
                   f"the detector's batch numbers (its count of the model's forwards)")
        if summary.global_steps:
            train, evals = summary.optimizer_steps("train"), summary.optimizer_steps("eval")
            count = summary.opt_steps.count
            if count is not None and train is not None:
                count = len(set(train) | set(evals))
            count = f"more than {summary.opt_steps.cap}" if count is None else count
            parts = "" if train is None else (
                f": train at {len(train)}" + (f", eval at {len(evals)}" if evals else ""))
            out.append(f"optimizer steps recorded: {count} (first {summary.first_global_step}, "
                       f"last {summary.last_global_step}){parts}")
            without = summary.entries - summary.global_steps
            if without:
                out.append(f"  {without} tensor entries carry no optimizer step: they are in the tables, "
                           f"not on the picture's timeline")
        phases = ", ".join(f"{p} ({n} entries)" for p, n in summary.phases.items() if n)
        out.append(f"phases: {phases}")
        if any(summary.modes.values()):
            unknown = summary.entries - sum(summary.modes.values())
            modes = [f"{m} ({n} entries)" for m, n in summary.modes.items() if n]
            out.append(f"modes: {', '.join(modes + ([f'unknown ({unknown} entries)'] if unknown else []))}")
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

    return out


def _nonfinite_lines(summary):
    out = []
    unit = summary.unit
    first = summary.first_nonfinite
    if first is None:
        out.append("first non-finite value: no nan/inf recorded")
    else:
        out.append(f"first non-finite value: {_nonfinite_text(first, unit)}")
    for det in summary.detections[:1]:
        entries = [printable(e) for e in det.get("entries", ())[:20]]
        out.append(f"detection record: {when(det.get('step'), det.get('global_step'), det.get('mode'), unit)}, "
                   f"{det.get('phase')}, module {_module_label(det.get('module', ''), det.get('class'))}, "
                   f"entries {entries}")
    for backoff in summary.backoffs[:1]:
        module = _module_label(backoff.get("module", ""), backoff.get("class"))
        out.append(f"GradScaler backoffs (inf/nan gradients the scaler recovered from, not detections): "
                   f"{summary.backoff_count}, the first at "
                   f"{when(backoff.get('step'), backoff.get('global_step'), backoff.get('mode'), unit)}, scale "
                   f"{float(backoff['scale']):.3g}, module {module}")
    out.append("")

    return out


def _eval_lines(summary):
    out = []
    unit = summary.unit
    if summary.modes["eval"]:
        evals = summary.optimizer_steps("eval") if summary.global_steps else None
        at = f" at {len(evals)} optimizer steps ({_steps_list(evals)})" if evals else ""
        out.append(f"eval (kept apart: the picture's cells are the train timeline): "
                   f"{summary.modes['eval']} tensor entries{at}")
        if summary.eval_best is not None:
            (ratio, _), (module, class_name, entry, dtype, step, phase, abs_max, global_step, mode) = summary.eval_best
            out.append(f"  lowest headroom in eval: {headroom(ratio):.2f} bits (abs max {abs_max:.3g}), "
                       f"{_module_label(module, class_name)} {printable(entry)} [{printable(dtype)}] at "
                       f"{when(step, global_step, mode, unit)}, {phase}")
        nonfinite = summary.eval_nonfinite
        out.append("  first non-finite value in eval: "
                   + ("none" if nonfinite is None else _nonfinite_text(nonfinite, unit)))
        out.append("")

    return out


def _headroom_lines(summary):
    out = []
    unit = summary.unit
    hottest = summary.hottest()
    out.append("closest to the dtype's limit (headroom = log2(dtype max / abs max), in bits; lowest first):")
    if not hottest:
        out.append("  (no finite floating-point values recorded)")
    else:
        # with optimizer steps: the step and the batch number (the detector's report names the batch)
        steps = f"{'opt step':>8} {'batch':>7}" if unit == OPTIMIZER else f"{'step':>7}"
        out.append(f"  {'bits':>6}  {'abs max':>9}  {'dtype':<9} {steps}  module / entry")
        for name, class_name, (bits, entry, dtype, step, phase, abs_max, global_step, mode) in hottest:
            steps = f"{'-' if global_step is None else global_step:>8} {step:>7}" if unit == OPTIMIZER else f"{step:>7}"
            tag = ", eval" if mode == "eval" else ""
            out.append(f"  {bits:6.2f}  {abs_max:9.3g}  {printable(dtype):<9} {steps}  "
                       f"{_module_label(name, class_name)} {printable(entry)} ({phase}{tag})")
    out.append("")

    return out


def _underflow_lines(summary):
    out = []
    unit = summary.unit
    out.append("underflow hot spots (largest fraction of subnormal values):")
    subnormal = summary.subnormal.best(TOP)
    if not subnormal:
        out.append("  (no subnormal values recorded)")
    for (module, entry), _, (frac, step, dtype, numel, global_step, mode) in subnormal:
        out.append(f"  {100 * frac:6.2f}%  of {numel:>9} {printable(dtype):<9} at "
                   f"{_at(step, global_step, mode, unit)}  {_module_label(module)} {printable(entry)}")
    zeros = summary.all_zero.best(TOP)
    out.append("entries that are all zeros (latest first):")
    if not zeros:
        out.append("  (none)")
    for (module, entry), _, (step, dtype, numel, global_step, mode) in zeros:
        out.append(f"  last at {_at(step, global_step, mode, unit)}  {_module_label(module)} {printable(entry)} "
                   f"[{printable(dtype)}, {numel} elements]")
    total = summary.zero_keys.count
    if total is None:
        out.append(f"  ... and more than {summary.zero_keys.cap - len(zeros)} more")
    elif total > len(zeros):
        out.append(f"  ... and {total - len(zeros)} more")
    return out


def malformed_names(summary):
    """The first malformed lines, where and why: "run.jsonl:3 (not JSON), ..."."""
    return ", ".join(f"{printable(os.path.basename(s))}:{n} ({reason})" for s, n, reason in summary.malformed_lines)


def _at(step, global_step, mode, unit):
    """A table's step column: aligned, in the timeline's unit (eval rows say so)."""
    if unit == OPTIMIZER and global_step is not None:
        return f"optimizer step {global_step:>7} ({'eval, ' if mode == 'eval' else ''}batch {step})"
    tag = " (eval)" if mode == "eval" else ""
    if unit == OPTIMIZER:
        return f"batch {step:>7} (no optimizer step){tag}"
    return f"step {step:>7}{tag}"


def _nonfinite_text(first, unit):
    kinds = [k for k in ("nan", "posinf", "neginf") if first.get(k)]
    what = ", ".join(f"{first[k]} {'+inf' if k == 'posinf' else '-inf' if k == 'neginf' else 'nan'}"
                     for k in kinds) or f"abs max {first.get('abs_max')}"
    rank = f", rank {first['rank']}" if first.get("rank") is not None else ""
    return (f"{when(first['step'], first.get('global_step'), first.get('mode'), unit)}, {first['phase']}{rank}, "
            f"module {_module_label(first['module'], first['class'])}, entry {printable(first['entry'])} "
            f"[{printable(first['dtype'])}]: {what}")
