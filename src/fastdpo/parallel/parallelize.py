"""The memory and speed layers of a model, composed in one readable order (the order torchtitan uses):

1. activation checkpointing of the decoder layers (`--gradient_checkpointing`),
2. torch.compile of each decoder layer (`--torch_compile`),
3. the policy's log-prob forward as one module, wrapped in DDP or sharded with FSDP2 (`--fsdp` / `--deepspeed`).

Checkpointing wraps a layer before it is compiled, so the recomputation is compiled too; sharding comes last, so
FSDP2's units are the (checkpointed, compiled) layers the forward runs."""

from __future__ import annotations

import logging

import torch

from fastdpo.config import TrainConfig
from fastdpo.model.memory import apply_checkpointing, compile_layers
from fastdpo.observe.envinfo import as_assignments, compile_vars
from fastdpo.parallel.distributed import Dist
from fastdpo.parallel.wrap import wrap_models

log = logging.getLogger("fastdpo")


def parallelize(model: torch.nn.Module, reference, backend, cfg: TrainConfig, d: Dist,
                checkpointing: str) -> torch.nn.Module:
    """Apply the layers above to `model` (in place) and return the module the loop calls for the policy's
    log-probs (the model itself on one process without sharding). `checkpointing`: the policy the run's plan
    resolved."""
    apply_checkpointing(model, checkpointing, reentrant=d.world_size == 1)  # no DDP/FSDP2 hooks to follow
    if cfg.torch_compile:
        compile_layers(model, lengths=cfg.length_buckets, dynamic=backend.name == "varlen")
        settings = compile_vars()  # they change compile time and speed (e.g. TORCHINDUCTOR_CPP_WRAPPER=1): say so
        if settings:
            log.info("torch.compile settings from the environment: %s", as_assignments(settings))
    model.train()
    return wrap_models(model, reference, backend, d)
