"""Compare training runs of the same job (e.g. one GPU vs DDP vs FSDP2 on N GPUs, same global batch) from their
metrics.jsonl: the loss curve step by step, pairs/s per GPU (median step) against the first run, peak memory per GPU.

    python benchmarks/compare_runs.py out/1gpu:1 out/ddp:2 out/fsdp:2 [--skip 3] [--tolerance 0.02]

Prints a Markdown table; exits 1 when a run's loss leaves the first run's by more than the tolerance (relative)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def metrics_file(run: str) -> Path:
    """A run's metrics: RUN/metrics.jsonl, or RUN itself when it is a .jsonl file (a copied run's metrics)."""
    p = Path(run)
    return p if p.suffix == ".jsonl" else p / "metrics.jsonl"


def read(run_dir: str) -> list[dict]:
    rows = [json.loads(line) for line in open(metrics_file(run_dir), encoding="utf-8") if line.strip()]
    return [r for r in rows if "loss" in r and "pairs_per_second" in r]  # training steps, not evaluations


def compare(runs: list[tuple[str, int]], skip: int, tolerance: float, overlap: bool = False,
            until: int = 0) -> tuple[list[dict], bool]:
    """Per run: loss against the first run's at the same steps (all of them, or with `overlap` the steps both
    logged, e.g. a resumed run), median pairs/s of the steps after `skip` (and up to `until` when > 0, e.g. to leave out
    profiled steps), per GPU and relative to the first run, peak GiB."""
    base_rows = read(runs[0][0])
    base_loss = {r["step"]: r["loss"] for r in base_rows}
    base_rate = None
    out, ok = [], True
    for run_dir, gpus in runs:
        rows = read(run_dir)
        diffs = [abs(r["loss"] - base_loss[r["step"]]) / max(abs(base_loss[r["step"]]), 1e-8)
                 for r in rows if r["step"] in base_loss]
        timed = [r["pairs_per_second"] for r in rows if r["step"] > skip and (not until or r["step"] <= until)]
        # the median step: steps that compile a new micro-batch length (a one-time cost, at most a few per run) are
        # outliers that a mean over 15 steps would weigh by chance
        rate = statistics.median(timed) if timed else float("nan")
        per_gpu = rate / gpus
        base_rate = per_gpu if base_rate is None else base_rate
        worst = max(diffs) if diffs else float("nan")
        complete = len(diffs) == len(rows) if overlap else len(diffs) == len(base_loss) == len(rows)
        ok &= bool(diffs) and worst <= tolerance and complete
        out.append({"run": run_dir, "gpus": gpus, "steps": len(rows), "max_rel_loss_diff": worst,
                    "pairs_per_s": rate, "pairs_per_s_per_gpu": per_gpu, "scaling": per_gpu / base_rate,
                    "peak_gib": max((r.get("memory/peak_gib", 0) for r in rows), default=0)})
    return out, ok


def table(rows: list[dict], tolerance: float) -> str:
    lines = ["| run | GPUs | steps | max rel. loss diff | pairs/s | pairs/s per GPU | per GPU vs first | peak GiB/GPU |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['gpus']} | {r['steps']} | {r['max_rel_loss_diff']:.2e} | "
                     f"{r['pairs_per_s']:.2f} | {r['pairs_per_s_per_gpu']:.2f} | {r['scaling']:.1%} | {r['peak_gib']} |")
    lines.append(f"\nLoss tolerance: {tolerance:g} relative, per step.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="RUN_DIR:GPUS (or a metrics .jsonl file:GPUS); the first is the baseline.")
    p.add_argument("--skip", type=int, default=3, help="Steps left out of pairs/s (compilation, warm-up).")
    p.add_argument("--tolerance", type=float, default=0.02, help="Max relative loss difference per step.")
    p.add_argument("--until", type=int, default=0, help="Last step counted in pairs/s (0: all; e.g. leave out "
                   "profiled steps).")
    p.add_argument("--overlap", action="store_true", help="Compare only the steps both runs logged (resumed runs).")
    a = p.parse_args(argv)
    runs, missing = [], []
    for spec in a.runs:
        path, _, gpus = spec.rpartition(":")
        run = (path, int(gpus)) if path else (spec, 1)
        (runs if metrics_file(run[0]).is_file() else missing).append(run)
    if not runs or runs[0][0] != (a.runs[0].rpartition(":")[0] or a.runs[0]):
        print(f"No metrics.jsonl in the baseline run {a.runs[0]}: nothing to compare.")
        return 1
    rows, ok = compare(runs, a.skip, a.tolerance, a.overlap, a.until)
    print(table(rows, a.tolerance))
    for path, _ in missing:
        print(f"{path}: no metrics.jsonl (the run failed or did not start); see its log.")
    return 0 if ok and not missing else 1


if __name__ == "__main__":
    sys.exit(main())
