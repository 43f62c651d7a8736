"""`fastdpo tune` and `--gradient_checkpointing auto`: measure checkpointing policies x token budgets on the user's
model and data, and pick the fastest combination that fits the memory limit.

For each candidate the real training step runs for a few steps; the table shows pairs/s (the median over the timed
steps, so one slow step does not decide), peak memory, and what the policy saves against no checkpointing on this
data (its benefit depends on sequence lengths: short pairs gain little memory from recomputation and pay its time
anyway). Only GPU timings mean anything for GPU runs: on a CPU the policies differ by noise."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from fastdpo.config import TrainConfig, checkpoint_policy
from fastdpo.training.measure import annotate, choose, measure, memory_limit_gib

log = logging.getLogger("fastdpo")


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
    from fastdpo.model.load import resolve_device

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


