"""Collectives over picklable Python objects (decisions, digests, small tables), for the modules above `parallel/`
that must agree across ranks without touching `torch.distributed` themselves. Each is a no-op on one process."""

from __future__ import annotations

from typing import Any

from fastdpo.parallel.distributed import Dist


def broadcast_object(obj: Any, d: Dist, src: int = 0) -> Any:
    """Rank `src`'s `obj` on every rank (the others' `obj` is ignored)."""
    if d.world_size == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj: Any, d: Dist) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank."""
    if d.world_size == 1:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * d.world_size
    dist.all_gather_object(out, obj)
    return out


def all_ranks(flag: bool, d: Dist) -> bool:
    """Whether `flag` holds on every rank (host-side: for decisions taken before any device work)."""
    return all(gather_objects(bool(flag), d))
