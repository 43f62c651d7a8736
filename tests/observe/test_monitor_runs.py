"""Each alert driven by a crafted training run of a tiny CPU model, and silence on a healthy run."""

import json
import math
import random

import pytest
from data_helpers import easy_rows, write_jsonl

import fastdpo.training.loop as train_mod
from fastdpo.config import TrainConfig


def long_rows(n: int, seed: int) -> list[dict]:
    """A learnable preference with realistic completion lengths (10 tokens): chosen from w4..w16, rejected from
    w17..w29."""
    r = random.Random(seed)
    words = lambda lo, hi, k: " ".join(f"w{r.randrange(lo, hi)}" for _ in range(k))
    return [{"prompt": words(30, 60, r.randint(2, 6)), "chosen": " " + words(4, 17, 10),
             "rejected": " " + words(17, 30, 10)} for _ in range(n)]


def noisy_rows(n: int, seed: int) -> list[dict]:
    """Random labels: nothing to learn."""
    r = random.Random(seed)
    words = lambda k: " ".join(f"w{r.randrange(4, 60)}" for _ in range(k))
    return [{"prompt": words(r.randint(2, 6)), "chosen": " " + words(r.randint(2, 6)),
             "rejected": " " + words(r.randint(2, 6))} for _ in range(n)]


def run(tmp_path, model, name, rows, **kw):
    data = write_jsonl(tmp_path / f"{name}.jsonl", rows)
    base = dict(learning_rate=1e-3, max_steps=6, per_device_train_batch_size=8, seed=3, alert_patience=3)
    cfg = TrainConfig(model=str(model), dataset=[str(data)], output_dir=str(tmp_path / name), **{**base, **kw})
    return train_mod.train(cfg, progress=False)


def alerts(out):
    path = out / "alerts.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def records(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def healthy(tmp_path_factory, model_dirs):
    """A healthy run, reported to TensorBoard and plotted at the end when those packages are installed."""
    import importlib.util

    tmp = tmp_path_factory.mktemp("healthy")
    tb = importlib.util.find_spec("tensorboard") is not None
    mpl = importlib.util.find_spec("matplotlib") is not None
    run(tmp, model_dirs("qwen3"), "run", long_rows(64, 1), max_steps=8, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, report_to="tensorboard" if tb else "none", plot=mpl)
    return tmp / "run"


def test_healthy_run_is_silent(healthy):
    assert alerts(healthy) == []
    rows = records(healthy)
    assert rows[-1]["rewards/accuracies"] == 1.0 and rows[-1]["rewards/margins"] > rows[1]["rewards/margins"] > 0
    for r in rows:
        assert r["update_gap"] == 2.0 and r["skipped_steps"] == 0  # micro-steps of 4 pairs per update
        assert r["kl_ratio"] < 0.3 and math.isfinite(r["logratio/chosen"]) and math.isfinite(r["logratio/rejected"])
    assert rows[0]["logratio/mean"] == 0.0 and rows[-1]["logratio/chosen"] > 0 > rows[-1]["logratio/rejected"]


def test_tensorboard_events_and_end_of_training_plot(healthy):
    pytest.importorskip("tensorboard")
    pytest.importorskip("matplotlib")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(healthy / "runs"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for tag in ("loss", "rewards/margins", "logratio/mean", "kl_ratio", "grad_norm", "update_gap"):
        assert tag in tags, tag
    assert [e.step for e in acc.Scalars("loss")] == list(range(1, 9))
    assert [e.value for e in acc.Scalars("loss")] == pytest.approx([r["loss"] for r in records(healthy)])
    png = healthy / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 50_000


def test_swapped_labels_alert(tmp_path, model_dirs):
    """The policy already learned the real preference (a first DPO stage); the second stage's data has chosen and
    rejected swapped, with the original model as reference: margins go negative, every pair prefers rejected, and
    the alert says the labels are swapped."""
    base = model_dirs("qwen3")
    stage1 = run(tmp_path, base, "stage1", easy_rows(48, seed=1), learning_rate=2e-3, beta=0.5)
    swapped = [{**r, "chosen": r["rejected"], "rejected": r["chosen"]} for r in easy_rows(48, seed=2)]
    run(tmp_path, stage1["final_dir"], "stage2", swapped, ref_model=str(base), learning_rate=1e-4, max_steps=4)
    got = alerts(tmp_path / "stage2")
    assert "accuracy_zero" in [a["name"] for a in got]
    first = next(a for a in got if a["name"] == "accuracy_zero")
    assert first["step"] == 3 and "chosen and rejected are swapped" in first["advice"]


def test_exploding_learning_rate_raises_kl_ratio(tmp_path, model_dirs):
    run(tmp_path, model_dirs("qwen3"), "lr", noisy_rows(96, 2), learning_rate=10.0, max_grad_norm=0,
        lr_scheduler_type="constant_with_warmup", warmup_steps=6, max_steps=7)
    got = {a["name"]: a for a in alerts(tmp_path / "lr")}
    assert "kl_ratio" in got and "--beta" in got["kl_ratio"]["advice"]  # the policy runs away from the reference


def test_a_wild_batch_raises_grad_spike_at_its_step(tmp_path, model_dirs):
    """Six steps of two-token completions, then a step whose completions repeat one token 50 times: its summed
    log-probs' gradient is tens of times the running median (90x here), far past the factor of 10."""
    r = random.Random(4)
    rows = [{"prompt": " ".join(f"w{r.randrange(4, 60)}" for _ in range(4)), "chosen": f" w{4 + i % 20} w{30 + i % 20}",
             "rejected": f" w{30 + i % 20} w{4 + i % 20}"} for i in range(48)]
    rows += [{"prompt": "w7 w8", "chosen": " w5" * 50, "rejected": " w6" * 50} for _ in range(8)]
    run(tmp_path, model_dirs("qwen3"), "wild", rows, max_grad_norm=0, shuffle=False, max_steps=7, max_length=128)
    got = {a["name"]: a for a in alerts(tmp_path / "wild")}
    assert got["grad_spike"]["step"] == 7 and "--learning_rate" in got["grad_spike"]["advice"]


def test_conflicting_labels_raise_accuracy_stuck(tmp_path, model_dirs):
    """Every pair also appears with chosen and rejected swapped, in the same step: computed pair by pair, the step's
    margins cancel up to rounding, so accuracy sits at 0.5."""
    rows = easy_rows(4, seed=5)
    rows += [{**r, "chosen": r["rejected"], "rejected": r["chosen"]} for r in rows]
    run(tmp_path, model_dirs("qwen3"), "conflict", rows, max_steps=9, alert_patience=2, group_prompts=False)
    got = [a["name"] for a in alerts(tmp_path / "conflict")]
    assert "accuracy_stuck" in got
    assert "swapped_labels" not in got and "grad_spike" not in got and "grad_collapse" not in got


def test_conflicting_labels_in_one_group_raise_grad_collapse(tmp_path, model_dirs):
    """The same data in prompt groups: each completion is computed once for both of its pairs, so their gradients
    cancel exactly and the alert names contradicting pairs among the causes."""
    rows = easy_rows(4, seed=5)
    rows += [{**r, "chosen": r["rejected"], "rejected": r["chosen"]} for r in rows]
    run(tmp_path, model_dirs("qwen3"), "conflict", rows, max_steps=6, alert_patience=2)
    got = {a["name"]: a for a in alerts(tmp_path / "conflict")}
    assert "grad_collapse" in got and "contradict" in got["grad_collapse"]["advice"]
    assert "swapped_labels" not in got and "grad_spike" not in got


def test_saturated_loss_raises_grad_collapse(tmp_path, model_dirs):
    """A large beta and learning rate on an easy preference: the loss saturates at ~0 and gradients vanish."""
    run(tmp_path, model_dirs("qwen3"), "saturated", easy_rows(48, 1), learning_rate=0.05, beta=2.0,
        lr_scheduler_type="constant")
    got = {a["name"]: a for a in alerts(tmp_path / "saturated")}
    assert "grad_collapse" in got and got["grad_collapse"]["step"] == 5
    assert "accuracy_stuck" not in got and "swapped_labels" not in got
