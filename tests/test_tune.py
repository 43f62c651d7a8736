"""`fastdpo tune` and `--gradient_checkpointing auto`: candidates measured, out-of-memory ones excluded, the fastest
fitting one chosen."""

import json

import pytest
import torch
from conftest import easy_rows

from fastdpo import tune
from fastdpo.config import TrainConfig


def test_choose_respects_limit_and_errors():
    rows = [{"policy": "none", "budget": 64, "pairs_per_s": 9.0, "peak_gib": 30.0},
            {"policy": "ffn", "budget": 64, "pairs_per_s": 7.0, "peak_gib": 18.0},
            {"policy": "full", "budget": 64, "pairs_per_s": 5.0, "peak_gib": 12.0},
            {"policy": "attn", "budget": 64, "error": "out of memory"}]
    assert tune.choose(rows, 20.0)["policy"] == "ffn"
    assert tune.choose(rows, None)["policy"] == "none"
    assert tune.choose(rows, 10.0) is None
    tune.annotate(rows)
    assert rows[1]["speed_vs_none"] == pytest.approx(7 / 9, abs=1e-3)
    assert rows[2]["memory_saved"] == pytest.approx(0.6)


def test_run_tune_measures_each_candidate(tmp_path, model_dirs, monkeypatch):
    from fastdpo import bench

    real = bench.run_fastdpo

    def fake_oom(cfg, *a, **k):  # the 'attn' candidate runs out of memory
        if cfg.gradient_checkpointing == "attn":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return real(cfg, *a, **k)

    monkeypatch.setattr(bench, "run_fastdpo", fake_oom)
    cfg = TrainConfig(model=str(model_dirs("qwen3")), dataset=["x"], per_device_train_batch_size=4,
                      output_dir=str(tmp_path / "o"))
    out = tmp_path / "tune.json"
    best = tune.run_tune(cfg, easy_rows(12), ["none", "attn", "full"], [64], steps=1, warmup=1, max_memory_gib=0,
                         out_json=str(out), console=None)
    report = json.loads(out.read_text())
    assert [r["policy"] for r in report["results"]] == ["none", "attn", "full"]
    assert report["results"][1]["error"] == "out of memory"
    assert best["policy"] in ("none", "full") and best["pairs_per_s"] > 0
    assert best == max((r for r in report["results"] if "error" not in r), key=lambda r: r["pairs_per_s"])


def test_auto_policy_on_cpu_is_none():
    cfg = TrainConfig(model="m", dataset=["d"], gradient_checkpointing="auto")
    cfg.validate()  # auto is a valid value
    assert tune.auto_policy(cfg, easy_rows(4), torch.device("cpu")) == "none"
