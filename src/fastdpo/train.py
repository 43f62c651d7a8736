"""The training loop (DESIGN §6), readable top to bottom: set up, then for each optimizer step run its micro-batches
(policy forward, reference forward, per-pair losses summed and divided by the step's pair count, backward), then clip,
update, schedule, log and checkpoint."""

from __future__ import annotations

import logging
import math
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from fastdpo import checkpoint as ckpt
from fastdpo.config import TrainConfig, save_config
from fastdpo.data.pack import pack_pairs, pad_pairs, split_micro_batches, step_order
from fastdpo.data.prepare import DataOptions, load_pairs
from fastdpo.data.stream import PairStream
from fastdpo.data.tokenize import TokenizedPair
from fastdpo.errors import FastDPOError
from fastdpo.losses import LOSSES, LossInputs, LossParams
from fastdpo.memory import apply_checkpointing, compile_layers
from fastdpo.metrics import MetricsSink, StepMetrics, Throughput, device_peak_flops, peak_memory_gib, step_flops
from fastdpo.model import (
    Backend,
    add_lora,
    base_causal_lm,
    build_mask,
    choose_backend,
    load_model,
    load_tokenizer,
    model_summary,
    prepare_packed,
    resolve_device,
    resolve_dtype,
    save_model,
    sequence_logps,
)
from fastdpo.optim import build_optimizer, build_scheduler
from fastdpo.reference import Reference, build_reference

log = logging.getLogger("fastdpo")
FLEX_PAD = 128


@dataclass
class Setup:
    """Everything the loop needs, built once."""

    cfg: TrainConfig
    device: torch.device
    model: torch.nn.Module
    tokenizer: object
    reference: Reference
    backend: Backend
    pairs: list[TokenizedPair]
    total_steps: int
    steps_per_epoch: int
    stream: PairStream | None = None  # --streaming: pairs come from here instead of `pairs`


def seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def check_output_dir(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".fastdpo_write_test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise FastDPOError(f"--output_dir {out} is not writable ({e.strerror}). Choose another directory.") from None


def build_setup(cfg: TrainConfig) -> Setup:
    cfg.validate()
    out = Path(cfg.output_dir)
    check_output_dir(out)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.torch_dtype, device)
    seed_all(cfg.seed)

    tokenizer = load_tokenizer(cfg.model, cfg.trust_remote_code)
    data_opts = DataOptions.from_config(cfg)
    stream = PairStream(cfg.dataset, tokenizer, data_opts) if cfg.streaming else None
    pairs: list[TokenizedPair] = []
    if stream is None:
        pairs, summary = load_pairs(cfg.dataset, tokenizer, data_opts)
        summary.log()
        summary.save(out / "data_summary.json")

    model = load_model(cfg.model, dtype, device, cfg.trust_remote_code, cfg.model_type)
    ref_model = load_model(cfg.ref_model, dtype, device, cfg.trust_remote_code) if cfg.ref_model else None
    return assemble(cfg, device, model, tokenizer, pairs, ref_model, stream)


def assemble(cfg: TrainConfig, device: torch.device, model, tokenizer, pairs: list[TokenizedPair],
             ref_model=None, stream: PairStream | None = None) -> Setup:
    """Wire a loaded model into a training setup: backend, reference, LoRA, memory policy, step counts."""
    backend = choose_backend(model, cfg.attn_impl, cfg.padding_free, device)
    needs_ref = any(LOSSES[n].needs_reference for n in cfg.loss_type.split(","))
    reference = build_reference(model, cfg.train_type, ref_model, needs_ref, backend)
    if cfg.train_type == "lora":
        model = add_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.target_modules)
    if backend.name != "padded":
        prepare_packed(model, backend)
    apply_checkpointing(model, cfg.gradient_checkpointing)
    if cfg.torch_compile:
        compile_layers(model)
    model.train()

    steps_per_epoch = math.ceil(len(pairs) / cfg.pairs_per_step) if stream is None else cfg.max_steps
    total = cfg.max_steps if cfg.max_steps > 0 else math.ceil(cfg.num_train_epochs * steps_per_epoch)
    return Setup(cfg, device, model, tokenizer, reference, backend, pairs, total, steps_per_epoch, stream)


def make_batch(pairs: list[TokenizedPair], backend: Backend, pad_id: int, device: torch.device):
    """Build a micro-batch on `device`. Flex batches are padded to a multiple of the flex block; compiled code marks
    the token dimension dynamic after the first new length, so lengths vary without recompiling."""
    if backend.name == "padded":
        batch = pad_pairs(pairs, pad_id)
    else:
        batch = pack_pairs(pairs, FLEX_PAD if backend.name == "flex" else 1, pad_id)
    return batch.to(device)


def attended_pairs(p: TokenizedPair) -> int:
    """(query, key) pairs the rule allows within one pair: for MFU."""
    n_p, n_c, n_r = len(p.prompt), len(p.chosen), len(p.rejected)
    return n_p * (n_p + 1) // 2 + n_c * n_p + n_c * (n_c + 1) // 2 + n_r * n_p + n_r * (n_r + 1) // 2


def run_step(s: Setup, step_pairs: list[TokenizedPair], metrics: StepMetrics) -> None:
    """Forward and backward over one optimizer step's pairs; gradients accumulate in .grad."""
    cfg = s.cfg
    n_pairs = len(step_pairs)
    chosen_tokens = sum(len(p.chosen) for p in step_pairs)
    params = LossParams(beta=cfg.beta, label_smoothing=cfg.label_smoothing)
    pad_id = s.tokenizer.pad_token_id or 0
    for group in split_micro_batches(step_pairs, cfg.max_tokens_per_batch, cfg.per_device_train_batch_size):
        batch = make_batch(group, s.backend, pad_id, s.device)
        b = batch.num_pairs
        mask = build_mask(batch, s.backend)  # built once, shared by policy and reference forwards and all layers
        pol, _ = sequence_logps(s.model, batch, s.backend, mask)
        ref = s.reference.logps(s.model, batch, s.backend, mask) if s.reference.strategy != "none" else None
        x = LossInputs(pol[:b], pol[b:], ref[:b] if ref is not None else None, ref[b:] if ref is not None else None,
                       batch.lengths[:b], batch.lengths[b:])
        loss = 0.0
        for name in cfg.loss_type.split(","):
            loss = loss + LOSSES[name].fn(x, params).sum()
        # divide by the pairs of the whole step, not the micro-batch: accumulation is then exact
        loss = loss / n_pairs
        if cfg.rpo_alpha:
            loss = loss + cfg.rpo_alpha * (-x.policy_chosen.sum()) / max(1, chosen_tokens)
        loss.backward()
        metrics.add(loss, cfg.beta, x.policy_chosen.detach(), x.policy_rejected.detach(), x.ref_chosen,
                    x.ref_rejected, sum(p.num_tokens for p in group))


def train(cfg: TrainConfig, console=None, progress: bool = True) -> dict:
    """Train per `cfg`; returns a summary (final dir, last metrics)."""
    s = build_setup(cfg)
    out = Path(cfg.output_dir)
    model, device = s.model, s.device
    optimizer = build_optimizer(model, cfg, device)
    scheduler = build_scheduler(optimizer, cfg, s.total_steps)
    trainable = [p for p in model.parameters() if p.requires_grad]
    start = 0
    resume = ckpt.resolve_resume(cfg.resume_from_checkpoint, out)
    if resume is not None:
        ckpt.load_weights(model, resume)
        ckpt.load_training_state(resume, optimizer, scheduler)
        start = ckpt.load_progress(resume)["step"]
        log.info("Resumed from %s at step %d.", resume, start)
        if s.stream is not None:  # replay the stream's deterministic order up to the resume point
            s.stream.skip(start * cfg.pairs_per_step)
    save_config(cfg, out / "config.yaml")
    summary = {**model_summary(model), "backend": s.backend.name, "reference": s.reference.strategy,
               "pairs": len(s.pairs), "total_steps": s.total_steps}
    log.info("Training: %s", summary)

    sink = MetricsSink(out, console, append=resume is not None)
    lm_config = base_causal_lm(model).config
    peak = device_peak_flops(device)
    rate = Throughput()
    flops = 0.0
    bar = _progress_bar(console, s.total_steps, start) if progress and console is not None else None
    orders: dict[int, list[list[int]]] = {}
    last: dict = {}
    try:
        for step in range(start, s.total_steps):
            epoch, k = divmod(step, s.steps_per_epoch)
            if s.stream is not None:
                step_pairs = s.stream.take(cfg.pairs_per_step)
            else:
                if epoch not in orders:
                    orders = {epoch: step_order(len(s.pairs), cfg.pairs_per_step, cfg.seed, epoch)}
                step_pairs = [s.pairs[i] for i in orders[epoch][k]]
            metrics = StepMetrics(device)
            run_step(s, step_pairs, metrics)
            max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
            grad_norm = torch.nn.utils.clip_grad_norm_(trainable, max_norm)
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)

            tokens = sum(p.num_tokens for p in step_pairs)
            rate.add(len(step_pairs), tokens)
            if peak:
                flops += step_flops(lm_config, tokens, sum(len(p.chosen) + len(p.rejected) for p in step_pairs),
                                    sum(attended_pairs(p) for p in step_pairs), s.reference.strategy != "none")
            done = step + 1
            if done % cfg.logging_steps == 0 or done == s.total_steps:
                t0 = rate.t0
                record = {"step": done, "epoch": round(step / s.steps_per_epoch + 1 / s.steps_per_epoch, 4),
                          **metrics.finish(), "grad_norm": float(grad_norm), "learning_rate": lr}
                if peak:
                    record["mfu"] = flops / max(time.perf_counter() - t0, 1e-9) / peak
                    flops = 0.0
                record.update(rate.read())
                record["memory/peak_gib"] = round(peak_memory_gib(device), 3)
                sink.log(record)
                last = record
            if bar is not None:
                bar[0].update(bar[1], advance=1, rate=f"{last.get('pairs_per_second', 0):.2f} pairs/s")
            if cfg.save_steps > 0 and done % cfg.save_steps == 0 and done < s.total_steps:
                ckpt.save_checkpoint(out, done, model, s.tokenizer, optimizer, scheduler,
                                     {"epoch": epoch}, cfg)
                ckpt.rotate(out, cfg.save_total_limit)
    finally:
        if bar is not None:
            bar[0].stop()
        sink.close()
        if s.stream is not None:
            s.stream.close()
            s.stream.summary().save(out / "data_summary.json")
            s.stream.summary().log()

    final = out / "final"
    tmp = out / ".final.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_model(model, s.tokenizer, tmp)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return {"final_dir": str(final), "last": last, **summary}


def _progress_bar(console, total: int, start: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
                   TimeRemainingColumn(), console=console, transient=False)
    task = bar.add_task("train", total=total, completed=start, rate="")
    bar.start()
    return bar, task
