"""`fastdpo check-data` and `fastdpo train` on bad data: each bad-input class is named by file, line and field, with
a fix, in one message and never a traceback."""

import json
import os
import subprocess
import sys

import pytest
from data_helpers import assistant, easy_rows, tokenizer_dir, user, write_jsonl

from fastdpo.cli import main

GOOD = {"prompt": "w1 w2", "chosen": " w5 w6", "rejected": " w7"}
CONV = {"prompt": [user("w1")], "chosen": [assistant("w5")], "rejected": [assistant("w7")]}


def jsonl_with(bad_line: str | bytes, name="d.jsonl"):
    """Two good rows, the bad line as line 3, one good row."""
    good = json.dumps(GOOD).encode() + b"\n"
    bad = bad_line if isinstance(bad_line, bytes) else bad_line.encode()
    return name, good + json.dumps({**GOOD, "prompt": "w3"}).encode() + b"\n" + bad + b"\n" + \
        json.dumps({**GOOD, "prompt": "w4"}).encode() + b"\n"


# (class, file name, file bytes, where, text expected in the message)
CASES = [
    ("json syntax", *jsonl_with('{"prompt": "a", "chosen": "b"'), ":3", "invalid JSON"),
    ("missing field", *jsonl_with('{"prompt": "a", "chosen": "b"}'), ":3", "field 'rejected' is missing"),
    ("wrong type", *jsonl_with('{"prompt": "a", "chosen": "b", "rejected": 5}'), ":3", "field 'rejected' must be"),
    ("empty string", *jsonl_with('{"prompt": "a", "chosen": "", "rejected": "c"}'), ":3", "field 'chosen' is empty"),
    ("invalid utf-8", *jsonl_with(b'{"prompt": "a\xff", "chosen": "b", "rejected": "c"}'), ":3", "not valid UTF-8"),
    ("not an object", *jsonl_with('["a", "b", "c"]'), ":3", "expected a JSON object"),
    ("unknown format", *jsonl_with('{"question": "a", "answer": "b"}'), ":3", "no preference fields"),
    ("bad message", *jsonl_with(json.dumps({**CONV, "chosen": [{"content": "w5"}]})), ":3",
     "field 'chosen[0].role' is missing"),
    ("mixed forms", *jsonl_with(json.dumps({**CONV, "rejected": "w7"})), ":3", "same form"),
    ("messages with rejected", *jsonl_with(json.dumps({"messages": [user("a"), assistant("b")], "rejected": "c"})),
     ":3", "goes in rejected_response or rejected_messages"),
    ("csv extra cells", "d.csv", b'prompt,chosen,rejected\nw1,w2,w3\nw1,w2,w3,w4\n', ":3", "more cells"),
    ("json array syntax", "d.json", b'[\n{"prompt": "w1", "chosen": "w2", "rejected": "w3"},\n{"prompt": }\n]',
     ":3", "invalid JSON"),
]


def write_case(tmp_path, name, body):
    f = tmp_path / name
    f.write_bytes(body)
    return f


def run_cli(capsys, *args):
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize("name, body, where, needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_check_data_names_the_line(tmp_path, capsys, name, body, where, needle):
    f = write_case(tmp_path, name, body)
    code, out = run_cli(capsys, "check-data", "--dataset", str(f))
    assert code == 1, out
    assert f"{f}{where}: " in out and needle in out, out
    assert "Traceback" not in out and "FAILED: 1 error." in out, out


@pytest.mark.parametrize("name, body, where, needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_train_stops_at_the_bad_line(tmp_path, capsys, model_dirs, name, body, where, needle):
    f = write_case(tmp_path, name, body)
    code, out = run_cli(capsys, "train", "--model", str(model_dirs()), "--dataset", str(f), "--output_dir",
                        str(tmp_path / "o"), "--max_steps", "1", "--load_from_cache_file", "false")
    assert code == 1 and f"{f}{where}: " in out and needle in out, out
    assert "Traceback" not in out, out


def test_check_data_identical_duplicate_and_over_length(tmp_path, capsys):
    rows = [GOOD, {"prompt": "w1", "chosen": " w2", "rejected": " w2"}, GOOD,
            {"prompt": " ".join(["w9"] * 20), "chosen": " w5", "rejected": " w6"}, CONV]
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    tok = tokenizer_dir(tmp_path / "tok", "chatml")
    code, out = run_cli(capsys, "check-data", "--dataset", str(f), "--model", str(tok), "--max_length", "12")
    assert code == 1, out  # identical chosen/rejected is an error
    assert f"{f}:2: chosen is identical to rejected" in out
    assert f"{f}:3: the same pair as {f}:1" in out  # a warning
    assert f"{f}:4: prompt 21 + completion 2 tokens > --max_length 12" in out
    assert "(conversational 1, standard 4)" in out
    assert "dropped 1 (prompt fills max_length)" in out
    # nearest-rank p50/p95/max over the 4 tokenised rows: prompts of 3, 3, 21 and 7 tokens
    line = next(s for s in out.splitlines() if s.strip().startswith("prompt "))
    assert line.split()[1:] == ["3", "21", "21"], out


def test_check_data_finds_each_problem_of_a_one_line_json_array(tmp_path, capsys):
    """json.dump writes every row on line 1: each row is told apart by its index, so an identical pair and a
    duplicate further along are reported (with one location for all, the first row hid every later one)."""
    rows = [GOOD, {**GOOD, "prompt": "w3"}, GOOD, {"prompt": "w1", "chosen": " w2", "rejected": " w2"}]
    f = tmp_path / "d.json"
    f.write_text(json.dumps(rows), encoding="utf-8")
    code, out = run_cli(capsys, "check-data", "--dataset", str(f))
    assert code == 1, out
    assert f"{f}:1 index 3: chosen is identical to rejected" in out
    assert f"{f}:1 index 2: the same pair as {f}:1 index 0" in out


def test_check_data_reports_template_problems_with_the_row(tmp_path, capsys):
    f = write_jsonl(tmp_path / "d.jsonl", [GOOD, CONV])
    no_template = tokenizer_dir(tmp_path / "plain", None)
    code, out = run_cli(capsys, "check-data", "--dataset", str(f), "--model", str(no_template))
    assert code == 1 and f"{f}:2: is conversational but the tokenizer has no chat_template" in out, out
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m['content'] + ' ' }}{% endfor %}"
                   "{% if add_generation_prompt %}{{ 'assistant ' }}{% endif %}")
    code, out = run_cli(capsys, "check-data", "--dataset", str(f), "--model", str(no_template), "--template", str(bad))
    assert code == 1 and f"{f}:2: the chat template renders the prompt differently" in out, out
    code, out = run_cli(capsys, "check-data", "--dataset", str(f), "--model", str(no_template), "--template", "chatml")
    assert code == 0 and "OK: no errors." in out, out


def test_check_data_many_sources_and_a_clean_exit(tmp_path, capsys):
    a = write_jsonl(tmp_path / "a.jsonl", easy_rows(30))
    b = write_jsonl(tmp_path / "b.jsonl", [{"messages": [user("w1"), assistant("w5")], "rejected_response": "w7"}])
    code, out = run_cli(capsys, "check-data", "--dataset", str(a), str(b), "--model", str(tokenizer_dir(tmp_path / "t")))
    assert code == 0, out
    assert f"{a}: 30 rows (standard 30)" in out and f"{b}: 1 rows (ms_swift 1)" in out
    assert "p50" in out and "31 pairs kept" in out
    code, out = run_cli(capsys, "check-data", "--dataset", str(tmp_path / "missing.jsonl"))
    assert code == 1 and "not found" in out and "Traceback" not in out


def test_check_data_checks_the_held_out_pairs_too(tmp_path, capsys):
    """--val_dataset (with --val_split) is checked like --dataset: training would stop at its bad rows."""
    from datasets import Dataset, DatasetDict

    train = write_jsonl(tmp_path / "t.jsonl", easy_rows(4))
    val = write_jsonl(tmp_path / "v.jsonl", [GOOD, {"prompt": "w1", "chosen": "w5"}])
    code, out = run_cli(capsys, "check-data", "--dataset", str(train), "--val_dataset", str(val))
    assert code == 1 and f"{train}: 4 rows (standard 4)" in out, out
    assert "held-out pairs (--val_dataset, split train):" in out and f"{val}:2: field 'rejected' is missing" in out, out
    rows = easy_rows(5)
    DatasetDict({"train": Dataset.from_list(rows[:2]), "test": Dataset.from_list(rows[2:])}).save_to_disk(tmp_path / "hf")
    code, out = run_cli(capsys, "check-data", "--dataset", str(train), "--val_dataset", str(tmp_path / "hf"),
                        "--val_split", "test")
    assert code == 0 and f"{tmp_path / 'hf'}: 3 rows (standard 3)" in out, out


def test_max_samples_keeps_the_first_rows_of_each_dataset(tmp_path, capsys):
    """--max_samples N (LLaMA-Factory's and OpenRLHF's): the first N rows of each dataset, after `#N`; training and
    check-data agree, the held-out set is cut too, and a stream is refused (its `#N` takes the first rows)."""
    from fastdpo.cli import build_parser
    from fastdpo.config import TrainConfig, build_config
    from fastdpo.data.columns import RowOptions
    from fastdpo.data.load import load_rows
    from fastdpo.errors import FastDPOError

    a, b = write_jsonl(tmp_path / "a.jsonl", easy_rows(6, seed=1)), write_jsonl(tmp_path / "b.jsonl", easy_rows(5, seed=2))
    first = RowOptions(max_samples=2)
    assert [r.prompt for r in load_rows([str(a), str(b)], read=first)] == \
        [r["prompt"] for r in easy_rows(6, seed=1)[:2] + easy_rows(5, seed=2)[:2]]
    sampled = load_rows([f"{a}#4"], seed=3)
    assert [r.prompt for r in load_rows([f"{a}#4"], seed=3, read=first)] == [r.prompt for r in sampled[:2]]
    code, out = run_cli(capsys, "check-data", "--dataset", str(a), "--val_dataset", str(b), "--max_samples", "3")
    assert code == 0 and f"{a}: 6 rows read, 3 used for training" in out and f"{b}: 5 rows read, 3 used" in out, out
    cfg = build_config(build_parser().parse_args(["train", "--model", "m", "--dataset", str(a), "--streaming", "true",
                                                  "--max_steps", "2", "--max_samples", "3"]), TrainConfig)
    with pytest.raises(FastDPOError, match="write each dataset as `path#3`"):
        cfg.validate_data()


def test_check_data_reports_the_rows_a_row_count_selects(tmp_path, capsys):
    rows = easy_rows(32)
    rows[5] = {**rows[5], "chosen": rows[5]["rejected"]}  # one bad row: training stops at it whatever #N selects
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    tok = str(tokenizer_dir(tmp_path / "t"))
    for n in (10, 100):
        code, out = run_cli(capsys, "check-data", "--dataset", f"{f}#{n}", "--model", tok)
        assert f"{f}#{n}: 32 rows read, {n} used for training (standard {n})" in out, out
    assert code == 1 and out.count(f"{f}:6: chosen is identical") == 1, out  # a repeated row is reported once
    rows[5] = easy_rows(32)[5]
    write_jsonl(f, rows)
    code, out = run_cli(capsys, "check-data", "--dataset", f"{f}#100", "--model", tok)
    assert code == 0 and "100 pairs kept" in out and "duplicate" not in out, out


def test_check_data_selects_the_rows_training_uses(tmp_path):
    from transformers import AutoTokenizer

    from fastdpo.commands.check_data import check_data
    from fastdpo.data.prepare import DataOptions, load_pairs

    f = write_jsonl(tmp_path / "d.jsonl", easy_rows(32))
    tok = AutoTokenizer.from_pretrained(tokenizer_dir(tmp_path / "t"))
    for spec in (f"{f}#10", f"{f}#45"):
        opts = DataOptions(seed=3, use_cache=False)
        report = check_data([spec], opts, tok)
        pairs, _ = load_pairs([spec], tok, opts)
        assert report.lengths["prompt"] == [len(p.prompt) for p in pairs] and report.stats.pairs == len(pairs)


def test_the_real_command_exits_non_zero_without_a_traceback(tmp_path):
    _, name, body, *_ = CASES[1]
    f = write_case(tmp_path, name, body)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    res = subprocess.run([sys.executable, "-m", "fastdpo", "check-data", "--dataset", str(f)], capture_output=True,
                         text=True, env=env, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 1 and f"{f}:3: field 'rejected' is missing" in out and "Traceback" not in out, out


def test_plain_text_rows_under_a_chat_template_get_a_note(tmp_path, capsys):
    """ms-swift and LLaMA-Factory render a plain prompt as a user turn; TRL (and fastdpo's default) do not. A model
    with a chat template and raw plain-text rows is told so; rows already rendered, or read another way, are not."""
    raw = write_jsonl(tmp_path / "raw.jsonl", easy_rows(4))
    chat = tokenizer_dir(tmp_path / "chat")
    code, out = run_cli(capsys, "check-data", "--dataset", str(raw), "--model", str(chat))
    assert code == 0 and "note: 4 plain-text rows are tokenised as they are" in out, out
    assert "--apply_chat_template true" in out
    for flags in (["--apply_chat_template", "true"], ["--input_template", "user {} assistant "]):
        code, out = run_cli(capsys, "check-data", "--dataset", str(raw), "--model", str(chat), *flags)
        assert code == 0 and "note:" not in out, (flags, out)
    code, out = run_cli(capsys, "check-data", "--dataset", str(raw), "--model", str(tokenizer_dir(tmp_path / "t", None)))
    assert code == 0 and "note:" not in out, out  # no chat template at hand: nothing else to do
    rendered = write_jsonl(tmp_path / "rendered.jsonl", [
        {"prompt": "<|im_start|>user\nw1 w2<|im_end|>\n<|im_start|>assistant\n", "chosen": "w5", "rejected": "w7"}])
    code, out = run_cli(capsys, "check-data", "--dataset", str(rendered), "--model", str(chat))
    assert code == 0 and "note:" not in out, out


def test_training_logs_the_plain_text_note(tmp_path, caplog):
    import logging

    from fastdpo.config import TrainConfig
    from fastdpo.model.load import load_tokenizer
    from fastdpo.training.setup import load_splits

    caplog.set_level(logging.WARNING, logger="fastdpo")
    raw = write_jsonl(tmp_path / "raw.jsonl", easy_rows(4))
    chat = tokenizer_dir(tmp_path / "chat")
    cfg = TrainConfig(model=str(chat), dataset=[str(raw)], output_dir=str(tmp_path / "o"))
    load_splits(cfg, load_tokenizer(str(chat)))
    assert "4 plain-text rows are tokenised as they are" in caplog.text
    caplog.clear()
    cfg = TrainConfig(model=str(chat), dataset=[str(raw)], output_dir=str(tmp_path / "o"), apply_chat_template=True)
    load_splits(cfg, load_tokenizer(str(chat)))
    assert "plain-text rows" not in caplog.text


def test_check_data_reads_rows_up_to_the_raised_row_limit(tmp_path, capsys):
    """A row over the default 16 MiB is refused by name, and read once --max_row_mb allows it."""
    import json

    from cli_helpers import run_cli

    big = tmp_path / "big.jsonl"
    big.write_text(json.dumps({"prompt": "q " * (9 << 20), "chosen": "a", "rejected": "b"}) + "\n")  # ~18 MiB
    rc, out = run_cli(capsys, "check-data", "--dataset", big)
    assert rc != 0 and "--max_row_mb" in out
    rc, out = run_cli(capsys, "check-data", "--dataset", big, "--max_row_mb", "32")
    assert "--max_row_mb" not in out, out[-500:]
