"""Load preference rows from JSONL / JSON files, with precise errors for bad rows."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from fastdpo.errors import FastDPOError

REQUIRED = ("prompt", "chosen", "rejected")
MAX_SAMPLED_ROWS = 10_000_000  # `path#N` above this is a typo, not a plan (and would exhaust memory)


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
        digits = n.lstrip("0")
        if not (n.isascii() and n.isdigit()) or not digits:  # ascii: "²".isdigit() holds, int("²") fails
            raise FastDPOError(f"--dataset {spec!r}: the part after '#' must be a positive row count, e.g. data.jsonl#500.")
        if len(digits) > 9 or int(digits) > MAX_SAMPLED_ROWS:
            raise FastDPOError(f"--dataset {spec!r}: at most {MAX_SAMPLED_ROWS:,} rows can be sampled from one dataset.")
        return path, int(digits)
    return spec, None


def _unparsable(e: Exception) -> str:
    """Why json.loads failed, for errors other than JSONDecodeError."""
    return "nested too deeply" if isinstance(e, RecursionError) else "a number too long to convert"


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
        except (ValueError, RecursionError) as e:
            raise FastDPOError(f"{path}: invalid JSON ({_unparsable(e)}).") from None
        if isinstance(value, dict) and isinstance(value.get("data"), list):
            value = value["data"]
        if not isinstance(value, list):
            raise FastDPOError(f"{path}: a .json dataset must be an array of row objects.")
        return [(i + 1, v) for i, v in enumerate(value)]  # 1-based row index for arrays
    out = []
    for lineno, line in enumerate(text.split("\n"), 1):  # not splitlines(): U+2028 etc. may sit inside strings
        if not line.strip():
            continue
        try:
            out.append((lineno, json.loads(line)))
        except json.JSONDecodeError as e:
            raise FastDPOError(f"{path}:{lineno}: invalid JSON ({e.msg}, column {e.colno}). Fix or remove this line.") from None
        except (ValueError, RecursionError) as e:
            raise FastDPOError(f"{path}:{lineno}: invalid JSON ({_unparsable(e)}). Fix or remove this line.") from None
    return out


def check_row(value: object, where: str) -> Row:
    if not isinstance(value, dict):
        raise FastDPOError(f"{where}: expected a JSON object with prompt/chosen/rejected, got {type(value).__name__}.")
    for name in REQUIRED:
        if name not in value:
            have = ", ".join(sorted(map(str, value))).encode("utf-8", "backslashreplace").decode() or "none"
            raise FastDPOError(f"{where}: field {name!r} is missing (fields present: {have}). Add it to the row.")
        if not isinstance(value[name], str):
            raise FastDPOError(
                f"{where}: field {name!r} must be a string, got {type(value[name]).__name__}. "
                "Convert it to plain text."
            )
        try:
            value[name].encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate from a JSON escape such as "\ud800": no tokenizer takes it
            raise FastDPOError(
                f"{where}: field {name!r} holds an unpaired surrogate {value[name][e.start]!r} at character {e.start}, "
                "which is not valid Unicode text. Fix or remove that escape."
            ) from None
    for name in ("chosen", "rejected"):
        if not value[name]:
            raise FastDPOError(f"{where}: field {name!r} is empty. Every pair needs two non-empty completions.")
    return Row(value["prompt"], value["chosen"], value["rejected"], where)


def load_file(path_str: str) -> list[Row]:
    path = Path(path_str)
    try:
        exists, is_dir, is_file = path.exists(), path.is_dir(), path.is_file()
        files = sorted(p for p in path.iterdir() if p.suffix in (".jsonl", ".json")) if is_dir else []
    except (OSError, ValueError) as e:  # name too long, unencodable, unreadable dir
        raise FastDPOError(f"Dataset {path_str!r}: not a usable path ({getattr(e, 'strerror', None) or e}).") from None
    if not exists:
        raise FastDPOError(f"Dataset {path_str} not found. Check the path given to --dataset.")
    if not is_dir and not is_file:  # a pipe or device could block or never end
        raise FastDPOError(f"Dataset {path_str} is not a regular file or directory. Give a .jsonl or .json file.")
    if is_dir:
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
