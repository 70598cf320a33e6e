"""A log's entry records, pulled in batches: what ``overflow-fast diff`` reads two logs with, side
by side (the report's reader pushes one log's lines into a summary instead).

Every line is checked against ``schema.py``, as the report checks it: a line that does not fit is
counted and named with its reason, never raised. Most lines take a fast path: one regular
expression, generated from ``schema.RECORDS["entry"]``, that matches the writer's own form of an
entry record (its keys in order, no spaces, names without escapes, numbers of bounded length) and
accepts only lines that the schema accepts. Every other line (an escaped name, spaces, a key the
schema does not know, a meta or detection record, damage) goes to ``summary.parse_line``, the
report's parser. Both paths give the same ``Entry``. The fast path runs in C where it can be built
(csrc/logscan.c's ``scan``, its program ``scan_program()`` generated from the same schema: the same
lines to the same texts); ``scan_python`` is its twin and its specification.

An ``Entry`` is (its fields' JSON texts, its line number): two runs that agree write the same
texts, which are compared without reading a number (``key_of``, ``is_bad``, ``magnitude`` read
them where needed).
"""

import re

from ..recording import schema
from ..recording.schema import Malformed
from . import logscan
from .summary import BadFile, LogFile, is_blank, parse_line, read_chunks

# an Entry is (fields, line): ``fields`` the texts of these fields, ``line`` its line number (from 1)
FIELDS, LINE = 0, 1
STEP, PHASE, MODULE, CLASS, NAME, DTYPE, NUMEL, ABS_MIN, ABS_MAX, NAN, POSINF, NEGINF, RANK, GLOBAL_STEP, MODE = \
    range(15)
# integers in decimal without leading zeros; RANK, GLOBAL_STEP and MODE "" when null or missing;
# ABS_MIN and ABS_MAX the JSON text: "null", a number, or "\"nan\"", "\"inf\"", "\"-inf\""
_KEPT = ("step", "phase", "module", "class", "entry", "dtype", "numel", "abs_min", "abs_max", "nan", "posinf",
         "neginf", "rank", "global_step", "mode")

MAX_NAMED = 5  # malformed lines named

# a finite number >= 0: at most 20 digits and an exponent of at most +99 (below 1e120)
_FLOAT = r"(?:0|[1-9][0-9]{0,19})(?:\.[0-9]+)?(?:[eE](?:-[0-9]{1,3}|\+?[0-9]{1,2}))?"
# a number in [0, 1]: 0.x (times 10^-N), 1 with zero decimals, or x.y times 10^-N with N >= 1
_FRACTION = r"(?:0(?:\.[0-9]+)?(?:[eE]-[0-9]{1,3})?|1(?:\.0+)?|[1-9](?:\.[0-9]+)?[eE]-0*[1-9][0-9]{0,2})"


def _integer_digits(field):
    """The most digits of an integer the fast path reads: fewer than ``field.hi`` has, so all of
    them are within [lo, hi] when lo is 0."""
    digits = len(str(field.hi)) - 1
    if field.lo != 0 or digits < 1:
        raise ValueError(f"{field.name}: the fast path reads integers from 0 to at least 10 only")
    return digits


def _integer(field):
    return f"0|[1-9][0-9]{{0,{_integer_digits(field) - 1}}}"


def _value_pattern(field):
    """The field's JSON text: a group when the Entry keeps the field (a null leaves it unset, but
    in an ``abs`` field, whose text is kept null included)."""
    if field.kind == "int":
        body = _integer(field)
    elif field.kind == "str":  # without escapes (a control character must be escaped)
        body = r'[^"\\\x00-\x1f]*' if field.choices is None else "|".join(map(re.escape, field.choices))
    elif field.kind == "abs":
        body = "|".join(f'"{re.escape(text)}"' for text in schema.NONFINITE) + f"|null|{_FLOAT}"
    elif field.kind == "frac":
        body = _FRACTION
    else:
        raise ValueError(f"{field.name}: no fast pattern for {field.kind}")
    pattern = f"({body})" if field.name in _KEPT else f"(?:{body})"
    if field.kind == "str":
        pattern = f'"{pattern}"'
    return f"(?:null|{pattern})" if field.nullable and field.kind != "abs" else pattern


def entry_pattern():
    """The fast path's expression: one whole line, the entry record as the writer writes it (the
    fields in ``schema.RECORDS["entry"]``'s order; the ones written only when known,
    ``schema.WHEN_KNOWN``, the last, may be missing), a group for each field of ``_KEPT``."""
    fields = schema.RECORDS["entry"]
    parts = []
    for index, field in enumerate(fields):
        if field.name == "record":
            parts.append('"record":"entry"')
            continue
        item = ("," if index else "") + f'"{field.name}":' + _value_pattern(field)
        if field.name in schema.WHEN_KNOWN:
            if any(later.name not in schema.WHEN_KNOWN for later in fields[index:]):
                raise ValueError(f"{field.name}: an optional field before a required one")
            item = f"(?:{item})?"
        parts.append(item)
    return re.compile("^\\{" + "".join(parts) + "\\}$", re.MULTILINE)


# the value forms of the C fast path (csrc/logscan.c)
_NO_VALUE, _INT, _STR, _CHOICE, _ABS, _FRAC = range(6)


def scan_program():
    """The same line as ``entry_pattern()``, as csrc/logscan.c's program: per field, (the literal
    before its value, the value's form, its index among ``_KEPT`` or -1, nullable, optional (may be
    missing), an int's most digits, the choices of a str or the quoted texts of an abs)."""
    items = []
    for index, field in enumerate(schema.RECORDS["entry"]):
        literal = ("{" if index == 0 else ",") + f'"{field.name}":'
        kept = _KEPT.index(field.name) if field.name in _KEPT else -1
        optional = field.name in schema.WHEN_KNOWN
        digits, choices = 0, ()
        if field.name == "record":
            items.append(((literal + '"entry"').encode(), _NO_VALUE, -1, False, False, 0, ()))
            continue
        if field.kind == "int":
            digits, kind = _integer_digits(field), _INT
        elif field.kind == "str":
            kind = _STR if field.choices is None else _CHOICE
            choices = tuple(choice.encode() for choice in field.choices or ())
        elif field.kind == "abs":
            kind, choices = _ABS, tuple(text.encode() for text in schema.NONFINITE)
        elif field.kind == "frac":
            kind = _FRAC
        else:
            raise ValueError(f"{field.name}: no fast form for {field.kind}")
        items.append((literal.encode(), kind, kept, bool(field.nullable), optional, digits, choices))
    return tuple(items)


_ENTRY = entry_pattern()
_PROGRAM = scan_program()
if [f.name for f in schema.RECORDS["entry"] if f.name in _KEPT] != list(_KEPT):  # the groups are the fields
    raise ImportError("entries._KEPT is not in the schema's order")


def key_of(fields):
    """(rank, step, phase, module, entry) of an Entry's fields: what aligns two logs (a missing
    rank is rank 0)."""
    rank = fields[RANK]
    return int(rank) if rank else 0, int(fields[STEP]), fields[PHASE], fields[MODULE], fields[NAME]


def is_bad(fields):
    """Whether the entry recorded a nan or inf."""
    return fields[NAN] != "0" or fields[POSINF] != "0" or fields[NEGINF] != "0" or fields[ABS_MAX][0] == '"'


def global_step_of(fields):
    return int(fields[GLOBAL_STEP]) if fields[GLOBAL_STEP] else None


def magnitude(text):
    """An Entry's ``abs_min`` or ``abs_max`` as a float; None for an empty tensor."""
    if text == "null":
        return None
    return float(text.strip('"'))


def _abs_text(value):
    """A parsed ``abs`` field as the fast path keeps it (its JSON text)."""
    if value is None:
        return "null"
    if type(value) is str:
        return f'"{value}"'
    return repr(value) if type(value) is float else str(value)


def _parsed(record):
    """The fields of an entry record the schema's parser read, as the fast path's texts."""
    def text(value):
        return "" if value is None else str(value)
    return (str(record["step"]), record["phase"], record["module"], record["class"], record["entry"], record["dtype"],
            str(record["numel"]), _abs_text(record.get("abs_min")), _abs_text(record.get("abs_max")),
            str(record["nan"]), str(record["posinf"]), str(record["neginf"]), text(record.get("rank")),
            text(record.get("global_step")), text(record.get("mode")))


class EntryReader:
    """The entry records of one log, in batches (``batches()``: lists of Entry tuples, in the
    file's order). Meanwhile it counts what is not an entry: ``malformed`` lines (the first few
    named in ``malformed_lines``: (line number, reason)), ``metas``, ``detections`` (the first one
    kept in ``detection``). ``lines`` is the count of lines read.

    ``start`` and ``end``: only the bytes [start, end) of a plain (uncompressed) file, ``start``
    at the beginning of a line; its lines are numbered from 1 there (counting the lines before it
    would read the file up to it: the diff in parts numbers them as in the whole file when it
    merges the parts, ``Diff.merge``)."""

    def __init__(self, path, start=0, end=None):
        self.path = path
        self.start = start
        self.end = end
        self.lines = 0
        self.entries = 0
        self.metas = 0
        self.detections = 0
        self.detection = None
        self.malformed = 0
        self.malformed_lines = []
        self.damage = None

    def shift_lines(self, offset):
        """Number the lines named as if ``offset`` lines came before this reader's first."""
        self.malformed_lines = [(number + offset, reason) for number, reason in self.malformed_lines]
        if self.detection is not None:
            self.detection["line"] += offset

    def _malformed(self, number, reason):
        self.malformed += 1
        if len(self.malformed_lines) < MAX_NAMED:
            self.malformed_lines.append((number, reason))

    def _slow(self, raw, number, out):
        """One line that the fast path did not take (bytes)."""
        if is_blank(raw):
            return
        try:
            kind, record = parse_line(raw)
        except Malformed as error:
            self._malformed(number, str(error))
            return
        if kind == "entry":
            out.append((_parsed(record), number))
        elif kind == "meta":
            self.metas += 1
        else:
            self.detections += 1
            if self.detection is None:
                self.detection = dict(record, line=number)

    def batches(self):
        if self.start or self.end is not None:
            handle = Slice(self.path, self.start, self.end)
        else:
            handle = LogFile(self.path)
        with handle:
            for chunk in read_chunks(handle):
                if chunk is None:  # a line over the limit: never held whole
                    self.lines += 1
                    self._malformed(self.lines, f"longer than {schema.MAX_LINE_BYTES} bytes")
                    continue
                if handle.damage is not None and not chunk.endswith(b"\n"):
                    chunk = chunk[:chunk.rfind(b"\n") + 1]  # the last line, cut in two by the damage
                out = []
                self._chunk(chunk, out)
                self.entries += len(out)
                if out:
                    yield out
            if handle.damage is not None:
                self.damage = handle.damage
                self._malformed(self.lines + 1, handle.damage)

    def merge(self, later):
        """Add the counts of ``later``, the reader of the part of the same file that follows (its
        lines numbered as in the whole file: ``shift_lines``)."""
        self.lines += later.lines
        self.entries += later.entries
        self.metas += later.metas
        self.detections += later.detections
        self.detection = self.detection or later.detection
        self.malformed += later.malformed
        self.malformed_lines = (self.malformed_lines + later.malformed_lines)[:MAX_NAMED]
        self.damage = self.damage or later.damage

    def _chunk(self, chunk, out):
        native = logscan.native()
        if native is not None:
            self.lines = native.scan(chunk, self.lines, out, self._slow, _PROGRAM, len(_KEPT))
        else:
            self.lines = scan_python(chunk, self.lines, out, self._slow)


def scan_python(chunk, number, out, slow):
    """csrc/logscan.c's ``scan`` in Python, its specification: append to ``out`` the Entry of each
    line of ``chunk`` that the fast path takes, call ``slow(line, its number, out)`` for any other,
    in order; lines numbered from ``number`` + 1; returns the last one's number. (A chunk that is
    not all UTF-8 goes line by line to ``slow``.)"""
    try:
        text = chunk.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None:  # some line is not UTF-8: each one on its own
        lines = chunk.split(b"\n")
        if lines[-1] == b"":
            lines.pop()
        for raw in lines:
            number += 1
            slow(raw, number, out)
        return number
    rows = _ENTRY.findall(text)
    if len(rows) == text.count("\n") + (not text.endswith("\n")):  # every line an entry the fast path takes
        out.extend(zip(rows, range(number + 1, number + len(rows) + 1)))
        return number + len(rows)
    append = out.append
    at = 0
    for match in _ENTRY.finditer(text):
        start = match.start()
        if start != at:  # lines the fast path did not take
            for line in text[at:start - 1].split("\n"):
                number += 1
                slow(line.encode("utf-8"), number, out)
        number += 1
        append((match.groups(""), number))
        at = match.end() + 1
    if at < len(text):
        rest = text[at:]
        lines = rest.split("\n")
        if lines[-1] == "":
            lines.pop()
        for line in lines:
            number += 1
            slow(line.encode("utf-8"), number, out)
    return number


class Slice:
    """The bytes [start, end) of a plain file, read as ``LogFile`` reads (never damaged)."""

    compression = None
    damage = None

    def __init__(self, path, start, end=None):
        try:
            self._raw = open(path, "rb")
        except OSError as error:
            raise BadFile(f"cannot read {path}: {error.strerror or error}") from None
        self._raw.seek(start)
        self._left = None if end is None else end - start

    def read(self, size):
        if self._left is not None:
            size = min(size, self._left)
            if size <= 0:
                return b""
        block = self._raw.read(size)
        if self._left is not None:
            self._left -= len(block)
        return block

    def close(self):
        self._raw.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def parse_entry(raw, number=0):
    """One line (bytes, without its newline) as an Entry; None when it is not an entry record
    (another kind, or malformed)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    match = _ENTRY.match(text)
    if match is not None:
        return match.groups(""), number
    try:
        kind, record = parse_line(raw)
    except Malformed:
        return None
    return (_parsed(record), number) if kind == "entry" else None


def entry_at(path, offset):
    """(where it starts, its step, where it ends) of the first entry line of a plain file that
    starts at or after byte ``offset``; None when none does."""
    with open(path, "rb") as handle:
        if offset > 0:
            handle.seek(offset - 1)
            if handle.read(1) != b"\n":
                _skip_line(handle)
        while True:
            start = handle.tell()
            line = handle.readline(schema.MAX_LINE_BYTES + 1)
            if not line:
                return None
            if not line.endswith(b"\n"):
                if len(line) > schema.MAX_LINE_BYTES:
                    _skip_line(handle)
                    continue
            entry = parse_entry(line.rstrip(b"\n"))
            if entry is not None:
                return start, int(entry[FIELDS][STEP]), handle.tell()


def _skip_line(handle, piece=1 << 20):
    while True:
        line = handle.readline(piece)
        if not line or line.endswith(b"\n"):
            return
