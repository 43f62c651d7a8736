"""Local data files -> records: JSON Lines, JSON, CSV and Parquet, each record with its `file:line` (text files) or
`file index i` (Parquet, and rows a JSON object holds under a key) for error messages.

Every row a file holds is read, or reading fails naming the line. JSON files may hold:
- JSON values one after another: one per line (JSON Lines), spread over several lines (pretty-printed), or several on
  one line (concatenated). Each object is a row; each array's elements are rows.
- one top-level array of rows (or several arrays, one after another).
- one object that holds the rows: a list of rows under one key (`{"data": [...]}`, or any one key), rows keyed by an
  id (`{"0": {...}, "1": {...}}`, pandas' `orient="index"`), columns (`{"prompt": [...], "chosen": [...], ...}`,
  or pandas' default `{"prompt": {"0": ...}, ...}`) or pandas' `orient="split"`.
A row (a line, an array element, a CSV record) larger than `limit` bytes is rejected as soon as its size is known,
without holding more of it than the limit: tokenising a row costs about 200 bytes of memory per byte of text.
`fastdpo.data.records` turns the records into rows.
"""

from __future__ import annotations

import codecs
import csv
import itertools
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from fastdpo.data.columns import COLUMN_NAMES, MAX_ROW_BYTES
from fastdpo.data.records import STOPPED, Record, is_turn, too_large
from fastdpo.errors import FastDPOError

_WS = re.compile(r"\s*")
_BYTES_WS = re.compile(rb"\s*")
# outside a string: what changes the nesting depth, and the quote that opens a string
_STRUCTURE = re.compile(rb'["\[\]{}]')
_STRING_REST = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*', re.DOTALL)  # up to (not including) a string's closing quote
_OPENS = re.compile(r"[\[{,:]\s*$")  # a line that opens a value continued on the next lines
_DECODE = json.JSONDecoder().decode
_MAY_HOLD_ROWS = re.compile(rb'\s*(?:\xef\xbb\xbf)?\s*\{\s*"(?:[^"\\]|\\.)*"\s*:\s*[\[{]')


def _unparsable(e: Exception) -> str:
    """Why json.loads failed, for errors other than JSONDecodeError."""
    return "nested too deeply" if isinstance(e, RecursionError) else "a number too long to convert"


# ---------------------------------------------------------------- JSON


def _depth(data: bytes, depth: int = 0, in_string: bool = False, escaped: bool = False) -> tuple[int, bool, bool]:
    """The nesting depth after `data` (a line, or a piece of one), from the state before it: strings skipped, so
    brackets inside them do not count. JSON strings hold no raw newline, so each line starts outside a string."""
    i, n = (1 if escaped else 0), len(data)
    escaped = False
    while i < n:
        if in_string:
            i = _STRING_REST.match(data, i).end()
            if i >= n:
                break
            if data[i] == 0x5C:  # a backslash ending the piece: the byte it escapes starts the next piece
                escaped = True
                break
            in_string, i = False, i + 1
            continue
        m = _STRUCTURE.search(data, i)
        if m is None:
            break
        c, i = data[m.start()], m.end()
        if c == 0x22:
            in_string = True
        else:
            depth += 1 if c in b"[{" else -1
    return depth, in_string, escaped


def _brackets(data: bytes) -> int:
    """Opening minus closing brackets in `data`, strings not skipped: a quick first look at a long line."""
    return data.count(b"{") + data.count(b"[") - data.count(b"}") - data.count(b"]")


def _lines(f, limit: int) -> Iterator[tuple[int, bytes | None, int, int]]:
    """(line number, the line or None when it is over `limit` bytes, its size, the nesting depth a line over the
    limit adds). A line over the limit is read in pieces and never held whole."""
    at = f.tell()  # where the line starts
    for lineno in itertools.count(1):
        raw = f.readline(limit + 1)
        if not raw:
            return
        if len(raw) <= limit or raw.endswith(b"\n"):
            at += len(raw)
            if lineno == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8):]
            yield lineno, raw, len(raw), 0
            continue
        size, depth = len(raw), _brackets(raw)
        while not raw.endswith(b"\n") and (raw := f.readline(1 << 20)):
            size, depth = size + len(raw), depth + _brackets(raw)
        if depth:  # brackets left open, or some inside strings: count again, skipping strings
            end = f.tell()
            f.seek(at)
            state = (0, False, False)
            while f.tell() < end and (raw := f.readline(min(1 << 20, end - f.tell()))):
                state = _depth(raw, *state)
            depth = state[0]
        at += size
        yield lineno, None, size, depth


@dataclass(slots=True)
class _Value:
    """A JSON value of a file: the line it starts on, and the value, the error, or the size when over the limit."""

    line: int
    value: object = None
    error: str | None = None
    size: int = 0  # set when over the limit (the value is not kept)
    index: int | None = None  # its position in its array (or among the values of its line)
    element: bool = False  # an element of an array (never an object holding rows)


def _text_values(text: str, line0: int, limit: int) -> Iterator[_Value]:
    """The JSON values in `text`, whose first line is line `line0` of its file, one after another; an array's
    elements come one by one. An error ends the text."""
    return _shared_lines(_values_in(text, line0, limit))


def _values_in(text: str, line0: int, limit: int) -> Iterator[_Value]:
    dec = json.JSONDecoder()
    line, seen = line0, 0

    def line_at(pos: int) -> int:
        nonlocal line, seen
        line += text.count("\n", seen, pos)
        seen = pos
        return line

    def value_at(i: int, index: int, element: bool) -> tuple[_Value, int]:
        """The value starting at `i` and the position after it (-1 after an error)."""
        try:
            value, end = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            return _Value(line0 + e.lineno - 1, error=f"invalid JSON ({e.msg}, column {e.colno}). Fix the syntax."), -1
        except (ValueError, RecursionError) as e:
            return _Value(line_at(i), error=f"invalid JSON ({_unparsable(e)}). Fix this row."), -1
        size = end - i  # characters: a lower bound of the bytes, counted only where they could pass the limit
        if size > limit // 4:
            size = len(text[i:end].encode("utf-8", "surrogatepass"))
        if size > limit:
            return _Value(line_at(i), size=size, index=index, element=element), end
        return _Value(line_at(i), value, index=index, element=element), end

    i, k = _WS.match(text, 0).end(), 0
    while i < len(text):
        if text[i] != "[":
            v, end = value_at(i, k, False)
            yield v
            if end < 0:
                return
            i, k = _WS.match(text, end).end(), k + 1
            continue
        i = _WS.match(text, i + 1).end()
        if i < len(text) and text[i] == "]":  # an empty array
            i = _WS.match(text, i + 1).end()
            continue
        for index in itertools.count():
            v, end = value_at(i, index, True)
            yield v
            if end < 0:
                return
            i = _WS.match(text, end).end()
            if i < len(text) and text[i] == ",":
                i = _WS.match(text, i + 1).end()
            elif i < len(text) and text[i] == "]":
                i = _WS.match(text, i + 1).end()
                break
            else:
                yield _Value(line_at(min(i, len(text))), error="invalid JSON (expected ',' or ']' after a row).")
                return


def _complete_row(raw: bytes) -> bool:
    """A line that is a whole JSON object on its own, starting the line (as a JSON Lines row does)."""
    if not raw.startswith(b"{"):
        return False
    try:
        return isinstance(_DECODE(raw.decode("utf-8")), dict)
    except (ValueError, RecursionError):
        return False


def _line_values(f, limit: int) -> Iterator[_Value]:
    """The JSON values of a file read line by line: one per line (JSON Lines, the fast path), or spread over lines
    (a line that opens a value continues until its brackets close), or several on a line."""
    block: list[bytes] | None = None  # the lines of a value spread over lines; [] once it is over the limit
    start = depth = size = 0
    rows_on_lines = False  # a row has had a line to itself: the file is JSON Lines so far
    unclosed = ("invalid JSON (the value that starts on this line is not closed {}: a '}}' or ']' is missing). Fix "
                "or remove this line.")
    for lineno, raw, n, opened in _lines(f, limit):
        if block is not None and rows_on_lines and raw is not None and _complete_row(raw):
            # in JSON Lines, a row cut short swallows no rows after it: the next row starts a line of its own
            yield _Value(start, error=unclosed.format(f"before line {lineno} starts the next row"))
            block = None
        if block is not None:
            size += n
            depth += opened if raw is None else _depth(raw)[0]
            if raw is None or size > limit:
                block = []
            elif block:
                block.append(raw)
            if depth > 0:
                continue
            if not block:
                yield _Value(start, size=size)
            else:
                data = b"".join(block)
                try:
                    yield from _text_values(data.decode("utf-8"), start, limit)
                except UnicodeDecodeError as e:
                    yield _Value(start + data.count(b"\n", 0, e.start), error=_utf8_error(data, e))
            block = None
            continue
        if raw is None:  # one line over the limit
            if opened > 0:
                block, start, depth, size = [], lineno, opened, n
            else:
                yield _Value(lineno, size=n)
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            yield _Value(lineno, error=f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}). "
                         "Re-save the file as UTF-8.")
            continue
        if not line.strip():
            continue
        try:
            value = _DECODE(line)
        except json.JSONDecodeError as e:
            if e.msg == "Extra data":  # several values on the line
                yield from _text_values(line, lineno, limit)
            elif e.pos >= len(line.rstrip()) and _OPENS.search(line):  # the value goes on below
                block, start, depth, size = [raw], lineno, _depth(raw)[0], n
            else:
                yield _Value(lineno, error=f"invalid JSON ({e.msg}, column {e.colno}). Fix or remove this line.")
            continue
        except (ValueError, RecursionError) as e:
            yield _Value(lineno, error=f"invalid JSON ({_unparsable(e)}). Fix or remove this line.")
            continue
        rows_on_lines = True
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):  # a line of rows
            yield from _text_values(line, lineno, limit)
        else:
            yield _Value(lineno, value)
    if block is not None:
        yield _Value(start, error=unclosed.format("by the end of the file") + f" {STOPPED}")


def _utf8_error(data: bytes, e: UnicodeDecodeError) -> str:
    return f"not valid UTF-8 (byte 0x{data[e.start]:02x}). Re-save the file as UTF-8."


def _is_messages(v: object) -> bool:
    return isinstance(v, list) and bool(v) and all(is_turn(m) for m in v)


def _rows_of_lists(path: Path, value: dict) -> list[tuple[str, object]] | None:
    """Rows a file's one object holds in lists: under one key (`data` first, as HF datasets' `field`), pandas'
    `orient="split"`, or as columns; None when the object is one row."""
    named = [k for k in value if k in COLUMN_NAMES]
    data, columns = value.get("data"), value.get("columns")
    if isinstance(data, list) and isinstance(columns, list) and all(isinstance(r, list) for r in data):  # split
        return [(f"{path} index {i}", dict(zip(columns, r)) if len(r) == len(columns) else r)
                for i, r in enumerate(data)]
    if not named:
        if isinstance(data, list):
            return [(f"{path} index {i}", v) for i, v in enumerate(data)]
        lists = [k for k, v in value.items() if isinstance(v, list) and v and all(isinstance(r, dict) for r in v)
                 and not _is_messages(v)]
        if len(lists) > 1:
            raise FastDPOError(f"{path}: the file's object holds lists of rows under {', '.join(map(repr, lists))}; "
                               "fastdpo reads one list of rows per file. Write each list to a file of its own.")
        if lists:
            return [(f"{path} index {i}", v) for i, v in enumerate(value[lists[0]])]
        return None
    lengths = {len(v) if isinstance(v, list) else -1 for v in value.values()}
    if len(lengths) == 1 and lengths.pop() > 0 and not any(_is_messages(v) for v in value.values()):  # columns
        return [(f"{path} index {i}", {k: v[i] for k, v in value.items()}) for i in range(len(value[named[0]]))]
    return None


def _rows_of_object(path: Path, value: object) -> list[tuple[str, object]] | None:
    """The rows a file's only value holds when it is an object that holds rows rather than being one (see the module
    docstring); None when it is one row."""
    if not isinstance(value, dict) or not value:
        return None
    rows = _rows_of_lists(path, value)
    if rows is not None:
        return rows
    inner = list(value.values())
    if not all(isinstance(v, dict) and not is_turn(v) for v in inner):
        return None
    if not any(k in COLUMN_NAMES for k in value):  # rows keyed by an id (orient="index")
        return [(f"{path} key {k!r}", v) for k, v in value.items()]
    keys = list(inner[0])
    if keys and all(list(v) == keys for v in inner):  # columns keyed by row (pandas' default orient="columns")
        return [(f"{path} index {i}", {c: v[i] for c, v in value.items()}) for i in keys]
    return None


def _record(path: Path, v: _Value, limit: int) -> Record:
    where = f"{path}:{v.line}" + (f" index {v.index}" if v.index is not None else "")
    if v.error is not None:
        return Record(where, error=v.error)
    if v.size:
        return Record(where, error=too_large(v.size, limit))
    return Record(where, v.value)


def _shared_lines(values: Iterator[_Value]) -> Iterator[_Value]:
    """Values with `index` only where another value starts on the same line (`file:1 index 5` in a one-line array);
    values alone on their line keep the bare line."""
    held, before = None, None
    for v in values:
        if held is not None:
            if held.line not in (before, v.line if v.error is None else None):
                held.index = None
            before = held.line
            yield held
        held = v
    if held is not None:
        if held.error is not None or held.line != before:
            held.index = None
        yield held


def _whole_file_rows(path: Path, first: _Value, limit: int) -> Iterator[Record]:
    """The file's only value was over the limit: when it may be an object holding rows, read the file whole and give
    those rows (`Record.row` checks each against the limit); else it is one row over the limit."""
    with open(path, "rb") as f:
        may_hold = _MAY_HOLD_ROWS.match(f.read(1 << 16)) is not None
    try:
        rows = _rows_of_object(path, json.loads(path.read_bytes())) if may_hold else None
    except (ValueError, RecursionError):  # not expected: the value was read to its end before
        rows = None
    if rows is None:
        yield _record(path, first, limit)
        return
    for where, value in rows:
        yield Record(where, value)


def _json_records(path: Path, limit: int) -> Iterator[Record]:
    with open(path, "rb") as f:
        head = f.read(4096)
        head = head[len(codecs.BOM_UTF8):] if head.startswith(codecs.BOM_UTF8) else head
        if head[_BYTES_WS.match(head).end():][:1] == b"[":  # an array: parsed whole, element by element
            raw = path.read_bytes()
            try:
                values = _text_values(raw.decode("utf-8-sig"), 1, limit)
            except UnicodeDecodeError as e:
                line = raw.count(b"\n", 0, e.start) + 1
                yield Record(f"{path}:{line}", error=f"{_utf8_error(raw, e)} {STOPPED}")
                return
        else:
            f.seek(0)
            values = _line_values(f, limit)
        first = next(values, None)
        if first is None:
            return
        second = next(values, None)
        if second is None and first.error is None and not first.element:  # the file's only value
            if first.size:
                yield from _whole_file_rows(path, first, limit)
                return
            rows = _rows_of_object(path, first.value)
            if rows is not None:
                yield from (Record(where, value) for where, value in rows)
                return
        whole = head[_BYTES_WS.match(head).end():][:1] == b"["  # one text: an error ends the file's reading
        for v in itertools.chain([first], [second] if second else [], values):
            if whole and v.error is not None:
                v.error += f" {STOPPED}"
            yield _record(path, v, limit)


# ---------------------------------------------------------------- CSV


class _LineTooLong(Exception):
    def __init__(self, line: int, size: int):
        super().__init__(line, size)
        self.line, self.size = line, size


class _CsvLines:
    """The lines `csv.reader` reads: counted, each at most `limit` characters (a longer one raises `_LineTooLong`
    without being held whole), those of the record being read kept in `kept`; `eof` once the file has ended."""

    def __init__(self, f, limit: int):
        self.f, self.limit, self.count, self.kept, self.eof = f, limit, 0, [], False

    def __iter__(self):
        return self

    def __next__(self) -> str:
        line = self.f.readline(self.limit + 1)
        if not line:
            self.eof = True
            raise StopIteration
        self.count += 1
        if len(line) > self.limit and not line.endswith(("\n", "\r")):
            size = len(line)
            while not line.endswith(("\n", "\r")) and (line := self.f.readline(1 << 20)):
                size += len(line)
            raise _LineTooLong(self.count, size)
        self.kept.append(line)
        return line


def _csv_records(path: Path, limit: int) -> Iterator[Record]:
    if csv.field_size_limit() < limit:  # a cell may be as large as a row (the module's default is 128 KiB)
        csv.field_size_limit(limit)
    with open(path, encoding="utf-8-sig", newline="") as f:
        lines = _CsvLines(f, limit)
        reader = csv.DictReader(lines)
        header = True
        while True:
            lines.kept = []
            at = lines.count + 1
            try:
                if header:  # read now, so that the first record's lines are its own
                    header = False
                    if reader.fieldnames is None:  # an empty file
                        return
                    lines.kept = []
                    at = lines.count + 1
                row = next(reader)
            except StopIteration:
                return
            except UnicodeDecodeError:
                yield Record(f"{path}:{lines.count + 1}", error="not valid UTF-8 at or after this line. Re-save the "
                             "file as UTF-8.")
                return
            except _LineTooLong as e:
                yield Record(f"{path}:{e.line}", error=f"{too_large(e.size, limit, 'line')} {STOPPED}")
                return
            except csv.Error as e:
                at += next((i for i, line in enumerate(lines.kept) if line.strip()), 0)
                if "field limit" in str(e):  # the field limit is the row limit
                    problem = too_large(None, limit, "record")
                else:
                    problem = f"malformed CSV in the record that starts on this line ({e}). Fix the quoting."
                yield Record(f"{path}:{at}", error=f"{problem} {STOPPED}")
                return
            at += next((i for i, line in enumerate(lines.kept) if line.strip()), 0)  # DictReader skips blank lines
            where = f"{path}:{at}"
            if len(lines.kept) > 1 or lines.eof:  # a record over several lines: a quote left open swallows rows
                try:
                    list(csv.reader(lines.kept, strict=True))
                except csv.Error as e:
                    yield Record(where, error=f"malformed CSV: a quoted cell of the record that starts on this line "
                                 f"is not closed where it should be ({e}), so lines {at}-{lines.count} were read as "
                                 "one record. Fix the quoting (a quote inside a quoted cell is written \"\").")
                    continue
            size = sum(map(len, lines.kept))
            if size > limit // 4 and (size := sum(len(x.encode("utf-8", "surrogatepass")) for x in lines.kept)) > limit:
                yield Record(where, error=too_large(size, limit))
                continue
            if None in row:
                yield Record(where, error=f"has {len(row[None])} more cells than the header. Quote cells that "
                             "contain commas.")
                continue
            yield Record(where, row, text_cells=True)


# ---------------------------------------------------------------- Parquet


def _parquet_records(path: Path) -> Iterator[Record]:
    import pyarrow.parquet as pq

    try:  # page checksums, where the writer stored them, catch damage inside a page
        pf = pq.ParquetFile(path, page_checksum_verification=True)
    except Exception as e:  # pyarrow raises several types for a corrupt or foreign file
        raise FastDPOError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0]}).") from None
    i = 0
    batches = pf.iter_batches(batch_size=1024)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception as e:  # a damaged page: OSError, ArrowInvalid, ... with the codec's or decoder's words
            raise FastDPOError(f"{path}: the Parquet data from row {i} on cannot be read ({str(e).splitlines()[0]}): "
                               "the file is damaged or incomplete. Download or write it again.") from None
        for value in batch.to_pylist():
            yield Record(f"{path} index {i}", value)
            i += 1


def file_records(path: Path, limit: int = MAX_ROW_BYTES) -> Iterator[Record]:
    """The records of one data file, by its suffix; rows over `limit` bytes are rejected (JSON and CSV)."""
    if path.suffix == ".parquet":
        yield from _parquet_records(path)
    elif path.suffix == ".csv":
        yield from _csv_records(path, limit)
    else:
        yield from _json_records(path, limit)
