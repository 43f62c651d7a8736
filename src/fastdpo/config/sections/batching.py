"""The batching and memory section: pairs and tokens per micro-batch, the layout and attention, activation
checkpointing and the kernels."""

from __future__ import annotations

from dataclasses import dataclass

from fastdpo.config.fields import Section, at_least, check_choice, option
from fastdpo.errors import FastDPOError

KERNELS = ("auto", "triton", "torch")
ATTN_IMPLS = ("auto", "varlen", "flex", "dense", "padded", "flash_attn", "flash_attention_2", "sdpa", "eager")
CHECKPOINT_POLICIES = ("none", "full", "ffn", "attn")


@dataclass
class BatchingSection(Section):
    """How a step's pairs become micro-batches, and what they cost in memory and time."""

    name = "batching"
    title = "Batching and memory"

    per_device_train_batch_size: int = option(8, "Pairs per micro-batch (without a token budget).")
    gradient_accumulation_steps: int = option(1, "Micro-steps per optimizer step. A step covers bs x accum x world pairs.")
    max_tokens_per_batch: int = option(0, "Token budget per packed micro-batch (0: with FlexAttention, on CUDA, about "
                                       "per_device_train_batch_size pairs of the data's tokens, logged; otherwise "
                                       "per_device_train_batch_size pairs).")
    padding_free: bool = option(True, "Packed, prefix-shared layout (true) or the padded two-rows-per-pair path (false).")
    group_prompts: bool = option(True, "Packed layout: the pairs of a micro-batch with the same prompt (token ids) share one "
                                 "run, the prompt and each distinct completion computed once; the same losses and "
                                 "gradients as one run per pair. false: one run per pair.")
    attn_impl: str = option("auto", "auto|varlen|flex|dense|padded. auto: varlen on CUDA for bf16/fp16 models (flex for "
                            "float32), dense on CPU.")
    gradient_checkpointing: str = option("fit", "Activation checkpointing: fit|none|full|ffn|attn|every:K|keep:N|auto (true "
                                         "or no value = full; keep:N: full but the last N decoder layers, which keep "
                                         "their activations). fit: the fastest of none, ffn, keep:N and full whose peak "
                                         "memory, estimated from one probe forward of the model, fits the GPU at the data's "
                                         "largest micro-batch (with a token budget if even full does not, and lean "
                                         "norms and MLPs that keep fewer bytes when none does not); none off CUDA. "
                                         "auto: measure training steps of each instead.", bare="true")
    max_memory_gib: float = option(0.0, "Memory limit for `--gradient_checkpointing fit|auto` / `fastdpo tune`. 0: "
                                   "for fit, what training holds plus about the weights' size for activations (a "
                                   "peak like other trainers' defaults), at most 90% of the GPU; for auto and tune, 90% "
                                   "of the GPU. A higher limit buys speed.")
    activation_offloading: bool = option(False, "Move activations saved for backward to pinned CPU memory (slower; pair "
                                         "with --gradient_checkpointing none or ffn).")
    torch_compile: bool = option(False, "Compile each decoder layer with torch.compile (CUDA; static token budget).")
    kernels: str = option("auto", "auto|triton|torch: the norms, SwiGLU MLPs, rotary embeddings and log-prob head. triton: "
                          "one-pass Triton kernels that keep "
                          "fewer bytes for the backward (built once per width, not per length); torch: the model's own "
                          "layers (the lean torch ones when --gradient_checkpointing fit is short of memory). auto: "
                          "triton on CUDA when Triton is installed and without --torch_compile (whose compiler fuses "
                          "them itself). LoRA layers: three GEMMs and no pass over the output, except with torch (PEFT's "
                          "own forward).")

    @property
    def pairs_per_step(self) -> int:
        """Pairs per optimizer step on one rank (world size multiplies it)."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    def validate_batching(self) -> None:
        at_least(self, 1, "per_device_train_batch_size", "gradient_accumulation_steps")
        if self.max_tokens_per_batch and self.max_tokens_per_batch < 16:
            raise FastDPOError("--max_tokens_per_batch must be 0 (off) or at least 16.")
        check_choice("attn_impl", self.attn_impl, ATTN_IMPLS)
        check_choice("kernels", self.kernels, KERNELS)
        if self.gradient_checkpointing not in ("auto", "fit"):
            checkpoint_policy(self.gradient_checkpointing)  # raises on a bad value


def checkpoint_policy(value: str, flag: str = "gradient_checkpointing") -> tuple[str, int]:
    """Parse a checkpointing policy into (policy, K). `true` means full, `false` none, `every:K` every K-th layer,
    `keep:N` every layer but the last N (K = N).
    `flag` names the option the value came from (only --gradient_checkpointing also takes `auto`, resolved
    before this)."""
    v = str(value).strip().lower()
    if v in ("true", "1", "yes"):
        return "full", 1
    if v in ("false", "0", "no", ""):
        return "none", 1
    if v.startswith("keep:"):
        n = v.split(":", 1)[1]
        if not n.isdigit() or int(n) < 1:
            raise FastDPOError(f"--{flag} {value!r}: N in keep:N (layers not recomputed) must be an integer >= 1.")
        return "keep", int(n)
    if v.startswith("every:"):
        try:
            k = int(v.split(":", 1)[1])
        except ValueError:
            k = 0
        if k < 1:
            raise FastDPOError(f"--{flag} {value!r}: K in every:K must be an integer >= 1.")
        return "every", k
    if v not in CHECKPOINT_POLICIES:
        accepted = f"true, false, {', '.join(CHECKPOINT_POLICIES)}, every:K, keep:N"
        if flag == "gradient_checkpointing":
            accepted += ", fit, auto"
        raise FastDPOError(f"--{flag} {value!r} is not one of: {accepted}.")
    return v, 1


# ---------------------------------------------------------------- value parsing shared with the flag mapping
