"""What ``overflow-fast report`` knows of a run: SQL over the entries table (``engine.Logs``), the
same queries on either engine, into a ``Summary`` of plain data; and ``Picture``, what
``report --png`` draws (plain data too: ``plot.py`` only draws it).

Every table is exact whatever the number of modules, steps or entries: the queries aggregate in
the engine (within its memory limit, spilling to disk) and hand over only the rows printed or drawn.
"What comes first" is decided by the position (file index, then the line's place in its file):
files count in the order given.
"""

import math
import os

from ..recording.schema import judged_in
from .text import cut, label, module_name, printable, when
from .timeline import BATCH, OPTIMIZER, bin_width

MAX_COLUMNS = 200  # step bins of the picture: fewer than 2 * MAX_COLUMNS (400) columns, each a power-of-two run of steps
TOP = 10
PLOT_ROWS = 512  # heatmap rows: the modules closest to their limit
UNDERFLOW_ROWS = 4  # (module, entry) pairs of the picture's underflow panel
EVAL = "mode = 'eval'"
TRAIN = "(mode IS NULL OR mode <> 'eval')"

# what a cell of the picture's heatmap shows
HEADROOM = "headroom"  # the lowest headroom of the module's floating-point entries in that column
NONFINITE = "nan/inf"  # a nan or inf was recorded there
ALL_ZERO = "all zero"  # only floating-point entries whose largest |value| is 0 (or empty tensors)
INTEGER_ONLY = "integer"  # only entries without headroom (integer or bool dtypes)
NOT_RECORDED = "not recorded"  # no record of the module in that column

_WHEN = "step, gstep, mode"  # what ``when()`` says of a row


def headroom(ratio):
    """Bits of headroom: log2(dtype max / abs max)."""
    return math.log2(ratio)


def best_rows(logs, group, value, where, fields, limit, largest=False):
    """Per group of rows (``group``: columns) among those ``where`` holds, the row where ``value``
    is least (``largest``: greatest), the first such by position; of the ``limit`` groups whose
    value comes first (ties: by that row's position): (value, position, *fields), in that order."""
    order = "DESC" if largest else ""
    # a window numbers each group's rows by value, then position: one sort, where a join of the
    # rows back to their group's least value has no index to use in sqlite (quadratic there)
    return logs.rows(f"""
        SELECT v, pos, {fields} FROM (
            SELECT {value} AS v, pos, {fields},
                   row_number() OVER (PARTITION BY {group} ORDER BY {value} {order}, pos) AS r
            FROM entries WHERE ({where}) AND {value} IS NOT NULL) numbered
        WHERE r = 1 ORDER BY v {order}, pos LIMIT ?""", (limit,))


class Summary:
    """The report of ``logs`` (an ``engine.Logs`` of one log): counts, the first nan/inf, the
    tables; with ``bins``, what the picture needs too (``cells``, ``eval_bins``, ``underflow``)."""

    def __init__(self, logs, bins=False, max_columns=MAX_COLUMNS, plot_rows=PLOT_ROWS,
                 underflow_rows=UNDERFLOW_ROWS):
        notes = logs.notes[0]
        self.paths = logs.paths
        self.notes = notes
        self.malformed, self.malformed_lines = notes.malformed, notes.malformed_lines
        self.detections, self.detection_count = notes.detections, notes.detection_count
        self.backoffs, self.backoff_count = notes.backoffs, notes.backoff_count
        self.metas = notes.metas
        (self.entries, forward, self.first_step, self.last_step, self.step_count, self.global_steps,
         self.first_global_step, self.last_global_step, evals, trains, self.module_count, self.opt_step_count,
         eval_steps, train_steps) = logs.one(f"""
            SELECT count(*), sum(CASE WHEN phase = 'forward' THEN 1 ELSE 0 END), min(step), max(step),
                count(DISTINCT step), count(gstep), min(gstep), max(gstep), sum(CASE WHEN {EVAL} THEN 1 ELSE 0 END),
                sum(CASE WHEN mode = 'train' THEN 1 ELSE 0 END), count(DISTINCT module), count(DISTINCT gstep),
                count(DISTINCT CASE WHEN {EVAL} THEN gstep END), count(DISTINCT CASE WHEN {TRAIN} THEN gstep END)
            FROM entries""")
        self.records = self.entries + notes.records
        self.phases = {"forward": forward or 0, "backward": self.entries - (forward or 0)}
        self.modes = {"train": trains or 0, "eval": evals or 0}
        self.train_steps, self.eval_step_count = train_steps, eval_steps
        self.eval_steps = [v for v, in logs.rows(f"SELECT DISTINCT gstep FROM entries WHERE {EVAL} AND gstep IS NOT NULL "
                                                 f"ORDER BY gstep LIMIT 9")]
        if eval_steps > 9:
            self.eval_steps[-1] = logs.one(f"SELECT max(gstep) FROM entries WHERE {EVAL}")[0]
        self.rank_list = sorted({r for r, in logs.rows("SELECT DISTINCT rank FROM entries WHERE rank IS NOT NULL")}
                                | notes.ranks)
        self.unit = OPTIMIZER if self.global_steps else BATCH
        self.first_nonfinite = self._first_nonfinite(logs, "1 = 1")
        self.eval_nonfinite = self._first_nonfinite(logs, EVAL)
        self.eval_best = logs.one(f"""SELECT module, cls, entry, dtype, {_WHEN}, phase, amax, ratio, computed_in FROM entries
                                      WHERE {EVAL} AND ratio IS NOT NULL ORDER BY ratio, pos LIMIT 1""")
        self._modules(logs, plot_rows)
        self.subnormal = best_rows(logs, "module, entry", "sf", "numel > 0 AND sf > 0",
                                   f"module, entry, dtype, numel, {_WHEN}", TOP, largest=True)
        self.all_zero = best_rows(logs, "module, entry", "step", "numel > 0 AND zf >= 1",
                                  f"module, entry, dtype, numel, {_WHEN}", TOP, largest=True)
        self.zero_count = logs.one("SELECT count(*) FROM (SELECT DISTINCT module, entry FROM entries "
                                   "WHERE numel > 0 AND zf >= 1) AS z")[0]
        self.cells = None
        if bins and self.entries:
            _Bins(self, logs, max_columns, underflow_rows)

    def _first_nonfinite(self, logs, where):
        """The first entry with a nan/inf (by batch number, then rank, then position), as a dict."""
        row = logs.one(f"""SELECT step, phase, module, cls, entry, dtype, rank, nan, posinf, neginf, amax_s, gstep,
                               mode, file FROM entries WHERE bad = 1 AND {where}
                           ORDER BY step, coalesce(rank, -1), pos LIMIT 1""")
        if row is None:
            return None
        keys = ("step", "phase", "module", "class", "entry", "dtype", "rank", "nan", "posinf", "neginf", "abs_max",
                "global_step", "mode")
        return dict(zip(keys, row), source=self.paths[row[-1]])

    def _modules(self, logs, plot_rows):
        """``ranked``: the modules closest to their limit (lowest headroom; ties and those without
        any: by position), as (module, lowest ratio or None, its first position, the position of its
        lowest-headroom entry); ``modules``: the first ``TOP`` of them, each with its class where it
        first appears and that entry; ``drawn``: the ``plot_rows`` the picture draws, in the order
        they first appear, as (first position, its name cut for a label)."""
        logs.rows("""CREATE TEMP TABLE ranked AS
            WITH m AS (SELECT module, min(ratio) AS r, min(pos) AS first FROM entries GROUP BY module),
            b AS (SELECT m.module, min(e.pos) AS best FROM entries e JOIN m ON e.module = m.module AND e.ratio = m.r
                  GROUP BY m.module)
            SELECT m.module, m.r, m.first, b.best FROM m LEFT JOIN b ON b.module = m.module
            ORDER BY m.r IS NULL, m.r, coalesce(b.best, m.first) LIMIT ?""", (max(plot_rows, TOP),))
        self.modules = logs.rows("""
            SELECT k.module, f.cls, k.r, k.first, e.entry, e.dtype, e.step, e.phase, e.amax, e.gstep, e.mode,
                e.computed_in
            FROM (SELECT * FROM ranked ORDER BY r IS NULL, r, coalesce(best, first) LIMIT ?) AS k
            JOIN entries f ON f.pos = k.first LEFT JOIN entries e ON e.pos = k.best
            ORDER BY k.r IS NULL, k.r, coalesce(k.best, k.first)""", (TOP,))
        self.drawn = logs.rows(f"""SELECT first, {cut("module")} FROM (SELECT * FROM ranked
                                   ORDER BY r IS NULL, r, coalesce(best, first) LIMIT ?) AS k ORDER BY first""",
                               (plot_rows,))
        self.modules_dropped = max(0, self.module_count - plot_rows)

    def hottest(self, n=TOP):
        """[(module, class, (headroom, entry, dtype, step, phase, abs_max, global_step, mode, the dtype
        its headroom is judged against))], lowest headroom first."""
        return [(module, cls, (headroom(r), entry, dtype, step, phase, amax, gstep, mode, judged_in(dtype, computed)))
                for module, cls, r, _, entry, dtype, step, phase, amax, gstep, mode, computed in self.modules[:n]
                if r is not None]


class _Bins:
    """The picture's cells, on ``summary.unit``'s timeline: per drawn module and train bin of
    ``width`` steps (a power of two, fewer than 2 * ``max_columns`` bins), per dtype judged against, the
    lowest headroom ratio, whether a nan/inf was there, and what entries without headroom were
    (all zero, integer); the bins where evaluation ran; and per (module, entry) of the top
    underflow hot spots, from its first subnormal value, the largest subnormal and zero fractions
    per train bin."""

    def __init__(self, summary, logs, max_columns, underflow_rows):
        x = "gstep" if summary.unit == OPTIMIZER else "step"
        first, last = logs.one(f"SELECT min({x}), max({x}) FROM entries")
        summary.width = width = bin_width(first, last, max_columns)
        shift = width.bit_length() - 1
        summary.first_x, summary.last_x = first, last
        logs.rows("CREATE TEMP TABLE drawn AS SELECT module AS drawn_module, first AS drawn_first FROM ranked "
                  "ORDER BY r IS NULL, r, coalesce(best, first) LIMIT ?", (len(summary.drawn),))
        summary.cells = logs.rows(f"""
            SELECT drawn_first, {x} >> {shift} AS b, min(ratio), max(bad), fmax,
                max(CASE WHEN bad = 0 AND ratio IS NULL AND fmax IS NOT NULL THEN 1 ELSE 0 END),
                max(CASE WHEN bad = 0 AND fmax IS NULL THEN 1 ELSE 0 END)
            FROM entries JOIN drawn ON module = drawn_module WHERE {TRAIN} AND {x} IS NOT NULL
            GROUP BY drawn_first, b, fmax""")
        first = summary.first_nonfinite
        summary.first_module = None if first is None else logs.one(
            "SELECT drawn_first FROM drawn WHERE drawn_module = ?", (first["module"],))
        summary.eval_bins = sorted(b for b, in logs.rows(
            f"SELECT DISTINCT {x} >> {shift} FROM entries WHERE {EVAL} AND {x} IS NOT NULL"))
        where = TRAIN if summary.unit == OPTIMIZER else "1 = 1"
        summary.steps_per_column = logs.one(f"""SELECT max(n) FROM (SELECT count(DISTINCT {x}) AS n FROM entries
                                                WHERE {where} AND {x} IS NOT NULL GROUP BY {x} >> {shift}) AS c""")[0]
        tracked = [(row[2], row[3]) for row in summary.subnormal[:underflow_rows]]
        summary.underflow = []
        if tracked:
            values = ", ".join("(?, ?)" for _ in tracked)
            found = logs.rows(f"""
                WITH tracked (t_module, t_entry) AS (VALUES {values}),
                s AS (SELECT module AS s_module, entry AS s_entry, min(pos) AS since FROM entries
                      JOIN tracked ON module = t_module AND entry = t_entry WHERE numel > 0 AND sf > 0
                      GROUP BY module, entry)
                SELECT module, entry, {x} >> {shift} AS b, max(sf), max(zf) FROM entries
                JOIN s ON module = s_module AND entry = s_entry
                WHERE {TRAIN} AND {x} IS NOT NULL AND numel > 0 AND pos >= since GROUP BY module, entry, b""",
                              [value for key in tracked for value in key])
            for key in tracked:
                bins = sorted((b, (sub, zero)) for m, e, b, sub, zero in found if (m, e) == key)
                summary.underflow.append((key, dict(bins)))


def _cell(kinds_by_dtype):
    """One heatmap cell from its rows per dtype: (headroom in bits, its share of the dtype's
    headroom at 1.0, kind). The share is what the colour shows, so that each dtype is judged
    against its own range (fp16's 16 bits, fp32's 128)."""
    bits = share = None
    bad = zero = integer = False
    for ratio, dtype_bad, fmax, dtype_zero, dtype_integer in kinds_by_dtype:
        bad, zero, integer = bad or dtype_bad, zero or dtype_zero, integer or dtype_integer
        if ratio is not None:
            value = headroom(ratio)
            bits = value if bits is None else min(bits, value)
            relative = value / math.log2(fmax)
            share = relative if share is None else min(share, relative)
    if bad:
        return 0.0, 0.0, NONFINITE
    if bits is not None:
        return bits, share, HEADROOM
    return None, None, ALL_ZERO if zero else INTEGER_ONLY


class Picture:
    """What ``report --png`` draws, as plain data: the heatmap's rows (``modules``), columns (bins of
    ``width`` steps of ``unit``), and per cell ``values`` (headroom in bits, or None), ``shares``
    (of the dtype's headroom at 1.0: what the colour shows) and ``kinds`` (one of HEADROOM,
    NONFINITE, ALL_ZERO, INTEGER_ONLY, NOT_RECORDED); ``eval_x`` the columns' centres where
    evaluation ran; ``first`` the first nan/inf (``x``, ``row``: None when it is not on the heatmap,
    ``text``); ``curves`` the modules closest to overflow; ``underflow`` the top underflow hot spots'
    fractions."""

    def __init__(self, summary, curves=5):
        unit = self.unit = summary.unit
        self.width = width = summary.width
        self.keys = [first for first, _ in summary.drawn]  # each module's first position
        self.modules = [label(name) if name else "(model)" for _, name in summary.drawn]
        grouped = {}
        for module, b, ratio, bad, fmax, zero, integer in summary.cells:
            grouped.setdefault((module, b), []).append((ratio, bad, fmax, zero, integer))
        self.columns = sorted({b for _, b in grouped})
        self.centres = [c * width + (width - 1) / 2 for c in self.columns]
        column = {c: j for j, c in enumerate(self.columns)}
        row = {key: i for i, key in enumerate(self.keys)}
        self.values = [[None] * len(self.columns) for _ in self.keys]
        self.shares = [[None] * len(self.columns) for _ in self.keys]
        self.kinds = [[NOT_RECORDED] * len(self.columns) for _ in self.keys]
        for (module, b), found in grouped.items():
            i, j = row[module], column[b]
            self.values[i][j], self.shares[i][j], self.kinds[i][j] = _cell(found)
        self.eval_x = [c * width + (width - 1) / 2 for c in summary.eval_bins]
        self.eval_entries = summary.modes["eval"]
        what = "steps" if unit == OPTIMIZER else "batches"
        self.xlabel = ("optimizer step" if unit == OPTIMIZER else
                       "batch number (the detector's count of forwards: the records carry no optimizer step)")
        per_column = width if summary.steps_per_column is None else summary.steps_per_column
        if per_column > 1:
            self.xlabel += (f"; a column covers {width} {what}, up to {per_column} of them recorded: "
                            f"its lowest headroom is shown")
        self.first = None
        first = summary.first_nonfinite
        if first is not None:
            x = first.get("global_step") if unit == OPTIMIZER else first["step"]
            on_map = x is not None and first.get("mode") != "eval" and summary.first_module is not None
            self.first = {
                "x": x, "row": row[summary.first_module[0]] if on_map else None,
                "text": (f"first nan/inf: {when(first['step'], first.get('global_step'), first.get('mode'), unit)}, "
                         f"{first['phase']}\n{label(first['module'] or '(model)')}\n{label(first['entry'])}"
                         + ("" if on_map or x is None else "\n(not on the heatmap: eval)" if first.get("mode") == "eval"
                            else "\n(not on the heatmap: not among the modules drawn)")),
            }
        self.curves = [(row[first], f"{label(name, 32) if name else '(model)'} ({label(cls, 16)})")
                       for name, cls, r, first, *_ in summary.modules[:max(curves, 0)]
                       if r is not None and first in row]
        self.underflow = []
        for key, bins in summary.underflow:
            if bins:
                xs = [index * width + (width - 1) / 2 for index in bins]
                self.underflow.append((key, xs, [v[0] for v in bins.values()], [v[1] for v in bins.values()]))


# -- the text ----------------------------------------------------------------------------------------------

def summary_text(summary):
    """The report's text: what was recorded, the first nan/inf, eval, the modules closest to their
    dtype's limit, underflow hot spots."""
    out = []
    for section in (_recorded_lines, _nonfinite_lines, _eval_lines, _headroom_lines, _underflow_lines):
        out.extend(section(summary))
    return "\n".join(out)


def _recorded_lines(summary):
    paths = summary.paths
    out = [f"flight recorder log: {paths[0]}" if len(paths) == 1 else f"flight recorder logs: {len(paths)} files",
           f"records: {summary.records} ({summary.entries} tensor entries)"
           + (f", malformed lines: {summary.malformed}" if summary.malformed else "")]
    if summary.malformed_lines:
        out.append(f"  malformed lines skipped (first): {malformed_names(summary.notes)}")
    if summary.entries:
        out.append(f"steps recorded: {summary.step_count} (first {summary.first_step}, last {summary.last_step}), "
                   f"the detector's batch numbers (its count of the model's forwards)")
        if summary.global_steps:
            parts = f": {summary.train_steps} in train" + (
                f", {summary.eval_step_count} in eval" if summary.eval_step_count else "")
            out.append(f"optimizer steps recorded: {summary.opt_step_count} (first {summary.first_global_step}, "
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
        out.append(f"modules: {summary.module_count}")
    else:
        out.append("steps recorded: 0")
    ranks = summary.rank_list
    if not ranks:
        out.append("ranks: none (not distributed)")
    elif len(ranks) <= 32:
        out.append(f"ranks: {', '.join(map(str, ranks))}")
    else:
        out.append(f"ranks: {ranks[0]} to {ranks[-1]} ({len(ranks)} ranks)")
    return out + [""]


def _nonfinite_lines(summary):
    unit = summary.unit
    first = summary.first_nonfinite
    out = [f"first non-finite value: {'no nan/inf recorded' if first is None else _nonfinite_text(first, unit)}"]
    for det in summary.detections[:1]:
        entries = [printable(e) for e in det.get("entries", ())[:20]]
        out.append(f"detection record: {when(det.get('step'), det.get('global_step'), det.get('mode'), unit)}, "
                   f"{det.get('phase')}, module {module_name(det.get('module', ''), det.get('class'))}, "
                   f"entries {entries}")
    for backoff in summary.backoffs[:1]:
        out.append(f"GradScaler backoffs (inf/nan gradients the scaler recovered from, not detections): "
                   f"{summary.backoff_count}, the first at "
                   f"{when(backoff.get('step'), backoff.get('global_step'), backoff.get('mode'), unit)}, scale "
                   f"{float(backoff['scale']):.3g}, module {module_name(backoff.get('module', ''), backoff.get('class'))}")
    return out + [""]


def _eval_lines(summary):
    if not summary.modes["eval"]:
        return []
    unit = summary.unit
    evals, count = summary.eval_steps, summary.eval_step_count
    steps = ", ".join(map(str, evals)) if count <= 8 else f"{evals[0]} to {evals[-1]}"
    at = f" at {count} optimizer steps ({steps})" if count else ""
    out = [f"eval (kept apart: the picture's cells are the train timeline): {summary.modes['eval']} tensor entries{at}"]
    if summary.eval_best is not None:
        module, class_name, entry, dtype, step, global_step, mode, phase, abs_max, ratio, computed = summary.eval_best
        out.append(f"  lowest headroom in eval: {headroom(ratio):.2f} bits (abs max {abs_max:.3g}), "
                   f"{module_name(module, class_name)} {printable(entry)} [{_judged(dtype, computed)}] at "
                   f"{when(step, global_step, mode, unit)}, {phase}")
    nonfinite = summary.eval_nonfinite
    out.append("  first non-finite value in eval: " + ("none" if nonfinite is None else _nonfinite_text(nonfinite, unit)))
    return out + [""]


def _headroom_lines(summary):
    unit = summary.unit
    hottest = summary.hottest()
    out = ["closest to the dtype's limit (headroom = log2(dtype max / abs max), in bits; lowest first):"]
    if not hottest:
        out.append("  (no finite floating-point values recorded)")
    else:
        # with optimizer steps: the step and the batch number (the detector's report names the batch)
        steps = f"{'opt step':>8} {'batch':>7}" if unit == OPTIMIZER else f"{'step':>7}"
        out.append(f"  {'bits':>6}  {'abs max':>9}  {'dtype':<9} {steps}  module / entry")
        for name, class_name, (bits, entry, dtype, step, phase, abs_max, global_step, mode, judged) in hottest:
            steps = f"{'-' if global_step is None else global_step:>8} {step:>7}" if unit == OPTIMIZER else f"{step:>7}"
            tag = (", eval" if mode == "eval" else "") + (f"; a {printable(dtype)} computed in it" if judged != dtype else "")
            out.append(f"  {bits:6.2f}  {abs_max:9.3g}  {printable(judged):<9} {steps}  "
                       f"{module_name(name, class_name)} {printable(entry)} ({phase}{tag})")
    return out + [""]


def _underflow_lines(summary):
    unit = summary.unit
    out = ["underflow hot spots (largest fraction of subnormal values):"]
    if not summary.subnormal:
        out.append("  (no subnormal values recorded)")
    for frac, _, module, entry, dtype, numel, step, global_step, mode in summary.subnormal:
        out.append(f"  {100 * frac:6.2f}%  of {numel:>9} {printable(dtype):<9} at "
                   f"{_at(step, global_step, mode, unit)}  {module_name(module)} {printable(entry)}")
    out.append("entries that are all zeros (latest first):")
    if not summary.all_zero:
        out.append("  (none)")
    for _, _, module, entry, dtype, numel, step, global_step, mode in summary.all_zero:
        out.append(f"  last at {_at(step, global_step, mode, unit)}  {module_name(module)} {printable(entry)} "
                   f"[{printable(dtype)}, {numel} elements]")
    if summary.zero_count > len(summary.all_zero):
        out.append(f"  ... and {summary.zero_count - len(summary.all_zero)} more")
    return out


def _judged(dtype, computed_in):
    """The dtype an entry's headroom is judged against, and, where it is not its own, that one."""
    judged = judged_in(dtype, computed_in)
    return printable(judged) + ("" if judged == dtype else f", a {printable(dtype)} computed in it")


def malformed_names(notes):
    """The first malformed lines, where and why: "run.jsonl:3 (not JSON), ..."."""
    return ", ".join(f"{printable(os.path.basename(s))}:{n} ({reason})" for s, n, reason in notes.malformed_lines)


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
            f"module {module_name(first['module'], first['class'])}, entry {printable(first['entry'])} "
            f"[{printable(first['dtype'])}]: {what}")
