"""Loading a checkpoint into the run (DESIGN §9): weights (full model or PEFT adapter, after their shapes are
compared with the model's), optimizer and scheduler state, RNG states, the modules saved beside the model, and
sharded checkpoints on any number of ranks. What loads is checked: shapes that do not fit and NaN/Inf weights stop
with a message naming them, and `torch.load` runs with `weights_only=True` (a tampered file cannot run code)."""

from __future__ import annotations

from pathlib import Path

import torch

from fastdpo.checkpoint.layout import SHARDED, STATE
from fastdpo.checkpoint.rng import set_rng_state
from fastdpo.errors import FastDPOError
from fastdpo.parallel.sharded_state import (
    load_sharded,
    set_full_module_state,
    set_full_state,
    set_sharded_state,
    sharded_state,
)


def _mismatch(ckpt: Path, detail: str) -> FastDPOError:
    return FastDPOError(f"{ckpt}: its weights do not fit this model ({detail}): it was trained from another "
                        "architecture or size. Resume with the --model (and --train_type, LoRA settings) it was "
                        "trained with, or start a fresh run in another --output_dir.")


def _size_mismatch(e: RuntimeError) -> str | None:
    """The first 'size mismatch for NAME' line of torch's load_state_dict error, shortened."""
    for line in str(e).splitlines():
        if "size mismatch for" in line:
            return line.strip().replace("copying a param with shape ", "").replace("torch.Size(", "(")
    return None


def weight_files(ckpt: Path) -> list[Path]:
    """The weight files of the model saved in `ckpt`: model.safetensors, or the shards its index names; never any
    other .safetensors file that happens to lie there."""
    import json

    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise FastDPOError(f"{index}: unreadable weight index. Resume from another checkpoint.") from None
        return [ckpt / n for n in names]
    single = ckpt / "model.safetensors"
    return [single] if single.is_file() else []


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

        try:
            set_peft_model_state_dict(model, read(ckpt / "adapter_model.safetensors"))
        except RuntimeError as e:
            raise _mismatch(ckpt, _size_mismatch(e) or str(e).splitlines()[0]) from None
        return
    files = weight_files(ckpt)
    if not files:
        raise FastDPOError(f"{ckpt} holds no model.safetensors weights. Resume from another checkpoint.")
    state = {}
    for f in files:
        state.update(read(f))
    own = model.state_dict()
    shapes = [(k, tuple(v.shape), tuple(own[k].shape)) for k, v in state.items() if k in own and v.shape != own[k].shape]
    if shapes:
        k, saved, now = shapes[0]
        more = f", and {len(shapes) - 1} more" if len(shapes) > 1 else ""
        raise _mismatch(ckpt, f"{k} is {list(saved)} there, {list(now)} in this model{more}")
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if "lm_head" in k or "embed_tokens" in k}
    if set(missing) - tied or unexpected:
        raise _mismatch(ckpt, f"missing {missing[:3]}, unexpected {unexpected[:3]}")


def _load_state(path: Path, **kw):
    """torch.load restricted to tensors and plain containers: a tampered file cannot run code."""
    import pickle

    try:
        return torch.load(path, weights_only=True, **kw)
    except pickle.UnpicklingError:  # torch's message advises weights_only=False: exactly what must not be done here
        reason = "it holds objects other than tensors and plain containers, which fastdpo does not unpickle"
    except (OSError, RuntimeError, EOFError) as e:
        text = str(e).strip()
        reason = text.splitlines()[0] if text and "weights_only" not in text else type(e).__name__
    raise FastDPOError(f"{path}: not a loadable training state ({reason}). Resume from another checkpoint.")


def load_rng(path: Path) -> None:
    """Restore the RNG states saved in `path` (rng.pt, or rng-RANK.pt of a sharded checkpoint)."""
    state = _load_state(path)
    try:
        set_rng_state(state)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise FastDPOError(f"{path}: not the random-number state fastdpo writes ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else 'wrong layout'}). Resume from another "
                           "checkpoint.") from None


def load_training_state(ckpt: Path, optimizer, scheduler) -> None:
    st = ckpt / STATE
    try:
        optimizer.load_state_dict(_load_state(st / "optimizer.pt", map_location="cpu"))
        scheduler.load_state_dict(_load_state(st / "scheduler.pt"))
    except (KeyError, TypeError, ValueError) as e:
        raise FastDPOError(f"{ckpt}: its optimizer or scheduler state does not fit this run ({e}). Resume with the "
                           "--model and --train_type it was trained with.") from None
    load_rng(st / "rng.pt")


def nonfinite_tensors(modules: dict[str, torch.nn.Module], optimizer=None) -> list[str]:
    """Names of the floating-point weights, buffers (and optimizer state tensors) holding NaN or Inf, on this
    process (its shards under FSDP2). Two reductions per tensor (max and min propagate NaN), one host sync."""
    names, flags = [], []

    def add(name: str, t) -> None:
        t = t.to_local() if hasattr(t, "to_local") else t
        if t.dtype == torch.float8_e4m3fn and t.numel():  # an FP8 base (--fp8_base): no Inf, NaN is S.1111.111
            names.append(name)
            flags.append(((t.detach().view(torch.uint8) & 0x7F) != 0x7F).all())
        elif t.is_floating_point() and t.numel():
            names.append(name)
            flags.append(torch.isfinite(torch.stack([t.detach().amax(), t.detach().amin()]).float()).all())

    for label, module in modules.items():
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            add(f"{label}{name}", t)
    if optimizer is not None:
        for i, state in enumerate(optimizer.state.values()):
            for key, t in state.items():
                if isinstance(t, torch.Tensor):
                    add(f"optimizer state {key} of parameter {i}", t)
    if not flags:
        return []
    ok = torch.stack([f.cpu() for f in flags]).tolist()
    return [n for n, good in zip(names, ok) if not good]


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


def load_sharded_checkpoint(ckpt: Path, model, optimizer, scheduler, rank: int, extra_modules: dict | None = None) -> None:
    """Load a sharded checkpoint into `model` and `optimizer` as they are now laid out (plain, DDP or FSDP2 on any
    number of ranks), then the scheduler and this rank's RNG state (rank 0's when the checkpoint had fewer ranks)."""
    state = sharded_state(model, optimizer, extra_modules)
    try:
        load_sharded(state, ckpt / SHARDED)
    except (OSError, RuntimeError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise FastDPOError(f"{ckpt / SHARDED}: not loadable into this model ({first}). Resume with the --model "
                           "and --train_type it was trained with, or from another checkpoint.") from None
    set_sharded_state(model, optimizer, state, extra_modules)
    st = ckpt / STATE
    scheduler.load_state_dict(_load_state(st / "scheduler.pt"))
    rng = st / f"rng-{rank}.pt"
    load_rng(rng if rng.is_file() else st / "rng-0.pt")


def load_unsharded_into_ranks(ckpt: Path, model, optimizer, scheduler, extra_modules: dict | None = None) -> None:
    """Load a checkpoint written by one process (HF weights or PEFT adapter + optimizer.pt) into a model laid out
    over several ranks (DDP or FSDP2): every rank reads the full tensors and keeps its shard."""
    from safetensors.torch import load_file

    saved = {}
    peft_file = ckpt / "adapter_model.safetensors"
    files = ([peft_file] if peft_file.is_file() else []) if hasattr(model, "peft_config") else weight_files(ckpt)
    for f in files:
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
    shapes = {p: tuple(p.shape) for p in names}  # DTensors report their full (global) shape
    wrong = [(n, list(weights[n].shape), list(shapes[p])) for p, n in names.items() if tuple(weights[n].shape) != shapes[p]]
    if wrong:
        raise _mismatch(ckpt, f"{wrong[0][0]} is {wrong[0][1]} there, {wrong[0][2]} in this model")
    # optimizer.pt numbers parameters in param-group order; the distributed loader wants their names
    order = [names[p] for g in optimizer.param_groups for p in g["params"]]
    raw = _load_state(ckpt / STATE / "optimizer.pt", map_location="cpu")
    optim = {"state": {order[i]: v for i, v in raw["state"].items()},
             "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in raw["param_groups"]]}
    set_full_state(model, optimizer, weights, optim)
    for name, module in (extra_modules or {}).items():
        path = ckpt / STATE / f"{name}.safetensors"
        if not path.is_file():
            raise FastDPOError(f"{ckpt} has no saved {name} ({path.name}). Resume with the settings it was trained with.")
        set_full_module_state(module, load_file(str(path)))
    scheduler.load_state_dict(_load_state(ckpt / STATE / "scheduler.pt"))
    load_rng(ckpt / STATE / "rng.pt")
