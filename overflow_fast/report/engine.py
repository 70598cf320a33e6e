"""The log reader: every entry record of the logs in one SQL table, ``entries``
(``records.COLUMNS``), that the report's and the diff's queries read; everything else in each
log's ``Notes``.

Two engines run the same queries:
- DuckDB (``pip install overflow_fast[logs]``): ``read_json`` scans the files, all at once (one
  scan per file, in parallel), and checks each row in SQL against the schema (SQL generated from
  ``schema.RECORDS``). Only the rows that fit are entries; every other row (the meta line, a
  detection, damage) is handed back by its position to the json reader (``records.py``), which
  decides and names it: the malformed lines, their reasons and their order are the json reader's.
  A file DuckDB is not given (a pipe, bzip2 or xz, a gzip stream that Python's gzip finds cut or
  damaged, a line over the size limit, a name DuckDB would take for a pattern) or cannot read is
  read by the json reader whole.
- Without DuckDB, the json reader reads every line into sqlite3 (Python's standard library), at
  about a tenth of the speed (``FALLBACK_NOTE``).

Memory is bounded: DuckDB works within ``MEMORY_LIMIT`` and spills to disk; sqlite keeps its
table on disk. Both write only into a fresh folder of this user's that nobody else can change
(``scratch_folder``), the rule the C++ kernel's cache follows; DuckDB loads no extension (JSON is
built in), so no other folder is ever read as code.
"""

import json
import os
import shutil
import sqlite3
import tempfile
import warnings

from .. import build_cache
from ..recording import schema
from .logfile import BadFile, LogFile, is_regular, line_starts, read_lines_at, survey, walk
from .records import COLUMNS, POSITION_BITS, TYPES, Notes, read_log

try:
    import duckdb

    # read_json's options and its JSON columns as this module uses them came with DuckDB 1.3
    if tuple(int(part) for part in duckdb.__version__.split(".")[:2] if part.isdigit()) < (1, 3):
        duckdb = None
except ImportError:
    duckdb = None

MEMORY_LIMIT = "384MB"  # DuckDB's JSON reader holds a 32 MiB buffer per file being scanned
FALLBACK_NOTE = ("DuckDB is not installed: reading the logs with Python's json into sqlite3, at about a tenth of "
                 "DuckDB's speed (a gigabyte takes minutes, not seconds); pip install 'overflow_fast[logs]'")
_GLOB = set("*?[{")
_ORDINAL = (1 << POSITION_BITS) - 1


class EngineError(Exception):
    """DuckDB failed in a way this reader does not know (never a line of a log: those are read)."""


def available_engines():
    return ("duckdb", "python") if duckdb is not None else ("python",)


def describe():
    """What reads logs here, in a line (``overflow-fast info``)."""
    if duckdb is not None:
        return f"DuckDB {duckdb.__version__} (Python's json where DuckDB cannot read a file)"
    return "Python's json into sqlite3: " + FALLBACK_NOTE


def scratch_folder():
    """A fresh folder for the reader's temporary files, made in the temporary folder where that
    passes ``build_cache.private_folder``'s rule (every folder above ours this user's or root's,
    and writable by nobody else unless sticky), else in the kernel's cache folder; a warning names
    a folder passed over and why. None (warned) where no folder passes: then nothing spills to disk."""
    candidates = [tempfile.gettempdir()]
    cache, _ = build_cache.cache_folder()
    if cache is not None:
        candidates.append(str(cache))
    rejected = []
    for parent in candidates:
        if parent != candidates[0]:
            build_cache.private_folder(parent, create=True)
        try:
            made = tempfile.mkdtemp(prefix="overflow_fast-logs-", dir=parent)
        except OSError as error:
            rejected.append(f"{parent} cannot hold a folder ({error.strerror or error})")
            continue
        folder, problem = build_cache.private_folder(made)
        if problem is None:
            if rejected:
                _warn(f"not using {candidates[0]} for the log reader's temporary files: {'; '.join(rejected)}, so "
                      f"another user could change what it reads back from them; using {folder} instead (fix that, or "
                      f"point TMPDIR at a folder of yours that nobody else can write)")
            return str(folder)
        shutil.rmtree(made, ignore_errors=True)
        rejected.append(problem)
    _warn(f"no private folder for the log reader's temporary files ({'; '.join(rejected)}): it keeps them in memory, "
          f"which a large log may exhaust (point TMPDIR at a folder of yours that nobody else can write)")
    return None


def _warn(message):
    warnings.warn(f"overflow_fast: {message}", RuntimeWarning, stacklevel=3)


class Logs:
    """The entries of ``groups`` (lists of paths; a group is one log: the report reads one, the
    diff two), read by ``engine`` ("duckdb", "python"; "auto": DuckDB where installed). ``notes``:
    each log's ``Notes``; ``paths``: the files, in order (a row's ``file`` indexes it)."""

    def __init__(self, groups, engine="auto", threads=None, progress=None):
        if engine == "auto":
            engine = available_engines()[0]
        if engine == "duckdb" and duckdb is None:
            raise ImportError("DuckDB 1.3 or newer is not installed")
        self.engine = engine
        self.paths = [path for group in groups for path in group]
        self.log_of = [log for log, group in enumerate(groups) for _ in group]
        self.notes = [Notes() for _ in groups]
        self.by_ordinal = set()  # files whose ``line`` holds the ordinal, and that have blank lines
        self.scratch = scratch_folder()
        self.progress = progress
        self.full_join = engine == "duckdb" or sqlite3.sqlite_version_info >= (3, 39)
        try:
            if engine == "duckdb":
                self._open_duckdb(threads)
            else:
                self._open_sqlite()
        except BaseException:
            self.close()
            raise

    # -- queries ----------------------------------------------------------------------------------

    def rows(self, sql, params=()):
        try:
            return self.con.execute(sql, list(params)).fetchall()
        except (duckdb.Error if duckdb is not None else sqlite3.Error, sqlite3.Error) as error:
            raise EngineError(f"{self.engine} failed: {str(error).splitlines()[0]}") from error

    def one(self, sql, params=()):
        found = self.rows(sql, params)
        return found[0] if found else None

    def relation(self, name, select, key):
        """``name`` for the rows of ``select``, which the next queries join on the columns ``key``: a
        view for DuckDB (it plans the joins itself), an indexed table for sqlite (which would join
        a view row by row)."""
        if self.engine == "duckdb":
            self.rows(f"CREATE TEMP VIEW {name} AS {select}")
        else:
            self.rows(f"CREATE TEMP TABLE {name} AS {select}")
            self.rows(f"CREATE INDEX {name}_key ON {name} ({key})")

    def lines_of(self, positions):
        """{position: line number} of entry rows (the DuckDB reader numbered the rows of a file with
        blank lines by ordinal: their line numbers are found by reading it again)."""
        lines = {}
        wanted = {}
        for pos in positions:
            file = pos >> POSITION_BITS
            if file in self.by_ordinal:
                wanted.setdefault(file, []).append(pos & _ORDINAL)
            else:
                lines[pos] = self.one("SELECT line FROM entries WHERE pos = ?", (pos,))[0]
        for file, ordinals in wanted.items():
            walk(self.paths[file], lambda number, ordinal, raw: lines.__setitem__((file << POSITION_BITS) | ordinal, number),
                 iter(sorted(set(ordinals))))
        return lines

    def close(self):
        con, self.con = getattr(self, "con", None), None
        if con is not None:
            con.close()
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- the json reader into sqlite --------------------------------------------------------------

    def _open_sqlite(self):
        self.con = sqlite3.connect(os.path.join(self.scratch, "logs.db") if self.scratch else ":memory:",
                                   isolation_level=None)
        for pragma in ("journal_mode = OFF", "synchronous = OFF", "cache_size = -65536", "temp_store = FILE"):
            self.con.execute(f"PRAGMA {pragma}")
        if self.scratch:
            try:  # its sorts' files beside its database, not in a folder of sqlite's choosing (a PRAGMA takes no parameter)
                self.con.execute("PRAGMA temp_store_directory = '" + self.scratch.replace("'", "''") + "'")
            except sqlite3.Error:  # (a sqlite built without it: its own temporary folder, files unlinked at once)
                pass
        types = {"BIGINT": "INTEGER", "VARCHAR": "TEXT", "DOUBLE": "REAL"}
        self.con.execute("CREATE TABLE entries (" + ", ".join(
            f"{c} {'INTEGER PRIMARY KEY' if c == 'pos' else types[TYPES[c]]}" for c in COLUMNS) + ")")
        insert = f"INSERT INTO entries VALUES ({', '.join('?' * len(COLUMNS))})"
        self.con.execute("BEGIN")
        for file, path in enumerate(self.paths):
            read_log(path, self.log_of[file], file, self.notes[self.log_of[file]],
                     lambda rows: self.con.executemany(insert, rows), progress=self.progress)
        self.con.execute("COMMIT")

    # -- DuckDB -----------------------------------------------------------------------------------

    def _open_duckdb(self, threads):
        config = {"memory_limit": MEMORY_LIMIT, "preserve_insertion_order": True,
                  "autoinstall_known_extensions": False, "autoload_known_extensions": False,
                  "temp_directory": os.path.join(self.scratch, "spill") if self.scratch else ""}
        if self.scratch:
            config["extension_directory"] = os.path.join(self.scratch, "extensions")  # empty: nothing to load
        if threads:
            config["threads"] = threads
        self.con = duckdb.connect(config=config)
        self.con.execute("SET enable_progress_bar = false")
        scans, lines = {}, {}
        for file, path in enumerate(self.paths):
            scans[file], lines[file] = self._scannable(path)
        scans = {file: kind for file, kind in scans.items() if kind is not None}
        scans = self._scan(scans)
        counts = dict(self.rows("SELECT file, count(*) FROM entries GROUP BY file"))
        for file, path in enumerate(self.paths):
            notes = self.notes[self.log_of[file]]
            if file not in scans:
                read_log(path, self.log_of[file], file, notes, self._insert, progress=self.progress)
                continue
            if counts.get(file, 0) != lines[file]:
                self.by_ordinal.add(file)
            self._judge(file, scans[file], lines[file] == counts.get(file, 0))
            if self.progress is not None:
                self.progress.update(os.path.getsize(path))
        self.rows("DELETE FROM entries WHERE NOT ok")

    def _scannable(self, path):
        """(how DuckDB reads the file: "none" or "gzip"; None where the json reader must, its line
        count): a regular file, compressed with gzip or not at all, intact, no line over the limit."""
        if _GLOB & set(path):
            return None, None
        try:
            if not is_regular(path):  # opened once, by the json reader
                return None, None
            with LogFile(path) as handle:
                if handle.compression not in (None, "gzip"):
                    return None, None
                compression = handle.compression or "none"
            lines, long_line, damage = survey(path)
        except (OSError, BadFile):
            return None, None
        return (None if long_line or damage else compression), lines

    def _scan(self, scans):
        """Load the files of ``scans`` ({file: compression}) that DuckDB can read; returns those. (A
        table made by the scan is filled by both cores; an INSERT that keeps the rows' order, by one.)"""
        while scans:
            try:
                params = {f"f{file}": [self.paths[file]] for file in scans}
                self.con.execute(f"CREATE TEMP TABLE entries AS {_scan_sql(scans)}", dict(params, log_of=self.log_of))
                return scans
            except (duckdb.InvalidInputException, duckdb.IOException, duckdb.OutOfMemoryException) as error:
                if isinstance(error, duckdb.OutOfMemoryException) and self.one("SELECT current_setting('threads')")[0] > 1:
                    self.rows("SET threads = 1")  # one file's buffers at a time: slower, not the json reader
                    continue
                readable = {}
                for file, kind in scans.items():  # which files it cannot read, one by one (rare)
                    try:
                        self.con.execute(f"SELECT count(*) FROM {_read_json('f0', kind, {'record': 'JSON'})}",
                                         {"f0": [self.paths[file]]})
                        readable[file] = kind
                    except (duckdb.InvalidInputException, duckdb.IOException):
                        pass
                scans = {} if readable == scans else readable
            except duckdb.Error as error:
                raise EngineError(f"DuckDB could not read the logs ({str(error).splitlines()[0]})") from error
        self.rows(f"CREATE TEMP TABLE entries ({', '.join(f'{c} {TYPES[c]}' for c in COLUMNS)}, ok BOOLEAN)")
        return {}

    def _judge(self, file, compression, numbered):
        """The rows of a scanned file that DuckDB's checks left out, to the json reader (by ordinal:
        ``numbered``, the file has no blank line, seeks to each one's line)."""
        ordinals = [pos & _ORDINAL for pos, in self.rows(
            "SELECT pos FROM entries WHERE file = ? AND NOT ok ORDER BY pos", (file,))]
        if not ordinals:
            return
        path = self.paths[file]
        lines = None
        if numbered and compression == "none":
            starts, _ = line_starts(path, ordinals, to_end=False)
            lines = ((ordinal, ordinal, raw) for ordinal, raw in zip(ordinals, read_lines_at(path, starts)))
        read_log(path, self.log_of[file], file, self.notes[self.log_of[file]], self._insert, wanted=iter(ordinals),
                 lines=lines)

    def _insert(self, rows):
        """Rows the json reader read, into DuckDB's table: written as JSON to a file and read by
        read_json (typed: the values exactly), as DuckDB inserts one row at a time slowly."""
        handle, path = tempfile.mkstemp(suffix=".jsonl", dir=self.scratch)
        try:
            with os.fdopen(handle, "w") as out:
                for row in rows:
                    out.write(json.dumps(dict(zip(COLUMNS, row))) + "\n")
            columns = "{" + ", ".join(f"'{c}': '{TYPES[c]}'" for c in COLUMNS) + "}"
            self.rows(f"INSERT INTO entries ({', '.join(COLUMNS)}, ok) SELECT *, true FROM "
                      f"read_json(?, format = 'newline_delimited', columns = {columns})", [path])
        finally:
            os.remove(path)


# -- DuckDB's scan of the files, in SQL ------------------------------------------------------------

def _read_json(param, compression, columns):
    """read_json of the file given as ``$param``, with its ``compression`` ("none" or "gzip": never
    guessed from the name, as DuckDB's "auto" would)."""
    return (f"read_json(${param}, format = 'newline_delimited', columns = {columns}, ignore_errors = true, "
            f"maximum_object_size = {schema.MAX_LINE_BYTES}, compression = '{compression}')")


def _text(column):
    """A JSON string column's value: one of the schema's choices told by its JSON text, or its text
    between the quotes when it has no escape (cheap), else decoded by DuckDB's JSON parser."""
    c = f'"{column}"'
    choices = next(field.choices for field in schema.RECORDS["entry"] if field.name == column)
    if choices is not None:  # (plain words: their JSON text is the word in quotes)
        return f"CASE {c}::VARCHAR " + " ".join(f"""WHEN '"{word}"' THEN '{word}'""" for word in choices) + " END"
    return (f"CASE WHEN contains({c}::VARCHAR, '\\') THEN {c}->>'$' "
            f"ELSE substr({c}::VARCHAR, 2, length({c}::VARCHAR) - 2) END")


def _abs(column):
    """An abs field: (its finite value, the text of a nan/inf)."""
    c = f'"{column}"'
    return f'"{column}#double"', f"CASE WHEN starts_with({c}::VARCHAR, '\"') THEN ({c}::VARCHAR)[2:-2] END"


_ENTRY_FIELDS = "{" + ", ".join(f"'{field.name}': 'JSON'" for field in schema.RECORDS["entry"]) + "}"
def _limit(column):
    return f"CASE {column} " + " ".join(f"WHEN '{name}' THEN {value!r}::DOUBLE" for name, value in schema.DTYPE_MAX.items()) + " END"


# the largest value of the dtype an entry is judged against (``schema.judged_in``)
_LIMITS = (f"CASE WHEN {_limit('computed_in')} < {_limit('dtype')} THEN {_limit('computed_in')} "
           f"ELSE {_limit('dtype')} END")


def _scan_sql(scans):
    """Every row of the files of ``scans`` ({file: compression}, given as $f{file}), numbered by a
    streaming row_number() per file (one numbered scan of all files would run on one thread), with
    the table's columns and ``ok``: it is an entry record that fits the schema."""
    (amin, amin_s), (amax, amax_s) = _abs("abs_min"), _abs("abs_max")
    parts = []
    for file, compression in scans.items():
        parts.append(f"SELECT {file}::BIGINT AS file, row_number() OVER () AS ordinal, * "
                     f"FROM {_read_json(f'f{file}', compression, _ENTRY_FIELDS)}")
    return f"""
SELECT log, file, pos, line, step, phase, module, cls, entry, dtype, numel, amin, amin_s, amax, amax_s, nan, posinf,
    neginf, zf, sf, rank, gstep, mode, computed_in, bad, fmax,
    CASE WHEN bad = 0 AND amax > 0 AND fmax IS NOT NULL THEN greatest(fmax / amax, 1.0) END AS ratio, ok
FROM (
    SELECT *, CASE WHEN nan > 0 OR posinf > 0 OR neginf > 0 OR amax_s IS NOT NULL THEN 1 ELSE 0 END AS bad,
        {_LIMITS} AS fmax
    FROM (
        SELECT $log_of[file + 1]::BIGINT AS log, file, file * {1 << POSITION_BITS} + ordinal AS pos, ordinal AS line,
            "step#int" AS step, {_text("phase")} AS phase, {_text("module")} AS module, {_text("class")} AS cls,
            {_text("entry")} AS entry, {_text("dtype")} AS dtype, "numel#int" AS numel, {amin} AS amin,
            {amin_s} AS amin_s, {amax} AS amax, {amax_s} AS amax_s, "nan#int" AS nan, "posinf#int" AS posinf,
            "neginf#int" AS neginf, "zero_frac#double" AS zf, "subnormal_frac#double" AS sf, "rank#int" AS rank,
            "global_step#int" AS gstep, {_text("mode")} AS mode, {_text("computed_in")} AS computed_in,
            ({schema.sql_check("entry")}) AS ok
        FROM (SELECT *, {schema.sql_values("entry")} FROM ({" UNION ALL ".join(parts)}))
    )
)"""
