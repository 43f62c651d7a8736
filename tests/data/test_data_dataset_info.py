"""LLaMA-Factory's dataset_dir/dataset_info.json: names resolve to data files read with each entry's own columns,
formatting and sharegpt tags; entries fastdpo cannot honour are refused by name; num_samples samples; the reading is
part of the tokenisation cache key; a config in LLaMA-Factory's form checks and trains."""

import json
import logging

import pytest
import yaml
from cli_helpers import run_cli
from data_helpers import assistant, chat_tokenizer, easy_rows, user, write_jsonl

from fastdpo.cli import build_parser
from fastdpo.config import TrainConfig, build_config
from fastdpo.data.cache import data_key
from fastdpo.data.columns import RowOptions
from fastdpo.data.dataset_info import DatasetRead
from fastdpo.data.load import load_rows
from fastdpo.data.prepare import DataOptions, load_pairs
from fastdpo.data.tokenize import TokenizeOptions
from fastdpo.errors import FastDPOError

INFO = {
    "my_alpaca": {"file_name": "alpaca.jsonl", "ranking": True,
                  "columns": {"prompt": "question", "query": "context", "chosen": "good", "rejected": "bad",
                              "system": "sys", "history": "past"}},
    "my_chat": {"file_name": "chat", "ranking": True, "formatting": "sharegpt",
                "columns": {"messages": "messages", "chosen": "better", "rejected": "worse"},
                "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                         "assistant_tag": "assistant"}},
    "sft_data": {"file_name": "alpaca.jsonl"},
    "clips": {"file_name": "alpaca.jsonl", "ranking": True, "columns": {"prompt": "question", "videos": "vids"}},
    "modelscope": {"ms_hub_url": "org/prefs", "ranking": True},
    "hub": {"hf_hub_url": "org/prefs", "ms_hub_url": "org/ms", "subset": "en", "split": "test", "ranking": True},
    "hub_train": {"hf_hub_url": "org/other", "ranking": True, "formatting": "sharegpt"},
    "misspelt": {"file_name": "alpaca.jsonl", "ranking": True, "colums": {"prompt": "question"}},
    "moved": {"file_name": "gone.jsonl", "ranking": True},
}


def alpaca_rows(n: int) -> list[dict]:
    return [{"question": r["prompt"], "context": "w1", "good": r["chosen"], "bad": r["rejected"], "sys": "w2",
             "past": [["w3", "w4"]], "prompt": "not read", "messages": "not read"} for r in easy_rows(n, seed=1)]


def chat_rows(n: int) -> list[dict]:
    return [{"messages": [{"role": "system", "content": "w9"}, {"role": "user", "content": r["prompt"]}],
             "better": {"role": "assistant", "content": r["chosen"]},
             "worse": {"role": "assistant", "content": r["rejected"]}} for r in easy_rows(n, seed=2)]


@pytest.fixture
def lf(tmp_path, monkeypatch):
    """A LLaMA-Factory project dir: data/dataset_info.json, an alpaca file and a sharegpt directory; cwd there."""
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "data"
    (data / "chat").mkdir(parents=True)
    (data / "dataset_info.json").write_text(json.dumps(INFO), encoding="utf-8")
    write_jsonl(data / "alpaca.jsonl", alpaca_rows(16))
    write_jsonl(data / "chat" / "part-0.jsonl", chat_rows(16))
    return tmp_path


def lf_yaml(**keys) -> dict:
    """examples/train_lora/llama3_lora_dpo.yaml with its datasets named through dataset_dir."""
    return {"model_name_or_path": "m", "trust_remote_code": True, "stage": "dpo", "do_train": True,
            "finetuning_type": "lora", "lora_rank": 8, "lora_target": "all", "pref_beta": 0.1, "pref_loss": "sigmoid",
            "dataset": "my_alpaca,my_chat", "dataset_dir": "data", "template": "identity", "cutoff_len": 64,
            "overwrite_cache": True, "output_dir": "saves", "logging_steps": 1, "per_device_train_batch_size": 8,
            "gradient_accumulation_steps": 1, "learning_rate": 5.0e-3, "num_train_epochs": 1.0, **keys}


def config(path, data: dict) -> TrainConfig:
    y = path / "dpo.yaml"
    y.write_text(yaml.safe_dump(data), encoding="utf-8")
    return build_config(build_parser().parse_args(["train", "--config", str(y)]), TrainConfig)


def test_names_resolve_to_files_read_with_their_own_columns_and_tags(lf):
    cfg = config(lf, lf_yaml(eval_dataset="my_chat"))
    cfg.validate_data()
    assert cfg.dataset == ["data/alpaca.jsonl", "data/chat"] and cfg.val_dataset == ["data/chat"]
    rows = load_rows(cfg.dataset, read=RowOptions.from_config(cfg))
    first = easy_rows(1, seed=1)[0]
    assert rows[0].format == "alpaca" and rows[0].prompt == [
        {"role": "system", "content": "w2"}, user("w3"), assistant("w4"), user(f"{first['prompt']}\nw1")]
    assert rows[0].chosen == [assistant(first["chosen"])] and rows[0].source == "data/alpaca.jsonl:1 (dataset my_alpaca)"
    chat = easy_rows(1, seed=2)[0]
    assert rows[16].format == "sharegpt" and rows[16].prompt == [{"role": "system", "content": "w9"},
                                                               user(chat["prompt"])]
    assert (rows[16].chosen, rows[16].rejected) == ([assistant(chat["chosen"])], [assistant(chat["rejected"])])
    assert len(rows) == 32


def test_hub_entries_name_the_dataset_subset_and_split(lf):
    cfg = config(lf, lf_yaml(dataset="hub", eval_dataset="hub_train"))
    assert (cfg.dataset, cfg.split, cfg.val_dataset, cfg.val_split) == (["org/prefs:en"], "test", ["org/other"], "train")
    assert cfg.dataset_info["org/other"]["columns"] == {"chosen": "chosen", "conversations": "conversations",
                                                        "rejected": "rejected"}


@pytest.mark.parametrize("keys,needle", [
    ({"dataset": "sft_data"}, "dataset sft_data: ranking is not true .* so it is not preference data"),
    ({"dataset": "my_chta"}, "dataset my_chta: not in data/dataset_info.json. Did you mean my_chat"),
    ({"dataset": "clips"}, "dataset clips: columns.videos \\(vids\\): fastdpo reads text and images; videos are not read"),
    ({"dataset": "modelscope"}, "dataset modelscope: ms_hub_url names a ModelScope dataset"),
    ({"dataset_dir": "nowhere"}, "dataset_dir nowhere: no dataset_info.json there"),
    ({"dataset": "data/alpaca.jsonl"}, "data/alpaca.jsonl is a file, but with dataset_dir every dataset is a name"),
    ({"dataset": "hub,hub_train"}, "their hub datasets read different splits \\(test, train\\)"),
    ({"eval_dataset": "my_alpaca", "val_size": 0.1}, "Give --val_dataset or --split_dataset_ratio, not both"),
    ({"dataset": "misspelt"}, "dataset misspelt: 'colums' in its dataset_info.json entry .* Did you mean columns"),
    ({"dataset": "moved"}, "dataset moved: its file_name 'gone.jsonl' is not in data .* Fix file_name in "
                           "data/dataset_info.json"),
])
def test_refusals_name_the_entry(lf, keys, needle):
    with pytest.raises(FastDPOError, match=needle):
        config(lf, lf_yaml(**keys)).validate()


def test_a_row_that_does_not_fit_its_entry_names_entry_and_location(lf):
    write_jsonl(lf / "data" / "alpaca.jsonl", [{"question": "w1", "good": "w2"}])
    read = RowOptions.from_config(config(lf, lf_yaml()))
    with pytest.raises(FastDPOError, match="alpaca.jsonl:1 \\(dataset my_alpaca\\): field 'bad' is missing .* "
                                           "dataset 'my_alpaca' reads its rejected from it"):
        load_rows(["data/alpaca.jsonl"], read=read)
    rows = chat_rows(1)
    rows[0]["messages"][1]["role"] = "human"  # the default tag, not this entry's
    write_jsonl(lf / "data" / "chat" / "part-0.jsonl", rows)
    with pytest.raises(FastDPOError, match="part-0.jsonl:1 \\(dataset my_chat\\): field 'conversations\\[1\\].role' is "
                                           "'human', not a role tag of dataset 'my_chat' \\(user, assistant, "):
        load_rows(["data/chat"], read=read)


def test_formatting_decides_how_rows_are_read(lf):
    """An alpaca entry reads its named columns only: a `conversations` column does not make the row sharegpt."""
    write_jsonl(lf / "data" / "alpaca.jsonl", [{**alpaca_rows(1)[0], "conversations": [{"from": "human", "value": "x"}]}])
    rows = load_rows(["data/alpaca.jsonl"], read=RowOptions.from_config(config(lf, lf_yaml())))
    assert rows[0].format == "alpaca"


def test_num_samples_samples_that_many_rows(lf, caplog):
    caplog.set_level(logging.INFO, logger="fastdpo")
    info = json.loads((lf / "data" / "dataset_info.json").read_text())
    info["my_alpaca"]["num_samples"] = 5
    (lf / "data" / "dataset_info.json").write_text(json.dumps(info))
    cfg = config(lf, lf_yaml(dataset="my_alpaca"))
    assert cfg.dataset == ["data/alpaca.jsonl#5"] and set(cfg.dataset_info) == {"data/alpaca.jsonl#5"}
    rows = load_rows(cfg.dataset, cfg.seed, read=RowOptions.from_config(cfg))
    assert len(rows) == 5 and len({r.source for r in rows}) == 5 and all(r.format == "alpaca" for r in rows)
    assert "num_samples 5 samples 5 rows at random with --seed" in caplog.text


def test_the_reading_is_part_of_the_cache_key(lf, tmp_path):
    """Swapping an entry's chosen and rejected columns must not reuse the pairs cached under the old mapping."""
    tok = chat_tokenizer()
    got = []
    for good, bad in (("good", "bad"), ("bad", "good")):
        info = json.loads((lf / "data" / "dataset_info.json").read_text())
        info["my_alpaca"]["columns"].update(chosen=good, rejected=bad)
        (lf / "data" / "dataset_info.json").write_text(json.dumps(info))
        cfg = config(lf, lf_yaml(dataset="my_alpaca"))
        opts = DataOptions(TokenizeOptions(max_length=64), cache_dir=str(tmp_path / "cache"),
                           read=RowOptions.from_config(cfg))
        got.append(load_pairs(cfg.dataset, tok, opts)[0])
    assert got[0][0].chosen == got[1][0].rejected and got[0][0].chosen != got[1][0].chosen
    one = DatasetRead("a", columns=(("q", "instruction"),))
    keys = {data_key([], tok, TokenizeOptions(), RowOptions(datasets=(("d", r),)))
            for r in (one, DatasetRead("a", columns=(("q2", "instruction"),)), DatasetRead("a", "sharegpt"))}
    assert len(keys) == 3


def test_check_data_and_training_from_a_llamafactory_config(lf, model_dirs, one_thread, capsys, restore_logging):
    y = lf / "dpo.yaml"
    y.write_text(yaml.safe_dump(lf_yaml(model_name_or_path=str(model_dirs()), eval_dataset="my_chat", lora_rank=4,
                                        max_steps=4, device="cpu", disable_progress=True)), encoding="utf-8")
    code, out = run_cli(capsys, "check-data", "--config", y)
    assert code == 0 and "data/alpaca.jsonl" in out and "data/chat" in out, out
    code, out = run_cli(capsys, "train", "--config", y)
    assert code == 0, out
    saved = yaml.safe_load((lf / "saves" / "config.yaml").read_text(encoding="utf-8"))
    assert saved["dataset"] == ["data/alpaca.jsonl", "data/chat"] and saved["dataset_info"]["data/chat"]["name"] == "my_chat"
    summary = json.loads((lf / "saves" / "data_summary.json").read_text())
    assert summary["formats"] == {"alpaca": 16, "sharegpt": 16}
    losses = [json.loads(line)["loss"] for line in (lf / "saves" / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert len(losses) == 4 and losses[-1] < losses[0], losses


def test_eval_reads_names_through_dataset_dir_as_training_does(lf, model_dirs, monkeypatch, capsys):
    """`fastdpo eval --dataset my_chat --dataset_dir data` scores the rows training held out under eval_dataset
    my_chat, read with that entry's own columns and tags; the resolved reading can also be passed as --dataset_info
    (what a run's config.yaml holds). Unknown names and a conflicting --split are refused with the fix."""
    from fastdpo.commands.evaluate import EvalConfig, run_eval
    from fastdpo.data import prepare

    train_cfg = config(lf, lf_yaml(eval_dataset="my_chat"))
    train_cfg.validate_data()
    held_out = load_rows(train_cfg.val_dataset, train_cfg.seed, train_cfg.val_split,
                         read=RowOptions.from_config(train_cfg))
    seen = []

    def capture(rows, *args):
        seen.append(rows)
        raise SystemExit

    monkeypatch.setattr(prepare, "tokenize_pairs", capture)
    model = str(model_dirs())
    for flags in (["--dataset", "my_chat", "--dataset_dir", "data"],
                  ["--dataset", "data/chat", "--dataset_info", json.dumps({"data/chat": train_cfg.dataset_info["data/chat"]})]):
        args = build_parser().parse_args(["eval", "--model", model, "--output_dir", str(lf / "e"), *flags])
        with pytest.raises(SystemExit):
            run_eval(build_config(args, EvalConfig))
    assert len(seen) == 2 and seen[0] == held_out and seen[1] == held_out and len(held_out) == 16
    assert held_out[0].format == "sharegpt"

    with pytest.raises(FastDPOError, match="which --dataset does not name"):  # a training config's whole reading
        EvalConfig(model=model, dataset=["data/chat"], dataset_info=train_cfg.dataset_info).validate()
    code = run_cli(capsys, "eval", "--model", model, "--dataset", "my_chatt", "--dataset_dir", "data")
    assert code[0] == 1 and "dataset my_chatt: not in data/dataset_info.json. Did you mean my_chat" in code[1]
    with pytest.raises(FastDPOError, match="read split test"):
        EvalConfig(model=model, dataset=["hub"], dataset_dir="data", split="validation").validate()
    cfg = EvalConfig(model=model, dataset=["hub"], dataset_dir="data")
    cfg.validate()
    cfg.validate()  # the names are resolved once
    assert (cfg.dataset, cfg.split) == (["org/prefs:en"], "test")
