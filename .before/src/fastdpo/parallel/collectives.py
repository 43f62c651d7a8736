"""The step's numbers over all ranks: the gradient norm and clipping (sharded or not), the summed metrics, beta's
drift, the step-wide log-prob view the sorting losses need, and small any/max reductions the loop decides on."""

from __future__ import annotations

import math

import torch

from fastdpo.parallel.distributed import Dist


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip by the global gradient norm (over all shards); returns it as a plain tensor. FSDP2's gradients (DTensors
    sharded over one mesh dimension) are clipped on their local shards: one all-reduce of the summed squares, no
    DTensor dispatch around each foreach op (≈ 10 ms of host time per step for Qwen3-1.7B, benchmarks/NOTES.md
    "Where time goes now"); anything else goes through torch's `clip_grad_norm_`."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads and _sharded_on_one_mesh(grads):
        return _clip_shards(grads, max_norm)
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def _sharded_on_one_mesh(grads: list[torch.Tensor]) -> bool:
    mesh = getattr(grads[0], "device_mesh", None)
    return mesh is not None and mesh.ndim == 1 and all(
        getattr(g, "device_mesh", None) is mesh and all(p.is_shard() for p in g.placements) for g in grads)


def _clip_shards(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch's clipping (coefficient max_norm / (norm + 1e-6), at most 1) with the norm's squares summed in float32
    on each rank's shards, then across the mesh. Each element lives on one rank only, so the sum counts it once."""
    import torch.distributed as dist

    from fastdpo.optim.adamw import local_shard

    local = [local_shard(g) for g in grads]
    norms = torch._foreach_norm(local, 2, dtype=torch.float32)
    total = torch.stack(norms).square().sum()
    dist.all_reduce(total, group=grads[0].device_mesh.get_group())
    norm = total.sqrt()
    if not math.isinf(max_norm):
        torch._foreach_mul_(local, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


def reduce_metrics(metrics, d: Dist, pairs: int, tokens: int) -> None:
    """Sum a StepMetrics' per-pair sums over all ranks (in place, on the device: no host sync), before `finish`.
    The step's pair and token counts over all ranks, `pairs` and `tokens`, are known on every rank from the
    step's pairs."""
    if d.world_size == 1:
        return
    import torch.distributed as dist

    if not d.speaks_for_group:  # the ranks of a sequence-parallel group hold the same sums: count them once
        metrics.sums.zero_()
    dist.all_reduce(metrics.sums)
    metrics.pairs, metrics.tokens = pairs, tokens


def reduce_beta_drift(beta, d: Dist) -> None:
    """kl_adaptive beta: sum the step's drift and token count over all ranks before the schedule closes the step, so
    every rank (and a run on one rank) sets the same next beta."""
    if d.world_size == 1 or not beta.adaptive:
        return
    import torch.distributed as dist

    both = torch.stack([beta._drift, beta._tokens])
    if not d.speaks_for_group:  # counted once per sequence-parallel group
        both.zero_()
    dist.all_reduce(both)
    beta._drift.copy_(both[0])
    beta._tokens.copy_(both[1])


def gather_step_view(view, d: Dist, device: torch.device):
    """The step-wide StepView over all ranks' pairs (rank order; `view` is this rank's, None without pairs), and
    the position of this rank's first pair in it. Sorting losses (aot) then rank pairs over the whole step. Under
    sequence parallelism the pairs are the data-parallel groups' (the first rank of each group speaks for it)."""
    if d.world_size == 1:
        return view, 0
    import torch.distributed as dist

    from fastdpo.dpo.losses import StepView

    names = ("policy_chosen", "policy_rejected", "ref_chosen", "ref_rejected")
    local = torch.stack([getattr(view, n) for n in names]) if view is not None else torch.zeros(4, 0, device=device)
    sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(d.world_size)]
    dist.all_gather(sizes, torch.tensor([local.shape[1]], device=device))
    sizes = [int(n) for n in sizes]
    padded = torch.zeros(4, max(sizes), dtype=torch.float32, device=device)
    padded[:, : local.shape[1]] = local
    parts = [torch.empty_like(padded) for _ in range(d.world_size)]
    dist.all_gather(parts, padded)
    keep = range(0, d.world_size, d.sp_size)  # one copy per sequence-parallel group
    full = torch.cat([parts[r][:, : sizes[r]] for r in keep], dim=1)
    return StepView(*full.unbind(0)), sum(sizes[r] for r in keep if r < d.dp_rank * d.sp_size)


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
