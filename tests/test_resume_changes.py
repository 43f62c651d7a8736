"""Resuming with changed settings: the learning-rate schedule the new flags define, a kl_adaptive window of another
size, and a metrics log with unreadable lines."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import easy_rows, write_jsonl

from fastdpo.config import TrainConfig
from fastdpo.optim import lr_lambda
from fastdpo.train import train

BASE = dict(learning_rate=1e-3, per_device_train_batch_size=2, gradient_accumulation_steps=2, seed=3,
            lr_scheduler_type="cosine", warmup_steps=2, weight_decay=0.01, device="cpu", max_steps=4, save_steps=2)


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, model_dirs):
    """A finished 4-step run that kept checkpoint-2; copy it before changing it."""
    root = tmp_path_factory.mktemp("trained")
    data = write_jsonl(root / "data.jsonl", easy_rows(48, seed=1))
    cfg = TrainConfig(model=str(model_dirs("qwen3")), dataset=[str(data)], output_dir=str(root / "run"), **BASE)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as the resumed runs: identical float summation order
    try:
        train(cfg, progress=False)
    finally:
        torch.set_num_threads(before)
    return cfg


def resume_copy(trained: TrainConfig, tmp_path: Path, **changes) -> TrainConfig:
    out = tmp_path / "run"
    shutil.copytree(trained.output_dir, out)
    return TrainConfig(**{**trained.to_dict(), "output_dir": str(out), "resume_from_checkpoint": "latest", **changes})


def logged(out: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------- learning-rate schedule


@pytest.mark.parametrize("changes,named", [
    (dict(learning_rate=1e-5), ["--learning_rate 0.001 → 1e-05"]),
    (dict(max_steps=6), ["--max_steps 4 → 6"]),
    (dict(lr_scheduler_type="linear", warmup_steps=3), ["--lr_scheduler_type cosine → linear", "--warmup_steps 2 → 3"]),
])
def test_a_changed_schedule_is_followed_from_the_resumed_step(trained, tmp_path, caplog, changes, named):
    cfg = resume_copy(trained, tmp_path, **changes)
    with caplog.at_level("WARNING", logger="fastdpo"):
        train(cfg, progress=False)
    f = lr_lambda(cfg, cfg.max_steps)
    rows = logged(cfg.output_dir)
    assert [r["step"] for r in rows] == list(range(1, cfg.max_steps + 1))
    assert [r["learning_rate"] for r in rows[2:]] == [cfg.learning_rate * f(step) for step in range(2, cfg.max_steps)]
    warnings = [r.getMessage() for r in caplog.records if "schedule" in r.getMessage()]
    assert len(warnings) == 1 and all(n in warnings[0] for n in named), warnings


def test_an_unchanged_schedule_logs_no_schedule_warning(trained, tmp_path, caplog):
    cfg = resume_copy(trained, tmp_path)
    with caplog.at_level("WARNING", logger="fastdpo"):
        train(cfg, progress=False)
    assert "schedule" not in caplog.text
    before = [(r["step"], r["learning_rate"], r["loss"]) for r in logged(trained.output_dir)]
    assert [(r["step"], r["learning_rate"], r["loss"]) for r in logged(cfg.output_dir)] == before
