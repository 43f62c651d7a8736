"""What a run is, recorded in every checkpoint and compared when it is resumed: the model (a content fingerprint of
--model and of the reference and adapter dirs, with the model's shape), the training data (a fingerprint of the
tokenised pairs), and, from the checkpoint's saved config, every setting but those in FREE: what changes the
objective, the optimizer's update (dtype, weight decay, Adam's betas and epsilon, clipping), what trains, or the data
and its order. A resume that differs in any of them would continue another run's optimizer state on another problem,
so it is refused with each difference named, unless --resume_ignore_changes true. Learning-rate flags may change
(the loop follows the new schedule), and so may --beta_kl_window (the beta schedule keeps the latest drifts)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import yaml

from fastdpo.checkpoint import manifest
from fastdpo.config import TrainConfig
from fastdpo.data.sources import data_files, parse_spec, source_kind
from fastdpo.data.tokenize import TokenizedPair
from fastdpo.dpo.refcache import WEIGHT_FILES, local_model_dir, tokens_fingerprint
from fastdpo.errors import FastDPOError

log = logging.getLogger("fastdpo")

MODEL_PATHS = ("model", "ref_model", "ref_adapters", "adapters")
SHAPE_KEYS = ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
              "num_key_value_heads", "vocab_size")


def _uses(*losses: str):
    return lambda c: any(n.strip() in losses for n in str(c.get("loss_type", "")).replace("[", "").replace("]", "")
                         .replace("'", "").split(","))


def _kl_adaptive(c: dict) -> bool:
    return c.get("beta_schedule") == "kl_adaptive"


def _lora(c: dict) -> bool:
    return c.get("train_type") in ("lora", "qlora")


def _always(c: dict) -> bool:
    return True


# Flags a resume may change: where and how the run reports and saves, how long it runs (max_steps and
# num_train_epochs extend it), how fast it runs (layout, kernels, memory, ranks), the evaluation, and flags checked on
# their own (learning-rate flags: followed; the step size and drop_last: loop.check_resume_step_size; model and data
# paths: by fingerprint, below; --strict: the rows it lets through are in the data's fingerprint). Any other flag,
# one added later included, is compared.
FREE = frozenset({
    "model", "ref_model", "adapters", "ref_adapters", "dataset", "trust_remote_code", "max_row_mb", "template_timeout",
    "strict",
    "dataset_num_proc", "load_from_cache_file", "dataset_cache_dir", "dataloader_num_workers", "dataloader_drop_last",
    "per_device_train_batch_size", "gradient_accumulation_steps", "max_tokens_per_batch", "padding_free", "attn_impl",
    "gradient_checkpointing", "max_memory_gib", "activation_offloading", "torch_compile", "kernels",
    "max_steps", "num_train_epochs", "learning_rate", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_ratio",
    "warmup_steps", "beta_kl_window", "precompute_ref_log_probs", "precompute_ref_batch_size", "ref_cache_dir",
    "val_dataset", "val_split", "eval_steps", "metric_for_best_model", "greater_is_better",
    "output_dir", "push_to_hub", "hub_model_id", "hub_private_repo", "logging_steps", "save_steps", "save_total_limit",
    "resume_from_checkpoint", "resume_ignore_changes", "start_over_if_unusable", "trust_unverified_checkpoint",
    "overwrite_output_dir", "device", "disable_progress", "profile_steps", "compile_warmup", "length_buckets",
    "gc_steps", "profile_memory", "report_to", "logging_dir", "run_name", "plot", "alert_patience",
    "kl_ratio_threshold", "max_nonfinite_steps", "ddp_timeout", "fsdp", "deepspeed", "reduce_dtype",
    "fsdp_layers_per_unit", "sequence_parallel_size", "sequence_parallel_mode",
})

# flag -> when it matters (a difference counts if it matters in the checkpoint's config or in this run's); a flag
# neither here nor in FREE always matters
GUARDED = {
    # the objective
    "loss_type": _always, "loss_weights": _always, "beta": _always, "beta_schedule": _always,
    "beta_kl_target": _kl_adaptive, "beta_min_ratio": _kl_adaptive, "label_smoothing": _always,
    "rpo_alpha": _always, "ld_alpha": _always, "f_divergence_type": _always,
    "f_alpha_divergence_coef": lambda c: c.get("f_divergence_type") == "alpha_divergence",
    "use_weighting": _always, "discopop_tau": _uses("discopop"), "simpo_gamma": _uses("simpo"),
    "cpo_alpha": _uses("cpo"), "orpo_alpha": _uses("orpo"), "sync_ref_model": _always,
    "ref_model_mixup_alpha": lambda c: bool(c.get("sync_ref_model")),
    "ref_model_sync_steps": lambda c: bool(c.get("sync_ref_model")),
    # what trains
    "train_type": _always, "lora_rank": _lora, "lora_alpha": _lora, "lora_dropout": _lora, "target_modules": _lora,
    "use_dora": _lora, "fp8_base": _lora,
    "quant_bits": lambda c: c.get("train_type") == "qlora",
    # the data and its order
    "seed": _always, "shuffle": _always, "streaming": _always,
    "shuffle_buffer_size": lambda c: bool(c.get("streaming")), "max_length": _always, "truncation_strategy": _always,
    "max_prompt_length": _always, "max_completion_length": _always, "split_dataset_ratio": _always,
}


# ---------------------------------------------------------------- fingerprints


def model_record(path: str) -> dict:
    """{path, fingerprint (content hash of config.json and the weight files), shape (from config.json)} of a model
    or adapter dir (a hub id: its local snapshot). The fingerprint is None when the files cannot be found."""
    record: dict = {"path": path, "fingerprint": None, "shape": {}}
    try:
        d = local_model_dir(path)
    except FastDPOError:
        return record
    files = sorted({f for pattern in WEIGHT_FILES for f in d.glob(pattern) if f.is_file()})
    if files:
        digests = manifest.file_digests(files)
        h = manifest.hasher(manifest.default_algorithm())
        for f in files:
            h.update(f"{f.name}:{digests[f]};".encode())
        record["fingerprint"] = h.hexdigest()
    try:
        config = json.loads((d / "config.json").read_text())
        record["shape"] = {k: config[k] for k in SHAPE_KEYS if k in config}
    except (OSError, ValueError):
        pass
    return record


def stream_fingerprint(specs: list[str]) -> str:
    """Of --streaming data, which is never all in memory: each spec and the content of its local files (a hub id
    by its name)."""
    h = manifest.hasher(manifest.default_algorithm())
    for text in specs:
        h.update(f"{text};".encode())
        spec = parse_spec(text)
        kind = source_kind(spec)
        p = Path(spec.name).expanduser()
        files = [p] if kind == "file" else data_files(p) if kind == "dir" else \
            manifest.files_of(p) if kind == "saved" else []
        for f, digest in manifest.file_digests(files).items():
            h.update(f"{f.name}:{digest};".encode())
    return h.hexdigest()


class RunIdentity:
    """The record of this run that each checkpoint stores under `run` in trainer_state.json; computed once, when
    first asked for (the first checkpoint, or the resume)."""

    def __init__(self, cfg: TrainConfig, pairs: list[TokenizedPair]):
        self.cfg, self.pairs = cfg, pairs
        self._record: dict | None = None

    def record(self) -> dict:
        if self._record is None:
            cfg = self.cfg
            data = stream_fingerprint(list(cfg.dataset)) if cfg.streaming else \
                tokens_fingerprint(self.pairs, cfg.max_length)
            self._record = {"model": {flag: model_record(getattr(cfg, flag)) for flag in MODEL_PATHS
                                      if getattr(cfg, flag)},
                            "data": {"dataset": list(cfg.dataset), "pairs": len(self.pairs), "fingerprint": data}}
        return self._record


# ---------------------------------------------------------------- comparing


def _plain(value):
    """A value as the saved config.yaml holds it (tuples as lists, and so on)."""
    return yaml.safe_load(yaml.safe_dump(value))


def _loss_terms(c: dict):
    try:
        return TrainConfig(loss_type=c.get("loss_type", "sigmoid"), loss_weights=c.get("loss_weights", "")).loss_terms()
    except FastDPOError:
        return (c.get("loss_type"), c.get("loss_weights"))


def _shape(record: dict) -> str:
    s = record.get("shape") or {}
    return ", ".join(f"{k} {v}" for k, v in s.items()) or "shape unknown"


def setting_changes(saved: dict, cfg: TrainConfig) -> list[str]:
    """`--flag old → new` for each setting not in FREE that differs between a checkpoint's saved config and `cfg`
    (a flag the saved config lacks, from an earlier version, is not compared)."""
    now = _plain(cfg.to_dict())
    changes = []
    if _loss_terms(saved) != _loss_terms(now):
        changes.append(f"--loss_type {saved.get('loss_type')} (weights {saved.get('loss_weights') or 'default'}) → "
                       f"{now['loss_type']} (weights {now['loss_weights'] or 'default'})")
    for name in now:
        if name in FREE or name in ("loss_type", "loss_weights") or name not in saved:
            continue
        matters = GUARDED.get(name, _always)
        if saved[name] != now[name] and (matters(saved) or matters(now)):
            changes.append(f"--{name} {saved[name]} → {now[name]}")
    return changes


def identity_changes(saved_run: dict | None, saved: dict, identity: RunIdentity) -> list[str]:
    """The model and data differences between the checkpoint's recorded run and this one. A checkpoint written
    before runs were recorded is compared by the paths in its saved config."""
    cfg = identity.cfg
    if not saved_run:
        named = [(f"--{flag}", saved.get(flag), getattr(cfg, flag)) for flag in (*MODEL_PATHS, "dataset")]
        changes = [f"{flag} {old} → {new}" for flag, old, new in named if old is not None and _plain(old) != _plain(new)]
        if changes or not saved:
            return changes
        log.info("The checkpoint records no fingerprints (written by an earlier fastdpo): its model and data are "
                 "compared by path only.")
        return []
    now = identity.record()
    changes = []
    before_models = saved_run.get("model", {})
    for flag in MODEL_PATHS:
        old, new = before_models.get(flag), now["model"].get(flag)
        if old is None and new is None:
            continue
        if old is None or new is None:
            changes.append(f"--{flag} {(old or {}).get('path', 'not set')} → {(new or {}).get('path', 'not set')}")
        elif old.get("fingerprint") and new.get("fingerprint") and old["fingerprint"] != new["fingerprint"]:
            where = "same path, its files changed since" if old["path"] == new["path"] else "other weights"
            shapes = "" if old.get("shape") == new.get("shape") else f"; {_shape(old)} → {_shape(new)}"
            changes.append(f"--{flag} {old['path']} → {new['path']} ({where}{shapes})")
    before_data = saved_run.get("data", {})
    if before_data.get("fingerprint") and before_data["fingerprint"] != now["data"]["fingerprint"]:
        old_pairs, new_pairs = before_data.get("pairs"), now["data"]["pairs"]
        counts = f"; {old_pairs} → {new_pairs} pairs" if old_pairs is not None and old_pairs != new_pairs else ""
        changes.append(f"the training data: --dataset {' '.join(before_data.get('dataset', []))} → "
                       f"{' '.join(now['data']['dataset'])} (other pairs after reading and tokenising{counts})")
    return changes


def check_resume_identity(resume: Path, saved_run: dict | None, saved: dict, identity: RunIdentity) -> None:
    """Refuse to resume `resume` into a run of another model, data or objective, naming each difference; with
    --resume_ignore_changes true, warn instead."""
    cfg = identity.cfg
    changes = identity_changes(saved_run, saved, identity) + setting_changes(saved, cfg)
    if not changes:
        return
    listed = "".join(f"\n  - {c}" for c in changes)
    if cfg.resume_ignore_changes:
        log.warning("Resuming %s with other settings than it was trained with (--resume_ignore_changes true): %s",
                    resume, listed)
        return
    raise FastDPOError(
        f"{resume} was trained with other settings than this run has:{listed}\nResuming would continue its "
        "optimizer state on another problem. Resume with the settings it was trained with (they are in "
        f"{resume / 'state' / 'config.yaml'}, usable as --config), start a fresh run in another --output_dir, or pass "
        "--resume_ignore_changes true to resume anyway."
    )
