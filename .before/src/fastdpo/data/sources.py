"""Where rows come from: local JSONL / JSON / Parquet / CSV files and directories of them, HF datasets (hub ids,
local dataset repos, `save_to_disk` dirs). Each record carries its location for error messages: `file:line` for
text files, `source index i` (0-based, as `ds[i]` / `df.iloc[i]`) for the others. Local files are read by
`fastdpo.data.files`.

A dataset spec is `PATH_OR_ID[:SUBSET][#N]`. `#N` takes N rows without replacement (whole copies first when N
exceeds the size, as ms-swift does); with streaming it takes the first N rows, cycling when the source is shorter.
UTF-8 with a BOM and CRLF line endings are read silently.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from fastdpo.data.columns import MAX_ROW_BYTES
from fastdpo.data.files import file_records
from fastdpo.data.records import Record
from fastdpo.errors import FastDPOError

DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
MAX_SAMPLED_ROWS = 10_000_000  # `path#N` above this is a typo, not a plan (and would exhaust memory)


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


def iter_records(spec: Spec, split: str = "train", streaming: bool = False,
                 limit: int = MAX_ROW_BYTES) -> Iterator[Record]:
    """All records of one spec, in order (without `#N` sampling), each naming the spec; rows of local files over
    `limit` bytes are refused."""
    for rec in _spec_records(spec, split, streaming, limit):
        rec.dataset = spec.text
        yield rec


def _spec_records(spec: Spec, split: str, streaming: bool, limit: int) -> Iterator[Record]:
    kind = source_kind(spec)
    path = Path(spec.name).expanduser()
    if kind == "file":
        yield from file_records(path, limit)
    elif kind == "dir":
        for f in data_files(path):
            yield from file_records(f, limit)
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

