"""Evaluation: held-out pair metrics (by hand and after training), KL against full logits, evaluation during training
with the best checkpoint kept, reward functions (loading, errors, win rate), lm-eval, and flag validation."""

import json
import math
import sys

import pytest
import torch
from cli_helpers import run_cli
from data_helpers import easy_rows, write_jsonl
from model_helpers import WORDS
from transformers import AutoModelForCausalLM

from fastdpo import checkpoint as ckpt
from fastdpo.commands.evaluate import EvalConfig, run_eval
from fastdpo.config import TrainConfig
from fastdpo.data.load import Row, load_rows
from fastdpo.data.split import split_rows
from fastdpo.data.tokenize import tokenize_rows
from fastdpo.dpo.reference import Reference
from fastdpo.dpo.rewards import load_reward_fn, score, win_rate
from fastdpo.errors import FastDPOError
from fastdpo.losses import LossInputs, LossParams
from fastdpo.model.backend import Backend, prepare_packed
from fastdpo.model.load import load_tokenizer
from fastdpo.model.tiny import build_tiny_model
from fastdpo.training.evaluate import BestTracker, TrainingEval, per_token_logps, preference_metrics, token_kl
from fastdpo.training.loop import train

# ---------------------------------------------------------------- pure pieces


def test_preference_metrics_by_hand():
    x = LossInputs(policy_chosen=torch.tensor([-2.0, -5.0]), policy_rejected=torch.tensor([-4.0, -3.0]),
                   ref_chosen=torch.tensor([-3.0, -4.0]), ref_rejected=torch.tensor([-3.0, -4.0]),
                   chosen_tokens=torch.tensor([2, 3]), rejected_tokens=torch.tensor([4, 1]))
    m = preference_metrics(x, LossParams(beta=0.5), [("sigmoid", 1.0)], rpo_alpha=0.1)
    # rewards: chosen 0.5*(1, -1) = (0.5, -0.5); rejected 0.5*(-1, 1) = (-0.5, 0.5); margins (1, -1)
    assert m["rewards/chosen"] == pytest.approx(0.0)
    assert m["rewards/rejected"] == pytest.approx(0.0)
    assert m["rewards/margins"] == pytest.approx(0.0)
    assert m["rewards/accuracies"] == pytest.approx(0.5)
    assert m["logps/chosen"] == pytest.approx(-3.5)
    assert m["logps/rejected"] == pytest.approx(-3.5)
    dpo = (-math.log(1 / (1 + math.exp(-1.0))) - math.log(1 / (1 + math.exp(1.0)))) / 2
    assert m["loss"] == pytest.approx(dpo + 0.1 * 7.0 / 5.0, rel=1e-6)  # + rpo: NLL(chosen) per chosen token
    free = preference_metrics(LossInputs(x.policy_chosen, x.policy_rejected, None, None, x.chosen_tokens,
                                         x.rejected_tokens), LossParams(beta=0.5), [("sigmoid", 1.0)])
    assert "loss" not in free  # DPO needs a reference
    assert free["rewards/chosen"] == pytest.approx(-1.75) and free["rewards/accuracies"] == pytest.approx(0.5)
    weighted = preference_metrics(x, LossParams(beta=0.5), [("sigmoid", 2.0), ("sft", 0.5)])
    assert weighted["loss"] == pytest.approx(2 * dpo + 0.5 * 7.0 / 5.0, rel=1e-6)  # the training loss's weighted terms


def test_eval_metrics_have_the_names_and_values_training_logs():
    """The same pairs through training's step metrics and eval's: every name both report has the same value."""
    from fastdpo.observe.metrics import StepMetrics

    g = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (-torch.rand(5, generator=g) * 20 for _ in range(4))
    lc, lr = torch.randint(1, 9, (5,), generator=g), torch.randint(1, 9, (5,), generator=g)
    step = StepMetrics(torch.device("cpu"))
    step.add(torch.tensor(1.0), 0.1, pc, pr, rc, rr, 50, lc, lr)
    trained = step.finish()
    x = LossInputs(pc, pr, rc, rr, lc, lr)
    evaluated = {**preference_metrics(x, LossParams(beta=0.1), [("sigmoid", 1.0)]), **per_token_logps(x)}
    shared = (set(trained) & set(evaluated)) - {"loss"}
    assert {"rewards/chosen", "rewards/margins", "logps/chosen", "logps/chosen_per_token", "logratio/chosen",
            "logratio/rejected", "logratio/mean"} <= shared
    for k in shared:
        assert evaluated[k] == pytest.approx(trained[k], rel=1e-5), k
    assert "kl" not in trained and "kl" not in evaluated  # `kl` is only the exact KL `fastdpo eval` measures


def test_win_rate_counts_ties_half():
    assert win_rate([0, 1, 1, 0.5], [1, 1, 0, 0.7]) == {"win_rate": 0.625, "wins": 2, "ties": 1, "losses": 1}


def test_best_tracker():
    loss = BestTracker.from_config("loss", None)
    assert loss.metric == "eval_loss" and loss.greater_is_better is False
    assert loss.update(2, {"eval_loss": 0.5})
    assert not loss.update(4, {"eval_loss": 0.7})
    assert not loss.update(6, {"eval_loss": float("nan")})
    assert loss.update(8, {"eval_loss": 0.4}) and loss.best_step == 8
    loss.saved(6, "out/checkpoint-6")
    assert loss.best_model_checkpoint is None  # step 6 is not the best
    loss.saved(8, "out/checkpoint-8")
    assert loss.best_model_checkpoint == "out/checkpoint-8"
    acc = BestTracker.from_config("eval_rewards/accuracies", None)
    assert acc.greater_is_better is True
    acc.update(2, {"eval_rewards/accuracies": 0.5})
    assert not acc.update(4, {"eval_rewards/accuracies": 0.5})  # ties keep the earlier one
    forced = BestTracker.from_config("loss", True)
    forced.update(1, {"eval_loss": 1.0})
    assert forced.update(2, {"eval_loss": 2.0})
    restored = BestTracker.from_config("loss", None)
    restored.load(loss.state())
    assert restored.state() == loss.state()
    other = BestTracker.from_config("rewards/margins", None)
    other.load(loss.state())  # ranked by another metric: start fresh
    assert other.best_metric is None


def _fake_checkpoints(out, steps):
    for s in steps:
        (out / f"checkpoint-{s}" / ckpt.STATE).mkdir(parents=True)
        (out / f"checkpoint-{s}" / ckpt.STATE / ckpt.DONE).write_text(json.dumps({"step": s}))


def _names(out):
    return sorted(p.name for p in ckpt.complete_checkpoints(out))


def test_rotation_never_deletes_the_best(tmp_path):
    _fake_checkpoints(tmp_path, [1, 2, 3, 4, 5])
    ckpt.rotate(tmp_path, 2, str(tmp_path / "checkpoint-2"))
    assert _names(tmp_path) == ["checkpoint-2", "checkpoint-5"]  # the best counts as one of the kept two
    ckpt.rotate(tmp_path, 1, tmp_path / "checkpoint-2")
    assert _names(tmp_path) == ["checkpoint-2", "checkpoint-5"]  # keep=1 still keeps best and newest
    ckpt.rotate(tmp_path, 1, tmp_path / "checkpoint-5")
    assert _names(tmp_path) == ["checkpoint-5"]
    _fake_checkpoints(tmp_path, [6, 7])
    ckpt.rotate(tmp_path, 2, None)
    assert _names(tmp_path) == ["checkpoint-6", "checkpoint-7"]
    ckpt.rotate(tmp_path, 1, tmp_path / "final")  # a best outside the checkpoints protects nothing
    assert _names(tmp_path) == ["checkpoint-7"]


def test_split_rows_is_seeded_and_disjoint():
    rows = [Row(f"p{i}", "c", "r", f"f:{i}") for i in range(20)]
    train_a, val_a = split_rows(rows, 0.12, seed=1)
    assert len(val_a) == 3 and len(train_a) == 17  # ceil, as datasets' train_test_split
    assert split_rows(rows, 0.12, seed=1) == (train_a, val_a)
    assert {r.prompt for r in train_a}.isdisjoint({r.prompt for r in val_a})
    assert split_rows(rows, 0.12, seed=2)[1] != val_a
    with pytest.raises(FastDPOError, match="no training rows"):
        split_rows(rows[:1], 0.5, seed=1)


# ---------------------------------------------------------------- KL against full logits


def test_token_kl_matches_full_logits(tmp_path, model_dirs):
    policy_dir, ref_dir = model_dirs("llama"), build_tiny_model(tmp_path / "ref", "llama", WORDS, seed=1)
    tok = load_tokenizer(str(policy_dir))
    pairs, _ = tokenize_rows(tok, [Row(**r, source=f"x:{i}") for i, r in enumerate(easy_rows(5, seed=4))], 64)
    policy = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    ref = AutoModelForCausalLM.from_pretrained(ref_dir).eval()
    want, n = 0.0, 0
    with torch.no_grad():
        for p in pairs:
            for comp in (p.chosen, p.rejected):
                ids = torch.tensor([p.prompt + comp])
                lp = torch.log_softmax(policy(ids).logits[0].double(), -1)
                lq = torch.log_softmax(ref(ids).logits[0].double(), -1)
                for t in range(len(p.prompt), ids.shape[1]):
                    want += float((lp[t - 1].exp() * (lp[t - 1] - lq[t - 1])).sum())
                    n += 1
    backend = Backend("dense")
    prepare_packed(policy, backend)
    prepare_packed(ref, backend)
    got = token_kl(policy, Reference("separate", ref), pairs, backend, 1, torch.device("cpu"), batch_size=2, chunk=7)
    assert want / n > 0.01
    assert got == pytest.approx(want / n, rel=1e-4)
    assert token_kl(policy, Reference("separate", policy), pairs, backend, 1, torch.device("cpu")) == pytest.approx(
        0.0, abs=1e-6)


# ---------------------------------------------------------------- evaluation during training


def test_training_evaluates_and_keeps_the_best_checkpoint(tmp_path, model_dirs):
    data = write_jsonl(tmp_path / "data.jsonl", easy_rows(48, seed=1))
    out = tmp_path / "run"
    # logps/rejected falls as DPO pushes rejected down: the best (highest) is an early checkpoint, which rotation
    # with save_total_limit=1 would otherwise delete
    cfg = TrainConfig(model=str(model_dirs("llama")), dataset=[str(data)], output_dir=str(out), split_dataset_ratio=0.25,
                      eval_steps=2, save_steps=2, save_total_limit=1, max_steps=8, learning_rate=1e-3, beta=0.5,
                      per_device_train_batch_size=8, metric_for_best_model="logps/rejected", greater_is_better=True)
    result = train(cfg, progress=False)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4, 6, 8]
    assert all(not any(k.startswith("rewards/") for k in r) for r in evals)  # eval records carry eval_ names only
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert evals[-1]["eval_rewards/margins"] > evals[0]["eval_rewards/margins"]
    assert evals[-1]["eval_rewards/accuracies"] >= 0.9
    best = max(evals, key=lambda r: r["eval_logps/rejected"])
    assert best["step"] in (2, 4)  # an older checkpoint than the newest (8): protection is exercised
    assert result["best_step"] == best["step"] and result["best_metric"] == best["eval_logps/rejected"]
    assert result["best_model_checkpoint"] == str(out / f"checkpoint-{best['step']}")
    assert result["eval_pairs"] == 12 and result["pairs"] == 36
    assert _names(out) == sorted([f"checkpoint-{best['step']}", "checkpoint-8"])  # the last step's, kept to extend
    state = ckpt.load_progress(out / "checkpoint-8")
    assert state["best_model_checkpoint"] == result["best_model_checkpoint"]
    resumed = TrainingEval(cfg, [object()], state)  # a resumed run ranks against the same best
    assert resumed.best.best_step == best["step"] and resumed.best.best_metric == best["eval_logps/rejected"]


def test_precomputed_reference_evaluates_held_out_pairs_like_online(tmp_path, model_dirs):
    """The held-out pairs get their own precomputed table (the training table does not hold them)."""
    data = write_jsonl(tmp_path / "data.jsonl", easy_rows(32, seed=1))
    val = write_jsonl(tmp_path / "val.jsonl", easy_rows(8, seed=9))
    kw = dict(model=str(model_dirs("llama")), dataset=[str(data)], val_dataset=[str(val)], eval_steps=2, max_steps=2,
              learning_rate=1e-3, beta=0.5, per_device_train_batch_size=8, ref_cache_dir=str(tmp_path / "cache"))
    evals = []
    for name, precompute in (("online", False), ("precompute", True)):
        result = train(TrainConfig(**kw, output_dir=str(tmp_path / name), precompute_ref_log_probs=precompute),
                       progress=False)
        assert result["reference"] == ("precompute" if precompute else "copy")
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        evals.append([r for r in map(json.loads, lines) if "eval_loss" in r][-1])
    for key in ("eval_loss", "eval_rewards/margins", "eval_rewards/chosen", "eval_logps/rejected"):
        assert evals[1][key] == pytest.approx(evals[0][key], rel=1e-5, abs=1e-6), key
    assert len(list((tmp_path / "cache").glob("*.safetensors"))) == 2  # training pairs and held-out pairs


def test_eval_flags_are_validated(tmp_path):
    base = dict(model="m", dataset=["d.jsonl"])
    cases = [
        (dict(eval_steps=5), "--eval_steps needs held-out pairs"),
        (dict(val_dataset=["v.jsonl"], split_dataset_ratio=0.1), "not both"),
        (dict(split_dataset_ratio=1.0), "--split_dataset_ratio"),
        (dict(split_dataset_ratio=0.1, eval_steps=4, save_steps=6), "multiple of --eval_steps"),
        (dict(metric_for_best_model="accuracy"), "rewards/accuracies"),
        (dict(eval_steps=-1), "--eval_steps"),
    ]
    for kw, needle in cases:
        with pytest.raises(FastDPOError, match=needle):
            TrainConfig(**base, **kw).validate()
    TrainConfig(**base, val_dataset=["v.jsonl"], eval_steps=4, save_steps=8,
                metric_for_best_model="eval_rewards/margins").validate()


def test_eval_flags_from_cli_and_yaml(tmp_path):
    import yaml

    from fastdpo.cli import build_parser
    from fastdpo.config import build_config

    y = tmp_path / "run.yaml"
    y.write_text(yaml.safe_dump({"val_dataset": "v.jsonl", "greater_is_better": True, "eval_steps": 5}))
    args = build_parser().parse_args(["train", "--config", str(y), "--metric_for_best_model", "rewards/margins",
                                      "--greater_is_better", "false"])
    cfg = build_config(args, TrainConfig)
    assert cfg.val_dataset == ["v.jsonl"] and cfg.eval_steps == 5
    assert cfg.metric_for_best_model == "rewards/margins" and cfg.greater_is_better is False
    assert build_config(build_parser().parse_args(["train"]), TrainConfig).greater_is_better is None
    # the saved config.yaml (greater_is_better: null) loads back as it was
    from fastdpo.config import save_config

    save_config(cfg, tmp_path / "saved.yaml")
    saved = build_config(build_parser().parse_args(["train", "--config", str(tmp_path / "saved.yaml")]), TrainConfig)
    assert saved == cfg
    cfg.greater_is_better = None
    save_config(cfg, tmp_path / "saved.yaml")
    assert build_config(build_parser().parse_args(["train", "--config", str(tmp_path / "saved.yaml")]),
                        TrainConfig).greater_is_better is None


# ---------------------------------------------------------------- `fastdpo eval`


REWARDS = '''
def on_answer(prompts, completions, answer, **kwargs):
    """Minus the number of words that are not in the reference answer."""
    return [-float(sum(w not in a.split() for w in c.split())) for c, a in zip(completions, answer)]

def raises(prompts, completions, **kwargs):
    return [1.0 / 0 for _ in completions]

def too_few(prompts, completions, **kwargs):
    return [1.0]

def not_numbers(prompts, completions, **kwargs):
    return ["good" for _ in completions]

def a_number(prompts, completions, **kwargs):
    return 1.0

NOT_A_FUNCTION = 3
'''


@pytest.fixture
def heldout(tmp_path):
    rows = [{**r, "answer": "w5 w6"} for r in easy_rows(16, seed=11)]  # prompts never seen in training
    return write_jsonl(tmp_path / "heldout.jsonl", rows)


def test_eval_accuracy_rises_after_training(tmp_path, heldout, lora_run):
    base, adapter, _ = lora_run
    before = run_eval(EvalConfig(model=str(base), ref_model=str(base), dataset=[str(heldout)], beta=0.5,
                                 output_dir=str(tmp_path / "before")))
    after = run_eval(EvalConfig(model=str(base), adapters=str(adapter), dataset=[str(heldout)], beta=0.5,
                                output_dir=str(tmp_path / "after")))
    b, a = before["metrics"], after["metrics"]
    assert before["reference"] == "separate" and after["reference"] == "adapter_off"
    assert b["rewards/accuracies"] == 0.0 and b["rewards/margins"] == 0.0  # policy == reference: all ties
    assert b["loss"] == pytest.approx(math.log(2), rel=1e-5) and b["kl"] == pytest.approx(0.0, abs=1e-6)
    assert a["rewards/accuracies"] >= 0.9 and a["rewards/margins"] > 0.5 and a["loss"] < 0.5
    assert a["kl"] > 1e-3
    assert a["logps/rejected_per_token"] < a["ref_logps/rejected_per_token"]
    assert a["ref_logps/chosen_per_token"] == pytest.approx(b["logps/chosen_per_token"], rel=1e-5)
    saved = json.loads((tmp_path / "after" / "eval_report.json").read_text())
    assert saved["metrics"] == a and saved["pairs"] == 16


def test_reward_function_and_win_rate(tmp_path, heldout, capsys, lora_run):
    base, adapter, _ = lora_run
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    rc, text = run_cli(capsys, "eval", "--model", base, "--adapters", adapter, "--dataset", heldout, "--reward_fn",
                       f"{tmp_path}/my_rewards.py:on_answer", "--max_new_tokens", 6, "--eval_limit", 10,
                       "--output_dir", tmp_path / "ev", "--kl", "false")
    assert rc == 0, text
    assert "win_rate" in text and "rewards/accuracies" in text
    report = json.loads((tmp_path / "ev" / "eval_report.json").read_text())
    gen = report["generation"]
    rows = [json.loads(line) for line in (tmp_path / "ev" / "generations.jsonl").read_text().splitlines()]
    assert len(rows) == gen["prompts"] == 10
    for r in rows:  # every score is the function applied to the recorded answer
        assert r["reward"] == -sum(w not in ["w5", "w6"] for w in r["response"].split())
        assert r["base_reward"] == -sum(w not in ["w5", "w6"] for w in r["base_response"].split())
    wins = sum(r["reward"] > r["base_reward"] for r in rows)
    ties = sum(r["reward"] == r["base_reward"] for r in rows)
    assert gen["wins"] == wins and gen["ties"] == ties and gen["win_rate"] == pytest.approx((wins + ties / 2) / 10)
    assert gen["reward/tuned"] == pytest.approx(sum(r["reward"] for r in rows) / 10)
    # the tuned model stops instead of repeating the prompt's last word: it wins under this reward
    assert gen["win_rate"] > 0.5 and gen["reward/tuned"] > gen["reward/base"]


def test_reward_function_errors_are_clear(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    (tmp_path / "broken.py").write_text("def f(prompts, completions):\n    return [0.0 for c in completions\n")
    (tmp_path / "fails_at_import.py").write_text("import json\nCONFIG = json.loads('{bad')\n")
    monkeypatch.chdir(tmp_path)
    fn = load_reward_fn("my_rewards:on_answer")  # importable from the current directory
    assert score(fn, "s", ["p"], ["w5 w9"], {"answer": ["w5 w6"]}) == [-1.0]
    assert load_reward_fn(f"{tmp_path}/my_rewards.py:on_answer")(prompts=[], completions=[], answer=[]) == []
    cases = [
        ("my_rewards", "expected module:function"),
        ("no_such_module:f", "no module named 'no_such_module'"),
        ("nowhere/rewards.py:f", "not found"),
        ("my_rewards:missing", "has no 'missing'. Functions there: a_number, not_numbers, on_answer, raises, too_few"),
        ("my_rewards:NOT_A_FUNCTION", "is a int, not a function"),
        ("broken.py:f", "SyntaxError"),
        ("fails_at_import:f", "JSONDecodeError"),
    ]
    for spec, needle in cases:
        with pytest.raises(FastDPOError) as e:
            load_reward_fn(spec)
        assert needle in str(e.value), str(e.value)
    assert "broken.py:2" in _error(lambda: load_reward_fn("broken.py:f")) or "broken.py:3" in _error(
        lambda: load_reward_fn("broken.py:f"))
    assert "fails_at_import.py:2" in _error(lambda: load_reward_fn("fails_at_import:f"))
    calls = [
        ("raises", "raised ZeroDivisionError", "my_rewards.py:7"),
        ("too_few", "returned 1 values for 2 completions", ""),
        ("not_numbers", "returned 'good' for completion 0", ""),
        ("a_number", "returned a float", ""),
    ]
    for name, needle, where in calls:
        msg = _error(lambda name=name: score(load_reward_fn(f"my_rewards:{name}"), name, ["p", "q"], ["a", "b"], {}))
        assert needle in msg and where in msg, msg
    sys.modules.pop("my_rewards", None)


def _error(fn) -> str:
    with pytest.raises(FastDPOError) as e:
        fn()
    return str(e.value)


def test_eval_cli_reports_a_bad_reward_fn_before_loading(tmp_path, heldout, capsys, model_dirs):
    rc, text = run_cli(capsys, "eval", "--model", model_dirs("llama"), "--dataset", heldout, "--reward_fn",
                       "no_such_module:f", "--output_dir", tmp_path / "ev")
    assert rc == 1 and "no module named 'no_such_module'" in text and "Traceback" not in text
    rc, text = run_cli(capsys, "eval", "--model", model_dirs("llama"), "--output_dir", tmp_path / "ev")
    assert rc == 1 and "--dataset is required" in text


# ---------------------------------------------------------------- lm-evaluation-harness


def test_lm_eval_missing_is_a_clear_error(tmp_path, heldout, model_dirs, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if not installed
    with pytest.raises(FastDPOError, match="pip install lm-eval"):
        run_eval(EvalConfig(model=str(model_dirs("llama")), dataset=[str(heldout)], lm_eval_tasks="hellaswag",
                            output_dir=str(tmp_path / "ev")))


LOCAL_TASK = """task: fastdpo_local_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{prompt}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""


@pytest.mark.slow  # lm-eval indexes its ~15k tasks on first use
def test_lm_eval_runs_a_local_task(tmp_path, heldout, lora_run, monkeypatch):
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    base, adapter, _ = lora_run
    docs = [{"prompt": r["prompt"], "choices": [" w5 w6", " w7 w8 w9"], "label": 0} for r in easy_rows(12, seed=5)]
    data = write_jsonl(tmp_path / "task.jsonl", docs)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "local.yaml").write_text(LOCAL_TASK.format(data=data))
    report = run_eval(EvalConfig(model=str(base), adapters=str(adapter), dataset=[str(heldout)],
                                 lm_eval_tasks="fastdpo_local_choice", lm_eval_include_path=str(tasks),
                                 output_dir=str(tmp_path / "ev"), kl=False))
    res = report["lm_eval"]["fastdpo_local_choice"]
    assert res["acc,none"] == pytest.approx(1.0)  # the tuned model prefers the chosen continuation
    with pytest.raises(FastDPOError, match="unknown task"):
        run_eval(EvalConfig(model=str(base), dataset=[str(heldout)], lm_eval_tasks="no_such_task_xyz",
                            output_dir=str(tmp_path / "ev2"), kl=False))


@pytest.mark.gpu
def test_eval_during_training_on_flex_matches_the_padded_eval(tmp_path, model_dirs):
    """On CUDA the training hook evaluates flex-packed batches; `fastdpo eval` on the padded path agrees (fp32)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    base = model_dirs("qwen3", hidden=128)
    data = write_jsonl(tmp_path / "data.jsonl", easy_rows(48, seed=1))
    val = write_jsonl(tmp_path / "val.jsonl", easy_rows(12, seed=9))
    out = tmp_path / "run"
    result = train(TrainConfig(model=str(base), dataset=[str(data)], val_dataset=[str(val)], output_dir=str(out),
                               eval_steps=2, max_steps=4, learning_rate=1e-3, beta=0.5, per_device_train_batch_size=8,
                               device="cuda", attn_impl="flex", torch_dtype="float32"), progress=False)
    assert result["backend"] == "flex"
    evals = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    report = run_eval(EvalConfig(model=str(base), checkpoint=result["final_dir"], dataset=[str(val)], beta=0.5,
                                 attn_impl="padded", device="cuda", torch_dtype="float32", kl=False,
                                 output_dir=str(tmp_path / "ev")))
    for key in ("loss", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert report["metrics"][key] == pytest.approx(evals[-1][f"eval_{key}"], rel=1e-4, abs=1e-5), key


def test_eval_tokenises_like_training(tmp_path, model_dirs, monkeypatch):
    """--template and the length limits mean the same in eval as in training: the scored pairs are training's."""
    from fastdpo.data.prepare import DataOptions, tokenize_pairs
    from fastdpo.training import evaluate  # run_eval scores through training's pair_logps

    words = WORDS[4:40]
    rows = [{"prompt": [{"role": "user", "content": " ".join(words[i:i + 6])}],
             "chosen": [{"role": "assistant", "content": " ".join(words[i + 1:i + 5])}],
             "rejected": [{"role": "assistant", "content": " ".join(words[i + 2:i + 9])}]} for i in range(6)]
    data = write_jsonl(tmp_path / "conv.jsonl", rows)
    model = model_dirs("qwen3")
    seen = {}

    def capture(model, reference, pairs, *args, **kw):
        seen["pairs"] = pairs
        raise SystemExit  # the tokenisation is what is checked

    monkeypatch.setattr(evaluate, "pair_logps", capture)
    cfg = EvalConfig(model=str(model), dataset=[str(data)], template="chatml", max_length=20,
                     truncation_strategy="left", output_dir=str(tmp_path / "e"), kl=False)
    with pytest.raises(SystemExit):
        run_eval(cfg)
    train_cfg = TrainConfig(model=str(model), dataset=[str(data)], template="chatml", max_length=20,
                            truncation_strategy="left")
    expected, _ = tokenize_pairs(load_rows([str(data)], 42), load_tokenizer(str(model)),
                                 DataOptions.from_config(train_cfg))
    assert seen["pairs"] == expected
    assert all(p.num_tokens <= 20 + 20 for p in expected) and any(len(p.prompt) > 6 for p in expected)
    with pytest.raises(FastDPOError, match="truncation_strategy"):
        EvalConfig(model="m", dataset=["d"], truncation_strategy="middle").validate()


def test_eval_reads_the_split_it_is_given(tmp_path, model_dirs, monkeypatch):
    """A save_to_disk dataset with train and test splits (TRL's --dataset_test_split): --split test scores the
    held-out split, not the training rows."""
    from datasets import Dataset, DatasetDict

    from fastdpo.cli import build_parser
    from fastdpo.config import build_config
    from fastdpo.training import evaluate

    rows = easy_rows(5, seed=3)
    DatasetDict({"train": Dataset.from_list(rows[:2]), "test": Dataset.from_list(rows[2:])}).save_to_disk(
        str(tmp_path / "ds"))
    seen = {}

    def capture(model, reference, pairs, *args, **kw):
        seen["pairs"] = pairs
        raise SystemExit

    monkeypatch.setattr(evaluate, "pair_logps", capture)
    args = build_parser().parse_args(["eval", "--model", str(model_dirs("qwen3")), "--dataset", str(tmp_path / "ds"),
                                      "--split", "test", "--output_dir", str(tmp_path / "e"), "--kl", "false"])
    with pytest.raises(SystemExit):
        run_eval(build_config(args, EvalConfig))
    assert len(seen["pairs"]) == 3


@pytest.mark.parametrize("flags,needle", [
    (["--eval_backend", "OpenCompass"], "--eval_backend OpenCompass: fastdpo eval scores held-out preference pairs"),
    (["--eval_dataset", "mt_bench,zh_cls"], "--eval_dataset mt_bench,zh_cls: name benchmark tasks with --lm_eval_tasks"),
    (["--infer_backend", "vllm"], "--infer_backend vllm"),
    (["--vllm_max_model_len", "16384"], "--vllm_max_model_len 16384: fastdpo eval does not run vLLM"),
    (["--num_gpus", "4"], "--num_gpus 4: fastdpo eval runs on one device"),
    (["--eval_dataset", "mt_bench,zh_cls", "--eval_backend", "OpenCompass", "--infer_backend", "vllm",
      "--vllm_max_model_len", "16384", "--num_gpus", "4"], "--eval_backend OpenCompass"),  # ms-swift's OpenCompass eval command
])
def test_ms_swift_eval_flags_get_clear_answers(flags, needle, capsys):
    rc, out = run_cli(capsys, "eval", "--model", "m", "--dataset", "d.jsonl", *flags)
    assert rc == 1 and needle in out and "Traceback" not in out


def test_eval_on_flex_without_a_budget_gets_one(tmp_path, heldout, model_dirs, monkeypatch):
    """FlexAttention builds kernels per micro-batch length: `fastdpo eval` without --max_tokens_per_batch scores in
    micro-batches under a budget of about --per_device_eval_batch_size pairs, so they take a few static lengths."""
    import fastdpo.model.backend as model_mod
    import fastdpo.training.evaluate as ev

    seen = {}

    class Scored(Exception):
        pass

    def capture(model, reference, pairs, backend, pad_id, device, budget, batch_size, *a, **kw):
        seen.update(budget=budget, pairs=pairs, batch_size=batch_size)
        raise Scored

    monkeypatch.setattr(model_mod, "choose_backend", lambda *a, **kw: model_mod.Backend("flex"))
    monkeypatch.setattr(model_mod, "prepare_packed", lambda *a, **kw: None)
    monkeypatch.setattr(ev, "pair_logps", capture)
    with pytest.raises(Scored):
        run_eval(EvalConfig(model=str(model_dirs("qwen3")), dataset=[str(heldout)], per_device_eval_batch_size=4,
                            output_dir=str(tmp_path / "o")))
    assert seen["budget"] == model_mod.flex_budget(seen["pairs"], 4) > 0
    with pytest.raises(Scored):
        run_eval(EvalConfig(model=str(model_dirs("qwen3")), dataset=[str(heldout)], max_tokens_per_batch=2048,
                            output_dir=str(tmp_path / "o2")))
    assert seen["budget"] == 2048


def test_reward_columns_come_from_each_rows_own_record(tmp_path):
    """The extra fields handed to a reward function are each row's own: in a one-line JSON array (every row on line
    1), in JSONL, and for rows read through --dataset_info (whose location names the dataset)."""
    import dataclasses

    from fastdpo.commands.evaluate import row_columns

    records = [{**r, "answer": f"w{k}"} for k, r in enumerate(easy_rows(4, seed=2))]
    one_line = tmp_path / "one.json"
    one_line.write_text(json.dumps(records), encoding="utf-8")
    lines = write_jsonl(tmp_path / "rows.jsonl", records)
    for f in (one_line, lines):
        rows = load_rows([str(f)])
        assert row_columns(rows)["answer"] == ["w0", "w1", "w2", "w3"], f
    named = [dataclasses.replace(r, source=f"{r.source} (dataset mine)") for r in load_rows([str(one_line)])]
    assert row_columns(named[::-1])["answer"] == ["w3", "w2", "w1", "w0"]


def test_kto_metrics_of_a_model_alone_are_refused(tmp_path, model_dirs):
    """KTO's metrics are log-ratios against a reference: a model evaluated alone (no adapters, checkpoint or
    --ref_model) is refused with what to give, not a crash."""
    data = write_jsonl(tmp_path / "d.jsonl", easy_rows(4))
    with pytest.raises(FastDPOError, match="--loss_type kto: .*--adapters or --checkpoint"):
        run_eval(EvalConfig(model=str(model_dirs("qwen3")), dataset=[str(data)], output_dir=str(tmp_path / "e"),
                            device="cpu", loss_type="kto"))
