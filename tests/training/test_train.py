"""End-to-end training on tiny CPU models: accumulation, resume, learning, LoRA."""

import json

import pytest
import torch
from data_helpers import easy_rows, write_jsonl
from safetensors.torch import load_file

from fastdpo.config import TrainConfig
from fastdpo.training.loop import train


def run(tmp_path, model_dir, name, **kw):
    data = write_jsonl(tmp_path / "data.jsonl", easy_rows(48, seed=1))
    base = dict(learning_rate=1e-3, max_steps=6, logging_steps=1, seed=3)
    cfg = TrainConfig(model=str(model_dir), dataset=[str(data)], output_dir=str(tmp_path / name), **{**base, **kw})
    return train(cfg, progress=False)


def weights(result):
    return load_file(f"{result['final_dir']}/model.safetensors")


def metrics(path):
    return [json.loads(line) for line in open(path / "metrics.jsonl")]


def test_accumulation_equals_big_batch(tmp_path, model_dirs):
    m = model_dirs("qwen3")
    # Adam divides by sqrt(v): float32 summation-order noise in near-zero gradients would be amplified to the size
    # of a whole update with eps=1e-8, so use a larger eps here. One update is ~1e-3; we allow 1e-5.
    kw = dict(adam_epsilon=1e-6)
    a = weights(run(tmp_path, m, "a", per_device_train_batch_size=8, gradient_accumulation_steps=1, **kw))
    b = weights(run(tmp_path, m, "b", per_device_train_batch_size=2, gradient_accumulation_steps=4, **kw))
    c = weights(run(tmp_path, m, "c", per_device_train_batch_size=2, gradient_accumulation_steps=4,
                    max_tokens_per_batch=40, **kw))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-5, msg=k)
        torch.testing.assert_close(a[k], c[k], rtol=0, atol=1e-5, msg=k)


def test_step_metrics_do_not_depend_on_micro_batching(tmp_path, model_dirs):
    m = model_dirs("llama")
    run(tmp_path, m, "a", per_device_train_batch_size=8, gradient_accumulation_steps=1)
    run(tmp_path, m, "b", per_device_train_batch_size=1, gradient_accumulation_steps=8)
    for x, y in zip(metrics(tmp_path / "a"), metrics(tmp_path / "b")):
        for key in ("loss", "rewards/margins", "rewards/accuracies", "logps/chosen", "grad_norm"):
            assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-6), key


def test_resume_reproduces_uninterrupted_run(tmp_path, model_dirs):
    m = model_dirs("qwen3")
    kw = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, lr_scheduler_type="cosine",
              warmup_steps=2, weight_decay=0.01)
    full = weights(run(tmp_path, m, "full", **kw))
    # interrupted: train to step 3 and checkpoint, then a fresh process-like run resumes from it
    part = TrainConfig(model=str(m), dataset=[str(tmp_path / "data.jsonl")], output_dir=str(tmp_path / "part"),
                       learning_rate=1e-3, max_steps=6, seed=3, save_steps=3, **kw)
    train(part, progress=False)
    ckpt_dir = tmp_path / "part" / "checkpoint-3"
    assert (ckpt_dir / "state" / "trainer_state.json").is_file()
    resumed = TrainConfig(**{**part.to_dict(), "output_dir": str(tmp_path / "resumed"),
                             "resume_from_checkpoint": str(ckpt_dir)})
    got = weights(train(resumed, progress=False))
    for k in full:
        assert torch.equal(full[k], got[k]), k
    # the resumed run logs steps 4..6 only, identical to the uninterrupted run's
    tail = [r["loss"] for r in metrics(tmp_path / "full")][3:]
    assert [r["loss"] for r in metrics(tmp_path / "resumed")] == tail


def test_tiny_model_learns_easy_preference(tmp_path, model_dirs):
    result = run(tmp_path, model_dirs("qwen3"), "learn", per_device_train_batch_size=8, max_steps=40,
                 learning_rate=2e-3, beta=0.5)
    rows = metrics(tmp_path / "learn")
    assert rows[0]["rewards/accuracies"] <= 0.75  # untrained: not already solved
    assert rows[-1]["rewards/accuracies"] >= 0.9
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert result["reference"] == "copy"


def test_lora_trains_adapter_and_keeps_base(tmp_path, model_dirs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    m = model_dirs("llama")
    result = run(tmp_path, m, "lora", train_type="lora", lora_rank=4, lora_alpha=8, per_device_train_batch_size=8,
                 max_steps=15, learning_rate=5e-3)
    assert result["reference"] == "adapter_off"
    rows = metrics(tmp_path / "lora")
    assert rows[-1]["rewards/margins"] > rows[0]["rewards/margins"]
    base = AutoModelForCausalLM.from_pretrained(m)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    tuned = PeftModel.from_pretrained(base, result["final_dir"])
    lora_b = [p for n, p in tuned.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b)  # adapters moved away from their zero init
    merged = tuned.merge_and_unload()
    unmerged = {k: v for k, v in merged.state_dict().items()}
    assert any(not torch.equal(before[k], unmerged[k]) for k in before)  # the adapter changes the model
    fresh = AutoModelForCausalLM.from_pretrained(m).state_dict()
    for k in before:
        assert torch.equal(before[k], fresh[k])  # base weights on disk unchanged


def test_gradient_checkpointing_policies_give_same_weights(tmp_path, model_dirs):
    m = model_dirs("qwen2")
    ref = weights(run(tmp_path, m, "none", per_device_train_batch_size=8, adam_epsilon=1e-6))
    for policy in ("full", "ffn", "attn", "every:2"):
        got = weights(run(tmp_path, m, policy.replace(":", ""), per_device_train_batch_size=8,
                          gradient_checkpointing=policy, adam_epsilon=1e-6))
        for k in ref:  # recomputation is deterministic on CPU: identical
            assert torch.equal(ref[k], got[k]), f"{policy} {k}"


def test_padded_path_trains_like_packed(tmp_path, model_dirs):
    m = model_dirs("mistral")
    a = weights(run(tmp_path, m, "packed", per_device_train_batch_size=4, gradient_accumulation_steps=2,
                    adam_epsilon=1e-6))
    b = weights(run(tmp_path, m, "padded", per_device_train_batch_size=4, gradient_accumulation_steps=2,
                    padding_free=False, adam_epsilon=1e-6))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-5, msg=k)
    # what each step ran: packed rows hold exactly the pairs' tokens; padded rows repeat the prompt and pad
    packed, padded = metrics(tmp_path / "packed"), metrics(tmp_path / "padded")
    assert all(r["batch/micro_batches"] == 2 and r["batch/padding"] == 0 for r in packed)
    assert all(r["batch/micro_batches"] == 2 and r["batch/padding"] > 0.2 for r in padded)


def test_scheduled_garbage_collection_trains_the_same_and_logs_pauses(tmp_path, model_dirs):
    """--gc_steps 2: the same weights as Python's own collection (collection never touches the numbers); every
    logged step carries its pauses, and the steps that collect show one; Python's collector is back on after."""
    import gc

    m = model_dirs("qwen3")
    a = run(tmp_path, m, "python", max_steps=4)
    b = run(tmp_path, m, "scheduled", max_steps=4, gc_steps=2)
    assert gc.isenabled() and gc.get_freeze_count() == 0
    wa, wb = weights(a), weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    rows = metrics(tmp_path / "scheduled")
    assert [r["gc/collections"] for r in rows] == [0, 1, 0, 1]  # only the scheduled ones, at steps 2 and 4
    assert all(r["gc/pause_ms"] > 0 for r in rows if r["gc/collections"])
    assert all("gc/pause_ms" in r and "gc/collections" in r for r in metrics(tmp_path / "python"))


def test_drop_last_skips_each_epochs_short_step(tmp_path, model_dirs):
    """48 pairs at 20 per step: three steps an epoch, the last of 8 pairs; --dataloader_drop_last (ms-swift's
    --drop_last) skips it, so two epochs are four steps of 20, not six. Fewer pairs than one step is refused."""
    from fastdpo.cli import build_parser
    from fastdpo.config import build_config
    from fastdpo.errors import FastDPOError

    m = model_dirs("qwen3")
    kw = dict(max_steps=0, num_train_epochs=2, per_device_train_batch_size=20, logging_steps=1)
    run(tmp_path, m, "keep", **kw)
    run(tmp_path, m, "drop", dataloader_drop_last=True, **kw)
    keep, drop = metrics(tmp_path / "keep"), metrics(tmp_path / "drop")
    assert len(keep) == 6 and len(drop) == 4
    assert [r["epoch"] for r in drop] == [0.5, 1.0, 1.5, 2.0]
    assert keep[0]["loss"] == drop[0]["loss"] and keep[1]["loss"] == drop[1]["loss"]  # the same steps, minus the short
    args = build_parser().parse_args(["train", "--model", "m", "--dataset", "d.jsonl", "--drop_last", "true"])
    assert build_config(args, TrainConfig).dataloader_drop_last is True
    with pytest.raises(FastDPOError, match="fewer than one step's 64"):
        run(tmp_path, m, "tiny", dataloader_drop_last=True, max_steps=0, per_device_train_batch_size=64)


def test_a_cpu_run_reports_its_peak_rss(tmp_path, model_dirs, caplog):
    """Off CUDA the memory figure is the process's peak resident memory, labelled as RSS."""
    with caplog.at_level("INFO", logger="fastdpo"):
        run(tmp_path, model_dirs("qwen3"), "run", max_steps=2, device="cpu")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["peak_memory_gib"] is None and 0.01 < summary["peak_rss_gib"] < 1024
    assert all(r["memory/peak_rss_gib"] > 0.01 for r in metrics(tmp_path / "run"))
    assert f"peak RSS {summary['peak_rss_gib']:.2f} GiB" in caplog.text
