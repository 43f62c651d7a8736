"""Whole runs on data that is not one pair per row, from the command line: unpaired rows with KTO (TRL's and
ms-swift's spellings), rankings with Plackett-Luce, and the clear refusals when data and loss do not fit."""

import json

import pytest
from cli_helpers import run_cli
from data_helpers import write_jsonl

UNPAIRED = [{"prompt": f"w{10 + i} w{20 + i}", "completion": " w5 w6" if i % 2 == 0 else " w7 w8 w9",
             "label": i % 2 == 0} for i in range(16)]
RANKED = [{"prompt": f"w{10 + i}", "completions": [" w5 w6", " w7", " w8 w9"], "scores": [3, 2, 1]} for i in range(8)]
COMMON = ["--device", "cpu", "--learning_rate", "1e-3", "--logging_steps", "1", "--save_strategy", "no"]


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_kto_trains_unpaired_rows_and_logs_trl_metrics(tmp_path, model_dirs, capsys):
    data = write_jsonl(tmp_path / "kto.jsonl", UNPAIRED)
    out = tmp_path / "kto"
    rc, text = run_cli(capsys, "train", "--model", model_dirs("qwen3"), "--dataset", data, "--output_dir", out,
                       "--loss_type", "kto", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
                       "--num_train_epochs", "2", *COMMON)
    assert rc == 0, text
    logged = metrics(out)
    assert len(logged) == 4  # 16 rows, 8 per step, two epochs
    for name in ("loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
                 "logps/rejected"):
        assert all(name in r for r in logged), name
    assert logged[-1]["rewards/margins"] > logged[0]["rewards/margins"]  # desirable completions gain
    assert "16 unpaired rows, 8 desirable and 8 undesirable" in text
    assert (out / "final" / "model.safetensors").exists()


def test_ms_swift_kto_command(tmp_path, model_dirs, capsys):
    rows = [{"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"]}],
             "label": r["label"]} for r in UNPAIRED[:8]]
    data = write_jsonl(tmp_path / "swift.jsonl", rows)
    rc, text = run_cli(capsys, "train", "--rlhf_type", "kto", "--model", model_dirs("qwen3"), "--dataset", data,
                       "--output_dir", tmp_path / "swift", "--train_type", "full", "--max_steps", "1",
                       "--desirable_weight", "1.2", "--template", "chatml", *COMMON)
    assert rc == 0, text
    assert "kl" in metrics(tmp_path / "swift")[0]


def test_a_pairwise_loss_refuses_unpaired_rows(tmp_path, model_dirs, capsys):
    data = write_jsonl(tmp_path / "kto.jsonl", UNPAIRED)
    rc, text = run_cli(capsys, "train", "--model", model_dirs("qwen3"), "--dataset", data, "--output_dir",
                       tmp_path / "o", "--max_steps", "1", *COMMON)
    assert rc != 0
    assert "16 of 16 rows are unpaired" in text and "kto.jsonl:1" in text and "--loss_type kto" in text
    assert "Traceback" not in text


def test_kto_needs_rows_to_rotate(tmp_path, model_dirs, capsys):
    data = write_jsonl(tmp_path / "kto.jsonl", UNPAIRED)
    rc, text = run_cli(capsys, "train", "--model", model_dirs("qwen3"), "--dataset", data, "--output_dir",
                       tmp_path / "o", "--loss_type", "kto", "--per_device_train_batch_size", "1", *COMMON)
    assert rc != 0 and "--per_device_train_batch_size 2 or more" in text


def test_plackett_luce_trains_rankings(tmp_path, model_dirs, capsys):
    data = write_jsonl(tmp_path / "ranked.jsonl", RANKED)
    out = tmp_path / "pl"
    rc, text = run_cli(capsys, "train", "--model", model_dirs("qwen3"), "--dataset", data, "--output_dir", out,
                       "--loss_type", "plackett_luce", "--per_device_train_batch_size", "2",
                       "--gradient_accumulation_steps", "2", *COMMON)
    assert rc == 0, text
    assert "8 rankings of 3 to 3 completions (16 pairs)" in text
    assert len(metrics(out)) == 2  # 8 rankings, 4 per step


def test_kto_evaluates_held_out_rows_in_training_and_after(tmp_path, model_dirs, capsys):
    """--val_dataset under KTO logs TRL's eval metrics; `fastdpo eval --loss_type kto` on the final model scores the
    same rows the same way (same weights, same batches)."""
    data = write_jsonl(tmp_path / "kto.jsonl", UNPAIRED)
    held = write_jsonl(tmp_path / "held.jsonl", UNPAIRED[:8])
    out = tmp_path / "kto"
    rc, text = run_cli(capsys, "train", "--model", model_dirs("qwen3"), "--dataset", data, "--val_dataset", held,
                       "--output_dir", out, "--loss_type", "kto", "--per_device_train_batch_size", "4", *COMMON)
    assert rc == 0, text
    last = [r for r in metrics(out) if "eval_loss" in r][-1]
    assert {"eval_kl", "eval_rewards/chosen", "eval_rewards/margins", "eval_logps/rejected"} <= set(last)
    rc, text = run_cli(capsys, "eval", "--model", out / "final", "--ref_model", model_dirs("qwen3"), "--dataset", held,
                       "--loss_type", "kto", "--per_device_eval_batch_size", "4", "--output_dir", tmp_path / "ev")
    assert rc == 0, text
    report = json.loads((tmp_path / "ev" / "eval_report.json").read_text())["metrics"]
    for name in ("loss", "kl", "rewards/chosen", "rewards/rejected"):
        assert report[name] == pytest.approx(last[f"eval_{name}"], rel=1e-4, abs=1e-6), name
