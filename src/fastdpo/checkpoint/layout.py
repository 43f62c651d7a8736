"""What a checkpoint directory holds, and finding the whole ones (DESIGN §9). `checkpoint-N/` = the model (HF
safetensors dir or PEFT adapter; `sharded/` instead for a multi-rank run) + `state/` (optimizer, scheduler, RNG,
the resolved config, `trainer_state.json` and the content manifest). `trainer_state.json` holds the progress and the
size of every other file, so a cheap look at sizes (`is_complete`) tells a whole checkpoint from a torn one; the
manifest, written last, holds their content hashes (checked by `resume.checkpoint_problem`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from fastdpo.checkpoint import manifest
from fastdpo.errors import FastDPOError

STATE = "state"
DONE = "trainer_state.json"
SHARDED = "sharded"  # checkpoint-N/sharded/: model + optimizer as `parallel.sharded_state` writes them
MANIFEST = f"{STATE}/{manifest.MANIFEST}"
NAME = re.compile(r"^checkpoint-(\d+)$")


def sizes(root: Path) -> dict[str, int]:
    """Every file under `root` (relative path) with its size in bytes."""
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def size_problem(ckpt: Path, manifest_needed: bool = True) -> str | None:
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
    return size_problem(ckpt) is None


def unverified(ckpt: Path) -> bool:
    """`ckpt` has no content manifest (written by fastdpo before manifests, or the manifest was removed)."""
    return not (ckpt / MANIFEST).is_file()


def is_sharded(ckpt: Path) -> bool:
    return (ckpt / SHARDED).is_dir()


def complete_checkpoints(out_dir: Path) -> list[Path]:
    """Complete checkpoints in `out_dir`, oldest first."""
    found = []
    if out_dir.is_dir():
        for p in out_dir.iterdir():
            m = NAME.match(p.name)
            if m and is_complete(p):
                found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def numbered_checkpoints(out_dir: Path) -> list[Path]:
    """Every checkpoint-N dir in `out_dir`, complete or not, newest first."""
    found = [(int(m.group(1)), p) for p in out_dir.iterdir() if (m := NAME.match(p.name)) and p.is_dir()] \
        if out_dir.is_dir() else []
    return [p for _, p in sorted(found, reverse=True)]


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
