"""The model section: which model trains and in what precision, and the adapters LoRA and QLoRA train."""

from __future__ import annotations

from dataclasses import dataclass

from fastdpo.config.fields import Section, check_choice, option
from fastdpo.errors import FastDPOError

DTYPES = ("float32", "bfloat16", "float16", "auto")


@dataclass
class ModelSection(Section):
    """Which model trains, and in what precision."""

    name = "model"
    title = "Model"

    model: str = option("", "Local HF model dir or hub id of the policy.")
    ref_model: str = option("", "Reference model (dir or hub id). Default: a frozen copy of --model (or adapters off).")
    model_type: str = option("", "Expected model_type (e.g. qwen3, llama); checked against the model's config.")
    torch_dtype: str = option("auto", "Parameter dtype: float32|bfloat16|float16|auto (bf16 on GPU, fp32 on CPU).")
    trust_remote_code: bool = option(False, "Allow model code from the model dir / hub (off unless asked).")

    def validate_model(self) -> None:
        if not self.model:
            raise FastDPOError("--model is required: a local HF model dir or a hub id.")
        check_choice("torch_dtype", self.torch_dtype, DTYPES)


@dataclass
class LoraSection(Section):
    """Full fine-tuning, or LoRA / QLoRA adapters and how they are shaped."""

    name = "lora"
    title = "LoRA and QLoRA"

    train_type: str = option("full", "full|lora|qlora (qlora: LoRA on a 4-bit nf4 base; CUDA + bitsandbytes).")
    quant_bits: int = option(4, "Bits of the quantised base for --train_type qlora (4: nf4 with double quantisation; 8).")
    lora_rank: int = option(8, "LoRA rank.")
    lora_alpha: int = option(32, "LoRA alpha.")
    lora_dropout: float = option(0.05, "LoRA dropout.")
    target_modules: str = option("all-linear", "LoRA targets: all-linear, default (PEFT's modules for the architecture, "
                                 "e.g. q_proj,v_proj) or module names (comma-separated or several values).", nargs="+")
    use_dora: bool = option(False, "LoRA: DoRA adapters (weight-decomposed: a trained magnitude per output row beside A "
                            "and B), through PEFT's own forward (the fused LoRA path serves plain LoRA only).")
    adapters: str = option("", "LoRA: start the trained adapter from this PEFT adapter dir instead of a fresh one.")
    freeze_vit: bool = option(True, "Vision-language models: keep the vision tower (its patch embedding and blocks) "
                              "frozen; false trains it too (full fine-tuning: its weights; LoRA: adapters on its "
                              "linear layers).")
    freeze_aligner: bool = option(True, "Vision-language models: keep the aligner (what projects image features "
                                  "into the language model: Qwen2-VL's patch merger, Qwen3-VL's merger and DeepStack "
                                  "mergers, LLaVA's multi_modal_projector) frozen; false trains it too.")
    freeze_llm: bool = option(False, "Vision-language models: keep the language model (and its output head) frozen, "
                              "training only what the other --freeze_* flags leave trainable.")
    ref_adapters: str = option("", "A PEFT adapter dir applied to --model to form the reference (e.g. the SFT adapter).")
    fp8_base: bool = option(False, "LoRA: hold the frozen base's decoder projections in FP8 (e4m3, row-wise scales; half "
                            "the bytes of bf16) and run their products in FP8. CUDA GPUs of compute capability 8.9+ "
                            "(Ada, Hopper); the policy and the reference (adapters off) share the FP8 base.")
    fp8: bool = option(False, "Full fine-tuning: run the decoder projections' products in FP8 (e4m3; the output and "
                       "the input's gradient; the weights, their gradients and the optimizer stay as they are). CUDA "
                       "GPUs of compute capability 8.9+ (Ada, Hopper); the frozen reference copy computes the same FP8 "
                       "products. With LoRA, --fp8_base.")
    fp8_recipe: str = option("rowwise", "--fp8's scaling: rowwise (a scale per token and per output row) or tensorwise "
                             "(one per tensor).")

    @property
    def freezes_default(self) -> bool:
        """The --freeze_* flags are at their defaults (what a text-only model allows)."""
        return (self.freeze_vit, self.freeze_aligner, self.freeze_llm) == (True, True, False)

    @property
    def uses_lora(self) -> bool:
        """LoRA adapters are trained (on a full-precision or a quantised base)."""
        return self.train_type in ("lora", "qlora")

    def validate_lora(self) -> None:
        check_choice("train_type", self.train_type, ("full", "lora", "qlora"))
        check_choice("fp8_recipe", self.fp8_recipe, ("rowwise", "tensorwise"))
        if self.train_type == "qlora" and self.quant_bits not in (4, 8):
            raise FastDPOError(f"--quant_bits must be 4 or 8 for --train_type qlora, got {self.quant_bits}.")
        if self.uses_lora and self.lora_rank < 1:
            raise FastDPOError(f"--lora_rank must be >= 1, got {self.lora_rank}.")
        if self.uses_lora and not 0 <= self.lora_dropout < 1:  # also refuses NaN
            raise FastDPOError(f"--lora_dropout is a drop probability in [0, 1) (0.05 by default, 0 for none), got "
                               f"{self.lora_dropout}.")
        if self.use_dora and not self.uses_lora:
            raise FastDPOError("--use_dora trains DoRA adapters: it needs --train_type lora (or qlora).")
        if self.fp8_base and self.train_type == "full":
            raise FastDPOError("--fp8_base holds the frozen base of LoRA in FP8, but --train_type full trains every "
                               "weight. For FP8 products in a full fine-tune use --fp8; with LoRA, --train_type lora "
                               "--fp8_base.")
        if self.fp8 and self.train_type != "full":
            raise FastDPOError(f"--fp8 trains a full fine-tune with FP8 products; with --train_type {self.train_type} "
                               "the base is frozen: hold it in FP8 with --train_type lora --fp8_base instead.")
        if self.fp8_base and self.train_type == "qlora":
            raise FastDPOError("--fp8_base and --train_type qlora both quantise the frozen base (FP8 / bitsandbytes): "
                               "choose one, --train_type lora --fp8_base or --train_type qlora.")
        if self.adapters and not self.uses_lora:
            raise FastDPOError("--adapters starts a LoRA adapter from a saved one: it needs --train_type lora.")
