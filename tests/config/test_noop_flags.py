"""Flags accepted that do nothing in the configuration given say so in one note each, once, when set; a field that
nothing outside the configuration reads must have such a note."""

import dataclasses
import logging
import re
from pathlib import Path

import pytest

from fastdpo.cli import build_parser
from fastdpo.config import TrainConfig, build_config
from fastdpo.config.compat.noop import NOOPS

SRC = Path(__file__).resolve().parents[2] / "src" / "fastdpo"

# field -> flags that set it where it does nothing
CASES = {
    "padding_free": ("--padding_free", "true"),
    "dataloader_num_workers": ("--dataloader_num_workers", "8"),
    "dataset_num_proc": ("--dataset_num_proc", "4", "--streaming", "true", "--max_steps", "5"),
    "shuffle_buffer_size": ("--shuffle_buffer_size", "64"),
    "dataloader_drop_last": ("--dataloader_drop_last", "true", "--streaming", "true", "--max_steps", "5"),
    "dataset_cache_dir": ("--dataset_cache_dir", "/tmp/c", "--load_from_cache_file", "false"),
    "quant_bits": ("--train_type", "lora", "--quant_bits", "8"),
    "num_train_epochs": ("--num_train_epochs", "3", "--max_steps", "10"),
    "warmup_ratio": ("--warmup_ratio", "0.1", "--warmup_steps", "5"),
    "lr_scheduler_kwargs": ("--lr_scheduler_kwargs", '{"num_cycles": 1}', "--lr_scheduler_type", "linear"),
    "label_smoothing": ("--label_smoothing", "0.1", "--loss_type", "ipo"),
    "f_alpha_divergence_coef": ("--f_alpha_divergence_coef", "0.3"),
    "discopop_tau": ("--discopop_tau", "0.1"),
    "simpo_gamma": ("--simpo_gamma", "1.0"),
    "orpo_alpha": ("--orpo_alpha", "0.2"),
    "cpo_alpha": ("--cpo_alpha", "0.5"),
    "beta_kl_target": ("--beta_kl_target", "0.3"),
    "beta_kl_window": ("--beta_kl_window", "10"),
    "beta_min_ratio": ("--beta_min_ratio", "0.3"),
    "ref_model": ("--ref_model", "r", "--loss_type", "simpo"),
    "ref_adapters": ("--ref_adapters", "a", "--loss_type", "orpo"),
    "precompute_ref_batch_size": ("--precompute_ref_batch_size", "16"),
    "ref_cache_dir": ("--ref_cache_dir", "/tmp/r"),
    "ref_model_mixup_alpha": ("--ref_model_mixup_alpha", "0.5"),
    "ref_model_sync_steps": ("--ref_model_sync_steps", "64"),
    "val_split": ("--val_split", "test"),
    "metric_for_best_model": ("--metric_for_best_model", "rewards/accuracies"),
    "greater_is_better": ("--greater_is_better", "true"),
    "save_total_limit": ("--save_total_limit", "2"),
    "resume_ignore_changes": ("--resume_ignore_changes", "true"),
    "trust_unverified_checkpoint": ("--trust_unverified_checkpoint", "true"),
    "start_over_if_unusable": ("--start_over_if_unusable", "true"),
    "hub_private_repo": ("--hub_private_repo", "true"),
    "logging_dir": ("--logging_dir", "/tmp/tb"),
    "run_name": ("--run_name", "r1"),
    "fsdp_layers_per_unit": ("--fsdp_layers_per_unit", "2"),
    "reduce_dtype": ("--reduce_dtype", "float32"),
    "sequence_parallel_mode": ("--sequence_parallel_mode", "ring"),
}

# field -> flags that set it where it acts: no note
ACTING = {
    "padding_free": ("--padding_free", "false"),
    "dataloader_num_workers": ("--dataloader_num_workers", "2", "--streaming", "true", "--max_steps", "5"),
    "num_train_epochs": ("--num_train_epochs", "3"),
    "dataset_num_proc": ("--dataset_num_proc", "4"),
    "label_smoothing": ("--label_smoothing", "0.1"),
    "simpo_gamma": ("--simpo_gamma", "1.0", "--loss_type", "simpo"),
    "cpo_alpha": ("--rlhf_type", "simpo", "--cpo_alpha", "0.5"),
    "ref_model": ("--ref_model", "r"),
    "logging_dir": ("--logging_dir", "/tmp/tb", "--report_to", "tensorboard"),
    "metric_for_best_model": ("--metric_for_best_model", "loss", "--split_dataset_ratio", "0.1"),
    "sequence_parallel_mode": ("--sequence_parallel_mode", "ring", "--sequence_parallel_size", "2"),
}


def notes(caplog, *flags) -> list[str]:
    caplog.clear()
    caplog.set_level(logging.INFO, logger="fastdpo")
    build_config(build_parser().parse_args(["train", "--model", "m", "--dataset", "d.jsonl", *flags]), TrainConfig)
    return [r.getMessage() for r in caplog.records]


def test_every_noop_flag_has_a_case():
    assert set(CASES) == set(NOOPS)
    assert set(NOOPS) <= {f.name for f in dataclasses.fields(TrainConfig)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_noop_flag_is_noted_once_when_set(caplog, name):
    said = [m for m in notes(caplog, *CASES[name]) if m.startswith(f"--{name} ")]
    assert len(said) == 1 and ("no effect" in said[0] or "nothing to do" in said[0]), said


def test_noop_flags_unset_say_nothing(caplog):
    said = notes(caplog)
    assert not [m for m in said if any(m.startswith(f"--{name} ") for name in NOOPS)], said


@pytest.mark.parametrize("name", sorted(ACTING))
def test_flag_that_acts_is_not_noted(caplog, name):
    assert not [m for m in notes(caplog, *ACTING[name]) if m.startswith(f"--{name} ")]


def test_the_user_examples_read_as_promised(caplog):
    said = notes(caplog, "--dataloader_num_workers", "8", "--padding_free", "true")
    assert "--padding_free true: fastdpo always packs without padding; nothing to do." in said
    assert any(m.startswith("--dataloader_num_workers 8: tokenisation happens before training and batches are built "
                            "in-process; the flag has no effect") for m in said)


def test_notes_come_from_rank_zero_only(caplog, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert not notes(caplog, "--padding_free", "true")


@pytest.mark.parametrize("flags,needle", [
    (("--optim", "adamw_torch"), "--optim adamw_torch: fastdpo always trains with AdamW; nothing to do."),
    (("--use_peft", "--load_in_4bit", "--bnb_4bit_quant_type", "nf4"),
     "--bnb_4bit_quant_type nf4: fastdpo's 4-bit base is always nf4; nothing to do."),
    (("--use_peft", "--load_in_4bit", "--use_bnb_nested_quant"), "--use_bnb_nested_quant true: the 4-bit base"),
    (("--use_peft", "--use_bnb_nested_quant"), "--use_bnb_nested_quant true: only a 4-bit base"),
])
def test_other_tools_flags_with_nothing_to_do_are_noted(caplog, flags, needle):
    assert any(m.startswith(needle) for m in notes(caplog, *flags))


def test_every_field_is_read_or_noted():
    """A field nothing outside `config/` reads is accepted and ignored: it needs an entry in NOOPS."""
    text = "\n".join(p.read_text(encoding="utf-8") for p in SRC.rglob("*.py") if "config" not in p.relative_to(SRC).parts)
    unread = [f.name for f in dataclasses.fields(TrainConfig)
              if not re.search(rf"\.{f.name}\b|[\"']{f.name}[\"']", text) and f.name not in NOOPS]
    assert not unread, f"fields never read outside config/: {unread}; read them or add a note to compat/noop.py"
