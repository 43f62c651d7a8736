"""Unpaired rows (KTO): one completion with a boolean label, read from TRL's prompt/completion/label (text and
conversational), ms-swift's messages + label and LLaMA-Factory's kto_tag entries into Rows with `label` set; a label
that is not a boolean is refused where it is; a dataset, or the datasets of a run, hold one kind of row; check-data
counts desirable and undesirable rows."""

import json

import pytest
from cli_helpers import run_cli
from data_helpers import assistant, chat_tokenizer, user, write_jsonl

from fastdpo.data.columns import RowOptions
from fastdpo.data.dataset_info import resolve
from fastdpo.data.formats import Row, RowError
from fastdpo.data.groups import to_rows
from fastdpo.data.kinds import RowKinds, check_row_kinds
from fastdpo.data.load import load_file, load_rows
from fastdpo.data.prepare import DataOptions
from fastdpo.data.records import Record
from fastdpo.data.split import held_out_rows
from fastdpo.data.stream import PairStream
from fastdpo.errors import FastDPOError

W = "d.jsonl:3"
SYSTEM = {"role": "system", "content": "w0"}
PAIR = {"prompt": "w1 w2", "chosen": " w5", "rejected": " w7"}

# (record, prompt, completion, label, format)
READS = [
    ({"prompt": "w1 w2", "completion": " w5", "label": True}, "w1 w2", " w5", True, "unpaired"),
    ({"prompt": [user("w1")], "completion": [assistant("w5")], "label": False}, [user("w1")], [assistant("w5")], False,
     "unpaired_conversational"),
    ({"prompt": "w1", "completion": [assistant("w5")], "label": True, "system": "w0"}, [SYSTEM, user("w1")],
     [assistant("w5")], True, "unpaired_conversational"),
    ({"prompt": [user("w1")], "completion": [assistant("w5"), {"role": "tool", "content": "w6"}, assistant("w7")],
      "label": True}, [user("w1")], [assistant("w5"), {"role": "tool", "content": "w6"}, assistant("w7")], True,
     "unpaired_conversational"),
    ({"messages": [SYSTEM, user("w1"), assistant("w2"), user("w3"), assistant("w5")], "label": False},
     [SYSTEM, user("w1"), assistant("w2"), user("w3")], [assistant("w5")], False, "swift_kto"),
    ({"messages": [user("w1"), assistant("w5")], "label": True, "system": "w0"}, [SYSTEM, user("w1")],
     [assistant("w5")], True, "swift_kto"),
    ({"instruction": "w1", "input": "w2", "output": "w5", "label": True}, [user("w1\nw2")], [assistant("w5")], True,
     "llamafactory_kto"),
    ({"conversations": [{"from": "human", "value": "w1"}, {"from": "gpt", "value": "w5"}], "label": False},
     [user("w1")], [assistant("w5")], False, "llamafactory_kto"),
]


@pytest.mark.parametrize("record,prompt,completion,label,fmt", READS)
def test_each_format_reads_into_one_labelled_row(record, prompt, completion, label, fmt):
    [row] = to_rows(record, W)
    assert (row.prompt, row.chosen, row.label, row.format) == (prompt, completion, label, fmt)
    assert row.rejected is row.chosen and row.unpaired and not row.identical and row.source == W


def test_the_label_is_part_of_the_duplicate_key():
    good, bad = (to_rows({"prompt": "w1", "completion": " w5", "label": x}, W)[0] for x in (True, False))
    assert good.key() != bad.key()


@pytest.mark.parametrize("record", [r for r, *_ in READS])
@pytest.mark.parametrize("label,shown", [("yes", 'the string "yes"'), (2, "the number 2"), (None, "null"),
                                         ([True], "a list [true]")])
def test_a_label_that_is_not_a_boolean_is_refused_where_it_is(tmp_path, record, label, shown):
    f = write_jsonl(tmp_path / "d.jsonl", [{**record, "label": True}] * 2 + [{**record, "label": label}])
    with pytest.raises(FastDPOError) as e:
        load_rows([str(f)])
    assert f"{f}:3: field 'label' must be a JSON boolean, got {shown}. Write true" in str(e.value)
    assert "false" in str(e.value)


def test_csv_cells_true_and_false_are_labels(tmp_path):
    f = tmp_path / "d.csv"
    f.write_text("prompt,completion,label\nw1,w5,true\nw2,w6,FALSE\nw3,w7,True\n", encoding="utf-8")
    rows = load_rows([str(f)])
    assert [(r.prompt, r.chosen, r.label, r.format) for r in rows] == [
        ("w1", "w5", True, "unpaired"), ("w2", "w6", False, "unpaired"), ("w3", "w7", True, "unpaired")]
    conv = json.dumps([assistant("w5")]).replace('"', '""')
    f.write_text(f'prompt,completion,label\nw1,"{conv}",false\n', encoding="utf-8")
    [row] = load_rows([str(f)])
    assert (row.prompt, row.chosen, row.label, row.format) == ([user("w1")], [assistant("w5")], False,
                                                               "unpaired_conversational")
    f.write_text("prompt,completion,label\nw1,w5,true\nw2,w6,yes\n", encoding="utf-8")
    with pytest.raises(FastDPOError, match=f"{f}:3: field 'label' must be a JSON boolean, got the string \"yes\""):
        load_rows([str(f)])


def test_a_json_label_must_be_a_boolean_not_text():
    with pytest.raises(RowError, match="field 'label' must be a JSON boolean, got the string \"true\""):
        to_rows({"prompt": "w1", "completion": "w5", "label": "true"}, W)


@pytest.mark.parametrize("record", [
    {**PAIR, "label": True},
    {"messages": [user("w1"), assistant("w5")], "rejected_response": "w7", "label": False},
    {"prompt": "w1", "chosen": " w5", "rejected": [" w6", " w7"], "label": True},
    {"prompt": "w1", "completions": [" w5", " w7"], "scores": [1, 2], "label": True},
])
def test_a_row_with_a_pair_and_a_label_is_refused(record):
    with pytest.raises(RowError) as e:
        to_rows(record, W)
    assert e.value.field == "label" and "a row is either a pair or one completion with its label" in str(e.value)
    assert "Keep one" in str(e.value) and e.value.reason == "pair and label"


def test_a_null_label_beside_a_pair_leaves_the_pair():
    [row] = to_rows({**PAIR, "label": None}, W)
    assert row.format == "standard" and not row.unpaired


@pytest.mark.parametrize("record,needle", [
    ({"prompt": "w1", "completion": " w5"}, "field 'label' is missing .* prompt-completion \\(SFT\\) row"),
    ({"prompt": "w1", "label": True}, "field 'completion' is missing"),
    ({"completion": " w5", "label": True}, "field 'prompt' is missing"),
    ({"prompt": "w1", "completion": "", "label": True}, "field 'completion' is empty. An unpaired row needs"),
    ({"prompt": [user("w1")], "completion": " w5", "label": True}, "field 'completion' is a string but prompt is"),
    ({"prompt": "w1", "completion": [user("w5")], "label": True}, "field 'completion\\[0\\].role' is 'user'"),
    ({"messages": [user("w1")], "label": True}, "field 'messages' ends with a 'user' turn. .* judged assistant"),
    ({"conversations": [{"from": "human", "value": "w1"}], "label": True},
     "field 'conversations' ends with a user or observation turn"),
    ({"instruction": "w1", "label": True}, "field 'output' is missing"),
    ({"instruction": "w1", "output": "w5", "kto_tag": True}, "field 'kto_tag' is LLaMA-Factory's KTO tag"),
])
def test_an_unpaired_row_that_is_incomplete_names_the_field(record, needle):
    with pytest.raises(RowError, match=needle):
        to_rows(record, W)


def test_columns_rename_to_completion_and_label(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"q": "w1", "answer": " w5", "good": False}])
    [row] = load_rows([str(f)], read=RowOptions(columns=(("answer", "completion"), ("good", "label"), ("q", "prompt"))))
    assert (row.prompt, row.chosen, row.label, row.format) == ("w1", " w5", False, "unpaired")


def test_prompt_flags_wrap_unpaired_text_prompts():
    record = {"prompt": "w1", "completion": " w5", "label": True}
    [row] = load_rows_of(record, RowOptions(input_template="User: {}\nAssistant:"))
    assert (row.prompt, row.chosen, row.label) == ("User: w1\nAssistant:", " w5", True)
    [row] = load_rows_of(record, RowOptions(apply_chat_template=True))
    assert (row.prompt, row.chosen, row.label) == ([user("w1")], [assistant(" w5")], True) and row.rejected is row.chosen


def load_rows_of(record: dict, read: RowOptions) -> list[Row]:
    return Record(W, record).rows(read)


def unpaired(n: int, start: int = 0) -> list[dict]:
    return [{"prompt": f"w{10 + i}", "completion": " w5" if i % 2 else " w7", "label": bool(i % 2)}
            for i in range(start, start + n)]


def test_a_dataset_that_mixes_unpaired_rows_and_pairs_is_refused(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", unpaired(3) + [PAIR, PAIR] + unpaired(1, 3))
    with pytest.raises(FastDPOError) as e:
        load_rows([str(f)])
    text = str(e.value)
    assert text.startswith(f"{f}: mixes 4 unpaired rows (one completion with a label; the first at {f}:1) with 2 "
                           f"pairs (the first at {f}:4).")
    assert "--loss_type kto or apo_zero_unpaired" in text and "Give one kind" in text
    with pytest.raises(FastDPOError, match=f"the first at {f}:4"):
        load_file(str(f))


def test_datasets_of_one_run_hold_one_kind(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", unpaired(4))
    b = write_jsonl(tmp_path / "b.jsonl", [PAIR] * 3)
    assert len(load_rows([str(a), str(a)])) == 8
    with pytest.raises(FastDPOError) as e:
        load_rows([str(a), str(b)])
    assert f"datasets {a}, {b}: mixes 4 unpaired rows" in str(e.value)
    assert f"the first at {a}:1" in str(e.value) and f"3 pairs (the first at {b}:1)" in str(e.value)

    class Cfg:
        val_dataset, seed, val_split = [str(b)], 42, "train"

    with pytest.raises(FastDPOError, match="--dataset and --val_dataset: mixes 4 unpaired rows"):
        held_out_rows(Cfg(), load_rows([str(a)]))


def test_a_stream_that_mixes_kinds_is_refused(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", unpaired(3))
    b = write_jsonl(tmp_path / "b.jsonl", [PAIR] * 3)
    stream = PairStream([str(a)], chat_tokenizer(), DataOptions(streaming=True))
    assert len(stream.take(4)) == 4 and stream.stats.formats == {"unpaired": 3}
    stream.close()
    stream = PairStream([str(a), str(b)], chat_tokenizer(), DataOptions(streaming=True))
    with pytest.raises(FastDPOError, match=f"{a}, {b}: mixes 3 unpaired rows .* 3 pairs \\(the first at {b}:1\\)"):
        stream.take(1)


def test_check_row_kinds_counts_and_locates():
    rows = [Row("w1", "w5", "w5", "x:1", label=True), Row("w1", "w5", "w7", "x:2"), Row("w1", "w6", "w6", "x:3",
                                                                                          label=False)]
    kinds = RowKinds.of(rows)
    assert (kinds.unpaired, kinds.pairs, kinds.first_unpaired, kinds.first_pair) == (2, 1, "x:1", "x:2")
    check_row_kinds(rows[:1] + rows[2:], "x")
    with pytest.raises(FastDPOError, match="^x: mixes 2 unpaired rows .*x:1.* with 1 pair \\(the first at x:2\\)"):
        check_row_kinds(rows, "x")


def kto_info(tmp_path) -> tuple[dict, str]:
    """A dataset_info.json dir with a KTO alpaca entry and a KTO sharegpt entry (own columns and tags)."""
    data = tmp_path / "data"
    data.mkdir()
    info = {
        "kto_alpaca": {"file_name": "alpaca.jsonl",
                       "columns": {"prompt": "question", "query": "context", "response": "answer", "kto_tag": "tag"}},
        "kto_chat": {"file_name": "chat.jsonl", "formatting": "sharegpt",
                     "columns": {"messages": "messages", "kto_tag": "kto_tag", "system": "sys"},
                     "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                              "assistant_tag": "assistant"}},
        "kto_defaults": {"file_name": "plain.jsonl", "columns": {"kto_tag": "kto_tag"}},
        "both": {"file_name": "alpaca.jsonl", "ranking": True, "columns": {"kto_tag": "tag"}},
        "sft": {"file_name": "alpaca.jsonl"},
    }
    (data / "dataset_info.json").write_text(json.dumps(info), encoding="utf-8")
    write_jsonl(data / "alpaca.jsonl", [{"question": "w1", "context": "w2", "answer": "w5", "tag": True,
                                         "chosen": "not read"},
                                        {"question": "w3", "answer": "w6", "tag": False}])
    write_jsonl(data / "chat.jsonl", [{"messages": [user("w1"), assistant("w2"), user("w3"), assistant("w5")],
                                       "kto_tag": False, "sys": "w0"}])
    write_jsonl(data / "plain.jsonl", [{"instruction": "w1", "input": "w2", "output": "w5", "kto_tag": True}])
    return info, str(data)


def read_entry(name: str, info: dict, data: str) -> list[Row]:
    r = resolve(name, info, data)
    return load_rows([r.spec], read=RowOptions(datasets=((r.spec, r.read),)))


def test_a_dataset_info_kto_entry_reads_alpaca_rows(tmp_path):
    info, data = kto_info(tmp_path)
    rows = read_entry("kto_alpaca", info, data)
    assert [(r.prompt, r.chosen, r.label, r.format) for r in rows] == [
        ([user("w1\nw2")], [assistant("w5")], True, "llamafactory_kto"),
        ([user("w3")], [assistant("w6")], False, "llamafactory_kto")]
    assert rows[0].source == f"{data}/alpaca.jsonl:1 (dataset kto_alpaca)"
    [row] = read_entry("kto_defaults", info, data)  # instruction, input, output: LLaMA-Factory's default names
    assert (row.prompt, row.chosen, row.label) == ([user("w1\nw2")], [assistant("w5")], True)


def test_a_dataset_info_kto_entry_reads_sharegpt_rows(tmp_path):
    info, data = kto_info(tmp_path)
    [row] = read_entry("kto_chat", info, data)
    assert row.prompt == [SYSTEM, user("w1"), assistant("w2"), user("w3")]
    assert (row.chosen, row.label, row.format) == ([assistant("w5")], False, "llamafactory_kto")


@pytest.mark.parametrize("tag,needle", [
    ("yes", "field 'tag' must be a JSON boolean, got the string \"yes\""),
    (None, "field 'tag' must be a JSON boolean, got null"),
    (1, "field 'tag' must be a JSON boolean, got the number 1"),
])
def test_a_kto_tag_that_is_not_a_boolean_names_the_tag_column(tmp_path, tag, needle):
    info, data = kto_info(tmp_path)
    write_jsonl(tmp_path / "data" / "alpaca.jsonl", [{"question": "w1", "answer": "w5", "tag": True},
                                                     {"question": "w3", "answer": "w6", "tag": tag}])
    with pytest.raises(FastDPOError) as e:
        read_entry("kto_alpaca", info, data)
    assert f"alpaca.jsonl:2 (dataset kto_alpaca): {needle}" in str(e.value) and "Write true" in str(e.value)
    write_jsonl(tmp_path / "data" / "alpaca.jsonl", [{"question": "w1", "answer": "w5"}])
    with pytest.raises(FastDPOError, match="alpaca.jsonl:1 \\(dataset kto_alpaca\\): field 'tag' is missing"):
        read_entry("kto_alpaca", info, data)


def test_dataset_info_entries_without_ranking_or_kto_tag_are_still_refused(tmp_path):
    info, data = kto_info(tmp_path)
    with pytest.raises(FastDPOError, match="dataset sft: ranking is not true"):
        resolve("sft", info, data)
    with pytest.raises(FastDPOError, match="dataset both: ranking is true and its columns name a kto_tag \\('tag'\\)"):
        resolve("both", info, data)


def test_check_data_counts_desirable_and_undesirable_rows(tmp_path, capsys):
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"w{10 + i}", "completion": " w5", "label": i < 6}
                                           for i in range(8)])
    code, out = run_cli(capsys, "check-data", "--dataset", f)
    assert code == 0 and f"{f}: 8 rows (unpaired 8)" in out, out
    assert "unpaired rows: 6 desirable (label true), 2 undesirable (label false), 3.00 desirable per undesirable" in out
    assert "OK: no errors." in out
    g = write_jsonl(tmp_path / "g.jsonl", [{"messages": [user("w1"), assistant("w5")], "label": True}])
    code, out = run_cli(capsys, "check-data", "--dataset", g)
    assert code == 0 and "unpaired rows: 1 desirable (label true), 0 undesirable (label false): no undesirable" in out


def test_check_data_names_bad_labels_and_mixed_kinds(tmp_path, capsys):
    f = write_jsonl(tmp_path / "d.jsonl", unpaired(2) + [{"prompt": "w1", "completion": " w5", "label": "no"}, PAIR])
    code, out = run_cli(capsys, "check-data", "--dataset", f)
    assert code == 1, out
    assert f"{f}:3: field 'label' must be a JSON boolean, got the string \"no\"" in out
    assert f"{f}: mixes 2 unpaired rows (one completion with a label; the first at {f}:1) with 1 pair (the first at " \
           f"{f}:4)" in out
    a, b = write_jsonl(tmp_path / "a.jsonl", unpaired(2)), write_jsonl(tmp_path / "b.jsonl", [PAIR])
    code, out = run_cli(capsys, "check-data", "--dataset", a, b)
    assert code == 1 and f"datasets {a}, {b}: mixes 2 unpaired rows" in out and f"(the first at {b}:1)" in out, out


def test_check_data_reads_a_kto_entry_through_dataset_dir(tmp_path, capsys, monkeypatch):
    _, data = kto_info(tmp_path)
    monkeypatch.chdir(tmp_path)
    code, out = run_cli(capsys, "check-data", "--dataset", "kto_alpaca", "--dataset_dir", "data")
    assert code == 0 and "(llamafactory_kto 2)" in out and "1 desirable (label true), 1 undesirable" in out, out
