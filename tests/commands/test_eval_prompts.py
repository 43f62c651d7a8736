"""`fastdpo eval` on prompts alone: rows of each prompt-only format, answers of the tuned and the base model scored by
a reward function or a sequence-classification reward model, and a clear error without either."""

import json

import pytest
import torch
from cli_helpers import run_cli
from data_helpers import easy_rows, write_jsonl
from model_helpers import WORDS

from fastdpo.data.columns import RowOptions
from fastdpo.data.prompts import is_prompt_only, load_prompts
from fastdpo.errors import FastDPOError

REWARDS = '''
def on_answer(prompts, completions, answer, **kwargs):
    """Minus the number of words that are not in the reference answer."""
    return [-float(sum(w not in a.split() for w in c.split())) for c, a in zip(completions, answer)]
'''


@pytest.fixture
def prompts_file(tmp_path):
    rows = [{"prompt": r["prompt"], "answer": "w5 w6"} for r in easy_rows(16, seed=11)]  # never seen in training
    return write_jsonl(tmp_path / "prompts.jsonl", rows)


def test_prompt_rows_of_each_format(tmp_path):
    rows = [
        {"prompt": "w1 w2", "answer": "w5"},
        {"prompt": [{"role": "user", "content": "w3"}]},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "w4"}]},  # ms-swift
        {"messages": [{"role": "user", "content": "w4"}, {"role": "assistant", "content": "w9"}]},  # an SFT row
        {"query": "w6", "history": [["w7", "w8"]], "system": "s", "response": "w9"},  # ms-swift query/response
        {"instruction": "w10", "input": "w11", "output": "w12"},  # alpaca
        {"question": "w13"},
        {"prompt": "w14", "chosen": "w5", "rejected": "w7"},  # a preference row reads as its prompt too
    ]
    got = load_prompts([str(write_jsonl(tmp_path / "p.jsonl", rows))])
    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    assert [r.prompt for r in got] == [
        "w1 w2", [user("w3")], [{"role": "system", "content": "s"}, user("w4")], [user("w4")],
        [{"role": "system", "content": "s"}, user("w7"), {"role": "assistant", "content": "w8"}, user("w6")],
        [user("w10\nw11")], "w13", "w14"]
    assert got[0].fields == {"answer": "w5"} and got[3].fields == {"response": "w9"}
    assert got[5].fields == {"output": "w12"} and got[7].fields == {"chosen": "w5", "rejected": "w7"}
    assert [is_prompt_only(r) for r in rows] == [True] * 7 + [False]
    # plain text through the chat template, as training reads it under --apply_chat_template
    plain = write_jsonl(tmp_path / "plain.jsonl", rows[:1])
    assert load_prompts([str(plain)], read=RowOptions(apply_chat_template=True))[0].prompt == [user("w1 w2")]


@pytest.mark.parametrize("row, needle", [
    ({"text": "w1"}, "has no prompt (fields present: text)"),
    ({"messages": [{"role": "assistant", "content": "w1"}]}, "field 'messages' has no user turn"),
    ({"prompt": ""}, "field 'prompt' is empty"),
    ({"query": "w1", "history": [["w2"]]}, "field 'history[0]' must be a [user, assistant] pair"),
])
def test_bad_prompt_rows_name_the_line_and_field(tmp_path, row, needle):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "w1"}, row])
    with pytest.raises(FastDPOError) as e:
        load_prompts([str(path)])
    assert f"{path}:2" in str(e.value) and needle in str(e.value), str(e.value)


def test_prompts_alone_are_answered_by_tuned_and_base_and_scored(tmp_path, prompts_file, capsys, lora_run):
    base, adapter, _ = lora_run
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    rc, text = run_cli(capsys, "eval", "--model", base, "--adapters", adapter, "--dataset", prompts_file,
                       "--reward_fn", f"{tmp_path}/my_rewards.py:on_answer", "--max_new_tokens", 6, "--eval_limit",
                       10, "--output_dir", tmp_path / "ev")
    assert rc == 0, text
    assert "prompts: 10" in text and "ties count half" in text and "chosen" not in text
    report = json.loads((tmp_path / "ev" / "eval_report.json").read_text())
    assert "metrics" not in report and report["prompts"] == 10
    gen = report["generation"]
    rows = [json.loads(line) for line in (tmp_path / "ev" / "generations.jsonl").read_text().splitlines()]
    assert len(rows) == gen["prompts"] == 10
    for r in rows:  # every score is the function applied to the recorded answer, with the row's `answer` column
        assert r["reward"] == -sum(w not in ["w5", "w6"] for w in r["response"].split())
        assert r["base_reward"] == -sum(w not in ["w5", "w6"] for w in r["base_response"].split())
    wins = sum(r["reward"] > r["base_reward"] for r in rows)
    ties = sum(r["reward"] == r["base_reward"] for r in rows)
    assert gen["win_rate"] == pytest.approx((wins + ties / 2) / 10) and gen["ties"] == ties
    assert gen["reward/tuned"] == pytest.approx(sum(r["reward"] for r in rows) / 10)
    assert gen["reward/base"] == pytest.approx(sum(r["base_reward"] for r in rows) / 10)
    assert gen["win_rate"] > 0.5 and gen["reward/tuned"] > gen["reward/base"]  # DPO taught it to answer w5 w6


def test_prompts_alone_without_a_scorer_say_what_to_add(tmp_path, prompts_file, capsys, model_dirs):
    rc, text = run_cli(capsys, "eval", "--model", model_dirs("qwen3"), "--dataset", prompts_file, "--output_dir",
                       tmp_path / "ev")
    text = " ".join(text.split())
    assert rc == 1 and f"{prompts_file}:1: a prompt without chosen/rejected" in text, text
    assert "--reward_fn FILE.py:function" in text and "--reward_model DIR" in text
    assert "'chosen' is missing" not in text and "Traceback" not in text
    rc, text = run_cli(capsys, "eval", "--model", model_dirs("qwen3"), "--dataset", prompts_file, "--reward_fn",
                       "r.py:f", "--reward_model", "rm", "--output_dir", tmp_path / "ev")
    assert rc == 1 and "not both" in text


@pytest.fixture
def reward_model_dir(tmp_path):
    """A random tiny sequence-classification model (one output) with the word tokenizer."""
    from transformers import AutoModelForSequenceClassification

    from fastdpo.model.tiny import tiny_config, word_tokenizer

    tok = word_tokenizer(WORDS)
    torch.manual_seed(1)
    model = AutoModelForSequenceClassification.from_config(tiny_config("qwen3", len(tok), num_labels=1))
    model.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    return tmp_path / "rm"


def test_a_reward_model_scores_the_answers(tmp_path, prompts_file, capsys, lora_run, reward_model_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    base, adapter, _ = lora_run
    rc, text = run_cli(capsys, "eval", "--model", base, "--adapters", adapter, "--dataset", prompts_file,
                       "--reward_model", reward_model_dir, "--max_new_tokens", 4, "--eval_limit", 4, "--output_dir",
                       tmp_path / "ev")
    assert rc == 0, text
    report = json.loads((tmp_path / "ev" / "eval_report.json").read_text())
    assert report["scorer"] == str(reward_model_dir) and report["generation"]["prompts"] == 4
    rows = [json.loads(line) for line in (tmp_path / "ev" / "generations.jsonl").read_text().splitlines()]
    rm = AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()
    tok = AutoTokenizer.from_pretrained(reward_model_dir)
    for r in rows:  # each score is the model's output on prompt + answer (plain text: a space between)
        for answer, got in ((r["response"], r["reward"]), (r["base_response"], r["base_reward"])):
            ids = tok(f"{r['prompt']} {answer}", add_special_tokens=False, return_tensors="pt")["input_ids"]
            with torch.no_grad():
                assert got == pytest.approx(float(rm(input_ids=ids).logits[0, 0]), rel=1e-4, abs=1e-5)
    assert len({r["reward"] for r in rows} | {r["base_reward"] for r in rows}) > 1  # not one constant


def test_a_classifier_with_several_outputs_is_refused(tmp_path, prompts_file, capsys, model_dirs):
    from transformers import AutoModelForSequenceClassification

    from fastdpo.model.tiny import tiny_config, word_tokenizer

    tok = word_tokenizer(WORDS)
    AutoModelForSequenceClassification.from_config(tiny_config("qwen3", len(tok), num_labels=3)).save_pretrained(
        tmp_path / "cls")
    tok.save_pretrained(tmp_path / "cls")
    rc, text = run_cli(capsys, "eval", "--model", model_dirs("qwen3"), "--dataset", prompts_file, "--reward_model",
                       tmp_path / "cls", "--output_dir", tmp_path / "ev")
    assert rc == 1 and "has 3 (a classifier)" in text and "Traceback" not in text
