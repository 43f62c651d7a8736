"""The parallelism section: data parallelism (DDP, FSDP2 or its DeepSpeed names), how gradients are reduced, and
sequence parallelism."""

from __future__ import annotations

from dataclasses import dataclass

from fastdpo.config.fields import Section, at_least, check_choice, option


@dataclass
class ParallelSection(Section):
    """How the ranks of a launch share the work (under torchrun or NPROC_PER_NODE)."""

    name = "parallel"
    title = "Parallelism"

    fsdp: str = option("", "full_shard|shard_grad_op: FSDP2 sharding; no_shard: DDP. Empty: DDP.")
    deepspeed: str = option("", "zero3 (= --fsdp full_shard), zero2 (= shard_grad_op), or a DeepSpeed JSON: its ZeRO "
                            "stage maps onto FSDP2, the rest is checked or reported.")
    reduce_dtype: str = option("auto", "Dtype in which bfloat16/float16 gradients are summed across ranks: float32, "
                               "bfloat16 (their own dtype; faster, inexact beyond two ranks), or auto: their own dtype "
                               "on two ranks (the same bits as a float32 sum), float32 on more. float32 gradients are "
                               "always summed in float32.")
    fsdp_layers_per_unit: int = option(0, "Most consecutive decoder layers sharded as one FSDP2 unit (gathered, reduced "
                                       "and hooked once per forward and backward); units are as few as that allows and "
                                       "equal within one layer. 0: up to 768 MiB of weights per unit.")
    sequence_parallel_size: int = option(1, "Ranks that share each micro-batch's tokens (sequence parallelism, for pairs "
                                         "too long for one GPU's activations): the world is this many ranks per group "
                                         "times the data-parallel groups. 1: off.")
    sequence_parallel_mode: str = option("auto", "auto|ulysses|ring: how attention crosses the ranks of a group. ulysses: "
                                         "all-to-all of heads (needs query heads divisible by the size); ring: key/value "
                                         "chunks passed around the group. auto: ulysses where the heads allow, else ring.")
    ddp_timeout: int = option(1800, "Seconds a distributed collective may wait before the run fails (torch.distributed "
                              "timeout); the heartbeat names a stalled rank well before that.")

    def validate_parallel(self) -> None:
        check_choice("reduce_dtype", self.reduce_dtype, ("auto", "float32", "bfloat16"))
        at_least(self, 0, "fsdp_layers_per_unit", hint=" (0: auto)")
        check_choice("sequence_parallel_mode", self.sequence_parallel_mode, ("auto", "ulysses", "ring"))
        at_least(self, 1, "sequence_parallel_size", hint=" (1: off)")
        at_least(self, 1, "ddp_timeout", hint=" second")
