"""Checkpoints (DESIGN §9): `checkpoint-N/` = model (HF safetensors dir or PEFT adapter) + `state/` (optimizer,
scheduler, RNG, progress, resolved config). Written into a temporary dir, fsynced, then renamed, so a kill at any
instant leaves the previous checkpoint intact. Loading uses safetensors and `torch.load(weights_only=True)`."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import torch

from fastdpo.config import save_config
from fastdpo.errors import FastDPOError
from fastdpo.model import save_model

STATE = "state"
DONE = "trainer_state.json"
_NAME = re.compile(r"^checkpoint-(\d+)$")


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


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
    state/{name}.safetensors (e.g. a reference model that training updates)."""
    final = out_dir / f"checkpoint-{step}"
    tmp = out_dir / f".checkpoint-{step}.tmp"
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
    (st / DONE).write_text(json.dumps({"step": step, **progress}, indent=1))  # written last: marks completeness
    _fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fd = os.open(out_dir, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return final


def complete_checkpoints(out_dir: Path) -> list[Path]:
    """Complete checkpoints in `out_dir`, oldest first."""
    found = []
    if out_dir.is_dir():
        for p in out_dir.iterdir():
            m = _NAME.match(p.name)
            if m and (p / STATE / DONE).is_file():
                found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def rotate(out_dir: Path, keep: int, best: str | Path | None = None) -> None:
    """Delete the oldest complete checkpoints beyond `keep` (0 keeps all); never the newest, never `best`.
    As in HF: the best counts as one of the `keep` (ranked just below the newest), so keep=1 keeps two when the best
    is not the newest."""
    if keep <= 0:
        return
    found = complete_checkpoints(out_dir)
    names = [p.name for p in found]
    best_name = Path(best).name if best else None
    if best_name in names[:-1]:
        best_path = found.pop(names.index(best_name))
        found.insert(len(found) - 1, best_path)
        keep = max(keep, 2)
    for p in found[:-keep]:
        shutil.rmtree(p, ignore_errors=True)


def resolve_resume(spec: str, out_dir: Path) -> Path | None:
    if not spec:
        return None
    if spec == "latest":
        found = complete_checkpoints(out_dir)
        return found[-1] if found else None  # nothing to resume: start fresh
    p = Path(spec)
    if not (p / STATE / DONE).is_file():
        raise FastDPOError(
            f"--resume_from_checkpoint {spec}: not a complete fastdpo checkpoint (no {STATE}/{DONE}). "
            f"Use `latest` or one of: {', '.join(c.name for c in complete_checkpoints(out_dir)) or 'none found'}."
        )
    return p


def load_progress(ckpt: Path) -> dict:
    return json.loads((ckpt / STATE / DONE).read_text())


def load_weights(model, ckpt: Path) -> None:
    """Load checkpoint weights into `model` in place (full model or PEFT adapter)."""
    from safetensors.torch import load_file

    if hasattr(model, "peft_config"):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(str(ckpt / "adapter_model.safetensors")))
        return
    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise FastDPOError(f"{ckpt} holds no .safetensors weights.")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if "lm_head" in k or "embed_tokens" in k}
    if set(missing) - tied or unexpected:
        raise FastDPOError(f"{ckpt}: weights do not match the model (missing {missing[:3]}, unexpected {unexpected[:3]}).")


def load_training_state(ckpt: Path, optimizer, scheduler) -> None:
    st = ckpt / STATE
    optimizer.load_state_dict(torch.load(st / "optimizer.pt", weights_only=True, map_location="cpu"))
    scheduler.load_state_dict(torch.load(st / "scheduler.pt", weights_only=True))
    set_rng_state(torch.load(st / "rng.pt", weights_only=True))


def load_extra_module(ckpt: Path, name: str, module) -> None:
    """Load state/{name}.safetensors written by `save_checkpoint(extra_modules=...)` into `module`."""
    from safetensors.torch import load_model as load_module

    path = ckpt / STATE / f"{name}.safetensors"
    if not path.is_file():
        raise FastDPOError(f"{ckpt} has no saved {name} ({path.name}); it was written without the settings that "
                           "need it. Resume with the settings it was trained with.")
    load_module(module, str(path))


# ---------------------------------------------------------------- sharded checkpoints (multi-rank runs)
# checkpoint-N/sharded/ holds model + optimizer through torch.distributed.checkpoint: every rank writes its own
# shards, and a later run loads them on any number of ranks (one included). state/ holds the rest as above, with
# one RNG file per rank. The same temporary-dir-then-rename protocol marks completeness.

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
        (st / DONE).write_text(json.dumps({"step": step, **progress}, indent=1))  # written last: marks completeness
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fd = os.open(out_dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
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
        dcp.load(state, checkpoint_id=str(ckpt / SHARDED))
    # strict=False: frozen weights are absent by design; dcp.load has already failed on any trainable key missing
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))
    for name, module in (extra_modules or {}).items():
        set_model_state_dict(module, state["extra"][name])
    st = ckpt / STATE
    scheduler.load_state_dict(torch.load(st / "scheduler.pt", weights_only=True))
    rng = st / f"rng-{rank}.pt"
    set_rng_state(torch.load(rng if rng.is_file() else st / "rng-0.pt", weights_only=True))


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
    raw = torch.load(ckpt / STATE / "optimizer.pt", weights_only=True, map_location="cpu")
    optim = {"state": {order[i]: v for i, v in raw["state"].items()},
             "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in raw["param_groups"]]}
    set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict=optim,
                   options=StateDictOptions(full_state_dict=True, strict=False))
    for name, module in (extra_modules or {}).items():
        path = ckpt / STATE / f"{name}.safetensors"
        if not path.is_file():
            raise FastDPOError(f"{ckpt} has no saved {name} ({path.name}). Resume with the settings it was trained with.")
        set_model_state_dict(module, load_file(str(path)), options=StateDictOptions(full_state_dict=True, strict=False))
    scheduler.load_state_dict(torch.load(ckpt / STATE / "scheduler.pt", weights_only=True))
    set_rng_state(torch.load(ckpt / STATE / "rng.pt", weights_only=True))
