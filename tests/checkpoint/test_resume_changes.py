"""Resuming with changed settings: the learning-rate schedule the new flags define, a kl_adaptive window of another
size, and a metrics log with unreadable lines."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from data_helpers import easy_rows, write_jsonl

from fastdpo import checkpoint as ckpt
from fastdpo.config import TrainConfig
from fastdpo.dpo.beta import BetaSchedule
from fastdpo.losses import LossInputs
from fastdpo.optim.optimizer import lr_lambda
from fastdpo.training.loop import train

BASE = dict(learning_rate=1e-3, per_device_train_batch_size=2, gradient_accumulation_steps=2, seed=3,
            lr_scheduler_type="cosine", warmup_steps=2, weight_decay=0.01, device="cpu", max_steps=4, save_steps=2)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: identical float summation order across runs


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
    shutil.rmtree(out / "checkpoint-4", ignore_errors=True)  # the finished run's last step: resume mid-run instead
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


# ---------------------------------------------------------------- kl_adaptive window


def feed(b: BetaSchedule, drift: float) -> None:
    tokens = torch.tensor([2])
    b.observe(LossInputs(torch.tensor([drift * 2]), torch.tensor([-drift * 2]), torch.zeros(1), torch.zeros(1),
                         tokens, tokens))
    b.step()


def adaptive(window: int) -> BetaSchedule:
    return BetaSchedule(0.2, "kl_adaptive", target=0.5, window=window, min_ratio=0.5)


@pytest.mark.parametrize("window", [2, 3, 8])
def test_beta_state_loads_into_another_window(window, caplog):
    drifts = [0.1 * (i + 1) for i in range(7)]
    saved = adaptive(3)
    for d in drifts:
        feed(saved, d)
    b = adaptive(window)
    with caplog.at_level("INFO", logger="fastdpo"):
        b.load_state_dict(saved.state_dict())
    assert ("--beta_kl_window" in caplog.text) == (window != 3)
    # the moving average is over the most recent drifts the checkpoint kept, then continues over the new window
    kept = drifts[-min(3, window):]
    assert b.drift_mean() == pytest.approx(sum(kept) / len(kept))
    same = adaptive(window)
    for d in kept:
        feed(same, d)
    assert float(b.value()) == pytest.approx(float(same.value()))
    for d in (2.0, 0.4, 3.0):
        feed(b, d)
        feed(same, d)
        assert b.drift_mean() == pytest.approx(same.drift_mean())
        assert float(b.value()) == pytest.approx(float(same.value()))


def test_beta_state_in_the_same_window_is_restored_exactly():
    saved = adaptive(3)
    for d in (0.5, 1.5, 0.7, 2.5):
        feed(saved, d)
    b = adaptive(3)
    b.load_state_dict(saved.state_dict())
    assert b.state_dict() == saved.state_dict()
    feed(b, 0.9)
    feed(saved, 0.9)
    assert b.state_dict() == saved.state_dict()


# ---------------------------------------------------------------- metrics log


def test_unreadable_metrics_lines_are_named_and_kept_aside(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    original = '{"step": 1, "loss": 1.0}\n{"step": 2, "lo#ss": \n{"step": 3, "loss": 0.8}\n[1]\n{"step": 4, "lo'
    path.write_text(original)
    with caplog.at_level("WARNING", logger="fastdpo"):
        ckpt.truncate_metrics(path, 3)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 3]
    backup = tmp_path / "metrics.jsonl.bak-3"
    assert backup.read_text() == original
    assert str(path) in caplog.text and "lines 2, 4" in caplog.text and str(backup) in caplog.text


def test_a_clean_metrics_log_is_trimmed_without_a_copy(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.9}\n{"step": 3, "lo')  # torn by a kill
    with caplog.at_level("WARNING", logger="fastdpo"):
        ckpt.truncate_metrics(path, 2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    assert not caplog.text and [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


def test_resume_warns_about_a_garbled_metrics_line(trained, tmp_path, caplog):
    cfg = resume_copy(trained, tmp_path)
    path = Path(cfg.output_dir) / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    lines[0] = lines[0][:10] + "\x00garbled\n"
    path.write_text("".join(lines))
    with caplog.at_level("WARNING", logger="fastdpo"):
        train(cfg, progress=False)
    assert [r["step"] for r in logged(cfg.output_dir)] == [2, 3, 4]
    assert f"{path}: line 1 could not be read" in caplog.text, caplog.text
    assert (path.parent / "metrics.jsonl.bak-2").read_text() == "".join(lines)


def test_a_changed_drop_last_is_refused(trained, tmp_path):
    """--dataloader_drop_last decides how many steps an epoch has, so the data order after a resume depends on it."""
    from fastdpo.errors import FastDPOError

    with pytest.raises(FastDPOError, match="written with --dataloader_drop_last false"):
        train(resume_copy(trained, tmp_path, dataloader_drop_last=True), progress=False)


# ---------------------------------------------------------------- settings that change the optimisation


def test_changed_optimizer_settings_are_refused_listing_each(trained, tmp_path, caplog):
    from fastdpo.errors import FastDPOError

    changes = dict(torch_dtype="bfloat16", weight_decay=0.1, adam_beta1=0.8, adam_epsilon=1e-6, max_grad_norm=0.5)
    with pytest.raises(FastDPOError) as e:
        train(resume_copy(trained, tmp_path, **changes), progress=False)
    msg = str(e.value)
    for named in ("--torch_dtype auto → bfloat16", "--weight_decay 0.01 → 0.1", "--adam_beta1 0.9 → 0.8",
                  "--adam_epsilon 1e-08 → 1e-06", "--max_grad_norm 1.0 → 0.5", "--resume_ignore_changes true"):
        assert named in msg, (named, msg)
    shutil.rmtree(tmp_path / "run")
    del changes["torch_dtype"]  # the rest resumes in float32 on the CPU
    with caplog.at_level("WARNING", logger="fastdpo"):
        cfg = resume_copy(trained, tmp_path, resume_ignore_changes=True, **changes)
        assert train(cfg, progress=False)["final_dir"]
    assert "--resume_ignore_changes true" in caplog.text and "--adam_beta1 0.9 → 0.8" in caplog.text


def test_reporting_saving_and_speed_settings_may_change(trained, tmp_path, caplog):
    cfg = resume_copy(trained, tmp_path, logging_steps=2, save_total_limit=1, alert_patience=9, length_buckets=8,
                      per_device_train_batch_size=4, gradient_accumulation_steps=1, disable_progress=True,
                      template_timeout=30.0)
    with caplog.at_level("WARNING", logger="fastdpo"):
        assert train(cfg, progress=False)["final_dir"]
    assert "other settings" not in caplog.text


def test_every_flag_the_resume_compare_names_exists():
    import dataclasses

    from fastdpo.checkpoint.identity import FREE, GUARDED

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert not (set(FREE) | set(GUARDED)) - fields and not set(FREE) & set(GUARDED)
