"""The json reader: a log's lines parsed by Python's ``json`` and checked against ``schema.py``.
It is the whole reader where DuckDB is not installed, and the judge of every line DuckDB's own
checks leave out (a meta line, a detection, damage): either way one parser decides what a line is
and why a line is malformed. A line that does not fit is counted and named with the reason, never
raised.

An entry record becomes a row of the entries table (``COLUMNS``: what both engines store, the
DuckDB reader computing the same values in SQL); the rest goes into the log's ``Notes``.
"""

import json

from ..recording import schema
from ..recording.schema import Malformed
from .logfile import walk

MAX_NAMED = 5  # malformed lines, detections and backoffs kept to be named
POSITION_BITS = 40  # a row's position: (file index << 40) | its ordinal among the file's non-blank lines

# The entries table: ``pos`` orders everything that "comes first" (files in the order given);
# ``line`` is the line number (the DuckDB reader stores the ordinal, the same where the file has no
# blank line); ``amax``/``amin`` the finite magnitude or NULL, ``amax_s``/``amin_s`` the text of a
# nan/inf; ``bad`` 1 where the entry recorded a nan/inf; ``fmax`` the largest value of the dtype
# its headroom is judged against (``schema.judged_in``: under autocast, the one its call computed in
# where narrower; NULL: an integer dtype); ``ratio`` fmax / amax, at least 1, where headroom means
# something.
COLUMNS = ("log", "file", "pos", "line", "step", "phase", "module", "cls", "entry", "dtype", "numel", "amin", "amin_s",
           "amax", "amax_s", "nan", "posinf", "neginf", "zf", "sf", "rank", "gstep", "mode", "computed_in", "bad", "fmax",
           "ratio")
TYPES = dict.fromkeys(COLUMNS, "BIGINT")
TYPES.update(dict.fromkeys(("phase", "module", "cls", "entry", "dtype", "amin_s", "amax_s", "mode", "computed_in"),
                           "VARCHAR"))
TYPES.update(dict.fromkeys(("amin", "amax", "zf", "sf", "fmax", "ratio"), "DOUBLE"))


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


def _magnitude(value):
    """An ``abs`` field as (its finite value or None, the text of a nan/inf or None)."""
    if type(value) is str:
        return None, value
    return (None if value is None else float(value)), None


def entry_row(record, log, file, ordinal, line):
    """An entry record as a row of the entries table (``COLUMNS``)."""
    amin, amin_s = _magnitude(record.get("abs_min"))
    amax, amax_s = _magnitude(record.get("abs_max"))
    bad = int(bool(record["nan"] or record["posinf"] or record["neginf"] or amax_s is not None))
    fmax = schema.dtype_max(schema.judged_in(record["dtype"], record.get("computed_in")))
    ratio = max(fmax / amax, 1.0) if not bad and fmax is not None and amax is not None and amax > 0 else None
    return (log, file, (file << POSITION_BITS) | ordinal, line, record["step"], record["phase"], record["module"],
            record["class"], record["entry"], record["dtype"], record["numel"], amin, amin_s, amax, amax_s,
            record["nan"], record["posinf"], record["neginf"], float(record["zero_frac"]),
            float(record["subnormal_frac"]), record.get("rank"), record.get("global_step"), record.get("mode"),
            record.get("computed_in"), bad, fmax, ratio)


class Notes:
    """What a log holds besides its entries: the malformed lines (counted; the first few named as
    (file, line number, reason)), the meta records (and the ranks they name), the detection and
    backoff records (counted; the first few kept)."""

    def __init__(self):
        self.malformed = 0
        self.malformed_lines = []
        self.metas = 0
        self.ranks = set()
        self.detections, self.detection_count = [], 0
        self.backoffs, self.backoff_count = [], 0

    def add_malformed(self, path, number, reason):
        self.malformed += 1
        if len(self.malformed_lines) < MAX_NAMED:
            self.malformed_lines.append((path, number, reason))

    def add(self, kind, record, number):
        """A record that is not an entry."""
        if kind == "meta":
            self.metas += 1
            if record.get("rank") is not None:
                self.ranks.add(record["rank"])
        elif kind == "detection":
            self.detection_count += 1
            if len(self.detections) < MAX_NAMED:
                self.detections.append(dict(record, line=number))
        else:
            self.backoff_count += 1
            if len(self.backoffs) < MAX_NAMED:
                self.backoffs.append(record)

    @property
    def records(self):
        return self.metas + self.detection_count + self.backoff_count


def read_log(path, log, file, notes, add_rows, wanted=None, lines=None, progress=None, batch=8192):
    """Read the lines of one file (only the ordinals of ``wanted``, when given) into ``notes`` and
    the entries table: ``add_rows(rows)`` takes the rows of its entry records, a batch at a time.
    ``lines``: those lines found already, as (line number, ordinal, bytes or None)."""
    rows = []

    def visit(number, ordinal, raw):
        if raw is None:
            notes.add_malformed(path, number, f"longer than {schema.MAX_LINE_BYTES} bytes")
            return
        try:
            kind, record = parse_line(raw)
        except Malformed as error:
            notes.add_malformed(path, number, str(error))
            return
        if kind != "entry":
            notes.add(kind, record, number)
            return
        rows.append(entry_row(record, log, file, ordinal, number))
        if len(rows) >= batch:
            add_rows(rows)
            rows.clear()

    if lines is not None:
        for line in lines:
            visit(*line)
        count = damage = None
    else:
        count, damage = walk(path, visit, wanted, progress)
    if rows:
        add_rows(rows)
    if damage is not None and wanted is None:
        notes.add_malformed(path, count + 1, damage)
