"""Flags of OpenRLHF's `openrlhf.cli.train_dpo`. Its defaults differ from fastdpo's in ways that change training
(learning rate, schedule, Adam's beta2, sequence length, batch), so a command with OpenRLHF's flags gets OpenRLHF's
defaults for what it leaves out, listed in one logged note. Its column flags (--prompt_key, --chosen_key,
--rejected_key) are shorthand for --columns and do not make a command OpenRLHF's (--input_template and
--apply_chat_template are fields of their own)."""

from __future__ import annotations

import os
from typing import Any

from fastdpo.config.compat.base import (
    NLL_PER_ANSWER,
    Apply,
    Foreign,
    Source,
    adopt,
    assign,
    later,
    maps_to,
    note,
    number,
    refuse_nonzero,
    refuse_on,
    to_bool,
)
from fastdpo.config.compat.swift import offload
from fastdpo.errors import FastDPOError

# train_dpo.py's defaults where fastdpo's differ (lr_warmup_ratio, lr_scheduler, adam_betas, max_len,
# micro_train_batch_size); the LoRA ones apply with --lora_rank, train_batch_size sets the accumulation
DEFAULTS = {"learning_rate": 1e-5, "warmup_ratio": 0.03, "lr_scheduler_type": "cosine_with_min_lr", "adam_beta2": 0.95,
            "max_length": 512, "per_device_train_batch_size": 8}
LORA_DEFAULTS = {"lora_alpha": 16, "lora_dropout": 0.0}
TRAIN_BATCH_SIZE, MIN_LR_RATIO = 128, 0.1


def _zero_stage(value: Any, values: dict) -> str | None:
    stage = number(value, int)
    if stage not in (0, 1, 2, 3):
        raise FastDPOError(f"--zero_stage {value}: choose 0, 1, 2 or 3.")
    assign(values, "deepspeed", {0: "", 1: "", 2: "zero2", 3: "zero3"}[stage], "zero_stage", value)
    if stage == 1:
        return ("ZeRO-1 shards only the optimizer state; here that is plain DDP (the same updates, more memory per "
                "GPU). --zero_stage 2 or 3 shards more.")
    return None


def _adam_betas(value: Any, values: dict) -> str | None:
    b1, b2 = (number(v) for v in value)
    assign(values, "adam_beta1", b1, "adam_betas", f"{b1} {b2}")
    assign(values, "adam_beta2", b2, "adam_betas", f"{b1} {b2}")
    return None


def _load_checkpoint(value: Any, values: dict) -> str | None:
    if to_bool(value):
        assign(values, "resume_from_checkpoint", "latest", "load_checkpoint", value)
        return "= --resume_from_checkpoint latest: resumes from the newest checkpoint in --output_dir, if any."
    return None


def _use_wandb(value: Any, values: dict) -> str | None:
    if not str(value).strip() or str(value).lower() in ("false", "none", "0"):
        return None
    sinks = [s for s in str(values.get("report_to", "none")).split(",") if s.strip() and s.strip() != "none"]
    values["report_to"] = ",".join(sinks if "wandb" in sinks or "all" in sinks else [*sinks, "wandb"])
    if str(value).lower() in ("true", "1"):
        return None
    return "= --report_to wandb. The value is not used as an API key here: log in with `wandb login` or WANDB_API_KEY."


def _column_key(flag: str) -> Apply:
    """--prompt_key COL (chosen, rejected): the same as --columns '{"COL": "prompt"}'."""
    def apply(value: Any, values: dict) -> str | None:
        from fastdpo.data.columns import add_key_flag, column_mapping

        columns = dict(column_mapping(values.get("columns") or {}))  # --columns checked as it is anywhere
        add_key_flag(columns, flag, str(value))
        values["columns"] = columns
        return None
    return apply


def _wandb_project(value: Any, values: dict) -> str | None:
    current = os.environ.setdefault("WANDB_PROJECT", str(value))
    if current != str(value):
        return f"ignored: WANDB_PROJECT={current} is set and names the project."
    return None


def _lora(given: dict, values: dict) -> list[str]:
    rank = values.get("lora_rank")
    if rank is None:
        return []
    if rank == 0:  # OpenRLHF: no adapters
        values.pop("lora_rank")
        return []
    four_bit = to_bool(given.get("load_in_4bit", False))
    assign(values, "train_type", "qlora" if four_bit else "lora", "lora_rank", rank)
    return adopt(values, LORA_DEFAULTS)


def _accumulation(given: dict, values: dict) -> None:
    """OpenRLHF's --train_batch_size is the global batch: accumulation = global / (micro x world size)."""
    from fastdpo.config.launch import world_size

    total = number(given.get("train_batch_size", TRAIN_BATCH_SIZE), int)
    micro, world = values["per_device_train_batch_size"], world_size()
    if total < 1 or total % (micro * world):
        raise FastDPOError(f"--train_batch_size {total} is not a multiple of --micro_train_batch_size {micro} x "
                           f"{world} ranks = {micro * world}, so no whole number of accumulation steps gives it. Pass "
                           f"a multiple of {micro * world}, e.g. {max(1, total // (micro * world)) * micro * world}.")
    assign(values, "gradient_accumulation_steps", total // (micro * world), "train_batch_size", total)


def finish(given: dict, values: dict) -> list[str]:
    adopted = adopt(values, DEFAULTS)
    if values["lr_scheduler_type"] == "cosine_with_min_lr" and not values.get("lr_scheduler_kwargs"):
        values["lr_scheduler_kwargs"] = {"min_lr_rate": number(given.get("min_lr_ratio", MIN_LR_RATIO))}
    if "train_batch_size" in given or "gradient_accumulation_steps" not in values:  # else fastdpo's own flag rules
        if "train_batch_size" not in given:
            adopted.append(f"--train_batch_size {TRAIN_BATCH_SIZE}")
        _accumulation(given, values)
    for name in ("save_steps", "eval_steps"):  # OpenRLHF's -1: no checkpoints / no evaluation during training
        if values.get(name) == -1:
            values[name] = 0
    adopted += _lora(given, values)
    if not adopted:
        return []
    return ["OpenRLHF's defaults for what the command leaves out: " + ", ".join(adopted) + "."]


FLAGS: dict[str, Foreign] = {
    "pretrain": Foreign("OpenRLHF: = --model.", maps_to("model")),
    "save_path": Foreign("OpenRLHF: = --output_dir.", maps_to("output_dir")),
    "max_len": Foreign("OpenRLHF: = --max_length.", maps_to("max_length", int)),
    "micro_train_batch_size": Foreign("OpenRLHF: = --per_device_train_batch_size.",
                                      maps_to("per_device_train_batch_size", int)),
    "train_batch_size": Foreign("OpenRLHF: pairs per optimizer step over all GPUs (sets "
                                "--gradient_accumulation_steps).", later),
    "max_epochs": Foreign("OpenRLHF: = --num_train_epochs.", maps_to("num_train_epochs", float)),
    "zero_stage": Foreign("OpenRLHF: 2 = --deepspeed zero2, 3 = zero3, 0/1 = DDP.", _zero_stage),
    "lr_warmup_ratio": Foreign("OpenRLHF: = --warmup_ratio.", maps_to("warmup_ratio", float)),
    "lr_scheduler": Foreign("OpenRLHF: = --lr_scheduler_type.", maps_to("lr_scheduler_type")),
    "min_lr_ratio": Foreign("OpenRLHF: cosine_with_min_lr's floor, a fraction of the learning rate.", later),
    "l2": Foreign("OpenRLHF: = --weight_decay.", maps_to("weight_decay", float)),
    "adam_betas": Foreign("OpenRLHF: two numbers = --adam_beta1 --adam_beta2.", _adam_betas, nargs=2),
    "max_norm": Foreign("OpenRLHF: = --max_grad_norm.", maps_to("max_grad_norm", float)),
    "ipo": Foreign("OpenRLHF: refused (its IPO is on summed log-probs).", refuse_on(
        "--ipo: OpenRLHF's IPO uses summed log-probs; fastdpo's --loss_type ipo is TRL's, on per-token mean "
        "log-probs, so the same --beta asks for a different margin. Use --loss_type ipo with a beta chosen for it."),
        bare=True),
    "nll_loss_coef": Foreign("OpenRLHF: 0 only (its NLL term is normalised per answer, unlike --rpo_alpha).",
                             refuse_nonzero(f"--nll_loss_coef {{value}}: OpenRLHF's NLL term {NLL_PER_ANSWER} The nearest here "
                                            "is --rpo_alpha {value}, with that difference; use it knowingly.")),
    "ref_offload": Foreign("OpenRLHF: not available.", offload("ref_offload"), bare=True),
    "adam_offload": Foreign("OpenRLHF: not available.", offload("adam_offload"), bare=True),
    "load_checkpoint": Foreign("OpenRLHF: = --resume_from_checkpoint latest.", _load_checkpoint, bare=True),
    "ckpt_path": Foreign("OpenRLHF: ignored (checkpoints live in --output_dir).",
                         note("ignored; checkpoints are written to and resumed from --output_dir (--save_path).")),
    "use_wandb": Foreign("OpenRLHF: = --report_to wandb (log in with `wandb login`).", _use_wandb),
    "wandb_project": Foreign("OpenRLHF: the W&B project (WANDB_PROJECT).", _wandb_project),
    "wandb_run_name": Foreign("OpenRLHF: = --run_name.", maps_to("run_name")),
}

COLUMN_FLAGS: dict[str, Foreign] = {
    f"{col}_key": Foreign(f"OpenRLHF: the {col} column (= --columns '{{\"COL\": \"{col}\"}}').", _column_key(f"{col}_key"))
    for col in ("prompt", "chosen", "rejected")
}

OPENRLHF = Source("accepted from OpenRLHF's train_dpo", {**FLAGS, **COLUMN_FLAGS}, finish, markers=frozenset(FLAGS))
