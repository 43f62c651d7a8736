"""Every data file reads every row or fails naming the line: JSON in every layout the readers accept, rows over the
size limit refused early (with their size, the limit and the flag), CSV cells of any size, damaged Parquet and
tokenisation caches, and dataset_info file names confined to their dir."""

import errno
import json
import logging
import tracemalloc

import pytest
from cli_helpers import run_cli
from data_helpers import easy_rows, write_jsonl

from fastdpo.config import TrainConfig
from fastdpo.data.columns import RowOptions
from fastdpo.data.dataset_info import resolve
from fastdpo.data.load import load_rows
from fastdpo.data.sources import file_records
from fastdpo.errors import FastDPOError

ROWS = [{"prompt": f"w{i}", "chosen": f" w{i + 20}", "rejected": f" w{i + 40}"} for i in range(5)]
EXPECTED = [(r["prompt"], r["chosen"], r["rejected"]) for r in ROWS]
CONV = {"prompt": [{"role": "user", "content": "w1"}], "chosen": [{"role": "assistant", "content": "w5"}],
        "rejected": [{"role": "assistant", "content": "w7"}]}
COLUMNS = {k: [r[k] for r in ROWS] for k in ROWS[0]}

# every one of these held 5 rows and read fewer, or failed as one bad row
LAYOUTS = {
    "rows under a key": ("d.json", json.dumps({"train": ROWS})),
    "rows under a key, with metadata, indented": ("d.json", json.dumps({"version": 2, "rows": ROWS}, indent=2)),
    "concatenated objects": ("d.json", "".join(json.dumps(r) for r in ROWS)),
    "objects separated by spaces": ("d.jsonl", " ".join(json.dumps(r) for r in ROWS)),
    "two objects on a line": ("d.jsonl", json.dumps(ROWS[0]) + json.dumps(ROWS[1]) + "\n"
                              + "\n".join(json.dumps(r) for r in ROWS[2:])),
    "pretty-printed JSON Lines": ("d.jsonl", "\n".join(json.dumps(r, indent=2) for r in ROWS)),
    "pretty-printed objects in a .json": ("d.json", "\n\n".join(json.dumps(r, indent=4) for r in ROWS)),
    "rows keyed by id": ("d.json", json.dumps({str(i): r for i, r in enumerate(ROWS)}, indent=1)),
    "columns of lists": ("d.json", json.dumps(COLUMNS)),
    "pandas orient=columns": ("d.json", json.dumps({k: {str(i): v for i, v in enumerate(c)} for k, c in COLUMNS.items()})),
    "pandas orient=split": ("d.json", json.dumps({"columns": list(COLUMNS), "index": list(range(5)),
                                                  "data": [list(r.values()) for r in ROWS]})),
    "two arrays": ("d.json", json.dumps(ROWS[:2]) + "\n" + json.dumps(ROWS[2:])),
    "an array, then objects": ("d.json", json.dumps(ROWS[:3]) + "\n" + "\n".join(json.dumps(r) for r in ROWS[3:])),
    "a line of rows per line": ("d.jsonl", "\n".join(json.dumps([r]) for r in ROWS)),
}


@pytest.mark.parametrize("name, text", LAYOUTS.values(), ids=LAYOUTS)
def test_every_json_layout_reads_every_row(tmp_path, name, text):
    f = tmp_path / name
    f.write_text(text, encoding="utf-8")
    rows = load_rows([str(f)])
    assert [(r.prompt, r.chosen, r.rejected) for r in rows] == EXPECTED
    assert len({r.source for r in rows}) == len(rows)  # each row has a location of its own


def test_rows_under_data_are_read_as_before(tmp_path):
    f = tmp_path / "d.json"
    f.write_text(json.dumps({"schema": {"fields": []}, "data": ROWS}))  # pandas orient=table
    assert [(r.prompt, r.chosen, r.rejected) for r in load_rows([str(f)])] == EXPECTED


def test_layouts_that_are_one_row_stay_one_row(tmp_path):
    for i, value in enumerate([ROWS[0], CONV, {**CONV, "tools": [{"type": "function", "function": {"name": "f"}}]}]):
        for indent in (None, 2):
            f = tmp_path / f"one{i}{indent}.json"
            f.write_text(json.dumps(value, indent=indent))
            rows = load_rows([str(f)])
            assert len(rows) == 1 and rows[0].source == f"{f}:1"


def test_pretty_printed_rows_carry_their_first_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps(r, indent=2) for r in ROWS))  # 5 lines per row
    assert [r.source for r in load_rows([str(f)])] == [f"{f}:{1 + 5 * k}" for k in range(5)]


def test_two_lists_of_rows_in_one_object_are_refused_by_name(tmp_path):
    f = tmp_path / "d.json"
    f.write_text(json.dumps({"train": ROWS, "test": ROWS}))
    with pytest.raises(FastDPOError, match="'train', 'test'.*one list of rows per file"):
        load_rows([str(f)])


def test_a_row_cut_short_names_its_line_and_the_rows_after_it_are_read(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps(ROWS[0]) + '\n{"prompt": "w1",\n' + "\n".join(json.dumps(r) for r in ROWS[1:]) + "\n")
    recs = list(file_records(f))
    assert [r.where for r in recs] == [f"{f}:{n}" for n in (1, 2, 3, 4, 5, 6)]
    assert "not closed before line 3" in recs[1].error and all(r.error is None for r in recs[2:])
    g = tmp_path / "e.json"
    g.write_text(json.dumps(ROWS[0], indent=2) + "\n" + json.dumps(ROWS[1], indent=2)[:-1])
    with pytest.raises(FastDPOError, match=f"{g}:6: .*not closed by the end of the file"):
        load_rows([str(g)])


def test_trailing_text_after_an_array_is_an_error_naming_its_line(tmp_path):
    f = tmp_path / "d.json"
    f.write_text(json.dumps(ROWS) + "\noops\n")
    with pytest.raises(FastDPOError, match=f"{f}:2: invalid JSON"):
        load_rows([str(f)])


# ---------------------------------------------------------------- the row size limit

LIMIT = 1 << 20


def small() -> RowOptions:
    return RowOptions(max_row_bytes=LIMIT)


def big_row(mib: int) -> dict:
    return {"prompt": "w1 " * (mib * LIMIT // 3), "chosen": " w5", "rejected": " w7"}


def test_a_line_over_the_limit_is_refused_with_its_size_without_being_held(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(big_row(8)) + "\n" + json.dumps(ROWS[1]) + "\n")
    tracemalloc.start()
    try:
        recs = list(file_records(f, LIMIT))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * LIMIT, peak  # the 8 MiB line was never held whole (pieces of 1 MiB were)
    assert [r.error is None for r in recs] == [True, False, True]
    assert "8 MiB, over the limit of 1 MiB per row" in recs[1].error and "--max_row_mb" in recs[1].error
    with pytest.raises(FastDPOError, match=f"{f}:2: this row is 8 MiB, over the limit of 1 MiB"):
        load_rows([str(f)], read=small())


@pytest.mark.parametrize("layout", ["pretty", "array", "one-line array", "csv", "csv line", "parquet", "columns"])
def test_rows_over_the_limit_are_refused_in_every_layout(tmp_path, layout):
    rows = [ROWS[0], big_row(2), ROWS[1]]
    f = tmp_path / ("d.csv" if layout.startswith("csv") else "d.parquet" if layout == "parquet" else "d.json")
    if layout == "pretty":
        f.write_text("\n".join(json.dumps(r, indent=2) for r in rows))
    elif layout == "array":
        f.write_text("[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]")
    elif layout == "one-line array":
        f.write_text(json.dumps(rows))
    elif layout == "columns":
        f.write_text(json.dumps({k: [r[k] for r in rows] for k in rows[0]}))
    elif layout == "csv":  # the big cell spread over lines
        rows[1]["prompt"] = rows[1]["prompt"].replace(" ", "\n")
        f.write_text("prompt,chosen,rejected\n" + "".join(f'"{r["prompt"]}",{r["chosen"]},{r["rejected"]}\n'
                                                         for r in rows))
    elif layout == "csv line":
        f.write_text("prompt,chosen,rejected\n" + "".join(f'{r["prompt"]},{r["chosen"]},{r["rejected"]}\n'
                                                         for r in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), f)
    with pytest.raises(FastDPOError, match=r"2 MiB, over the limit of 1 MiB per row|over the limit of 1 MiB per row"):
        load_rows([str(f)], read=small())
    assert len(load_rows([str(f)])) == 3  # the default limit (16 MiB) reads it


def test_max_row_mb_sets_the_limit():
    assert RowOptions.from_config(TrainConfig(dataset=["d"], max_row_mb=0.5)).max_row_bytes == 1 << 19
    assert RowOptions.from_config(TrainConfig()).max_row_bytes == 16 << 20
    with pytest.raises(FastDPOError, match="--max_row_mb must be > 0"):
        TrainConfig(dataset=["d"], max_row_mb=0).validate_data()


def test_check_data_names_a_row_over_max_row_mb(tmp_path, capsys, restore_logging):
    f = write_jsonl(tmp_path / "d.jsonl", [ROWS[0], big_row(1), ROWS[1]])
    code, out = run_cli(capsys, "check-data", "--dataset", f, "--max_row_mb", "0.5")
    assert code == 1 and f"{f}:2: this row is 1 MiB, over the limit of 512 KiB per row" in out, out
    assert "FAILED: 1 error." in out and "Traceback" not in out, out


# ---------------------------------------------------------------- CSV


def test_csv_cells_larger_than_pythons_default_limit_are_read(tmp_path):
    f = tmp_path / "d.csv"
    big = "w1 " * 100_000  # 300 KB: csv's own limit is 128 KiB
    f.write_text(f'prompt,chosen,rejected\nw1,w2,w3\n"{big}",w5,w7\nw1,w2,w4\n')
    rows = load_rows([str(f)])
    assert len(rows) == 3 and rows[1].prompt == big and rows[2].source == f"{f}:4"


def test_csv_errors_name_the_line_where_the_record_starts(tmp_path):
    f = tmp_path / "d.csv"
    f.write_text('prompt,chosen,rejected\nw1,w2,w3\n"multi\nline\ntext",w5,w7\nw1,"' + "x" * 300_000 + '",w4\n')
    recs = list(file_records(f, 100_000))
    assert [r.where for r in recs] == [f"{f}:2", f"{f}:3", f"{f}:6"]
    assert "over the limit" in recs[2].error


def test_an_unclosed_quote_in_a_csv_does_not_swallow_the_rows_after_it(tmp_path):
    f = tmp_path / "d.csv"
    f.write_text('prompt,chosen,rejected\nw1,w2,w3\nw1,w2,"w3\nw4,w5,w6\nw7,w8,w9\n')  # the rest of the file in one cell
    with pytest.raises(FastDPOError, match=f"{f}:3: malformed CSV.*lines 3-5"):
        load_rows([str(f)])
    g = tmp_path / "e.csv"
    g.write_text('prompt,chosen,rejected\nw1,w2,"w3\nw4,"w5 w6",w6\nw7,w8,w9\n')
    with pytest.raises(FastDPOError, match=f"{g}:2: malformed CSV"):
        load_rows([str(g)])


# ---------------------------------------------------------------- Parquet


def test_a_damaged_parquet_page_is_a_clear_error_naming_the_file(tmp_path, capsys, restore_logging):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "d.parquet"
    rows = [{"prompt": f"w{i} " + "w9 " * (i % 17), "chosen": " w5" * (1 + i % 5), "rejected": " w7"} for i in range(5000)]
    pq.write_table(pa.Table.from_pylist(rows), f, row_group_size=1000, compression="snappy")
    data = bytearray(f.read_bytes())
    mid = len(data) // 2
    data[mid: mid + 64] = bytes(b ^ 0xFF for b in data[mid: mid + 64])
    f.write_bytes(bytes(data))
    with pytest.raises(FastDPOError, match=f"{f}: .*damaged or incomplete. Download or write it again"):
        load_rows([str(f)])
    code, out = run_cli(capsys, "check-data", "--dataset", f)
    assert code == 1 and str(f) in out and "Traceback" not in out, out


# ---------------------------------------------------------------- the tokenisation cache


@pytest.fixture
def cached(tmp_path, model_dirs):
    from fastdpo.data.prepare import DataOptions, tokenize_pairs
    from fastdpo.model.load import load_tokenizer

    tok = load_tokenizer(str(model_dirs("qwen3")))
    rows = load_rows([str(write_jsonl(tmp_path / "d.jsonl", easy_rows(40)))])
    opts = DataOptions(cache_dir=str(tmp_path / "cache"))
    first, summary = tokenize_pairs(rows, tok, opts)
    assert not summary.cached
    (entry,) = (tmp_path / "cache" / "tokenized").iterdir()
    return lambda: tokenize_pairs(rows, tok, opts), first, entry


@pytest.mark.parametrize("damage", ["pairs cut short", "pairs emptied", "stats cut short", "stats of another entry"])
def test_a_damaged_tokenisation_cache_is_rebuilt_with_a_warning(cached, caplog, damage):
    again, first, entry = cached
    if damage == "pairs cut short":
        data = (entry / "pairs.npz").read_bytes()
        (entry / "pairs.npz").write_bytes(data[: len(data) // 2])
    elif damage == "pairs emptied":
        (entry / "pairs.npz").write_bytes(b"")
    elif damage == "stats cut short":
        (entry / "stats.json").write_text((entry / "stats.json").read_text()[:10])
    else:
        stats = json.loads((entry / "stats.json").read_text())
        (entry / "stats.json").write_text(json.dumps({**stats, "pairs": stats["pairs"] + 1}))
    with caplog.at_level(logging.WARNING, logger="fastdpo"):
        pairs, summary = again()
    assert pairs == first and not summary.cached
    assert "cannot be read" in caplog.text and str(entry) in caplog.text and "tokenising again" in caplog.text
    pairs, summary = again()  # written again whole
    assert pairs == first and summary.cached


def test_a_full_disk_while_writing_the_tokenisation_cache_is_a_warning(cached, caplog, monkeypatch):
    import numpy as np

    again, first, entry = cached
    for f in entry.iterdir():
        f.unlink()
    entry.rmdir()

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np, "savez", full)
    with caplog.at_level(logging.WARNING, logger="fastdpo"):
        pairs, _ = again()
    assert pairs == first
    assert "No space left on device" in caplog.text and "going on without it" in caplog.text
    assert not any(entry.parent.iterdir())  # no half-written entry left


def test_a_full_disk_while_writing_the_reference_cache_is_a_warning(tmp_path, caplog, monkeypatch):
    from pathlib import Path

    import torch

    from fastdpo.dpo.refcache import RefTable, save_table

    def full(self, data):
        with open(self, "wb") as f:
            f.write(data[:10])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full)
    table = RefTable(torch.arange(3), torch.zeros(3, 4), "cpu")
    with caplog.at_level(logging.WARNING, logger="fastdpo"):
        save_table(tmp_path / "ref" / "k.safetensors", table, {})
    assert "No space left on device" in caplog.text and "going on without it" in caplog.text
    assert list((tmp_path / "ref").iterdir()) == []  # the partial file is removed


# ---------------------------------------------------------------- dataset_info


@pytest.mark.parametrize("file_name", ["../outside.jsonl", "sub/../../outside.jsonl", "/etc/passwd", "OUTSIDE"])
def test_dataset_info_file_names_stay_under_their_dir(tmp_path, file_name):
    d = tmp_path / "data"
    (d / "sub").mkdir(parents=True)
    outside = write_jsonl(tmp_path / "outside.jsonl", ROWS)
    file_name = str(outside) if file_name == "OUTSIDE" else file_name
    with pytest.raises(FastDPOError, match="points outside dataset_dir.*only name files under its own dir"):
        resolve("x", {"x": {"file_name": file_name, "ranking": True}}, str(d))
    write_jsonl(d / "sub" / "in.jsonl", ROWS)
    for inside in ("sub/in.jsonl", "./sub/in.jsonl", "sub/../sub/in.jsonl"):
        assert resolve("x", {"x": {"file_name": inside, "ranking": True}}, str(d)).spec == str(d / inside)
