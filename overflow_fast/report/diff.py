"""``overflow-fast diff A.jsonl B.jsonl``: where two recorded runs first part, in SQL over the
entries table (``engine.Logs`` of two logs, A = log 0 and B = log 1).

The entry records are aligned by (rank, step, phase, module, entry, occurrence): the k-th record
of a key in A with the k-th of that key in B (a module called twice in a step has two), over the
whole logs, in whatever order they were written. A log without ranks counts as rank 0. An aligned
pair *parts* when one run recorded a nan/inf and the other did not, or when abs-min or abs-max
differ by more than ``rtol`` relative to the larger of the two (differences of at most ``atol``
count as none). Where the two records' dtypes differ, only abs-max is compared: a tensor's
smallest magnitude moves with its dtype's rounding and underflow, its largest one by a rounding
error at most. The first pair that parts, by step, then rank, then A's order, is named; then the
largest divergence of each module; and what only one run recorded, named apart: ranks, steps (a
run that went on longer, a different ``log_every``), modules, and other entries.
"""

import math

from .summary import NOT_RECORDED  # noqa: F401 - a kind of cell here too
from .text import cut, label, module_name, printable, when
from .timeline import BATCH, OPTIMIZER, bin_width

MAX_COLUMNS = 200  # step bins of the picture: fewer than 2 * MAX_COLUMNS
PLOT_ROWS = 512
TOP = 10
MAX_EXAMPLES = 5
INF = float("inf")

ABS_MAX, ABS_MIN, BAD = 1, 2, 3  # where a divergence comes from (BAD: a nan/inf in one run only)
ABS_NAMES = {ABS_MIN: "abs min", ABS_MAX: "abs max", BAD: "nan/inf"}
STATS = {"both": (ABS_MAX, ABS_MIN), "abs_max": (ABS_MAX,), "abs_min": (ABS_MIN,)}
STAT_NAMES = {"both": "abs min or abs max", "abs_max": "abs max", "abs_min": "abs min"}
KEY = ("r0", "step", "phase", "module", "entry", "occ")
ROW = "step, phase, module, cls, entry, dtype, numel, amin, amin_s, amax, amax_s, bad, rank, gstep, mode, pos"
ROW_KEYS = tuple(ROW.split(", "))


def _relative(x, y, atol):
    """SQL: |x - y| relative to the larger of two magnitudes (columns of ``a`` and ``b``): 0 within
    ``atol``; where one is not a finite number, 0 when both are not (both broke; an empty tensor's
    null is not compared) and inf when one only is."""
    return f"""CASE
        WHEN a.{x} IS NOT NULL AND b.{x} IS NOT NULL THEN CASE WHEN abs(a.{x} - b.{x}) <= {atol!r} THEN 0.0
            ELSE abs(a.{x} - b.{x}) / CASE WHEN a.{x} > b.{x} THEN a.{x} ELSE b.{x} END END
        WHEN (a.{x} IS NULL AND a.{y} IS NULL) OR (b.{x} IS NULL AND b.{y} IS NULL) THEN 0.0
        WHEN (a.{y} IS NULL) = (b.{y} IS NULL) THEN 0.0 ELSE 9e999 END"""


class Side:
    """One log as the diff saw it: its entries and steps, and what only it recorded (not compared):
    ``only`` entries, by why: ``only_ranks`` {rank: entries}, ``only_steps`` (entries, (rank, step)s,
    the steps listed when few, first, last), ``only_modules`` [(module, class, entries)] (the first
    few) of ``only_module_count``, ``only_other`` entries and the first few of them (row dicts)."""

    def __init__(self, diff, logs, log, totals, ranks):
        self.name, self.log = "AB"[log], log
        self.path = logs.paths[log]
        self.notes = logs.notes[log]
        self.entries, self.first_step, self.last_step = next((row[1:4] for row in totals if row[0] == log), (0, None, None))
        self.ranks = [r for which, r in ranks if which == log]
        counts = dict(logs.rows("SELECT why, count(*) FROM alone WHERE log = ? GROUP BY why", (log,)))
        self.only = sum(counts.values())
        self.only_ranks = dict(logs.rows("SELECT r0, count(*) FROM alone WHERE log = ? AND why = 1 GROUP BY r0 "
                                         "ORDER BY r0", (log,)))
        steps = logs.one(f"""SELECT count(*), count(DISTINCT step), min(step), max(step),
                                count(DISTINCT step * {1 << 21} + r0) FROM alone WHERE log = ? AND why = 2""", (log,))
        listed = [s for s, in logs.rows("SELECT DISTINCT step FROM alone WHERE log = ? AND why = 2 ORDER BY step "
                                        "LIMIT 9", (log,))]
        self.only_steps = (steps[0], steps[4], listed if steps[1] <= 8 else None, steps[2], steps[3])
        self.only_module_count = logs.one("SELECT count(DISTINCT module) FROM alone WHERE log = ? AND why = 3",
                                          (log,))[0]
        self.only_modules = logs.rows("""
            SELECT m.module, e.cls, m.n FROM (SELECT module, count(*) AS n, min(pos) AS first FROM alone
                                              WHERE log = ? AND why = 3 GROUP BY module) AS m
            JOIN entries e ON e.pos = m.first ORDER BY m.first LIMIT ?""", (log, MAX_EXAMPLES))
        self.only_other = counts.get(4, 0)
        self.only_examples = diff.rows_at([pos for pos, in logs.rows(
            "SELECT pos FROM alone WHERE log = ? AND why = 4 ORDER BY pos LIMIT ?", (log, MAX_EXAMPLES))])


class Diff:
    """The comparison of the two logs of ``logs``; the results are attributes, and ``text()``
    prints them. ``grid``: also what the picture needs (``cells``, ``one_sided``)."""

    def __init__(self, logs, rtol=1e-2, atol=0.0, stat="both", grid=False):
        if not (rtol >= 0 and math.isfinite(rtol)) or not (atol >= 0 and math.isfinite(atol)):
            raise ValueError("rtol and atol must be finite numbers >= 0")
        if stat not in STATS:
            raise ValueError(f"stat must be one of {', '.join(STATS)}, not {stat!r}")
        self.logs, self.rtol, self.atol, self.stat = logs, rtol, atol, stat
        self._align()
        self.dtype_differs, self.numel_differs = (n or 0 for n in logs.one(
            "SELECT sum(dtypes_differ), sum(numels_differ) FROM pairs"))
        self.first_dtype = self._first_of("dtypes_differ = 1") if self.dtype_differs else None
        self.first_numel = self._first_of("numels_differ = 1") if self.numel_differs else None
        # runs that compute in other dtypes: a tensor's smallest magnitude moves with its dtype's
        # rounding and underflow (and so does everything after it), its largest by a rounding error
        self.compared = "abs_max" if stat == "both" and self.dtype_differs else stat
        self._score()
        self.pairs, self.parted, self.modules_compared, self.modules_parted = logs.one("""
            SELECT count(*), sum(parted), count(DISTINCT module), count(DISTINCT CASE WHEN parted = 1 THEN module END)
            FROM scored""")
        self.parted = self.parted or 0
        self.first = self._pair(logs.one("SELECT apos, bpos, value, field FROM scored WHERE parted = 1 "
                                         "ORDER BY step, r0, apos LIMIT 1"))
        self._modules()
        totals = logs.rows("SELECT log, count(*), min(step), max(step), count(gstep) FROM entries GROUP BY log")
        ranks = logs.rows("SELECT DISTINCT log, coalesce(rank, 0) AS r0 FROM entries ORDER BY log, r0")
        self.sides = [Side(self, logs, log, totals, ranks) for log in (0, 1)]
        self.unit = OPTIMIZER if any(row[4] for row in totals) else BATCH
        self.cells = None
        if grid:
            self._grid()
        del self.logs  # plain data from here on

    def _align(self):
        """``aligned``: every record of either log, with its partner where it has one (A's position
        ``apos``, B's ``bpos``), and of a pair the relative differences of abs max (``high``) and abs
        min (``low``); ``pairs`` those with both; ``alone`` the others, and why they have none."""
        logs = self.logs
        key = "coalesce(rank, 0), step, phase, module, entry"
        # a key that comes more than once in a log: its records are numbered, the k-th pairing with
        # the k-th; every other record is its key's only one (numbering them all costs a sort)
        same = " AND ".join(f"{c} = r_{c}" for c in ("r0", "step", "phase", "module", "entry"))
        numbered = 1 if logs.engine != "duckdb" else logs.one(  # (a cheap test first: no key twice, no hash twice)
            f"SELECT count(*) - count(DISTINCT hash(log, {key})) FROM entries")[0]
        if numbered:
            logs.rows(f"""CREATE TEMP TABLE numbered AS
                          WITH rep AS (SELECT DISTINCT coalesce(rank, 0) AS r_r0, step AS r_step, phase AS r_phase,
                                           module AS r_module, entry AS r_entry
                                       FROM entries GROUP BY log, {key} HAVING count(*) > 1)
                          SELECT pos, row_number() OVER (PARTITION BY log, {key} ORDER BY pos) AS occ
                          FROM (SELECT *, coalesce(rank, 0) AS r0 FROM entries) AS e JOIN rep ON {same}""")
            numbered = logs.one("SELECT count(*) FROM numbered")[0]
        occ, join = ("coalesce(n.occ, 1)", "LEFT JOIN numbered n ON n.pos = e.pos") if numbered else ("1", "")
        for log, name in ((0, "side_a"), (1, "side_b")):
            logs.relation(name, f"""SELECT e.pos, coalesce(e.rank, 0) AS r0, e.step, e.phase, e.module, e.entry,
                                        {occ} AS occ, e.gstep, e.dtype, e.numel, e.bad, e.amax, e.amax_s, e.amin,
                                        e.amin_s
                                    FROM entries e {join} WHERE e.log = {log}""", ", ".join(KEY))
        on = " AND ".join(f"a.{c} = b.{c}" for c in KEY)
        select = f"""SELECT a.pos AS apos, b.pos AS bpos, coalesce(a.r0, b.r0) AS r0, coalesce(a.step, b.step) AS step,
            coalesce(a.module, b.module) AS module,
            CASE WHEN a.pos IS NULL THEN b.gstep ELSE a.gstep END AS gstep, a.bad AS a_bad, b.bad AS b_bad,
            CASE WHEN a.dtype <> b.dtype THEN 1 ELSE 0 END AS dtypes_differ,
            CASE WHEN a.numel <> b.numel THEN 1 ELSE 0 END AS numels_differ,
            {_relative("amax", "amax_s", self.atol)} AS high, {_relative("amin", "amin_s", self.atol)} AS low"""
        a, b = "side_a AS a", "side_b AS b"
        if logs.full_join:
            joined = f"{select} FROM {a} FULL JOIN {b} ON {on}"
        else:  # (sqlite before 3.39)
            joined = (f"{select} FROM {a} LEFT JOIN {b} ON {on} UNION ALL {select} FROM {b} LEFT JOIN {a} ON {on} "
                      f"WHERE a.pos IS NULL")
        logs.rows(f"CREATE TEMP TABLE aligned AS {joined}")
        logs.rows("CREATE TEMP VIEW pairs AS SELECT * FROM aligned WHERE apos IS NOT NULL AND bpos IS NOT NULL")
        one = "FROM aligned WHERE apos IS NULL OR bpos IS NULL"
        why = "4"
        sets = ""
        if logs.one(f"SELECT count(*) {one}")[0]:  # why: the other log has no record of its rank, step, module
            why = "CASE WHEN r_log IS NULL THEN 1 WHEN s_log IS NULL THEN 2 WHEN m_log IS NULL THEN 3 ELSE 4 END"
            sets = """LEFT JOIN (SELECT DISTINCT log AS r_log, coalesce(rank, 0) AS r_r0 FROM entries) AS r
                          ON r_log = 1 - log AND r_r0 = r0
                      LEFT JOIN (SELECT DISTINCT log AS s_log, coalesce(rank, 0) AS s_r0, step AS s_step FROM entries) AS s
                          ON s_log = 1 - log AND s_r0 = r0 AND s_step = step
                      LEFT JOIN (SELECT DISTINCT log AS m_log, module AS m_module FROM entries) AS m
                          ON m_log = 1 - log AND m_module = module"""
        logs.rows(f"""CREATE TEMP TABLE alone AS
                      SELECT one.*, {why} AS why
                      FROM (SELECT CASE WHEN apos IS NULL THEN 1 ELSE 0 END AS log, coalesce(apos, bpos) AS pos, r0,
                                step, module, gstep {one}) AS one {sets}""")

    def _score(self):
        """``scored``: the pairs with their divergence over the statistics compared, where it comes
        from, whether it parts, and ``sr``: (step, rank) as one number, the pairs' order with A's
        position."""
        fields = STATS[self.compared]
        high = "high" if ABS_MAX in fields else "0.0"
        low = "low" if ABS_MIN in fields else "0.0"
        self.logs.rows(f"""
            CREATE TEMP VIEW scored AS
            SELECT *, CASE WHEN value > {self.rtol!r} THEN 1 ELSE 0 END AS parted, step * {1 << 21} + r0 AS sr
            FROM (SELECT *, CASE WHEN a_bad <> b_bad THEN 9e999 WHEN {high} >= {low} THEN {high} ELSE {low} END AS value,
                      CASE WHEN a_bad <> b_bad THEN {BAD} WHEN {high} > 0 AND {high} >= {low} THEN {ABS_MAX}
                           WHEN {low} > {high} THEN {ABS_MIN} END AS field
                  FROM pairs) AS v""")

    def rows_at(self, positions):
        """Entry rows as dicts (``ROW_KEYS`` and ``line``), in the order of ``positions``."""
        if not positions:
            return []
        found = {row[-1]: row for row in self.logs.rows(
            f"SELECT {ROW} FROM entries WHERE pos IN ({', '.join('?' * len(positions))})", positions)}
        lines = self.logs.lines_of(positions)
        return [dict(zip(ROW_KEYS, found[pos]), line=lines[pos]) for pos in positions]

    def _pair(self, found):
        """(row of A, row of B, divergence, field) of a pair of ``pairs`` (apos, bpos, value, field)."""
        if found is None:
            return None
        a, b = self.rows_at(found[:2])
        return a, b, found[2], found[3]

    def _first_of(self, where):
        """(row of A, row of B) of the first pair where ``where`` holds."""
        first = self.logs.one(f"SELECT apos, bpos FROM pairs WHERE {where} ORDER BY step, r0, apos LIMIT 1")
        return tuple(self.rows_at(list(first)))

    def _modules(self):
        """Per module: the largest divergence (its first pair), where it first parted, how often;
        ``largest`` the ``TOP`` that diverge most (ties: the one that parted first, then the one
        compared first); ``drawn`` the ``PLOT_ROWS`` the picture shows, in the order first compared.
        "First" is by (step, rank, A's position): the least ``sr``, then the least ``apos`` there."""
        logs = self.logs
        logs.relation("module_first", """SELECT module AS m_module, max(value) AS v, sum(parted) AS n, min(sr) AS fsr,
                                              min(CASE WHEN parted = 1 THEN sr END) AS psr
                                          FROM scored GROUP BY module""", "m_module")
        logs.relation("module_pairs", """SELECT m_module, v, n, fsr, psr, min(CASE WHEN sr = fsr THEN apos END) AS first,
                                              min(CASE WHEN parted = 1 AND sr = psr THEN apos END) AS fp,
                                              min(CASE WHEN value = v THEN sr END) AS bsr
                                          FROM scored JOIN module_first ON m_module = module
                                          GROUP BY m_module, v, n, fsr, psr""", "m_module")
        logs.rows("""CREATE TEMP TABLE per_module AS
                     SELECT m_module AS module, v, n, fsr, psr, first, fp, min(apos) AS best
                     FROM scored JOIN module_pairs ON m_module = module AND value = v AND sr = bsr
                     GROUP BY m_module, v, n, fsr, psr, first, fp""")
        self.differing = logs.one("SELECT count(*) FROM per_module WHERE v > 0")[0]
        largest = logs.rows("""SELECT m.module, m.v, m.n, b.apos, b.bpos, b.field, m.fp, m.first FROM per_module m
                               JOIN scored b ON b.apos = m.best WHERE m.v > 0
                               ORDER BY m.v DESC, m.psr IS NULL, m.psr, m.fp, m.fsr, m.first LIMIT ?""", (TOP,))
        self.largest = []
        for module, value, parted, apos, bpos, field, first_parted, first in largest:
            a, b = self.rows_at([apos, bpos])
            parted_at = None if first_parted is None else self.rows_at([first_parted])[0]
            self.largest.append((module, value, field, a, b, parted_at, parted, first))
        logs.rows("CREATE TEMP TABLE drawn AS SELECT module AS drawn_module, first AS drawn_first, fsr FROM per_module "
                  "ORDER BY v DESC, fsr, first LIMIT ?", (PLOT_ROWS,))
        self.drawn = logs.rows(f"SELECT drawn_first, {cut('drawn_module')} FROM drawn ORDER BY fsr, drawn_first")

    def _grid(self):
        """The picture's cells: per drawn module, the largest divergence in each bin of ``width``
        steps of the timeline's unit (A's optimizer step where the records carry one), and the
        bins where one run only recorded it."""
        logs = self.logs
        x = "gstep" if self.unit == OPTIMIZER else "step"
        first, last = logs.one(f"SELECT min({x}), max({x}) FROM entries")
        self.width = width = 1 if first is None else bin_width(first, last, MAX_COLUMNS)
        shift = width.bit_length() - 1
        self.cells, self.one_sided, self.first_drawn = {}, {}, None  # by the module's first pair (``drawn``)
        if first is None:  # (no entries: nothing to draw, and the command says so)
            return
        for key, b, value in logs.rows(f"""SELECT drawn_first, {x} >> {shift} AS b, max(value) FROM scored
                                           JOIN drawn ON module = drawn_module WHERE {x} IS NOT NULL
                                           GROUP BY drawn_first, b"""):
            self.cells.setdefault(key, {})[b] = value
        for key, b in logs.rows(f"""SELECT DISTINCT drawn_first, {x} >> {shift} FROM alone
                                    JOIN drawn ON module = drawn_module WHERE {x} IS NOT NULL"""):
            self.one_sided.setdefault(key, set()).add(b)
        found = None if self.first is None else logs.one("SELECT drawn_first FROM drawn WHERE drawn_module = ?",
                                                           (self.first[0]["module"],))
        self.first_drawn = None if found is None else found[0]

    def text(self):
        return "\n".join(_text_lines(self))


# -- the picture's data ----------------------------------------------------------------------------

DIFFERS = "differs"  # the largest divergence of the module's aligned entries there (> 0)
IDENTICAL = "identical"  # aligned entries there, all with equal statistics
NONFINITE = "nan/inf in one run"  # a nan/inf that the other run did not have
ONE_RUN = "one run only"  # entries there that only one run recorded, none aligned


class Picture:
    """What ``diff --png`` draws, as plain data (``diff_plot`` only draws it): rows ``modules`` (in
    the order they were first compared) and ``labels``, columns (bins of ``width`` steps of
    ``unit``), per cell ``values`` (the largest divergence, or None) and ``kinds``; ``first`` the
    first parting (``x``, ``row``, ``text``); ``curves`` the modules with the largest divergence;
    ``title``, ``explained`` and ``xlabel`` what is drawn."""

    def __init__(self, diff, curves=5):
        self.rtol, self.unit = diff.rtol, diff.unit
        self.width = width = diff.width
        self.keys = keys = [key for key, _ in diff.drawn]  # each module's first pair
        self.modules = self.labels = [label(name) if name else "(model)" for _, name in diff.drawn]
        self.columns = sorted({b for bins in list(diff.cells.values()) + list(diff.one_sided.values()) for b in bins})
        self.centres = [c * width + (width - 1) / 2 for c in self.columns]
        column = {c: j for j, c in enumerate(self.columns)}
        self.values = [[None] * len(self.columns) for _ in keys]
        self.kinds = [[NOT_RECORDED] * len(self.columns) for _ in keys]
        for i, key in enumerate(keys):
            for c in diff.one_sided.get(key, ()):
                self.kinds[i][column[c]] = ONE_RUN
            for c, value in diff.cells.get(key, {}).items():
                j = column[c]
                if value == INF:
                    self.kinds[i][j] = NONFINITE
                elif value > 0:
                    self.values[i][j], self.kinds[i][j] = value, DIFFERS
                else:
                    self.kinds[i][j] = IDENTICAL
        axis = "optimizer step" if self.unit == OPTIMIZER else "step (the detector's batch number)"
        self.xlabel = axis + (f"; a column covers {width} {'steps' if self.unit == OPTIMIZER else 'batches'}: "
                              f"its largest divergence is shown" if width > 1 else "")
        stats = STAT_NAMES[diff.compared]
        self.title = (f"Where two runs part: divergence of {stats} per module and "
                      f"{'optimizer step' if self.unit == OPTIMIZER else 'step'}")
        self.explained = (f"divergence = |A - B| / max(A, B) of {stats}, the largest of the module's entries in the "
                          f"column" + ("; the runs' dtypes differ: abs min is not compared"
                                       if diff.compared != diff.stat else ""))
        self.first = None
        if diff.first is not None:
            a, _, value, field = diff.first
            x = a["gstep"] if self.unit == OPTIMIZER else a["step"]
            row = keys.index(diff.first_drawn) if diff.first_drawn is not None and x is not None else None
            self.first = {
                "x": x, "row": row,
                "text": (f"first parting: {_when(a)}, {a['phase']}\n{label(a['module'] or '(model)')}\n"
                         f"{label(a['entry'])}: " + ("nan/inf in one run" if field == BAD else
                                                      f"{ABS_NAMES[field]} {_percent(value)}")
                         + ("" if row is not None else "\n(not among the modules drawn)")),
            }
        row = {key: i for i, key in enumerate(keys)}
        self.curves = [row[found[7]] for found in diff.largest[:max(curves, 0)] if found[7] in row]


# -- the text ------------------------------------------------------------------------------------

def _when(row):
    unit = BATCH if row["gstep"] is None else OPTIMIZER
    return when(row["step"], row["gstep"], row["mode"], unit)


def _percent(value):
    return "inf" if value == INF else f"{100 * value:.3g}%"


def _g(value):
    return "-" if value is None else f"{value:.6g}"


def _stat(row, which):
    """A row's abs min or abs max as a float (a nan/inf's too), None for an empty tensor."""
    value, special = (row["amin"], row["amin_s"]) if which == ABS_MIN else (row["amax"], row["amax_s"])
    return float(special) if special is not None else value


def _stat_text(row):
    return (f"abs min {_g(_stat(row, ABS_MIN))}, abs max {_g(_stat(row, ABS_MAX))}" + (" (nan/inf)" if row["bad"] else "")
            + f" [{printable(row['dtype'])}, {row['numel']} elements]")


def _what(row):
    return f"{module_name(row['module'])} {printable(row['entry'])}"


def _span(values, count, first, last):
    """The values when few, else "first to last"."""
    return ", ".join(map(str, values)) if values is not None and count <= 8 else f"{first} to {last}"


def _text_lines(diff):
    out = []
    for side in diff.sides:
        steps = ("no tensor entries" if not side.entries else
                 f"{side.entries:,} tensor entries, steps {side.first_step} to {side.last_step}")
        ranks = side.ranks
        out.append(f"{side.name}: {printable(side.path)}: {steps}"
                   + (f", ranks {_span(ranks, len(ranks), ranks[0], ranks[-1])}" if ranks and ranks != [0] else ""))
        notes = side.notes
        if notes.malformed:
            named = ", ".join(f"{n} ({printable(reason)})" for _, n, reason in notes.malformed_lines)
            out.append(f"   malformed lines skipped: {notes.malformed:,} (first: line {named})")
        for det in notes.detections[:1]:
            unit = BATCH if det.get("global_step") is None else OPTIMIZER
            out.append(f"   detection record: {when(det['step'], det.get('global_step'), det.get('mode'), unit)}, "
                       f"{det['phase']}, module {module_name(det['module'], det['class'])}")
    out.append(f"aligned: {diff.pairs:,} entry pairs, by (rank, step, phase, module, entry); they part "
               f"where {STAT_NAMES[diff.compared]} differs by more than rtol {diff.rtol:g} of the larger"
               + (f" (differences up to atol {diff.atol:g} count as none)" if diff.atol else "")
               + ", or where one run only has a nan/inf")
    for section in (_first_lines, _largest_lines, _one_sided_lines):
        out.append("")
        out.extend(section(diff))
    return out


def _first_lines(diff):
    out = []
    if diff.first is None:
        out.append("first parting: none (every aligned pair within the tolerance)")
    else:
        a, b, value, field = diff.first
        ranks = set(diff.sides[0].ranks) | set(diff.sides[1].ranks)
        rank = f", rank {a['rank'] or 0}" if ranks != {0} else ""
        out.append(f"first parting: {_when(a)}, {a['phase']}{rank}, module {module_name(a['module'], a['cls'])}, "
                   f"entry {printable(a['entry'])}")
        out.append(f"   A: {_stat_text(a)}  (line {a['line']})")
        out.append(f"   B: {_stat_text(b)}  (line {b['line']})")
        if field == BAD:
            out.append(f"   a nan/inf in {'A' if a['bad'] else 'B'} only")
        else:
            out.append(f"   {ABS_NAMES[field]} differs by {_percent(value)}")
    out.append(f"pairs beyond the tolerance: {diff.parted:,} of {diff.pairs:,}"
               + (f" ({100 * diff.parted / diff.pairs:.3g}%)" if diff.pairs else "")
               + (f", in {diff.modules_parted} of {diff.modules_compared} modules" if diff.parted else ""))
    if diff.dtype_differs:
        a, b = diff.first_dtype
        out.append(f"dtype differs in {diff.dtype_differs:,} pairs (first: {_when(a)}, {_what(a)}: "
                   f"{printable(a['dtype'])} in A, {printable(b['dtype'])} in B)"
                   + ("; so abs max only is compared, abs min moving with a dtype's rounding and underflow "
                      "(--stat abs_min compares it anyway)" if diff.compared != diff.stat else ""))
    if diff.numel_differs:
        a, b = diff.first_numel
        out.append(f"element count differs in {diff.numel_differs:,} pairs (first: {_when(a)}, {_what(a)}: "
                   f"{a['numel']} in A, {b['numel']} in B)")
    return out


def _largest_lines(diff):
    out = ["largest divergence per module (its largest relative difference; parted: where it first went "
           "beyond the tolerance):"]
    if not diff.largest:
        out.append("  (no aligned pair differs)")
        return out
    table = [("divergence", "stat", "at", "parted", "A", "B", "module / entry")]
    for module, value, field, a, b, parted_at, *_ in diff.largest:
        if field == BAD:
            value_a, value_b = ("nan/inf" if row["bad"] else "finite" for row in (a, b))
        else:
            value_a, value_b = _g(_stat(a, field)), _g(_stat(b, field))
        table.append((_percent(value), ABS_NAMES[field], _when(a), "-" if parted_at is None else _when(parted_at),
                      value_a, value_b, f"{_what(a)} ({a['phase']})"))
    widths = [max(len(row[i]) for row in table) for i in range(6)]
    for row in table:
        cells = [row[0].rjust(widths[0]), row[1].ljust(widths[1]), row[2].ljust(widths[2]), row[3].ljust(widths[3]),
                 row[4].rjust(widths[4]), row[5].rjust(widths[5]), row[6]]
        out.append("  " + "  ".join(cells))
    if diff.differing > len(diff.largest):
        out.append(f"  ... and {diff.differing - len(diff.largest)} more modules that differ")
    return out


def _one_sided_lines(diff):
    out = []
    for side, other in (diff.sides, diff.sides[::-1]):
        if not side.only:
            out.append(f"in {side.name} only: nothing")
            continue
        out.append(f"in {side.name} only (not compared): {side.only:,} tensor entries")
        if side.only_ranks:
            ranks = sorted(side.only_ranks)
            out.append(f"   ranks {other.name} did not record: {_span(ranks, len(ranks), ranks[0], ranks[-1])} "
                       f"({len(ranks):,} {'rank' if len(ranks) == 1 else 'ranks'}, "
                       f"{sum(side.only_ranks.values()):,} entries)")
        entries, pairs, listed, first, last = side.only_steps
        if entries:
            out.append(f"   steps {other.name} did not record: {_span(listed, len(listed or ()), first, last)} "
                       f"({pairs:,} {'step' if pairs == 1 else 'steps'}, {entries:,} entries)")
        if side.only_modules:
            count = side.only_module_count
            shown = ", ".join(f"{module_name(m)} ({printable(c)}, {n} entries)" for m, c, n in side.only_modules)
            more = f", and {count - len(side.only_modules)} more" if count > len(side.only_modules) else ""
            out.append(f"   modules {other.name} did not record ({count:,} {'module' if count == 1 else 'modules'}): "
                       f"{shown}{more}")
        if side.only_other:
            shown = "; ".join(f"{_when(e)} {e['phase']} {_what(e)} (line {e['line']})" for e in side.only_examples)
            out.append(f"   other entries (an entry, or a repeated call, that {other.name} lacks): "
                       f"{side.only_other:,} entries; first: {shown}")
    return out
