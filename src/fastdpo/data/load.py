"""Load preference rows from JSONL / JSON files, with precise errors for bad rows."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from fastdpo.errors import FastDPOError

REQUIRED = ("prompt", "chosen", "rejected")


@dataclass
class Row:
    """One preference pair as text, with where it came from (for error messages)."""

    prompt: str
    chosen: str
    rejected: str
    source: str  # "file:line"


def parse_spec(spec: str) -> tuple[str, int | None]:
    """`path#N` -> (path, N); plain path -> (path, None)."""
    if "#" in spec:
        path, _, n = spec.rpartition("#")
        if not n.isdigit() or int(n) < 1:
            raise FastDPOError(f"--dataset {spec!r}: the part after '#' must be a positive row count, e.g. data.jsonl#500.")
        return path, int(n)
    return spec, None


def _records(path: Path) -> list[tuple[int, object]]:
    """(line number, decoded JSON value) for a JSONL file or a JSON array file."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise FastDPOError(f"{path}: cannot read ({e.strerror}).") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise FastDPOError(f"{path}:{line}: not valid UTF-8 (byte {e.start}). Re-save the file as UTF-8.") from None
    stripped = text.lstrip()
    if path.suffix == ".json" or stripped.startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise FastDPOError(f"{path}:{e.lineno}: invalid JSON ({e.msg}, column {e.colno}).") from None
        if isinstance(value, dict) and isinstance(value.get("data"), list):
            value = value["data"]
        if not isinstance(value, list):
            raise FastDPOError(f"{path}: a .json dataset must be an array of row objects.")
        return [(i + 1, v) for i, v in enumerate(value)]  # 1-based row index for arrays
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append((lineno, json.loads(line)))
        except json.JSONDecodeError as e:
            raise FastDPOError(f"{path}:{lineno}: invalid JSON ({e.msg}, column {e.colno}). Fix or remove this line.") from None
    return out


def check_row(value: object, where: str) -> Row:
    if not isinstance(value, dict):
        raise FastDPOError(f"{where}: expected a JSON object with prompt/chosen/rejected, got {type(value).__name__}.")
    for name in REQUIRED:
        if name not in value:
            have = ", ".join(sorted(map(str, value))) or "none"
            raise FastDPOError(f"{where}: field {name!r} is missing (fields present: {have}). Add it to the row.")
        if not isinstance(value[name], str):
            raise FastDPOError(
                f"{where}: field {name!r} must be a string, got {type(value[name]).__name__}. "
                "Convert it to plain text."
            )
    for name in ("chosen", "rejected"):
        if not value[name]:
            raise FastDPOError(f"{where}: field {name!r} is empty. Every pair needs two non-empty completions.")
    return Row(value["prompt"], value["chosen"], value["rejected"], where)


def load_file(path_str: str) -> list[Row]:
    path = Path(path_str)
    if not path.exists():
        raise FastDPOError(f"Dataset {path_str} not found. Check the path given to --dataset.")
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".jsonl", ".json"))
        if not files:
            raise FastDPOError(f"Dataset dir {path_str} holds no .jsonl or .json files.")
        return [row for f in files for row in load_file(str(f))]
    return [check_row(v, f"{path}:{ln}") for ln, v in _records(path)]


def sample_rows(rows: list[Row], n: int, seed: int) -> list[Row]:
    """N rows without replacement; when N exceeds the size, whole copies then a sample of the rest."""
    rng = random.Random(seed)
    whole, rest = divmod(n, len(rows))
    return rows * whole + rng.sample(rows, rest)


def load_rows(specs: list[str], seed: int = 42) -> list[Row]:
    """All rows of all datasets given (`path` or `path#N`), in order."""
    rows: list[Row] = []
    for spec in specs:
        path, n = parse_spec(spec)
        got = load_file(path)
        if not got:
            raise FastDPOError(f"Dataset {path} has no rows.")
        rows.extend(sample_rows(got, n, seed) if n is not None else got)
    return rows
