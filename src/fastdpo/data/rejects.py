"""Invalid rows. By default (`--strict true`) they stop the run with one error per dataset: the same problem over
many rows is named once, with its count and the first locations. With `--strict false` (ms-swift's flag) they are
skipped, counted by reason (`skipped 3 of 20 rows: 2 empty chosen, 1 missing rejected`) and written to
`rejects.jsonl` in the output dir: each with its file, line or index, reason, message and the row as read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from fastdpo.data.formats import Row, RowError
from fastdpo.data.unsupported import UnsupportedCount, UnsupportedRow
from fastdpo.errors import FastDPOError

REJECTS_FILE = "rejects.jsonl"
STRICT_HINT = (f"To skip invalid rows instead (counted, and written to {REJECTS_FILE} in --output_dir), pass "
               "--strict false.")
SHOWN = 3  # locations named per problem
_WHERE = re.compile(r"^(?P<file>.*?)(?::(?P<line>\d+))?(?: index (?P<index>\d+))?(?: key .*?)?(?: \(dataset .*\))?$")


def locate(where: str) -> tuple[str, int | None, int | None]:
    """A row's location (`file:12`, `file:1 index 5`, `file index 3`) -> (file or dataset, line, index)."""
    m = _WHERE.match(where)
    if m is None:  # not expected: the pattern matches any text
        return where, None, None
    line, index = m["line"], m["index"]
    return m["file"], int(line) if line else None, int(index) if index else None


def _locations(errors: list[RowError]) -> str:
    """'lines 1, 2, 3, ...' when the rows are lines of one file, else their locations."""
    located = [locate(e.where) for e in errors[:SHOWN]]
    more = ", ..." if len(errors) > SHOWN else ""
    if all(line is not None and index is None for _, line, index in located) and len({f for f, _, _ in located}) == 1:
        return f"line{'s' if len(errors) > 1 else ''} " + ", ".join(str(line) for _, line, _ in located) + more
    return ", ".join(e.where for e in errors[:SHOWN]) + more


def _headline(e: RowError) -> str:
    """'field 'prompt' is missing', or the reason when no one field is at fault."""
    if not e.field or e.kind:
        return e.reason
    word, field = e.reason.split(" ", 1)  # 'missing prompt': see RowError.reason
    return f"field {field!r} is {word}"


def grouped_error(errors: list[RowError], label: str, rows: int) -> FastDPOError:
    """One error for the invalid rows of dataset `label` (of `rows` read): each problem once, with its count and
    first locations, the first row's full message, and how to skip them."""
    assert errors
    if len(errors) == 1:
        return FastDPOError(f"{errors[0]} {STRICT_HINT}")
    first, *others = by_reason(errors).values()
    parts = [same_problem(first, label, rows)] + [f"Also {same_problem(same)}" for same in others]
    return FastDPOError(" ".join(parts) + f" {STRICT_HINT}")


def by_reason(errors: list[RowError]) -> dict[str, list[RowError]]:
    """The errors grouped by reason, in the order each reason first appears."""
    groups: dict[str, list[RowError]] = {}
    for e in errors:
        groups.setdefault(e.reason, []).append(e)
    return groups


def same_problem(errors: list[RowError], label: str = "", rows: int = 0) -> str:
    """'field 'prompt' is missing in 100 of 120 rows of data.jsonl (lines 1, 2, 3, ...): <the first row's error>'."""
    of = (f" of {rows}" if rows else "") + " rows" + (f" of {label}" if label else "")
    return f"{_headline(errors[0])} in {len(errors)}{of} ({_locations(errors)}): {errors[0]}"


@dataclass
class Rejected:
    """One skipped row: where it was, why, and the row as read (a raw record, or the row once read)."""

    file: str
    line: int | None
    index: int | None
    where: str
    reason: str
    error: str
    row: object


class Rejects:
    """The invalid rows of a run: skipped when `skip` (--strict false), else they raise (see `read_valid`)."""

    def __init__(self, skip: bool = False):
        self.skip = skip
        self.items: list[Rejected] = []
        self.rows = 0  # rows read, valid or not

    def add(self, e: RowError, row: object) -> None:
        self.items.append(Rejected(*locate(e.where), e.where, e.reason, str(e), row))

    def counts(self) -> dict[str, int]:
        """Skipped rows per reason, the most common first."""
        out: dict[str, int] = {}
        for r in self.items:
            out[r.reason] = out.get(r.reason, 0) + 1
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def summary(self) -> str:
        """'skipped 3 of 20 rows: 2 empty chosen, 1 missing rejected'."""
        counts = ", ".join(f"{n} {reason}" for reason, n in self.counts().items())
        return f"skipped {len(self.items)} of {self.rows} rows" + (f": {counts}" if counts else "")

    def write(self, path: Path) -> None:
        """One JSON line per skipped row (an empty file when none was)."""
        with open(path, "w", encoding="utf-8") as f:
            for r in self.items:
                f.write(json.dumps(asdict(r), ensure_ascii=False, default=str) + "\n")


def row_record(row: Row) -> dict:
    """A row once read, for the rejects file (rows that fail at tokenisation have no raw record at hand)."""
    return {"prompt": row.prompt, "chosen": row.chosen, "rejected": row.rejected, "tools": row.tools,
            "format": row.format}


def read_valid(records: Iterable, read, label: str, rejects: Rejects | None = None) -> list[Row]:
    """`record.rows(read)` of every record, in order. Invalid rows are added to `rejects` when it skips them; else, after the
    whole dataset is read, one error names each problem with its count (unsupported rows: what they hold)."""
    rows: list[Row] = []
    bad: list[RowError] = []
    n = 0
    for rec in records:
        n += 1
        try:
            rows.extend(rec.rows(read))
        except RowError as e:
            if rejects is not None and rejects.skip and e.kind == "unreadable file":
                raise FastDPOError(f"{e} The rows after this one could not be read, so --strict false cannot skip "
                                   "it alone: fix the file.") from None
            if rejects is not None and rejects.skip:
                rejects.add(e, rec.value if rec.error is None else None)
            else:
                bad.append(e)
    if rejects is not None:
        rejects.rows += n
    if bad and isinstance(bad[0], UnsupportedRow):  # a dataset of a kind fastdpo does not train: what it holds
        count = UnsupportedCount(label)
        count.rows = n
        for e in bad:
            if isinstance(e, UnsupportedRow):
                count.add(e)
        raise FastDPOError(f"{count.error()} {STRICT_HINT}")
    if bad:
        raise grouped_error(bad, label, n)
    if n and not rows:
        raise FastDPOError(f"{label}: all {n} rows are invalid and were skipped. Run `fastdpo check-data` on it to see "
                           "why.")
    return rows
