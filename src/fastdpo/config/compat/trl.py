"""Flags of TRL's scripts (`trl dpo`, examples/scripts/dpo.py): its ScriptArguments and ModelConfig. DPOConfig's own
flags (beta, max_length, loss_type, rpo_alpha, ...) are fastdpo's flags already. DPOConfig's defaults differ from
fastdpo's in ways that change training (learning rate, sequence length, and HF's three epochs), so a command with
TRL's script flags gets TRL's defaults for what it leaves out, listed in one logged note."""

from __future__ import annotations

from typing import Any

from fastdpo.config.compat.base import Foreign, Source, adopt, assign, later, maps_to, number, refuse_on, to_bool
from fastdpo.errors import FastDPOError


def _attn_implementation(value: Any, values: dict) -> str | None:
    from fastdpo.config.sections.batching import ATTN_IMPLS

    if str(value) not in ATTN_IMPLS:
        raise FastDPOError(f"--attn_implementation {value}: fastdpo runs its own attention on the packed layout "
                           f"(--attn_impl auto); accepted names: {', '.join(ATTN_IMPLS)}.")
    assign(values, "attn_impl", str(value), "attn_implementation")
    return None


def _quant_type(value: Any, values: dict) -> str | None:
    if str(value).lower() != "nf4":
        raise FastDPOError(f"--bnb_4bit_quant_type {value}: fastdpo's 4-bit base is nf4. Pass nf4 or drop the flag.")
    return "fastdpo's 4-bit base is always nf4; nothing to do."


def _load_in(bits: int):
    def apply(value: Any, values: dict) -> str | None:
        if not to_bool(value):
            return None
        assign(values, "quant_bits", bits, f"load_in_{bits}bit", True)
        if values.get("train_type") == "lora":
            values["train_type"] = "qlora"
        return None
    return apply


def _quant_bits(given: dict) -> int | None:
    four, eight = (to_bool(given.get(f"load_in_{b}bit", False)) for b in (4, 8))
    if four and eight:
        raise FastDPOError("--load_in_4bit and --load_in_8bit: choose one.")
    return 4 if four else 8 if eight else None


def _dataset(given: dict, values: dict) -> list[str]:
    name, config = given.get("dataset_name"), given.get("dataset_config")
    if config and not name:
        raise FastDPOError(f"--dataset_config {config} names a subset of --dataset_name: add --dataset_name (or write "
                           f"--dataset NAME:{config}).")
    spec = f"{name}:{config}" if config else str(name)
    if isinstance(values.get("dataset"), str):
        values["dataset"] = [values["dataset"]]
    if name:
        assign(values, "dataset", [spec], "dataset_name", spec)
    test = given.get("dataset_test_split")
    if test is None:
        return []
    strategy = str(given.get("eval_strategy", given.get("evaluation_strategy", "no"))).lower()
    if strategy == "no" and not values.get("eval_steps"):  # fastdpo's own --eval_steps N asks for evaluation too
        return [f"--dataset_test_split {test}: not read; TRL evaluates on it only with --eval_strategy steps|epoch "
                "(or give --eval_steps N)."]
    if not name:
        raise FastDPOError(f"--dataset_test_split {test} selects a split of --dataset_name: add --dataset_name, or give "
                           "--val_dataset with --val_split.")
    assign(values, "val_dataset", [spec], "dataset_test_split", test)
    assign(values, "val_split", str(test), "dataset_test_split")
    return []


def _peft(given: dict, values: dict) -> list[str]:
    notes = []
    bits = _quant_bits(given)
    if to_bool(given.get("use_peft", False)):
        assign(values, "train_type", "qlora" if bits else "lora", "use_peft", True)
        if "lora_r" in given:
            assign(values, "lora_rank", number(given["lora_r"], int), "lora_r", given["lora_r"])
        else:
            values.setdefault("lora_rank", 16)  # TRL's default rank (alpha 32 and dropout 0.05 are fastdpo's too)
        targets = given.get("lora_target_modules")
        if targets:
            joined = ",".join(targets) if isinstance(targets, list) else str(targets)
            assign(values, "target_modules", joined, "lora_target_modules", joined)
        elif "target_modules" not in values:
            values["target_modules"] = "default"
            notes.append("--use_peft without --lora_target_modules: LoRA on PEFT's default modules for the "
                         "architecture (q_proj,v_proj for Llama and Qwen), as in TRL (--target_modules default).")
        nested = to_bool(given.get("use_bnb_nested_quant", False))
        if nested:
            notes.append("--use_bnb_nested_quant true: the 4-bit base always uses double quantisation here; nothing to "
                         "do." if bits == 4 else "--use_bnb_nested_quant true: only a 4-bit base (--load_in_4bit) is "
                         "quantised twice; the flag has no effect.")
        if bits == 4 and not nested:
            notes.append("--load_in_4bit: the nf4 base is quantised with double quantisation here (TRL: only with "
                         "--use_bnb_nested_quant); it stores the quantisation constants in 8 bits, which moves the "
                         "dequantised weights slightly.")
    else:
        notes += [f"--{n}: ignored, as in TRL without --use_peft." for n in ("lora_r", "lora_target_modules")
                  if n in given]
    if bits and values.get("train_type") != "qlora":
        raise FastDPOError(f"--load_in_{bits}bit quantises the base for LoRA adapters: add --use_peft (TRL), "
                           "--lora_rank N (OpenRLHF) or --train_type qlora.")
    return notes


# TRL 1.x DPOConfig (learning_rate, max_length) and TrainingArguments (num_train_epochs) where fastdpo's differ
DEFAULTS = {"learning_rate": 1e-6, "max_length": 1024, "num_train_epochs": 3.0}
# flags only TRL's scripts have: they make a command TRL's (--model_name_or_path is LLaMA-Factory's too)
SCRIPT_FLAGS = frozenset({"dataset_name", "dataset_config", "dataset_train_split", "dataset_test_split", "use_peft",
                          "lora_r", "lora_target_modules"})


def _defaults(given: dict, values: dict) -> list[str]:
    if not SCRIPT_FLAGS & set(given):
        return []
    defaults = {k: v for k, v in DEFAULTS.items() if k != "num_train_epochs" or not values.get("max_steps")}
    adopted = adopt(values, defaults)
    return ["TRL's defaults for what the command leaves out: " + ", ".join(adopted) + "."] if adopted else []


def _label_smoothing(given: dict, values: dict) -> list[str]:
    """TRL 1.16's sigmoid loss ignores label_smoothing (only robust, exo_pair, bco_pair, aot... read it); fastdpo's
    applies it (cDPO). The flag given wins, so a TRL command with both trains cDPO here: said once."""
    raw = values.get("loss_type", "sigmoid")
    losses = [str(n).strip() for n in (raw if isinstance(raw, list) else str(raw).split(","))]
    smoothing = number(values.get("label_smoothing", 0.0))
    if not SCRIPT_FLAGS & set(given) or "sigmoid" not in losses or smoothing <= 0:
        return []
    return [f"--label_smoothing {smoothing:g} with --loss_type sigmoid: fastdpo trains conservative DPO (cDPO, "
            f"-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)); TRL 1.16's sigmoid loss ignores "
            "label_smoothing, so this command trained plain DPO there. Drop the flag for TRL's result."]


def _truncation_mode(value: Any, values: dict) -> str | None:
    """DPOConfig's truncation_mode: keep_start is --truncation_strategy right; keep_end (deprecated in TRL) is
    nearest to left."""
    v = str(value).lower()
    if v == "keep_start":
        assign(values, "truncation_strategy", "right", "truncation_mode", value)
        return None
    if v == "keep_end":
        assign(values, "truncation_strategy", "left", "truncation_mode", value)
        return ("= --truncation_strategy left: the prompt loses tokens from the left until prompt + the longer "
                "completion fit --max_length, completions whole. TRL keeps the last max_length tokens of each "
                "sequence on its own, so its shorter completion keeps more of the prompt and a completion longer "
                "than max_length loses its start; here such a pair is dropped.")
    raise FastDPOError(f"--truncation_mode {value}: TRL's keep_start (= --truncation_strategy right) or keep_end "
                       "(= left); fastdpo also has --truncation_strategy delete.")


def finish(given: dict, values: dict) -> list[str]:
    return (_dataset(given, values) + _peft(given, values) + _defaults(given, values)
            + _label_smoothing(given, values))


FLAGS: dict[str, Foreign] = {
    "model_name_or_path": Foreign("TRL/LLaMA-Factory: = --model.", maps_to("model")),
    "dataset_name": Foreign("TRL: = --dataset (with --dataset_config: NAME:CONFIG).", later),
    "dataset_config": Foreign("TRL: the subset of --dataset_name.", later),
    "dataset_train_split": Foreign("TRL: = --split.", maps_to("split")),
    "dataset_test_split": Foreign("TRL: with --eval_strategy steps|epoch, that split of --dataset_name is "
                                  "--val_dataset (--val_split).", later),
    "use_peft": Foreign("TRL: LoRA (= --train_type lora; qlora with --load_in_4bit/8bit), rank 16 unless --lora_r, "
                        "PEFT's default modules unless --lora_target_modules.", later, bare=True),
    "lora_r": Foreign("TRL: = --lora_rank (with --use_peft).", later),
    "lora_target_modules": Foreign("TRL: = --target_modules (with --use_peft).", later, nargs="+"),
    "load_in_4bit": Foreign("TRL/OpenRLHF: LoRA on a 4-bit nf4 base (= --train_type qlora).", _load_in(4), bare=True),
    "load_in_8bit": Foreign("TRL: LoRA on an 8-bit base (= --train_type qlora --quant_bits 8).", _load_in(8),
                            bare=True),
    "bnb_4bit_quant_type": Foreign("TRL: nf4 (what the 4-bit base uses).", _quant_type),
    "use_bnb_nested_quant": Foreign("TRL: the 4-bit base always uses double quantisation here.", later, bare=True),
    "use_rslora": Foreign("TRL: not available (false = off).", refuse_on(
        "--use_rslora {value}: rank-stabilised LoRA scaling is not available; fastdpo scales adapters by "
        "lora_alpha / lora_rank. Drop the flag (and set --lora_alpha for the scale you want)."), bare=True),
    "lora_modules_to_save": Foreign("TRL: not available.", refuse_on(
        "--lora_modules_to_save {value}: fastdpo trains only the LoRA adapters, never whole modules beside them. "
        "Drop the flag, or train every weight with --train_type full."), nargs="+"),
    "attn_implementation": Foreign("TRL/HF: = --attn_impl.", _attn_implementation),
    "dtype": Foreign("TRL/HF (newer name of --torch_dtype): = --torch_dtype.", maps_to("torch_dtype")),
    "truncation_mode": Foreign("TRL DPOConfig: keep_start (= --truncation_strategy right) or keep_end (= left, "
                               "noted).", _truncation_mode),
}

TRL = Source("accepted from TRL scripts (trl dpo)", FLAGS, finish,
             markers=frozenset(FLAGS) - {"model_name_or_path", "attn_implementation", "dtype", "truncation_mode"})
