"""Checkpoints (DESIGN §9): `checkpoint-N/` = model (HF safetensors dir or PEFT adapter) + `state/` (optimizer,
scheduler, RNG, progress, resolved config, content manifest).

Crash safety: every directory we publish (`checkpoint-N/`, `final/`) is written under a hidden temporary name,
fsynced file by file, then renamed into place, and the parent directory is fsynced. Rewriting a published directory
takes three renames (temporary -> `.NAME.new`, the old one -> `.NAME.old`, `.NAME.new` -> NAME), so at every instant
the old or the new copy is complete under a name `clean_partial` knows, and the next start puts it back in place.
Deletions (rotation) rename first, then remove. `trainer_state.json` lists every file with its size (`latest`
skips a checkpoint whose sizes do not match), and `state/manifest.json`, written last, holds a content hash of every
file, checked before resuming. Loading uses safetensors and `torch.load(weights_only=True)`."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import threading
from pathlib import Path

import torch

from fastdpo.config import save_config
from fastdpo.errors import FastDPOError
from fastdpo.model.load import save_model
from fastdpo.training import manifest

log = logging.getLogger("fastdpo")

STATE = "state"
DONE = "trainer_state.json"
_NAME = re.compile(r"^checkpoint-(\d+)$")
_PARTIAL = re.compile(r"^\.(checkpoint-\d+|final)\.(tmp|new|old|del)$")  # leftovers of an interrupted write or delete
MANIFEST = f"{STATE}/{manifest.MANIFEST}"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "chat_template.jinja")


# ---------------------------------------------------------------- atomic directory writes


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(dirpath))


_datasync = getattr(os, "fdatasync", os.fsync)


class _Flusher:
    """Writes a directory's new data to the disk while it is still being written: a thread that keeps syncing the
    files under `root`, so that the disk works while the writers fill the page cache, and the fsync before
    publishing waits only for the tail (without it, the disk starts when the writing ends: a 3.4 GB model took
    1.8 s to write and 1.5-2 s more to sync). Errors are left to that fsync."""

    def __init__(self, root: Path, interval: float = 0.05):
        self.root, self.interval = root, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fastdpo-flush", daemon=True)
        self.synced = 0  # file syncs done (for tests)

    def __enter__(self) -> _Flusher:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for dirpath, _, files in os.walk(self.root):
                for name in files:
                    if self._stop.is_set():
                        return
                    try:
                        fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
                    except OSError:
                        continue
                    try:
                        _datasync(fd)
                        self.synced += 1
                    except OSError:
                        pass
                    finally:
                        os.close(fd)


def _hidden(dest: Path, kind: str) -> Path:
    return dest.with_name(f".{dest.name}.{kind}")


def _publish(tmp: Path, dest: Path) -> None:
    """Make the fully written `tmp` visible as `dest`, durably. An existing `dest` (os.replace cannot overwrite a
    non-empty directory) is replaced in three renames: tmp -> .dest.new, dest -> .dest.old, .dest.new -> dest. A kill
    between any two leaves a complete copy under a name `recover` puts back (the new one if it is there)."""
    _fsync_tree(tmp)
    if not dest.exists():
        os.replace(tmp, dest)
        _fsync_dir(dest.parent)
        return
    new, old = _hidden(dest, "new"), _hidden(dest, "old")
    for leftover in (new, old):
        if leftover.exists():
            shutil.rmtree(leftover)
    try:
        os.replace(tmp, new)
        os.replace(dest, old)
        os.replace(new, dest)
    except OSError:
        recover(dest)
        raise
    _fsync_dir(dest.parent)
    shutil.rmtree(old, ignore_errors=True)


def recover(dest: Path) -> None:
    """After an interrupted `_publish` of `dest`: put the complete copy back under its public name (the new one,
    else the old one) and remove the other leftovers of that write."""
    new, old = _hidden(dest, "new"), _hidden(dest, "old")
    for copy in (new, old):
        if not dest.exists() and copy.exists():
            try:
                os.replace(copy, dest)
                _fsync_dir(dest.parent)
                log.info("%s: an interrupted write had left it under %s; put back.", dest, copy.name)
            except OSError as e:
                log.warning("%s: could not put back %s (%s).", dest, copy, e.strerror or e)
    for leftover in (new, old, _hidden(dest, "tmp")):
        if leftover.exists() and dest.exists():
            shutil.rmtree(leftover, ignore_errors=True)


def remove_published(path: Path) -> None:
    """Delete a published directory: rename it to a hidden name first, so a kill mid-delete leaves no
    half-deleted checkpoint under a public name."""
    trash = _hidden(path, "del")
    os.replace(path, trash)
    _fsync_dir(path.parent)
    shutil.rmtree(trash, ignore_errors=True)


def clean_partial(out_dir: Path) -> None:
    """Put back what an interrupted rewrite left under a hidden name, then remove the other leftovers of interrupted
    writes and deletes (hidden `.checkpoint-N.tmp` etc.)."""
    if not out_dir.is_dir():
        return
    for name in sorted({m.group(1) for p in out_dir.iterdir() if (m := _PARTIAL.match(p.name))}):
        recover(out_dir / name)
    for p in out_dir.iterdir():
        if _PARTIAL.match(p.name):
            shutil.rmtree(p, ignore_errors=True)


def _sizes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def _reason(err: BaseException, out_dir: Path) -> str:
    """What went wrong with a write, in words: the OS's reason, or for torch's and safetensors' writers (whose
    messages read like " . unexpected pos 6419008 vs 6418896") what the disk says."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    try:
        full = shutil.disk_usage(out_dir).free < 64 << 20
    except OSError:
        full = False
    if full:
        return "no space left on device"
    text = str(err).strip()
    first = text.splitlines()[0].strip(" .") if text else ""
    return f"the file was cut short: {first}" if "unexpected pos" in first or not first else first


def write_failed(what: str, out_dir: Path, err: BaseException) -> FastDPOError:
    """The error for a write in `out_dir` that failed (disk full, permissions): what failed, why, and the last good
    checkpoint to resume from."""
    found = complete_checkpoints(out_dir)
    last = f"the last good checkpoint is {found[-1]}" if found else "no complete checkpoint exists yet"
    return FastDPOError(
        f"Writing {what} in {out_dir} failed ({_reason(err, out_dir)}); training stopped and {last}. Free disk space "
        f"(or fix the directory's permissions), then rerun with --resume_from_checkpoint latest."
    )


# Errors a failing write raises: OSError from Python, RuntimeError from torch.save's writer, SafetensorError.
def _write_errors() -> tuple[type[BaseException], ...]:
    from safetensors import SafetensorError

    return (OSError, RuntimeError, SafetensorError)


# ---------------------------------------------------------------- saving


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _write_done(tmp: Path, step: int, progress: dict, known: dict[str, str] | None = None) -> None:
    """The last two files of a checkpoint: trainer_state.json (progress, and the size of every other file: a
    checkpoint is complete only if all of them match), then the manifest of every file's content hash."""
    state = {"step": step, **progress, "files": _sizes(tmp), "manifest": MANIFEST}
    (tmp / STATE / DONE).write_text(json.dumps(state, indent=1))
    manifest.write_manifest(tmp, MANIFEST, known)


def save_checkpoint(out_dir: Path, step: int, model, tokenizer, optimizer, scheduler, progress: dict, config,
                    extra_modules: dict | None = None) -> Path:
    """Write checkpoint-{step} atomically and return its path. `extra_modules` (name -> module) are saved as
    state/{name}.safetensors (e.g. a reference model that training updates). A failed write raises a FastDPOError
    that names the last good checkpoint; the previous checkpoints are untouched."""
    final = out_dir / f"checkpoint-{step}"
    tmp = out_dir / f".checkpoint-{step}.tmp"
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        with _Flusher(tmp):
            save_model(model, tokenizer, tmp)
            st = tmp / STATE
            st.mkdir()
            torch.save(optimizer.state_dict(), st / "optimizer.pt")
            torch.save(scheduler.state_dict(), st / "scheduler.pt")
            torch.save(rng_state(), st / "rng.pt")
            save_config(config, st / "config.yaml")
            for name, module in (extra_modules or {}).items():
                from safetensors.torch import save_model as save_module

                save_module(module, str(st / f"{name}.safetensors"))
            _write_done(tmp, step, progress)
        _publish(tmp, final)
    except _write_errors() as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_failed(final.name, out_dir, e) from None
    return final


def save_final(out_dir: Path, model, tokenizer, state_dict: dict | None = None) -> Path:
    """Write the final model to `out_dir/final` atomically. `state_dict`: full weights gathered from shards."""
    final = out_dir / "final"
    tmp = out_dir / ".final.tmp"
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        with _Flusher(tmp):
            save_model(model, tokenizer, tmp, state_dict)
        _publish(tmp, final)
    except _write_errors() as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_failed("the final model", out_dir, e) from None
    return final


def _size_problem(ckpt: Path, manifest_needed: bool = True) -> str | None:
    """None when every file trainer_state.json lists (and the manifest it names) is there with its recorded size."""
    try:
        state = json.loads((ckpt / STATE / DONE).read_text())
    except (OSError, ValueError):
        return f"{STATE}/{DONE} is missing or unreadable"
    files = state.get("files") if isinstance(state, dict) else None
    if not isinstance(files, dict):
        return None if isinstance(state, dict) and "step" in state else f"{STATE}/{DONE} is unreadable"
    for rel, size in files.items():
        try:
            actual = (ckpt / rel).stat().st_size
        except OSError:
            return f"{rel} is missing"
        if actual != size:
            return f"{rel} has {actual} bytes, {size} when written"
    if manifest_needed and state.get("manifest") and not (ckpt / state["manifest"]).is_file():
        return f"{state['manifest']} is missing"
    return None


def is_complete(ckpt: Path) -> bool:
    """All files listed in the checkpoint's trainer_state.json are present with their recorded sizes (a cheap check;
    `checkpoint_problem` also checks their content)."""
    return _size_problem(ckpt) is None


def unverified(ckpt: Path) -> bool:
    """`ckpt` has no content manifest (written by fastdpo before manifests, or the manifest was removed)."""
    return not (ckpt / MANIFEST).is_file()


def checkpoint_problem(ckpt: Path, trust_unverified: bool = False) -> str | None:
    """Why `ckpt` cannot be resumed, in words, or None: files missing or of another size, content that differs from
    its manifest (a flipped bit, a swapped file), a file the manifest does not list, no manifest at all (unless
    `trust_unverified`), or a step counter that is not a step of this checkpoint."""
    if not ckpt.is_dir():
        return "no such directory"
    if unverified(ckpt) and not trust_unverified:
        return (f"{MANIFEST} is missing, so its content cannot be verified (checkpoints of fastdpo before content "
                "manifests have none); pass --trust_unverified_checkpoint true to resume it unverified")
    problem = _size_problem(ckpt, manifest_needed=not trust_unverified)
    if problem:
        return problem
    state = json.loads((ckpt / STATE / DONE).read_text())
    step, m = state.get("step"), _NAME.match(ckpt.name)
    if not isinstance(step, int) or isinstance(step, bool) or step < 1 or (m and int(m.group(1)) != step):
        return f"its step counter ({step!r} in {STATE}/{DONE}) is not the step {ckpt.name} was written at"
    for key in ("pairs_per_step", "epoch", "world_size"):
        value = state.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < (key != "epoch")):
            return f"its {key} ({value!r} in {STATE}/{DONE}) is not a count"
    return None if unverified(ckpt) else manifest.check_manifest(ckpt, MANIFEST)


def complete_checkpoints(out_dir: Path) -> list[Path]:
    """Complete checkpoints in `out_dir`, oldest first."""
    found = []
    if out_dir.is_dir():
        for p in out_dir.iterdir():
            m = _NAME.match(p.name)
            if m and is_complete(p):
                found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def rotate(out_dir: Path, limit: int, best: str | Path | None = None, keep: Path | None = None) -> None:
    """Delete the oldest complete checkpoints beyond `limit` (0 keeps all); never the newest, never `best`, never
    `keep` (the one just written, which is not the highest-numbered after resuming from an older checkpoint). As in
    HF, the best counts as one of the `limit` kept, so limit=1 keeps two when the best is not the newest."""
    if limit <= 0:
        return
    found = complete_checkpoints(out_dir)
    protected = {p.name for p in found[-1:]} | {Path(x).name for x in (best, keep) if x}
    protected &= {p.name for p in found}
    excess = len(found) - max(limit, len(protected))
    for p in [p for p in found if p.name not in protected][: max(0, excess)]:
        try:
            remove_published(p)
        except OSError as e:  # a checkpoint we could not delete costs disk space, not the run
            log.warning("--save_total_limit: could not delete %s (%s).", p, e.strerror or e)

# ---------------------------------------------------------------- pre-flight


def _tensor_bytes(tensors, per_tensor: int) -> int:
    """Bytes of the distinct tensors (tied weights are saved once) plus a per-tensor file overhead."""
    seen, total = set(), 0
    for t in tensors:
        key = (t.data_ptr(), t.numel(), t.dtype)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size() + per_tensor
    return total


def estimate_checkpoint_bytes(model, model_dir: str = "") -> tuple[int, int]:
    """(model bytes, optimizer-state bytes) of one checkpoint: the weights save_pretrained writes (the adapter only
    for PEFT models) with the tokenizer files and small state files, and AdamW's two moments (plus step) per
    trainable parameter."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    weights = _tensor_bytes(trainable if hasattr(model, "peft_config") else model.state_dict().values(), 256)
    src = Path(model_dir)
    tok = sum((src / n).stat().st_size for n in TOKENIZER_FILES if (src / n).is_file()) if model_dir else 0
    small = 32 * 1024  # RNG and scheduler state, configs, model card
    return weights + tok + small, 2 * _tensor_bytes(trainable, 512)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def check_disk_space(out_dir: Path, model, cfg, steps: int, extra_modules: list | tuple = ()) -> None:
    """Refuse to start unless `out_dir` has room for one checkpoint (with `extra_modules`, as save_checkpoint
    writes them); warn when the checkpoints the next `steps` steps keep (per --save_steps / --save_total_limit)
    plus the final model may not fit."""
    weights, optim = estimate_checkpoint_bytes(model, cfg.model)
    weights += sum(_tensor_bytes(m.state_dict().values(), 256) for m in extra_modules)
    one = int((weights + optim) * 1.05)  # filesystem slack
    free = shutil.disk_usage(out_dir).free
    if free < one:
        raise FastDPOError(
            f"--output_dir {out_dir}: only {_gib(free)} free, but one checkpoint needs about {_gib(one)} "
            f"(model {_gib(weights)}, optimizer state {_gib(optim)}). Free disk space or choose another --output_dir."
        )
    periodic = steps // cfg.save_steps if cfg.save_steps > 0 else 0
    checkpoints = max(1, min(periodic, cfg.save_total_limit) if cfg.save_total_limit > 0 else periodic)
    total = checkpoints * one + weights
    if total > free:
        log.warning("--output_dir %s: %s free; the %d checkpoints this run keeps plus the final model need about %s. "
                    "Set --save_total_limit or free space.", out_dir, _gib(free), checkpoints, _gib(total))


# ---------------------------------------------------------------- resuming


def numbered_checkpoints(out_dir: Path) -> list[Path]:
    """Every checkpoint-N dir in `out_dir`, complete or not, newest first."""
    found = [(int(m.group(1)), p) for p in out_dir.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()] \
        if out_dir.is_dir() else []
    return [p for _, p in sorted(found, reverse=True)]


def resolve_resume(spec: str, out_dir: Path, start_over: bool = False, trust_unverified: bool = False) -> Path | None:
    """The checkpoint --resume_from_checkpoint names, its content verified. `latest`: the newest one that passes
    `checkpoint_problem`, naming each one skipped and why; None when `out_dir` holds no checkpoint (a run that starts
    from step 0). When checkpoints exist but none is usable, a FastDPOError, unless `start_over` (then None).
    `trust_unverified`: a checkpoint without a content manifest may be chosen (with a warning)."""
    if not spec:
        return None
    if spec != "latest":
        p = Path(spec)
        problem = checkpoint_problem(p, trust_unverified)
        if problem:
            raise FastDPOError(
                f"--resume_from_checkpoint {spec}: not a complete fastdpo checkpoint ({problem}). Use `latest` or one "
                f"of: {', '.join(c.name for c in complete_checkpoints(out_dir)) or 'none found'}."
            )
        return _trusted(p)
    candidates = numbered_checkpoints(out_dir)
    if not candidates:
        log.info("--resume_from_checkpoint latest: no checkpoint in %s yet; starting from step 0.", out_dir)
        return None
    skipped = []
    for p in candidates:
        problem = checkpoint_problem(p, trust_unverified)
        if problem is None:
            if skipped:
                log.warning("--resume_from_checkpoint latest: skipped %s; resuming from %s.", "; ".join(skipped), p)
            return _trusted(p)
        skipped.append(f"{p.name} ({problem})")
    text = (f"--resume_from_checkpoint latest: none of the {len(candidates)} checkpoints in {out_dir} can be "
            f"resumed: {'; '.join(skipped)}.")
    if start_over:
        log.warning("%s --start_over_if_unusable: training from step 0.", text)
        return None
    raise FastDPOError(f"{text} Resume one you trust by its path, remove the broken ones, or pass "
                       "--start_over_if_unusable true to train from step 0.")


def _trusted(ckpt: Path) -> Path:
    if unverified(ckpt):
        log.warning("%s has no content manifest (%s): resuming it unverified, as --trust_unverified_checkpoint true "
                    "asks.", ckpt, MANIFEST)
    return ckpt


def check_resume_step(resume: Path, total_steps: int) -> int:
    """The step `resume` continues from; a FastDPOError when it lies past the end of this run."""
    step = load_progress(resume)["step"]
    if step > total_steps:
        raise FastDPOError(f"{resume} was written at step {step}, past the {total_steps} steps this run trains "
                           "(--max_steps / --num_train_epochs). Raise them to continue it, or resume an earlier "
                           "checkpoint by its path.")
    return step


def warn_later_checkpoints(out_dir: Path, start: int) -> None:
    """Checkpoints past the step this run starts at come from another run; `latest` would pick them after a kill."""
    later = [p.name for p in complete_checkpoints(out_dir) if int(p.name.split("-")[1]) > start]
    if later:
        log.warning("%s already holds %s from an earlier run, past step %d where this run starts; after an "
                    "interruption `--resume_from_checkpoint latest` would pick those. Remove them or use a fresh "
                    "--output_dir.", out_dir, ", ".join(later[-3:]), start)


def load_progress(ckpt: Path) -> dict:
    try:
        state = json.loads((ckpt / STATE / DONE).read_text())
        assert isinstance(state.get("step"), int)
    except (OSError, ValueError, AttributeError, AssertionError):
        raise FastDPOError(f"{ckpt / STATE / DONE}: unreadable training progress. Resume from another checkpoint.") from None
    return state


def saved_config(ckpt: Path) -> dict:
    """The resolved config saved with the checkpoint ({} when it has none or it cannot be read)."""
    return read_config(ckpt / STATE / "config.yaml")


def read_config(path: Path) -> dict:
    """A config.yaml written by training ({} when it is missing or cannot be read)."""
    import yaml

    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return {}
    return config if isinstance(config, dict) else {}


def _step_record(line: str) -> dict | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None


def split_metrics(text: str, step: int) -> tuple[list[str], list[int]]:
    """The lines of a metrics.jsonl `text` whose records are at or before `step`, and the numbers (from 1) of the
    lines that are not a step record. An unterminated last line is a write a kill interrupted, past any checkpoint,
    and is not counted."""
    lines = text.split("\n")
    keep, unreadable = [], []
    for number, line in enumerate(lines, 1):
        record = _step_record(line)
        if record is None:
            if line.strip() and number < len(lines):
                unreadable.append(number)
        elif record["step"] <= step:
            keep.append(line + "\n")
    return keep, unreadable


def truncate_metrics(path: Path, step: int) -> None:
    """Keep only the complete metrics.jsonl records up to `step`: after a resume from there, the log continues as
    if the run had never been interrupted (no repeated steps, no torn last line). Lines that cannot be read are
    named in a warning, and the file as it was is kept as metrics.jsonl.bak-{step}."""
    if not path.is_file():
        return
    text = path.read_text(encoding="utf-8", errors="replace")
    keep, unreadable = split_metrics(text, step)
    if unreadable:
        backup = path.with_name(f"{path.name}.bak-{step}")
        shutil.copy2(path, backup)
        which = f"line {unreadable[0]}" if len(unreadable) == 1 else f"lines {', '.join(map(str, unreadable))}"
        log.warning("%s: %s could not be read and %s dropped when the log was trimmed to step %d for the resume; the "
                    "file as it was is kept as %s.", path, which, "was" if len(unreadable) == 1 else "were", step,
                    backup)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(keep), encoding="utf-8")
    os.replace(tmp, path)


# ---------------------------------------------------------------- sharded checkpoints (multi-rank runs)
# checkpoint-N/sharded/ holds model + optimizer through torch.distributed.checkpoint: every rank writes its own
# shards, and a later run loads them on any number of ranks (one included). state/ holds the rest as above, with
# one RNG file per rank. Published like the others (temporary dir, manifest, fsync, rename) by rank 0 once every
# rank has written its part; output_dir must be shared by all nodes.

SHARDED = "sharded"


def is_sharded(ckpt: Path) -> bool:
    return (ckpt / SHARDED).is_dir()


def sharded_state(model, optimizer, extra_modules: dict | None) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    # frozen weights (a LoRA base) come from --model on resume: only what trains is saved
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    extra = {name: get_model_state_dict(m) for name, m in (extra_modules or {}).items()}
    return {"model": model_sd, "optim": optim_sd, "extra": extra}


def save_sharded_checkpoint(out_dir: Path, step: int, model, tokenizer, optimizer, scheduler, progress: dict, config,
                            rank: int, extra_modules: dict | None = None) -> Path:
    """Write checkpoint-{step} from all ranks (each must call this) and return its path. `extra_modules` (name ->
    module, e.g. a reference that training updates) are saved in the shards too."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    final = out_dir / f"checkpoint-{step}"
    tmp = out_dir / f".checkpoint-{step}.tmp"
    try:
        if rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            (tmp / STATE).mkdir(parents=True)
        dist.barrier()
        with _Flusher(tmp):  # every rank: the disk takes the shards as they are written and hashed
            dcp.save(sharded_state(model, optimizer, extra_modules), checkpoint_id=str(tmp / SHARDED))
            torch.save(rng_state(), tmp / STATE / f"rng-{rank}.pt")
            # each rank hashes the files it wrote (torch.distributed.checkpoint names them __RANK_N.distcp); rank 0
            # hashes the rest when it writes the manifest
            mine = [tmp / STATE / f"rng-{rank}.pt", *sorted((tmp / SHARDED).glob(f"__{rank}_*.distcp"))]
            digests = {str(f.relative_to(tmp)): d for f, d in manifest.file_digests(mine).items()}
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, digests)
        known = {k: v for part in every for k, v in part.items()}
        if rank == 0:
            st = tmp / STATE
            torch.save(scheduler.state_dict(), st / "scheduler.pt")
            save_config(config, st / "config.yaml")
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            _write_done(tmp, step, progress, known)
            _publish(tmp, final)
    except _write_errors() as e:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise write_failed(final.name, out_dir, e) from None
    dist.barrier()
    return final
