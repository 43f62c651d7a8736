"""Checkpoints (DESIGN §9): `checkpoint-N/` = model (HF safetensors dir or PEFT adapter) + `state/` (optimizer,
scheduler, RNG, progress, resolved config).

Crash safety: every directory we publish (`checkpoint-N/`, `final/`) is written under a hidden temporary name,
fsynced file by file, then renamed into place, and the parent directory is fsynced. A kill at any instant therefore
leaves either the old or the new directory complete, never a half-written one under a public name. Deletions
(rotation) rename first, then remove. `trainer_state.json` lists every file with its size, so `latest` can verify
a checkpoint before trusting it. Loading uses safetensors and `torch.load(weights_only=True)`."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from pathlib import Path

import torch

from fastdpo.config import save_config
from fastdpo.errors import FastDPOError
from fastdpo.model.core import save_model

log = logging.getLogger("fastdpo")

STATE = "state"
DONE = "trainer_state.json"
_NAME = re.compile(r"^checkpoint-(\d+)$")
_PARTIAL = re.compile(r"^\.(checkpoint-\d+|final)\.(tmp|old|del)$")  # leftovers of an interrupted write or delete
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


def _publish(tmp: Path, dest: Path) -> None:
    """Make the fully written `tmp` visible as `dest`, durably. An existing `dest` is moved aside first (os.replace
    cannot overwrite a non-empty directory) and removed only once the new one is in place."""
    _fsync_tree(tmp)
    old = dest.with_name(f".{dest.name}.old")
    if old.exists():
        shutil.rmtree(old)
    if dest.exists():
        os.replace(dest, old)
    try:
        os.replace(tmp, dest)
    except OSError:
        if old.exists() and not dest.exists():
            os.replace(old, dest)  # put the previous one back under its public name
        raise
    _fsync_dir(dest.parent)
    shutil.rmtree(old, ignore_errors=True)


def _remove(path: Path) -> None:
    """Delete a published directory: rename it to a hidden name first, so a kill mid-delete leaves no
    half-deleted checkpoint under a public name."""
    trash = path.with_name(f".{path.name}.del")
    os.replace(path, trash)
    _fsync_dir(path.parent)
    shutil.rmtree(trash, ignore_errors=True)


def clean_partial(out_dir: Path) -> None:
    """Remove what interrupted writes and deletes left behind (hidden `.checkpoint-N.tmp` etc.)."""
    if out_dir.is_dir():
        for p in out_dir.iterdir():
            if _PARTIAL.match(p.name):
                shutil.rmtree(p, ignore_errors=True)


def _manifest(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def _write_failed(what: str, out_dir: Path, err: BaseException) -> FastDPOError:
    found = complete_checkpoints(out_dir)
    last = f"the last good checkpoint is {found[-1]}" if found else "no complete checkpoint exists yet"
    text = str(err).strip()
    reason = getattr(err, "strerror", None) or (text.splitlines()[0] if text else type(err).__name__)
    return FastDPOError(
        f"Writing {what} in {out_dir} failed ({reason}); training stopped and {last}. Free disk space (or fix the "
        f"directory's permissions), then rerun with --resume_from_checkpoint latest."
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
        # written last, with the size of every other file: a checkpoint is complete only if all of them match
        (st / DONE).write_text(json.dumps({"step": step, **progress, "files": _manifest(tmp)}, indent=1))
        _publish(tmp, final)
    except _write_errors() as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _write_failed(final.name, out_dir, e) from e
    return final


def save_final(out_dir: Path, model, tokenizer, state_dict: dict | None = None) -> Path:
    """Write the final model to `out_dir/final` atomically. `state_dict`: full weights gathered from shards."""
    final = out_dir / "final"
    tmp = out_dir / ".final.tmp"
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        save_model(model, tokenizer, tmp, state_dict)
        _publish(tmp, final)
    except _write_errors() as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _write_failed("the final model", out_dir, e) from e
    return final


def is_complete(ckpt: Path) -> bool:
    """All files listed in the checkpoint's trainer_state.json are present with their recorded sizes."""
    try:
        state = json.loads((ckpt / STATE / DONE).read_text())
    except (OSError, ValueError):
        return False
    files = state.get("files") if isinstance(state, dict) else None
    if not isinstance(files, dict):
        return isinstance(state, dict) and "step" in state  # written before manifests existed
    try:
        return all((ckpt / rel).stat().st_size == size for rel, size in files.items())
    except OSError:
        return False


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
            _remove(p)
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


def resolve_resume(spec: str, out_dir: Path) -> Path | None:
    if not spec:
        return None
    if spec == "latest":
        found = complete_checkpoints(out_dir)
        if not found:
            log.info("--resume_from_checkpoint latest: no complete checkpoint in %s; starting from step 0.", out_dir)
        return found[-1] if found else None
    p = Path(spec)
    if not is_complete(p):
        raise FastDPOError(
            f"--resume_from_checkpoint {spec}: not a complete fastdpo checkpoint (missing or mismatched files listed "
            f"in {STATE}/{DONE}). Use `latest` or one of: "
            f"{', '.join(c.name for c in complete_checkpoints(out_dir)) or 'none found'}."
        )
    return p


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


def load_weights(model, ckpt: Path) -> None:
    """Load checkpoint weights into `model` in place (full model or PEFT adapter)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    def read(f: Path) -> dict:
        try:
            return load_file(str(f))
        except (OSError, SafetensorError) as e:
            raise FastDPOError(f"{f}: unreadable weights ({e}). Resume from another checkpoint.") from None

    if hasattr(model, "peft_config"):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, read(ckpt / "adapter_model.safetensors"))
        return
    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise FastDPOError(f"{ckpt} holds no .safetensors weights.")
    state = {}
    for f in files:
        state.update(read(f))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if "lm_head" in k or "embed_tokens" in k}
    if set(missing) - tied or unexpected:
        raise FastDPOError(f"{ckpt}: weights do not match the model (missing {missing[:3]}, unexpected {unexpected[:3]}).")


def _load_state(path: Path, **kw):
    """torch.load restricted to tensors and plain containers: a tampered file cannot run code."""
    import pickle

    try:
        return torch.load(path, weights_only=True, **kw)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
        text = str(e).strip()
        first = text.splitlines()[0] if text else type(e).__name__
        raise FastDPOError(f"{path}: not a loadable training state ({first}). Resume from another checkpoint.") from None


def load_training_state(ckpt: Path, optimizer, scheduler) -> None:
    st = ckpt / STATE
    optimizer.load_state_dict(_load_state(st / "optimizer.pt", map_location="cpu"))
    scheduler.load_state_dict(_load_state(st / "scheduler.pt"))
    set_rng_state(_load_state(st / "rng.pt"))


def load_extra_module(ckpt: Path, name: str, module) -> None:
    """Load state/{name}.safetensors written by `save_checkpoint(extra_modules=...)` into `module`."""
    from safetensors import SafetensorError
    from safetensors.torch import load_model as load_module

    path = ckpt / STATE / f"{name}.safetensors"
    if not path.is_file():
        raise FastDPOError(f"{ckpt} has no saved {name} ({path.name}); it was written without the settings that "
                           "need it. Resume with the settings it was trained with.")
    try:
        load_module(module, str(path))
    except (OSError, SafetensorError) as e:
        raise FastDPOError(f"{path}: unreadable weights ({e}). Resume from another checkpoint.") from None


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


def _train_state(model, optimizer, extra_modules: dict | None) -> dict:
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
        dcp.save(_train_state(model, optimizer, extra_modules), checkpoint_id=str(tmp / SHARDED))
        torch.save(rng_state(), tmp / STATE / f"rng-{rank}.pt")
        dist.barrier()
        if rank == 0:
            st = tmp / STATE
            torch.save(scheduler.state_dict(), st / "scheduler.pt")
            save_config(config, st / "config.yaml")
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            # written last, with the size of every other file: a checkpoint is complete only if all of them match
            (st / DONE).write_text(json.dumps({"step": step, **progress, "files": _manifest(tmp)}, indent=1))
            _publish(tmp, final)
    except _write_errors() as e:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise _write_failed(final.name, out_dir, e) from e
    dist.barrier()
    return final


def load_sharded_checkpoint(ckpt: Path, model, optimizer, scheduler, rank: int, extra_modules: dict | None = None) -> None:
    """Load a sharded checkpoint into `model` and `optimizer` as they are now laid out (plain, DDP or FSDP2 on any
    number of ranks), then the scheduler and this rank's RNG state (rank 0's when the checkpoint had fewer ranks)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

    state = _train_state(model, optimizer, extra_modules)
    with warnings.catch_warnings():  # one process reading shards of many is what we mean
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(state, checkpoint_id=str(ckpt / SHARDED))
        except (OSError, RuntimeError, ValueError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise FastDPOError(f"{ckpt / SHARDED}: not loadable into this model ({first}). Resume with the --model "
                               "and --train_type it was trained with, or from another checkpoint.") from None
    # strict=False: frozen weights are absent by design; dcp.load has already failed on any trainable key missing
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))
    for name, module in (extra_modules or {}).items():
        set_model_state_dict(module, state["extra"][name])
    st = ckpt / STATE
    scheduler.load_state_dict(_load_state(st / "scheduler.pt"))
    rng = st / f"rng-{rank}.pt"
    set_rng_state(_load_state(rng if rng.is_file() else st / "rng-0.pt"))


def load_unsharded_into_ranks(ckpt: Path, model, optimizer, scheduler, extra_modules: dict | None = None) -> None:
    """Load a checkpoint written by one process (HF weights or PEFT adapter + optimizer.pt) into a model laid out
    over several ranks (DDP or FSDP2): every rank reads the full tensors and keeps its shard."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

    saved = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        saved.update(load_file(str(f)))
    adapter = f".{model.active_adapter}." if hasattr(model, "peft_config") else None
    names = {p: n for n, p in model.named_parameters() if p.requires_grad}
    weights = {}
    for name in names.values():
        key = name.replace(adapter, ".") if adapter else name  # PEFT files drop the adapter name
        if key not in saved:
            raise FastDPOError(f"{ckpt}: no weight {key!r} for this model. Resume with the --model and --train_type "
                               "the checkpoint was trained with.")
        weights[name] = saved[key]
    # optimizer.pt numbers parameters in param-group order; the distributed loader wants their names
    order = [names[p] for g in optimizer.param_groups for p in g["params"]]
    raw = _load_state(ckpt / STATE / "optimizer.pt", map_location="cpu")
    optim = {"state": {order[i]: v for i, v in raw["state"].items()},
             "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in raw["param_groups"]]}
    set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict=optim,
                   options=StateDictOptions(full_state_dict=True, strict=False))
    for name, module in (extra_modules or {}).items():
        path = ckpt / STATE / f"{name}.safetensors"
        if not path.is_file():
            raise FastDPOError(f"{ckpt} has no saved {name} ({path.name}). Resume with the settings it was trained with.")
        set_model_state_dict(module, load_file(str(path)), options=StateDictOptions(full_state_dict=True, strict=False))
    scheduler.load_state_dict(_load_state(ckpt / STATE / "scheduler.pt"))
    set_rng_state(_load_state(ckpt / STATE / "rng.pt"))
