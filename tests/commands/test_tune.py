"""`fastdpo tune` and `--gradient_checkpointing auto`: candidates measured, out-of-memory ones excluded, the fastest
fitting one chosen."""

import json

import pytest
import torch
from data_helpers import easy_rows

from fastdpo.commands import tune
from fastdpo.config import TrainConfig
from fastdpo.errors import FastDPOError
from fastdpo.training import measure


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
    from fastdpo.training import measure as bench

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
    assert measure.auto_policy(cfg, easy_rows(4), torch.device("cpu")) == "none"


def test_a_bad_value_names_its_flag_and_auto_where_it_is_accepted():
    with pytest.raises(FastDPOError,
                       match=r"--gradient_checkpointing 'bogus' is not one of: .*every:K, keep:N, fit, auto\."):
        TrainConfig(model="m", dataset=["d"], gradient_checkpointing="bogus").validate()
    cfg = TrainConfig(model="m", dataset=["d"])
    with pytest.raises(FastDPOError, match=r"--policies 'auto' is not one of: .*every:K, keep:N\.$"):
        tune.run_tune(cfg, easy_rows(4), ["none", "auto"], [64], steps=1, warmup=1, max_memory_gib=0, out_json=None,
                      console=None)


def test_tune_on_cpu_warns_and_takes_the_median_step(tmp_path, model_dirs, monkeypatch, caplog):
    from fastdpo.training import measure as bench

    def fake_run(cfg, *a, **k):  # one slow step must not decide
        return {"pairs_per_s": 1.0, "pairs_per_s_median": 10.0, "peak_gib": None, "mfu": None}

    monkeypatch.setattr(bench, "run_fastdpo", fake_run)
    cfg = TrainConfig(model=str(model_dirs("qwen3")), dataset=["x"], device="cpu", output_dir=str(tmp_path / "o"))
    with caplog.at_level("WARNING", logger="fastdpo"):
        best = tune.run_tune(cfg, easy_rows(4), ["none", "full"], [64], steps=3, warmup=1, max_memory_gib=0,
                             out_json=None, console=None)
    assert best["pairs_per_s"] == 10.0
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "CPU timings do not represent a GPU" in warned[0], warned
    assert "not meaningful for GPU runs" in warned[0]


def test_bench_reports_the_median_of_the_timed_steps(tmp_path, model_dirs):
    from fastdpo.training.measure import run_fastdpo

    cfg = TrainConfig(model=str(model_dirs("qwen3")), dataset=["x"], device="cpu", per_device_train_batch_size=2,
                      output_dir=str(tmp_path / "o"))
    r = run_fastdpo(cfg, None, easy_rows(10), steps=3, warmup=1, verbose=False)
    assert r["pairs_per_s_median"] > 0
