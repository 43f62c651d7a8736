"""Every source kind loads the same rows; locations are exact; `#N` sampling and mixing follow ms-swift."""

import json

import pytest
from data_helpers import assistant, user, write_jsonl

from fastdpo.data.load import load_rows
from fastdpo.data.sources import iter_records, parse_spec
from fastdpo.errors import FastDPOError

ROWS = [{"prompt": f"w{i}", "chosen": f" w{i + 20}", "rejected": f" w{i + 40}"} for i in range(6)]
CONV = {"prompt": [user("w1")], "chosen": [assistant("w5")], "rejected": [assistant("w7")]}


def texts(rows):
    return [(r.prompt, r.chosen, r.rejected) for r in rows]


EXPECTED = [(r["prompt"], r["chosen"], r["rejected"]) for r in ROWS]


def test_jsonl_with_bom_crlf_and_blank_lines(tmp_path):
    body = "\r\n".join(json.dumps(r) for r in ROWS[:3]) + "\r\n\r\n" + "\r\n".join(json.dumps(r) for r in ROWS[3:])
    f = tmp_path / "d.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + body.encode())
    rows = load_rows([str(f)])
    assert texts(rows) == EXPECTED
    assert [r.source for r in rows] == [f"{f}:{n}" for n in (1, 2, 3, 5, 6, 7)]


def test_json_array_rows_carry_their_line(tmp_path):
    f = tmp_path / "d.json"
    f.write_text("[\n" + ",\n".join(json.dumps(r, indent=1) for r in ROWS) + "\n]\n", encoding="utf-8-sig")
    rows = load_rows([str(f)])
    assert texts(rows) == EXPECTED
    assert rows[1].source == f"{f}:7"  # each indented object takes 5 lines, after the '[' line


def test_rows_sharing_a_line_of_a_json_array_carry_their_index(tmp_path):
    """A one-line array (json.dump's default) locates each row by its index too, so a bad row can be found; rows alone
    on their line keep the bare line."""
    f = tmp_path / "one.json"
    f.write_text(json.dumps(ROWS), encoding="utf-8")
    assert [r.source for r in load_rows([str(f)])] == [f"{f}:1 index {k}" for k in range(len(ROWS))]
    g = tmp_path / "mixed.json"
    g.write_text(f"[{json.dumps(ROWS[0])},\n{json.dumps(ROWS[1])}, {json.dumps(ROWS[2])},\n{json.dumps(ROWS[3])}]")
    assert [r.source for r in load_rows([str(g)])] == [f"{g}:1", f"{g}:2 index 1", f"{g}:2 index 2", f"{g}:3"]
    bad = [dict(r) for r in ROWS]
    del bad[2]["chosen"]
    f.write_text(json.dumps(bad), encoding="utf-8")
    with pytest.raises(FastDPOError, match=f"{f}:1 index 2"):
        load_rows([str(f)])


def test_json_object_with_data_list_and_json_lines_in_a_json_file(tmp_path):
    a = tmp_path / "a.json"
    a.write_text(json.dumps({"data": ROWS}))
    b = tmp_path / "b.json"
    b.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert texts(load_rows([str(a)])) == EXPECTED == texts(load_rows([str(b)]))
    assert load_rows([str(a)])[2].source == f"{a} index 2"


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), f)
    rows = load_rows([str(f)])
    assert texts(rows) == EXPECTED and rows[4].source == f"{f} index 4"


def test_parquet_with_conversations_and_null_struct_fields(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    other = {"prompt": [user("w2")], "chosen": [{"role": "assistant", "content": "w6", "name": "bot"}],
             "rejected": [assistant("w8")]}
    f = tmp_path / "c.parquet"
    pq.write_table(pa.Table.from_pylist([CONV, other]), f)  # arrow adds "name": None to every other message
    rows = load_rows([str(f)])
    assert rows[0].chosen == [assistant("w5")] and rows[1].chosen[0]["name"] == "bot"


def test_csv_with_quoted_cells_and_a_conversational_row(tmp_path):
    import csv

    f = tmp_path / "d.csv"
    with open(f, "w", newline="", encoding="utf-8-sig") as fh:
        w = csv.DictWriter(fh, ["prompt", "chosen", "rejected"])
        w.writeheader()
        w.writerow({"prompt": "w1, w2\nw3", "chosen": " w5", "rejected": " w7"})  # a cell spanning two lines
        w.writerow({k: json.dumps(v) for k, v in CONV.items()})
    rows = load_rows([str(f)])
    assert texts(rows)[0] == ("w1, w2\nw3", " w5", " w7")
    assert rows[1].conversational and rows[1].prompt == [user("w1")]
    assert [r.source for r in rows] == [f"{f}:2", f"{f}:4"]


def test_directory_of_mixed_files_in_sorted_order(tmp_path):
    d = tmp_path / "dir"
    (d / "sub").mkdir(parents=True)
    write_jsonl(d / "b.jsonl", ROWS[2:4])
    write_jsonl(d / "a.jsonl", ROWS[:2])
    (d / "sub" / "c.json").write_text(json.dumps(ROWS[4:]))
    (d / "notes.txt").write_text("ignored")
    for hidden in (".ipynb_checkpoints/a-checkpoint.jsonl", ".b.jsonl", "__pycache__/x.jsonl", "sub/.old/c.json"):
        (d / hidden).parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(d / hidden, ROWS[:1])  # a notebook's or an editor's copies: not data
    assert texts(load_rows([str(d)])) == EXPECTED


def test_saved_dataset_dir_and_split(tmp_path):
    import datasets

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                               "test": datasets.Dataset.from_list(ROWS[:2])})
    dd.save_to_disk(str(tmp_path / "saved"))
    assert texts(load_rows([str(tmp_path / "saved")])) == EXPECTED
    assert texts(load_rows([str(tmp_path / "saved")], split="test")) == EXPECTED[:2]
    with pytest.raises(FastDPOError, match="no split 'dev'"):
        load_rows([str(tmp_path / "saved")], split="dev")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
    rows = load_rows([str(tmp_path / "one")])
    assert texts(rows) == EXPECTED and rows[3].source == f"{tmp_path / 'one'}[train] index 3"


def test_hf_dataset_repo_with_subsets_and_splits(tmp_path):
    """`name:subset` and --split through `datasets.load_dataset` (a local dataset repo: no network)."""
    repo = tmp_path / "repo"
    (repo / "easy").mkdir(parents=True)
    (repo / "hard").mkdir()
    write_jsonl(repo / "easy" / "train.jsonl", ROWS[:3])
    write_jsonl(repo / "easy" / "test.jsonl", ROWS[3:4])
    write_jsonl(repo / "hard" / "train.jsonl", ROWS[4:])
    (repo / "README.md").write_text(
        "---\nconfigs:\n- config_name: easy\n  data_files:\n  - split: train\n    path: easy/train.jsonl\n"
        "  - split: test\n    path: easy/test.jsonl\n- config_name: hard\n  data_files:\n  - split: train\n"
        "    path: hard/train.jsonl\n---\n")
    assert texts(load_rows([f"{repo}:easy"])) == EXPECTED[:3]
    assert texts(load_rows([f"{repo}:easy"], split="test")) == EXPECTED[3:4]
    rows = load_rows([f"{repo}:hard#1"])
    assert texts(rows)[0] in EXPECTED[4:] and rows[0].source.startswith(f"{repo}:hard[train] index")


def test_sampling_without_replacement_and_repeats_beyond_the_size(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", ROWS)
    some = texts(load_rows([f"{f}#4"], seed=1))
    assert len(some) == 4 and len(set(some)) == 4 and set(some) <= set(EXPECTED)
    assert some == texts(load_rows([f"{f}#4"], seed=1))  # seeded
    many = texts(load_rows([f"{f}#15"], seed=1))
    counts = {t: many.count(t) for t in EXPECTED}
    assert len(many) == 15 and sorted(counts.values()) == [2, 2, 2, 3, 3, 3]  # two whole copies + 3 sampled


def test_mixing_datasets_keeps_each_share(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", ROWS[:3])
    b = write_jsonl(tmp_path / "b.jsonl", ROWS[3:])
    rows = load_rows([str(a), f"{b}#5"])
    assert texts(rows)[:3] == EXPECTED[:3]
    assert len(rows) == 8 and all(r.source.startswith(str(b)) for r in rows[3:])


def test_spec_parsing():
    s = parse_spec("org/name:subset#500")
    assert (s.name, s.subset, s.count) == ("org/name", "subset", 500)
    with pytest.raises(FastDPOError, match="positive row count"):
        parse_spec("d.jsonl#0")


def test_unreadable_rows_are_reported_and_reading_goes_on(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_bytes(b'{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "\xff"}\n{oops\n'
                  b'{"prompt": "a", "chosen": "b", "rejected": "d"}\n')
    recs = list(iter_records(parse_spec(str(f))))
    assert [r.where for r in recs] == [f"{f}:{n}" for n in (1, 2, 3, 4)]
    assert "UTF-8" in recs[1].error and "invalid JSON" in recs[2].error and recs[3].error is None


def test_missing_sources(tmp_path):
    with pytest.raises(FastDPOError, match="not found"):
        load_rows([str(tmp_path / "nope.jsonl")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FastDPOError, match="holds no"):
        load_rows([str(tmp_path / "empty")])
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(FastDPOError, match="no rows"):
        load_rows([str(tmp_path / "e.jsonl")])
