"""The disk under a run: the pre-flight (refuse to start without room for one checkpoint, warn when the checkpoints a
run keeps may not fit) and the error a failed write becomes (what failed, why in words, the last good checkpoint)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from fastdpo.checkpoint.layout import complete_checkpoints
from fastdpo.errors import FastDPOError

log = logging.getLogger("fastdpo")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "chat_template.jinja")


# ---------------------------------------------------------------- write failures


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
def write_errors() -> tuple[type[BaseException], ...]:
    from safetensors import SafetensorError

    return (OSError, RuntimeError, SafetensorError)


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
