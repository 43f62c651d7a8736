"""Scale-out (DESIGN §8): torchrun ranks, DDP or FSDP2, rank-aware micro-batches, reduced metrics.

The loop stays the single-process loop; it asks this module for a few things:
- `init_distributed(cfg)`: read torchrun's env vars, start the process group, pick DDP or FSDP2 (`--fsdp`,
  `--deepspeed` aliases), quiet the logs of ranks other than 0.
- `wrap_models(...)`: the policy's completion log-prob forward as one module (so DDP/FSDP2 hooks see the whole
  computation), wrapped in DDP or sharded with `fully_shard` per unit of decoder layers (`unit_sizes`); the
  reference likewise.
- `rank_micro_batches(...)`: this rank's share of a step's pairs (equal counts, balanced tokens), cut into as many
  micro-batches as every other rank has, so the collectives of the micro-steps line up.
- `grad_sync(...)`: DDP `no_sync` / FSDP2 deferred reduce on all but the last micro-step.
- `reduce_metrics`, `clip_grad_norm`, `full_state_dict`: the step's numbers over all ranks.

Gradients are *summed* across ranks (not averaged): every rank divides its loss by the pairs of the whole step, so
the sum is the gradient of the global mean, exactly as one process with all pairs would compute it.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import inspect
import logging
import math
import os
from dataclasses import dataclass

import torch

from fastdpo.config.parallel import parallel_plan
from fastdpo.data.pack import split_micro_batches
from fastdpo.data.tokenize import TokenizedPair
from fastdpo.errors import FastDPOError

log = logging.getLogger("fastdpo")

# ---------------------------------------------------------------- process group


@dataclass
class Dist:
    """This process's place in the job. A plain run is rank 0 of 1 with mode `single`."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    mode: str = "single"  # single | ddp | fsdp
    reshard_after_forward: bool = True
    sum_in_fp32: bool = True  # bfloat16/float16 gradients summed across ranks in float32 (else in their own dtype)
    layers_per_unit: int = 0  # FSDP2: most decoder layers per unit (0: by their size, `unit_sizes`)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def keeps_gathered(self) -> bool:
        """FSDP2 shard_grad_op (ZeRO-2): weights stay gathered through all micro-steps of an optimizer step."""
        return self.mode == "fsdp" and not self.reshard_after_forward

    @property
    def sharded(self) -> bool:
        """Checkpoints go through torch.distributed.checkpoint (one shard file per rank)."""
        return self.world_size > 1


def init_distributed(cfg, timeout_s: float | None = None) -> Dist:
    """Join the torchrun job described by the env vars (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), or
    return a single-process Dist when not launched by torchrun (or launched with one process)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    plan = parallel_plan(cfg.fsdp, cfg.deepspeed, cfg)
    if world <= 1:
        if cfg.fsdp or cfg.deepspeed:
            log.info("One process: --fsdp/--deepspeed have no effect (launch with torchrun or NPROC_PER_NODE).")
        return Dist()
    import torch.distributed as dist

    if "RANK" not in os.environ:
        raise FastDPOError(f"WORLD_SIZE={world} is set but RANK is not. Launch with torchrun (or NPROC_PER_NODE=N "
                           "fastdpo train ...), which sets both.")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = cfg.device != "cpu" and torch.cuda.is_available()
    if use_cuda:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if local_world > torch.cuda.device_count():
            raise FastDPOError(
                f"{local_world} processes per node but only {torch.cuda.device_count()} GPUs are visible "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}). Set NPROC_PER_NODE / "
                "--nproc_per_node to the number of visible GPUs."
            )
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        kw = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
        dist.init_process_group("cpu:gloo,cuda:nccl" if use_cuda else "gloo", **kw)
    if rank != 0:
        log.setLevel(logging.ERROR)  # rank 0 speaks for the job
    for note in plan.notes:
        log.info("Parallelism over %d ranks: %s.", world, note)
    wide = sums_in_fp32(cfg.reduce_dtype, world)
    if not wide:
        log.info("Gradients summed across %d ranks in their own dtype%s.", world,
                 " (the same bits as a float32 sum on two ranks)" if world == 2 else " (--reduce_dtype bfloat16)")
    return Dist(rank, world, local_rank, plan.mode, plan.reshard_after_forward, wide, cfg.fsdp_layers_per_unit)


def sums_in_fp32(reduce_dtype: str, world: int) -> bool:
    """Whether low-precision gradients are widened to float32 for the sum across ranks. On two ranks a sum in their
    own dtype rounds the exact a + b once, as the float32 sum cast back does (a float32 sum of two bfloat16 values is
    exact, or off by less than a bfloat16 rounding can see): the same bits at half the traffic. On more ranks the
    partial sums would be rounded at each hop, so `auto` widens there."""
    return reduce_dtype == "float32" or (reduce_dtype == "auto" and world > 2)


class _NoHeartbeat:
    def beat(self, step: int, phase: str) -> None:
        pass

    def start(self) -> _NoHeartbeat:
        return self

    def stop(self) -> None:
        pass


def heartbeat(cfg, d: Dist):
    """The cross-rank heartbeat of heartbeat.py (stall after min(300 s, --ddp_timeout / 3)); a no-op on one process."""
    if d.world_size == 1:
        return _NoHeartbeat()
    from fastdpo.parallel.heartbeat import Heartbeat

    return Heartbeat.for_process_group(ddp_timeout=cfg.ddp_timeout)


def shutdown(d: Dist) -> None:
    if d.world_size > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def barrier(d: Dist) -> None:
    if d.world_size > 1:
        import torch.distributed as dist

        dist.barrier()


# ---------------------------------------------------------------- models


class LogpsModule(torch.nn.Module):
    """`completion_logps` as one module forward: DDP and FSDP2 attach their hooks to module calls, and our forward
    runs the decoder and then reads the output head's weight directly (chunked log-probs), so the whole
    computation must sit inside one call. Parameters are the wrapped model's (FQNs gain a `model.` prefix).
    Returns a tuple (the wrappers find tensors in tuples, not in our dataclass); `policy_logps` rebuilds SeqLogps.
    `reference` runs the LoRA reference on this same module without grad: `adapter_off` or `ref_adapter`."""

    def __init__(self, model: torch.nn.Module, backend):
        super().__init__()
        self.model = model
        self.backend = backend

    def forward(self, batch, mask, wpo: bool = False, reference: str = ""):
        from fastdpo.dpo.reference import REF_ADAPTER, active_adapter
        from fastdpo.model.seqlogps import completion_logps

        if not reference:
            out = completion_logps(self.model, batch, self.backend, mask, wpo)
        else:
            off = reference == "adapter_off"
            with torch.no_grad(), (self.model.disable_adapter() if off else active_adapter(self.model, REF_ADAPTER)):
                out = completion_logps(self.model, batch, self.backend, mask, wpo)
        return out.sums, out.shared, out.wpo


def policy_logps(module: torch.nn.Module, batch, mask, wpo: bool = False, reference: str = ""):
    """SeqLogps of a batch through a LogpsModule, plain or wrapped in DDP / FSDP2."""
    from fastdpo.model.seqlogps import SeqLogps

    return SeqLogps(*module(batch, mask, wpo, reference))


def _sum_across_ranks(widen: bool, bucket):
    """DDP comm hook: sum (not average) the gradient bucket across ranks; a bfloat16/float16 bucket in a float32 copy
    when `widen` (`Dist.sum_in_fp32`), else in place."""
    import torch.distributed as dist

    buf = bucket.buffer()
    wide = buf.float() if widen and buf.dtype != torch.float32 else buf
    fut = dist.all_reduce(wide, async_op=True).get_future()

    def done(f):
        if wide is not buf:
            buf.copy_(f.value()[0])
        return buf

    return fut.then(done)


UNIT_MIB = 768  # auto FSDP2 units: consecutive decoder layers up to this many MiB of weights each


def unit_sizes(layers, requested: int = 0) -> list[int]:
    """Decoder layers per FSDP2 unit, in order: units of at most `requested` layers (--fsdp_layers_per_unit), or
    with 0 of at most UNIT_MIB of weights (at least one layer), as few units as that allows and of equal size within
    one layer (28 layers of 96 MiB: four units of 7, not 8, 8, 8, 4). A unit's hooks run on the host once per forward
    and backward whatever its size, and at small micro-batches the ranks wait on those hooks (benchmarks/NOTES.md
    entries 19, 20, 25); under full_shard a larger unit holds more gathered weights at once (the unit computing and
    the one prefetched)."""
    if not len(layers):
        return []
    most = requested or (UNIT_MIB << 20) // max(sum(p.numel() * p.element_size() for p in layers[0].parameters()), 1)
    units = -(-len(layers) // max(most, 1))
    return [len(layers) // units + (i < len(layers) % units) for i in range(units)]


def _shard(module: LogpsModule, d: Dist, reshard: bool, training: bool = True) -> list[int]:
    """FSDP2: one unit per `unit_sizes` consecutive decoder layers plus the root (embeddings, final norm, head);
    gradients summed (not averaged) in float32 or in their own dtype (`Dist.sum_in_fp32`). A unit's weights are
    gathered and its gradients reduced together, and its hooks run once per forward and backward. With `reshard`
    (full_shard) and `training`, the last decoder unit and the root stay gathered from their forward into the
    backward that starts right after it (otherwise both are freed and gathered again at once, the root's gather
    exposed); a forward-only module (the reference) frees every unit after its forward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    from fastdpo.model.memory import decoder_layers

    device_type = "cuda" if next(module.parameters()).is_cuda else "cpu"
    mesh = init_device_mesh(device_type, (d.world_size,))
    mp = MixedPrecisionPolicy(reduce_dtype=torch.float32 if d.sum_in_fp32 else None)
    layers = decoder_layers(module.model)
    start, sizes = 0, unit_sizes(layers, d.layers_per_unit)
    units = []  # in forward order
    for i, size in enumerate(sizes):
        unit, start = layers[start : start + size], start + size
        keep = training and i == len(sizes) - 1
        sharded = fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh,
                              reshard_after_forward=reshard and not keep, mp_policy=mp)
        units.append(sharded[0] if isinstance(sharded, list) else sharded)  # a list shares one state
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard and not training, mp_policy=mp)
    # each forward gathers the next unit as it opens (the root: the first unit), so that gather runs under this unit's
    # compute even when the host is behind the device; left to the next unit's own hook, it is issued only when the
    # host reaches that unit, and the device waits on it. A no-op for a unit already gathered.
    for unit, after in zip([module, *units], units):
        unit.set_modules_to_forward_prefetch([after])
    # full_shard: the root and the first unit open every forward; between a step's micro-batches (grad_sync) they
    # stay gathered instead of being freed by one backward and gathered again, exposed, by the next forward. No peak
    # is added: nothing else is held at a micro-batch boundary, and both are gathered again right after it.
    module._fastdpo_boundary_units = (module, *units[:1]) if reshard and training else ()
    for m in module.modules():
        if isinstance(m, FSDPModule):
            if hasattr(m, "set_gradient_divide_factor"):  # torch >= 2.8
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
            else:  # torch 2.6 / 2.7: the same setting under its earlier name
                m.set_reduce_scatter_divide_factor(1.0)
    return sizes


def wrap_models(model: torch.nn.Module, reference, backend, d: Dist) -> torch.nn.Module:
    """The policy forward module for the loop (plain, DDP or FSDP2). Under FSDP2 the reference is sharded too and
    `reference.runner` is set so its forward goes through the sharded module."""
    policy = LogpsModule(model, backend)
    if d.mode == "single":
        return policy
    if d.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        on_cuda = next(model.parameters()).is_cuda
        # buffers (rotary tables) are equal on every rank: no sync before each forward (torch >= 2.13 calls this
        # forward_sync_buffers and warns on the old name); gradients are views into the reduction buckets, so the
        # reducer does not keep a second copy of them
        sync = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters \
            else "broadcast_buffers"
        policy = DDP(policy, device_ids=[d.local_rank] if on_cuda else None, gradient_as_bucket_view=True,
                     **{sync: False})
        policy.register_comm_hook(d.sum_in_fp32, _sum_across_ranks)
        return policy
    sizes = _shard(policy, d, d.reshard_after_forward)
    log.info("FSDP2 units: %d of %s decoder layers, and the root (--fsdp_layers_per_unit).", len(sizes),
             "/".join(map(str, sorted(set(sizes), reverse=True))))
    _accumulate_in_param_dtype(policy)
    if reference.strategy in ("copy", "separate"):
        ref = LogpsModule(reference.model, backend)
        _shard(ref, d, reshard=True, training=False)
        reference.runner = functools.partial(policy_logps, ref)
    elif reference.strategy in ("adapter_off", "ref_adapter"):
        reference.runner = functools.partial(policy_logps, policy, reference=reference.strategy)
    return policy


@contextlib.contextmanager
def grad_sync(policy: torch.nn.Module, last: bool, keep_gathered: bool = False):
    """Reduce gradients across ranks only on the last micro-step of an optimizer step. With `keep_gathered` (FSDP2
    shard_grad_op, i.e. ZeRO-2), the weights gathered by the step's first forward also stay gathered after the
    backwards of its other micro-steps: one all-gather per optimizer step instead of one per micro-batch, at no extra
    peak memory (shard_grad_op holds every layer's gathered weights between forward and backward anyway). FSDP2's
    deferred gradients accumulate in the parameters' dtype, like DDP's and one process's (`_accumulate_in_param_dtype`).
    Under full_shard the root and the first decoder unit stay gathered between micro-steps (`_shard`)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel as DDP

    if isinstance(policy, DDP) and not last:
        with policy.no_sync():
            yield
        return
    if isinstance(policy, FSDPModule):
        policy.set_requires_gradient_sync(last)
        if keep_gathered:
            policy.set_reshard_after_backward(last)
        for unit in getattr(policy, "_fastdpo_boundary_units", ()):  # full_shard (`_shard`)
            unit.set_reshard_after_backward(last, recurse=False)
    yield


def gather_step_start(policy: torch.nn.Module) -> list:
    """full_shard: start gathering the root and the first decoder unit, which every step's first forward opens with
    and which the step's last backward sharded for the optimizer. Called right after the update is queued (the
    gathers read the updated shards: FSDP2 orders them after it) when another step follows: the gathers run under the
    host's work between steps (the flag read, logging, a checkpoint or an evaluation, packing the next micro-batches)
    instead of, exposed, in the next forward, whose pre-forward hooks wait on them. Not before the first forward,
    where FSDP2 sets up its streams. Returns the handles (none for other modes). No peak is added: nothing else is
    held between steps, and the next forward gathers both at once anyway."""
    return [unit.unshard(async_op=True) for unit in getattr(policy, "_fastdpo_boundary_units", ())]


def _accumulate_in_param_dtype(module: torch.nn.Module) -> None:
    """Deferred FSDP2 micro-steps accumulate their unsharded gradients in the parameters' dtype, as one process and
    DDP do; the reduction on the last micro-step runs in the reduce dtype (float32 unless `Dist.sum_in_fp32` is off).
    Left alone, FSDP2 copies each gradient to the reduce dtype after every deferred backward and adds there: a cast
    and a float32 add per parameter and micro-step, and a float32 copy of the whole model's gradients held through
    the step. The per-parameter reduce dtype (read only by that copy) is cleared; the groups', which the
    reduce-scatter uses, stays. FSDP2 sets both at its lazy initialisation, which the first forward would run: it runs
    here instead, once. On a torch whose FSDP2 keeps these elsewhere, nothing changes (float32 accumulation, slower)."""
    init = getattr(getattr(module, "_get_fsdp_state", lambda: None)(), "_lazy_init", None)
    if init is None:
        return
    init()
    states = {id(st): st for m in module.modules() if (st := getattr(m, "_get_fsdp_state", lambda: None)())}
    for state in states.values():  # a unit of several layers has one state
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # earlier torch: one group per module
            groups = [getattr(state, "_fsdp_param_group", None)]
        for group in groups:
            for fp in getattr(group, "fsdp_params", ()):
                if getattr(fp, "reduce_dtype", None) is not None:
                    fp.reduce_dtype = None


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


# ---------------------------------------------------------------- data


def split_ranks(pairs: list[TokenizedPair], world: int) -> list[list[TokenizedPair]]:
    """Deal one optimizer step's pairs to ranks: pair counts differ by at most one (equal when the step divides
    evenly), tokens balanced by giving each pair, longest first, to the rank with the fewest tokens and room left."""
    if world == 1:
        return [list(pairs)]
    n = len(pairs)
    room = [n // world + (1 if r < n % world else 0) for r in range(world)]
    shares: list[list[TokenizedPair]] = [[] for _ in range(world)]
    load = [0] * world
    for p in sorted(pairs, key=lambda p: -p.num_tokens):
        r = min((r for r in range(world) if room[r]), key=lambda r: (load[r], r))
        shares[r].append(p)
        load[r] += p.num_tokens
        room[r] -= 1
    return shares


def rank_micro_batches(pairs: list[TokenizedPair], rank: int, world: int, max_tokens: int,
                       pairs_per_micro: int) -> list[list[TokenizedPair]]:
    """This rank's micro-batches of one step. Every rank computes every rank's plan (same seed, same pairs), so all
    agree without communicating on the number of micro-steps: a rank with fewer splits its largest micro-batches;
    one with fewer pairs than micro-steps gets empty micro-batches, which the loop runs as zero-weight forwards."""
    plans = [split_micro_batches(share, max_tokens, pairs_per_micro) for share in split_ranks(pairs, world)]
    count = max(len(p) for p in plans)
    mine = plans[rank]
    while len(mine) < count:
        i = max(range(len(mine)), key=lambda j: len(mine[j]), default=-1)
        if i < 0 or len(mine[i]) < 2:
            mine.append([])
            continue
        group = mine.pop(i)
        mine[i:i] = [group[: len(group) // 2], group[len(group) // 2 :]]
    return mine


# ---------------------------------------------------------------- metrics and final weights


def reduce_metrics(metrics, d: Dist, pairs: int, tokens: int) -> None:
    """Sum a StepMetrics' per-pair sums over all ranks (in place, on the device: no host sync), before `finish`.
    The step's pair and token counts over all ranks, `pairs` and `tokens`, are known on every rank from the
    step's pairs."""
    if d.world_size == 1:
        return
    import torch.distributed as dist

    dist.all_reduce(metrics.sums)
    metrics.pairs, metrics.tokens = pairs, tokens


def reduce_beta_drift(beta, d: Dist) -> None:
    """kl_adaptive beta: sum the step's drift and token count over all ranks before the schedule closes the step, so
    every rank (and a run on one rank) sets the same next beta."""
    if d.world_size == 1 or not beta.adaptive:
        return
    import torch.distributed as dist

    both = torch.stack([beta._drift, beta._tokens])
    dist.all_reduce(both)
    beta._drift.copy_(both[0])
    beta._tokens.copy_(both[1])


def gather_step_view(view, d: Dist, device: torch.device):
    """The step-wide StepView over all ranks' pairs (rank order; `view` is this rank's, None without pairs), and
    the position of this rank's first pair in it. Sorting losses (aot) then rank pairs over the whole step."""
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
    full = torch.cat([p[:, :n] for p, n in zip(parts, sizes)], dim=1)
    return StepView(*full.unbind(0)), sum(sizes[: d.rank])


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


def full_state_dict(model: torch.nn.Module, d: Dist) -> dict | None:
    """Under FSDP2, gather the full weights onto rank 0's CPU (every rank must call); otherwise None (the model's
    own parameters are whole)."""
    if d.mode != "fsdp":
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    lora = hasattr(model, "peft_config")  # only the adapters are saved: do not gather the frozen base
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=lora)
    full = get_model_state_dict(model, options=options)
    # tied weights (embeddings = output head) arrive as separate copies: share them again so save_pretrained
    # recognises the tie and writes the usual single tensor
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for group in names.values():
        present = [n for n in group if n in full]
        for n in present[1:]:
            full[n] = full[present[0]]
    return full
