"""Reductions over all ranks, for the step and the loop to wire: the gradient norm and clipping (sharded or not), sums
of device tensors over the data-parallel groups, columns gathered from every group (the step-wide log-prob view the
sorting losses need), and small any/max reductions the loop decides on. Each is a no-op on one process."""

from __future__ import annotations

import math

import torch

from fastdpo.losses import StepView
from fastdpo.optim.adamw import local_shard
from fastdpo.parallel.distributed import Dist


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip by the global gradient norm (over all shards), in place; returns the norm as a plain tensor (see
    `total_grad_norm`). An update that scales the gradients as it reads them takes `clip_coef` instead (no pass of its
    own over the gradients)."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = total_grad_norm(params)
    coef = clip_coef(norm, max_norm)
    if grads and coef is not None:
        local = [local_shard(g) for g in grads]  # a DTensor scales as its local tensor does
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        for g in local:
            by_kind.setdefault((g.device, g.dtype), []).append(g)
        for (device, _), group in by_kind.items():
            torch._foreach_mul_(group, coef.to(device))
    return norm


def total_grad_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """The global gradient norm (over all shards) as a plain tensor, gradients left as they are. FSDP2's gradients
    (DTensors sharded over one mesh dimension) are summed on their local shards in float32, then with one
    all-reduce: no DTensor dispatch around each foreach op (≈ 10 ms of host time per step for Qwen3-1.7B,
    benchmarks/NOTES.md "Where time goes now"). Anything else is torch's `get_total_norm`, as `clip_grad_norm_`
    computes it (in the gradients' dtype)."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads and _sharded_on_one_mesh(grads):
        return _shard_norm(grads)
    if not grads:
        return torch.tensor(0.0)
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def clip_coef(norm: torch.Tensor, max_norm: float) -> torch.Tensor | None:
    """torch's clipping coefficient for `norm`, max_norm / (norm + 1e-6) and at most 1, on the norm's device and in its
    dtype; None when `max_norm` is infinite (no clipping)."""
    if math.isinf(max_norm):
        return None
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def _sharded_on_one_mesh(grads: list[torch.Tensor]) -> bool:
    mesh = getattr(grads[0], "device_mesh", None)
    return mesh is not None and mesh.ndim == 1 and all(
        getattr(g, "device_mesh", None) is mesh and all(p.is_shard() for p in g.placements) for g in grads)


def _shard_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The norm with its squares summed in float32 on each rank's shards, then across the mesh. Each element lives
    on one rank only, so the sum counts it once."""
    import torch.distributed as dist

    norms = torch._foreach_norm([local_shard(g) for g in grads], 2, dtype=torch.float32)
    total = torch.stack(norms).square().sum()
    dist.all_reduce(total, group=grads[0].device_mesh.get_group())
    return total.sqrt()


def sum_over_groups(t: torch.Tensor, d: Dist) -> torch.Tensor:
    """`t` summed over the data-parallel groups, in place (on the device: no host sync), and returned. The ranks of a
    sequence-parallel group hold the same values, so each group counts once."""
    if d.world_size == 1:
        return t
    import torch.distributed as dist

    if not d.speaks_for_group:
        t.zero_()
    dist.all_reduce(t)
    return t


def gather_columns(local: torch.Tensor, d: Dist) -> tuple[torch.Tensor, int]:
    """The columns of every data-parallel group's `local` (R, n_g) float32, n_g may differ (0 too), side by side in
    rank order (R, sum n_g), and the index of this rank's first column in it. The first rank of each
    sequence-parallel group speaks for it."""
    if d.world_size == 1:
        return local, 0
    import torch.distributed as dist

    device = local.device
    sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(d.world_size)]
    dist.all_gather(sizes, torch.tensor([local.shape[1]], device=device))
    sizes = [int(n) for n in sizes]
    padded = torch.zeros(local.shape[0], max(sizes), dtype=torch.float32, device=device)
    padded[:, : local.shape[1]] = local
    parts = [torch.empty_like(padded) for _ in range(d.world_size)]
    dist.all_gather(parts, padded)
    keep = range(0, d.world_size, d.sp_size)  # one copy per sequence-parallel group
    full = torch.cat([parts[r][:, : sizes[r]] for r in keep], dim=1)
    return full, sum(sizes[r] for r in keep if r < d.dp_rank * d.sp_size)


def gather_step_view(view: StepView | None, d: Dist, device: torch.device) -> tuple[StepView | None, int]:
    """The step-wide StepView over all ranks' pairs (rank order; `view` is this rank's, None without pairs), and
    the position of this rank's first pair in it. Sorting losses (aot) then rank pairs over the whole step. Under
    sequence parallelism the pairs are the data-parallel groups' (`gather_columns`)."""
    if d.world_size == 1:
        return view, 0
    names = ("policy_chosen", "policy_rejected", "ref_chosen", "ref_rejected")
    local = torch.stack([getattr(view, n) for n in names]) if view is not None else torch.zeros(4, 0, device=device)
    full, start = gather_columns(local, d)
    return StepView(*full.unbind(0)), start


def any_rank(flag: bool, d: Dist, device: torch.device) -> bool:
    """True on every rank when `flag` is true on some rank (e.g. a stop signal that reached only some processes)."""
    if d.world_size == 1:
        return flag
    import torch.distributed as dist

    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def max_over_ranks(values: list[float], d: Dist, device: torch.device) -> list[float]:
    """Each value's largest over the ranks (one all-reduce for them all)."""
    if d.world_size == 1:
        return list(values)
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()
