"""Sharded training state through `torch.distributed.checkpoint` (DCP), for the checkpoint room above: the model's
and optimizer's state dicts as they are laid out now (plain, DDP or FSDP2: each rank's shards), written and read by
DCP so that a checkpoint of N ranks loads on any number of ranks, one included; and full (unsharded) tensors put into
a model laid out over several ranks."""

from __future__ import annotations

import warnings
from pathlib import Path


def sharded_state(model, optimizer, extra_modules: dict | None) -> dict:
    """{model, optim, extra: {name: state}}: what a sharded checkpoint holds. Frozen weights (a LoRA base) are left
    out: a resume takes them from --model, so only what trains is saved."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    extra = {name: get_model_state_dict(m) for name, m in (extra_modules or {}).items()}
    return {"model": model_sd, "optim": optim_sd, "extra": extra}


def save_sharded(state: dict, path: Path) -> None:
    """Every rank writes its shards of `state` under `path` (DCP names them __RANK_N.distcp)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(path))


def load_sharded(state: dict, path: Path) -> None:
    """Fill `state` (as `sharded_state` lays it out for this run) in place from the shards under `path`."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # one process reading shards of many is what we mean
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path))


def set_sharded_state(model, optimizer, state: dict, extra_modules: dict | None) -> None:
    """Put a loaded `sharded_state` into the model, the optimizer and the extra modules."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

    # strict=False: frozen weights are absent by design; dcp.load has already failed on any trainable key missing
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))
    for name, module in (extra_modules or {}).items():
        set_model_state_dict(module, state["extra"][name])


def set_full_state(model, optimizer, weights: dict, optim: dict) -> None:
    """Put full tensors (weights by parameter name, optimizer state keyed by those names) into a model and optimizer
    laid out over several ranks: each rank keeps its shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict=optim,
                   options=StateDictOptions(full_state_dict=True, strict=False))


def set_full_module_state(module, state: dict) -> None:
    """Put a module's full state dict into it as it is laid out over the ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True, strict=False))
