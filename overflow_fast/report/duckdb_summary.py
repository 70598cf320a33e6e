"""The report's fast reader: DuckDB scans every log at once (``read_json``, all files in one
query, each file's scan in parallel with the others) and aggregates in SQL; the summary it fills
is the one the plain reader fills, line for line.

How the two agree:
- each row is checked in SQL against the schema, by SQL generated from ``schema.RECORDS`` (the
  same fields the plain reader checks); only entry records that fit are aggregated here;
- every other row (the meta line, detections, and any line that does not fit) is handed back by
  its position and re-read from the file by the plain reader, which decides and names it: the
  malformed lines, their reasons and their order are the plain reader's by construction;
- the SQL only finds *which* rows decide the tables (row numbers, by exact keys); those few rows
  are re-read and parsed by the plain parser too, so every value printed comes from it.
A file that DuckDB cannot read (a line over its 16 MiB limit, a name it would take for a glob
pattern, not a regular file, compressed other than with gzip, a gzip stream that is cut or damaged)
or that has more than ``MAX_RECHECK`` rows to hand back (a file of garbage) is read by the plain
reader instead.

Compression is told by the file's first bytes, as the plain reader tells it, never by its name.
DuckDB reads gzip without checking its checksums (a damaged stream can inflate to wrong lines,
silently): a gzip log is first read to its end by Python's gzip, which checks them, and only one
found intact is DuckDB's. Its rows are re-read by walking the decompressed lines (byte offsets
into a compressed file mean nothing).

Known difference: a line nesting deeper than Python's parser goes (about 1000 levels) inside a key
the schema does not know is malformed to the plain reader and read by DuckDB.
"""

import os
import stat
import struct
import tempfile

import duckdb

# read_json's file_index column came with DuckDB 1.3: an older one is as good as none here
if tuple(int(part) for part in duckdb.__version__.split(".")[:2] if part.isdigit()) < (1, 3):
    raise ImportError(f"DuckDB {duckdb.__version__} is too old for the report (1.3 or newer)")

from ..recording import schema
from .summary import (
    INTEGER,
    OPTIMIZER,
    POSITION_BITS,
    ZERO,
    BadFile,
    LogFile,
    intact,
    line_starts,
    parse_line,
    read_file,
    read_lines_at,
)

MAX_RECHECK = 10_000  # rows of one file handed back to the plain reader
# what a file DuckDB cannot read raises (a line over its limit, bytes it cannot decode, memory);
# anything else is a bug here and must not hide behind the plain reader
_UNREADABLE = (duckdb.InvalidInputException, duckdb.IOException, duckdb.OutOfMemoryException)
# Its JSON reader holds 32 MiB buffers per file being scanned, and grouping 300k modules needs
# room too: at 256 MB most runs over four 256 MB files ran out. 384 MB kept the process's peak RSS
# at 375 MB there.
MEMORY_LIMIT = "384MB"
_GLOB = set("*?[{")


def _limits_sql():
    cases = " ".join(f"WHEN '{name}' THEN '{value!r}'::DOUBLE" for name, value in schema.DTYPE_MAX.items())
    return f"CASE dtype {cases} END"


_ENTRY_OK = schema.sql_check("entry")


def _text(column):
    """A JSON string column's value: its text between the quotes when it has no escape (cheap),
    else decoded by DuckDB's JSON parser."""
    c = f'"{column}"'
    return f"CASE WHEN contains({c}::VARCHAR, '\\') THEN {c}->>'$' ELSE ({c}::VARCHAR)[2:-2] END"


def _scan_sql(param, compression, columns):
    """read_json of the file given as ``$param``, with its ``compression`` ("none" or "gzip": never
    guessed from the name, as DuckDB's "auto" would)."""
    assert compression in _COMPRESSIONS
    return (f"read_json(${param}, format = 'newline_delimited', columns = {columns}, ignore_errors = true, "
            f"maximum_object_size = {schema.MAX_LINE_BYTES}, compression = '{compression}')")


def _rows(compressions):
    """The rows of the files given as parameters $f0, $f1, ... (``compressions``: each one's):
    each file's own scan, numbered by a streaming row_number() (the rows of a file in its order:
    its non-blank lines). One numbered scan of all files would run on one thread; a union of
    per-file scans runs them in parallel. ``pos`` is the plain reader's position:
    (file index << 40) | ordinal; ``$i{j}`` the file's index."""
    scans = " UNION ALL ".join(
        f"""SELECT $i{j}::BIGINT * {1 << POSITION_BITS} + row_number() OVER () AS pos, $i{j}::BIGINT AS file, *
            FROM {_scan_sql(f"f{j}", compression, schema.sql_columns())}"""
        for j, compression in enumerate(compressions))
    return f"""
src AS ({scans}
), v AS (
    SELECT *, {schema.sql_values("entry")} FROM src
), t AS (
    SELECT pos, file, ({_ENTRY_OK}) AS fast,
        "step#int" AS step, {_text("phase")} AS phase, {_text("module")} AS module,
        {_text("class")} AS cls, {_text("entry")} AS entry, {_text("dtype")} AS dtype,
        "numel#int" AS numel, starts_with(abs_max::VARCHAR, '"') AS amax_text, "abs_max#double" AS amax,
        "nan#int" AS nan, "posinf#int" AS posinf, "neginf#int" AS neginf,
        "zero_frac#double" AS zf, "subnormal_frac#double" AS sf, "rank#int" AS rank,
        "global_step#int" AS gstep, {_text("mode")} AS mode
    FROM v
), e AS (
    SELECT *, CASE WHEN NOT nonfinite AND amax > 0 AND dtype_max IS NOT NULL
                   THEN greatest(dtype_max / amax, 1.0) END AS ratio
    FROM (
        -- (an empty tensor's abs_max is null: not a nan/inf, never an unknown)
        SELECT *, (nan > 0 OR posinf > 0 OR neginf > 0 OR coalesce(amax_text, false)) AS nonfinite,
            {_limits_sql()} AS dtype_max
        FROM t
    )
)
"""


def _params(paths, indexes):
    params = {f"f{j}": [path] for j, path in enumerate(paths)}
    params.update({f"i{j}": index for j, index in enumerate(indexes)})
    return params


# One streaming GROUP BY over every row taken twice (k = 1, 2): what GROUPING SETS would do,
# without materializing the rows first (which spilled a wide log to disk for minutes).
# - k = 1, the entries that fit, by module, and by (module, entry) for those with subnormals or
#   all zeros (the only ones the pairs' tables look at; a wide log has far fewer of them): the
#   row that decides each table (lowest headroom, largest subnormal fraction, latest all-zero
#   step, first nan/inf) and the module's first row;
# - k = 2, every row, by (file, step, rank, optimizer step, mode) for the entries that fit (a
#   batch has one optimizer step and mode: no more groups), and one group per row that does not:
#   the rows to hand back, the steps, ranks, phases and modes.
# "First" is decided by the position. Each "least" is one HUGEINT (a fixed-size state, much
# cheaper than a struct's): the deciding value in the high 64 bits (a positive double's IEEE bits
# order as the double does), the position in the low ones. Each is computed only for the rows it
# is about (CASE, not FILTER: a FILTER still computes it for every row, and a negative one overflows).
_LOW = 2 ** 64
_BITS = "(({x})::BIT)::BIGINT"


_FIRST = f"step::HUGEINT * {2 ** 21} + coalesce(rank, -1) + 1"  # what comes first: by batch number, then rank


def _key(high):
    return f"(({high})::HUGEINT * {_LOW} + pos)"


_GROUPED = f"""
SELECT k,
    CASE WHEN k = 1 THEN module END AS module,
    CASE WHEN k = 1 AND numel > 0 AND (sf > 0 OR zf >= 1) THEN entry END AS entry,
    CASE WHEN k = 2 THEN file END AS file, CASE WHEN k = 2 THEN fast END AS ok,
    CASE WHEN k = 2 AND fast THEN step END AS step, CASE WHEN k = 2 AND fast THEN rank END AS rank,
    CASE WHEN k = 2 AND fast THEN gstep END AS gstep, CASE WHEN k = 2 AND fast THEN mode END AS mode,
    CASE WHEN k = 2 AND NOT fast THEN pos END AS slow_pos,
    count(*) AS rows, min(pos) AS first_pos,
    count(*) FILTER (WHERE phase = 'forward') AS forward,
    min(CASE WHEN k = 1 AND ratio IS NOT NULL THEN {_key(_BITS.format(x="ratio"))} END) AS best,
    min(CASE WHEN k = 1 AND numel > 0 AND sf > 0 THEN {_key(f"{2 ** 63 - 1} - " + _BITS.format(x="sf"))} END) AS sub,
    min(CASE WHEN k = 1 AND numel > 0 AND zf >= 1 THEN {_key(f"{2 ** 41} - step")} END) AS zero,
    min(CASE WHEN k = 1 AND nonfinite THEN {_key(_FIRST)} END) AS nonfinite,
    min(CASE WHEN k = 1 AND ratio IS NOT NULL AND mode = 'eval' THEN {_key(_BITS.format(x="ratio"))} END) AS eval_best,
    min(CASE WHEN k = 1 AND nonfinite AND mode = 'eval'
             THEN {_key(_FIRST)} END) AS eval_nonfinite,
    min(CASE WHEN k = 1 AND numel > 0 AND sf > 0 THEN pos END) AS sub_first
FROM e, (VALUES (1), (2)) AS u(k)
WHERE k = 2 OR fast
GROUP BY ALL
"""


# an optimizer step and whether it is eval, as the plain reader counts them (Summary.opt_steps)
_OSTEP = "gstep * 2 + coalesce(mode = 'eval', false)::BIGINT"


def _split(key):
    """A HUGEINT key -> (its high part, the position)."""
    return key >> 64, key & (_LOW - 1)


def _double(bits):
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def _query(compressions, max_modules, max_keys, step_cap, names=False):
    """The whole read of the files (``compressions``: each one's) as one statement. With
    ``names``, the distinct module names and all-zero (module, entry) pairs themselves, not only
    their counts (up to ``step_cap`` and one more: where the plain reader reads other files of the
    same run, the same names counted on both sides must count once) (a table in between would cost more
    than the scan: DuckDB compresses what it stores). Its rows: (what, i1..i5, h1, s1, s2, l1)."""
    pairs = "FROM g WHERE k = 1"
    spots = "FROM g WHERE k = 2 AND ok"
    modules = "m"

    def out(what, i1="NULL", i2="NULL", i3="NULL", i4="NULL", i5="NULL", h1="NULL", s1="NULL", s2="NULL",
            l1="NULL"):
        ints = ", ".join(f"({v})::BIGINT" for v in (i1, i2, i3, i4, i5))
        return f"'{what}', {ints}, ({h1})::HUGEINT, ({s1})::VARCHAR, ({s2})::VARCHAR, ({l1})::BIGINT[]"

    parts = [
        f"""SELECT {out('file', 'file', 'sum(rows)', 'count(slow_pos)',
                        l1=f"(list(slow_pos ORDER BY slow_pos) FILTER (WHERE slow_pos IS NOT NULL))[:{MAX_RECHECK + 1}]")}
            FROM g WHERE k = 2 GROUP BY file""",
        f"""SELECT {out('totals', 'sum(rows)', 'sum(forward)', 'min(step)', 'max(step)', '(SELECT steps FROM s)')} {spots}""",
        f"""SELECT {out('timeline', 'sum(rows) FILTER (WHERE gstep IS NOT NULL)', 'min(gstep)', 'max(gstep)',
                        "sum(rows) FILTER (WHERE mode = 'eval')", "sum(rows) FILTER (WHERE mode = 'train')",
                        h1='(SELECT osteps FROM s)')} {spots}""",
        f"""SELECT {out('ostep', 'v')} FROM (SELECT DISTINCT {_OSTEP} AS v {spots} AND gstep IS NOT NULL)
            WHERE (SELECT osteps FROM s) <= {step_cap}""",
        f"""SELECT {out('step', 'step')} FROM (SELECT DISTINCT step {spots})
            WHERE (SELECT steps FROM s) <= {step_cap}""",
        f"""SELECT {out('rank', 'rank')} FROM (SELECT DISTINCT rank {spots} AND rank IS NOT NULL)""",
        f"""SELECT {out('nonfinite', h1='min(nonfinite)')} {pairs}""",
        f"""SELECT {out('eval', h1='min(eval_best)')} {pairs}""",
        f"""SELECT {out('eval_nonfinite', h1='min(eval_nonfinite)')} {pairs}""",
        f"""SELECT {out('module_count', 'count(*)')} FROM {modules}""",
        f"""SELECT * FROM (SELECT {out('module', 'first_pos', h1='best', s1='module')} FROM {modules}
            ORDER BY best NULLS LAST, first_pos LIMIT {max_modules})""",
        f"""SELECT * FROM (SELECT {out('sub', 'sub_first', h1='sub', s1='module', s2='entry')}
            {pairs} AND sub IS NOT NULL ORDER BY sub LIMIT {max_keys})""",
        f"""SELECT {out('zero_count', 'count(*)')} {pairs} AND zero IS NOT NULL""",
        f"""SELECT * FROM (SELECT {out('zero', h1='zero', s1='module', s2='entry')}
            {pairs} AND zero IS NOT NULL ORDER BY zero LIMIT {max_keys})""",
    ]
    if names:
        parts += [
            f"""SELECT * FROM (SELECT {out('module_name', s1='module')} FROM {modules} LIMIT {step_cap + 1})""",
            f"""SELECT * FROM (SELECT {out('zero_name', s1='module', s2='entry')}
                {pairs} AND zero IS NOT NULL LIMIT {step_cap + 1})""",
        ]
    return (f"WITH {_rows(compressions)}, g AS MATERIALIZED ({_GROUPED}),\n"
            f"m AS MATERIALIZED (SELECT module, min(first_pos) AS first_pos, min(best) AS best {pairs} GROUP BY module),\n"
            f"s AS MATERIALIZED (SELECT count(DISTINCT step) AS steps, count(DISTINCT {_OSTEP}) AS osteps {spots})\n"
            + "\nUNION ALL\n".join(parts))


def _connect():
    con = duckdb.connect(config={"memory_limit": MEMORY_LIMIT, "preserve_insertion_order": True,
                                 "temp_directory": os.path.join(tempfile.gettempdir(),
                                                                f"overflow_fast_duckdb.{os.getpid()}")})
    con.execute("SET enable_progress_bar = false")
    return con


_COMPRESSIONS = ("none", "gzip")


def _scannable(path):
    """How DuckDB reads the file itself ("none" or "gzip"), or None where the plain reader must: a
    name DuckDB would take for a pattern, not a regular file, another compression, a gzip stream
    that Python's gzip (which checks what DuckDB's does not) finds cut or damaged."""
    if _GLOB & set(path):
        return None
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None
        with LogFile(path) as handle:
            compression = handle.compression or "none"
    except (OSError, BadFile):
        return None
    if compression not in _COMPRESSIONS or (compression == "gzip" and not intact(path)):
        return None
    return compression


_ORDINAL = (1 << POSITION_BITS) - 1


def _aggregate(con, paths, candidates, summary):
    """Run the query over the files ``candidates`` ({index into ``paths``: its compression}): (the
    per-file rows; the other result rows, by kind). Where other files are left to the plain
    reader, the distinct names come whole (``_query``'s ``names``)."""
    names = len(candidates) < len(paths)
    query = _query(list(candidates.values()), summary.max_modules, max(summary.subnormal.cap, summary.all_zero.cap),
                   summary.steps.cap, names)
    results = {"module_name": [], "zero_name": []} if names else {}
    for what, *values in con.execute(query, _params([paths[i] for i in candidates], list(candidates))).fetchall():
        results.setdefault(what, []).append(values)
    files = []
    for index, rows, slow, _, _, _, _, _, slow_pos in results.pop("file", ()):  # i1..i5, h1, s1, s2, l1
        files.append({"index": index, "rows": rows, "slow": slow,
                      "slow_ordinals": [pos & _ORDINAL for pos in slow_pos or ()]})
    return files, results


def read_files(paths, summary, progress=None):
    """Fill ``summary`` from ``paths`` (in this order), as ``summary.read_files`` would."""
    con = _connect()
    try:
        scannable = {i: _scannable(path) for i, path in enumerate(paths)}
        files, results = _scan(con, paths, {i: c for i, c in scannable.items() if c is not None}, summary)
        tables = _tables(results, summary) if files else None
        details = {}  # position -> (the parsed record of a row the tables name, its file)
        wanted_detail = {}
        for pos in (tables["rows"] if tables else ()):
            wanted_detail.setdefault(pos >> POSITION_BITS, set()).add(pos & _ORDINAL)
        done = {row["index"]: row for row in files}
        for index, path in enumerate(paths):  # in file order: what comes first is named first
            row = done.get(index)
            if row is None:  # not for DuckDB, or nothing it could read: all of it to the plain reader
                read_file(path, index, summary, progress)
                continue
            slow = set(row["slow_ordinals"])
            detail = wanted_detail.get(index, set())
            if slow or detail:
                wanted = sorted(slow | detail)
                visit = _visitor(summary, path, index, slow, detail, details)
                starts, lines = line_starts(path, wanted) if scannable[index] == "none" else (None, None)
                if lines == row["rows"]:  # no blank line: row k is line k
                    for ordinal, raw in zip(wanted, read_lines_at(path, starts)):
                        visit(ordinal, ordinal, raw)
                else:  # compressed, blank lines (or a file still being written): walk it line by line
                    read_file(path, index, summary, wanted=wanted, visit=visit)
            if progress is not None:
                progress.update(_size(path))
        if tables:
            _merge(summary, tables, details)
        if summary.timeline.keep_bins and files:
            # (a log without entry records has no subnormal table)
            firsts = {(module, entry): first for module, entry, _, first in tables.get("sub", ())} if tables else {}
            _cells(con, summary, paths, {row["index"]: scannable[row["index"]] for row in files}, firsts)
    finally:
        con.close()


def _visitor(summary, path, index, slow, detail, details):
    def visit(number, ordinal, raw):
        if ordinal in slow:
            if raw is None:
                summary.add_malformed(path, number, f"longer than {schema.MAX_LINE_BYTES} bytes")
            else:
                summary.add_line(raw, index, path, number, ordinal)
        if ordinal in detail and raw is not None:
            try:
                details[(index << POSITION_BITS) | ordinal] = (parse_line(raw)[1], path)
            except schema.Malformed:  # only where DuckDB and Python disagree (see the docstring)
                pass
    return visit


def _size(path):
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _scan(con, paths, candidates, summary):
    """The query over the files of ``candidates`` ({index: compression}) that DuckDB can take: one
    it cannot read, or with too much to hand back, is left out (to the plain reader)."""
    while candidates:
        try:
            files, results = _aggregate(con, paths, candidates, summary)
        except _UNREADABLE as error:
            if (isinstance(error, duckdb.OutOfMemoryException)
                    and con.execute("SELECT current_setting('threads')").fetchone()[0] > 1):
                con.execute("SET threads = 1")  # one file's buffers at a time: slower, not the plain reader
                continue
            if len(candidates) == 1:
                return [], {}
            readable = {}  # which files it cannot read, one by one (rare: a line over its limit)
            for i, compression in candidates.items():
                try:
                    con.execute(f"SELECT count(*) FROM {_scan_sql('file', compression, {'record': 'JSON'})}",
                                {"file": [paths[i]]})
                    readable[i] = compression
                except _UNREADABLE:
                    pass
            if readable == candidates:
                return [], {}
            candidates = readable
            continue
        heavy = {row["index"] for row in files if row["slow"] > MAX_RECHECK}
        if not heavy:
            return files, results
        candidates = {i: c for i, c in candidates.items() if i not in heavy}
    return [], {}


def _tables(results, summary):
    """What the summary keeps, as positions; ``rows``: the positions whose records are needed
    (re-read by the plain parser). A result row is (i1, i2, i3, i4, i5, h1, s1, s2, l1)."""
    out = {"rows": set()}
    entries, forward, first_step, last_step, steps = (results.get("totals") or [[0] * 5])[0][:5]
    out["totals"] = (entries or 0, forward or 0, first_step, last_step)
    out["steps"] = [values[0] for values in results.get("step", ())] if "step" in results else (steps or 0)
    out["ranks"] = [values[0] for values in results.get("rank", ())]
    if not entries:
        return out
    with_global_step, first_global, last_global, evals, trains, osteps = results["timeline"][0][:6]
    out["timeline"] = (with_global_step or 0, first_global, last_global, evals or 0, trains or 0)
    out["osteps"] = [values[0] for values in results["ostep"]] if "ostep" in results else (osteps or 0)
    for what in ("nonfinite", "eval", "eval_nonfinite"):
        key = results[what][0][5]
        out[what] = None if key is None else _split(key)
        if key is not None:
            out["rows"].add(out[what][1])
    out["module_count"] = results["module_count"][0][0]
    out["module_names"] = [v[6] for v in results["module_name"]] if "module_name" in results else None
    out["zero_names"] = [(v[6], v[7]) for v in results["zero_name"]] if "zero_name" in results else None
    out["modules"] = [(v[6], v[0], None if v[5] is None else _split(v[5])) for v in results.get("module", ())]
    out["sub"] = [(v[6], v[7], _split(v[5]), v[0]) for v in results.get("sub", ())]  # and its first subnormal
    out["zero_count"] = results["zero_count"][0][0]
    out["zero"] = [(v[6], v[7], _split(v[5])) for v in results.get("zero", ())]
    for _, first_pos, best in out["modules"]:
        out["rows"].add(first_pos)  # its class where it first appears
        if best is not None:
            out["rows"].add(best[1])
    for _, _, (_, pos), *_ in out["sub"] + out["zero"]:
        out["rows"].add(pos)
    return out


def _merge(summary, tables, details):
    entries, forward, first_step, last_step = tables["totals"]
    if not entries:
        return
    summary.records += entries
    summary.entries += entries
    summary.phases["forward"] += forward
    summary.phases["backward"] += entries - forward
    summary.add_steps(first_step, last_step)
    if isinstance(tables["steps"], list):
        for step in tables["steps"]:
            summary.steps.add(step)
    else:
        summary.steps.add_count(tables["steps"])
    for rank in tables["ranks"]:
        summary.add_rank(rank)
    with_global_step, first_global, last_global, evals, trains = tables["timeline"]
    summary.modes["eval"] += evals
    summary.modes["train"] += trains
    if with_global_step:
        summary.global_steps += with_global_step
        summary.add_global_steps(first_global, last_global)  # the timeline is the optimizer step's now
        if isinstance(tables["osteps"], list):
            for value in tables["osteps"]:
                summary.opt_steps.add(value)
        else:
            summary.opt_steps.add_count(tables["osteps"])
    if summary.unit == OPTIMIZER:
        if with_global_step:
            summary.timeline.add_x(first_global, last_global)
    else:
        summary.timeline.add_x(first_step, last_step)

    for what in ("nonfinite", "eval_nonfinite"):
        if tables[what] is not None:
            _, pos = tables[what]
            if pos in details:
                record, path = details[pos]
                rank = record.get("rank")
                summary.add_nonfinite((record["step"], -1 if rank is None else rank, pos), record, path,
                                      in_eval=what == "eval_nonfinite")
    if tables["eval"] is not None:
        bits, pos = tables["eval"]
        if pos in details:
            r = details[pos][0]
            summary.add_eval_best(r["module"], r["class"], ((_double(bits), pos), _best_of(r)))

    if tables["module_names"] is None:
        summary.module_names.add_count(tables["module_count"])
    else:  # the plain reader counts other files' names: the same name on both sides counts once
        for name in tables["module_names"]:
            summary.module_names.add(hash(name))
    summary.modules_dropped += max(0, tables["module_count"] - summary.max_modules)
    for module, first_pos, best in tables["modules"]:
        first = details.get(first_pos)
        class_name = first[0]["class"] if first else None
        if best is not None and best[1] in details:
            best = ((_double(best[0]), best[1]), _best_of(details[best[1]][0]))
        else:
            best = None
        summary.add_module(module, class_name, first_pos, best)

    for module, entry, (_, pos), _ in tables["sub"]:
        if pos in details:
            r = details[pos][0]
            frac = r["subnormal_frac"]
            summary.subnormal.offer((module, entry), (-frac, pos),
                                    (frac, r["step"], r["dtype"], r["numel"], r.get("global_step"), r.get("mode")))
    if tables["zero_names"] is None:
        summary.zero_keys.add_count(tables["zero_count"])
    else:
        for key in tables["zero_names"]:
            summary.zero_keys.add(hash(key))
    for module, entry, (_, pos) in tables["zero"]:
        if pos in details:
            r = details[pos][0]
            summary.all_zero.offer((module, entry), (-r["step"], pos),
                                   (r["step"], r["dtype"], r["numel"], r.get("global_step"), r.get("mode")))


def _best_of(r):
    """A lowest-headroom record as the summary keeps it (``Summary.add_module``'s ``best``)."""
    return (r["entry"], r["dtype"], r["step"], r["phase"], float(r["abs_max"]), r.get("global_step"), r.get("mode"))


def _cells(con, summary, paths, compressions, firsts):
    """The picture's bins (a second scan: only ``--png`` needs it), on the timeline of
    ``summary.unit``: per drawn module, its lowest headroom ratio per train bin of
    ``summary.timeline.width`` steps, whether a nan/inf was there, and what entries without headroom were
    (all-zero floating point, integer); the bins where evaluation ran; and per (module, entry) of
    the top underflow hot spots, from its first subnormal value (``firsts``: its position), the
    largest subnormal and zero fractions per train bin. One scan, its rows taken up to three times
    (k = 1, 2, 3), as the first query does."""
    modules = summary.plot_modules()
    if not modules:
        return
    tracked = [key for key, _, _ in summary.subnormal.best(summary.underflow_rows) if key in firsts]
    x = "gstep" if summary.unit == OPTIMIZER else "step"
    query = f"""
        WITH {_rows(list(compressions.values()))},
        drawn AS (SELECT unnest($modules::VARCHAR[]) AS drawn_module),
        tracked AS (SELECT unnest($pair_modules::VARCHAR[]) AS tracked_module,
                           unnest($pair_entries::VARCHAR[]) AS tracked_entry, unnest($pair_firsts::BIGINT[]) AS since),
        r AS (
            SELECT e.*, {x} // {summary.timeline.width} AS b, coalesce(mode = 'eval', false) AS is_eval,
                drawn_module IS NOT NULL AS is_drawn, since
            FROM e LEFT JOIN drawn ON module = drawn_module  -- hash joins, not a list scanned per row
                LEFT JOIN tracked ON module = tracked_module AND entry = tracked_entry
            WHERE fast AND {x} IS NOT NULL
        )
        SELECT k, CASE WHEN k <> 2 THEN module END AS m, CASE WHEN k = 3 THEN entry END AS en, b,
            min(CASE WHEN nonfinite THEN 1.0 ELSE ratio END) AS ratio, bool_or(nonfinite) AS bad,
            bool_or(NOT nonfinite AND ratio IS NULL AND dtype_max IS NOT NULL) AS zero,
            bool_or(NOT nonfinite AND dtype_max IS NULL) AS integer, max(sf) AS sub, max(zf) AS zeros
        FROM r, (VALUES (1), (2), (3)) AS u(k)
        WHERE (k = 1 AND is_drawn AND NOT is_eval) OR (k = 2 AND is_eval)
            OR (k = 3 AND since IS NOT NULL AND NOT is_eval AND numel > 0 AND pos >= since)
        GROUP BY ALL"""
    params = _params([paths[i] for i in compressions], list(compressions))
    params.update(modules=modules, pair_modules=[m for m, _ in tracked], pair_entries=[e for _, e in tracked],
                  pair_firsts=[firsts[key] for key in tracked])
    for k, module, entry, index, ratio, bad, zero, integer, sub, zeros in con.execute(query, params).fetchall():
        if k == 1:
            summary.timeline.add_cell(module, index, ratio, bad, (ZERO if zero else 0) | (INTEGER if integer else 0))
        elif k == 2:
            summary.timeline.add_eval_bin(index)
        else:
            summary.timeline.add_underflow((module, entry), index, sub, zeros)
