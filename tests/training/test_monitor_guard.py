"""The update guard (NaN/Inf: skip, count, stop keeping the last good checkpoint) and the out-of-memory message,
on short training runs of a tiny CPU model."""

import json

import pytest
import torch
from data_helpers import easy_rows, write_jsonl
from safetensors.torch import load_file

import fastdpo.training.loop as train_mod
import fastdpo.training.trainer as step_mod
from fastdpo import checkpoint as ckpt
from fastdpo.checkpoint import restore
from fastdpo.config import TrainConfig
from fastdpo.errors import FastDPOError
from fastdpo.training.monitor import NonFiniteStop


def run(tmp_path, model, name, rows, **kw):
    data = write_jsonl(tmp_path / f"{name}.jsonl", rows)
    base = dict(learning_rate=1e-3, max_steps=6, per_device_train_batch_size=8, seed=3)
    cfg = TrainConfig(model=str(model), dataset=[str(data)], output_dir=str(tmp_path / name), **{**base, **kw})
    return train_mod.train(cfg, progress=False)


def alerts(out):
    return [json.loads(x) for x in (out / "alerts.jsonl").read_text().splitlines()]


def records(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def poison(monkeypatch, bad_steps):
    """Make the gradients and loss of the given (1-based) optimizer steps NaN."""
    real = step_mod.run_step
    calls = []

    def run_step(s, step_pairs, metrics, ahead=None):
        real(s, step_pairs, metrics, ahead)
        calls.append(1)
        if len(calls) in bad_steps:
            next(p for p in s.model.parameters() if p.requires_grad).grad.fill_(float("nan"))
            metrics.sums[0] = float("nan")

    monkeypatch.setattr(step_mod, "run_step", run_step)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # torch's AdamW (host decides); fastdpo's (flag obeyed)
def test_nan_steps_are_skipped_and_counted(tmp_path, model_dirs, monkeypatch, dtype):
    poison(monkeypatch, {3, 4})
    result = run(tmp_path, model_dirs("qwen3"), "nan", easy_rows(48, 1), save_steps=2, torch_dtype=dtype)
    out = tmp_path / "nan"
    rows = records(out)
    assert [r["skipped_steps"] for r in rows] == [0, 0, 1, 2, 2, 2]
    assert rows[2]["loss"] == "nan" and rows[2]["update_gap"] == "inf" and rows[4]["update_gap"] == 1.0
    got = [(a["name"], a["step"], a["repeats"]) for a in alerts(out) if a["name"] == "nonfinite"]
    assert got == [("nonfinite", 3, 0)]  # step 4: rate-limited
    # the skipped steps 3 and 4 changed nothing: checkpoint-4 holds exactly the weights of checkpoint-2
    w2, w4 = load_file(out / "checkpoint-2" / "model.safetensors"), load_file(out / "checkpoint-4" / "model.safetensors")
    assert all(torch.equal(w2[k], w4[k]) for k in w2)
    o2, o4 = (torch.load(out / c / ckpt.STATE / "optimizer.pt", weights_only=True) for c in ("checkpoint-2", "checkpoint-4"))
    for k in o2["state"]:  # nor the moments, nor the step counts (bias correction, rounding noise)
        assert all(torch.equal(torch.as_tensor(o2["state"][k][n]), torch.as_tensor(o4["state"][k][n])) for n in o2["state"][k])
    final = load_file(f"{result['final_dir']}/model.safetensors")
    assert all(torch.isfinite(v).all() for v in final.values())
    assert any(not torch.equal(final[k], w4[k]) for k in final)  # training went on after the bad steps


def test_nan_in_a_row_stops_and_keeps_last_good_checkpoint(tmp_path, model_dirs, monkeypatch):
    poison(monkeypatch, set(range(3, 100)))
    with pytest.raises(NonFiniteStop) as e:
        run(tmp_path, model_dirs("qwen3"), "stop", easy_rows(48, 1), save_steps=2, max_nonfinite_steps=3, max_steps=10)
    out = tmp_path / "stop"
    msg = str(e.value)
    assert "stopped at step 5: 3 steps in a row" in msg and str(out / "checkpoint-4") in msg
    assert "--resume_from_checkpoint latest" in msg and "Dataset rows of the last bad step" in msg
    assert not (out / "final").exists()
    assert [p.name for p in ckpt.complete_checkpoints(out)] == ["checkpoint-2", "checkpoint-4"]
    weights = load_file(out / "checkpoint-4" / "model.safetensors")
    assert all(torch.isfinite(v).all() for v in weights.values())
    # the kept checkpoint resumes
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dirs("qwen3"))
    restore.load_weights(model, out / "checkpoint-4")
    assert torch.equal(model.state_dict()["model.norm.weight"], weights["model.norm.weight"])


def test_a_run_with_no_finite_step_is_not_blamed_on_the_learning_rate(tmp_path, model_dirs, monkeypatch):
    """The weights are checked finite before training; if no step of the run was finite, the cause came in with the
    run (reference, data), and lowering the learning rate would not help."""
    poison(monkeypatch, set(range(1, 100)))
    with pytest.raises(NonFiniteStop) as e:
        run(tmp_path, model_dirs("qwen3"), "none", easy_rows(16, 1), max_nonfinite_steps=2)
    msg = str(e.value)
    assert "no step of this run had a finite loss, so the learning rate is not the cause" in msg, msg
    assert "Lower --learning_rate" not in msg


OOM_TEXT = ("CUDA out of memory. Tried to allocate 3.50 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
            "1.21 GiB is free.")


def test_simulated_oom_becomes_advice(tmp_path, model_dirs, monkeypatch, capsys, restore_logging):
    def oom(*a, **k):
        raise torch.OutOfMemoryError(OOM_TEXT)

    monkeypatch.setattr(step_mod, "run_step", oom)
    with pytest.raises(FastDPOError) as e:
        run(tmp_path, model_dirs("qwen3"), "oom", easy_rows(16, 1), max_tokens_per_batch=64, torch_dtype="float32")
    msg = str(e.value)
    for needle in ("Out of GPU memory in a step of 8 pairs", "tried to allocate 3.50 GiB",
                   "max_tokens_per_batch 64", "--max_tokens_per_batch 32 (now 64)", "--gradient_checkpointing ffn",
                   "precompute the reference log-probs", "--train_type lora", "--torch_dtype bfloat16",
                   "Peak memory: not measured"):
        assert needle in msg, needle
    # through the command line: one message, no traceback, exit 1
    from fastdpo.cli import main

    data = write_jsonl(tmp_path / "d.jsonl", easy_rows(16, 1))
    rc = main(["train", "--model", str(model_dirs("qwen3")), "--dataset", str(data), "--output_dir",
               str(tmp_path / "cli"), "--gradient_checkpointing", "full", "--train_type", "lora"])
    out = capsys.readouterr().out
    assert rc == 1 and "Traceback" not in out and "Out of GPU memory" in out
    assert "--gradient_checkpointing ffn" not in out and "--train_type lora (" not in out  # already in use
    assert "--train_type qlora --quant_bits 4" in out
    assert "--max_tokens_per_batch" in out


def _oom_in_a_fresh_process(tmp_path, model):
    torch.cuda.set_per_process_memory_fraction(0.002)  # ~0.3 GiB of an H200: a big step cannot fit
    with pytest.raises(FastDPOError) as e:
        run(tmp_path, model, "oom", easy_rows(512, 1) * 8, device="cuda", per_device_train_batch_size=4096,
            attn_impl="dense", gradient_checkpointing="none")  # named: the default would fit a budget that fits
    msg = str(e.value)
    assert "Out of GPU memory" in msg and "Peak allocated" in msg and "--gradient_checkpointing ffn" in msg


@pytest.mark.gpu
def test_real_cuda_oom_becomes_advice(tmp_path, model_dirs):
    """In a process of its own: memory that earlier tests left reserved in this one counts against the cap."""
    from dist_helpers import run_isolated

    run_isolated(_oom_in_a_fresh_process, tmp_path, model_dirs("qwen3", hidden=512, layers=4), timeout=300)
