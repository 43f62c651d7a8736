"""On-disk cache of tokenised pairs, keyed by a fingerprint of the rows, the tokenizer and the settings.

A hit skips tokenising (most of the cost). The key is computed from the rows themselves, so it follows whatever
chose them (files, `#N` samples, splits, held-out rows) and changes when any row's text, the tokenizer (vocabulary,
specials, chat template), a length or template setting, how records become rows (column mapping, prompt template),
or this cache format changes. Entries are written to a
temporary dir and renamed into place.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from fastdpo.data.columns import AS_GIVEN, RowOptions
from fastdpo.data.formats import Row
from fastdpo.data.tokenize import TokenizedPair, TokenizeOptions, TokenizeStats
from fastdpo.version import __version__

log = logging.getLogger("fastdpo")
CACHE_FORMAT = 2  # 2: unpaired rows' labels; pairs identical once cut are dropped


def cache_root(cache_dir: str = "") -> Path:
    """--dataset_cache_dir, else $FASTDPO_CACHE_DIR, else $XDG_CACHE_HOME/fastdpo (~/.cache/fastdpo)."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    if os.environ.get("FASTDPO_CACHE_DIR"):
        return Path(os.environ["FASTDPO_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "fastdpo"


def tokenizer_fingerprint(tokenizer) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    specials = getattr(tokenizer, "special_tokens_map", {})
    h.update(json.dumps([specials, str(tokenizer.chat_template), getattr(tokenizer, "add_bos_token", None),
                         getattr(tokenizer, "add_eos_token", None)], sort_keys=True, default=str).encode())
    return h.hexdigest()


def rows_fingerprint(rows: list[Row]) -> str:
    """Every row's texts (or canonical JSON of its messages) and tools, in order."""
    h = hashlib.blake2b(digest_size=16)
    for r in rows:
        for part in (r.prompt, r.chosen, r.rejected, r.tools):
            b = part.encode("utf-8") if isinstance(part, str) else json.dumps(part, sort_keys=True).encode("utf-8")
            h.update(len(b).to_bytes(8, "little") + bytes([isinstance(part, str)]))
            h.update(b)
    return h.hexdigest()


def data_key(rows: list[Row], tokenizer, options: TokenizeOptions, read: RowOptions = AS_GIVEN) -> str:
    read_key = dataclasses.asdict(read)
    del read_key["max_row_bytes"]  # the limit changes no row it lets through
    parts = {
        "read": read_key,
        "format": CACHE_FORMAT,
        "version": __version__,
        "rows": rows_fingerprint(rows),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "options": dataclasses.asdict(options),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def load_cached(root: Path, key: str) -> tuple[list[TokenizedPair], TokenizeStats] | None:
    """The cached pairs of `key`, or None when there are none, or when the entry cannot be read (cut short by a full
    disk or a kill, or edited): it is then removed with a warning, so that this run writes it again."""
    entry = root / "tokenized" / key
    if not (entry / "stats.json").exists():
        return None
    try:
        with np.load(entry / "pairs.npz") as z:
            tokens, lens, index = z["tokens"], z["lens"], z["index"]
            labels = z["labels"].tolist() if "labels" in z.files else [-1] * len(index)  # -1: a pair
        stats = TokenizeStats(**json.loads((entry / "stats.json").read_text()))
        if lens.shape != (len(index), 3) or int(lens.sum()) != len(tokens) or stats.pairs != len(index):
            raise ValueError(f"{len(index)} pairs, {len(tokens)} tokens and stats of {stats.pairs} pairs disagree")
    except Exception as e:  # noqa: BLE001 - numpy, zipfile and json raise many types for a damaged file
        log.warning("Tokenisation cache %s cannot be read (%s: %s); tokenising again and rewriting it.", entry,
                    type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        discard(entry)
        return None
    tokens, lens, index = tokens.tolist(), lens.tolist(), index.tolist()
    pairs = []
    at = 0
    for (p, c, r), i, label in zip(lens, index, labels):
        pairs.append(TokenizedPair(tokens[at: at + p], tokens[at + p: at + p + c], tokens[at + p + c: at + p + c + r], i,
                                   label=None if label < 0 else bool(label)))
        at += p + c + r
    return pairs, stats


def discard(entry: Path) -> None:
    """Remove a cache entry: renamed aside first, so no reader sees it half removed."""
    aside = entry.with_name(f".{entry.name}.discarded.{os.getpid()}")
    try:
        entry.rename(aside)
    except OSError:  # gone already (another process), or not ours to move: leave it
        return
    shutil.rmtree(aside, ignore_errors=True)


def save_cached(root: Path, key: str, pairs: list[TokenizedPair], stats: TokenizeStats) -> Path:
    entry = root / "tokenized" / key
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=entry.parent))
    try:
        tokens = np.fromiter((t for p in pairs for seq in (p.prompt, p.chosen, p.rejected) for t in seq), np.int32)
        lens = np.array([(len(p.prompt), len(p.chosen), len(p.rejected)) for p in pairs], np.int32).reshape(-1, 3)
        labels = np.array([-1 if p.label is None else int(p.label) for p in pairs], np.int8)
        np.savez(tmp / "pairs.npz", tokens=tokens, lens=lens, index=np.array([p.index for p in pairs], np.int64),
                 labels=labels)
        (tmp / "stats.json").write_text(json.dumps(dataclasses.asdict(stats)))  # written last: marks completeness
        try:
            tmp.rename(entry)
        except OSError:  # another process wrote the same entry first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return entry
