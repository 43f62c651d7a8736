"""Everything a run needs, built once: tokenizer, data (training and held-out pairs), model, reference, LoRA,
memory policy, DDP/FSDP2, step counts (`build_setup` from a config, `assemble` around a loaded model)."""


from __future__ import annotations

import dataclasses
import json
import logging
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

from fastdpo.checkpoint.ownership import check_output_dir
from fastdpo.config import RunPlan, TrainConfig
from fastdpo.data.kto import check_unpaired, kl_completions, label_counts, unpair_rows
from fastdpo.data.load import Row, load_rows
from fastdpo.data.pack import prompt_runs
from fastdpo.data.prepare import DataOptions, log_rejects, tokenize_rows
from fastdpo.data.rankings import ranking_sizes
from fastdpo.data.rankings import rankings as gather_rankings
from fastdpo.data.rejects import Rejects
from fastdpo.data.split import held_out_rows
from fastdpo.data.stream import PairStream
from fastdpo.data.template import keep_template, plain_text_note
from fastdpo.data.tokenize import TokenizedPair, check_vocab
from fastdpo.dpo.beta import BetaSchedule
from fastdpo.dpo.reference import Ranks, Reference, build_reference, load_ref_adapter
from fastdpo.errors import FastDPOError
from fastdpo.kernels.warmup import build_ahead, head_size, norm_widths
from fastdpo.kernels.warmup import ready as kernels_ready
from fastdpo.losses import needs_kl_completions, trains_rankings, trains_unpaired
from fastdpo.model.backend import Backend, choose_backend, micro_batch_budget, prepare_packed
from fastdpo.model.fp8 import check_fp8_device, convert_to_fp8_base, convert_to_fp8_training
from fastdpo.model.fused import fuse_layers, kernels_wanted, unfused
from fastdpo.model.load import (
    add_lora,
    base_causal_lm,
    is_vision_config,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
)
from fastdpo.model.lora import DORA_NOTE, fuse_lora
from fastdpo.model.processor import is_vision_model, load_processor
from fastdpo.model.vlm_parts import freeze_parts, lora_pattern
from fastdpo.parallel import sequence
from fastdpo.parallel.distributed import Dist, check_sequence_parallel_size
from fastdpo.parallel.objects import gather_objects
from fastdpo.parallel.parallelize import parallelize
from fastdpo.training.evaluate import held_out_reference
from fastdpo.training.fit import fit_checkpointing, planned_largest_micro_batch

log = logging.getLogger("fastdpo")


SMALL_STEP = 32  # pairs per optimizer step below which a warning says DPO steps get noisy


@dataclass
class Setup:
    """Everything the loop needs, built once."""

    cfg: TrainConfig
    dist: Dist
    device: torch.device
    model: torch.nn.Module
    policy: torch.nn.Module  # the model's log-prob forward; wrapped in DDP or sharded by FSDP2 under torchrun
    tokenizer: object
    reference: Reference
    backend: Backend
    pairs: list[TokenizedPair]
    total_steps: int
    steps_per_epoch: int
    loss_terms: list[tuple[str, float]]  # (loss name, weight)
    beta: BetaSchedule
    val_pairs: list[TokenizedPair] = field(default_factory=list)  # held-out pairs for evaluation during training
    val_reference: Reference | None = None  # their precomputed reference (None: the training reference)
    stream: PairStream | None = None  # --streaming: training pairs come from here instead of `pairs`
    plan: RunPlan | None = None  # what set-up resolved from cfg (checkpointing, token budget, ...); set by `assemble`
    prompt_runs: list[int] | None = None  # runs of one prompt's consecutive pairs, shuffled as wholes
    rankings: list[int] | None = None  # a listwise loss: the pairs of each ranking, the unit a step counts

    @property
    def unpaired(self) -> bool:
        """The loss trains on unpaired rows (KTO): one completion per row, micro-batches are its KL chunks."""
        return trains_unpaired(name for name, _ in self.loss_terms)

    @property
    def listwise(self) -> bool:
        """The loss trains on rankings (Plackett-Luce): steps count rankings, micro-batches keep them whole."""
        return trains_rankings(name for name, _ in self.loss_terms)

    @property
    def shuffle(self) -> bool:
        """Whether each epoch shuffles the pairs: --shuffle, except for unpaired rows (TRL trains KTO in order)."""
        return self.cfg.shuffle and not self.unpaired


def seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id or 0


def load_data(cfg: TrainConfig, tokenizer) -> tuple[list[Row], list[TokenizedPair]]:
    """The training rows and pairs (held-out rows excluded)."""
    return load_splits(cfg, tokenizer)[:2]


def load_splits(cfg: TrainConfig, tokenizer, summary_dir: Path | None = None, processor=None
                ) -> tuple[list[Row], list[TokenizedPair], list[Row], list[TokenizedPair]]:
    """Training rows and pairs, then the held-out rows and pairs (--val_dataset or --split_dataset_ratio). The data
    summary is logged (and saved in `summary_dir`). With --streaming the training data is read lazily by a
    PairStream instead: no training rows or pairs here. `processor`: a vision-language model's (`load_processor`):
    rows with images are read and prepared with it; without one they are refused."""
    opts = DataOptions.from_config(cfg)
    if processor is not None:
        opts = dataclasses.replace(opts, read=dataclasses.replace(opts.read, images=True))
    rejects = Rejects(skip=not cfg.strict)
    rows, val_rows = held_out_rows(cfg, [] if cfg.streaming else load_rows(cfg.dataset, cfg.seed, cfg.split, opts.read,
                                                                           rejects), opts.read)
    names = [name for name, _ in cfg.loss_terms()]
    rows, val_rows = rows_for_loss(rows, names), rows_for_loss(val_rows, names, "the validation rows")
    shape = (cfg.per_device_train_batch_size, cfg.max_length, cfg.max_completion_length)
    pairs: list[TokenizedPair] = []
    if not cfg.streaming:
        pairs, summary = tokenize_rows(rows, tokenizer, opts, rejects, processor)
        pairs = pairs_for_loss(pairs, rows, names, *shape)
        if trains_unpaired(names) and cfg.shuffle:
            log.info("data: --loss_type %s trains the rows in the dataset's order, every epoch (TRL's KTOTrainer "
                     "requires it: the KL completions are built over that order), so --shuffle does not apply.",
                     names[0])
        summary.log()
        log_rejects(rejects, summary_dir)
        note = None if cfg.input_template else plain_text_note(rows, tokenizer, opts.tokenize.template)
        if note:
            log.warning("data: %s", note)
        if summary_dir is not None:
            summary.save(summary_dir / "data_summary.json")
    val_pairs = tokenize_rows(val_rows, tokenizer, opts, processor=processor)[0] if val_rows else []
    if val_pairs:  # TRL rotates the eval set's completions in chunks of the training batch too
        val_pairs = pairs_for_loss(val_pairs, val_rows, names, *shape, which="held-out ")
    return rows, pairs, val_rows, val_pairs


def rows_for_loss(rows: list[Row], names: list[str], where: str = "--dataset") -> list[Row]:
    """The rows as the losses `names` read them: pairs given to an unpaired loss (KTO) unpaired in TRL's order;
    unpaired rows under a pairwise or listwise loss refused."""
    if trains_unpaired(names):
        return unpair_rows(rows)
    check_unpaired(rows, None, where)
    return rows


def pairs_for_loss(pairs: list[TokenizedPair], rows: list[Row], names: list[str], batch: int, max_length: int,
                   max_completion_length: int = 0, which: str = "") -> list[TokenizedPair]:
    """Tokenised rows as the losses `names` train on them, what was done logged: unpaired rows with their KL
    completions (built in batches of `batch` rows; kto only), a listwise loss's pairs gathered into whole rankings
    (those the length limits cut into left out); pairs as they are."""
    if trains_unpaired(names):
        kl = needs_kl_completions(names)
        pairs = kl_completions(pairs, batch, max_length, max_completion_length, kl)
        good, bad = label_counts(pairs)
        log.info("data: %d %sunpaired rows, %d desirable and %d undesirable; %s", len(pairs), which, good, bad,
                 f"each row's KL completion is the completion of the row before it in its batch of {batch} (as TRL's "
                 "KTOTrainer builds them)" if kl else "no KL estimate")
        return pairs
    if not trains_rankings(names):
        return pairs
    pairs, left_out = gather_rankings(pairs, rows)
    sizes = ranking_sizes(pairs)
    log.info("data: %d %srankings of %d to %d completions (%d pairs)%s.", len(sizes), which, min(sizes, default=0) + 1,
             max(sizes, default=0) + 1, len(pairs), f"; {left_out} left out: the length limits dropped one of their "
             "pairs" if left_out else "")
    if not pairs:
        raise FastDPOError("No ranking survives the length limits (each needs all of its pairs). Raise --max_length.")
    return pairs


def check_vision_flags(cfg: TrainConfig, vision: bool) -> None:
    """What a vision-language model's training refuses, and the --freeze_* flags a text-only model refuses."""
    if not vision:
        if not cfg.freezes_default:
            raise FastDPOError(f"--freeze_vit / --freeze_aligner / --freeze_llm choose which parts of a vision-language "
                               f"model train; {cfg.model} is text-only. Drop them.")
        return
    if cfg.streaming:
        raise FastDPOError("--streaming with a vision-language model: its rows are prepared with the model's processor "
                           "before training, not streamed. Drop --streaming.")
    if cfg.group_prompts:
        log.info("Vision-language model: pairs are not grouped by prompt (--group_prompts): two prompts of equal "
                 "token ids may hold different images.")


def warn_small_steps(cfg: TrainConfig, world_size: int) -> None:
    """DPO's usual minimum is 32 pairs per optimizer step (a heuristic: below it steps are noisy; warned, not refused).
    Only a step size the user chose is warned about: a default (fastdpo's 8 pairs, ms-swift's 16) is not theirs to
    defend."""
    pairs = cfg.pairs_per_step * world_size
    chosen = cfg.step_chosen
    if chosen is None:  # a config built in Python: any step size other than the default is a choice
        chosen = (cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps) != (
            TrainConfig.per_device_train_batch_size, TrainConfig.gradient_accumulation_steps)
    if pairs < SMALL_STEP and chosen:
        log.warning("%d pairs per optimizer step (--per_device_train_batch_size %d x --gradient_accumulation_steps %d"
                    "%s): DPO is usually trained with at least %d, below which its steps are noisy. Raise "
                    "--gradient_accumulation_steps to %d for %d.", pairs, cfg.per_device_train_batch_size,
                    cfg.gradient_accumulation_steps, f" x {world_size} ranks" if world_size > 1 else "", SMALL_STEP,
                    -(-SMALL_STEP // (cfg.per_device_train_batch_size * world_size)), SMALL_STEP)


def build_setup(cfg: TrainConfig, d: Dist | None = None, choose_policy=None, mark=None, model=None, ref_model=None,
                tokenizer=None) -> Setup:
    """`choose_policy(cfg, rows, device) -> policy` resolves --gradient_checkpointing auto (the measuring is done
    above this floor, by the code that times training steps). `mark(name)` is told when the data (`data`) and
    the model (`model`) are loaded. `model`, `ref_model`, `tokenizer`: objects already loaded, used (moved to the
    device) instead of loading `cfg.model`, `cfg.ref_model` and the tokenizer."""
    mark = mark or (lambda name: None)
    cfg.validate_training()
    if d is None or d.is_main:
        warn_small_steps(cfg, d.dp_size if d else 1)
    out = Path(cfg.output_dir)
    check_output_dir(out)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.torch_dtype, device)
    seed_all(cfg.seed)
    if kernels_wanted(cfg.kernels, device, cfg.torch_compile):
        build_kernels_ahead(cfg.model, dtype, device, cfg.trust_remote_code, cfg.uses_lora, dropout_rank(cfg),
                            fused_fp8(cfg), cfg.fp8_base)

    if tokenizer is None:
        tokenizer = load_tokenizer(cfg.model, cfg.trust_remote_code)
    vision = is_vision_config(base_causal_lm(model).config) if model is not None else is_vision_model(
        cfg.model, cfg.trust_remote_code)
    check_vision_flags(cfg, vision)
    processor = load_processor(cfg.model, cfg.trust_remote_code) if vision else None
    rows, pairs, val_rows, val_pairs = load_splits(cfg, tokenizer, out if d is None or d.is_main else None, processor)
    mark("data")
    stream = PairStream(cfg.dataset, tokenizer, DataOptions.from_config(cfg)) if cfg.streaming else None
    keep_template(tokenizer, cfg.template)  # saved with every checkpoint: infer and eval format prompts the same way
    plan = RunPlan.of(cfg)
    if cfg.gradient_checkpointing == "auto":
        if choose_policy is None:
            raise FastDPOError("--gradient_checkpointing auto is resolved by measuring steps: train with "
                               "fastdpo.train(cfg) (or `fastdpo train`), or name a policy: none, full, ffn, attn.")
        dict_rows = [{"prompt": r.prompt, "chosen": r.chosen, "rejected": r.rejected} for r in rows]
        plan.gradient_checkpointing = choose_policy(cfg, dict_rows, device)

    if model is None:
        model = load_model(cfg.model, dtype, device, cfg.trust_remote_code, cfg.model_type,
                           cfg.quant_bits if cfg.train_type == "qlora" else 0)
    else:
        model = model.to(device)
    fp8_layers(cfg, model, device, d)  # before any reference log-prob (held-out ones below): both see the same products
    mark("model")
    vocab = model.get_input_embeddings().weight.shape[0]  # ids past it fail at the first step, far from the cause
    check_vocab(pairs, rows, vocab, cfg.model)
    check_vocab(val_pairs, val_rows, vocab, cfg.model)
    fuse_kernels(cfg, model, device)  # before any reference is computed: policy and reference compute alike
    val_reference = held_out_reference(cfg, model, device, val_pairs, val_rows, pad_id(tokenizer))
    s = assemble(cfg, device, model, tokenizer, pairs, ref_model=None if ref_model is None else ref_model.to(device),
                 rows=rows, d=d, plan=plan)
    s.val_pairs, s.val_reference, s.stream = val_pairs, val_reference, stream
    return s


FSDP_MIN_BUDGET = 8192  # tokens per micro-batch below which FSDP2's per-micro-batch costs dominate (README)


def speed_hint(cfg: TrainConfig, plan: RunPlan, device: torch.device, backend: str, mode: str = "single") -> str | None:
    """The settings behind the measured speed-ups, named once when a GPU run trains without them. `mode`: single,
    ddp, fsdp (full_shard: weights gathered for every micro-batch) or fsdp_zero2 (gathered once per step)."""
    if device.type != "cuda" or backend not in ("flex", "varlen"):
        return None
    hints = []
    budget = plan.max_tokens_per_batch
    if mode in ("fsdp", "fsdp_zero2") and 0 < budget < FSDP_MIN_BUDGET:
        if mode == "fsdp":
            cost = (f"FSDP2 full_shard gathers every layer's weights twice for each micro-batch: with "
                    f"--max_tokens_per_batch {budget} that cost is paid often. If the gathered weights fit, "
                    "--fsdp shard_grad_op gathers them once per optimizer step; otherwise")
        else:
            cost = ("FSDP2 runs its hooks on the CPU for every unit of layers and micro-batch: with "
                    f"--max_tokens_per_batch {budget} the GPUs wait on them. If the activations fit,")
        hints.append(f"{cost} --max_tokens_per_batch {FSDP_MIN_BUDGET} or more amortises it (README, Several GPUs).")
    missing = []
    if not cfg.torch_compile:
        missing.append("--torch_compile")
    if not plan.max_tokens_per_batch and backend == "flex":
        missing.append("--max_tokens_per_batch 4096 (about a few pairs' tokens)")
    if plan.gradient_checkpointing in ("none", "false"):
        missing.append("--gradient_checkpointing ffn")
    if not cfg.precompute_ref_log_probs and cfg.needs_reference() and not cfg.sync_ref_model:
        missing.append("--precompute_ref_log_probs")
    if missing:
        hints.append("Faster on this GPU (README, Performance): " + ", ".join(missing) +
                     "; `fastdpo tune` measures these choices on your model and data.")
    return " ".join(hints) or None


def _config_fields(model: str, trust_remote_code: bool):
    """The fields of a model's config that the kernels' shapes need: read straight from a local dir's config.json
    (the builds then start before transformers is even imported), else through AutoConfig."""
    path = Path(model).expanduser() / "config.json"
    if path.is_file():
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raw = None
        if isinstance(raw, dict):
            for sub in ("text_config", "vision_config"):  # read as the loaded config's attributes are
                if isinstance(raw.get(sub), dict):
                    raw[sub] = SimpleNamespace(**raw[sub])
            return SimpleNamespace(**raw)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - the model's loading reports what is wrong with it
        return None


def dropout_rank(cfg: TrainConfig) -> int:
    """The rank of the LoRA adapters whose dropout the lean LoRA linear applies (its kernels are built ahead), else 0
    (a quantised base's LoRA layers keep PEFT's forward; an adapter dir's rank is known once it loads)."""
    return cfg.lora_rank if cfg.train_type == "lora" and cfg.lora_dropout > 0 and not cfg.adapters else 0


def fused_fp8(cfg: TrainConfig) -> bool:
    """Whether the norm and SwiGLU kernels write their outputs in e4m3 too (--fp8 with row-wise scales)."""
    return cfg.fp8 and cfg.fp8_recipe == "rowwise"


def build_kernels_ahead(model: str, dtype: torch.dtype, device: torch.device, trust_remote_code: bool,
                        lora: bool, lora_dropout_rank: int = 0, fp8: bool = False, fp8_base: bool = False) -> None:
    """Start building the Triton kernels for this model's shapes (its config) while data and weights load (`fp8`:
    the norm and SwiGLU kernels that write e4m3 copies too; `fp8`, `fp8_base`: the row-wise quantisation's)."""
    config = _config_fields(model, trust_remote_code)
    if config is not None and (widths := norm_widths(config)):
        build_ahead(widths, dtype, device, head_size(config), lora, lora_dropout_rank, fp8, fp8_base)


def fp8_layers(cfg: TrainConfig, model, device: torch.device, d: Dist | None = None) -> None:
    """The decoder projections' FP8 products (`fastdpo.model.fp8`), set once (idempotent): --fp8_base holds the frozen
    LoRA base in FP8, before the reference's log-probs are computed and before LoRA wraps the model; --fp8 runs a full
    fine-tune's products in FP8, before the reference copy is made (the copy computes the same products)."""
    if not (cfg.fp8_base or cfg.fp8):
        return
    flag = "--fp8_base" if cfg.fp8_base else "--fp8"
    check_fp8_device(device, flag)
    if d is not None and d.mode == "fsdp":
        why = ("sharding casts each parameter to the compute dtype, which would read the FP8 weights without their "
               "scales" if cfg.fp8_base else "the sharded weights are gathered in bf16, and FP8 training keeps no "
               "FP8 copy to gather")
        raise FastDPOError(f"{flag} with FSDP2: {why}. Train on one GPU or with DDP (no --fsdp, or --fsdp "
                           f"no_shard), or drop {flag}.")
    if cfg.fp8_base and (n := convert_to_fp8_base(model)):
        log.info("FP8 base: %d frozen decoder projections held in e4m3 with row-wise scales (half the bytes of "
                 "bf16); their products and x's gradient run in FP8. The adapters stay in their dtype.", n)
    dtype = next(model.parameters()).dtype
    if cfg.fp8 and device.type == "cuda" and dtype != torch.bfloat16:
        raise FastDPOError(f"--fp8 trains a bfloat16 model (its FP8 products write bfloat16), and this one is "
                           f"{str(dtype).removeprefix('torch.')}. Pass --torch_dtype bfloat16, or drop --fp8.")
    if cfg.fp8 and (n := convert_to_fp8_training(model, cfg.fp8_recipe)):
        log.info("FP8 training (%s scales): %d decoder projections compute their outputs and their inputs' "
                 "gradients as e4m3 products; weights, weight gradients and the optimizer stay in %s.", cfg.fp8_recipe,
                 n, str(next(model.parameters()).dtype).removeprefix("torch."))


def fuse_kernels(cfg: TrainConfig, model, device: torch.device) -> None:
    """--kernels: the Triton norms, MLPs and rotary embeddings where they serve, once they are known to build here (idempotent;
    logged once per model). A GPU where they cannot be built trains on the model's own layers, with a warning (an
    error when --kernels triton asked for them)."""
    if not kernels_wanted(cfg.kernels, device, cfg.torch_compile) or getattr(model, "_fastdpo_fused", False):
        return
    lm = base_causal_lm(model)
    why = kernels_ready(norm_widths(lm.config), lm.get_input_embeddings().weight.dtype, device, head_size(lm.config),
                        cfg.uses_lora, dropout_rank(cfg), fused_fp8(cfg), cfg.fp8_base)
    if why is not None:
        if cfg.kernels == "triton":
            raise FastDPOError(f"--kernels triton: the Triton kernels cannot be built on this GPU ({why}). Use "
                               "--kernels torch (the model's own layers).")
        log.warning("Kernels: the Triton norms, MLPs and rotary embeddings cannot be built on this GPU (%s); training with the "
                    "model's own layers (--kernels torch).", why)
        model._fastdpo_fused = True
        return
    names = fuse_layers(model, use_kernels=True)
    model._fastdpo_fused = True
    log.info("Kernels: Triton norms, SwiGLU MLPs and rotary embeddings for %s; the log-prob head's log-sum-exp and "
             "its gradient.", ", ".join(names) or "no module of this model (its norms and MLPs differ from the standard "
             "ones: they keep their own forward)")


def epoch_steps(pairs: int, per_step: int, drop_last: bool) -> int:
    """Optimizer steps in one epoch: the last one takes the pairs left, or with `drop_last` is skipped when short."""
    if not drop_last:
        return math.ceil(pairs / per_step)
    if pairs < per_step:
        raise FastDPOError(f"--dataloader_drop_last: the data has {pairs} pairs, fewer than one step's {per_step}, so "
                           "every step would be skipped. Drop the flag or take fewer pairs per step.")
    return pairs // per_step


def assemble(cfg: TrainConfig, device: torch.device, model, tokenizer, pairs: list[TokenizedPair],
             ref_model=None, rows: list[Row] | None = None, d: Dist | None = None,
             steps: list[list[TokenizedPair]] | None = None, plan: RunPlan | None = None) -> Setup:
    """Wire a loaded model into a training setup: backend, reference, LoRA, memory policy, DDP/FSDP2, step counts.
    `ref_model`: an already loaded reference (else --ref_model is loaded when needed); `rows`: the text rows, which
    key the on-disk cache of a precomputed reference (without them it is computed but not cached); `steps`: the
    pairs of each step when the caller chooses them (`Trainer.step(pairs)`), else the run's seeded order, for the
    memory policy to plan on the micro-batches the run really forms. `plan`: what the caller resolved already (the
    checkpointing policy `auto` measured), else the config's own values; set-up resolves the rest into it."""
    d = d or Dist()
    plan = plan or RunPlan.of(cfg)
    check_sequence_parallel_size(cfg.sequence_parallel_size, d.world_size)  # e.g. bench/tune: one process
    backend = choose_backend(model, cfg.attn_impl, cfg.padding_free, device, cfg.length_buckets).grouping(
        cfg.group_prompts, dedupe=cfg.ld_alpha == 1.0)  # LD-DPO weighs a completion by its partner's length
    given = plan.max_tokens_per_batch
    plan.max_tokens_per_batch = micro_batch_budget(backend, given, pairs, cfg.per_device_train_batch_size)
    plan.device, plan.attention = str(device), backend.name
    plan.dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    plan.kernels = "triton" if kernels_wanted(cfg.kernels, device, cfg.torch_compile) else "torch"
    plan.products = "fp8_base" if cfg.fp8_base else f"fp8_{cfg.fp8_recipe}" if cfg.fp8 else plan.dtype
    if plan.max_tokens_per_batch != given:
        log.info("FlexAttention: micro-batches use a token budget of %d (about --per_device_train_batch_size %d "
                 "pairs of this data), so its kernels (and --torch_compile's layers) are built for a few static "
                 "lengths, not for every batch. Set --max_tokens_per_batch to choose another.",
                 plan.max_tokens_per_batch, cfg.per_device_train_batch_size)
    elif backend.name == "flex" and not given:  # a stream: no pairs to size a budget from
        log.warning("--streaming without --max_tokens_per_batch: each new micro-batch length builds FlexAttention "
                    "kernels of its own. Set --max_tokens_per_batch (e.g. 4096) for a few static lengths.")
    fp8_layers(cfg, model, device, d)  # before the reference and LoRA: policy and reference share the FP8 products
    fuse_kernels(cfg, model, device)
    ranks = Ranks(d.rank, d.world_size, lambda obj: gather_objects(obj, d))  # they share a precompute pass
    reference = build_reference(cfg, model, backend, pairs, rows, pad_id(tokenizer), ref_model, ranks)
    if reference.model is not None and reference.model is not model:  # a --ref_model loaded on its own
        fuse_kernels(cfg, reference.model, device)
    vision = is_vision_config(base_causal_lm(model).config)
    freezes = (cfg.freeze_vit, cfg.freeze_aligner, cfg.freeze_llm)
    if vision and not cfg.uses_lora:
        log.info("Vision-language model: training the %s (--freeze_vit %s, --freeze_aligner %s, --freeze_llm %s).",
                 ", ".join(freeze_parts(model, *freezes)), *freezes)
    if cfg.uses_lora:
        pattern = lora_pattern(model, cfg.target_modules, *freezes) if vision and not cfg.adapters else None
        model = add_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.target_modules, cfg.adapters,
                         cfg.use_dora, pattern)
        if cfg.use_dora:
            log.info("%s", DORA_NOTE)
        if reference.strategy == "ref_adapter":
            load_ref_adapter(model, cfg.ref_adapters)
        if cfg.kernels != "torch":
            fuse_lora(model)
    if lost := unfused(model):
        log.warning("Kernels: %s no longer run fastdpo's lean forward (something rebound them after loading); they "
                    "train on torch's path, correct but slower and larger.", ", ".join(lost))
    if backend.name != "padded":
        prepare_packed(model, backend)
    if d.sp_size > 1:
        d.sp_mode = sequence.resolve_mode(model, cfg.sequence_parallel_mode, d.sp_size, backend)
        sequence.register()
        log.info("Sequence parallelism: %s attention over groups of %d ranks.", d.sp_mode, d.sp_size)
    # a stream's size is unknown: --streaming needs --max_steps, and "epoch" then counts max_steps
    per_step = cfg.pairs_per_step * d.dp_size
    ranked = ranking_sizes(pairs) if cfg.trains_rankings() else None  # a step counts rankings, not pairs
    units = len(ranked) if ranked is not None else len(pairs)
    steps_per_epoch = cfg.max_steps if cfg.streaming else epoch_steps(units, per_step, cfg.dataloader_drop_last)
    total = cfg.max_steps if cfg.max_steps > 0 else math.ceil(cfg.num_train_epochs * steps_per_epoch)
    runs = None if cfg.streaming else prompt_runs(pairs)  # whatever the layout: grouping changes no step's pairs
    if plan.gradient_checkpointing == "fit":  # measured on the model as it trains: after LoRA, before wrapping
        planned = steps
        if planned is None and not cfg.streaming:
            planned = planned_largest_micro_batch(pairs, per_step, cfg.per_device_train_batch_size,
                                                  plan.max_tokens_per_batch, d.dp_size, cfg.seed,
                                                  cfg.shuffle and not cfg.trains_unpaired(), total,
                                                  steps_per_epoch, runs)
        fit_checkpointing(cfg, plan, model, backend, pairs, device, pad_id(tokenizer), cfg.max_memory_gib or None,
                          shards=d.world_size if d.mode == "fsdp" else 1, sequence_split=d.sp_size,
                          steps=planned, world=d.dp_size)
    policy = parallelize(model, reference, backend, cfg, d, plan.gradient_checkpointing)  # checkpointing -> compile -> DDP

    beta = BetaSchedule(cfg.beta, cfg.beta_schedule, cfg.beta_kl_target, cfg.beta_kl_window, cfg.beta_min_ratio, device)
    return Setup(cfg, d, device, model, policy, tokenizer, reference, backend, pairs, total, steps_per_epoch,
                 cfg.loss_terms(), beta, plan=plan, prompt_runs=runs, rankings=ranked)
