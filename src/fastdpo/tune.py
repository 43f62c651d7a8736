"""`fastdpo tune` and `--gradient_checkpointing auto`: measure checkpointing policies x token budgets on the user's
model and data, and pick the fastest combination that fits the memory limit.

For each candidate the real training step runs for a few steps; the table shows pairs/s (the median over the timed
steps, so one slow step does not decide), peak memory, and what the policy saves against no checkpointing on this
data (its benefit depends on sequence lengths: short pairs gain little memory from recomputation and pay its time
anyway). Only GPU timings mean anything for GPU runs: on a CPU the policies differ by noise."""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
from pathlib import Path

import torch

from fastdpo.config import TrainConfig, checkpoint_policy
from fastdpo.errors import FastDPOError

log = logging.getLogger("fastdpo")

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
    from fastdpo.bench import run_fastdpo

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


def print_table(console, results: list[dict], best: dict | None, limit: float | None) -> None:
    from rich.table import Table

    table = Table(title=f"fastdpo tune (memory limit: {f'{limit:.1f} GiB' if limit else 'none'})")
    for col in ("policy", "budget", "pairs/s", "peak GiB", "vs none", "memory saved", ""):
        table.add_column(col)
    for r in results:
        mark = "<- best" if r is best else ""
        if "error" in r:
            table.add_row(r["policy"], str(r["budget"]), r["error"], "", "", "", "")
            continue
        saved = f"{r['memory_saved']:.0%}" if "memory_saved" in r else ""
        table.add_row(r["policy"], str(r["budget"]), f"{r['pairs_per_s']:.2f}", str(r["peak_gib"] or "n/a"),
                      f"{r['speed_vs_none']:.2f}x" if "speed_vs_none" in r else "", saved, mark)
    console.print(table)


def run_tune(cfg: TrainConfig, rows: list[dict], policies: list[str], budgets: list[int], steps: int, warmup: int,
             max_memory_gib: float, out_json: str | None, console, shape: str | None = None) -> dict | None:
    from fastdpo.model import resolve_device

    for policy in policies:
        checkpoint_policy(policy, "policies")  # raises on a bad value before anything runs
    device = resolve_device(cfg.device)
    if device.type != "cuda":
        log.warning("fastdpo tune on %s: CPU timings do not represent a GPU, so the policy picked here is not "
                    "meaningful for GPU runs. Run tune on the GPU you will train on.", device.type)
    limit = memory_limit_gib(max_memory_gib, device)
    results = measure(cfg, rows, policies, budgets, steps, warmup, shape)
    annotate(results)
    best = choose(results, limit)
    if console is not None:
        print_table(console, results, best, limit)
        if best is None:
            console.print("[red]No candidate fits.[/] Try smaller budgets, LoRA, or a precomputed reference.")
        else:
            console.print(f"Use: --gradient_checkpointing {best['policy']} --max_tokens_per_batch {best['budget']}")
    if out_json:
        Path(out_json).write_text(json.dumps({"limit_gib": limit, "best": best, "results": results}, indent=1))
    return best


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
