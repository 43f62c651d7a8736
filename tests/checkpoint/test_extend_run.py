"""A finished run is extended exactly: its last step keeps a checkpoint (when it falls on --save_steps), and
`--resume_from_checkpoint latest` with more steps or epochs continues it as if it had been one longer run. A run
that kept no checkpoint is refused with a command that works."""

import json
import re
from pathlib import Path

import pytest
import torch
from data_helpers import easy_rows, write_jsonl
from safetensors.torch import load_file

from fastdpo import checkpoint as ckpt
from fastdpo.config import TrainConfig
from fastdpo.errors import FastDPOError
from fastdpo.training.loop import train

BASE = dict(learning_rate=1e-3, per_device_train_batch_size=2, gradient_accumulation_steps=2, seed=3, device="cpu",
            lr_scheduler_type="constant", logging_steps=1)

pytestmark = pytest.mark.usefixtures("one_thread")


def config(root: Path, model: Path, name: str, rows: int = 48, **kw) -> TrainConfig:
    data = root / f"data{rows}.jsonl"
    if not data.exists():
        write_jsonl(data, easy_rows(rows, seed=1))
    return TrainConfig(**{"model": str(model), "dataset": [str(data)], "output_dir": str(root / name), **BASE, **kw})


def more(cfg: TrainConfig, **changes) -> TrainConfig:
    return TrainConfig(**{**cfg.to_dict(), "resume_from_checkpoint": "latest", **changes})


def logged(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (Path(out) / "metrics.jsonl").read_text().splitlines())]


def assert_same_run(a: Path, b: Path) -> None:
    assert logged(a) == logged(b)  # every step's loss, bit for bit
    wa, wb = load_file(a / "final" / "model.safetensors"), load_file(b / "final" / "model.safetensors")
    assert set(wa) == set(wb)
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def test_a_finished_run_is_extended_exactly_with_a_higher_max_steps(tmp_path, model_dirs, caplog):
    m = model_dirs("qwen3")
    short = config(tmp_path, m, "run", max_steps=3, save_steps=3)
    train(short, progress=False)
    out = Path(short.output_dir)
    assert [p.name for p in ckpt.complete_checkpoints(out)] == ["checkpoint-3"]  # the last step's, with its optimizer
    with caplog.at_level("INFO", logger="fastdpo"):
        train(more(short, max_steps=5), progress=False)
    assert f"Resumed from {out / 'checkpoint-3'} at step 3" in caplog.text
    train(config(tmp_path, m, "long", max_steps=5, save_steps=3), progress=False)
    assert [s for s, _ in logged(out)] == [1, 2, 3, 4, 5]
    assert_same_run(out, tmp_path / "long")


def test_a_finished_run_is_extended_exactly_with_more_epochs(tmp_path, model_dirs):
    m = model_dirs("qwen3")
    one = config(tmp_path, m, "run", rows=12, num_train_epochs=1, save_steps=3)  # 12 pairs, 4 a step: 3 steps
    train(one, progress=False)
    assert [p.name for p in ckpt.complete_checkpoints(Path(one.output_dir))] == ["checkpoint-3"]
    train(more(one, num_train_epochs=2), progress=False)
    train(config(tmp_path, m, "long", rows=12, num_train_epochs=2, save_steps=3), progress=False)
    assert [s for s, _ in logged(Path(one.output_dir))] == list(range(1, 7))
    assert_same_run(Path(one.output_dir), tmp_path / "long")


def test_resuming_a_finished_run_at_its_last_step_trains_nothing_more(tmp_path, model_dirs):
    """A job restarted after it finished (preempted after its final save) ends at once, as it was."""
    cfg = config(tmp_path, model_dirs("qwen3"), "run", max_steps=2, save_steps=2)
    train(cfg, progress=False)
    out = Path(cfg.output_dir)
    before = logged(out)
    result = train(more(cfg), progress=False)
    assert result["final_dir"] and logged(out) == before


def test_a_run_without_checkpoints_is_refused_with_a_command_that_works(tmp_path, model_dirs):
    cfg = config(tmp_path, model_dirs("qwen3"), "run", max_steps=2)
    train(cfg, progress=False)
    with pytest.raises(FastDPOError) as e:
        train(more(cfg, max_steps=4), progress=False)
    msg = str(e.value)
    assert "no checkpoint to continue from" in msg and "--resume_from_checkpoint latest to continue" not in msg, msg
    suggested = re.search(r"`--model (\S+) --output_dir (\S+)`", msg)
    assert suggested, msg
    model, output_dir = suggested.groups()
    again = TrainConfig(**{**cfg.to_dict(), "model": model, "output_dir": output_dir, "max_steps": 2})
    assert Path(train(again, progress=False)["final_dir"]).is_dir()
