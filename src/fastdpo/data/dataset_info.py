"""LLaMA-Factory's `dataset_info.json`: dataset names -> fastdpo dataset specs, each read with its own columns, row
format (alpaca or sharegpt) and sharegpt turn tags, as LLaMA-Factory reads them.

An entry is read as LLaMA-Factory reads it: only the columns it names (with `columns` left out: alpaca's
`instruction` and `input`, sharegpt's `conversations`; `chosen` and `rejected` under those names unless renamed),
and, for sharegpt, only the turns whose role is one of its tags (`tags` overrides the defaults it names). The
resolved form (`DatasetRead.to_dict`) is what `--dataset_info` holds, keyed by the dataset spec.

Preference entries have `ranking: true`. An entry whose columns name a `kto_tag` column (and without `ranking`) holds
unpaired rows (KTO): one judged reply per row, its tag the label (a JSON boolean) — alpaca's `output` (the `response`
column) after `instruction` / `input`, or the last turn of sharegpt's `conversations`. Its prompt and reply columns
not named take their default names; `chosen` / `rejected` are not read.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from fastdpo.data.formats import RowError, fields_present, read_label
from fastdpo.errors import FastDPOError

INFO_FILE = "dataset_info.json"
FORMATTINGS = ("alpaca", "sharegpt")
# LLaMA-Factory column key -> (its default dataset column, the fastdpo column it fills), per formatting
LF_COLUMNS = {
    "alpaca": {"prompt": ("instruction", "instruction"), "query": ("input", "input"), "chosen": ("chosen", "chosen"),
               "rejected": ("rejected", "rejected"), "history": (None, "history"), "system": (None, "system"),
               "tools": (None, "tools")},
    "sharegpt": {"messages": ("conversations", "conversations"), "chosen": ("chosen", "chosen"),
                 "rejected": ("rejected", "rejected"), "system": (None, "system"), "tools": (None, "tools")},
}
LF_COLUMN_NAMES = ("prompt", "query", "response", "history", "messages", "system", "tools", "images", "videos",
                   "audios", "chosen", "rejected", "kto_tag")
REQUIRED = ("instruction", "conversations", "chosen", "rejected")  # a row without them cannot be a pair
# an unpaired (KTO) entry's columns: the judged reply (alpaca's response column) and the tag read as the label
KTO_COLUMNS = {"alpaca": {"response": ("output", "output"), "kto_tag": (None, "label")},
               "sharegpt": {"kto_tag": (None, "label")}}
MEDIA_COLUMNS = ("videos", "audios")  # not read; `images` is (its rows are checked by check-data, refused by train)
# tag key -> (its default, the sharegpt role fastdpo's reader knows); role_tag / content_tag name the turn's keys
TAGS = {"role_tag": ("from", None), "content_tag": ("value", None), "user_tag": ("human", "human"),
        "assistant_tag": ("gpt", "gpt"), "observation_tag": ("observation", "observation"),
        "function_tag": ("function_call", "function_call"), "system_tag": ("system", "system")}
DEFAULT_TAGS = tuple((k, default) for k, (default, _) in TAGS.items())
ENTRY_KEYS = ("file_name", "hf_hub_url", "subset", "split", "formatting", "ranking", "columns", "tags", "num_samples",
              "folder", "revision", "file_sha1", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")
UNSUPPORTED = {"ms_hub_url": "a ModelScope dataset", "om_hub_url": "a Modelers dataset",
               "script_url": "a dataset loading script", "cloud_file_name": "a cloud file"}


@dataclass(frozen=True)
class DatasetRead:
    """How one dataset's records become rows: its own column mapping (dataset column -> fastdpo column; columns it
    does not name are not read), row format and sharegpt tags. Part of the tokenisation cache key."""

    name: str  # the dataset_info.json entry, for messages
    formatting: str = "alpaca"
    columns: tuple[tuple[str, str], ...] = ()
    tags: tuple[tuple[str, str], ...] = DEFAULT_TAGS

    def to_dict(self) -> dict:
        return {"name": self.name, "formatting": self.formatting, "columns": dict(self.columns),
                "tags": dict(self.tags)}

    @classmethod
    def from_dict(cls, spec: str, d: object) -> DatasetRead:
        """The `--dataset_info` value of dataset `spec`; a FastDPOError says what is wrong."""
        ok = isinstance(d, dict) and d.get("formatting", "alpaca") in FORMATTINGS and all(
            isinstance(d.get(k, {}), dict) for k in ("columns", "tags"))
        if not ok or not set(d.get("tags", {})) <= set(TAGS):
            raise FastDPOError(f"--dataset_info {spec}: expected {{name, formatting: alpaca|sharegpt, columns: "
                               f"{{dataset column: fastdpo column}}, tags: {{{', '.join(TAGS)}}}}}, got {d!r}.")
        tags = {**dict(DEFAULT_TAGS), **d.get("tags", {})}
        return cls(str(d.get("name", spec)), d.get("formatting", "alpaca"), tuple(sorted(d.get("columns", {}).items())),
                   tuple((k, str(tags[k])) for k in TAGS))

    @property
    def unpaired(self) -> bool:
        """Its rows are unpaired (KTO): its columns name a kto_tag column, read as each row's label."""
        return any(target == "label" for _, target in self.columns)

    def source_of(self, target: str) -> str:
        """The dataset column read as fastdpo's column `target` (`target` itself when none is)."""
        return next((source for source, t in self.columns if t == target), target)

    def project(self, value: object, where: str) -> object:
        """The record reduced to the columns this dataset names, under fastdpo's names; sharegpt turns re-tagged."""
        if not isinstance(value, dict):
            return value
        out = {}
        for source, target in self.columns:
            if value.get(source) is not None:
                out[target] = value[source]
            elif target == "label":
                if source not in value:
                    raise RowError(where, source, f"is missing (fields present: {fields_present(value)}); dataset "
                                   f"{self.name!r} reads each row's label (its kto_tag) from it.", "Give every row "
                                   f"its label, true or false, or fix the columns of {self.name!r} in {INFO_FILE}.")
                read_label(None, source, where)  # null: refused, naming the column
            elif target in REQUIRED:
                raise RowError(where, source, f"is missing (fields present: {fields_present(value)}); dataset "
                               f"{self.name!r} reads its {target} from it.", f"Fix the columns of {self.name!r} in "
                               f"{INFO_FILE}, or the row.")
        if self.formatting == "sharegpt":
            if isinstance(out.get("conversations"), list):
                out["conversations"] = [self._turn(m, f"conversations[{i}]", where)
                                        for i, m in enumerate(out["conversations"])]
            for name in ("chosen", "rejected"):
                if isinstance(out.get(name), dict):
                    out[name] = self._turn(out[name], name, where)
        return out

    def _turn(self, m: object, name: str, where: str) -> object:
        """A turn under this dataset's tags -> {from, value} with LLaMA-Factory's default role names."""
        if not isinstance(m, dict):
            return m
        tags = dict(self.tags)
        roles = {tags[k]: role for k, (_, role) in TAGS.items() if role}
        role = m.get(tags["role_tag"])
        if not isinstance(role, str) or role not in roles:
            raise RowError(where, f"{name}.{tags['role_tag']}", f"is {role!r}, not a role tag of dataset "
                           f"{self.name!r} ({', '.join(roles)}).", f"Fix the row, or the tags of {self.name!r} in "
                           f"{INFO_FILE}.")
        return {"from": roles[role], "value": m.get(tags["content_tag"])}


@dataclass(frozen=True)
class Resolved:
    """A dataset name resolved: the fastdpo spec, how it is read, the split of a hub dataset (None for files)."""

    spec: str
    read: DatasetRead
    split: str | None
    note: str = ""


def split_names(value: object) -> list[str]:
    """LLaMA-Factory's `dataset: a,b` (or a YAML list) -> names."""
    items = [] if value is None else [value] if isinstance(value, str) else list(value)
    return [n.strip() for d in items for n in str(d).split(",") if n.strip()]


def load_info(dataset_dir: str) -> dict:
    """The entries of DIR/dataset_info.json."""
    if dataset_dir == "ONLINE" or dataset_dir.startswith("REMOTE:"):
        raise FastDPOError(f"dataset_dir {dataset_dir}: fastdpo reads a local {INFO_FILE}. Download the dataset "
                           "(or its dataset_info.json) and give its directory.")
    path = Path(dataset_dir).expanduser() / INFO_FILE
    if not path.is_file():
        raise FastDPOError(f"dataset_dir {dataset_dir}: no {INFO_FILE} there, which names the datasets (LLaMA-Factory's "
                           f"data/{INFO_FILE}). Add it, or drop dataset_dir and list the data files under dataset.")
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise FastDPOError(f"{path}: not readable JSON ({e}). Fix the file.") from None
    if not isinstance(table, dict):
        raise FastDPOError(f"{path}: expected an object of dataset names to their entries.")
    return table


def _unknown(name: str, table: dict, dataset_dir: str) -> FastDPOError:
    close = difflib.get_close_matches(name, [str(k) for k in table], n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(close)}?" if close else f" Names there: {', '.join(list(map(str, table))[:10])}."
    if Path(name).expanduser().exists() or (Path(dataset_dir) / name).exists():
        hint += (f" {name} is a file, but with dataset_dir every dataset is a name (as in LLaMA-Factory): add an "
                 f"entry {{\"{Path(name).stem}\": {{\"file_name\": \"...\", \"ranking\": true}}}} for it, or drop "
                 "dataset_dir and list the data files under dataset.")
    return FastDPOError(f"dataset {name}: not in {Path(dataset_dir) / INFO_FILE}.{hint}")


def _source(name: str, entry: dict, dataset_dir: str) -> tuple[str, bool]:
    """(spec without `#N`, whether it is a hub dataset): hf_hub_url wins over file_name, as in LLaMA-Factory."""
    if entry.get("hf_hub_url"):
        for key in ("folder", "revision"):
            if entry.get(key):
                raise FastDPOError(f"dataset {name}: {key} {entry[key]!r} is not supported. Download that part of "
                                   f"{entry['hf_hub_url']} and name it with file_name.")
        subset = entry.get("subset")
        return str(entry["hf_hub_url"]) + (f":{subset}" if subset else ""), True
    for key, what in UNSUPPORTED.items():
        if entry.get(key):
            raise FastDPOError(f"dataset {name}: {key} names {what}, which fastdpo cannot read. Give the data as "
                               "file_name (a file or directory under dataset_dir) or hf_hub_url.")
    if not entry.get("file_name"):
        raise FastDPOError(f"dataset {name}: the entry names no file_name or hf_hub_url.")
    file_name = str(entry["file_name"])
    if os.path.isabs(file_name) or os.path.normpath(file_name).split(os.sep)[0] == os.pardir:
        raise FastDPOError(f"dataset {name}: file_name {file_name!r} points outside dataset_dir {dataset_dir}, and a "
                           f"{INFO_FILE} may only name files under its own dir (as LLaMA-Factory documents it). Copy "
                           "or link the file into the dir and name it relative to it, or drop dataset_dir and list "
                           "the file under dataset.")
    path = Path(dataset_dir) / file_name
    if not path.expanduser().exists():
        raise FastDPOError(f"dataset {name}: its file_name {entry['file_name']!r} is not in {dataset_dir} ({path} "
                           f"does not exist). Fix file_name in {Path(dataset_dir) / INFO_FILE}, or add the file.")
    return str(path), False


def _kto_tag(entry: dict) -> str | None:
    """The kto_tag column an entry's columns name (an unpaired dataset), else None."""
    columns = entry.get("columns")
    tag = columns.get("kto_tag") if isinstance(columns, dict) else None
    return str(tag) if tag else None


def _columns(name: str, entry: dict, formatting: str) -> tuple[tuple[str, str], ...]:
    given = entry.get("columns")
    if given is not None and not isinstance(given, dict):
        raise FastDPOError(f"dataset {name}: columns must be an object, got {given!r}.")
    known = LF_COLUMNS[formatting]
    kto = _kto_tag(entry) is not None
    if kto:  # unpaired: the reply and the tag, no chosen / rejected; unnamed columns under their default names
        known = {k: v for k, v in known.items() if k not in ("chosen", "rejected")} | KTO_COLUMNS[formatting]
    mapping: dict[str, str] = {}
    for key, column in (given or {}).items():
        if key == "images" and column:
            mapping[str(column)] = "images"
        if key in MEDIA_COLUMNS and column:
            raise FastDPOError(f"dataset {name}: columns.{key} ({column}): fastdpo reads text and images; {key} are "
                               "not read. Drop the column from the entry and the rows.")
        if key not in LF_COLUMN_NAMES:  # other formattings' columns, SFT's response and KTO's tag are not read
            close = difflib.get_close_matches(key, list(known), n=1)
            raise FastDPOError(f"dataset {name}: columns.{key} is not a LLaMA-Factory column."
                               + (f" Did you mean {close[0]}?" if close else f" Known: {', '.join(known)}."))
    for key, (default, target) in known.items():
        source = (given or {}).get(key, default if given is None or kto or key in ("chosen", "rejected") else None)
        if source:
            if source in mapping:
                raise FastDPOError(f"dataset {name}: column {source!r} is named for both {mapping[source]} and "
                                   f"{target}. Keep one.")
            mapping[str(source)] = target
    return tuple(sorted(mapping.items()))


def _count(name: str, entry: dict) -> tuple[str, str]:
    """(`#N` of num_samples or "", the note that says how it samples)."""
    n = entry.get("num_samples")
    if n is None:
        return "", ""
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise FastDPOError(f"dataset {name}: num_samples {n!r} must be a positive integer.")
    return f"#{n}", (f"dataset {name}: num_samples {n} samples {n} rows at random with --seed (as `path#{n}`), as "
                     "LLaMA-Factory does, with another generator, so other rows; beyond the dataset's size fastdpo "
                     "repeats whole copies where LLaMA-Factory draws the extra rows with replacement.")


def resolve(name: str, table: dict, dataset_dir: str) -> Resolved:
    """One dataset name -> its spec and reading; refusals name the entry."""
    entry = table.get(name)
    if entry is None:
        raise _unknown(name, table, dataset_dir)
    if not isinstance(entry, dict):
        raise FastDPOError(f"dataset {name}: its {INFO_FILE} entry must be an object, got {entry!r}.")
    for key in entry:  # a misspelt key would leave its setting at the default; keys unlike any are left alone
        close = difflib.get_close_matches(str(key), ENTRY_KEYS, n=1, cutoff=0.8)
        if key not in ENTRY_KEYS and close:
            raise FastDPOError(f"dataset {name}: {key!r} in its {INFO_FILE} entry is not a key LLaMA-Factory reads. "
                               f"Did you mean {close[0]}?")
    tag = _kto_tag(entry)
    if tag is not None and entry.get("ranking") is True:
        raise FastDPOError(f"dataset {name}: ranking is true and its columns name a kto_tag ({tag!r}) in "
                           f"{Path(dataset_dir) / INFO_FILE}: a dataset holds pairs (ranking) or unpaired rows judged "
                           "by their tag (kto_tag), not both. Keep one.")
    if tag is None and entry.get("ranking") is not True:
        raise FastDPOError(f"dataset {name}: ranking is not true in {Path(dataset_dir) / INFO_FILE}, so it is not "
                           "preference data (LLaMA-Factory's stage dpo refuses it too). Name a preference dataset, "
                           "or set \"ranking\": true if its rows hold chosen and rejected replies.")
    formatting = entry.get("formatting", "alpaca")
    if formatting not in FORMATTINGS:
        raise FastDPOError(f"dataset {name}: formatting {formatting!r}: choose alpaca or sharegpt.")
    tags = entry.get("tags") or {}
    if formatting == "sharegpt" and (not isinstance(tags, dict) or not set(tags) <= set(TAGS)):
        raise FastDPOError(f"dataset {name}: tags must be an object with keys among {', '.join(TAGS)}, got {tags!r}.")
    source, hub = _source(name, entry, dataset_dir)
    split = str(entry.get("split", "train"))
    if not hub and split != "train":
        raise FastDPOError(f"dataset {name}: split {split!r} of a data file: a file holds one split, train.")
    count, note = _count(name, entry)
    read = DatasetRead(name, formatting, _columns(name, entry, formatting), tuple(
        (k, str(tags.get(k, default))) for k, default in DEFAULT_TAGS) if formatting == "sharegpt" else DEFAULT_TAGS)
    return Resolved(source + count, read, split if hub else None, note)


def resolve_names(names: list[str], table: dict, dataset_dir: str, reading: dict,
                  split_flag: str) -> tuple[list[str], str | None, list[str]]:
    """The names of one dataset list (training's or the held-out one) -> (their specs, the split their hub datasets
    read when it is not train, notes). Each reading is added to `reading` (the --dataset_info value) under its spec;
    `split_flag` names the flag that holds the list's split, for the message when the hub datasets disagree."""
    got = [resolve(name, table, dataset_dir) for name in names]
    for r in got:
        if reading.setdefault(r.spec, r.read.to_dict()) != r.read.to_dict():
            raise FastDPOError(f"dataset {r.read.name}: {r.spec} is also another dataset, read otherwise. Name each "
                               "data file once.")
    splits = {r.split for r in got if r.split is not None}
    if len(splits) > 1:
        raise FastDPOError(f"datasets {', '.join(r.read.name for r in got)}: their hub datasets read different splits "
                           f"({', '.join(sorted(splits))}); fastdpo reads one split for all of them (--{split_flag}).")
    split = splits.pop() if splits else None
    return [r.spec for r in got], split if split != "train" else None, [r.note for r in got if r.note]
