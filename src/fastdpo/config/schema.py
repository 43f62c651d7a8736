"""The one training configuration: typed fields, defaults, validation, YAML and command-line mapping.

Flag names follow ms-swift / HF TrainingArguments. Every field is settable from `--config run.yaml`; the command
line wins over the file. The resolved configuration is saved with every checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from fastdpo.config.parallel import parallel_plan
from fastdpo.errors import FastDPOError

log = logging.getLogger("fastdpo")
LR_SCHEDULERS = ("linear", "cosine", "cosine_with_min_lr", "constant", "constant_with_warmup")
KERNELS = ("auto", "triton", "torch")
ATTN_IMPLS = ("auto", "varlen", "flex", "dense", "padded", "flash_attn", "flash_attention_2", "sdpa", "eager")
DTYPES = ("float32", "bfloat16", "float16", "auto")
MAX_LR = 1e6  # far past any useful rate, far below where AdamW's step size overflows float32
FULL_LEARNING_RATE, LORA_LEARNING_RATE = 5e-7, 5e-6  # --learning_rate left out (TRL's LoRA DPO example uses 5e-6)
CHECKPOINT_POLICIES = ("none", "full", "ffn", "attn")


def _f(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


# ---------------------------------------------------------------- names other layers implement

def registered_losses() -> dict:
    """The losses by --loss_type name, with their traits (`fastdpo.losses.LOSSES`: each loss registers itself where
    it is defined). Imported on use, not at the top of this module: the losses load torch, and `fastdpo --help` must
    not. The import points down the floors (the losses sit below config)."""
    from fastdpo.losses import LOSSES

    return LOSSES


F_DIVERGENCE_TYPES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")

# Metrics of held-out pairs that can rank checkpoints (`--metric_for_best_model`, with or without `eval_`).
PAIR_METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                "logps/rejected")


def check_metric_name(name: str) -> None:
    bare = name.removeprefix("eval_")
    if bare not in PAIR_METRICS:
        raise FastDPOError(f"--metric_for_best_model {name!r} is not an eval metric. Choose from: "
                           f"{', '.join(PAIR_METRICS)} (with or without the eval_ prefix).")


REPORT_TARGETS = ("tensorboard", "wandb", "mlflow", "trackio", "swanlab")
_PACKAGES = {t: t for t in REPORT_TARGETS}  # the module each sink imports, and the package that installs it


def report_targets(value: str) -> list[str]:
    """Parse --report_to: `none`, `all` (every installed one), or a comma-separated list of REPORT_TARGETS."""
    v = str(value).strip().lower()
    if v in ("", "none"):
        return []
    if v == "all":
        return [t for t in REPORT_TARGETS if importlib.util.find_spec(_PACKAGES[t]) is not None]
    names = [n.strip() for n in v.split(",") if n.strip()]
    for n in names:
        if n not in REPORT_TARGETS:
            raise FastDPOError(f"--report_to {value!r}: {n!r} is not one of: none, all, {', '.join(REPORT_TARGETS)}.")
    return names


def check_installed(targets: list[str]) -> None:
    """Fail before training (not after hours of it) when a requested sink's package is missing."""
    for t in targets:
        if importlib.util.find_spec(_PACKAGES[t]) is None:
            raise FastDPOError(f"--report_to {t}: the {_PACKAGES[t]} package is not installed. "
                               f"Run `pip install {_PACKAGES[t]}`, or drop {t} from --report_to.")


def parse_steps(spec: str) -> tuple[int, int] | None:
    """'6-8' -> (6, 8); '7' -> (7, 7); '' -> None. Steps count from 1, like the logged step numbers."""
    if not spec:
        return None
    lo, _, hi = spec.partition("-")
    try:
        first, last = int(lo), int(hi or lo)
    except ValueError:
        first = last = 0
    if first < 1 or last < first:
        raise FastDPOError(f"--profile_steps {spec!r}: give one step or a range of optimizer steps, e.g. 6-8 (from 1).")
    return first, last


def require_matplotlib(what: str) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise FastDPOError(f"{what} needs matplotlib, which is not installed. Run `pip install matplotlib`.")


@dataclass
class ModelSection:
    """Which model trains, in what precision, and with which adapters."""

    model: str = _f("", "Local HF model dir or hub id of the policy.")
    ref_model: str = _f("", "Reference model (dir or hub id). Default: a frozen copy of --model (or adapters off).")
    model_type: str = _f("", "Expected model_type (e.g. qwen3, llama); checked against the model's config.")
    torch_dtype: str = _f("auto", "Parameter dtype: float32|bfloat16|float16|auto (bf16 on GPU, fp32 on CPU).")
    trust_remote_code: bool = _f(False, "Allow model code from the model dir / hub (off unless asked).")
    train_type: str = _f("full", "full|lora|qlora (qlora: LoRA on a 4-bit nf4 base; CUDA + bitsandbytes).")
    quant_bits: int = _f(4, "Bits of the quantised base for --train_type qlora (4: nf4 with double quantisation; 8).")
    lora_rank: int = _f(8, "LoRA rank.")
    lora_alpha: int = _f(32, "LoRA alpha.")
    lora_dropout: float = _f(0.05, "LoRA dropout.")
    target_modules: str = _f("all-linear", "LoRA targets: all-linear, default (PEFT's modules for the architecture, "
                             "e.g. q_proj,v_proj) or module names (comma-separated or several values).", nargs="+")
    use_dora: bool = _f(False, "LoRA: DoRA adapters (weight-decomposed: a trained magnitude per output row beside A "
                        "and B), through PEFT's own forward (the fused LoRA path serves plain LoRA only).")
    adapters: str = _f("", "LoRA: start the trained adapter from this PEFT adapter dir instead of a fresh one.")
    ref_adapters: str = _f("", "A PEFT adapter dir applied to --model to form the reference (e.g. the SFT adapter).")


@dataclass
class DataReading:
    """How rows are read and cut to length: one section for training and `fastdpo eval`, so both read a dataset the
    same way (and a run's saved reading can be adopted by eval)."""

    split: str = _f("train", "Split to read from HF datasets (hub ids, dataset repos, save_to_disk dirs).")
    max_length: int = _f(2048, "Max tokens of prompt+completion per sequence (see --truncation_strategy).")
    truncation_strategy: str = _f("right", "Over --max_length: right = cut completions, dropping pairs whose prompt "
                                  "alone fills it (default, TRL keep_start); left = trim the prompt from the left, "
                                  "completions whole; delete = drop the pair.")
    max_prompt_length: int = _f(0, "Keep the last N prompt tokens (0: off; with delete, longer pairs are dropped).")
    max_completion_length: int = _f(0, "Keep the first N completion tokens (0: off; with delete, longer pairs are dropped).")
    template: str = _f("", "Chat template for conversational rows: chatml|llama3|identity|hh or a Jinja file "
                       "(default: the tokenizer's chat_template).")
    columns: dict = _f({}, "Dataset columns renamed to fastdpo's before rows are read (as ms-swift): a JSON object "
                       "{dataset column: fastdpo column}, e.g. '{\"question\": \"prompt\", \"good\": \"chosen\", "
                       "\"bad\": \"rejected\"}' (a mapping in YAML). Applies to every dataset, --val_dataset too.")
    dataset_info: dict = _f({}, "Datasets read with their own columns, row format and sharegpt tags, keyed by the "
                            "--dataset / --val_dataset entry: {ENTRY: {name, formatting: alpaca|sharegpt, columns: "
                            "{dataset column: fastdpo column}, tags: {role_tag, content_tag, user_tag, ...}}}; only "
                            "the columns named are read, --columns does not apply. Filled from LLaMA-Factory's "
                            "dataset_dir/dataset_info.json.")
    input_template: str = _f("", "OpenRLHF: text around plain-text prompts, {} standing for the prompt, e.g. "
                             "$'User: {}\\nAssistant: ' (message-list rows use the chat template instead).")
    apply_chat_template: bool = _f(False, "OpenRLHF: plain-text rows become a user turn and assistant replies, so the "
                                   "chat template applies to them too (message-list rows always go through it).")
    max_row_mb: float = _f(16.0, "Largest row read from a data file, in MiB (a JSONL line, a JSON array element, a CSV "
                           "record): a larger one is an error naming its line, found before it is held in memory.")
    template_timeout: float = _f(10.0, "Seconds the chat template may take to render one row (0: no limit): a longer "
                                 "rendering is an error naming the row and the template, not a silent hang.")

    def validate_reading(self) -> None:
        """The reading flags: choices and bounds, the chat template, columns and per-dataset readings."""
        from fastdpo.data.columns import check_row_flags
        from fastdpo.data.template import resolve_template

        _choice("truncation_strategy", self.truncation_strategy, ("right", "left", "delete"))
        if self.max_length < 1:
            raise FastDPOError(f"--max_length must be >= 1, got {self.max_length}.")
        for name in ("max_prompt_length", "max_completion_length"):
            if getattr(self, name) < 0:
                raise FastDPOError(f"--{name} must be >= 0, got {getattr(self, name)}.")
        if not self.max_row_mb > 0:
            raise FastDPOError(f"--max_row_mb must be > 0, got {self.max_row_mb}.")
        if not self.template_timeout >= 0:
            raise FastDPOError(f"--template_timeout must be >= 0 seconds (0: no limit), got {self.template_timeout}.")
        resolve_template(self.template)  # raises on an unknown name or a missing file
        check_row_flags(self)


@dataclass
class TrainConfig(DataReading, ModelSection):
    """Everything a training run is: the model and reading sections above, then the rest by concern."""

    # data
    dataset: list = _f([], "Datasets: JSONL/JSON/Parquet/CSV files or dirs, HF dataset ids or saved dirs "
                       "(`name:subset`); `path#N` takes N rows. Row formats: see the README. In Python also a list of "
                       "row dicts or an HF Dataset / DatasetDict / IterableDataset.", nargs="+")
    system: str = _f("", "System prompt for conversational rows that have none.")
    max_samples: int = _f(0, "Keep the first N rows of each dataset, --val_dataset's too, after `#N` sampling (0: all), "
                          "as LLaMA-Factory's and OpenRLHF's max_samples (OpenRLHF also caps several datasets' sum).")
    strict: bool = _f(True, "Invalid rows stop the run with one error per dataset (true), or are skipped, counted by "
                      "reason and written to rejects.jsonl in --output_dir (false; ms-swift's default).")
    dataset_num_proc: int = _f(1, "Processes that tokenise the dataset.")
    load_from_cache_file: bool = _f(True, "Reuse tokenised data cached under a fingerprint of data, tokenizer, settings.")
    dataset_cache_dir: str = _f("", "Tokenisation cache dir (default: $FASTDPO_CACHE_DIR, else ~/.cache/fastdpo).")
    streaming: bool = _f(False, "Read and tokenise lazily, for data larger than memory; needs --max_steps.")
    shuffle: bool = _f(True, "Shuffle the pairs each epoch (seeded by --seed); false keeps the dataset order.")
    shuffle_buffer_size: int = _f(10000, "Pairs in the seeded shuffle buffer when streaming.")
    dataloader_num_workers: int = _f(0, "Processes that read and tokenise ahead of training when streaming.")
    dataloader_drop_last: bool = _f(False, "Skip each epoch's last step when it would have fewer pairs than the others "
                                    "(off: it trains on the pairs left). Ignored with --streaming.")
    # batching
    per_device_train_batch_size: int = _f(8, "Pairs per micro-batch (without a token budget).")
    gradient_accumulation_steps: int = _f(1, "Micro-steps per optimizer step. A step covers bs x accum x world pairs.")
    max_tokens_per_batch: int = _f(0, "Token budget per packed micro-batch (0: with FlexAttention, on CUDA, about "
                                   "per_device_train_batch_size pairs of the data's tokens, logged; otherwise "
                                   "per_device_train_batch_size pairs).")
    padding_free: bool = _f(True, "Packed, prefix-shared layout (true) or the padded two-rows-per-pair path (false).")
    attn_impl: str = _f("auto", "auto|varlen|flex|dense|padded. auto: varlen on CUDA for bf16/fp16 models (flex for "
                        "float32), dense on CPU.")
    gradient_checkpointing: str = _f("fit", "Activation checkpointing: fit|none|full|ffn|attn|every:K|keep:N|auto (true "
                                     "or no value = full; keep:N: full but the last N decoder layers, which keep "
                                     "their activations). fit: the fastest of none, ffn, keep:N and full whose peak "
                                     "memory, estimated from one probe forward of the model, fits the GPU at the data's "
                                     "largest micro-batch (with a token budget if even full does not, and lean "
                                     "norms and MLPs that keep fewer bytes when none does not); none off CUDA. "
                                     "auto: measure training steps of each instead.", bare="true")
    max_memory_gib: float = _f(0.0, "Memory limit for `--gradient_checkpointing fit|auto` / `fastdpo tune`. 0: "
                               "for fit, what training holds plus about the weights' size for activations (a "
                               "peak like other trainers' defaults), at most 90% of the GPU; for auto and tune, 90% "
                               "of the GPU. A higher limit buys speed.")
    activation_offloading: bool = _f(False, "Move activations saved for backward to pinned CPU memory (slower; pair "
                                            "with --gradient_checkpointing none or ffn).")
    torch_compile: bool = _f(False, "Compile each decoder layer with torch.compile (CUDA; static token budget).")
    kernels: str = _f("auto", "auto|triton|torch: the norms, SwiGLU MLPs, rotary embeddings and log-prob head. triton: "
                      "one-pass Triton kernels that keep "
                      "fewer bytes for the backward (built once per width, not per length); torch: the model's own "
                      "layers (the lean torch ones when --gradient_checkpointing fit is short of memory). auto: "
                      "triton on CUDA when Triton is installed and without --torch_compile (whose compiler fuses "
                      "them itself). LoRA layers: three GEMMs and no pass over the output, except with torch (PEFT's "
                      "own forward).")
    # schedule
    max_steps: int = _f(-1, "Optimizer steps to run (overrides num_train_epochs when > 0).")
    num_train_epochs: float = _f(1.0, "Epochs over the dataset.")
    learning_rate: float | None = _f(None, "Peak learning rate. Unset: 5e-7 for --train_type full, 5e-6 for LoRA and "
                                     "QLoRA, whose adapters start at zero and take larger steps (TRL's and ms-swift's LoRA "
                                     "DPO recipes use 5e-6 to 1e-4; 5e-7 barely moves an adapter).",
                                     default_text="5e-7 (full), 5e-6 (lora, qlora)")
    lr_scheduler_type: str = _f("linear", "linear|cosine|cosine_with_min_lr|constant|constant_with_warmup.")
    lr_scheduler_kwargs: dict = _f({}, "JSON dict for the scheduler, e.g. '{\"min_lr\": 1e-7}'.")
    warmup_ratio: float = _f(0.0, "Fraction of steps for linear warm-up.")
    warmup_steps: int = _f(0, "Warm-up steps (overrides warmup_ratio when > 0).")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    adam_beta1: float = _f(0.9, "AdamW beta1.")
    adam_beta2: float = _f(0.999, "AdamW beta2.")
    adam_epsilon: float = _f(1e-8, "AdamW epsilon.")
    max_grad_norm: float = _f(1.0, "Gradient clipping norm (0 disables).")
    update_rounding: str = _f("stochastic", "How AdamW writes updates into bfloat16 weights: stochastic (unbiased: "
                              "updates far below bf16's precision, as at lr 1e-6, still count on average) or nearest "
                              "(torch.optim.AdamW, fused on CUDA: such updates mostly round away).")
    # loss
    loss_type: str = _f("sigmoid", "Preference loss, or several comma-separated (sigmoid,sft); see the README's table.")
    loss_weights: str = _f("", "Comma-separated weights of the --loss_type terms (default 1 each), e.g. 1,0.1.")
    beta: float = _f(0.1, "DPO beta (strength of the KL constraint; IPO's tau; SimPO/CPO's temperature).")
    label_smoothing: float = _f(0.0, "Label smoothing eps in [0, 0.5): cDPO (sigmoid; TRL 1.16's sigmoid ignores it), "
                                "robust, exo_pair, aot, simpo, cpo.")
    rpo_alpha: float = _f(0.0, "Weight of the NLL(chosen) term (RPO); 0 disables.")
    ld_alpha: float = _f(1.0, "LD-DPO: weight of completion tokens past the length both completions share (1 = off).")
    f_divergence_type: str = _f("reverse_kl", "f-DPO divergence: reverse_kl|forward_kl|js_divergence|alpha_divergence.")
    f_alpha_divergence_coef: float = _f(0.5, "alpha of --f_divergence_type alpha_divergence.")
    use_weighting: bool = _f(False, "WPO: weight each pair by the policy's length-normalised probability of both answers.")
    discopop_tau: float = _f(0.05, "DiscoPOP temperature tau.")
    simpo_gamma: float = _f(0.5, "SimPO target reward margin gamma.")
    cpo_alpha: float = _f(1.0, "CPO: weight of the NLL(chosen) term.")
    orpo_alpha: float = _f(0.1, "ORPO: weight lambda of the odds-ratio term. Its NLL term is TRL's ORPOTrainer's: the "
                           "token mean over the step's chosen sequences, prompt and completion.")
    beta_schedule: str = _f("constant", "constant|kl_adaptive: lower beta while the policy drifts far from the reference.")
    beta_kl_target: float = _f(0.5, "kl_adaptive: drift (mean |log-ratio| per token, nats) above which beta is lowered.")
    beta_kl_window: int = _f(100, "kl_adaptive: optimizer steps in the running mean of the drift.")
    beta_min_ratio: float = _f(0.5, "kl_adaptive: beta never goes below this fraction of --beta.")
    # reference
    precompute_ref_log_probs: bool = _f(False, "Compute reference log-probs once before training (cached on disk) "
                                               "and hold no reference model while training.")
    precompute_ref_batch_size: int = _f(0, "Pairs per forward of the precompute pass (0: 4x per_device_train_batch_size; "
                                           "with --max_tokens_per_batch, a 4x token budget).")
    ref_cache_dir: str = _f("", "Reference cache dir (default $FASTDPO_CACHE_DIR/ref_logps or ~/.cache/fastdpo/ref_logps).")
    sync_ref_model: bool = _f(False, "TR-DPO: every --ref_model_sync_steps, ref = alpha * policy + (1 - alpha) * ref.")
    ref_model_mixup_alpha: float = _f(0.6, "TR-DPO mix-up weight alpha of the policy.")
    ref_model_sync_steps: int = _f(512, "TR-DPO: optimizer steps between reference updates.")
    # evaluation during training
    val_dataset: list = _f([], "Held-out preference files (like --dataset) evaluated during training.", nargs="+")
    val_split: str = _f("train", "Split to read from HF datasets in --val_dataset.")
    split_dataset_ratio: float = _f(0.0, "Hold out this fraction of --dataset for evaluation (without --val_dataset).")
    eval_steps: int = _f(0, "Evaluate every N optimizer updates (0: at every save and at the end) on the held-out pairs.")
    metric_for_best_model: str = _f("loss", "Eval metric ranking checkpoints (loss, rewards/accuracies, ...); the best "
                                    "checkpoint is never rotated away.")
    greater_is_better: bool | None = _f(None, "Whether larger metric_for_best_model is better (default: no for losses).")
    # run
    output_dir: str = _f("output", "Where checkpoints, metrics and the final model go.")
    push_to_hub: bool = _f(False, "At the end, upload final/ (the model, or the LoRA adapter) to a Hugging Face Hub model "
                           "repo, created if missing (huggingface_hub; log in with `hf auth login` or HF_TOKEN).")
    hub_model_id: str = _f("", "The repo --push_to_hub uploads to: NAME or OWNER/NAME (default: the --output_dir name).")
    hub_private_repo: bool = _f(False, "Create the --push_to_hub repo as a private one.")
    seed: int = _f(42, "Seed for data order, init and dropout.")
    logging_steps: int = _f(1, "Log metrics every N optimizer steps.")
    save_steps: int = _f(0, "Checkpoint every N optimizer steps (0: only the final model).")
    save_total_limit: int = _f(0, "Keep at most N checkpoints (0: keep all).")
    resume_from_checkpoint: str = _f("", "Checkpoint dir, or `latest` for the newest one in output_dir whose content "
                                     "matches its manifest (each one skipped is named, with why).")
    resume_ignore_changes: bool = _f(False, "Resume even when the checkpoint was trained with another model, other "
                                     "data, or other settings that change the objective, the optimizer's update or "
                                     "the data order (loss, beta, torch_dtype, weight_decay, adam_beta1, "
                                     "max_grad_norm, seed, max_length, ...): each difference is logged. Off: such a "
                                     "resume is refused, naming each old → new. Learning-rate, length, logging, "
                                     "saving and speed flags may always change.")
    start_over_if_unusable: bool = _f(False, "With --resume_from_checkpoint latest: when output_dir holds checkpoints "
                                      "but none can be resumed (corrupt, incomplete), train from step 0 instead of "
                                      "stopping.")
    trust_unverified_checkpoint: bool = _f(False, "Resume a checkpoint that has no content manifest (state/manifest.json: "
                                           "written by fastdpo before manifests, or removed since); its files are "
                                           "loaded unverified (logged). Off: such a checkpoint is refused.")
    overwrite_output_dir: bool = _f(False, "A new run (no --resume_from_checkpoint) into an output_dir that holds an "
                                    "earlier run's checkpoints, final/ or metrics.jsonl is refused; true removes "
                                    "those outputs first (logged).")
    device: str = _f("auto", "auto|cpu|cuda|cuda:N.")
    disable_progress: bool = _f(False, "No progress bar (logs only).")
    profile_steps: str = _f("", "Profile these optimizer steps, e.g. 6-8: a torch.profiler trace per rank in "
                            "output_dir/profile/ and a summary of the device's time (compute, exposed communication, "
                            "idle).")
    compile_warmup: bool = _f(False, "Before the first step, build the kernels of every micro-batch length (one "
                              "filler forward and backward per length of the --max_tokens_per_batch budget; gradients "
                              "discarded): steps run at full speed from the first, and on several GPUs no rank waits "
                              "for another's compilation.")
    length_buckets: int = _f(16, "Static lengths a packed micro-batch is padded to under a --max_tokens_per_batch "
                             "budget (FlexAttention; varlen needs no padding): the next multiple of budget / N (and "
                             "of 128 tokens). More pad less (batch/padding in the metrics) and build kernels for "
                             "more lengths (each once; up front with --compile_warmup).")
    gc_steps: int = _f(0, "Python's garbage collection in training: what exists when training starts is frozen "
                       "(never walked again) either way; 0 leaves the schedule to Python; N turns automatic "
                       "collection off and collects the young generations at every N-th step on every rank at once "
                       "(pauses logged as gc/pause_ms).")
    profile_memory: bool = _f(False, "With --profile_steps: also record the GPU allocations of those steps; "
                              "output_dir/profile/rank{R}/memory.txt names the peak and what was alive at it, by "
                              "source line (memory_snapshot.pickle: the timeline, for pytorch.org/memory_viz).")
    # monitoring
    report_to: str = _f("none", "Extra metric sinks: none|all (the installed ones)|tensorboard|wandb|mlflow|trackio|"
                        "swanlab, comma-separated (metrics.jsonl and the console are always written).")
    logging_dir: str = _f("", "TensorBoard log dir (default: output_dir/runs).")
    run_name: str = _f("", "Run name for Weights & Biases, MLflow, Trackio and SwanLab (default: the output_dir name).")
    plot: bool = _f(False, "Write the dashboard output_dir/metrics.png (needs matplotlib) at the end of training.")
    alert_patience: int = _f(5, "Logged steps a condition must hold before its alert (negative margins, gradient "
                             "collapse; four times as many for accuracy stuck at 0.5).")
    kl_ratio_threshold: float = _f(0.3, "Alert when kl_ratio (|logratio/mean| per token / rewards/margins, the margin "
                                        "floored at 0.01) exceeds this: the policy drifts from the reference faster "
                                        "than the margin grows, whichever way the log-probs move.")
    max_nonfinite_steps: int = _f(5, "Steps with a NaN/Inf loss or gradient skip their update; stop after this many "
                                  "in a row (0: never stop).")
    ddp_timeout: int = _f(1800, "Seconds a distributed collective may wait before the run fails (torch.distributed "
                          "timeout); the heartbeat names a stalled rank well before that.")
    # scale-out (under torchrun or NPROC_PER_NODE)
    fsdp: str = _f("", "full_shard|shard_grad_op: FSDP2 sharding; no_shard: DDP. Empty: DDP.")
    deepspeed: str = _f("", "zero3 (= --fsdp full_shard), zero2 (= shard_grad_op), or a DeepSpeed JSON: its ZeRO "
                            "stage maps onto FSDP2, the rest is checked or reported.")
    reduce_dtype: str = _f("auto", "Dtype in which bfloat16/float16 gradients are summed across ranks: float32, "
                           "bfloat16 (their own dtype; faster, inexact beyond two ranks), or auto: their own dtype "
                           "on two ranks (the same bits as a float32 sum), float32 on more. float32 gradients are "
                           "always summed in float32.")
    fsdp_layers_per_unit: int = _f(0, "Most consecutive decoder layers sharded as one FSDP2 unit (gathered, reduced "
                                   "and hooked once per forward and backward); units are as few as that allows and "
                                   "equal within one layer. 0: up to 768 MiB of weights per unit.")
    sequence_parallel_size: int = _f(1, "Ranks that share each micro-batch's tokens (sequence parallelism, for pairs "
                                     "too long for one GPU's activations): the world is this many ranks per group "
                                     "times the data-parallel groups. 1: off.")
    sequence_parallel_mode: str = _f("auto", "auto|ulysses|ring: how attention crosses the ranks of a group. ulysses: "
                                     "all-to-all of heads (needs query heads divisible by the size); ring: key/value "
                                     "chunks passed around the group. auto: ulysses where the heads allow, else ring.")
    # not a field: whether the pairs per step are the user's choice (a flag or YAML key), not a default of fastdpo's or
    # of the tool whose flags were given; set by `build_config`, None when unknown (a config built in Python)
    step_chosen = None

    def __post_init__(self) -> None:
        if self.learning_rate is None:  # the rate that trains what --train_type trains
            self.learning_rate = LORA_LEARNING_RATE if self.uses_lora else FULL_LEARNING_RATE
        self.normalise_datasets()

    def normalise_datasets(self) -> None:
        """dataset / val_dataset as lists of specs: a single path, rows in memory and HF datasets become specs."""
        from fastdpo.data.sources import dataset_specs

        self.dataset = dataset_specs(self.dataset, self.split, "dataset")
        self.val_dataset = dataset_specs(self.val_dataset, self.val_split, "val_dataset")

    def validate_training(self) -> None:
        """`validate`, plus what only training (not scoring or generating) cannot do."""
        self.validate()
        check_push(self.push_to_hub, self.hub_model_id)
        if self.uses_lora and self.learning_rate < LORA_LEARNING_RATE / 5:
            log.warning("--learning_rate %g with --train_type %s: LoRA adapters start at zero, and at a full fine-tune's "
                        "rate they barely move (LoRA DPO usually trains at 5e-6 to 1e-4; leave the flag out for %g).",
                        self.learning_rate, self.train_type, LORA_LEARNING_RATE)
        if self.torch_dtype == "float16" and self.train_type == "full":
            raise FastDPOError(
                "--torch_dtype float16 (or --fp16 true) with --train_type full: AdamW's updates and second moments do "
                "not fit in float16 weights (they underflow, and the weights turn to NaN within a few steps). Use "
                "--torch_dtype bfloat16 (fastdpo rounds its updates stochastically), float32, or --train_type lora "
                "on the float16 base (the adapters train in float32).")

    def validate(self) -> None:
        """Check values in one place; raise FastDPOError naming the flag and a fix."""
        if not self.model:
            raise FastDPOError("--model is required: a local HF model dir or a hub id.")
        self.validate_data()
        _choice("train_type", self.train_type, ("full", "lora", "qlora"))
        if self.train_type == "qlora" and self.quant_bits not in (4, 8):
            raise FastDPOError(f"--quant_bits must be 4 or 8 for --train_type qlora, got {self.quant_bits}.")
        _choice("attn_impl", self.attn_impl, ATTN_IMPLS)
        _choice("kernels", self.kernels, KERNELS)
        _choice("torch_dtype", self.torch_dtype, DTYPES)
        _choice("lr_scheduler_type", self.lr_scheduler_type, LR_SCHEDULERS)
        _choice("update_rounding", self.update_rounding, ("stochastic", "nearest"))
        _choice("reduce_dtype", self.reduce_dtype, ("auto", "float32", "bfloat16"))
        parse_steps(self.profile_steps)  # raises on a bad value
        if self.profile_memory and not self.profile_steps:
            raise FastDPOError("--profile_memory records the steps of --profile_steps: add e.g. --profile_steps 6-7.")
        if self.gradient_checkpointing not in ("auto", "fit"):
            checkpoint_policy(self.gradient_checkpointing)  # raises on a bad value
        if self.activation_offloading and (self.deepspeed or self.fsdp not in ("", "no_shard")):
            raise FastDPOError("--activation_offloading works with one GPU or DDP, not with FSDP2 sharding (it would "
                               "copy the gathered weights too). Drop one of the two.")
        if self.gc_steps < 0:
            raise FastDPOError(f"--gc_steps must be >= 0 (0: Python's own collection), got {self.gc_steps}.")
        if not 1 <= self.length_buckets <= 64:
            raise FastDPOError(f"--length_buckets must be between 1 and 64, got {self.length_buckets}.")
        if self.fsdp_layers_per_unit < 0:
            raise FastDPOError(f"--fsdp_layers_per_unit must be >= 0 (0: auto), got {self.fsdp_layers_per_unit}.")
        _choice("sequence_parallel_mode", self.sequence_parallel_mode, ("auto", "ulysses", "ring"))
        if self.sequence_parallel_size < 1:
            raise FastDPOError(f"--sequence_parallel_size must be >= 1 (1: off), got {self.sequence_parallel_size}.")
        if self.sequence_parallel_size > 1 and self.attn_impl == "padded":
            raise FastDPOError("--sequence_parallel_size splits the packed row, which --attn_impl padded does not use. "
                               "Use --attn_impl auto (or dense / varlen / flex).")
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "max_length", "logging_steps"):
            if getattr(self, name) < 1:
                raise FastDPOError(f"--{name} must be >= 1, got {getattr(self, name)}.")
        if self.max_steps <= 0 and self.num_train_epochs <= 0:
            raise FastDPOError("Set --max_steps > 0 or --num_train_epochs > 0.")
        if not 0 <= self.label_smoothing < 0.5:
            raise FastDPOError(f"--label_smoothing must be in [0, 0.5), got {self.label_smoothing}.")
        if self.beta <= 0:
            raise FastDPOError(f"--beta must be > 0, got {self.beta}.")
        if not 0 <= self.warmup_ratio < 1:
            raise FastDPOError(f"--warmup_ratio must be in [0, 1), got {self.warmup_ratio}.")
        if not 0 <= self.learning_rate <= MAX_LR:  # also refuses NaN
            raise FastDPOError(f"--learning_rate must be a number from 0 to {MAX_LR:g} (DPO uses 1e-7 to 1e-4), got "
                               f"{self.learning_rate}.")
        if self.max_tokens_per_batch and self.max_tokens_per_batch < 16:
            raise FastDPOError("--max_tokens_per_batch must be 0 (off) or at least 16.")
        if self.uses_lora and self.lora_rank < 1:
            raise FastDPOError(f"--lora_rank must be >= 1, got {self.lora_rank}.")
        if self.uses_lora and not 0 <= self.lora_dropout < 1:  # also refuses NaN
            raise FastDPOError(f"--lora_dropout is a drop probability in [0, 1) (0.05 by default, 0 for none), got "
                               f"{self.lora_dropout}.")
        check_installed(report_targets(self.report_to))
        if self.plot:
            require_matplotlib("--plot")
        if self.alert_patience < 1:
            raise FastDPOError(f"--alert_patience must be >= 1, got {self.alert_patience}.")
        if self.kl_ratio_threshold <= 0:
            raise FastDPOError(f"--kl_ratio_threshold must be > 0, got {self.kl_ratio_threshold}.")
        if self.max_nonfinite_steps < 0:
            raise FastDPOError(f"--max_nonfinite_steps must be >= 0 (0: never stop), got {self.max_nonfinite_steps}.")
        if self.ddp_timeout < 1:
            raise FastDPOError(f"--ddp_timeout must be >= 1 second, got {self.ddp_timeout}.")
        self._validate_loss()
        self._validate_reference()
        self._validate_eval()
        parallel_plan(self.fsdp, self.deepspeed, self)  # raises on what cannot be honoured

    def _validate_loss(self) -> None:
        losses = registered_losses()
        specs = {name: losses[name] for name, _ in self.loss_terms()}
        _choice("f_divergence_type", self.f_divergence_type, F_DIVERGENCE_TYPES)
        if self.f_divergence_type != "reverse_kl" and not all(sp.f_divergence for sp in specs.values()):
            ok = ", ".join(n for n, sp in losses.items() if sp.f_divergence)
            raise FastDPOError(f"--f_divergence_type {self.f_divergence_type} is defined only for the losses built on "
                               f"the reward difference ({ok}). Drop it or change --loss_type.")
        if self.use_weighting and any(sp.sorts_step for sp in specs.values()):
            raise FastDPOError("--use_weighting does not apply to aot / aot_unpaired (they sort pairs, so per-pair "
                               "weights would not line up). Drop one of them.")
        if "exo_pair" in specs and self.label_smoothing <= 0:
            raise FastDPOError("--loss_type exo_pair needs --label_smoothing > 0 (the EXO paper uses 1e-3).")
        if not 0 <= self.ld_alpha <= 1:
            raise FastDPOError(f"--ld_alpha must be in [0, 1] (1 = plain DPO), got {self.ld_alpha}.")
        if self.discopop_tau <= 0:
            raise FastDPOError(f"--discopop_tau must be > 0, got {self.discopop_tau}.")
        for name in ("rpo_alpha", "cpo_alpha", "orpo_alpha"):
            if getattr(self, name) < 0:
                raise FastDPOError(f"--{name} must be >= 0, got {getattr(self, name)}.")
        _choice("beta_schedule", self.beta_schedule, ("constant", "kl_adaptive"))
        if self.beta_schedule == "kl_adaptive":
            if not self.needs_reference():
                raise FastDPOError("--beta_schedule kl_adaptive follows the policy-reference log-ratio, but "
                                   f"--loss_type {self.loss_type} is reference-free. Use --beta_schedule constant.")
            if self.beta_kl_window < 1 or not 0 < self.beta_min_ratio <= 1 or self.beta_kl_target < 0:
                raise FastDPOError("kl_adaptive needs --beta_kl_window >= 1, --beta_min_ratio in (0, 1] and "
                                   "--beta_kl_target >= 0.")

    def _validate_reference(self) -> None:
        if self.precompute_ref_batch_size < 0:
            raise FastDPOError(f"--precompute_ref_batch_size must be >= 0, got {self.precompute_ref_batch_size}.")
        if self.use_dora and not self.uses_lora:
            raise FastDPOError("--use_dora trains DoRA adapters: it needs --train_type lora (or qlora).")
        if self.adapters and not self.uses_lora:
            raise FastDPOError("--adapters starts a LoRA adapter from a saved one: it needs --train_type lora.")
        if self.ref_adapters and self.ref_model:
            raise FastDPOError("Give either --ref_model or --ref_adapters (applied to --model), not both.")
        if self.sync_ref_model:
            if not self.needs_reference():
                raise FastDPOError("--sync_ref_model has no reference to update: the loss is reference-free.")
            if self.uses_lora:
                raise FastDPOError("--sync_ref_model (TR-DPO) needs full fine-tuning: a LoRA reference is the "
                                   "base model itself. Use --train_type full.")
            if self.precompute_ref_log_probs:
                raise FastDPOError("--sync_ref_model changes the reference during training, so it cannot be "
                                   "precomputed. Drop --precompute_ref_log_probs.")
            if not 0 <= self.ref_model_mixup_alpha <= 1 or self.ref_model_sync_steps < 1:
                raise FastDPOError("TR-DPO needs --ref_model_mixup_alpha in [0, 1] and --ref_model_sync_steps >= 1.")

    def loss_terms(self) -> list[tuple[str, float]]:
        """[(loss name, weight)] from --loss_type and --loss_weights (comma strings, or YAML lists)."""
        raw = self.loss_type if isinstance(self.loss_type, list) else str(self.loss_type).split(",")
        names = [str(n).strip() for n in raw if str(n).strip()]
        if not names:
            raise FastDPOError("--loss_type is empty. Give a loss name, e.g. sigmoid.")
        losses = registered_losses()
        for name in names:
            if name not in losses:
                raise FastDPOError(f"--loss_type {name!r} is unknown. Choose from: {', '.join(sorted(losses))}.")
        w = self.loss_weights
        raw_w = w if isinstance(w, list) else [w] if isinstance(w, (int, float)) else str(w).split(",")
        raw_w = [x for x in raw_w if str(x).strip()]
        try:
            weights = [float(x) for x in raw_w] or [1.0] * len(names)
        except ValueError:
            raise FastDPOError(f"--loss_weights {w!r}: expected comma-separated numbers, e.g. 1,0.1.") from None
        if len(weights) != len(names):
            raise FastDPOError(f"--loss_weights has {len(weights)} values for {len(names)} losses in --loss_type "
                               f"{','.join(names)}. Give one weight per loss.")
        return list(zip(names, weights))

    def needs_reference(self) -> bool:
        losses = registered_losses()
        return any(losses[name].needs_reference for name, _ in self.loss_terms())

    def _validate_eval(self) -> None:
        if not 0 <= self.split_dataset_ratio < 1:
            raise FastDPOError(f"--split_dataset_ratio must be in [0, 1), got {self.split_dataset_ratio}.")
        if self.val_dataset and self.split_dataset_ratio > 0:
            raise FastDPOError("Give --val_dataset or --split_dataset_ratio, not both.")
        if self.eval_steps < 0:
            raise FastDPOError(f"--eval_steps must be >= 0, got {self.eval_steps}.")
        has_val = bool(self.val_dataset) or self.split_dataset_ratio > 0
        if self.eval_steps > 0 and not has_val:
            raise FastDPOError("--eval_steps needs held-out pairs: add --val_dataset FILE or --split_dataset_ratio R.")
        if has_val and self.eval_steps > 0 and self.save_steps > 0 and self.save_steps % self.eval_steps:
            raise FastDPOError(f"--save_steps {self.save_steps} must be a multiple of --eval_steps {self.eval_steps}, so "
                               "every checkpoint has an evaluation to rank it by.")
        check_metric_name(self.metric_for_best_model)

    @property
    def uses_lora(self) -> bool:
        """LoRA adapters are trained (on a full-precision or a quantised base)."""
        return self.train_type in ("lora", "qlora")

    def validate_data(self) -> None:
        """The data flags alone (also used by `fastdpo check-data`)."""
        self.normalise_datasets()  # set after construction too
        if not self.dataset:
            raise FastDPOError("--dataset is required: one or more dataset files, dirs or HF dataset ids.")
        for name in ("dataset_num_proc", "shuffle_buffer_size"):
            if getattr(self, name) < 1:
                raise FastDPOError(f"--{name} must be >= 1, got {getattr(self, name)}.")
        for name in ("dataloader_num_workers", "max_samples"):
            if getattr(self, name) < 0:
                raise FastDPOError(f"--{name} must be >= 0, got {getattr(self, name)}.")
        if self.streaming:  # the data is read once, lazily: nothing may need all of it ahead
            if self.max_steps <= 0:
                raise FastDPOError("--streaming needs --max_steps > 0: the size of a streamed dataset is not known ahead.")
            if self.max_samples:
                raise FastDPOError(f"--max_samples {self.max_samples} with --streaming: write each dataset as "
                                   f"`path#{self.max_samples}` instead (a stream takes its first N rows).")
            if self.split_dataset_ratio > 0:
                raise FastDPOError("--streaming cannot hold out --split_dataset_ratio of a stream. Give --val_dataset.")
            if self.precompute_ref_log_probs:
                raise FastDPOError("--precompute_ref_log_probs needs every training pair ahead, which --streaming does "
                                   "not have. Drop it: the reference then runs alongside the policy.")
            if str(self.gradient_checkpointing) == "auto":
                raise FastDPOError("--gradient_checkpointing auto measures on data in memory. With --streaming, name a "
                                   "policy: none, full, ffn, attn or every:K.")
        self.validate_reading()

    @property
    def pairs_per_step(self) -> int:
        """Pairs per optimizer step on one rank (world size multiplies it)."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def check_push(push_to_hub: bool, hub_model_id: str) -> None:
    """--push_to_hub / --hub_model_id, before any work: a push that cannot happen is refused now, not after hours
    of training."""
    if hub_model_id and not push_to_hub:
        log.warning("--hub_model_id %s without --push_to_hub: nothing is uploaded (add --push_to_hub).", hub_model_id)
    if not push_to_hub:
        return
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise FastDPOError("--push_to_hub with HF_HUB_OFFLINE=1: nothing can be uploaded. Drop --push_to_hub and "
                           "upload the saved model later with `hf upload REPO DIR`, or unset HF_HUB_OFFLINE.")
    if hub_model_id.count("/") > 1 or hub_model_id.strip() != hub_model_id:
        raise FastDPOError(f"--hub_model_id {hub_model_id!r}: give a repo name, or OWNER/NAME.")


def _choice(name: str, value: str, choices: tuple) -> None:
    if value not in choices:
        raise FastDPOError(f"--{name} {value!r} is not one of: {', '.join(choices)}.")


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


def _parse_bool(text: str) -> bool:
    t = str(text).strip().lower()
    if t in ("true", "1", "yes", "on"):
        return True
    if t in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _parse_dict(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({e.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value
