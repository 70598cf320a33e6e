"""The flight recorder's record schema: the one definition the writer (``recorder.py``) builds its
records from and the readers (``report/records.py``, and ``report/engine.py`` through the SQL it generates
from these same fields) check every line against.

A log is JSON Lines: one JSON object per line, UTF-8. Four kinds of record, told apart by
``"record"`` (``"backoff"``: a GradScaler's backoff, an inf/nan gradient the scaler recovers from,
which is not a detection); keys are written in the order below; a reader ignores keys it does not
know (a newer writer may add some). A field marked nullable may also be missing.

An entry record's ``computed_in`` (the dtype its call computed in under autocast: a float32 weight
of a Linear run under float16 autocast is cast to float16) is written only under autocast; its
headroom is judged against that dtype where it is narrower (``judged_in``).

``global_step`` and ``mode`` (entry, detection and backoff records: the trainer's optimizer step, and
``"train"`` or ``"eval"``) are written only when the detector knows them (``set_step``); a log
without them (an older writer, a loop that never names its steps) reads as before, and ``step``
is always the detector's batch number (its count of the model's forwards).

Field kinds:

- ``int``: a JSON integer (not a boolean, not ``1.0``) in ``[lo, hi]``;
- ``str``: a JSON string (valid Unicode: no lone surrogate); ``choices`` restricts its values;
- ``abs``: a magnitude: ``null``, a finite number >= 0 (an exact integer for integer dtypes,
  up to 2**64 - 1), or one of the strings ``"nan"``, ``"inf"``, ``"-inf"``;
- ``frac``: a number in [0, 1];
- ``strlist``: a list of at most ``hi`` strings;
- ``object``: a JSON object (its own keys are described with the field).

A detection record's ``where`` (written when the detector could tell, a reader may ignore it) says
where the nan/inf sits in the tensor the report's Source line names, as the report's ``Where:`` line
does: ``entry`` (its name in the frame), then either ``why`` (a string: why it could not be told) or
``shape`` (a list of ints), ``rows`` (the indices along dim 0 holding a nan/inf, ascending, at most
1024 of them), ``rows_total`` (how many rows hold one), ``batch`` (true when dim 0 is the batch:
``set_batch`` named it, or a transformers model's input), ``first`` (the index of the first
non-finite element, row-major), ``token`` (its position along the sequence, or null), ``samples``
(the dataset indices of ``rows``, or null), and the counts ``nan``, ``posinf``, ``neginf``,
``numel``.

A log's meta record says which ``check`` mode wrote it (nullable: a writer of its own, or an older
one). A detection of ``check="step"`` also carries ``check`` ("step") and ``replay`` (an object:
``outcome``, "reproduced", "not reproduced" or "not replayed"; ``transient``; ``why``): what its
replay of the step found. The report's readers pass over them.

With ``find_op``, a detection record also carries ``op`` (an object: ``op``, ``file``, ``line``,
``phase``, ``what``, ``module``, ``reproduced``, as ``detection["op"]``) and ``transient`` (true: the
replay of the call on its very inputs gave finite values where the run's were not, a transient
fault; false: the replay made the nan/inf again; null: it could not tell); with ``repro``, ``repro``
(the reproducer's path). The report's readers pass over them.

Lines that do not fit (not JSON, not an object, an unknown ``record``, a field missing or of the
wrong type or out of range, a line longer than ``MAX_LINE_BYTES``) are malformed.
"""

import math
from collections import namedtuple
from typing import Any, Optional, Protocol, Sequence

# What a frame entry holds: a tensor's statistics row, None, another object, or a tensor the
# engine cannot read (the reference would crash on it).
TENSOR, NONE, NOT_A_TENSOR, UNREADABLE = range(4)


class RecordedFrame(Protocol):
    """What the recording reads of a frame (one hook call, its rows on the host): the hook layer's
    ``Frame`` has these attributes (``tests/test_layout.py`` holds it), and the recording reads no
    other. A plain declaration: nothing checks it per frame."""

    module_name: str  # its qualified name, "" for the model itself
    class_name: str
    phase: str  # one of PHASES
    entries: Sequence[tuple]  # (kind, ctx, payload), in the reference's order: payload is the row index for TENSOR
    dtypes: Sequence[Any]  # torch dtype of each row
    rows: Optional[Sequence[Sequence[int]]]  # host rows (stats.layout's eight int64 columns), one per TENSOR entry
    computed_in: Any  # under autocast, the torch dtype the call computed in, or None

VERSION = 1
PHASES = ("forward", "backward")
MODES = ("train", "eval")
WHEN_KNOWN = ("global_step", "mode", "computed_in")  # written only when known: a record without them is as valid
KINDS = ("meta", "entry", "detection", "backoff")
NONFINITE = ("nan", "inf", "-inf")
CHECKS = ("module", "batch", "step")  # the detector's check= that wrote a log (its meta record's ``check``)

STEP_MAX = 2 ** 40  # a step beyond this is not a training step but damage
RANK_MAX = 2 ** 20 - 1
INT_MAX = 2 ** 63 - 1  # every int field fits a signed 64-bit integer (SQL BIGINT)
MAX_ENTRIES = 4096  # names in one detection record
# A record is about 300 bytes; a line over this is damage, skipped in bounded pieces. DuckDB's
# read_json refuses objects over 16 MiB, so the plain reader's limit is the same.
MAX_LINE_BYTES = 16 << 20

Field = namedtuple("Field", "name kind lo hi nullable choices")


def _f(name, kind, lo=None, hi=None, nullable=False, choices=None):
    return Field(name, kind, lo, hi, nullable, choices)


RECORDS = {
    "meta": (
        _f("record", "str", choices=("meta",)),
        _f("version", "int", 1, INT_MAX),
        _f("rank", "int", 0, RANK_MAX, nullable=True),
        _f("world_size", "int", 1, RANK_MAX + 1, nullable=True),
        _f("started", "str", nullable=True),
        _f("pid", "int", 0, INT_MAX, nullable=True),
        _f("torch", "str", nullable=True),
        _f("check", "str", nullable=True, choices=CHECKS),
    ),
    "entry": (
        _f("record", "str", choices=("entry",)),
        _f("step", "int", 0, STEP_MAX),
        _f("phase", "str", choices=PHASES),
        _f("call", "int", 0, INT_MAX),
        _f("module", "str"),
        _f("class", "str"),
        _f("entry", "str"),
        _f("dtype", "str"),
        _f("numel", "int", 0, INT_MAX),
        _f("abs_min", "abs", nullable=True),
        _f("abs_max", "abs", nullable=True),
        _f("nan", "int", 0, INT_MAX),
        _f("posinf", "int", 0, INT_MAX),
        _f("neginf", "int", 0, INT_MAX),
        _f("zero_frac", "frac"),
        _f("subnormal_frac", "frac"),
        _f("rank", "int", 0, RANK_MAX, nullable=True),
        _f("global_step", "int", 0, STEP_MAX, nullable=True),
        _f("mode", "str", nullable=True, choices=MODES),
        _f("computed_in", "str", nullable=True),
    ),
    "detection": (
        _f("record", "str", choices=("detection",)),
        _f("step", "int", 0, STEP_MAX),
        _f("phase", "str", choices=PHASES),
        _f("module", "str"),
        _f("class", "str"),
        _f("entries", "strlist", hi=MAX_ENTRIES),
        _f("rank", "int", 0, RANK_MAX, nullable=True),
        _f("global_step", "int", 0, STEP_MAX, nullable=True),
        _f("mode", "str", nullable=True, choices=MODES),
        _f("where", "object", nullable=True),
    ),
    "backoff": (
        _f("record", "str", choices=("backoff",)),
        _f("step", "int", 0, STEP_MAX),
        _f("module", "str"),
        _f("class", "str"),
        _f("entries", "strlist", hi=MAX_ENTRIES),
        _f("scale", "abs"),
        _f("in_a_row", "int", 1, INT_MAX),
        _f("rank", "int", 0, RANK_MAX, nullable=True),
        _f("global_step", "int", 0, STEP_MAX, nullable=True),
        _f("mode", "str", nullable=True, choices=MODES),
    ),
}

KEYS = {kind: tuple(field.name for field in fields) for kind, fields in RECORDS.items()}

# Largest finite value of each floating dtype the recorder writes (complex: of its parts), by the
# name in the "dtype" field; headroom is measured against it. Integer and bool dtypes have none.
DTYPE_MAX = {
    "float64": 1.7976931348623157e308,
    "float32": 3.4028234663852886e38,
    "bfloat16": 3.3895313892515355e38,
    "float16": 65504.0,
    "float8_e4m3fn": 448.0,
    "float8_e4m3fnuz": 240.0,
    "float8_e5m2": 57344.0,
    "float8_e5m2fnuz": 57344.0,
    "float8_e8m0fnu": 1.7014118346046923e38,
    "complex128": 1.7976931348623157e308,
    "complex64": 3.4028234663852886e38,
    "complex32": 65504.0,
}


def dtype_max(name):
    """Largest finite value of a floating (or complex) dtype by name; None for the others."""
    return DTYPE_MAX.get(name)


def judged_in(dtype, computed_in=None):
    """The dtype (a name) an entry's headroom is judged against: the one its call computed in under
    autocast (an entry's ``computed_in``) where that is narrower than its own (a float32 weight cast
    to float16), else its own."""
    if computed_in is None or DTYPE_MAX.get(dtype) is None or DTYPE_MAX.get(computed_in) is None:
        return dtype
    return computed_in if DTYPE_MAX[computed_in] < DTYPE_MAX[dtype] else dtype


# -- checking a parsed line ----------------------------------------------------------------------

class Malformed(ValueError):
    """A line that does not fit the schema; the message says why, briefly."""


def _is_int(value):
    return type(value) is int  # bool is a subclass of int: a JSON true is not a number


def _is_number(value):
    return type(value) is int or type(value) is float


def _valid_text(value):
    if value.isascii():
        return True
    try:
        value.encode("utf-8")  # a lone surrogate ("\ud800") cannot be printed or stored
    except UnicodeEncodeError:
        return False
    return True


def _check_field(field, record):
    value = record.get(field.name)
    if value is None:
        if field.nullable:
            return
        raise Malformed(f"{field.name} missing" if field.name not in record else f"{field.name} is null")
    kind = field.kind
    if kind == "int":
        if not _is_int(value):
            raise Malformed(f"{field.name} is not an integer")
        if not field.lo <= value <= field.hi:
            raise Malformed(f"{field.name} out of range")
    elif kind == "str":
        if type(value) is not str or not _valid_text(value):
            raise Malformed(f"{field.name} is not a string")
        if field.choices is not None and value not in field.choices:
            raise Malformed(f"{field.name} is not one of {', '.join(field.choices)}")
    elif kind == "abs":
        if type(value) is str:
            if value not in NONFINITE:
                raise Malformed(f"{field.name} is not a number")
        elif not _is_number(value) or not _finite_at_least_zero(value):
            raise Malformed(f"{field.name} is not a finite number >= 0")
    elif kind == "frac":
        if not _is_number(value) or not _finite_at_least_zero(value) or value > 1:
            raise Malformed(f"{field.name} is not a fraction in [0, 1]")
    elif kind == "strlist":
        if type(value) is not list or len(value) > field.hi:
            raise Malformed(f"{field.name} is not a list of names")
        for item in value:
            if type(item) is not str or not _valid_text(item):
                raise Malformed(f"{field.name} is not a list of names")
    elif kind == "object":
        if type(value) is not dict:
            raise Malformed(f"{field.name} is not an object")


def _finite_at_least_zero(value):
    try:
        value = float(value)
    except OverflowError:  # an integer beyond any double
        return False
    return math.isfinite(value) and value >= 0


def check(record):
    """Raise ``Malformed`` unless ``record`` (a parsed line) fits the schema; returns its kind."""
    if type(record) is not dict:
        raise Malformed("not a JSON object")
    kind = record.get("record")
    fields = RECORDS.get(kind) if type(kind) is str else None
    if fields is None:
        raise Malformed("unknown record kind" if "record" in record else "no record kind")
    for field in fields:
        _check_field(field, record)
    return kind


def magnitude(value):
    """An ``abs`` field as a float (``"nan"``/``"inf"``/``"-inf"`` -> float), None for null."""
    if value is None:
        return None
    return float(value)


# -- the same checks in SQL (DuckDB; read_json with every field as a JSON column) -------------------
#
# A JSON column holds the field's JSON text as DuckDB's parser wrote it back: strings in quotes
# (escapes decoded, but for quotes, backslashes and control characters), numbers as numbers
# (integers in plain digits), true/false, [..], {..}; SQL NULL for null and for a missing key.
# A number is read from that text once (``sql_values``, correctly rounded as Python's float() is;
# any other JSON text reads as NULL), and the checks use what was read: an integer is one whose
# text is its own decimal form (no "1.0", "1e2"); a string's text starts with a quote.

_DOUBLE_MAX = "1.7976931348623157e308::DOUBLE"


def _q(name):
    return '"' + name.replace('"', '""') + '"'


def _read_as(field):
    """(the SQL type a field is read as, the column that holds it) or None for strings, lists."""
    if field.kind == "int":
        return "BIGINT", _q(field.name + "#int")
    if field.kind in ("abs", "frac"):
        return "DOUBLE", _q(field.name + "#double")
    return None


def sql_values(kind):
    """The columns ``sql_check(kind)`` reads, to compute in a projection below it (each number
    is parsed once, there, and reused by the checks and the aggregates)."""
    columns = []
    for field in RECORDS[kind]:
        read = _read_as(field)
        if read is not None:
            columns.append(f"TRY_CAST({_q(field.name)}::VARCHAR AS {read[0]}) AS {read[1]}")
    return ", ".join(columns)


def sql_field_check(field):
    """A SQL boolean, true exactly when ``_check_field`` accepts the column (a JSON value; SQL NULL
    for both a JSON null and a missing key); it reads the columns of ``sql_values``."""
    c = _q(field.name)
    text = f"{c}::VARCHAR"
    kind = field.kind
    read = _read_as(field)
    if kind == "int":
        test = f"{read[1]} BETWEEN {field.lo} AND {field.hi} AND {read[1]}::VARCHAR = {text}"
    elif kind == "str":
        test = f"starts_with({text}, '\"')"
        if field.choices is not None:
            test += f" AND {text} IN ({', '.join(repr(json_text) for json_text in _json_strings(field.choices))})"
    elif kind == "abs":  # (NaN sorts above every number in SQL: BETWEEN excludes it, and inf)
        test = f"{text} IN ('\"nan\"', '\"inf\"', '\"-inf\"') OR {read[1]} BETWEEN 0 AND {_DOUBLE_MAX}"
    elif kind == "frac":
        test = f"{read[1]} BETWEEN 0 AND 1"
    elif kind == "strlist":
        test = (f"starts_with({text}, '[') AND json_array_length({c}) <= {field.hi} AND "
                f"list_bool_and(list_transform(json_extract({c}, '$[*]'), x -> json_type(x) = 'VARCHAR'))")
    elif kind == "object":
        test = f"json_type({c}) = 'OBJECT'"
    else:  # pragma: no cover - the table above has no other kinds
        raise ValueError(kind)
    if field.nullable:
        return f"COALESCE({c} IS NULL OR ({test}), false)"
    return f"COALESCE({c} IS NOT NULL AND ({test}), false)"


def _json_strings(values):
    return ['"' + value + '"' for value in values]  # plain ASCII words: no escaping to do


def sql_check(kind):
    """A SQL boolean: the row is a record of ``kind`` that fits the schema."""
    return " AND ".join(f"({sql_field_check(field)})" for field in RECORDS[kind])


def sql_columns():
    """read_json's ``columns``: every field of every kind, kept as raw JSON for the checks."""
    names = []
    for fields in RECORDS.values():
        for field in fields:
            if field.name not in names:
                names.append(field.name)
    return "{" + ", ".join(f"'{name}': 'JSON'" for name in names) + "}"


__all__ = [
    "VERSION", "PHASES", "MODES", "WHEN_KNOWN", "KINDS", "NONFINITE", "STEP_MAX", "RANK_MAX", "MAX_LINE_BYTES",
    "RECORDS", "KEYS",
    "DTYPE_MAX", "Field", "Malformed", "check", "dtype_max", "magnitude", "sql_check", "sql_columns", "sql_values",
]
