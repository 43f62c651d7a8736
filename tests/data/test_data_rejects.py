"""Invalid rows: one error for many alike (strict, the default), skipped and written to rejects.jsonl with --strict
false; foreign column names named or read (orca's question); token ids outside the model; slow chat templates."""

import json
import threading
import time

import pytest
from cli_helpers import run_cli
from data_helpers import assistant, chat_tokenizer, easy_rows, user, write_jsonl
from model_helpers import WORDS

from fastdpo.config import TrainConfig
from fastdpo.data.formats import Row, RowError, to_row
from fastdpo.data.load import load_rows
from fastdpo.data.prepare import DataOptions, tokenize_pairs
from fastdpo.data.rejects import Rejects
from fastdpo.data.template import BUILTIN_TEMPLATES, time_limit, turn_end
from fastdpo.data.tokenize import TokenizedPair, TokenizeOptions, check_vocab, tokenize_chunk
from fastdpo.errors import FastDPOError
from fastdpo.model.tiny import build_tiny_model, word_tokenizer

# nested loops of the sandbox's largest range: 10^10 iterations, hours of rendering
SLOW_TEMPLATE = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
                 "{% for m in messages %}{{ m['content'] }}{% endfor %}")


def bad_rows() -> list[dict]:
    """20 rows: line 4 with an empty chosen, lines 7 and 9 without rejected."""
    rows = easy_rows(20, seed=2)
    rows[3]["chosen"] = ""
    del rows[6]["rejected"], rows[8]["rejected"]
    return rows


def test_one_bad_row_names_its_line_and_the_flag_that_skips_it(tmp_path):
    rows = easy_rows(20, seed=2)
    rows[3]["chosen"] = ""
    f = write_jsonl(tmp_path / "data.jsonl", rows)
    with pytest.raises(FastDPOError) as e:
        load_rows([str(f)])
    assert f"{f}:4: field 'chosen' is empty." in str(e.value) and "--strict false" in str(e.value)


def test_the_same_error_over_many_rows_is_named_once_with_the_column_to_map(tmp_path):
    rows = [{"query": r["prompt"], "chosen": r["chosen"], "rejected": r["rejected"]} for r in easy_rows(100)]
    f = write_jsonl(tmp_path / "data.jsonl", rows)
    with pytest.raises(FastDPOError) as e:
        load_rows([str(f)])
    text = str(e.value)
    assert f"missing prompt in 100 of 100 rows of {f} (lines 1, 2, 3, ...): {f}:1: " in text, text
    assert """--columns '{"query": "prompt"}'""" in text and "--strict false" in text, text
    assert text.count(f"{f}:") == 1, text  # the first row's message once, not a hundred


def test_grouped_errors_name_each_problem_and_an_alias_of_chosen(tmp_path):
    rows = [{"instruction": r["prompt"], "chosen_response": r["chosen"], "rejected_response": r["rejected"]}
            for r in easy_rows(5)] + bad_rows()
    f = write_jsonl(tmp_path / "data.jsonl", rows)
    with pytest.raises(FastDPOError) as e:
        load_rows([str(f)])
    text = str(e.value)
    assert f"field 'chosen' is missing in 5 of 25 rows of {f} (lines 1, 2, 3, ...)" in text, text
    assert """--columns '{"chosen_response": "chosen", "rejected_response": "rejected"}'""" in text, text
    assert f"Also field 'chosen' is empty in 1 rows (line 9): {f}:9:" in text, text
    assert "Also field 'rejected' is missing in 2 rows (lines 12, 14)" in text, text


def test_orca_rows_read_question_as_the_prompt_and_system_as_its_turn():
    row = to_row({"system": "be brief", "question": "w1 w2", "chosen": "w3", "rejected": "w4"}, "d:1")
    assert row.format == "orca"
    assert row.prompt == [{"role": "system", "content": "be brief"}, user("w1 w2")]
    assert (row.chosen, row.rejected) == ([assistant("w3")], [assistant("w4")])
    assert to_row({"system": "", "question": "w1", "chosen": "w3", "rejected": "w4"}, "d:1").prompt == [user("w1")]
    plain = to_row({"question": "w1", "chosen": "w3", "rejected": "w4"}, "d:1")
    assert (plain.prompt, plain.chosen, plain.format) == ("w1", "w3", "standard")


def test_orca_rows_train_through_the_chat_template(tmp_path):
    rows = [{"system": "w9", "question": r["prompt"], "chosen": r["chosen"], "rejected": r["rejected"]}
            for r in easy_rows(6)]
    f = write_jsonl(tmp_path / "orca.jsonl", rows)
    loaded = load_rows([str(f)])
    pairs, summary = tokenize_pairs(loaded, chat_tokenizer("chatml"), DataOptions(use_cache=False))
    assert summary.stats.formats == {"orca": 6} and len(pairs) == 6


def test_skipped_rows_are_counted_by_reason_and_written_with_their_line(tmp_path):
    f = write_jsonl(tmp_path / "data.jsonl", bad_rows())
    rejects = Rejects(skip=True)
    rows = load_rows([str(f)], rejects=rejects)
    assert len(rows) == 17
    assert rejects.summary() == "skipped 3 of 20 rows: 2 missing rejected, 1 empty chosen"
    rejects.write(tmp_path / "rejects.jsonl")
    written = [json.loads(line) for line in (tmp_path / "rejects.jsonl").read_text().splitlines()]
    assert [(r["file"], r["line"], r["reason"]) for r in written] == [
        (str(f), 4, "empty chosen"), (str(f), 7, "missing rejected"), (str(f), 9, "missing rejected")]
    assert written[0]["row"] == bad_rows()[3] and "is empty" in written[0]["error"]


def test_an_unreadable_line_is_skipped_but_not_a_file_whose_rest_cannot_be_read(tmp_path):
    lines = [json.dumps(r) for r in easy_rows(4)]
    lines[1] = lines[1][:-1]  # the closing brace cut off
    f = tmp_path / "data.jsonl"
    f.write_text("\n".join(lines) + "\n")
    rejects = Rejects(skip=True)
    assert len(load_rows([str(f)], rejects=rejects)) == 3
    assert [(r.line, r.reason) for r in rejects.items] == [(2, "unreadable row")]
    g = tmp_path / "data.json"  # one array: what follows its broken element is never read
    g.write_text("[\n" + ",\n".join(lines) + "\n]\n")
    with pytest.raises(FastDPOError, match=rf"{g}:\d+: invalid JSON.*Reading stopped here.*cannot skip it alone"):
        load_rows([str(g)], rejects=Rejects(skip=True))


def test_rows_the_chat_template_fails_on_are_skipped_too():
    failing = ("{% if messages[0]['content'] == 'w13' %}{{ raise_exception('no') }}{% endif %}"
               + BUILTIN_TEMPLATES["chatml"])
    rows = [Row([user(f"w{10 + i}")], [assistant("w5")], [assistant("w6")], f"d.jsonl:{i + 1}",
                format="conversational") for i in range(5)]
    opts = DataOptions(TokenizeOptions(template=failing), use_cache=False)
    with pytest.raises(FastDPOError, match="d.jsonl:4: the chat template failed .* --strict false"):
        tokenize_pairs(rows, chat_tokenizer(), opts)
    rejects = Rejects(skip=True)
    pairs, _ = tokenize_pairs(rows, chat_tokenizer(), opts, rejects)
    assert [p.index for p in pairs] == [0, 1, 2, 4]
    assert [(r.where, r.reason) for r in rejects.items] == [("d.jsonl:4", "chat template failed")]
    assert rejects.summary() == "skipped 1 of 5 rows: 1 chat template failed"
    assert rejects.items[0].row["prompt"] == [user("w13")]


def test_training_with_strict_false_skips_logs_and_writes_the_rejects(tmp_path, model_dirs, capsys, restore_logging,
                                                                       one_thread):
    f = write_jsonl(tmp_path / "data.jsonl", bad_rows())
    out = tmp_path / "out"
    code, printed = run_cli(capsys, "train", "--model", model_dirs(), "--dataset", f, "--output_dir", out,
                            "--max_steps", "1", "--per_device_train_batch_size", "4", "--strict", "false",
                            "--load_from_cache_file", "false")
    assert code == 0, printed
    assert "skipped 3 of 20 rows: 2 missing rejected, 1 empty chosen" in printed, printed
    assert len((out / "rejects.jsonl").read_text().splitlines()) == 3


def test_check_data_counts_the_invalid_rows_and_groups_the_same_problem(tmp_path, capsys):
    rows = bad_rows()
    for i in (10, 11, 12, 13):
        rows[i]["chosen"] = ""
    f = write_jsonl(tmp_path / "data.jsonl", rows)
    code, out = run_cli(capsys, "check-data", "--dataset", str(f))
    assert code == 1
    assert "invalid rows: 7 of 20 (5 empty chosen, 2 missing rejected)" in out, out
    assert "--strict false skips them" in out
    assert f"field 'chosen' is empty in 5 of 20 rows of {f} (lines 4, 11, 12, ...)" in out, out
    assert f"{f}:7: field 'rejected' is missing" in out and f"{f}:13:" not in out, out


def test_token_ids_outside_the_model_are_refused_before_the_first_step(tmp_path):
    from fastdpo.training.loop import train

    model = build_tiny_model(tmp_path / "model", words=WORDS)
    word_tokenizer(WORDS + ["wx"]).save_pretrained(model)  # one token more than the model's embeddings
    rows = easy_rows(8)
    rows[5]["chosen"] = " w5 wx"
    f = write_jsonl(tmp_path / "data.jsonl", rows)
    cfg = TrainConfig(model=str(model), dataset=[str(f)], output_dir=str(tmp_path / "out"), max_steps=1,
                      load_from_cache_file=False)
    vocab = len(word_tokenizer(WORDS))
    with pytest.raises(FastDPOError, match=rf"{f}:6: token id {vocab} \(in the chosen\) .* {vocab} rows.*"
                                           "resize_token_embeddings"):
        train(cfg, progress=False)


def test_check_vocab_passes_ids_inside_the_embeddings():
    rows = [Row("a", "b", "c", "d:1")]
    check_vocab([TokenizedPair([1], [2, 9], [3], 0)], rows, 10, "m")
    with pytest.raises(FastDPOError, match="d:1: token id 10 .in the rejected."):
        check_vocab([TokenizedPair([1], [2, 9], [10], 0)], rows, 10, "m")


def test_a_chat_template_that_loops_for_hours_is_stopped_naming_the_row():
    row = Row([user("w1")], [assistant("w2")], [assistant("w3")], "d.jsonl:3", format="conversational")
    start = time.monotonic()
    with pytest.raises(RowError, match=r"d.jsonl:3: --template took more than 0.3 s to render this row.*"
                                       "--template_timeout") as e:
        tokenize_chunk(chat_tokenizer(), [row], TokenizeOptions(template=SLOW_TEMPLATE, template_timeout=0.3))
    assert time.monotonic() - start < 5 and e.value.reason == "chat template too slow"


def test_the_plain_text_note_does_not_wait_on_a_template_that_loops_for_hours():
    start = time.monotonic()
    assert turn_end(chat_tokenizer(), SLOW_TEMPLATE, timeout=0.2) is None
    assert time.monotonic() - start < 5


def test_off_the_main_thread_a_slow_rendering_is_reported_not_silent():
    called = threading.Event()

    def body():
        with time_limit(0.05, called.set):
            time.sleep(0.3)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert called.is_set()
