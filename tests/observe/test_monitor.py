"""Vital signs, the alert engine, the update guard and the sinks, on crafted records (no training)."""

import importlib.machinery
import importlib.util
import json
import math
import sys
import types

import pytest
import torch

from fastdpo.config import TrainConfig
from fastdpo.errors import FastDPOError
from fastdpo.observe.alerts import AlertEngine, AlertRules
from fastdpo.observe.metrics import KL_RATIO_FLOOR, StepMetrics, kl_ratio
from fastdpo.observe.sinks import open_sinks, report_targets
from fastdpo.training.monitor import Monitor, NonFiniteStop, finite_flag


def rec(step, **kw):
    base = {"step": step, "loss": 0.6, "rewards/chosen": 0.1, "rewards/margins": 0.2, "rewards/accuracies": 0.8,
            "logratio/mean": 0.001, "kl_ratio": 0.01, "grad_norm": 1.0, "skipped_steps": 0}
    return {**base, **kw}


def names(alerts):
    return [a.name for a in alerts]


# ---------------------------------------------------------------- metrics


def test_logratios_and_per_token_logps_by_hand():
    m = StepMetrics(torch.device("cpu"))
    pc, pr = torch.tensor([-4.0, -6.0]), torch.tensor([-9.0, -3.0])
    rc, rr = torch.tensor([-5.0, -6.5]), torch.tensor([-8.0, -2.0])
    lc, lr = torch.tensor([2, 3]), torch.tensor([4, 1])
    m.add(torch.tensor(1.0), 0.1, pc, pr, rc, rr, 20, lc, lr)
    out = m.finish()
    assert out["logps/chosen_per_token"] == pytest.approx(-10.0 / 5)
    assert out["logps/rejected_per_token"] == pytest.approx(-12.0 / 5)
    assert out["logratio/chosen"] == pytest.approx((1.0 + 0.5) / 5)
    assert out["logratio/rejected"] == pytest.approx((-1.0 - 1.0) / 5)
    assert out["logratio/mean"] == pytest.approx((1.5 - 2.0) / 10)
    assert out["rewards/margins"] == pytest.approx(0.1 * (1.5 + 2.0) / 2)
    assert out["kl_ratio"] == pytest.approx(0.05 / out["rewards/margins"])
    assert "kl" not in out  # a true KL needs the whole distribution: `fastdpo eval` measures it


def test_step_metrics_do_not_depend_on_how_pairs_fall_into_micro_batches():
    g = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (torch.randn(6, generator=g) * 5 for _ in range(4))
    lc, lr = torch.randint(1, 9, (6,), generator=g), torch.randint(1, 9, (6,), generator=g)
    whole = StepMetrics(torch.device("cpu"))
    whole.add(torch.tensor(3.0), 0.1, pc, pr, rc, rr, 60, lc, lr)
    split = StepMetrics(torch.device("cpu"))
    for sl in (slice(0, 1), slice(1, 4), slice(4, 6)):
        split.add(torch.tensor(1.0), 0.1, pc[sl], pr[sl], rc[sl], rr[sl], 20, lc[sl], lr[sl])
    a, b = whole.finish(), split.finish()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-9), k  # float32 sums within a micro-batch


def test_kl_ratio_is_drift_per_unit_of_margin_and_guarded_against_zero_margins():
    assert kl_ratio(0.0, 0.0) == 0.0
    assert kl_ratio(1e-4, 0.0) == pytest.approx(1e-4 / KL_RATIO_FLOOR)
    assert kl_ratio(-0.05, 0.5) == pytest.approx(0.1)  # rejected pushed down while the margin grows: healthy
    assert kl_ratio(0.2, 0.5) == pytest.approx(0.4)
    assert kl_ratio(0.001, -1.0) == pytest.approx(0.1)  # a negative margin counts as the floor: drift, no preference


def test_falling_log_probs_do_not_raise_kl_ratio():
    """Chosen and rejected both fall, rejected far more (per token -0.05 and -0.67 over 30 tokens, beta 0.1): the mean
    log-ratio (-0.36) and rewards/chosen (-0.15) are negative, the margin grows. Their ratio, 2.4, used to raise the
    alert."""
    m = StepMetrics(torch.device("cpu"))
    n = torch.tensor([30, 30])
    ref = torch.tensor([-40.0, -50.0])
    m.add(torch.tensor(1.0), 0.1, ref - 1.5, ref - 20.1, ref, ref, 120, n, n)
    out = m.finish()
    assert out["logratio/mean"] < 0 and out["rewards/chosen"] < 0 and out["rewards/margins"] > 0
    assert out["kl_ratio"] == pytest.approx(abs(out["logratio/mean"]) / out["rewards/margins"])
    assert out["kl_ratio"] < 0.3
    assert AlertEngine(AlertRules(kl_ratio_threshold=0.3)).check(rec(1, **out)) == []


def test_no_kl_without_a_reference():
    m = StepMetrics(torch.device("cpu"))
    m.add(torch.tensor(1.0), 0.1, torch.tensor([-1.0]), torch.tensor([-2.0]), None, None, 5, torch.tensor([2]),
          torch.tensor([2]))
    out = m.finish()
    assert "logratio/mean" not in out and "kl_ratio" not in out and out["logps/chosen_per_token"] == -0.5


# ---------------------------------------------------------------- the alert engine


def test_healthy_records_raise_nothing():
    eng = AlertEngine(AlertRules(patience=3))
    for s in range(1, 200):
        acc = min(1.0, 0.5 + s / 100)
        r = rec(s, grad_norm=1.0 + 0.3 * math.sin(s), **{"rewards/accuracies": acc})
        assert eng.check(r, expected_update_gap=4.0) == []


def test_swapped_labels_after_patience_then_rate_limited():
    eng = AlertEngine(AlertRules(patience=3, cooldown=10))
    bad = {"rewards/margins": -0.3, "rewards/accuracies": 0.2}
    assert eng.check(rec(1, **bad)) == []
    assert eng.check(rec(2, **bad)) == []
    first = eng.check(rec(3, **bad))
    assert names(first) == ["swapped_labels"] and "check the data" in first[0].advice
    shown = [a for s in range(4, 30) for a in eng.check(rec(s, **bad))]
    # held at every step, raised again only after the cooldown, with the count it held meanwhile
    assert [a.step for a in shown] == [13, 23] and shown[0].repeats == 9
    assert eng.summary() == {"swapped_labels": 3}


def test_accuracy_zero_says_labels_are_swapped_instead_of_swapped_labels():
    eng = AlertEngine(AlertRules(patience=3))
    zero = {"rewards/margins": -0.4, "rewards/accuracies": 0.0}
    got = [a for s in range(1, 6) for a in eng.check(rec(s, **zero))]
    assert names(got) == ["accuracy_zero"] and got[0].step == 3
    assert "every pair prefers the rejected answer" in got[0].advice and "--columns" in got[0].advice


STUCK = {"loss": math.log(2) + 1e-4, "rewards/margins": 2e-5, "rewards/accuracies": 0.5}


@pytest.mark.parametrize("extra,cause,needle", [
    ({"learning_rate": 0.0}, "learning rate is 0", "warm-up that starts at 0"),
    ({"learning_rate": 1e-6, "logratio/chosen": 0.0, "logratio/rejected": 0.0}, "log-ratio is exactly 0",
     "--target_modules"),
    ({"learning_rate": 1e-9, "logratio/chosen": 3e-6, "logratio/rejected": -2e-6, "logratio/mean": 5e-7},
     "moved 5e-07 nats per token from the reference at learning rate 1e-09", "raise --learning_rate"),
])
def test_loss_stuck_at_ln2_names_its_cause(extra, cause, needle):
    """The most asked question, 'my loss is stuck at 0.693': raised after the patience, with the cause the record
    shows and the advice for that cause."""
    eng = AlertEngine(AlertRules(patience=4))
    got = [a for s in range(1, 8) for a in eng.check(rec(s, **STUCK, **extra))]
    assert names(got) == ["stuck_at_ln2"] and got[0].step == 4
    assert "loss 0.6932 ≈ ln 2" in got[0].message and cause in got[0].message and needle in got[0].advice


def test_a_loss_near_ln2_that_moves_is_not_stuck():
    eng = AlertEngine(AlertRules(patience=3))
    for s in range(1, 20):  # the first steps of a healthy run: loss ~ ln 2 but the margin grows
        assert eng.check(rec(s, loss=math.log(2) - 1e-4 * s, **{"rewards/margins": 0.002 * s})) == []


def memory(step, held, peak, largest=4096, gpu=True):
    """A logged record's memory figures: a GPU run's (allocated between steps, peak) or a CPU run's (RSS)."""
    names_ = ("memory/allocated_gib", "memory/peak_gib") if gpu else ("memory/rss_gib", "memory/peak_rss_gib")
    return rec(step, **{names_[0]: held, names_[1]: peak, "batch/largest_tokens": largest,
                        **({} if gpu else {"memory/peak_gib": 0.0})})


@pytest.mark.parametrize("gpu", [True, False])
@pytest.mark.parametrize("cause", ["leak", "lengths", "allocator"])
def test_memory_rising_names_its_cause(cause, gpu):
    """Memory rising step over step: raised after the patience past the warm-up, with the cause the record shows:
    the memory held between steps grew (a leak), the largest micro-batch grew with the peak, or neither."""
    eng = AlertEngine(AlertRules(patience=3))
    got = []
    for s in range(1, 10):
        held = 10.0 + (0.25 * s if cause == "leak" else 0.0)
        peak = 20.0 + 0.5 * s + (0.25 * s if cause == "leak" else 0.0)
        largest = 4096 + (512 * s if cause == "lengths" else 0)
        got += eng.check(memory(s, held, peak, largest, gpu))
    assert names(got) == ["memory_rising"]
    assert got[0].step == 6  # steps 1-2 are the warm-up; 3 to 6 rise three times
    want = {"leak": ("held between steps grew from 10.750 to 11.500 GiB", "--profile_memory"),
            "lengths": ("largest micro-batch grew from 5632 to 7168 tokens", "--max_tokens_per_batch"),
            "allocator": ("stayed at or below 4096 tokens", "expandable_segments:True")}[cause]
    assert want[0] in got[0].message and want[1] in got[0].advice
    assert got[0].message.startswith("peak memory 21.500 -> 23.000 GiB" if cause != "leak" else "peak memory 22.250")


def test_steady_or_settling_memory_raises_nothing():
    """A healthy run: the peak rises over the first steps (optimizer state, longer batches) and then settles; the
    memory held between steps wobbles by the allocator's rounding. A step that does not rise restarts the count."""
    eng = AlertEngine(AlertRules(patience=3))
    peaks = [5.0, 9.0, 11.0, 12.0, 12.5, 12.5, 13.0, 13.1, 13.1, 13.1, 13.1, 13.1]
    helds = [4.0, 8.0, 8.0, 8.01, 8.0, 8.02, 8.03, 8.04, 8.05, 8.05, 8.06, 8.07]  # a few MiB: not a leak
    for s, (held, peak) in enumerate(zip(helds, peaks), 1):
        assert eng.check(memory(s, held, peak, 4096 + 100 * s)) == []
    for s in range(13, 30):  # no memory figures at all (an older log): nothing
        assert eng.check(rec(s)) == []


def test_swapped_needs_both_negative_margin_and_low_accuracy():
    eng = AlertEngine(AlertRules(patience=2))
    for s in range(1, 10):
        assert eng.check(rec(s, **{"rewards/margins": -0.1, "rewards/accuracies": 0.6})) == []


def test_kl_ratio_threshold():
    eng = AlertEngine(AlertRules(kl_ratio_threshold=0.3))
    assert eng.check(rec(1, kl_ratio=0.29)) == []
    a = eng.check(rec(2, kl_ratio=0.45))
    assert names(a) == ["kl_ratio"] and "--beta" in a[0].advice


def test_kl_ratio_help_describes_the_ratio_the_code_computes():
    import dataclasses

    help_text = next(f for f in dataclasses.fields(TrainConfig) if f.name == "kl_ratio_threshold").metadata["help"]
    assert "|logratio/mean|" in help_text and "rewards/margins" in help_text, help_text
    assert kl_ratio(-0.02, 0.04) == pytest.approx(0.5)


def test_grad_spike_against_running_median():
    eng = AlertEngine(AlertRules())
    for s in range(1, 8):
        assert eng.check(rec(s, grad_norm=1.0 + 0.1 * s)) == []
    assert eng.check(rec(8, grad_norm=9.0)) == []  # 6x the median: not a spike
    a = eng.check(rec(9, grad_norm=40.0))
    assert names(a) == ["grad_spike"] and "--learning_rate" in a[0].advice


def test_grad_collapse_must_be_sustained():
    eng = AlertEngine(AlertRules(patience=3))
    seq = [1.0, 1e-4, 1e-4, 0.5, 1e-4, 1e-5, 0.0]
    got = [names(eng.check(rec(s, grad_norm=g))) for s, g in enumerate(seq, 1)]
    assert got == [[], [], [], [], [], [], ["grad_collapse"]]


def test_accuracy_stuck_at_half():
    eng = AlertEngine(AlertRules(patience=2))
    got = [names(eng.check(rec(s, **{"rewards/accuracies": a}))) for s, a in
           enumerate([1.0, 1.0] + [0.5] * 8, 1)]
    assert got[:9] == [[]] * 9  # the window of 4 x patience logged steps must fill and average 0.5 +- 0.05
    assert got[9] == ["accuracy_stuck"]


def test_nonfinite_and_update_gap():
    eng = AlertEngine(AlertRules())
    assert names(eng.check(rec(1, loss=float("nan"), skipped_steps=1))) == ["nonfinite"]
    assert eng.check(rec(2, skipped_steps=1), expected_update_gap=4.0) == []  # no new skip since the last log
    assert names(eng.check(rec(3, update_gap=8.0), expected_update_gap=4.0)) == ["update_gap"]


# ---------------------------------------------------------------- the monitor (guard + vital signs)


def monitor(tmp_path, **kw):
    cfg = TrainConfig(model="m", dataset=["d"], output_dir=str(tmp_path), per_device_train_batch_size=2,
                      gradient_accumulation_steps=4, **kw)
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    return Monitor(cfg, tmp_path, None, opt, 0), opt, w


def guard(mon, loss, norm, step, rows, stepped=False):
    return mon.finite_update(bool(finite_flag(loss, norm)), step, rows, stepped)


def test_update_gap_counts_real_optimizer_steps(tmp_path):
    mon, opt, w = monitor(tmp_path, alert_patience=2)
    finite = torch.tensor(1.0)
    for step in (1, 2):
        w.grad = torch.ones(3)
        assert guard(mon, finite, finite, step, list(range(8)))
        opt.step()
    mon.log(rec(2))
    # a wrapper that swallows optimizer.step(): two steps, one real update
    for step in (3, 4):
        assert guard(mon, finite, finite, step, list(range(8)))
    opt.step()
    mon.log(rec(4))
    mon.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["update_gap"] == 4.0 and lines[1]["update_gap"] == 8.0
    alerts = [json.loads(x) for x in (tmp_path / "alerts.jsonl").read_text().splitlines()]
    assert [a["name"] for a in alerts] == ["update_gap"] and alerts[0]["step"] == 4


def test_guard_skips_counts_and_stops_after_n_in_a_row(tmp_path):
    mon, opt, w = monitor(tmp_path, max_nonfinite_steps=3)
    nan, one = torch.tensor(float("nan")), torch.tensor(1.0)
    assert not guard(mon, nan, one, 1, [0])
    assert not guard(mon, one, torch.tensor(float("inf")), 2, [1])
    assert guard(mon, one, one, 3, [2])  # a finite step resets the run of bad ones
    assert not guard(mon, nan, one, 4, [3])
    assert not guard(mon, nan, one, 5, [4])
    with pytest.raises(NonFiniteStop, match=r"step 6: 3 steps in a row.*after step 3.*No checkpoint.*rows of the last "
                                            r"bad step: 5, 7"):
        guard(mon, nan, one, 6, [7, 5])
    mon.log(rec(6))
    mon.close()
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["skipped_steps"] == 5


def test_finite_flag_needs_both_loss_and_norm_finite():
    one = torch.tensor(1.0, dtype=torch.float64)
    for loss, norm, want in [(1.0, 2.0, True), (float("nan"), 2.0, False), (1.0, float("inf"), False),
                             (float("-inf"), float("nan"), False)]:
        flag = finite_flag(one * loss, torch.tensor(norm))
        assert flag.dtype == torch.bool and flag.device == one.device and bool(flag) is want


def test_an_update_skipped_by_the_optimizer_is_not_counted(tmp_path):
    mon, opt, w = monitor(tmp_path, alert_patience=1)
    one, nan = torch.tensor(1.0), torch.tensor(float("nan"))
    w.grad = torch.ones(3)
    opt.step()  # called, but the device flag made it a no-op
    assert not guard(mon, nan, one, 1, list(range(8)), stepped=True)
    opt.step()
    assert guard(mon, one, one, 2, list(range(8)), stepped=True)
    mon.log(rec(2, skipped_steps=1))
    mon.close()
    line = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert line["update_gap"] == 8.0 and line["skipped_steps"] == 1  # 16 pairs in micro-steps of 2, one update
    assert not (tmp_path / "alerts.jsonl").exists() or "update_gap" not in (tmp_path / "alerts.jsonl").read_text()


# ---------------------------------------------------------------- sinks


def test_report_to_parsing_and_missing_packages(monkeypatch):
    assert report_targets("none") == [] and report_targets("TensorBoard, wandb") == ["tensorboard", "wandb"]
    with pytest.raises(FastDPOError, match="'neptune' is not one of"):
        report_targets("neptune")

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert report_targets("all") == []  # all installed ones
    TrainConfig(model="m", dataset=["d"], report_to="all").validate()
    cfg = TrainConfig(model="m", dataset=["d"], report_to="wandb")
    with pytest.raises(FastDPOError, match="pip install wandb"):
        cfg.validate()


def test_wandb_sink_logs_by_step_and_finishes(tmp_path, monkeypatch):
    calls = []

    class Run:
        id = "abc123"

        def log(self, data, step):
            calls.append(("log", step, data))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = lambda **kw: calls.append(("init", kw)) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = TrainConfig(model="m", dataset=["d"], output_dir=str(tmp_path), report_to="wandb", run_name="exp1")
    sinks = open_sinks(cfg, tmp_path, None, 0)
    sinks.log({"step": 3, "loss": 0.5, "rewards/margins": 0.1, "note": "x"})
    sinks.close()
    assert calls[0][0] == "init" and calls[0][1]["name"] == "exp1" and calls[0][1]["config"]["report_to"] == "wandb"
    assert calls[1] == ("log", 3, {"loss": 0.5, "rewards/margins": 0.1})
    assert calls[-1] == ("finish",)
    assert (tmp_path / ".wandb_run_id").read_text() == "abc123"  # a resumed run continues the same W&B run


def test_non_writing_rank_guards_but_writes_nothing(tmp_path):
    cfg = TrainConfig(model="m", dataset=["d"], output_dir=str(tmp_path), max_nonfinite_steps=1)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    mon = Monitor(cfg, tmp_path, None, opt, 0, write=False)
    mon.log(rec(1, **{"rewards/margins": -1.0, "rewards/accuracies": 0.0}))
    mon.close()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(NonFiniteStop):
        guard(mon, torch.tensor(float("nan")), torch.tensor(1.0), 2, [0])


def test_oom_next_steps_follow_the_settings():
    from fastdpo.observe.diagnostics import oom_next_steps

    cfg = TrainConfig(model="m", dataset=["d"], precompute_ref_log_probs=True, gradient_checkpointing="ffn",
                      max_tokens_per_batch=4096, torch_dtype="bfloat16")
    steps = oom_next_steps(cfg, None)
    assert steps[0].startswith("--max_tokens_per_batch 2048 (now 4096)")
    assert steps[1] == "--gradient_checkpointing full (now ffn)."
    assert not any("precompute" in s or "bfloat16" in s for s in steps)
    full = oom_next_steps(TrainConfig(model="m", dataset=["d"]), longest_micro_tokens=3000)
    assert full[0].startswith("--max_tokens_per_batch 1500") and any("--precompute_ref_log_probs" in s for s in full)
    lora = oom_next_steps(TrainConfig(model="m", dataset=["d"], train_type="lora"), None)
    assert any("--train_type qlora" in s and "--fp8_base" in s for s in lora)
    fp8 = oom_next_steps(TrainConfig(model="m", dataset=["d"], train_type="lora", fp8_base=True), None)
    assert any("--train_type qlora" in s for s in fp8) and not any("--fp8_base" in s for s in fp8)


def test_a_fragmented_allocator_puts_expandable_segments_first(monkeypatch):
    """torch's message says how much was reserved but unallocated: 1 GiB or more, and the allocator not already
    expandable, makes PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True the first step."""
    from fastdpo.observe.diagnostics import oom_error

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    cfg = TrainConfig(model="m", dataset=["d"])

    def oom(unallocated: str) -> str:
        e = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 154.00 MiB. GPU 0 has a total capacity of "
                                   f"79.18 GiB of which 90.00 MiB is free. Of the allocated memory 67.92 GiB is "
                                   f"allocated by PyTorch, and {unallocated} is reserved by PyTorch but unallocated.")
        return str(oom_error(e, cfg, None))

    steps = [line for line in oom("10.34 GiB").splitlines() if line.startswith("  - ")]
    assert steps[0].startswith("  - PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True") and "10.34 GiB" in steps[0]
    assert "expandable_segments" not in oom("300.00 MiB")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert "expandable_segments" not in oom("10.34 GiB")


def test_runs_logged_with_kl_names_read_back_as_logratios(tmp_path):
    """metrics.jsonl of earlier versions named the signed mean log-ratios `kl/chosen`, `kl/rejected` and `kl`."""
    from fastdpo.observe.plot import read_records

    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "kl/chosen": 0.2, "kl/rejected": -0.4, "kl": -0.1, "kl_ratio": 0.5}) + "\n")
    rec = read_records(path)[0]
    assert (rec["logratio/chosen"], rec["logratio/rejected"], rec["logratio/mean"]) == (0.2, -0.4, -0.1)
    assert "kl" not in rec and rec["kl_ratio"] == 0.5
