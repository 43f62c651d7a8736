"""Where rows come from: local JSONL / JSON / Parquet / CSV files and directories of them, HF datasets (hub ids,
local dataset repos, `save_to_disk` dirs). Each record carries its location for error messages: `file:line` for
text files, `source index i` (0-based, as `ds[i]` / `df.iloc[i]`) for the others.

A dataset spec is `PATH_OR_ID[:SUBSET][#N]`. `#N` takes N rows without replacement (whole copies first when N
exceeds the size, as ms-swift does); with streaming it takes the first N rows, cycling when the source is shorter.
UTF-8 with a BOM and CRLF line endings are read silently.
"""

from __future__ import annotations

import codecs
import csv
import itertools
import json
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from fastdpo.data.columns import AS_GIVEN, RowOptions
from fastdpo.data.formats import Row, to_row
from fastdpo.data.unsupported import refuse_unsupported
from fastdpo.errors import FastDPOError

DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
MAX_SAMPLED_ROWS = 10_000_000  # `path#N` above this is a typo, not a plan (and would exhaust memory)
# CSV cells hold text; these columns may hold JSON lists (messages, tool schemas) written as text
CSV_JSON_COLUMNS = ("prompt", "chosen", "rejected", "messages", "rejected_messages", "tools", "conversations", "history")
_WS = re.compile(r"\s*")


@dataclass
class Record:
    """One raw row: its location and decoded value, or the problem found while reading it. CSV cells are text
    (`text_cells`): those of message and tool columns are decoded once the columns have their fastdpo names."""

    where: str
    value: object = None
    error: str | None = None
    text_cells: bool = False
    dataset: str = ""  # the spec it was read from

    def row(self, read: RowOptions = AS_GIVEN) -> Row:
        """The record as a Row, read as its dataset's own reading says (--dataset_info), else as `read` says."""
        if self.error is not None:
            raise FastDPOError(f"{self.where}: {self.error}")
        own = read.reading(self.dataset)
        where = f"{self.where} (dataset {own.name})" if own else self.where
        value = own.project(self.value, where) if own else read.rename(self.value, where)
        if self.text_cells:
            value = {k: _csv_value(k, v) for k, v in value.items()}
        refuse_unsupported(value, where)  # multimodal and unpaired rows would otherwise be misread
        return read.adapt(to_row(value, where, own.formatting if own else None))


@dataclass(frozen=True)
class Spec:
    text: str  # as the user wrote it
    name: str  # local path or HF dataset id
    subset: str | None = None
    count: int | None = None  # `#N`

    @property
    def label(self) -> str:
        return self.name + (f":{self.subset}" if self.subset else "")


def parse_spec(text: str) -> Spec:
    """`data.jsonl#500`, `org/name:subset#100`, `dir/` -> Spec."""
    name, count = text, None
    if "#" in text:
        name, _, n = text.rpartition("#")
        digits = n.lstrip("0")
        if not (n.isascii() and n.isdigit()) or not digits:  # ascii: "²".isdigit() holds, int("²") fails
            raise FastDPOError(f"--dataset {text!r}: the part after '#' must be a positive row count, e.g. data.jsonl#500.")
        if len(digits) > 9 or int(digits) > MAX_SAMPLED_ROWS:
            raise FastDPOError(f"--dataset {text!r}: at most {MAX_SAMPLED_ROWS:,} rows can be sampled from one dataset.")
        count = int(digits)
    subset = None
    if ":" in name and not _stat(name)[0]:
        head, _, sub = name.rpartition(":")
        if head and sub and "/" not in sub:
            name, subset = head, sub
    return Spec(text, name, subset, count)


def _looks_local(name: str) -> bool:
    return name.startswith((".", "/", "~")) or Path(name).suffix in DATA_SUFFIXES or name.count("/") > 1


def _stat(name: str) -> tuple[bool, bool, bool]:
    """(exists, is_dir, is_file) of a local path; a FastDPOError for names the OS refuses."""
    p = Path(name).expanduser()
    try:
        return p.exists(), p.is_dir(), p.is_file()
    except (OSError, ValueError) as e:  # name too long, unencodable, NUL byte, unreadable parent
        raise FastDPOError(f"Dataset {name!r}: not a usable path ({getattr(e, 'strerror', None) or e}).") from None


def source_kind(spec: Spec) -> str:
    """file | dir (of data files) | saved (`save_to_disk`) | hub (`datasets.load_dataset`: ids and dataset repos)."""
    p = Path(spec.name).expanduser()
    exists, is_dir, is_file = _stat(spec.name)
    if exists and not (is_dir or is_file):  # a pipe or device could block or never end
        raise FastDPOError(f"Dataset {spec.name} is not a regular file or directory. Give a data file or directory.")
    if is_file:
        return "file"
    if is_dir:
        if (p / "dataset_dict.json").exists() or (p / "state.json").exists():
            return "saved"
        card = p / "README.md"
        if spec.subset or (card.exists() and card.read_text(encoding="utf-8", errors="replace").startswith("---")):
            return "hub"  # a dataset repo with a card: let `datasets` resolve its configs and splits
        return "dir"
    if _looks_local(spec.name):
        raise FastDPOError(f"Dataset {spec.name} not found. Check the path given to --dataset.")
    return "hub"


def data_files(path: Path) -> list[Path]:
    """The data files below a directory, in sorted order. Names starting with '.' or '__', and everything under
    such folders, are left out as HF datasets leaves them out: a notebook's `.ipynb_checkpoints/` copies or a
    `__pycache__` would otherwise train as more rows."""
    def hidden(f: Path) -> bool:
        return any(part.startswith((".", "__")) for part in f.relative_to(path).parts)

    try:
        files = sorted(f for f in path.rglob("*") if f.suffix in DATA_SUFFIXES and not hidden(f) and f.is_file())
    except OSError as e:
        raise FastDPOError(f"Dataset dir {path}: cannot list it ({e.strerror}).") from None
    if not files:
        raise FastDPOError(f"Dataset dir {path} holds no {', '.join(DATA_SUFFIXES)} files.")
    return files


# ---------------------------------------------------------------- text files


def _utf8_error(path: Path, raw: bytes, e: UnicodeDecodeError) -> Record:
    line = raw[: e.start].count(b"\n") + 1
    return Record(f"{path}:{line}", error=f"not valid UTF-8 (byte 0x{raw[e.start]:02x}). Re-save the file as UTF-8.")


def _unparsable(e: Exception) -> str:
    """Why json.loads failed, for errors other than JSONDecodeError."""
    return "nested too deeply" if isinstance(e, RecursionError) else "a number too long to convert"


def _jsonl_records(path: Path) -> Iterator[Record]:
    """Line by line, so files larger than memory stream; a bad line is reported and reading goes on."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if lineno == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8):]
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield Record(where, error=f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}). "
                             "Re-save the file as UTF-8.")
                continue
            if not line.strip():
                continue
            try:
                yield Record(where, json.loads(line))
            except json.JSONDecodeError as e:
                yield Record(where, error=f"invalid JSON ({e.msg}, column {e.colno}). Fix or remove this line.")
            except (ValueError, RecursionError) as e:
                yield Record(where, error=f"invalid JSON ({_unparsable(e)}). Fix or remove this line.")


def _json_array_records(path: Path, text: str) -> Iterator[Record]:
    """Elements of a top-level JSON array, each with the line it starts on, and its index in the array as well when
    another element starts on the same line (a one-line array: `path:1 index 5`)."""
    dec = json.JSONDecoder()
    i = _WS.match(text, 0).end() + 1  # past '['
    line, seen = 1, 0
    held, before = None, None  # the last element read (line, index, value), not yet given out; its predecessor's line
    error = None

    def line_at(pos: int) -> int:
        nonlocal line, seen
        line += text.count("\n", seen, pos)
        seen = pos
        return line

    def give(next_line: int | None) -> Record:
        at, k, value = held
        return Record(f"{path}:{at}" + (f" index {k}" if at in (before, next_line) else ""), value)

    for k in itertools.count():
        i = _WS.match(text, i).end()
        if i < len(text) and text[i] == "]":
            break
        try:
            value, end = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            error = Record(f"{path}:{e.lineno}", error=f"invalid JSON ({e.msg}, column {e.colno}). Fix the syntax.")
            break
        except (ValueError, RecursionError) as e:
            error = Record(f"{path}:{line_at(i)}", error=f"invalid JSON ({_unparsable(e)}). Fix this row.")
            break
        at = line_at(i)
        if held is not None:
            yield give(at)
            before = held[0]
        held = (at, k, value)
        i = _WS.match(text, end).end()
        if i < len(text) and text[i] == ",":
            i += 1
        elif i >= len(text) or text[i] != "]":
            error = Record(f"{path}:{line_at(min(i, len(text)))}", error="invalid JSON (expected ',' or ']' after a "
                           "row).")
            break
    if held is not None:
        yield give(None)
    if error is not None:
        yield error


def _json_records(path: Path) -> Iterator[Record]:
    with open(path, "rb") as f:
        head = f.read(4096)
    head = head[len(codecs.BOM_UTF8):].lstrip() if head.startswith(codecs.BOM_UTF8) else head.lstrip()
    if not head.startswith(b"[") and path.suffix != ".json":
        yield from _jsonl_records(path)
        return
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        yield _utf8_error(path, raw, e)
        return
    if text.lstrip().startswith("["):
        yield from _json_array_records(path, text)
        return
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # one object per line in a .json file
            yield from _jsonl_records(path)
            return
        yield Record(f"{path}:{e.lineno}", error=f"invalid JSON ({e.msg}, column {e.colno}). Fix the syntax.")
        return
    except (ValueError, RecursionError) as e:
        yield Record(f"{path}:1", error=f"invalid JSON ({_unparsable(e)}). Fix the file.")
        return
    if isinstance(value, dict) and isinstance(value.get("data"), list):
        for i, v in enumerate(value["data"]):
            yield Record(f"{path} index {i}", v)
    elif isinstance(value, dict):
        yield Record(f"{path}:1", value)
    else:
        yield Record(f"{path}:1", error="a .json dataset must be an array of row objects.")


def _is_turn(m: object) -> bool:
    return isinstance(m, dict) and ("role" in m or "from" in m)


def _csv_value(name: str, cell: str | None) -> object:
    """A cell of a message or tool column holding JSON (a message list, an alpaca history, a ShareGPT reply
    object) -> its value; any other cell stays text."""
    if cell is None or name not in CSV_JSON_COLUMNS or not cell.lstrip().startswith(("[", "{")):
        return cell
    try:
        value = json.loads(cell)
    except (ValueError, RecursionError):
        return cell
    if name == "tools":
        return value
    if name == "history":
        return value if isinstance(value, list) and all(isinstance(p, list) for p in value) else cell
    if isinstance(value, list) and value and all(_is_turn(m) for m in value):
        return value
    return value if name in ("chosen", "rejected") and _is_turn(value) else cell


def _csv_records(path: Path) -> Iterator[Record]:
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.DictReader(f)
        start = 2
        try:
            for row in reader:
                where = f"{path}:{start}"
                start = reader.line_num + 1
                if None in row:
                    yield Record(where, error=f"has {len(row[None])} more cells than the header. Quote cells that "
                                 "contain commas.")
                    continue
                yield Record(where, row, text_cells=True)
        except UnicodeDecodeError:
            yield Record(f"{path}:{start}", error="not valid UTF-8 at or after this line. Re-save the file as UTF-8.")
        except csv.Error as e:
            yield Record(f"{path}:{reader.line_num}", error=f"malformed CSV ({e}). Fix the quoting.")


def _parquet_records(path: Path) -> Iterator[Record]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a corrupt or foreign file
        raise FastDPOError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0]}).") from None
    i = 0
    for batch in pf.iter_batches(batch_size=1024):
        for value in batch.to_pylist():
            yield Record(f"{path} index {i}", value)
            i += 1


def file_records(path: Path) -> Iterator[Record]:
    if path.suffix == ".parquet":
        yield from _parquet_records(path)
    elif path.suffix == ".csv":
        yield from _csv_records(path)
    else:
        yield from _json_records(path)


# ---------------------------------------------------------------- HF datasets


def hf_dataset(spec: Spec, split: str, streaming: bool = False):
    """A `datasets` Dataset (or IterableDataset when streaming) for a hub id, dataset repo or saved dir."""
    import datasets

    kind = source_kind(spec)
    try:
        if kind == "saved":
            ds = datasets.load_from_disk(str(Path(spec.name).expanduser()))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise FastDPOError(f"--dataset {spec.text}: no split {split!r} (splits: {', '.join(ds)}). "
                                       "Choose one with --split.")
                ds = ds[split]
            return ds.to_iterable_dataset() if streaming else ds
        return datasets.load_dataset(spec.name, spec.subset, split=split, streaming=streaming)
    except FastDPOError:
        raise
    except Exception as e:  # network, missing config, unknown split: datasets raises many types
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FastDPOError(f"--dataset {spec.text}: cannot load it as a local path or HF dataset ({msg}). Check the "
                           "path or dataset id, the subset after ':' and --split.") from None


def _hf_records(spec: Spec, split: str, streaming: bool) -> Iterator[Record]:
    label = f"{spec.label}[{split}]"
    for i, value in enumerate(hf_dataset(spec, split, streaming)):
        yield Record(f"{label} index {i}", value)


def iter_records(spec: Spec, split: str = "train", streaming: bool = False) -> Iterator[Record]:
    """All records of one spec, in order (without `#N` sampling), each naming the spec."""
    for rec in _spec_records(spec, split, streaming):
        rec.dataset = spec.text
        yield rec


def _spec_records(spec: Spec, split: str, streaming: bool) -> Iterator[Record]:
    kind = source_kind(spec)
    path = Path(spec.name).expanduser()
    if kind == "file":
        yield from file_records(path)
    elif kind == "dir":
        for f in data_files(path):
            yield from file_records(f)
    else:
        yield from _hf_records(spec, split, streaming)


def sample(items: list, n: int, seed: int) -> list:
    """N items without replacement; when N exceeds the size, whole copies then a sample of the rest."""
    rng = random.Random(seed)
    whole, rest = divmod(n, len(items))
    return items * whole + rng.sample(items, rest)


def first_cycling(read: Callable[[], Iterator], n: int, label: str) -> Iterator:
    """The first N items of `read()`, reading it again from the start while it runs out (streaming's `#N`)."""
    taken = 0
    while taken < n:
        before = taken
        for item in read():
            yield item
            taken += 1
            if taken == n:
                return
        if taken == before:
            raise FastDPOError(f"Dataset {label} has no rows.")


def select(items: list, spec: Spec, seed: int, streaming: bool = False, first: int = 0) -> list:
    """The items `#N` of `spec` keeps, as training takes them: all without `#N`; the first N (cycling) when
    streaming; else a seeded sample (see `sample`). Then only the first `first` of them (--max_samples; 0: all)."""
    kept = items
    if spec.count is not None and items:
        kept = list(first_cycling(lambda: iter(items), spec.count, spec.label)) if streaming else \
            sample(items, spec.count, seed)
    return kept[:first] if first else kept

