"""Where rows come from: local JSONL / JSON / Parquet / CSV files and directories of them, HF datasets (hub ids,
local dataset repos, `save_to_disk` dirs). Each record carries its location for error messages: `file:line` for
text files, `source index i` (0-based, as `ds[i]` / `df.iloc[i]`) for the others. Local files are read by
`fastdpo.data.files`.

Data already in memory (a list of dicts, an HF `Dataset` / `DatasetDict` / `IterableDataset`) becomes an
`InMemoryData` spec: a string that reads `<in-memory: N rows, fingerprint F>` wherever specs are shown or saved, and
holds the rows; its records are located as `in-memory <kind> row i`.

A dataset spec is `PATH_OR_ID[:SUBSET][#N]`. `#N` takes N rows without replacement (whole copies first when N
exceeds the size, as ms-swift does); with streaming it takes the first N rows, cycling when the source is shorter.
UTF-8 with a BOM and CRLF line endings are read silently.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

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


class InMemoryData(str):
    """Rows given as Python objects. The string is an honest label, `<in-memory: N rows, fingerprint F>` (F: a hash
    of the rows' content), so configs holding it print, save and compare as text: the same rows give the same
    label, and a resume with the same data matches the saved run. Copies share the rows (they are not changed)."""

    rows: list
    kind: str

    def __new__(cls, rows: list, kind: str = "list") -> InMemoryData:
        h = hashlib.blake2b(digest_size=8)
        for row in rows:
            h.update(json.dumps(row, sort_keys=True, default=str, ensure_ascii=False).encode("utf-8", "surrogatepass"))
            h.update(b"\n")
        self = super().__new__(cls, f"{IN_MEMORY}{len(rows)} row{'s' * (len(rows) != 1)}, fingerprint {h.hexdigest()}>")
        self.rows, self.kind = rows, kind
        return self

    def __reduce__(self):  # pickled whole (worker processes), not as the bare label
        return _rebuild, (self.rows, self.kind)

    def __copy__(self) -> InMemoryData:
        return self

    def __deepcopy__(self, memo: dict) -> InMemoryData:
        return self


def _rebuild(rows: list, kind: str) -> InMemoryData:
    return InMemoryData(rows, kind)


IN_MEMORY = "<in-memory: "
# a saved config.yaml records the label: the rows themselves stay in the caller's hands
for _dumper in (yaml.SafeDumper, yaml.Dumper):
    _dumper.add_representer(InMemoryData, lambda dumper, value: dumper.represent_str(str(value)))


def dataset_specs(value: object, split: str = "train", flag: str = "dataset") -> list:
    """What `TrainConfig(dataset=...)` may be given -> a list of specs: a path or id string, a list of them, a list
    of dicts (rows), an HF Dataset, DatasetDict (its `split`) or IterableDataset (read whole, now), or a list
    mixing strings and datasets."""
    if isinstance(value, str) or _is_hf(value):
        value = [value]
    if isinstance(value, tuple):
        value = list(value)
    if not isinstance(value, list):
        raise FastDPOError(f"{flag}= takes a path or dataset id, a list of them, a list of row dicts or an HF "
                           f"Dataset; got a {type(value).__name__}.")
    if value and all(isinstance(v, dict) and not _is_hf(v) for v in value):  # a DatasetDict is a dict too
        return [InMemoryData(value, "list")]
    out = []
    for i, v in enumerate(value):
        if isinstance(v, str):
            out.append(v)
        elif _is_hf(v):
            out.append(_from_hf(v, split, flag))
        else:
            what = "a dict among other entries (give rows as a list holding only dicts)" if isinstance(v, dict) \
                else f"a {type(v).__name__}"
            raise FastDPOError(f"{flag}[{i}] is {what}. Each entry is a path or dataset id, or an HF Dataset; rows "
                               "go in as one list of dicts.")
    return out


def _is_hf(value: object) -> bool:
    return type(value).__module__.split(".")[0] == "datasets"


def _from_hf(ds, split: str, flag: str) -> InMemoryData:
    import datasets

    if isinstance(ds, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        if split not in ds:
            raise FastDPOError(f"{flag}= is a DatasetDict without a {split!r} split (splits: {', '.join(ds)}). Pass "
                               f"the split itself, e.g. ds[{next(iter(ds), 'train')!r}], or set split=.")
        ds = ds[split]
    if not isinstance(ds, (datasets.Dataset, datasets.IterableDataset)):
        raise FastDPOError(f"{flag}= is a {type(ds).__name__}; give a Dataset, DatasetDict or IterableDataset.")
    return InMemoryData(list(ds), type(ds).__name__)


def parse_spec(text: str) -> Spec:
    """`data.jsonl#500`, `org/name:subset#100`, `dir/` -> Spec."""
    if isinstance(text, InMemoryData):
        return Spec(text, text)
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
    """file | dir (of data files) | saved (`save_to_disk`) | hub (`datasets.load_dataset`: ids and dataset repos) |
    memory (`InMemoryData`)."""
    if isinstance(spec.name, InMemoryData):
        return "memory"
    if spec.text.startswith(IN_MEMORY):  # a saved config.yaml's label: the rows were never written
        raise FastDPOError(f"Dataset {spec.text} was given in memory, so the saved config records only its label. "
                           "Pass the same rows in Python (TrainConfig(dataset=rows)), or a file of them.")
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


def _based(records: Iterator[Record], base: Path) -> Iterator[Record]:
    """Records of a data file, knowing its directory (relative image paths are read against it)."""
    for rec in records:
        rec.base = str(base.resolve())
        yield rec


def _spec_records(spec: Spec, split: str, streaming: bool, limit: int) -> Iterator[Record]:
    kind = source_kind(spec)
    path = Path(spec.name).expanduser()
    if kind == "file":
        yield from _based(file_records(path, limit), path.parent)
    elif kind == "dir":
        for f in data_files(path):
            yield from _based(file_records(f, limit), f.parent)
    elif kind == "memory":
        for i, value in enumerate(spec.name.rows):
            yield Record(f"in-memory {spec.name.kind} row {i}", value)
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

