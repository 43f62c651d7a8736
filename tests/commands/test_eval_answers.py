"""After training: eval warns loudly (with counts) about empty or cut-off generations and reads prompts as the run
read them; lm-eval tasks run without preference data; vLLM is refused before any model loads; bench shows n/a for
memory it cannot measure; infer shows a multi-turn prompt as turns, not JSON."""

import io
import json
import logging
import shutil

import pytest
import yaml
from cli_helpers import run_cli
from data_helpers import easy_rows, write_jsonl
from rich.console import Console

import fastdpo.commands.evaluate as evaluate
import fastdpo.model.generate as generate
from fastdpo.commands.evaluate import EvalConfig, run_eval

REWARD = "def length(prompts, completions, **kwargs):\n    return [float(len(c)) for c in completions]\n"


@pytest.fixture
def heldout(tmp_path):
    return write_jsonl(tmp_path / "heldout.jsonl", easy_rows(8, seed=11))


def test_empty_generations_are_counted_and_warned_about(tmp_path, heldout, capsys, lora_run, monkeypatch,
                                                        restore_logging):
    base, adapter, _ = lora_run
    (tmp_path / "rewards.py").write_text(REWARD)
    real = generate.generate_ids
    monkeypatch.setattr(generate, "generate_ids", lambda model, tok, prompts, gen=None, streamer=None:
                        [[tok.eos_token_id] for _ in prompts])  # a model that answers nothing
    rc, text = run_cli(capsys, "eval", "--model", base, "--adapters", adapter, "--dataset", heldout, "--reward_fn",
                       f"{tmp_path}/rewards.py:length", "--output_dir", tmp_path / "ev", "--kl", "false")
    assert rc == 0, text
    assert "GENERATIONS: 8 of 8 tuned answers are empty; 8 of 8 base answers are empty." in " ".join(text.split())
    gen = json.loads((tmp_path / "ev" / "eval_report.json").read_text())["generation"]
    assert (gen["empty/tuned"], gen["empty/base"], gen["truncated/tuned"]) == (8, 8, 0)

    monkeypatch.setattr(generate, "generate_ids", real)
    rc, text = run_cli(capsys, "eval", "--model", base, "--adapters", adapter, "--dataset", heldout, "--reward_fn",
                       f"{tmp_path}/rewards.py:length", "--max_new_tokens", 1, "--output_dir", tmp_path / "ev2",
                       "--kl", "false")
    gen = json.loads((tmp_path / "ev2" / "eval_report.json").read_text())["generation"]
    assert rc == 0 and gen["truncated/base"] > 0, text
    assert f"{gen['truncated/base']} of 8 stopped at --max_new_tokens 1 before a stop token" in " ".join(text.split())


def test_prompts_are_read_as_the_run_read_them(tmp_path, heldout, lora_run, caplog):
    """A run trained through the chat template (--apply_chat_template, --template): eval under its adapter reads the
    held-out prompts the same way, unless a flag here says otherwise."""
    from fastdpo.data.columns import RowOptions
    from fastdpo.data.load import load_rows

    _, adapter, out = lora_run
    run = tmp_path / "run"
    shutil.copytree(adapter, run / "final")
    saved = yaml.safe_load((out / "config.yaml").read_text())
    (run / "config.yaml").write_text(yaml.safe_dump({**saved, "apply_chat_template": True, "template": "chatml",
                                                     "max_length": 512}))
    caplog.set_level(logging.INFO, logger="fastdpo")
    cfg = EvalConfig(adapters=str(run / "final"), dataset=[str(heldout)])
    cfg.validate()
    assert (cfg.apply_chat_template, cfg.template, cfg.max_length, cfg.beta) == (True, "chatml", 512, saved["beta"])
    assert "Read as the run in" in caplog.text and "--apply_chat_template True" in caplog.text
    rows = load_rows(cfg.dataset, read=RowOptions.from_config(cfg))
    assert rows[0].conversational and rows[0].prompt[0]["role"] == "user"
    given = EvalConfig(adapters=str(run / "final"), dataset=[str(heldout)], max_length=64)
    given.validate()
    assert given.max_length == 64 and given.apply_chat_template is True


def test_lm_eval_tasks_run_without_preference_data(tmp_path, capsys, model_dirs, monkeypatch):
    seen = {}

    def fake_lm_eval(model, tok, cfg):
        seen["model"] = model
        return {"gsm8k": {"exact_match,strict-match": 0.25}}

    monkeypatch.setattr(evaluate, "run_lm_eval", fake_lm_eval)
    report = run_eval(EvalConfig(model=str(model_dirs()), lm_eval_tasks="gsm8k", output_dir=str(tmp_path / "ev")),
                      console=Console(file=io.StringIO()))
    assert report["lm_eval"] == {"gsm8k": {"exact_match,strict-match": 0.25}} and "pairs" not in report
    assert json.loads((tmp_path / "ev" / "eval_report.json").read_text())["lm_eval"]["gsm8k"]
    rc, text = run_cli(capsys, "eval", "--model", model_dirs(), "--lm_eval_tasks", "gsm8k", "--output_dir",
                       tmp_path / "ev2")
    assert rc == 0 and "gsm8k exact_match,strict-match" in text, text
    rc, text = run_cli(capsys, "eval", "--model", model_dirs(), "--lm_eval_tasks", "gsm8k", "--reward_fn", "m:f")
    assert rc == 1 and "--reward_fn answers the prompts of --dataset" in text


@pytest.mark.parametrize("command", ["eval", "infer"])
def test_vllm_is_refused_before_a_model_loads(capsys, model_dirs, monkeypatch, command):
    def no_loading(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(generate, "load_model", no_loading)
    monkeypatch.setattr(generate, "load_tokenizer", no_loading)
    args = ["--dataset", "d.jsonl"] if command == "eval" else ["--prompt", "hi"]
    rc, text = run_cli(capsys, command, "--model", model_dirs(), *args, "--infer_backend", "vllm")
    assert rc == 1 and "--infer_backend vllm: fastdpo generates with transformers (pt)" in text, text


def test_bench_shows_na_for_memory_off_cuda():
    from fastdpo.commands.bench import print_table

    buf = io.StringIO()
    print_table(Console(file=buf, width=120), [{"impl": "fastdpo", "pairs_per_s": 3.5, "tokens_per_s": 900,
                                                "peak_gib": None}])
    assert "n/a" in buf.getvalue() and "None" not in buf.getvalue()


def test_infer_shows_a_conversation_as_turns():
    from fastdpo.commands.infer import show_answers

    buf = io.StringIO()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "w1"},
                {"role": "assistant", "content": "w2"}, {"role": "user", "content": "w3"}]
    show_answers(Console(file=buf, width=100), [{"messages": messages, "response": "w5"}], compare=False)
    out = buf.getvalue()
    assert "user: w1" in out and "assistant: w2" in out and "system: be brief" in out
    assert '"role"' not in out and "{" not in out
