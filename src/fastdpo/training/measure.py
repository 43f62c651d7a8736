"""Timing the real training step: `run_fastdpo` runs `Trainer.step` for warm-up and timed steps and reports pairs/s,
MFU and peak memory (`fastdpo bench`); `measure` does it for checkpointing policies x token budgets and `choose`
picks the fastest that fits (`fastdpo tune`, `--gradient_checkpointing auto`). `pairs_flops` and `mfu` are the one
account of FLOPs and MFU, for these numbers and the training loop's logged `mfu`."""

from __future__ import annotations

import dataclasses
import gc
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

from fastdpo.config import TrainConfig
from fastdpo.data.load import Row
from fastdpo.data.pack import prompt_groups
from fastdpo.data.prepare import DataOptions, tokenize_pairs
from fastdpo.data.tokenize import TokenizedPair
from fastdpo.errors import FastDPOError
from fastdpo.model.load import base_causal_lm, resolve_device, resolve_dtype
from fastdpo.model.shapes import bench_model
from fastdpo.observe.gcpause import GcPauses
from fastdpo.observe.metrics import device_peak_flops, model_flops_per_token, padding, step_flops
from fastdpo.observe.profile import report, start_profiler, synchronize
from fastdpo.training.certificate import Certificate
from fastdpo.training.setup import assemble, pairs_for_loss, rows_for_loss, seed_all
from fastdpo.training.trainer import StepResult, Trainer, attended_pairs

log = logging.getLogger("fastdpo")


def pairs_flops(lm_config, pairs: list[TokenizedPair], with_reference: bool, group: bool = False,
                dedupe: bool = True) -> float:
    """Useful FLOPs of an optimizer step over `pairs` (`observe.metrics.step_flops`: every token of the policy's
    forward and backward, the reference's forward when it runs online, the output head over completion tokens,
    attention over the (query, key) pairs the layout allows). With `group` (grouped layouts), what the step's
    prompt groups need: each prompt once, and each distinct completion once with `dedupe`."""
    if not group:
        return step_flops(lm_config, sum(p.num_tokens for p in pairs),
                          sum(len(p.chosen) + len(p.rejected) for p in pairs), sum(attended_pairs(p) for p in pairs),
                          with_reference)
    tokens = completions = attended = 0
    for members in prompt_groups(pairs):
        n_p = len(members[0].prompt)
        ys = [c for p in members for c in (p.chosen, p.rejected)]
        lengths = [len(y) for y in ({tuple(y): y for y in ys}.values() if dedupe else ys)]
        tokens += n_p + sum(lengths)
        completions += sum(lengths)
        attended += n_p * (n_p + 1) // 2 + sum(n * n_p + n * (n + 1) // 2 for n in lengths)
    return step_flops(lm_config, tokens, completions, attended, with_reference)


def mfu(flops: float, seconds: float, peak: float, devices: int = 1) -> float:
    """Model FLOPs utilisation: `flops` done in `seconds` over what `devices` devices of `peak` FLOP/s could do."""
    return flops / seconds / (peak * devices)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_pairs(cfg: TrainConfig, rows: list[dict], tokenizer) -> list[TokenizedPair]:
    """The bench's rows (prompt/chosen/rejected) tokenised as training reads them for the run's loss (for KTO
    unpaired in TRL's order, with their KL completions, as TRL's KTOTrainer prepares paired rows)."""
    names = [name for name, _ in cfg.loss_terms()]
    read = rows_for_loss([Row(r["prompt"], r["chosen"], r["rejected"], f"row {i}") for i, r in enumerate(rows)], names)
    pairs = tokenize_pairs(read, tokenizer, DataOptions.for_scoring(cfg))[0]
    return pairs_for_loss(pairs, read, names, cfg.per_device_train_batch_size, cfg.max_length,
                          cfg.max_completion_length)


def run_fastdpo(cfg: TrainConfig, shape: str | None, rows: list[dict], steps: int, warmup: int,
                verbose: bool = True, profile_dir: str | None = None) -> dict:
    """Time `steps` optimizer steps of the real training step after `warmup` steps; with `profile_dir`, profile
    two more steps afterwards (outside the timing)."""

    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.torch_dtype, device)
    seed_all(cfg.seed)
    tokenizer, model = bench_model(cfg, shape, device, dtype)
    pairs = bench_pairs(cfg, rows, tokenizer)
    t_init = time.perf_counter()
    cfg = dataclasses.replace(cfg, max_steps=steps + warmup)  # the schedules span exactly the steps run here
    per_step = cfg.pairs_per_step
    chunks = [pairs[i * per_step:(i + 1) * per_step] for i in range(warmup + steps)]
    trainer = Trainer(cfg, assemble(cfg, device, model, tokenizer, pairs, steps=chunks))
    if cfg.certificate != "off":  # checked by the first (warm-up) step, as training checks it
        trainer.certificate = Certificate(cfg.certificate)
    s = trainer.s
    lm_cfg = base_causal_lm(s.model).config.get_text_config()  # a vision-language model: its language model
    times, flops, tokens, n_pairs, computed = [], 0.0, 0, 0, 0
    rates = []  # pairs/s of each timed step
    queued, waited = [], []  # the host's side of each timed step (`StepResult.queued_s`, `.waited_s`)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t_first = None
    if s.backend.name == "flex":  # compiled layers, and the compiled flex kernel on its own, build per length
        trainer.warm_up()

    def one_step(step_pairs, then=None) -> StepResult:
        result = trainer.step(step_pairs, then)
        _sync(device)
        return result

    pauses = GcPauses(cfg.gc_steps).start()  # as training schedules and counts Python's collections
    try:
        for step in range(warmup + steps):
            step_pairs = chunks[step]
            ran = one_step(step_pairs, chunks[step + 1] if step + 1 < len(chunks) else None)
            pauses.step_end(step + 1)
            times.append(time.perf_counter())
            prev = times[-2] if len(times) > 1 else t_init
            if verbose:
                print(f"bench step {step}: {times[-1] - prev:.3f}s", file=sys.stderr, flush=True)
            if step == 0:
                t_first = times[0] - t_init
            if step == warmup - 1:
                pauses.take()  # the timed steps' pauses only
            if step >= warmup:
                tokens += sum(p.num_tokens for p in step_pairs)
                computed += ran.metrics.computed_tokens
                queued.append(ran.queued_s)
                waited.append(ran.waited_s)
                n_pairs += len(step_pairs)
                rates.append(len(step_pairs) / (times[-1] - prev))
                flops += pairs_flops(lm_cfg, step_pairs, s.reference.online, s.backend.group, s.backend.dedupe)
        gc_pauses = pauses.take()
    finally:
        pauses.stop()
    dt = times[-1] - times[warmup - 1] if warmup else times[-1] - t_init
    peak = device_peak_flops(device)
    profile = profile_steps(one_step, chunks[:2], device, profile_dir) if profile_dir else None
    return {
        "impl": "fastdpo", "pairs_per_s": round(n_pairs / dt, 2), "tokens_per_s": round(tokens / dt),
        "pairs_per_s_median": round(statistics.median(rates), 2),  # of the timed steps: one slow step cannot sway it
        # medians: the host's time to queue a step, then its wait for the device (near zero: bound by the CPU)
        "host_queue_ms": round(1e3 * statistics.median(queued), 1), "device_wait_ms": round(1e3 * statistics.median(waited), 1),
        "s_per_step": round(dt / steps, 4), "padding": padding(computed, tokens),
        "mfu": round(mfu(flops, dt, peak), 4) if peak else None,
        "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
        "first_step_s": round(t_first, 1), "gc_pause_ms": gc_pauses["gc/pause_ms"],
        "gc_collections": gc_pauses["gc/collections"], "backend": s.backend.name, "reference": s.reference.strategy,
        "gradient_checkpointing": s.plan.gradient_checkpointing, "max_tokens_per_batch": s.plan.max_tokens_per_batch,
        "params": sum(p.numel() for p in s.model.parameters()),
        "flops_per_token_fwd": model_flops_per_token(lm_cfg),
        **({"profile": profile} if profile else {}),
        **({"certificate": certificate_brief(trainer.certificate)} if trainer.certificate is not None else {}),
    }


def certificate_brief(cert: Certificate) -> dict:
    """The certificate of a bench run: its status, cost and each check's status and figure."""
    cert.finish()
    return brief_of(cert.to_dict())


def brief_of(saved: dict) -> dict:
    """A certificate as `Certificate.to_dict` (or a run's summary.json) holds it, briefly: its status, its cost
    (seconds, by part, and besides seconds) and each check's [status, figure]."""
    return {"status": saved["status"], "seconds": saved["seconds"], "seconds_by_part": saved.get("seconds_by_part", {}),
            "costs": saved.get("costs", {}), "checks": {c["name"]: [c["status"], c["measured"]] for c in saved["checks"]}}


def certificate_line(brief: dict) -> str:
    checks = ", ".join(f"{name} {status}" + (f" {measured:.3g}" if measured is not None else "")
                       for name, (status, measured) in brief["checks"].items())
    return f"certificate {brief['status']} in {brief['seconds']:.2f} s: {checks} (nats per completion token)"


def profile_steps(one_step, steps: list, device: torch.device, out_dir: str) -> dict:
    """Run `one_step` on each of `steps` under torch.profiler; write the Chrome trace, the operators and kernels
    that took the most time and the compute/communication/idle breakdown into `out_dir` (`fastdpo.observe.profile`)."""
    prof = start_profiler(device)
    t0 = time.perf_counter()
    try:
        for i, step_pairs in enumerate(steps):
            one_step(step_pairs, steps[i + 1] if i + 1 < len(steps) else None)
        synchronize(device)
    finally:
        prof.__exit__(None, None, None)
    return report(prof, Path(out_dir), len(steps), time.perf_counter() - t0, device)


DEFAULT_POLICIES = ("none", "ffn", "attn", "full")


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def memory_limit_gib(requested: float, device: torch.device) -> float | None:
    """The memory a candidate may use: as requested, else 90 % of the device's memory (None on CPU: no limit)."""
    if requested > 0:
        return requested
    if device.type == "cuda":
        return 0.9 * torch.cuda.get_device_properties(device).total_memory / 2**30
    return None


def measure(cfg: TrainConfig, rows: list[dict], policies: list[str], budgets: list[int], steps: int, warmup: int,
            shape: str | None = None) -> list[dict]:
    """One row per (policy, budget): pairs/s (median of the timed steps) and peak GiB, or the reason it failed (out
    of memory)."""
    from fastdpo.training.measure import run_fastdpo

    results = []
    for budget in budgets:
        for policy in policies:
            trial = dataclasses.replace(cfg, gradient_checkpointing=policy, max_tokens_per_batch=budget)
            row = {"policy": policy, "budget": budget}
            try:
                r = run_fastdpo(trial, shape, rows, steps, warmup, verbose=False)
                row.update(pairs_per_s=r["pairs_per_s_median"], peak_gib=r["peak_gib"], mfu=r["mfu"])
            except torch.cuda.OutOfMemoryError:
                row["error"] = "out of memory"
            _free()
            results.append(row)
    return results


def choose(results: list[dict], limit_gib: float | None) -> dict | None:
    """The fastest candidate that ran and fits the limit."""
    fits = [r for r in results if "error" not in r and (limit_gib is None or (r["peak_gib"] or 0) <= limit_gib)]
    return max(fits, key=lambda r: r["pairs_per_s"]) if fits else None


def annotate(results: list[dict]) -> None:
    """Speed and memory of each policy relative to no checkpointing at the same budget (seed the sweet spot)."""
    base = {r["budget"]: r for r in results if r["policy"] == "none" and "error" not in r}
    for r in results:
        b = base.get(r["budget"])
        if b is None or "error" in r or r is b:
            continue
        r["speed_vs_none"] = round(r["pairs_per_s"] / b["pairs_per_s"], 3)
        if b.get("peak_gib") and r.get("peak_gib") is not None:
            r["memory_saved"] = round(1 - r["peak_gib"] / b["peak_gib"], 3)


def auto_policy(cfg: TrainConfig, rows: list[dict], device: torch.device) -> str:
    """Resolve `--gradient_checkpointing auto`: on CUDA, the fastest policy that fits at the configured budget,
    measured on the first rows of the data; on CPU memory is not the constraint, so no checkpointing."""
    if device.type != "cuda":
        log.info("--gradient_checkpointing auto: no checkpointing on CPU.")
        return "none"
    budget = cfg.max_tokens_per_batch
    need = cfg.pairs_per_step * 3
    if len(rows) < need:
        rows = (rows * (need // max(1, len(rows)) + 1))[:need]
    results = measure(cfg, rows[:need], list(DEFAULT_POLICIES), [budget], steps=2, warmup=1)
    annotate(results)
    best = choose(results, memory_limit_gib(cfg.max_memory_gib, device))
    if best is None:
        raise FastDPOError("--gradient_checkpointing auto: every policy ran out of memory at --max_tokens_per_batch "
                           f"{budget}. Lower the budget, use LoRA, or --precompute_ref_log_probs.")
    log.info("--gradient_checkpointing auto chose %s (%s)", best["policy"],
             ", ".join(f"{r['policy']}: {r.get('pairs_per_s', r.get('error'))}" for r in results))
    return best["policy"]
