"""Scale-out (DESIGN §8): the process group. `init_distributed(cfg)` reads torchrun's env vars, starts the group,
picks DDP or FSDP2 (the plan in `config.parallel`) and quiets the logs of ranks other than 0; `Dist` describes the
result to the rest (rank, world, mode). The wrapping is in `wrap`, the collectives in `collectives`, the rank split
in `split`, and `parallelize` composes them with checkpointing and compile."""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch

from fastdpo.config import ParallelSection
from fastdpo.config.parallel import parallel_plan
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
    # sequence parallelism: ranks [g*sp_size, (g+1)*sp_size) share each micro-batch's tokens (group g); the data is
    # dealt over the world_size / sp_size groups (`parallel.sequence`)
    sp_size: int = 1
    sp_group: object = None  # this rank's group (a torch.distributed ProcessGroup) when sp_size > 1
    sp_mode: str = ""  # ulysses | ring, resolved from the model's heads (`sequence.resolve_mode`)

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp_size

    @property
    def dp_rank(self) -> int:
        """The data-parallel group this rank belongs to: which share of a step's pairs it runs."""
        return self.rank // self.sp_size

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size

    @property
    def sp_ranks(self) -> list[int]:
        """The global ranks of this rank's sequence-parallel group, in order."""
        return list(range(self.dp_rank * self.sp_size, (self.dp_rank + 1) * self.sp_size))

    @property
    def speaks_for_group(self) -> bool:
        """The rank whose copy of the group's numbers (metrics, beta's drift, log-probs) is counted: the first of its
        sequence-parallel group (every rank when sp_size is 1)."""
        return self.sp_rank == 0

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
    sp = getattr(cfg, "sequence_parallel_size", 1)
    check_sequence_parallel_size(sp, world)
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
    d = Dist(rank, world, local_rank, plan.mode, plan.reshard_after_forward, wide, cfg.fsdp_layers_per_unit, sp)
    if sp > 1:
        d.sp_group = sequence_groups(d)
        log.info("Sequence parallelism: %d groups of %d ranks share each micro-batch's tokens; the data is dealt "
                 "over the %d groups.", d.dp_size, sp, d.dp_size)
    return d


def check_sequence_parallel_size(sp: int, world: int) -> None:
    """--sequence_parallel_size must divide the number of processes (and a run of one process has no group)."""
    if sp > 1 and (world <= 1 or world % sp):
        raise FastDPOError(
            f"--sequence_parallel_size {sp} needs a number of processes it divides, and this run has {world}. Launch "
            f"with NPROC_PER_NODE={sp} (or a multiple: the data is then dealt over world / {sp} groups), or set "
            "--sequence_parallel_size to a divisor of the world size.")


def sequence_groups(d: Dist):
    """Create every sequence-parallel group (every rank creates each of them, in the same order, as
    torch.distributed requires) and return this rank's."""
    import torch.distributed as dist

    mine = None
    for g in range(d.dp_size):
        group = dist.new_group(ranks=list(range(g * d.sp_size, (g + 1) * d.sp_size)))
        if g == d.dp_rank:
            mine = group
    return mine


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


def heartbeat(cfg: ParallelSection, d: Dist):
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

