"""The launch environment as configuration: how many ranks a job has, from torchrun's or ms-swift's env vars."""

from __future__ import annotations

import json
import os
from pathlib import Path

from fastdpo.errors import FastDPOError


def wants_launch(env: dict | None = None) -> bool:
    """NPROC_PER_NODE asks for workers and this process is not already one of them."""
    env = os.environ if env is None else env
    return bool(env.get("NPROC_PER_NODE")) and "LOCAL_RANK" not in env


def env_int(env: dict, name: str, default: int | None = None, low: int = 0) -> int:
    """The launcher's variable `name` of `env` as an integer >= `low` (`default` when unset); a user error if not."""
    raw = env.get(name)
    if raw in (None, ""):
        assert default is not None
        return default
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if value < low:
        raise FastDPOError(f"{name}={raw!r}: expected an integer >= {low}.")
    return value


def world_size(env: dict | None = None) -> int:
    """Ranks of the job: WORLD_SIZE inside a worker, NPROC_PER_NODE x NNODES before `fastdpo train` starts them,
    else 1."""
    env = os.environ if env is None else env
    if env.get("WORLD_SIZE"):
        return env_int(env, "WORLD_SIZE", low=1)
    if env.get("NPROC_PER_NODE"):
        return env_int(env, "NPROC_PER_NODE", low=1) * env_int(env, "NNODES", 1, low=1)
    return 1


# set by `fastdpo train` under NPROC_PER_NODE for the workers it starts: it validated the flags and printed their
# notes itself
LAUNCHED = "FASTDPO_LAUNCHED"

# the fields whose checks depend on the world size, and the other tools' flags that can set them (the error names
# what the user typed)
WORLD_FIELDS = {"sequence_parallel_size": ("ulysses_num_heads",),
                "sequence_parallel_mode": ("ulysses_num_heads", "ring_attn")}


def prints_notes(env: dict | None = None) -> bool:
    """Notes about the flags print once per job: in the launcher, or on rank 0 of a job torchrun started."""
    env = os.environ if env is None else env
    return not env.get(LAUNCHED) and env.get("RANK", "0") in ("", "0")


def _heads(model: str) -> int | None:
    """The attention heads of a local model dir's config.json (None for a hub id: the workers check it)."""
    path = Path(model).expanduser() / "config.json"
    if not model or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # loading the model reports a broken config with its own message
    data = data.get("text_config", data) if isinstance(data.get("text_config"), dict) else data
    heads = data.get("num_attention_heads")
    return heads if isinstance(heads, int) and heads > 0 else None


def check_world(cfg, world: int, typed: dict[str, str] | None = None, source: str = "") -> None:
    """What the world size decides, checked before any worker starts: sequence-parallel groups must divide the
    ranks, and Ulysses must divide the model's heads. `typed` maps a field to the flag the user typed for it
    (`--ulysses_num_heads 8`); `source` says where the world size came from (`NPROC_PER_NODE=2`)."""
    typed = typed or {}
    sp, mode = cfg.sequence_parallel_size, cfg.sequence_parallel_mode
    size_flag = typed.get("sequence_parallel_size", f"--sequence_parallel_size {sp}")
    ranks = f"{source} starts {world}" if source else f"this run has {world}"
    if sp > 1 and (world <= 1 or world % sp):
        raise FastDPOError(
            f"{size_flag} asks for groups of {sp} ranks that share each pair's tokens, and {ranks} process"
            f"{'es' if world != 1 else ''}, which {sp} does not divide. Launch with NPROC_PER_NODE={sp} (or a multiple: "
            f"the data is then dealt over world / {sp} groups), or give {size_flag.split()[0]} a divisor of {world}.")
    heads = _heads(cfg.model) if sp > 1 and mode == "ulysses" else None
    if heads and heads % sp:
        mode_flag = typed.get("sequence_parallel_mode", "--sequence_parallel_mode ulysses")
        also = "" if mode_flag.split()[0] == size_flag.split()[0] else f" with {mode_flag}"
        raise FastDPOError(
            f"{size_flag}{also} splits the {heads} attention heads of {cfg.model} over {sp} ranks, which does not "
            f"divide them. Use a number of ranks that divides {heads}, or ring attention (ms-swift: --ring_attn "
            "true; fastdpo: --sequence_parallel_mode ring or auto).")
