"""Precomputed reference log-probs (DESIGN §5): one forward-only pass over the data before training, cached on disk.

A cache file `<cache_dir>/<key>.safetensors` holds, for every pair (by dataset index), the reference log-prob sums
and shared-prefix sums (LD-DPO) of chosen and rejected. The key hashes three fingerprints and the settings that
change the numbers:
  model         content of the reference weights and config (and of --ref_adapters),
  data          the text of every row, in order,
  tokenisation  the token ids of every pair, and --max_length,
  dtype         the parameter dtype of the pass,
  base          with --fp8_base: the FP8 base the pass ran on.
Any change gives another key and so a rebuild; otherwise the file is reused across epochs and runs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from array import array
from pathlib import Path

import torch

from fastdpo.data.load import Row
from fastdpo.data.tokenize import TokenizedPair
from fastdpo.errors import FastDPOError
from fastdpo.model.backend import Backend, make_batch
from fastdpo.model.seqlogps import SeqLogps, completion_logps

log = logging.getLogger("fastdpo")
FORMAT_VERSION = 1
# the weights, and what turns inputs into what the weights see (an image processor's sizes and normalisation)
WEIGHT_FILES = ("config.json", "adapter_config.json", "preprocessor_config.json", "processor_config.json",
                "*.safetensors", "*.bin", "*.pt")
PASS_WINDOW = 4096  # pairs per first-fit packing window in the pass (first-fit is quadratic in the window)


def default_cache_dir() -> Path:
    root = os.environ.get("FASTDPO_CACHE_DIR") or Path.home() / ".cache" / "fastdpo"
    return Path(root) / "ref_logps"


# ---------------------------------------------------------------- fingerprints


def _hasher():
    return hashlib.blake2b(digest_size=16)


def file_digest(path: Path, memo: dict) -> str:
    """Content hash of a file, remembered in `memo` by (path, size, mtime) so large weights are read once."""
    st = path.stat()
    stamp = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    if stamp not in memo:
        h = _hasher()
        with open(path, "rb") as f:
            while block := f.read(1 << 23):
                h.update(block)
        memo[stamp] = h.hexdigest()
    return memo[stamp]


def local_model_dir(path: str) -> Path:
    """A local dir for a model path or hub id (the hub snapshot the model was loaded from)."""
    p = Path(path).expanduser()
    if p.is_dir():
        return p
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(path, local_files_only=True))
    except Exception:  # noqa: BLE001 - not downloaded yet: fetch what the fingerprint reads (loading needs it too)
        pass
    try:
        return Path(snapshot_download(path, allow_patterns=list(WEIGHT_FILES)))
    except Exception as e:  # noqa: BLE001 - any hub failure means we cannot fingerprint it
        raise FastDPOError(f"Cannot fingerprint {path} for the reference cache: no local copy ({e}). "
                           "Pass a local model dir.") from None


def model_fingerprint(paths: list[str], cache_dir: Path) -> str:
    """Hash of the weight and config files of each model / adapter dir in `paths`."""
    memo_path = cache_dir / "file_digests.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    h = _hasher()
    for path in paths:
        d = local_model_dir(path)
        files = sorted({f for pattern in WEIGHT_FILES for f in d.glob(pattern) if f.is_file()})
        if not files:
            raise FastDPOError(f"{path} holds no weights or config to fingerprint for the reference cache.")
        for f in files:
            h.update(f"{f.name}:{file_digest(f, memo)};".encode())
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        _write_atomic(memo_path, json.dumps(memo).encode())
    except OSError:  # the memo only saves hashing again: a full or read-only dir costs that, nothing more
        pass
    return h.hexdigest()


def data_fingerprint(rows: list[Row]) -> str:
    """Hash of the rows' texts and of their images' contents (a file's bytes, not its path: an image replaced under
    the same name, same size and token count, is another image)."""
    h = _hasher()
    memo: dict = {}  # an image several rows share is read once
    for r in rows:
        for text in (r.prompt, r.chosen, r.rejected):  # conversational rows: their messages as canonical JSON
            b = text.encode("utf-8") if isinstance(text, str) else json.dumps(text, sort_keys=True).encode("utf-8")
            h.update(len(b).to_bytes(8, "little"))
            h.update(b)
        for image in r.images:
            digest = file_digest(Path(image.path), memo) if image.data is None else \
                hashlib.blake2b(image.data, digest_size=16).hexdigest()
            h.update(f"image:{digest};".encode())
    return h.hexdigest()


def tokens_fingerprint(pairs: list[TokenizedPair], max_length: int) -> str:
    h = _hasher()
    h.update(f"max_length={max_length};".encode())
    for p in pairs:
        for ids in (p.prompt, p.chosen, p.rejected):
            h.update(len(ids).to_bytes(8, "little"))
            h.update(array("q", ids).tobytes())
        h.update(p.index.to_bytes(8, "little"))
    return h.hexdigest()


def cache_key(parts: dict) -> str:
    h = _hasher()
    h.update(json.dumps({**parts, "format": FORMAT_VERSION}, sort_keys=True).encode())
    return h.hexdigest()


# ---------------------------------------------------------------- the table and the pass


class RefTable:
    """Reference `SeqLogps` of every pair, looked up by dataset index: `logps` (num_rows, 4) =
    [chosen sum, rejected sum, chosen shared, rejected shared]."""

    def __init__(self, index: torch.Tensor, values: torch.Tensor, device: torch.device | str):
        size = int(index.max()) + 1 if index.numel() else 0
        self.logps = torch.full((size, 4), float("nan"), dtype=torch.float32, device=device)
        self.logps[index.to(device)] = values.to(device, torch.float32)
        self.index, self.values = index.cpu(), values.cpu()

    def lookup(self, index: torch.Tensor) -> SeqLogps:
        v = self.logps[index]
        return SeqLogps(torch.cat([v[:, 0], v[:, 1]]), torch.cat([v[:, 2], v[:, 3]]))


@torch.no_grad()
def compute_table(model, pairs: list[TokenizedPair], backend: Backend, pad_id: int, device: torch.device,
                  pairs_per_batch: int, max_tokens: int) -> RefTable:
    """Forward-only pass of `model` (in eval mode) over all pairs, `pairs_per_batch` pairs or `max_tokens` tokens
    per batch."""
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    index, values = [], []
    for start in range(0, len(pairs), PASS_WINDOW):
        for group in backend.micro_batches(pairs[start : start + PASS_WINDOW], max_tokens, pairs_per_batch):
            batch = make_batch(group, backend, pad_id, device, max_tokens)
            s = completion_logps(model, batch, backend)
            if not index:
                log.info("First reference batch (kernel compilation included) took %.1f s.", time.perf_counter() - t0)
            b = batch.num_pairs
            index.append(batch.index)
            values.append(torch.stack([s.sums[:b], s.sums[b:], s.shared[:b], s.shared[b:]], dim=1).float())
    model.train(was_training)
    log.info("Reference log-probs of %d pairs computed in %.1f s.", len(pairs), time.perf_counter() - t0)
    if not index:  # an empty share (a rank with no pairs)
        return RefTable(torch.zeros(0, dtype=torch.long), torch.zeros(0, 4), device)
    return RefTable(torch.cat(index).cpu(), torch.cat(values).cpu(), device)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk leaves no half-written file behind
        raise


def save_table(path: Path, table: RefTable, meta: dict) -> None:
    """Write the table; a full or read-only cache dir is logged, not raised (the table is in memory already)."""
    from safetensors.torch import save

    blob = save({"index": table.index.contiguous(), "logps": table.values.contiguous()},
                metadata={k: str(v) for k, v in meta.items()})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(path, blob)
    except OSError as e:
        log.warning("Could not write the reference cache %s (%s); going on without it (the next run computes the "
                    "reference log-probs again). Free space there or choose another dir with --ref_cache_dir.", path,
                    e.strerror or e)


def load_table(path: Path, device: torch.device | str) -> RefTable | None:
    """The cached table, or None when the file is missing or unreadable (it is then rebuilt)."""
    from safetensors.torch import load_file

    if not path.is_file():
        return None
    try:
        t = load_file(str(path))
        return RefTable(t["index"], t["logps"], device)
    except Exception as e:  # noqa: BLE001 - a torn or foreign file is rebuilt, never trusted
        log.warning("Reference cache %s is unreadable (%s); rebuilding it.", path, e)
        return None
