"""Log files as bytes: opening one (compressed or not), reading its lines in bounded pieces, and
finding lines again by number. Nothing here parses JSON (``records.py`` does).

Compressed logs (gzip, bzip2, xz) are told by their first bytes, never by their names, and read
decompressed (``LogFile``). One that is cut or damaged is read up to the damage, which its reader
then counts as one malformed line where the readable lines end (a last line cut in two is part of
it); zstd, which Python's standard library cannot decompress, is refused (``BadFile``).
"""

import bz2
import gzip
import lzma
import os
import stat
import zlib

from ..recording import schema

BLOCK = 1 << 20


class BadFile(Exception):
    """A log that cannot be read at all; the message says which and why."""


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
    be read, and for one compressed in a way this reader cannot undo. A pipe is not opened here:
    its first bytes would be lost, and a named one's writer would see its reader leave."""
    total = 0
    for path in paths:
        try:
            if is_regular(path):
                with open(path, "rb") as handle:
                    compression_of(handle, path)
                total += os.path.getsize(path)
            elif not os.access(path, os.R_OK):
                raise PermissionError(13, "Permission denied")
        except (OSError, ValueError) as error:
            raise BadFile(f"cannot read {path}: {getattr(error, 'strerror', None) or error}") from None
    return total


def is_regular(path):
    """Whether ``path`` is a regular file (a pipe is read once, and only by its reader)."""
    return stat.S_ISREG(os.stat(path).st_mode)


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


def walk(path, visit, wanted=None, progress=None):
    """Every line of the log (decompressed), in order: ``visit(number, ordinal, raw)``, where
    ``number`` is its line number, ``ordinal`` its place among the non-blank lines, ``raw`` its
    bytes (None for a line over the size limit, never held whole). ``wanted``: an iterator of
    ordinals, ascending: only those lines. Returns (the line count, why the stream ended early
    or None)."""
    number = ordinal = 0
    want = None if wanted is None else next(wanted, None)
    read = 0
    with LogFile(path) as handle:
        for chunk in read_chunks(handle):
            if wanted is not None and want is None:
                break
            if progress is not None:
                done = handle.consumed() if handle.compression else read + len(chunk or b"")
                progress.update(done - read)
                read = done
            if chunk is None:
                number += 1
                ordinal += 1
                if want is None or want == ordinal:
                    visit(number, ordinal, None)
                    want = want if wanted is None else next(wanted, None)
                continue
            parts = chunk.split(b"\n")
            if parts[-1] == b"" or handle.damage is not None:  # (a last line cut by the damage is the damage)
                parts.pop()
            for raw in parts:
                number += 1
                if is_blank(raw):
                    continue
                ordinal += 1
                if wanted is None:
                    visit(number, ordinal, raw)
                elif want == ordinal:
                    visit(number, ordinal, raw)
                    want = next(wanted, None)
        return number, handle.damage


def survey(path):
    """(the line count, whether a line is over the size limit, why a compressed stream ends early
    or None) of a log, in one pass at the speed of reading it (a block holds no whole over-long
    line: it is shorter than the limit)."""
    lines, run, long_line = 0, 0, False  # run: bytes since the last newline
    with LogFile(path) as handle:
        while True:
            block = handle.read(BLOCK)
            if not block:
                break
            newlines = block.count(b"\n")
            if newlines:
                long_line = long_line or run + block.find(b"\n") > schema.MAX_LINE_BYTES
                run = len(block) - block.rfind(b"\n") - 1
            else:
                run += len(block)
            long_line = long_line or run > schema.MAX_LINE_BYTES
            lines += newlines
        return lines + (run > 0), long_line, handle.damage


# newlines are counted in pieces this size: a wanted line is then looked for, newline by
# newline, only inside the piece that holds it
_PIECE = 1 << 14


def line_starts(path, numbers, to_end=True):
    """(the byte offset where each line of ``numbers`` starts, the file's line count), in one pass
    that counts newlines at C speed. ``numbers``: sorted line numbers (from 1), none above the
    count. A last line without its newline counts. ``to_end=False``: the pass ends at the last
    line wanted, and the count is None."""
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
            if target is None and not to_end:
                return starts, None
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


def _open(path):
    try:
        return open(path, "rb")
    except OSError as error:
        raise BadFile(f"cannot read {path}: {error.strerror or error}") from None
