"""Flags accepted under their HF / TRL / ms-swift names that do nothing in the configuration given: always so here
(fastdpo always packs), or only together with another flag that is not set. Each one the user sets gets a one-line
note, so a copied script never loses a setting without saying so."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastdpo.config.launch import world_size
from fastdpo.errors import FastDPOError

log = logging.getLogger("fastdpo")

NO_EFFECT = "the flag has no effect"
# the losses that read --label_smoothing (`fastdpo.losses`)
SMOOTHED = ("sigmoid", "robust", "exo_pair", "aot", "aot_unpaired", "simpo", "cpo")


def _losses(c) -> set[str]:
    return {name for name, _ in c.loss_terms()}


def _targets(c) -> list[str]:
    from fastdpo.config.sections.monitoring import report_targets

    return report_targets(c.report_to)


def _held_out(c) -> bool:
    return bool(c.val_dataset) or c.split_dataset_ratio > 0


def _only_with(what: str) -> str:
    return f"only {what} reads it; {NO_EFFECT}"


def _loss_param(loss: str) -> Callable[[Any], str | None]:
    return lambda c: None if loss in _losses(c) else _only_with(f"--loss_type {loss}")


def _cpo_alpha(c) -> str | None:
    if "cpo" in _losses(c) or (c.rpo_alpha and c.rpo_alpha == c.cpo_alpha):  # ms-swift's SimPO: its NLL weight
        return None
    return _only_with("--loss_type cpo")


# field -> the note when the field's value does nothing in this configuration (None: it acts)
NOOPS: dict[str, Callable[[Any], str | None]] = {
    "padding_free": lambda c: "fastdpo always packs without padding; nothing to do" if c.padding_free else None,
    "dataloader_num_workers": lambda c: None if c.streaming or not c.dataloader_num_workers else (
        "tokenisation happens before training and batches are built in-process; the flag has no effect (with "
        "--streaming it sets the processes that tokenise ahead; --dataset_num_proc tokenises in parallel)"),
    "dataset_num_proc": lambda c: None if not c.streaming or c.dataset_num_proc <= 1 else (
        f"--streaming tokenises in --dataloader_num_workers processes; {NO_EFFECT}"),
    "shuffle_buffer_size": lambda c: None if c.streaming else (
        f"pairs in memory are shuffled whole each epoch; only --streaming shuffles through a buffer; {NO_EFFECT}"),
    "dataloader_drop_last": lambda c: (f"a stream has no last step to drop (--streaming); {NO_EFFECT}"
                                       if c.streaming and c.dataloader_drop_last else None),
    "dataset_cache_dir": lambda c: None if c.load_from_cache_file else (
        f"--load_from_cache_file false caches nothing; {NO_EFFECT}"),
    "quant_bits": lambda c: None if c.train_type == "qlora" or (c.fp8_base and c.quant_bits == 8) else _only_with(
        "--train_type qlora"),  # ms-swift's FP8 base is --quant_method fp8 --quant_bits 8
    "num_train_epochs": lambda c: None if c.max_steps <= 0 else f"--max_steps {c.max_steps} sets the length; {NO_EFFECT}",
    "warmup_ratio": lambda c: None if c.warmup_steps <= 0 else f"--warmup_steps {c.warmup_steps} wins; {NO_EFFECT}",
    "lr_scheduler_kwargs": lambda c: None if not c.lr_scheduler_kwargs or "cosine" in c.lr_scheduler_type else (
        f"--lr_scheduler_type {c.lr_scheduler_type} takes no arguments; {NO_EFFECT}"),
    "label_smoothing": lambda c: None if not c.label_smoothing or _losses(c) & set(SMOOTHED) else (
        f"only the losses {', '.join(SMOOTHED)} smooth their labels; {NO_EFFECT}"),
    "f_alpha_divergence_coef": lambda c: (None if c.f_divergence_type == "alpha_divergence"
                                          else _only_with("--f_divergence_type alpha_divergence")),
    "discopop_tau": _loss_param("discopop"),
    "simpo_gamma": _loss_param("simpo"),
    "orpo_alpha": _loss_param("orpo"),
    "cpo_alpha": _cpo_alpha,
    **{name: (lambda c: None if c.beta_schedule == "kl_adaptive" else _only_with("--beta_schedule kl_adaptive"))
       for name in ("beta_kl_target", "beta_kl_window", "beta_min_ratio")},
    **{name: (lambda c: None if c.needs_reference() else f"the loss is reference-free; {NO_EFFECT}")
       for name in ("ref_model", "ref_adapters")},
    **{name: (lambda c: None if c.precompute_ref_log_probs else _only_with("--precompute_ref_log_probs"))
       for name in ("precompute_ref_batch_size", "ref_cache_dir")},
    **{name: (lambda c: None if c.sync_ref_model else _only_with("--sync_ref_model (TR-DPO)"))
       for name in ("ref_model_mixup_alpha", "ref_model_sync_steps")},
    "val_split": lambda c: None if c.val_dataset else _only_with("--val_dataset"),
    **{name: (lambda c: None if _held_out(c) else (
        f"there are no held-out pairs to rank checkpoints by (--val_dataset or --split_dataset_ratio); {NO_EFFECT}"))
       for name in ("metric_for_best_model", "greater_is_better")},
    "save_total_limit": lambda c: None if c.save_steps > 0 or not c.save_total_limit else (
        f"without --save_steps only the final model is saved; {NO_EFFECT}"),
    "resume_ignore_changes": lambda c: None if c.resume_from_checkpoint else _only_with("--resume_from_checkpoint"),
    "trust_unverified_checkpoint": lambda c: (None if c.resume_from_checkpoint
                                              else _only_with("--resume_from_checkpoint")),
    "start_over_if_unusable": lambda c: (None if c.resume_from_checkpoint == "latest"
                                         else _only_with("--resume_from_checkpoint latest")),
    "hub_private_repo": lambda c: None if c.push_to_hub else _only_with("--push_to_hub"),
    "logging_dir": lambda c: None if "tensorboard" in _targets(c) else _only_with("--report_to tensorboard"),
    "run_name": lambda c: None if {"wandb", "mlflow", "trackio", "swanlab"} & set(_targets(c)) else (
        _only_with("--report_to wandb, mlflow, trackio or swanlab")),
    "fsdp_layers_per_unit": lambda c: None if c.fsdp not in ("", "no_shard") or c.deepspeed else (
        _only_with("FSDP2 sharding (--fsdp full_shard|shard_grad_op)")),
    "reduce_dtype": lambda c: None if world_size() > 1 else f"one process sums no gradients across ranks; {NO_EFFECT}",
    "sequence_parallel_mode": lambda c: None if c.sequence_parallel_size > 1 else _only_with("--sequence_parallel_size > 1"),
}


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return " ".join(map(str, value))
    return str(value)


def noop_notes(cfg: Any, asked: set[str]) -> list[str]:
    """The notes of the flags in `asked` (the fields the user set) that do nothing with `cfg`."""
    notes = []
    for name, check in NOOPS.items():
        try:
            text = check(cfg) if name in asked else None
        except FastDPOError:  # a bad value of another flag: validation names it
            continue
        if text:
            notes.append(f"--{name} {_shown(getattr(cfg, name))}: {text}.")
    return notes


def log_noop_notes(cfg: Any, asked: set[str]) -> None:
    for text in noop_notes(cfg, asked):
        log.info("%s", text)
