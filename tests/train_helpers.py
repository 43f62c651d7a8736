"""Configs of short CPU training runs on the easy preference, and the steps they log."""

import json
from pathlib import Path

from data_helpers import easy_rows, write_jsonl

from fastdpo.config import TrainConfig

# a short CPU run with accumulation, a cosine schedule and warm-up: what a stopped and resumed run must reproduce
RUN_SETTINGS = dict(learning_rate=1e-3, per_device_train_batch_size=2, gradient_accumulation_steps=2, seed=3,
                    lr_scheduler_type="cosine", warmup_steps=2, weight_decay=0.01, device="cpu")


def run_config(tmp_path: Path, model: Path, name: str, **kw) -> TrainConfig:
    """RUN_SETTINGS (`kw` over them) on 48 easy rows in tmp_path/data.jsonl, written once; output in tmp_path/name."""
    data = tmp_path / "data.jsonl"
    if not data.exists():
        write_jsonl(data, easy_rows(48, seed=1))
    return TrainConfig(model=str(model), dataset=[str(data)], output_dir=str(tmp_path / name), **{**RUN_SETTINGS, **kw})


def logged_steps(out: Path) -> list[tuple]:
    """(step, loss, grad_norm, learning_rate) of each record in out/metrics.jsonl."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"], r["learning_rate"]) for r in rows]


def two_step_config(tmp_path, model_dir, name, **kw) -> TrainConfig:
    """Two steps of 4 pairs on 16 easy rows in dataset order (`kw` over these); output in tmp_path/name."""
    data = write_jsonl(tmp_path / "data.jsonl", easy_rows(16, seed=2))
    base = dict(learning_rate=1e-3, max_steps=2, logging_steps=1, seed=5, per_device_train_batch_size=4,
                gradient_accumulation_steps=1, shuffle=False)
    return TrainConfig(model=str(model_dir), dataset=[str(data)], output_dir=str(tmp_path / name), **{**base, **kw})

