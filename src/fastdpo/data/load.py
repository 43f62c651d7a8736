"""Load preference rows from dataset specs (files, dirs, HF datasets), with precise errors for bad rows."""

from __future__ import annotations

from pathlib import Path

from fastdpo.data.columns import AS_GIVEN, RowOptions
from fastdpo.data.formats import Row, RowError
from fastdpo.data.groups import to_rows
from fastdpo.data.kinds import check_row_kinds
from fastdpo.data.rejects import Rejects, read_valid
from fastdpo.data.sources import MAX_SAMPLED_ROWS, Spec, file_records, iter_records, sample, select, source_kind
from fastdpo.data.sources import parse_spec as parse_dataset_spec
from fastdpo.errors import FastDPOError

__all__ = ["MAX_SAMPLED_ROWS", "Row", "RowError", "check_row", "load_file", "load_rows", "load_spec", "parse_spec",
           "records_by_location", "sample_rows"]


def parse_spec(spec: str) -> tuple[str, int | None]:
    """`path#N` -> (path, N); plain path -> (path, None)."""
    s = parse_dataset_spec(spec)
    return s.label, s.count


def check_row(value: object, where: str) -> list[Row]:
    """One decoded record -> its pairs, in any supported format (see `fastdpo.data.formats` and `.groups`)."""
    return to_rows(value, where)


def records_by_location(path: Path) -> dict[str, object]:
    """{location: decoded value} of the rows of a JSONL / JSON file, located as `Row.source` locates them."""
    out = {}
    for rec in file_records(path):
        if rec.error is not None:
            raise FastDPOError(f"{rec.where}: {rec.error}")
        out[rec.where] = rec.value
    return out


def load_file(path_str: str, read: RowOptions = AS_GIVEN) -> list[Row]:
    """All rows of one local file or directory of data files (an empty file gives none)."""
    spec = Spec(path_str, path_str)
    if source_kind(spec) not in ("file", "dir"):
        raise FastDPOError(f"Dataset {path_str} not found. Check the path given to --dataset.")
    rows = [row for r in iter_records(spec, limit=read.max_row_bytes) for row in r.rows(read)]
    check_row_kinds(rows, path_str)
    return rows


def sample_rows(rows: list[Row], n: int, seed: int) -> list[Row]:
    """N rows without replacement; when N exceeds the size, whole copies then a sample of the rest."""
    return sample(rows, n, seed)


def load_spec(spec: Spec, split: str = "train", seed: int = 42, read: RowOptions = AS_GIVEN,
              rejects: Rejects | None = None) -> list[Row]:
    """Every row of one spec, validated (invalid rows raise one error, or are skipped into `rejects`), then
    `#N`-sampled."""
    rows = read_valid(iter_records(spec, split, limit=read.max_row_bytes), read, spec.label, rejects)
    if not rows:
        raise FastDPOError(f"Dataset {spec.label} has no rows.")
    check_row_kinds(rows, spec.label)
    return [row for record in select(by_record(rows), spec, seed, first=read.max_samples) for row in record]


def by_record(rows: list[Row]) -> list[list[Row]]:
    """Rows gathered by the record they came from (its pairs are adjacent, `member` 0, 1, ...): `#N` and
    --max_samples count records, as the user wrote them."""
    out: list[list[Row]] = []
    for row in rows:
        if row.member and out:
            out[-1].append(row)
        else:
            out.append([row])
    return out


def load_rows(specs: list[str], seed: int = 42, split: str = "train", read: RowOptions = AS_GIVEN,
              rejects: Rejects | None = None) -> list[Row]:
    """All rows of all datasets given (`path`, `path#N`, `org/name:subset`), in order, read as `read` says (column
    mapping, prompt template); invalid rows raise, or are skipped into `rejects` when it skips them."""
    rows: list[Row] = []
    for text in specs:
        rows.extend(load_spec(parse_dataset_spec(text), split, seed, read, rejects))
    if len(specs) > 1:  # each dataset holds one kind of row; together they must hold the same
        check_row_kinds(rows, f"datasets {', '.join(specs)}")
    return rows
