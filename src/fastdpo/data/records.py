"""One raw row as read from a source (`Record`), and how it becomes a `Row`: its dataset's reading, CSV cells holding
JSON (or a label's true / false) decoded, multimodal rows refused (or, where the reading asks for them, read with
their images: `fastdpo.data.vision`), and rows over the size limit (--max_row_mb)
refused."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fastdpo.data.columns import AS_GIVEN, RowOptions
from fastdpo.data.formats import Row, RowError
from fastdpo.data.groups import to_rows
from fastdpo.data.unsupported import refuse_unsupported
from fastdpo.data.vision import has_media, split_media, with_images

# CSV cells hold text; these columns may hold JSON lists (messages, tool schemas) written as text
# the end of an error after which the rest of the file could not be read: such a row cannot be skipped alone
STOPPED = "Reading stopped here."
CSV_JSON_COLUMNS = ("prompt", "chosen", "rejected", "messages", "rejected_messages", "tools", "conversations", "history",
                    "completion")
CSV_LABEL_COLUMNS = ("label", "kto_tag")  # an unpaired row's label: the cell true or false (any case)


@dataclass
class Record:
    """One raw row: its location and decoded value, or the problem found while reading it. CSV cells are text
    (`text_cells`): those of message and tool columns are decoded once the columns have their fastdpo names."""

    where: str
    value: object = None
    error: str | None = None
    text_cells: bool = False
    dataset: str = ""  # the spec it was read from
    base: str = ""  # the directory of the data file it was read from: relative image paths are read against it

    def rows(self, read: RowOptions = AS_GIVEN) -> list[Row]:
        """The record as its pairs (one Row for a pair record; see `fastdpo.data.groups`), read as its dataset's own
        reading says (--dataset_info), else as `read` says."""
        if self.error is not None:  # the row itself could not be read: invalid JSON or UTF-8, malformed CSV, too large
            kind = "row too large" if "over the limit of" in self.error else "unreadable row"
            kind = "unreadable file" if self.error.endswith(STOPPED) else kind
            raise RowError(self.where, None, self.error, kind=kind)
        own = read.reading(self.dataset)
        where = f"{self.where} (dataset {own.name})" if own else self.where
        value = own.project(self.value, where) if own else read.rename(self.value, where)
        if self.text_cells:
            value = {k: _csv_value(k, v) for k, v in value.items()}
        media = read.images and isinstance(value, dict) and has_media(value)
        if media:
            value, images, rejected_images = split_media(value, where, Path(self.base) if self.base else None)
        else:
            refuse_unsupported(value, where)  # multimodal rows would otherwise train as text
        try:
            rows = to_rows(value, where, own.formatting if own else None, read.pairing)
        except RowError as e:
            if own and e.field == "label":  # the label is the dataset's tag column: name that
                raise RowError(e.where, own.source_of("label"), e.problem, e.fix, e.kind) from None
            raise
        if media:
            rows = [with_images(row, images, rejected_images, where) for row in rows]
        size = max(size_over(row, read.max_row_bytes) for row in rows)
        if size:  # from a source read whole (Parquet, HF datasets, a JSON object of rows)
            raise RowError(where, None, too_large(size, read.max_row_bytes), kind="row too large")
        return [read.adapt(row) for row in rows]


def size_over(row: Row, limit: int) -> int:
    """The bytes of a row's texts (messages: their contents) when they are over `limit`, else 0."""
    parts = [m.get("content") or "" for part in (row.prompt, row.chosen, row.rejected) if isinstance(part, list)
             for m in part] + [part for part in (row.prompt, row.chosen, row.rejected) if isinstance(part, str)]
    chars = sum(map(len, parts))
    if chars * 4 <= limit:  # a character is at most 4 bytes: counting them is not needed
        return 0
    size = sum(len(p.encode("utf-8", "surrogatepass")) for p in parts)
    return size if size > limit else 0


def _mib(n: int) -> str:
    return f"{n / 2**20:.3g} MiB" if n >= 2**20 else f"{n / 2**10:.3g} KiB" if n >= 2**10 else f"{n} bytes"


def too_large(size: int | None, limit: int, what: str = "row") -> str:
    """The message for a row over the limit: its size (None: not known), the limit and how to raise it."""
    return (f"this {what} is {f'{_mib(size)}, ' if size else ''}over the limit of {_mib(limit)} per row (tokenising "
            "a row needs about 200 bytes of memory per byte of text). Shorten or drop it, or raise --max_row_mb.")


def is_turn(m: object) -> bool:
    return isinstance(m, dict) and ("role" in m or "from" in m)


def _csv_value(name: str, cell: str | None) -> object:
    """A cell of a message or tool column holding JSON (a message list, an alpaca history, a ShareGPT reply
    object) -> its value; a label's true / false (any case) -> the boolean; any other cell stays text."""
    if name in CSV_LABEL_COLUMNS and isinstance(cell, str) and cell.strip().lower() in ("true", "false"):
        return cell.strip().lower() == "true"
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
    if isinstance(value, list) and value and all(is_turn(m) for m in value):
        return value
    return value if name in ("chosen", "rejected") and is_turn(value) else cell
