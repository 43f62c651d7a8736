"""The launch environment as configuration: how many ranks a job has, from torchrun's or ms-swift's env vars."""

from __future__ import annotations

import os

from fastdpo.errors import FastDPOError


def wants_launch(env: dict | None = None) -> bool:
    """NPROC_PER_NODE asks for workers and this process is not already one of them."""
    env = os.environ if env is None else env
    return bool(env.get("NPROC_PER_NODE")) and "LOCAL_RANK" not in env


def _env_int(env: dict, name: str, default: int | None = None, low: int = 0) -> int:
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
        return _env_int(env, "WORLD_SIZE", low=1)
    if env.get("NPROC_PER_NODE"):
        return _env_int(env, "NPROC_PER_NODE", low=1) * _env_int(env, "NNODES", 1, low=1)
    return 1
