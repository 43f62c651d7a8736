"""Data from LLaMA-Factory (alpaca, sharegpt) and OpenRLHF / ms-swift conventions (column mapping, input template):
each parses to the intended prompt and replies, and every bad row names its location, field and a fix."""

import json

import pytest
import yaml
from cli_helpers import run_cli
from data_helpers import assistant, chat_tokenizer, user, write_jsonl

from fastdpo.cli import build_parser
from fastdpo.config import TrainConfig, build_config
from fastdpo.data.columns import RowOptions, column_mapping
from fastdpo.data.formats import RowError, to_row
from fastdpo.data.load import load_rows
from fastdpo.data.prepare import DataOptions, load_pairs
from fastdpo.data.sources import Record
from fastdpo.data.stream import PairStream
from fastdpo.data.template import ChatRenderer
from fastdpo.errors import FastDPOError

W = "f.jsonl:7"


def system(text: str) -> dict:
    return {"role": "system", "content": text}


def turn(who: str, text: str) -> dict:
    return {"from": who, "value": text}


CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "get_time", "arguments": {"tz": "w3"}}}]}

# ---------------------------------------------------------------- alpaca


def test_alpaca_instruction_and_input_form_the_user_turn():
    row = to_row({"instruction": "w1 w2", "input": "w3", "chosen": "w5", "rejected": "w7"}, W)
    assert row.format == "alpaca" and row.conversational
    assert row.prompt == [user("w1 w2\nw3")]
    assert row.chosen == [assistant("w5")] and row.rejected == [assistant("w7")]
    assert to_row({"instruction": "w1", "input": "", "chosen": "w5", "rejected": "w7"}, W).prompt == [user("w1")]


def test_alpaca_history_and_system():
    value = {"instruction": "w4", "history": [["w1", "w2"], ["w3", "w9"]], "system": "w0", "chosen": "w5",
             "rejected": "w7"}
    row = to_row(value, W)
    assert row.prompt == [system("w0"), user("w1"), assistant("w2"), user("w3"), assistant("w9"), user("w4")]


def test_alpaca_row_is_never_an_implicit_text_prompt():
    # chosen and rejected share text: without the instruction this was taken as the prompt
    row = to_row({"instruction": "w1", "input": "w2", "chosen": "w3 w4 w5", "rejected": "w3 w4 w7"}, W)
    assert row.format == "alpaca" and row.prompt == [user("w1\nw2")] and row.chosen == [assistant("w3 w4 w5")]


# ---------------------------------------------------------------- sharegpt


def test_sharegpt_from_value_turns_and_reply_objects():
    value = {"conversations": [turn("human", "w1"), turn("gpt", "w2"), turn("human", "w3")],
             "chosen": turn("gpt", "w5"), "rejected": turn("gpt", "w7")}
    row = to_row(value, W)
    assert row.format == "sharegpt"
    assert row.prompt == [user("w1"), assistant("w2"), user("w3")]
    assert row.chosen == [assistant("w5")] and row.rejected == [assistant("w7")]


def test_sharegpt_role_content_variant_and_string_replies():
    value = {"conversations": [user("w1")], "chosen": "w5", "rejected": {"role": "assistant", "content": "w7"}}
    row = to_row(value, W)
    assert row.prompt == [user("w1")] and row.chosen == [assistant("w5")] and row.rejected == [assistant("w7")]


def test_sharegpt_turns_of_both_kinds_in_one_columnar_dataset(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"conversations": [turn("human", "w1")], "chosen": turn("gpt", "w5"), "rejected": turn("gpt", "w7")},
            {"conversations": [user("w2")], "chosen": assistant("w5"), "rejected": assistant("w7")}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")  # absent keys become nulls
    got = load_rows([str(tmp_path / "d.parquet")])
    assert [r.prompt for r in got] == [[user("w1")], [user("w2")]] and got[1].chosen == [assistant("w5")]


def test_sharegpt_system_turn_wins_over_the_system_column():
    conv = [turn("system", "w0"), turn("human", "w1")]
    base = {"chosen": turn("gpt", "w5"), "rejected": turn("gpt", "w7")}
    assert to_row({"conversations": conv, **base, "system": "w9"}, W).prompt == [system("w0"), user("w1")]
    assert to_row({"conversations": conv[1:], **base, "system": "w9"}, W).prompt == [system("w9"), user("w1")]


def test_sharegpt_function_call_observation_and_tools():
    tools = [{"name": "get_time", "description": "w1", "parameters": {"type": "object"}}]
    call = json.dumps({"name": "get_time", "arguments": {"tz": "w3"}})
    value = {"conversations": [turn("human", "w1"), turn("function_call", call), turn("observation", "w4")],
             "chosen": turn("gpt", "w5"), "rejected": turn("function_call", call.replace("w3", "w8")),
             "tools": json.dumps(tools)}
    row = to_row(value, W)
    assert row.tools == tools
    assert row.prompt == [user("w1"), CALL, {"role": "tool", "content": "w4"}]
    assert row.rejected[0]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": {"tz": "w8"}}
    # arguments given as JSON text become the object chat templates expect
    text_args = json.dumps({"name": "get_time", "arguments": json.dumps({"tz": "w3"})})
    row2 = to_row({**value, "conversations": [turn("human", "w1"), turn("function_call", text_args),
                                              turn("observation", "w4")]}, W)
    assert row2.prompt[1] == CALL


def test_a_template_without_tool_calls_is_refused_not_trained_as_empty_turns():
    row = to_row({"conversations": [turn("human", "w1")], "chosen": turn("function_call", '{"name": "get_time"}'),
                  "rejected": turn("gpt", "w7")}, W)
    with pytest.raises(RowError, match="does not render tool calls"):
        ChatRenderer(chat_tokenizer("chatml")).render(row)


BAD = [
    ("sharegpt starts with gpt", {"conversations": [turn("gpt", "a"), turn("human", "b")], "chosen": "c",
                                  "rejected": "d"}, "conversations[0].from", "where a user (human)"),
    ("sharegpt two human turns", {"conversations": [turn("human", "a"), turn("human", "b"), turn("human", "e")],
                                  "chosen": "c", "rejected": "d"}, "conversations[1].from", "an assistant (gpt)"),
    ("sharegpt ends with gpt", {"conversations": [turn("human", "a"), turn("gpt", "b")], "chosen": "c",
                                "rejected": "d"}, "conversations", "ends with an assistant turn"),
    ("sharegpt system in the middle", {"conversations": [turn("human", "a"), turn("system", "b"), turn("human", "e")],
                                       "chosen": "c", "rejected": "d"}, "conversations[1].from", "'system'"),
    ("sharegpt unknown role", {"conversations": [turn("bot", "a")], "chosen": "c", "rejected": "d"},
     "conversations[0].from", "not a ShareGPT role"),
    ("sharegpt reply by the human", {"conversations": [turn("human", "a")], "chosen": turn("human", "c"),
                                     "rejected": "d"}, "chosen.from", "a reply is an assistant"),
    ("sharegpt reply as a list", {"conversations": [turn("human", "a")], "chosen": [turn("gpt", "c")],
                                  "rejected": "d"}, "chosen", "one message"),
    ("sharegpt missing rejected", {"conversations": [turn("human", "a")], "chosen": "c"}, "rejected", "is missing"),
    ("sharegpt bad function call", {"conversations": [turn("human", "a"), turn("function_call", "now"),
                                                      turn("observation", "b")], "chosen": "c", "rejected": "d"},
     "conversations[1].value", "not a function call in JSON"),
    ("sharegpt non-text value", {"conversations": [turn("human", 3)], "chosen": "c", "rejected": "d"},
     "conversations[0].value", "must be a string"),
    ("sharegpt empty", {"conversations": [], "chosen": "c", "rejected": "d"}, "conversations", "empty list"),
    ("alpaca bad history pair", {"instruction": "a", "history": [["q"]], "chosen": "c", "rejected": "d"},
     "history[0]", "pair of strings"),
    ("alpaca reply as messages", {"instruction": "a", "chosen": [assistant("c")], "rejected": "d"}, "chosen",
     "reply text"),
    ("alpaca with prompt", {"instruction": "a", "prompt": "b", "chosen": "c", "rejected": "d"}, "prompt",
     "alpaca fields"),
    ("input without instruction", {"input": "a", "chosen": "c", "rejected": "d"}, "instruction", "is missing"),
    ("alpaca empty request", {"instruction": "", "input": "", "chosen": "c", "rejected": "d"}, "instruction",
     "is empty"),
]


@pytest.mark.parametrize("value, field, needle", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_foreign_rows_name_location_field_and_fix(value, field, needle):
    with pytest.raises(RowError) as info:
        to_row(value, W)
    msg = str(info.value)
    assert msg.startswith(W + ":") and needle in msg and f"field {field!r}" in msg, msg
    assert info.value.fix


# ---------------------------------------------------------------- column mapping


def read(**kw) -> RowOptions:
    return RowOptions(column_mapping(kw.pop("columns", {})), **kw)


def test_columns_rename_before_format_detection():
    opts = read(columns={"question": "prompt", "good": "chosen", "bad": "rejected"})
    row = Record(W, {"question": "w1", "good": "w5", "bad": "w7", "id": 1}).rows(opts)[0]
    assert (row.prompt, row.chosen, row.rejected, row.format) == ("w1", "w5", "w7", "standard")
    # a swap (labels recorded the wrong way round) renames both at once
    row = Record(W, {"prompt": "w1", "chosen": "w5", "rejected": "w7"}).rows(
        read(columns={"chosen": "rejected", "rejected": "chosen"}))[0]
    assert (row.chosen, row.rejected) == ("w7", "w5")
    # a foreign format under other names
    row = Record(W, {"msgs": [turn("human", "w1")], "chosen": "w5", "rejected": "w7"}).rows(
        read(columns={"msgs": "conversations"}))[0]
    assert row.format == "sharegpt"


def test_a_prompt_in_an_unread_column_is_named_not_dropped():
    """Chosen and rejected sharing no text, next to a text column: that column is the prompt, not read without a
    mapping; training on an empty prompt would be silent."""
    value = {"query": "w1 w2", "chosen": "w5 w6", "rejected": "w7 w8"}
    with pytest.raises(RowError, match=f"^{W}: has no prompt.*'query' is not read.*--columns '{{\"query\": "
                                       f"\"prompt\"}}'"):
        to_row(value, W)
    assert Record(W, value).rows(read(columns={"query": "prompt"}))[0].prompt == "w1 w2"
    # orca's question column is read as the prompt without a mapping (tests/data/test_data_rejects.py)
    # a shared text is the implicit prompt, whatever other columns hold; with nothing else, an empty prompt stays
    assert to_row({"id": "x", "chosen": "w1 w5", "rejected": "w1 w7"}, W).prompt == "w1"
    assert to_row({"chosen": "w5", "rejected": "w7"}, W).prompt == ""


def test_a_mapped_column_missing_or_colliding_names_the_row():
    opts = read(columns={"question": "prompt"})
    with pytest.raises(RowError, match=f"^{W}: field 'question' is missing .*renames it to prompt"):
        Record(W, {"prompt": "w1", "chosen": "w5", "rejected": "w7"}).rows(opts)[0]
    with pytest.raises(RowError, match="field 'prompt' is already a column"):
        Record(W, {"question": "w0", "prompt": "w1", "chosen": "w5", "rejected": "w7"}).rows(opts)[0]


def test_csv_cells_are_decoded_under_their_mapped_names(tmp_path):
    f = tmp_path / "d.csv"
    conv = json.dumps([user("w1")]).replace('"', '""')
    f.write_text(f'convo,good,bad\n"{conv}",w5,w7\n', encoding="utf-8")
    rows = load_rows([str(f)], read=read(columns={"convo": "conversations", "good": "chosen", "bad": "rejected"}))
    assert rows[0].format == "sharegpt" and rows[0].prompt == [user("w1")]


def config(tmp_path, *argv, yaml_cfg: dict | None = None) -> TrainConfig:
    args = ["train", "--model", "m", "--dataset", "d.jsonl", *argv]
    if yaml_cfg is not None:
        (tmp_path / "c.yaml").write_text(yaml.safe_dump(yaml_cfg), encoding="utf-8")
        args += ["--config", str(tmp_path / "c.yaml")]
    cfg = build_config(build_parser().parse_args(args), TrainConfig)
    cfg.validate_data()
    return cfg


MAPPING = {"question": "prompt", "good": "chosen", "bad": "rejected"}


def test_columns_from_flag_key_flags_and_yaml_agree(tmp_path):
    assert config(tmp_path, "--columns", json.dumps(MAPPING)).columns == MAPPING
    keys = ["--prompt_key", "question", "--chosen_key", "good", "--rejected_key", "bad"]
    assert config(tmp_path, *keys).columns == MAPPING
    assert config(tmp_path, yaml_cfg={"columns": MAPPING}).columns == MAPPING
    assert config(tmp_path, yaml_cfg={"prompt_key": "question", "chosen_key": "good", "rejected_key": "bad"}).columns \
        == MAPPING
    # the same mapping twice is no conflict
    assert config(tmp_path, "--columns", '{"question": "prompt"}', "--prompt_key", "question").columns == \
        {"question": "prompt"}


@pytest.mark.parametrize("argv, needle", [
    (["--columns", '{"question": "prompt"}', "--prompt_key", "q"], "names the prompt column, but --columns"),
    (["--columns", '{"q": "chosen"}', "--prompt_key", "q"], "but --columns maps it to 'chosen'"),
    (["--columns", '{"a": "prompt", "b": "prompt"}'], "maps both 'a' and 'b' to 'prompt'"),
    (["--columns", '{"a": "promt"}'], "Did you mean 'prompt'?"),
    (["--columns", '["a"]'], "expected a JSON object"),
    (["--input_template", "User: "], "has no {} for the prompt"),
    (["--input_template", "User: {}\\nAssistant: "], "not a newline"),
    (["--input_template", "{x} {}"], "not a valid template"),
    (["--input_template", "U: {}", "--apply_chat_template"], "Drop one"),
])
def test_column_and_template_flag_conflicts_are_refused(tmp_path, argv, needle):
    with pytest.raises(FastDPOError, match=None) as info:
        config(tmp_path, *argv)
    assert needle in str(info.value), str(info.value)


def test_mapping_applies_to_val_dataset_and_check_data(tmp_path, capsys):
    from fastdpo.data.split import held_out_rows

    rows = [{"question": f"w{i}", "good": " w5", "bad": " w7"} for i in range(10, 14)]
    val = write_jsonl(tmp_path / "val.jsonl", rows)
    cfg = config(tmp_path, "--prompt_key", "question", "--chosen_key", "good", "--rejected_key", "bad",
                 "--val_dataset", str(val))
    _, held = held_out_rows(cfg, [])
    assert [r.prompt for r in held] == ["w10", "w11", "w12", "w13"]
    code, out = run_cli(capsys, "check-data", "--dataset", str(val), "--columns", json.dumps(MAPPING))
    assert code == 0 and "(standard 4)" in out, out
    code, out = run_cli(capsys, "check-data", "--dataset", str(val), "--columns", '{"query": "prompt"}')
    assert code == 1 and f"{val}:1: field 'query' is missing" in out and "Traceback" not in out, out


def test_streaming_reads_mapped_columns(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"q": "w1 w2", "good": " w5", "bad": " w7"}] * 3)
    opts = DataOptions(streaming=True, read=read(columns={"q": "prompt", "good": "chosen", "bad": "rejected"}))
    stream = PairStream([str(f)], chat_tokenizer(), opts)
    assert len(stream.take(4)) == 4 and stream.stats.formats == {"standard": 3}
    stream.close()


# ---------------------------------------------------------------- OpenRLHF prompt handling


def test_input_template_wraps_plain_text_prompts_only():
    opts = read(input_template="User: {}\nAssistant:")
    row = Record(W, {"prompt": "w1", "chosen": " w5", "rejected": " w7"}).rows(opts)[0]
    assert row.prompt == "User: w1\nAssistant:" and row.chosen == " w5"
    with pytest.raises(RowError, match="is conversational .*wraps plain-text prompts only"):
        Record(W, {"instruction": "w1", "chosen": "w5", "rejected": "w7"}).rows(opts)[0]
    with pytest.raises(RowError, match="field 'prompt' is missing .*implicit_text"):
        Record(W, {"chosen": "w1 w5", "rejected": "w1 w7"}).rows(opts)[0]


def test_apply_chat_template_turns_plain_text_rows_into_a_conversation():
    row = Record(W, {"prompt": "w1", "chosen": "w5", "rejected": "w7"}).rows(read(apply_chat_template=True))[0]
    assert row.conversational and row.prompt == [user("w1")] and row.chosen == [assistant("w5")]
    conv = {"prompt": [user("w1")], "chosen": [assistant("w5")], "rejected": [assistant("w7")]}
    assert Record(W, conv).rows(read(apply_chat_template=True))[0].prompt == [user("w1")]


def test_cache_key_follows_the_mapping_and_the_template(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "w1 w2", "q": "w3", "chosen": " w5", "rejected": " w7"}] * 2)
    tok = chat_tokenizer()

    def load(**kw):
        opts = DataOptions(cache_dir=str(tmp_path / "cache"), read=read(**kw))
        pairs, summary = load_pairs([str(f)], tok, opts)
        return pairs[0].prompt, summary.cached

    plain, cached = load()
    assert not cached and load() == (plain, True)
    wrapped, cached = load(input_template="w9 {}")
    assert not cached and wrapped != plain
    assert load(input_template="w9 {}") == (wrapped, True)
    renamed, cached = load(columns={"q": "prompt", "prompt": "other"})
    assert not cached and renamed != plain
    # the same rows read under a different mapping are keyed apart too
    assert not load(columns={"prompt": "prompt"})[1]


def test_check_data_counts_foreign_formats(tmp_path, capsys):
    f = write_jsonl(tmp_path / "d.jsonl", [
        {"instruction": "w1", "input": "w2", "chosen": "w5", "rejected": "w7"},
        {"instruction": "w1", "history": [["w3", "w4"]], "system": "w0", "chosen": "w5", "rejected": "w7"},
        {"conversations": [turn("system", "w0"), turn("human", "w1")], "chosen": turn("gpt", "w5"),
         "rejected": turn("gpt", "w7")},
    ])
    code, out = run_cli(capsys, "check-data", "--dataset", str(f))
    assert code == 0 and "(alpaca 2, sharegpt 1)" in out, out
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"conversations": [turn("human", "w1"), turn("gpt", "w2")],
                                                "chosen": turn("gpt", "w5"), "rejected": turn("gpt", "w7")}])
    code, out = run_cli(capsys, "check-data", "--dataset", str(bad))
    assert code == 1 and f"{bad}:1: field 'conversations' ends with an assistant turn" in out, out
    assert "end with the human or observation turn" in out and "Traceback" not in out


def test_alpaca_file_trains(tmp_path, model_dirs, one_thread):
    from data_helpers import easy_rows

    from fastdpo.training.loop import train

    rows = [{"instruction": r["prompt"], "input": "", "chosen": r["chosen"], "rejected": r["rejected"]}
            for r in easy_rows(32, seed=2)]
    data = write_jsonl(tmp_path / "alpaca.jsonl", rows)
    cfg = TrainConfig(model=str(model_dirs()), dataset=[str(data)], output_dir=str(tmp_path / "out"),
                      template="identity", learning_rate=5e-3, max_steps=6, per_device_train_batch_size=8,
                      load_from_cache_file=False, disable_progress=True)
    result = train(cfg, progress=False)
    summary = json.loads((tmp_path / "out" / "data_summary.json").read_text())
    assert summary["formats"] == {"alpaca": 32} and summary["pairs"] == 32
    losses = [json.loads(line)["loss"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    assert result["final_dir"]


def test_eval_takes_the_column_keys_as_training_does():
    """`fastdpo eval` scores the rows a run trained on with the same flags: OpenRLHF's keys included."""
    from fastdpo.commands.evaluate import EvalConfig

    argv = ["eval", "--model", "m", "--dataset", "d.jsonl", "--prompt_key", "q", "--rejected_key", "bad"]
    cfg = build_config(build_parser().parse_args(argv), EvalConfig)
    assert cfg.columns == {"q": "prompt", "bad": "rejected"}
    with pytest.raises(FastDPOError, match="--pretrain"):  # the rest of OpenRLHF's flags stay training's
        build_parser().parse_args(["eval", "--model", "m", "--dataset", "d.jsonl", "--pretrain", "m"])


def test_eval_reads_rows_as_training_did():
    from fastdpo.commands.evaluate import EvalConfig

    cfg = EvalConfig(model="m", dataset=["d.jsonl"], columns={"q": "prompt"}, input_template="w9 {}")
    assert RowOptions.from_config(cfg) == RowOptions((("q", "prompt"),), "w9 {}")
    with pytest.raises(FastDPOError, match="Did you mean 'prompt'"):
        EvalConfig(model="m", dataset=["d.jsonl"], columns={"q": "promt"}).validate()
