"""The training loop (DESIGN §6), readable top to bottom: set up, then for each optimizer step run its micro-batches
(policy forward, reference forward, per-pair losses summed and divided by the step's pair count, backward), then clip,
update, schedule, log and checkpoint. Under torchrun every rank runs this loop on its share of each step's pairs
(distributed.py holds the mechanics)."""

from __future__ import annotations

import logging
import math
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.profiler import record_function as phase  # names the loop's phases in --profile_steps traces

from fastdpo import checkpoint as ckpt
from fastdpo.beta import BetaSchedule
from fastdpo.config import TrainConfig, save_config
from fastdpo.data.load import Row, load_rows
from fastdpo.data.pack import step_order
from fastdpo.data.prepare import DataOptions, tokenize_pairs
from fastdpo.data.stream import PairStream
from fastdpo.data.template import keep_template, plain_text_note
from fastdpo.data.tokenize import TokenizedPair
from fastdpo.diagnostics import oom_error
from fastdpo.distributed import (
    Dist,
    any_rank,
    barrier,
    clip_grad_norm,
    full_state_dict,
    gather_step_start,
    gather_step_view,
    grad_sync,
    heartbeat,
    init_distributed,
    max_over_ranks,
    policy_logps,
    rank_micro_batches,
    reduce_beta_drift,
    reduce_metrics,
    shutdown,
    wrap_models,
)
from fastdpo.envinfo import as_assignments, compile_vars
from fastdpo.errors import FastDPOError
from fastdpo.evaluate import TrainingEval, held_out_reference, held_out_rows
from fastdpo.gcpause import GcPauses
from fastdpo.losses import LOSSES, StepView, at, loss_inputs, loss_params, step_view, total_loss
from fastdpo.memory import apply_checkpointing, compile_layers, offloading
from fastdpo.metrics import StepMetrics, Throughput, device_peak_flops, padding, peak_memory_gib, step_flops
from fastdpo.model import (
    FLEX_PAD,
    Backend,
    add_lora,
    base_causal_lm,
    build_mask,
    choose_backend,
    flex_length,
    load_model,
    load_tokenizer,
    make_batch,
    micro_batch_budget,
    model_summary,
    prepare_packed,
    resolve_device,
    resolve_dtype,
)
from fastdpo.monitor import Monitor, finite_flag
from fastdpo.optim import (
    build_optimizer,
    build_scheduler,
    follow_schedule,
    schedule_changes,
    step_unless_nonfinite,
    undo_step_count,
)
from fastdpo.profile import StepProfiler
from fastdpo.reference import Reference, build_reference, load_ref_adapter
from fastdpo.signals import GracefulStop

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


def seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def check_output_dir(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        # one name per rank, the same in every run: a probe a kill left behind is overwritten and removed next time
        probe = out / f".fastdpo_write_test.rank{os.environ.get('RANK', '0')}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise FastDPOError(f"--output_dir {out} is not writable ({e.strerror}). Choose another directory.") from None


def pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id or 0


def load_data(cfg: TrainConfig, tokenizer) -> tuple[list[Row], list[TokenizedPair]]:
    """The training rows and pairs (held-out rows excluded)."""
    return load_splits(cfg, tokenizer)[:2]


def load_splits(cfg: TrainConfig, tokenizer, summary_dir: Path | None = None
                ) -> tuple[list[Row], list[TokenizedPair], list[Row], list[TokenizedPair]]:
    """Training rows and pairs, then the held-out rows and pairs (--val_dataset or --split_dataset_ratio). The data
    summary is logged (and saved in `summary_dir`). With --streaming the training data is read lazily by a
    PairStream instead: no training rows or pairs here."""
    opts = DataOptions.from_config(cfg)
    rows, val_rows = held_out_rows(cfg, [] if cfg.streaming else load_rows(cfg.dataset, cfg.seed, cfg.split, opts.read))
    pairs: list[TokenizedPair] = []
    if not cfg.streaming:
        pairs, summary = tokenize_pairs(rows, tokenizer, opts)
        summary.log()
        note = None if cfg.input_template else plain_text_note(rows, tokenizer, opts.tokenize.template)
        if note:
            log.warning("data: %s", note)
        if summary_dir is not None:
            summary.save(summary_dir / "data_summary.json")
    val_pairs = tokenize_pairs(val_rows, tokenizer, opts)[0] if val_rows else []
    return rows, pairs, val_rows, val_pairs


def warn_small_steps(cfg: TrainConfig, world_size: int) -> None:
    """DPO's usual minimum is 32 pairs per optimizer step (a heuristic: below it steps are noisy; warned, not refused)."""
    pairs = cfg.pairs_per_step * world_size
    if pairs < SMALL_STEP:
        log.warning("%d pairs per optimizer step (--per_device_train_batch_size %d x --gradient_accumulation_steps %d"
                    "%s): DPO is usually trained with at least %d, below which its steps are noisy. Raise "
                    "--gradient_accumulation_steps to %d for %d.", pairs, cfg.per_device_train_batch_size,
                    cfg.gradient_accumulation_steps, f" x {world_size} ranks" if world_size > 1 else "", SMALL_STEP,
                    -(-SMALL_STEP // (cfg.per_device_train_batch_size * world_size)), SMALL_STEP)


def build_setup(cfg: TrainConfig, d: Dist | None = None) -> Setup:
    cfg.validate_training()
    if d is None or d.is_main:
        warn_small_steps(cfg, d.world_size if d else 1)
    out = Path(cfg.output_dir)
    check_output_dir(out)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.torch_dtype, device)
    seed_all(cfg.seed)

    tokenizer = load_tokenizer(cfg.model, cfg.trust_remote_code)
    rows, pairs, val_rows, val_pairs = load_splits(cfg, tokenizer, out if d is None or d.is_main else None)
    stream = PairStream(cfg.dataset, tokenizer, DataOptions.from_config(cfg)) if cfg.streaming else None
    keep_template(tokenizer, cfg.template)  # saved with every checkpoint: infer and eval format prompts the same way
    if cfg.gradient_checkpointing == "auto":
        from fastdpo.tune import auto_policy

        dict_rows = [{"prompt": r.prompt, "chosen": r.chosen, "rejected": r.rejected} for r in rows]
        cfg.gradient_checkpointing = auto_policy(cfg, dict_rows, device)

    model = load_model(cfg.model, dtype, device, cfg.trust_remote_code, cfg.model_type,
                       cfg.quant_bits if cfg.train_type == "qlora" else 0)
    val_reference = held_out_reference(cfg, model, device, val_pairs, val_rows, pad_id(tokenizer))
    s = assemble(cfg, device, model, tokenizer, pairs, rows=rows, d=d)
    s.val_pairs, s.val_reference, s.stream = val_pairs, val_reference, stream
    return s


FSDP_MIN_BUDGET = 8192  # tokens per micro-batch below which FSDP2's per-micro-batch costs dominate (README)


def speed_hint(cfg: TrainConfig, device: torch.device, backend: str, mode: str = "single") -> str | None:
    """The settings behind the measured speed-ups, named once when a GPU run trains without them. `mode`: single,
    ddp, fsdp (full_shard: weights gathered for every micro-batch) or fsdp_zero2 (gathered once per step)."""
    if device.type != "cuda" or backend != "flex":
        return None
    hints = []
    budget = cfg.max_tokens_per_batch
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
    if not cfg.max_tokens_per_batch:
        missing.append("--max_tokens_per_batch 4096 (about a few pairs' tokens)")
    if cfg.gradient_checkpointing in ("none", "false"):
        missing.append("--gradient_checkpointing ffn")
    if not cfg.precompute_ref_log_probs and cfg.needs_reference() and not cfg.sync_ref_model:
        missing.append("--precompute_ref_log_probs")
    if missing:
        hints.append("Faster on this GPU (README, Performance): " + ", ".join(missing) +
                     "; `fastdpo tune` measures these choices on your model and data.")
    return " ".join(hints) or None


def epoch_steps(pairs: int, per_step: int, drop_last: bool) -> int:
    """Optimizer steps in one epoch: the last one takes the pairs left, or with `drop_last` is skipped when short."""
    if not drop_last:
        return math.ceil(pairs / per_step)
    if pairs < per_step:
        raise FastDPOError(f"--dataloader_drop_last: the data has {pairs} pairs, fewer than one step's {per_step}, so "
                           "every step would be skipped. Drop the flag or take fewer pairs per step.")
    return pairs // per_step


def assemble(cfg: TrainConfig, device: torch.device, model, tokenizer, pairs: list[TokenizedPair],
             ref_model=None, rows: list[Row] | None = None, d: Dist | None = None) -> Setup:
    """Wire a loaded model into a training setup: backend, reference, LoRA, memory policy, DDP/FSDP2, step counts.
    `ref_model`: an already loaded reference (else --ref_model is loaded when needed); `rows`: the text rows, which
    key the on-disk cache of a precomputed reference (without them it is computed but not cached)."""
    d = d or Dist()
    backend = choose_backend(model, cfg.attn_impl, cfg.padding_free, device, cfg.length_buckets)
    given = cfg.max_tokens_per_batch
    cfg.max_tokens_per_batch = micro_batch_budget(backend, given, pairs, cfg.per_device_train_batch_size)
    if cfg.max_tokens_per_batch != given:
        log.info("FlexAttention: micro-batches use a token budget of %d (about --per_device_train_batch_size %d "
                 "pairs of this data), so its kernels (and --torch_compile's layers) are built for a few static "
                 "lengths, not for every batch. Set --max_tokens_per_batch to choose another.",
                 cfg.max_tokens_per_batch, cfg.per_device_train_batch_size)
    elif backend.name == "flex" and not given:  # a stream: no pairs to size a budget from
        log.warning("--streaming without --max_tokens_per_batch: each new micro-batch length builds FlexAttention "
                    "kernels of its own. Set --max_tokens_per_batch (e.g. 4096) for a few static lengths.")
    reference = build_reference(cfg, model, backend, pairs, rows, pad_id(tokenizer), ref_model, d)
    if cfg.uses_lora:
        model = add_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.target_modules, cfg.adapters)
        if reference.strategy == "ref_adapter":
            load_ref_adapter(model, cfg.ref_adapters)
    if backend.name != "padded":
        prepare_packed(model, backend)
    apply_checkpointing(model, cfg.gradient_checkpointing)
    if cfg.torch_compile:
        compile_layers(model, lengths=cfg.length_buckets)
        settings = compile_vars()  # they change compile time and speed (e.g. TORCHINDUCTOR_CPP_WRAPPER=1): say so
        if settings:
            log.info("torch.compile settings from the environment: %s", as_assignments(settings))
    model.train()
    policy = wrap_models(model, reference, backend, d)

    # a stream's size is unknown: --streaming needs --max_steps, and "epoch" then counts max_steps
    steps_per_epoch = cfg.max_steps if cfg.streaming else epoch_steps(len(pairs), cfg.pairs_per_step * d.world_size,
                                                                      cfg.dataloader_drop_last)
    total = cfg.max_steps if cfg.max_steps > 0 else math.ceil(cfg.num_train_epochs * steps_per_epoch)
    beta = BetaSchedule(cfg.beta, cfg.beta_schedule, cfg.beta_kl_target, cfg.beta_kl_window, cfg.beta_min_ratio, device)
    return Setup(cfg, d, device, model, policy, tokenizer, reference, backend, pairs, total, steps_per_epoch,
                 cfg.loss_terms(), beta)


def attended_pairs(p: TokenizedPair) -> int:
    """(query, key) pairs the rule allows within one pair: for MFU."""
    n_p, n_c, n_r = len(p.prompt), len(p.chosen), len(p.rejected)
    return n_p * (n_p + 1) // 2 + n_c * n_p + n_c * (n_c + 1) // 2 + n_r * n_p + n_r * (n_r + 1) // 2


def chosen_targets(p: TokenizedPair) -> int:
    """Predicted chosen tokens: no state predicts the first token of an unprompted completion."""
    return len(p.chosen) - (len(p.prompt) == 0)


@torch.no_grad()
def step_logps(s: Setup, groups: list[list[TokenizedPair]], filler: list[TokenizedPair]) -> tuple[StepView, list, int]:
    """Every pair's log-probs over the whole step (all ranks), without grad: losses that sort the step's pairs (aot)
    need the ranks before any backward. One extra policy forward, for those losses only; the reference results are
    kept. Also returns where this rank's pairs start in the step-wide view."""
    parts, refs = [], []
    for group in groups:
        batch = make_batch(group or filler, s.backend, pad_id(s.tokenizer), s.device, s.cfg.max_tokens_per_batch)
        mask = build_mask(batch, s.backend)
        pol = policy_logps(s.policy, batch, mask)
        refs.append(s.reference.logps(s.model, batch, s.backend, mask))
        if group:
            parts.append(loss_inputs(pol, refs[-1], batch.lengths, s.cfg.ld_alpha))
    view, start = gather_step_view(step_view(parts) if parts else None, s.dist, s.device)
    return view, refs, start


def warm_up_lengths(s: Setup) -> int:
    """Build the kernels of every static micro-batch length up front (--compile_warmup; `fastdpo bench` always):
    the online reference's forward and the policy's forward and backward on a filler pair of each length.
    Gradients are discarded and the random state restored, so training continues exactly as without it. Returns
    the number of lengths."""
    budget = s.cfg.max_tokens_per_batch
    cuda = s.device.type == "cuda"
    rng = torch.get_rng_state(), torch.cuda.get_rng_state(s.device) if cuda else None
    lengths = sorted({flex_length(t, budget, s.backend.lengths) for t in range(FLEX_PAD, budget + 1, FLEX_PAD)})
    for length in lengths:
        n = length - FLEX_PAD // 2
        pair = TokenizedPair(prompt=[5] * (n // 2), chosen=[6] * (n // 4), rejected=[7] * (n - n // 2 - n // 4), index=0)
        batch = make_batch([pair], s.backend, pad_id(s.tokenizer), s.device, budget)
        mask = build_mask(batch, s.backend)
        if s.reference.online:  # its no-grad forward compiles graphs of its own
            s.reference.logps(s.model, batch, s.backend, mask)
        with offloading(s.cfg.activation_offloading, s.model):
            pol = policy_logps(s.policy, batch, mask)
        pol.sums.sum().backward()
    s.model.zero_grad(set_to_none=True)
    torch.set_rng_state(rng[0])
    if cuda:
        torch.cuda.set_rng_state(rng[1], s.device)
        torch.cuda.synchronize(s.device)
    return len(lengths)


def run_step(s: Setup, step_pairs: list[TokenizedPair], metrics: StepMetrics) -> None:
    """Forward and backward over this rank's share of one optimizer step's pairs (all of them on one process);
    gradients accumulate in .grad and are summed across ranks on the last micro-step."""
    cfg, d = s.cfg, s.dist
    n_pairs = len(step_pairs)  # the whole step, all ranks
    beta = s.beta.value()
    params = loss_params(cfg, beta)
    # NLL terms are token means over the step's chosen tokens, written per pair like every other term
    tokens_per_pair = sum(chosen_targets(p) for p in step_pairs) / n_pairs
    groups = rank_micro_batches(step_pairs, d.rank, d.world_size, cfg.max_tokens_per_batch,
                                cfg.per_device_train_batch_size)
    view, refs, offset = None, None, 0
    if any(LOSSES[name].sorts_step for name, _ in s.loss_terms):
        view, refs, offset = step_logps(s, groups, step_pairs[:1])
    for i, group in enumerate(groups):
        real = bool(group)  # an empty share still runs (zero-weighted) so every rank joins the same collectives
        with phase("fastdpo.pack"):
            batch = make_batch(group or step_pairs[:1], s.backend, pad_id(s.tokenizer), s.device,
                               cfg.max_tokens_per_batch)
            b = batch.num_pairs
            mask = build_mask(batch, s.backend)  # built once, shared by policy and reference forwards and all layers
            metrics.count_batch(batch)
        with grad_sync(s.policy, last=i == len(groups) - 1, keep_gathered=d.keeps_gathered):
            with phase("fastdpo.forward"), offloading(cfg.activation_offloading, s.model):
                pol = policy_logps(s.policy, batch, mask, wpo=cfg.use_weighting)
            with phase("fastdpo.loss"):
                ref = refs[i] if refs is not None else s.reference.logps(s.model, batch, s.backend, mask)
                in_step = at(view, offset if real else 0, b) if view is not None else None
                x = loss_inputs(pol, ref, batch.lengths, cfg.ld_alpha, tokens_per_pair, in_step)
                # divide by the pairs of the whole step (all ranks), not the micro-batch: accumulation is then exact
                loss = total_loss(x, params, s.loss_terms, cfg.rpo_alpha).sum() / n_pairs
                if not real:
                    loss = loss * 0.0
            with phase("fastdpo.backward"):
                loss.backward()
        if real:
            s.beta.observe(x)
            metrics.add(loss, beta, x.policy_chosen.detach(), x.policy_rejected.detach(), x.ref_chosen,
                        x.ref_rejected, sum(p.num_tokens for p in group), x.chosen_tokens, x.rejected_tokens)
            offset += b


def train(cfg: TrainConfig, console=None, progress: bool = True) -> dict:
    """Train per `cfg`; returns a summary (final dir, last metrics). Under torchrun every rank calls this; only rank
    0 logs and writes files other than checkpoint shards."""
    cfg.validate_training()
    d = init_distributed(cfg, timeout_s=cfg.ddp_timeout)
    try:
        return run_training(cfg, d, console if d.is_main else None, progress and d.is_main)
    finally:
        shutdown(d)


def run_training(cfg: TrainConfig, d: Dist, console, progress: bool) -> dict:
    s = build_setup(cfg, d)
    out = Path(cfg.output_dir)
    model, device = s.model, s.device
    optimizer = build_optimizer(model, cfg, device)
    scheduler = build_scheduler(optimizer, cfg, s.total_steps)
    trainable = [p for p in model.parameters() if p.requires_grad]
    step_pairs_total = cfg.pairs_per_step * d.world_size
    extra = {"reference": s.reference.model} if cfg.sync_ref_model else None
    start = 0
    if d.is_main:
        ckpt.clean_partial(out)  # leftovers of a write or delete a kill interrupted
    resume = ckpt.resolve_resume(cfg.resume_from_checkpoint, out)
    if resume is not None:
        check_resume_step_size(resume, cfg, d)
        if ckpt.is_sharded(resume):
            ckpt.load_sharded_checkpoint(resume, model, optimizer, scheduler, d.rank, extra)
        elif d.sharded:
            ckpt.load_unsharded_into_ranks(resume, model, optimizer, scheduler, extra)
        else:
            ckpt.load_weights(model, resume)
            ckpt.load_training_state(resume, optimizer, scheduler)
            if cfg.sync_ref_model:
                ckpt.load_extra_module(resume, "reference", s.reference.model)
        follow_changed_schedule(resume, cfg, scheduler, s.total_steps, d)
        state = ckpt.load_progress(resume)
        start = state["step"]
        s.beta.load_state_dict(state.get("beta", {}))
        if d.is_main:
            ckpt.truncate_metrics(out / "metrics.jsonl", start)
        log.info("Resumed from %s at step %d.", resume, start)
        if s.stream is not None:  # replay the stream's deterministic order up to the resume point
            s.stream.skip(start * step_pairs_total)
    ckpt.warn_later_checkpoints(out, start)
    ckpt.check_disk_space(out, model, cfg, s.total_steps - start, [s.reference.model] if cfg.sync_ref_model else [])
    evaluator = TrainingEval(cfg, s.val_pairs, ckpt.load_progress(resume) if resume is not None else None,
                             s.val_reference)
    if d.is_main:
        save_config(cfg, out / "config.yaml")
    summary = {**model_summary(model), "backend": s.backend.name, "reference": s.reference.strategy,
               "pairs": len(s.pairs), "total_steps": s.total_steps}
    log.info("Training: %s", summary)
    hint = speed_hint(cfg, device, s.backend.name, "fsdp_zero2" if d.keeps_gathered else d.mode)
    if hint and d.is_main:
        log.info(hint)
    if cfg.compile_warmup:
        t0 = time.perf_counter()
        n = warm_up_lengths(s)
        if n:
            log.info("--compile_warmup: kernels for %d micro-batch lengths built in %.1f s.", n,
                     time.perf_counter() - t0)
        else:  # dense or padded attention (CPU), or a stream: no budget, so no static lengths
            log.info("--compile_warmup: nothing to build without a token budget (--max_tokens_per_batch; FlexAttention "
                     "runs on CUDA pick one).")

    monitor = Monitor(cfg, out, console, optimizer, start, write=d.is_main, world_size=d.world_size)  # rank 0 writes
    lm_config = base_causal_lm(model).config
    peak = device_peak_flops(device)
    rate = Throughput()
    flops = 0.0
    bar = _progress_bar(console, s.total_steps, start) if progress and console is not None else None
    orders: dict[int, list[list[int]]] = {}
    last: dict = {}
    step_pairs: list[TokenizedPair] = []
    stop = GracefulStop().install()  # SIGTERM/SIGINT from here on: finish the step, checkpoint, exit
    stopped_at: Path | None = None
    hb = heartbeat(cfg, d).start()  # names a rank that stops progressing, long before --ddp_timeout
    profiler = StepProfiler(cfg.profile_steps, out, d.rank, device, memory=cfg.profile_memory)
    if profiler.window and (profiler.window[0] <= start or profiler.window[1] > s.total_steps):
        log.warning("--profile_steps %s: this run trains steps %d-%d, so the profile needs a window inside them.",
                    cfg.profile_steps, start + 1, s.total_steps)
    pauses = GcPauses(cfg.gc_steps).start()
    try:
        for step in range(start, s.total_steps):
            epoch, k = divmod(step, s.steps_per_epoch)
            if s.stream is not None:  # every rank reads the same stream and takes the whole step
                step_pairs = s.stream.take(step_pairs_total)
            else:
                if epoch not in orders:
                    orders = {epoch: step_order(len(s.pairs), step_pairs_total, cfg.seed, epoch, cfg.shuffle)}
                step_pairs = [s.pairs[i] for i in orders[epoch][k]]
            metrics = StepMetrics(device)
            beta = s.beta.value()
            hb.beat(step + 1, "forward")
            profiler.begin(step + 1)
            run_step(s, step_pairs, metrics)
            tokens = sum(p.num_tokens for p in step_pairs)
            # the step's sums over all ranks (the guard below decides alike everywhere); counts are known here
            with phase("fastdpo.metrics"):
                reduce_metrics(metrics, d, len(step_pairs), tokens)
            hb.beat(step + 1, "optimizer")
            max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
            with phase("fastdpo.clip"):
                grad_norm = clip_grad_norm(trainable, max_norm)
            lr = scheduler.get_last_lr()[0]
            # a NaN/Inf loss or gradient skips the update (counted; N in a row stop the run). The update obeys the
            # flag on the device, so the host queues it without waiting for the backward, and reads the flag after
            with phase("fastdpo.update"):
                finite = finite_flag(metrics.loss_sum, grad_norm)
                stepped = step_unless_nonfinite(optimizer, finite)
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            if step + 1 < s.total_steps:  # full_shard: the next forward's first weights, gathered under the host work
                gather_step_start(s.policy)
            reduce_beta_drift(s.beta, d)
            s.beta.step()
            ok = bool(finite)
            if not ok and stepped:
                undo_step_count(optimizer)
            monitor.finite_update(ok, step + 1, [p.index for p in step_pairs], stepped)
            done = step + 1
            pauses.step_end(done)  # --gc_steps: every rank collects at the same step
            profiler.end(done)
            if cfg.sync_ref_model and done % cfg.ref_model_sync_steps == 0:
                s.reference.sync(model, cfg.ref_model_mixup_alpha)

            rate.add(len(step_pairs), tokens)
            if peak:
                flops += step_flops(lm_config, tokens, sum(len(p.chosen) + len(p.rejected) for p in step_pairs),
                                    sum(attended_pairs(p) for p in step_pairs), s.reference.online)
            if done % cfg.logging_steps == 0 or done == s.total_steps:
                t0 = rate.t0
                record = {"step": done, "epoch": round(step / s.steps_per_epoch + 1 / s.steps_per_epoch, 4),
                          **metrics.finish(), "grad_norm": float(grad_norm), "learning_rate": lr, "beta": float(beta)}
                if peak:
                    record["mfu"] = flops / max(time.perf_counter() - t0, 1e-9) / (peak * d.world_size)
                    flops = 0.0
                record.update(rate.read())
                gcs = pauses.take()
                mem, gc_ms, gc_n, busiest = max_over_ranks([peak_memory_gib(device), gcs["gc/pause_ms"],
                                                            gcs["gc/collections"], metrics.computed_tokens], d, device)
                record.update({"memory/peak_gib": round(mem, 3), "gc/pause_ms": round(gc_ms, 3),
                               "gc/collections": int(gc_n), "batch/micro_batches": metrics.micro_batches,
                               "batch/padding": padding(int(busiest), tokens, d.world_size)})
                monitor.log(record)  # adds the vital signs, raises alerts, writes every sink
                last = record
            if evaluator.due(done, s.total_steps):  # every rank evaluates (the forwards are collective)
                hb.beat(done, "eval")
                monitor.write(evaluator.run(s, done, round(done / s.steps_per_epoch, 4)))
            if bar is not None:
                bar[0].update(bar[1], advance=1, rate=f"{last.get('pairs_per_second', 0):.2f} pairs/s")
            periodic = cfg.save_steps > 0 and done % cfg.save_steps == 0
            stopping = any_rank(stop.requested, d, device)  # all ranks stop after the same step
            if (periodic or stopping) and done < s.total_steps:
                hb.beat(done, "save")
                evaluator.best.saved(done, out / f"checkpoint-{done}")
                state = {"epoch": epoch, "beta": s.beta.state_dict(), **evaluator.progress(),
                         "pairs_per_step": step_pairs_total, "world_size": d.world_size,
                         "drop_last": cfg.dataloader_drop_last}
                if d.sharded:
                    saved = ckpt.save_sharded_checkpoint(out, done, model, s.tokenizer, optimizer, scheduler, state,
                                                         cfg, d.rank, extra)
                else:
                    saved = ckpt.save_checkpoint(out, done, model, s.tokenizer, optimizer, scheduler, state, cfg, extra)
                if d.is_main:
                    ckpt.rotate(out, cfg.save_total_limit, evaluator.best.best_model_checkpoint, keep=saved)
                if stopping:
                    stopped_at = saved
                    break
    except torch.OutOfMemoryError as e:
        raise oom_error(e, cfg, device, step_pairs) from None
    finally:
        pauses.stop()
        hb.stop()
        profiler.close()
        stop.restore()
        if bar is not None:
            bar[0].stop()
        monitor.close()
        if s.stream is not None:
            s.stream.close()
            if d.is_main:
                s.stream.summary().save(out / "data_summary.json")
            s.stream.summary().log()

    if stopped_at is not None:
        log.warning("Stopped by %s after step %d: saved %s. Continue with --resume_from_checkpoint latest.",
                    stop.name or "a signal to another rank", done, stopped_at)
        return {"final_dir": None, "stopped": stop.name or "SIGTERM", "checkpoint": str(stopped_at),
                "exit_code": stop.exit_code() if stop.requested else 128 + signal.SIGTERM,
                "last": last, **summary, **evaluator.summary()}
    weights = full_state_dict(model, d)  # FSDP2: every rank sends its shards to rank 0
    final = out / "final"
    if d.is_main:
        with stop:  # a signal now lets the final write finish
            final = ckpt.save_final(out, model, s.tokenizer, weights)
    barrier(d)
    evaluator.best.saved(s.total_steps, final)
    if cfg.plot and d.is_main:
        from fastdpo.plot import write_dashboard

        log.info("Dashboard: %s", write_dashboard(out))
    return {"final_dir": str(final), "last": last, **summary, **evaluator.summary()}


def check_resume_step_size(resume: Path, cfg: TrainConfig, d: Dist) -> None:
    """The data order continues only if a step covers as many pairs, and an epoch as many steps, as when the
    checkpoint was written."""
    progress = ckpt.load_progress(resume)
    dropped = progress.get("drop_last")
    if dropped is not None and dropped != cfg.dataloader_drop_last and not cfg.streaming:
        raise FastDPOError(f"{resume} was written with --dataloader_drop_last {str(dropped).lower()}; the data order "
                           "continues only with the same setting (it decides the steps of an epoch). Set it back to "
                           "resume.")
    saved = progress.get("pairs_per_step")
    now = cfg.pairs_per_step * d.world_size
    if saved is None or saved == now:
        return
    per_rank = cfg.per_device_train_batch_size * d.world_size
    hint = (f" Use --gradient_accumulation_steps {saved // per_rank} with this world size." if saved % per_rank == 0
            else "")
    raise FastDPOError(
        f"{resume} was written with {saved} pairs per optimizer step; this run has {now} "
        f"(per_device_train_batch_size {cfg.per_device_train_batch_size} x gradient_accumulation_steps "
        f"{cfg.gradient_accumulation_steps} x {d.world_size} ranks). Keep the product equal to resume.{hint}"
    )


def follow_changed_schedule(resume: Path, cfg: TrainConfig, scheduler, total_steps: int, d: Dist) -> None:
    """A resume whose learning-rate flags differ from the checkpoint's follows the schedule they define from the
    resumed step on (optimizer state kept); the restored scheduler would otherwise go on with the saved one."""
    changes = schedule_changes(ckpt.saved_config(resume), cfg)
    if not changes:
        return
    follow_schedule(scheduler, cfg, total_steps)
    if d.is_main:
        named = ", ".join(f"--{name} {old} → {new}" for name, old, new in changes)
        log.warning("Resuming from %s with a changed learning-rate schedule (%s): after step %d, training follows "
                    "the schedule these flags define, with the saved optimizer state. Resume with the old values to "
                    "continue the saved schedule instead.", resume, named, scheduler.last_epoch)


def _progress_bar(console, total: int, start: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
                   TimeRemainingColumn(), console=console, transient=False)
    task = bar.add_task("train", total=total, completed=start, rate="")
    bar.start()
    return bar, task
