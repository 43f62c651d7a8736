"""Keys of LLaMA-Factory's DPO configs (`llamafactory-cli train dpo.yaml`; here `fastdpo train --config dpo.yaml`),
also accepted as flags. Keys that are HF TrainingArguments or fastdpo fields already (learning_rate, lora_rank,
lora_alpha, lora_dropout, simpo_gamma, ld_alpha, report_to, ...) keep their own meaning."""

from __future__ import annotations

from typing import Any

from fastdpo.config.compat.base import (
    NLL_PER_ANSWER,
    Foreign,
    Source,
    assign,
    is_off,
    later,
    maps_to,
    note,
    number,
    refuse_nonzero,
    refuse_on,
    to_bool,
)
from fastdpo.config.compat.swift import LIGER
from fastdpo.data.dataset_info import load_info, resolve_names, split_names
from fastdpo.errors import FastDPOError

PREF_LOSSES = {"sigmoid": "sigmoid", "hinge": "hinge", "ipo": "ipo", "simpo": "simpo"}
ATTN = {"auto": "auto", "fa2": "flash_attention_2", "fa3": "flash_attn", "sdpa": "sdpa", "disabled": "eager"}


def _stage(value: Any, values: dict) -> str | None:
    v = str(value).lower()
    if v == "dpo":
        return None
    if v == "kto":
        assign(values, "loss_type", "kto", "stage", value)
        return ("training KTO as TRL's KTOTrainer computes it (each row's KL completion is the completion of the row "
                "before it in its batch; LLaMA-Factory pairs them in its own order, so the KL estimate differs).")
    raise FastDPOError(f"stage {value}: fastdpo trains preference losses (LLaMA-Factory's stages dpo, with any "
                       "pref_loss it can honour, and kto); SFT, pre-training, reward models and PPO are not among them.")


def _pref_loss(value: Any, values: dict) -> str | None:
    v = str(value).lower()
    if v == "orpo":
        raise FastDPOError(f"pref_loss orpo: LLaMA-Factory's SFT term {NLL_PER_ANSWER} The nearest here is --loss_type orpo "
                           "--orpo_alpha BETA (pref_beta is ORPO's lambda), with that difference; use it knowingly.")
    if v not in PREF_LOSSES:
        raise FastDPOError(f"pref_loss {value}: choose sigmoid, hinge, ipo or simpo (kto_pair has no counterpart here; "
                           "orpo's SFT term differs). Other paired losses: see --loss_type.")
    assign(values, "loss_type", PREF_LOSSES[v], "pref_loss", value)
    return None


def _val_size(value: Any, values: dict) -> str | None:
    v = number(value)
    if not 0 <= v < 1:
        raise FastDPOError(f"val_size {value}: a number of held-out rows is not supported here; give the fraction "
                           "(e.g. 0.05) that it is of the dataset (= --split_dataset_ratio).")
    assign(values, "split_dataset_ratio", v, "val_size")
    return None


def _cutoff_len(value: Any, values: dict) -> str | None:
    assign(values, "max_length", number(value, int), "cutoff_len")
    return ("= --max_length. A longer pair is cut as --truncation_strategy says (right: its answers are cut, a pair "
            "whose prompt alone is that long is dropped), where LLaMA-Factory shortens prompt and answers in "
            "proportion.")


def _flash_attn(value: Any, values: dict) -> str | None:
    """LLaMA-Factory's flash_attn auto|fa2|fa3|sdpa|disabled, or OpenRLHF's bare --flash_attn."""
    v = str(value).lower()
    if v in ATTN:
        impl = ATTN[v]
    elif to_bool(value):
        impl = "flash_attn"
    else:
        return None
    if impl != "auto":
        assign(values, "attn_impl", impl, "flash_attn", value)
    return None


def _do_train(value: Any, values: dict) -> str | None:
    if to_bool(value):
        return None
    raise FastDPOError("do_train false: this config would not train. To score a model on held-out pairs use "
                       "`fastdpo eval`.")


def _overwrite_cache(value: Any, values: dict) -> str | None:
    if to_bool(value):
        assign(values, "load_from_cache_file", False, "overwrite_cache", value)
    return None


def _datasets(given: dict, values: dict) -> list[str]:
    """dataset and eval_dataset: names resolved through dataset_dir/dataset_info.json (when dataset_dir is given),
    each read with its own columns, formatting and tags (--dataset_info)."""
    evals = split_names(given.get("eval_dataset"))
    if "dataset_dir" not in given:
        if evals:
            assign(values, "val_dataset", evals, "eval_dataset", ",".join(evals))
        return []
    dataset_dir = str(given["dataset_dir"])
    table = load_info(dataset_dir)
    if evals and values.get("val_dataset"):
        raise FastDPOError(f"eval_dataset {','.join(evals)} and --val_dataset both name held-out data. Drop one.")
    reading = dict(values.get("dataset_info") or {})
    notes = []
    for field, split, names in (("dataset", "split", split_names(values.get("dataset"))),
                                ("val_dataset", "val_split", evals)):
        if names:
            values[field], hub_split, got_notes = resolve_names(names, table, dataset_dir, reading, split)
            if hub_split:
                assign(values, split, hub_split, "dataset_dir", dataset_dir)
            notes += got_notes
    values["dataset_info"] = reading
    return notes


def _lora(given: dict, values: dict) -> list[str]:
    """finetuning_type (LLaMA-Factory's default is lora), quantization_bit and the LoRA defaults that differ."""
    notes = []
    own = values.get("train_type")  # fastdpo's own flag, when given, stands in for finetuning_type
    kind = str(given.get("finetuning_type", {"qlora": "lora"}.get(own, own or "lora"))).lower()
    bits = given.get("quantization_bit")
    if kind not in ("lora", "full"):
        raise FastDPOError(f"finetuning_type {kind}: fastdpo trains every weight (full) or LoRA adapters (lora); "
                           "freezing layers and OFT are not available.")
    if kind == "lora" and values.get("fp8") is True:  # LLaMA-Factory's fp8 under LoRA: the frozen base in FP8
        values["fp8"], values["fp8_base"] = False, True
        notes.append("fp8: true with LoRA: --fp8_base (the frozen base in FP8; CUDA, compute capability 8.9+).")
    if kind == "full" and not is_off(bits):
        raise FastDPOError(f"quantization_bit {bits} with finetuning_type full: a quantised base can only train "
                           "adapters. Use finetuning_type lora (QLoRA) or drop quantization_bit.")
    if not is_off(bits):
        b = number(bits, int)
        if b not in (4, 8):
            raise FastDPOError(f"quantization_bit {bits}: the base is quantised with bitsandbytes to 4 bits (nf4, double "
                               "quantisation) or 8; choose one of those.")
        assign(values, "quant_bits", b, "quantization_bit")
    train_type = "full" if kind == "full" else "lora" if is_off(bits) else "qlora"
    if "finetuning_type" not in given and "train_type" not in values:
        notes.append("finetuning_type not given: LoRA, LLaMA-Factory's default.")
    assign(values, "train_type", train_type, "finetuning_type", kind)
    if kind == "lora":
        values.setdefault("lora_alpha", 2 * int(values.get("lora_rank", 8)))  # LLaMA-Factory: lora_rank * 2
        values.setdefault("lora_dropout", 0.0)
        target = given.get("lora_target")
        if target is not None:
            joined = ",".join(map(str, target)) if isinstance(target, list) else str(target)
            assign(values, "target_modules", "all-linear" if joined == "all" else joined, "lora_target", joined)
    return notes


def _template(values: dict) -> list[str]:
    """LLaMA-Factory's template names that are built-ins here too; its other names (qwen, ...) mean what they mean
    on the command line (`compat.base.tool_template`)."""
    name = values.get("template")
    if name in ("llama3", "chatml"):
        return [f"template {name}: fastdpo's built-in {name} template renders conversations (its own layout, which "
                "can differ from LLaMA-Factory's in whitespace and in the default system prompt)."]
    return []


def finish(given: dict, values: dict) -> list[str]:
    if "dpo_label_smoothing" in given and values.get("loss_type") == "simpo" and values["label_smoothing"] > 0:
        raise FastDPOError("dpo_label_smoothing with pref_loss simpo: LLaMA-Factory ignores it for SimPO, fastdpo "
                           "would smooth SimPO's labels. Drop dpo_label_smoothing.")
    return _datasets(given, values) + _lora(given, values) + _template(values)


FLAGS: dict[str, Foreign] = {
    "stage": Foreign("LLaMA-Factory: dpo or kto (other stages are refused).", _stage),
    "kto_chosen_weight": Foreign("LLaMA-Factory: = --desirable_weight.", maps_to("desirable_weight", float)),
    "kto_rejected_weight": Foreign("LLaMA-Factory: = --undesirable_weight.", maps_to("undesirable_weight", float)),
    "pref_beta": Foreign("LLaMA-Factory: = --beta.", maps_to("beta", float)),
    "pref_loss": Foreign("LLaMA-Factory: sigmoid, hinge, ipo or simpo (= --loss_type).", _pref_loss),
    "pref_ftx": Foreign("LLaMA-Factory: 0 only (its SFT term is normalised per answer, unlike --rpo_alpha).",
                        refuse_nonzero(f"pref_ftx {{value}}: LLaMA-Factory's SFT term {NLL_PER_ANSWER} The nearest here is "
                                       "--rpo_alpha {value}, with that difference; change the config to it knowingly, "
                                       "or drop pref_ftx.")),
    "dpo_label_smoothing": Foreign("LLaMA-Factory: = --label_smoothing.", maps_to("label_smoothing", float)),
    "finetuning_type": Foreign("LLaMA-Factory: lora (its default) or full (= --train_type).", later),
    "lora_target": Foreign("LLaMA-Factory: all (= all-linear) or module names (= --target_modules).", later),
    "quantization_bit": Foreign("LLaMA-Factory: 4 or 8 (= --train_type qlora --quant_bits).", later),
    "cutoff_len": Foreign("LLaMA-Factory: = --max_length.", _cutoff_len),
    "val_size": Foreign("LLaMA-Factory: a fraction = --split_dataset_ratio.", _val_size),
    "preprocessing_num_workers": Foreign("LLaMA-Factory: = --dataset_num_proc.", maps_to("dataset_num_proc", int)),
    "overwrite_cache": Foreign("LLaMA-Factory: true = --load_from_cache_file false.", _overwrite_cache, bare=True),
    "plot_loss": Foreign("LLaMA-Factory: = --plot.", maps_to("plot", bool), bare=True),
    "do_train": Foreign("HF/LLaMA-Factory: true (false is refused).", _do_train, bare=True),
    "per_device_eval_batch_size": Foreign("HF/LLaMA-Factory: ignored (it does not change the scores).",
                                          note("ignored; held-out pairs are scored in batches like training's.")),
    "flash_attn": Foreign("LLaMA-Factory auto|fa2|fa3|sdpa|disabled, OpenRLHF bare: = --attn_impl.", _flash_attn,
                          bare=True),
    "enable_liger_kernel": Foreign("LLaMA-Factory: ignored (log-probs are chunked; norms and MLPs use --kernels).", LIGER,
                                   bare=True),
    "use_unsloth": Foreign("LLaMA-Factory: not available (false = off).", refuse_on(
        "use_unsloth {value}: Unsloth's kernels are not used here; fastdpo has its own packed, chunked path. "
        "Drop the key."), bare=True),
    "dataset_dir": Foreign("LLaMA-Factory: the dataset and eval_dataset names are looked up in DIR/dataset_info.json "
                           "(file_name or hf_hub_url, columns, formatting, tags, num_samples; ranking must be true).",
                           later),
    "eval_dataset": Foreign("LLaMA-Factory: held-out datasets (names with dataset_dir) = --val_dataset.", later),
}

LLAMAFACTORY = Source("accepted from LLaMA-Factory configs", FLAGS, finish, markers=frozenset(
    {"stage", "pref_beta", "pref_loss", "pref_ftx", "dpo_label_smoothing", "finetuning_type", "lora_target",
     "kto_chosen_weight", "kto_rejected_weight", "quantization_bit", "cutoff_len", "val_size",
     "preprocessing_num_workers", "plot_loss", "dataset_dir", "eval_dataset"}))
