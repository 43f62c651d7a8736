"""Flags of ms-swift and HF TrainingArguments scripts that have no field of their own here."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from fastdpo.config.compat.base import (
    Foreign,
    Source,
    Unnamed,
    adopt,
    assign,
    is_off,
    maps_to,
    note,
    number,
    refuse_on,
    to_bool,
)
from fastdpo.config.parallel import LESS_MEMORY
from fastdpo.errors import FastDPOError

LIGER = note("ignored; fastdpo's log-probs are always computed in chunks, never as full logits, and on CUDA its norms "
             "and SwiGLU MLPs run as Triton kernels (--kernels).")
RLHF_TYPES = {"dpo": None, "simpo": "simpo", "orpo": "orpo", "cpo": "cpo", "kto": "kto"}


def _rlhf_type(value: str, values: dict) -> str | None:
    v = str(value).lower()
    if v not in RLHF_TYPES:
        raise FastDPOError(f"--rlhf_type {value}: fastdpo trains preference losses (dpo, simpo, orpo, cpo, kto and "
                           "every --loss_type); reward models, PPO and GRPO are not among them.")
    loss = RLHF_TYPES[v]
    if loss is None:
        return None
    given = values.get("loss_type")
    if v == "kto" and given in ("kto", "apo_zero_unpaired"):  # ms-swift's KTO takes TRL's KTO loss_type
        return f"training with --loss_type {given}."
    if given and given != loss:
        raise FastDPOError(f"--rlhf_type {v} and --loss_type {given} disagree: drop one (--rlhf_type {v} means "
                           f"--loss_type {loss}).")
    values["loss_type"] = loss
    return f"training with --loss_type {loss}."


def _ulysses_num_heads(value: Any, values: dict) -> str | None:
    """ms-swift's Ulysses sequence parallelism over K ranks: --sequence_parallel_size K in ulysses mode (1: off)."""
    k = number(value, int)
    if k < 1:
        raise Unnamed("expected a number of ranks >= 1 (1: off).")
    if k == 1:
        return None
    assign(values, "sequence_parallel_size", k, "ulysses_num_heads")
    assign(values, "sequence_parallel_mode", "ulysses", "ulysses_num_heads")
    return None


def _ring_attn(value: Any, values: dict) -> str | None:
    """ms-swift's ring attention: --sequence_parallel_mode ring (its size from --sequence_parallel_size)."""
    if not to_bool(value):
        return None
    assign(values, "sequence_parallel_mode", "ring", "ring_attn", "true")
    return None


def offload(name: str) -> Callable[[Any, dict], str | None]:
    def apply(value: Any, values: dict) -> str | None:
        if is_off(value):
            return None
        raise FastDPOError(f"--{name} {value}: DeepSpeed's CPU offload is not available in fastdpo. {LESS_MEMORY}")
    return apply


def _master_port(value: Any, values: dict) -> str | None:
    """The launcher reads MASTER_PORT (`fastdpo.parallel.launch`); inside a worker the launcher's port stands."""
    port = number(value, int)
    if not 0 < port < 65536:
        raise Unnamed("expected a port number (1-65535).")
    held = os.environ.get("MASTER_PORT")
    if "LOCAL_RANK" in os.environ:
        return None
    if not os.environ.get("NPROC_PER_NODE"):
        return "ignored: one process has no rendezvous (NPROC_PER_NODE=N starts N workers on that port)."
    if held and held != str(port):
        raise FastDPOError(f"--master_port {port} but MASTER_PORT={held}: drop one.")
    os.environ["MASTER_PORT"] = str(port)
    return None


def _quant_method(value: str, values: dict) -> str | None:
    """ms-swift's QLoRA is `--train_type lora --quant_method bnb --quant_bits 4` (lora is its default train_type):
    here that is --train_type qlora. Its FP8 base, `--quant_method fp8 --quant_bits 8`, is --train_type lora
    --fp8_base."""
    method = str(value).lower()
    if method == "fp8":
        return _fp8_base(value, values)
    if method not in ("bnb", "bitsandbytes"):
        raise FastDPOError(f"--quant_method {value}: QLoRA quantises the base with bitsandbytes (nf4 with double "
                           "quantisation for --quant_bits 4, LLM.int8 for 8), and fp8 holds it in FP8 (--fp8_base). "
                           "Pass --quant_method bnb or fp8, or drop the flag.")
    kind = values.get("train_type", "lora")
    if kind == "full":
        raise FastDPOError(f"--quant_method {value} with --train_type full: a quantised base can only train adapters. "
                           "Use --train_type lora (QLoRA) or drop --quant_method.")
    if kind == "qlora":
        return None
    values["train_type"] = "qlora"
    return f"training QLoRA: --train_type qlora (LoRA on a {values.get('quant_bits', 4)}-bit base)."


def _fp8_base(value: str, values: dict) -> str | None:
    """`--quant_method fp8` (with --quant_bits 8 or none): LoRA on the FP8 base."""
    bits = values.get("quant_bits", 8)
    if number(bits, int) != 8:
        raise FastDPOError(f"--quant_method fp8 --quant_bits {bits}: an FP8 base has 8 bits. Pass --quant_bits 8 or "
                           "drop it.")
    kind = values.get("train_type", "lora")
    if kind != "lora":
        raise FastDPOError(f"--quant_method fp8 with --train_type {kind}: the FP8 base is the frozen base of LoRA "
                           "(--train_type lora --fp8_base). Use --train_type lora or drop --quant_method.")
    values["train_type"] = "lora"
    assign(values, "fp8_base", True, "quant_method", value)
    return "training LoRA on an FP8 base: --train_type lora --fp8_base (CUDA, compute capability 8.9+)."


def _precision(dtype: str) -> Callable[[Any, dict], str | None]:
    def apply(value: Any, values: dict) -> str | None:
        if not to_bool(value):
            return None
        given = values.get("torch_dtype", "auto")
        if given not in ("auto", dtype):
            raise FastDPOError(f"--{'bf16' if dtype == 'bfloat16' else 'fp16'} true and --torch_dtype {given} "
                               "disagree: drop one.")
        values["torch_dtype"] = dtype
        return None
    return apply


def _save_strategy(value: str, values: dict) -> str | None:
    v = str(value).lower()
    if v == "no":
        values["save_steps"] = 0
        return None
    if v == "steps":
        return None
    if v == "epoch":
        return "checkpoints follow --save_steps; the final model is saved at the end."
    raise FastDPOError(f"--save_strategy {value}: choose steps, epoch or no.")


def _eval_strategy(value: str, values: dict) -> str | None:
    v = str(value).lower()
    if v == "no":
        values["eval_steps"] = 0
        return None
    if v in ("steps", "epoch"):
        return None if v == "steps" else "held-out pairs are scored every --eval_steps."
    raise FastDPOError(f"--eval_strategy {value}: choose steps, epoch or no.")


def _optim(value: str, values: dict) -> str | None:
    if str(value).lower() in ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw"):
        return "fastdpo always trains with AdamW; nothing to do."
    raise FastDPOError(f"--optim {value}: fastdpo trains with AdamW (see --update_rounding for bfloat16 weights). "
                       "Pass --optim adamw_torch or drop the flag.")


FLAGS: dict[str, Foreign] = {
    "rlhf_type": Foreign("ms-swift: dpo (default), simpo, orpo, cpo or kto (= --loss_type; kto's rows are "
                         "unpaired). With it (or another flag only ms-swift has) the command takes ms-swift's "
                         "defaults for what it leaves out: train_type lora, "
                         "its learning rate, epochs, schedule and step size, SimPO's beta 2 and gamma 1, and the chat "
                         "template for plain-text rows; they are listed when training starts.", _rlhf_type),
    "bf16": Foreign("HF/OpenRLHF: true (or bare) = --torch_dtype bfloat16.", _precision("bfloat16"), bare=True),
    "fp16": Foreign("HF: true (or bare) = --torch_dtype float16.", _precision("float16"), bare=True),
    "optim": Foreign("HF: adamw_torch / adamw_torch_fused (AdamW is what fastdpo uses).", _optim),
    "save_strategy": Foreign("HF: steps (see --save_steps), epoch or no.", _save_strategy),
    "eval_strategy": Foreign("HF: steps (see --eval_steps), epoch or no.", _eval_strategy),
    "evaluation_strategy": Foreign("HF (older name of --eval_strategy).", _eval_strategy),
    "quant_method": Foreign("ms-swift: bnb (bitsandbytes, what --train_type qlora uses), or fp8 with --quant_bits 8 "
                            "(= --train_type lora --fp8_base).", _quant_method),
    "ulysses_num_heads": Foreign("ms-swift Ulysses sequence parallelism over K ranks: = --sequence_parallel_size K "
                                 "--sequence_parallel_mode ulysses (1 = off).", _ulysses_num_heads),
    "ring_attn": Foreign("ms-swift ring attention: true = --sequence_parallel_mode ring (the ranks from "
                         "--sequence_parallel_size).", _ring_attn),
    "ring_attn_window_size": Foreign("ms-swift ring attention's block size: ignored (each rank's whole chunk travels "
                                     "the ring; a model's sliding window is honoured as it is).",
                                     note("ignored; fastdpo's ring passes each rank's whole chunk of keys and values "
                                          "(no sub-block size to set), and a model's own sliding window is honoured "
                                          "in every block.")),
    "offload_optimizer": Foreign("DeepSpeed optimizer offload: not available (false = off).",
                                 offload("offload_optimizer")),
    "offload_param": Foreign("DeepSpeed parameter offload: not available (false = off).", offload("offload_param")),
    "flash_attn_version": Foreign("ms-swift: ignored (on CUDA, attention runs FlashAttention's varlen kernel).",
                                  note("ignored; on CUDA, attention runs FlashAttention's variable-length kernel "
                                       "through torch (--attn_impl varlen).")),
    "use_liger_kernel": Foreign("HF/ms-swift/OpenRLHF: ignored (log-probs are chunked; norms and MLPs use --kernels).",
                                LIGER, bare=True),
    "packing": Foreign("ms-swift: ignored (pairs are always packed; see --padding_free).",
                       note("ignored; pairs are always packed (--padding_free).")),
    "lazy_tokenize": Foreign("ms-swift: ignored (tokenisation is cached; see --streaming).",
                             note("ignored; tokenisation runs once and is cached (--streaming reads lazily).")),
    "zero3_save_16bit_model": Foreign("ms-swift: ignored (the final model is always saved whole, in the training dtype).",
                                      note("ignored; the final model is always saved whole (not as shards), in "
                                            "the training dtype.")),
    "save_only_model": Foreign("HF: ignored (checkpoints keep optimizer state for exact resume).",
                               note("ignored; checkpoints keep the optimizer state so resume is exact.")),
    "load_best_model_at_end": Foreign("HF: ignored (the best checkpoint is tracked and named at the end).",
                                      note("ignored; the best checkpoint is tracked and named in the summary.")),
    "gradient_checkpointing_kwargs": Foreign("HF: ignored (fastdpo picks the form: reentrant on one process where "
                                             "it serves, else non-reentrant).",
                                             note("ignored; fastdpo picks the checkpointing form itself (reentrant on "
                                                  "one process where it serves, else non-reentrant).")),
    "ddp_find_unused_parameters": Foreign("HF: ignored.", note("ignored.")),
    "data_seed": Foreign("HF: ignored (--seed drives the data order).", note("ignored; --seed drives the data order.")),
    "use_hf": Foreign("ms-swift: ignored (hub ids load from the Hugging Face hub).",
                      note("ignored; hub ids load from the Hugging Face hub.")),
    "add_version": Foreign("ms-swift: ignored (--output_dir is used as given).",
                           note("ignored; --output_dir is used as given.")),
    "check_model": Foreign("ms-swift: ignored.", note("ignored.")),
    "drop_last": Foreign("= --dataloader_drop_last.", maps_to("dataloader_drop_last", bool)),
    "hub_strategy": Foreign("HF: fastdpo pushes final/ once, at the end (--push_to_hub).", note(
        "fastdpo uploads final/ once, at the end of training (--push_to_hub); checkpoints stay local.")),
    "hub_token": Foreign("HF: refused (a token on the command line lands in config files and shell history).", refuse_on(
        "--hub_token: give the token as HF_TOKEN or log in once with `hf auth login`; a token on the command line "
        "lands in shell history and saved configs.")),
    "master_port": Foreign("DeepSpeed / torchrun: the port of the workers' rendezvous (= MASTER_PORT) when "
                           "NPROC_PER_NODE=N starts them.", _master_port),
}


# ms-swift's defaults where fastdpo's differ (RLHFArguments, TrainArguments, its Seq2SeqTrainingArguments overrides);
# the learning rate follows --train_type (1e-5 full, 1e-4 adapters); a step is 16 pairs (1 per device x
# ceil(16 / world size) accumulation steps); HF's three epochs unless --max_steps
DEFAULTS = {"train_type": "lora", "lr_scheduler_type": "cosine", "weight_decay": 0.1, "adam_beta2": 0.95}
RLHF_DEFAULTS = {"simpo": {"beta": 2.0, "simpo_gamma": 1.0}}
PAIRS_PER_STEP = 16
# flags only ms-swift's scripts have: they make a command ms-swift's (the HF TrainingArguments ones do not)
SCRIPT_FLAGS = frozenset({"rlhf_type", "quant_method", "use_hf", "add_version", "check_model", "lazy_tokenize",
                          "ulysses_num_heads", "ring_attn", "ring_attn_window_size",
                          "flash_attn_version", "zero3_save_16bit_model"})


def _step_size(values: dict) -> list[str]:
    """ms-swift's optimizer step: --per_device_train_batch_size (default 1) x --gradient_accumulation_steps (default
    ceil(16 / batch / data-parallel ranks)) x data-parallel ranks pairs (the world size over the sequence-parallel
    size). Micro-batches do not change fastdpo's step (accumulation is
    exact), so without a batch size of its own the step is formed from fewer, larger micro-batches."""
    from fastdpo.config.launch import world_size
    from fastdpo.config.train import TrainConfig

    if "gradient_accumulation_steps" in values:
        return []
    world = world_size()
    sp = number(values.get("sequence_parallel_size", 1), int)
    if sp > 1 and world % sp == 0:  # the ranks of a sequence-parallel group share their micro-batches
        world //= sp
    if "per_device_train_batch_size" in values:
        batch = number(values["per_device_train_batch_size"], int)
        values["gradient_accumulation_steps"] = max(1, -(-PAIRS_PER_STEP // (batch * world)))
        return [f"--gradient_accumulation_steps {values['gradient_accumulation_steps']}"]
    per_rank = -(-PAIRS_PER_STEP // world)  # ms-swift: 1 pair x this many accumulation steps on each rank
    batch = min(TrainConfig.per_device_train_batch_size, per_rank)
    values["per_device_train_batch_size"], values["gradient_accumulation_steps"] = batch, -(-per_rank // batch)
    return [f"--per_device_train_batch_size {batch} --gradient_accumulation_steps "
            f"{values['gradient_accumulation_steps']} ({per_rank * world} pairs per step, as ms-swift's 1 x "
            f"{per_rank}{f' x {world} data-parallel ranks' if world > 1 else ''})"]


def _rlhf_meaning(rlhf: str, values: dict) -> list[str]:
    """What ms-swift's --rlhf_type sets beyond the loss: SimPO's beta and gamma, and its NLL term (ms-swift trains
    SimPO as TRL's CPOTrainer does, with --cpo_alpha 1 x the chosen NLL: CPO-SimPO); ORPO's --beta is its lambda."""
    out = adopt(values, RLHF_DEFAULTS.get(rlhf, {}))
    if rlhf == "simpo" and "rpo_alpha" not in values:
        alpha = number(values.get("cpo_alpha", 1.0))
        if alpha > 0:
            values["rpo_alpha"] = alpha
            out.append(f"--rpo_alpha {alpha} (ms-swift's SimPO adds --cpo_alpha {alpha:g} x the NLL of chosen, "
                       "CPO-SimPO; --cpo_alpha 0 trains plain SimPO)")
    if rlhf == "orpo" and "beta" in values and "orpo_alpha" not in values:
        values["orpo_alpha"] = values["beta"]
        out.append(f"--orpo_alpha {values['beta']} (ms-swift's --beta is ORPO's lambda)")
    return out


def finish(given: dict, values: dict) -> list[str]:
    """ms-swift's meaning for what a command with its flags leaves out, listed in one block (flags given win)."""
    rlhf = str(given.get("rlhf_type", "dpo")).lower()
    adopted = _rlhf_meaning(rlhf, values) + adopt(values, DEFAULTS)
    adopted += adopt(values, {"learning_rate": 1e-5 if values["train_type"] == "full" else 1e-4})
    if not number(values.get("max_steps", -1)) > 0:
        adopted += adopt(values, {"num_train_epochs": 3.0})
    adopted += _step_size(values)
    if not values.get("input_template") and "apply_chat_template" not in values:
        values["apply_chat_template"] = True
        adopted.append("--apply_chat_template true (plain-text prompts are user turns through the chat template, as "
                       "ms-swift reads them)")
    if not adopted:
        return []
    return ["ms-swift's meaning for what the command leaves out (flags given win):\n  " + "\n  ".join(adopted)]


SWIFT = Source("accepted from ms-swift / HF TrainingArguments scripts", FLAGS, finish, markers=SCRIPT_FLAGS)
