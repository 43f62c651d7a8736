"""The sections of the commands that run a trained model (`fastdpo infer`, `eval`, the demo): which model to load
(`ModelArgs`: a base, optionally an adapter or a fastdpo checkpoint on top) and how answers are sampled
(`GenerationArgs`)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from fastdpo.config.fields import Section, check_choice, option
from fastdpo.config.sections.model import DTYPES
from fastdpo.errors import FastDPOError

log = logging.getLogger("fastdpo")


@dataclass
class ModelArgs(Section):
    """Which model to run: a base, optionally with a PEFT adapter or a fastdpo checkpoint on top."""

    name = "model"
    title = "Model"

    model: str = option("", "Base model: local HF model dir or hub id (default with an adapter: the base its "
                        "adapter_config.json names).")
    adapters: str = option("", "PEFT adapter dir (e.g. a LoRA run's output_dir/final or checkpoint-N) to apply to --model.")
    checkpoint: str = option("", "fastdpo checkpoint or final dir: a LoRA adapter (applied to --model) or a full model.")
    torch_dtype: str = option("auto", "float32|bfloat16|float16|auto (bf16 on GPU, fp32 on CPU).")
    device: str = option("auto", "auto|cpu|cuda|cuda:N.")
    trust_remote_code: bool = option(False, "Allow model code from the model dir / hub (off unless asked).")

    def validate_model(self) -> None:
        if not self.model:
            tuned = self.adapters or self.checkpoint
            if not tuned or not (Path(tuned).expanduser() / "adapter_config.json").is_file():
                raise FastDPOError("--model is required: the base model (local HF model dir or hub id).")
            self.model = base_of_adapter(tuned, "adapters" if self.adapters else "checkpoint")
        if self.adapters and self.checkpoint:
            raise FastDPOError("Give --adapters or --checkpoint, not both (--checkpoint accepts an adapter dir too).")
        check_choice("torch_dtype", self.torch_dtype, DTYPES)


@dataclass
class GenerationArgs(Section):
    """Sampling settings; temperature 0 is greedy decoding (deterministic)."""

    name = "generation"
    title = "Generation"

    max_new_tokens: int = option(256, "Most tokens to generate per answer.")
    temperature: float = option(0.0, "Sampling temperature; 0 = greedy (deterministic).")
    top_p: float = option(1.0, "Nucleus sampling mass (1 = off).")
    top_k: int = option(0, "Sample among the K most likely tokens (0 = off).")
    repetition_penalty: float = option(1.0, "Repetition penalty (1 = off).")
    system: str = option("", "System prompt (needs a tokenizer with a chat template).")
    use_chat_template: bool = option(True, "Format prompts with the tokenizer's chat template when it has one.")
    max_batch_size: int = option(16, "Prompts generated together in one batch.")
    seed: int = option(42, "Seed for sampling (temperature > 0).")

    def validate_generation(self) -> None:
        if self.max_new_tokens < 1:
            raise FastDPOError(f"--max_new_tokens must be >= 1, got {self.max_new_tokens}.")
        if self.temperature < 0:
            raise FastDPOError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise FastDPOError(f"--top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise FastDPOError(f"--top_k must be >= 0 (0 = off), got {self.top_k}.")
        if self.max_batch_size < 1:
            raise FastDPOError(f"--max_batch_size must be >= 1, got {self.max_batch_size}.")


def base_of_adapter(adapter: str, flag: str) -> str:
    """The base model an adapter dir names (PEFT's `base_model_name_or_path`), used when --model is left out, as
    ms-swift does; a clear error when it names none, or a local path that is not there."""
    path = Path(adapter).expanduser() / "adapter_config.json"
    if not path.is_file():
        raise FastDPOError(f"--{flag} {adapter}: no adapter_config.json there, so not a PEFT adapter dir (a LoRA run's "
                           "output_dir/final or checkpoint-N).")
    try:
        named = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        named = {}
    base = named.get("base_model_name_or_path") if isinstance(named, dict) else None
    if not isinstance(base, str) or not base:
        raise FastDPOError(f"--model is required: {adapter}/adapter_config.json names no base model. Pass the model "
                           "the adapter was trained on.")
    local = base.startswith(("/", ".", "~")) or base.count("/") > 1
    if local and not Path(base).expanduser().exists():
        raise FastDPOError(f"--model is required: --{flag} {adapter} was trained on {base}, which is not there from "
                           "here. Pass --model with that model's directory.")
    log.info("--model %s: the base model --%s %s names.", base, flag, adapter)
    return base
