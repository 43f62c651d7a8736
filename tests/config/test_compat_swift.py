"""A command with ms-swift's flags means what it meant in ms-swift: its defaults for what it leaves out (SimPO's beta
2 and gamma 1 with its NLL term, LoRA, learning rate, epochs, schedule, step size), plain-text rows read through the
chat template, all listed once in one block; an explicit flag always wins."""

import logging

import pytest
from data_helpers import write_jsonl

from fastdpo.cli import build_parser
from fastdpo.config import TrainConfig, build_config


def parse(*flags, env=None):
    return build_config(build_parser().parse_args(["train", "--model", "m", "--dataset", "d.jsonl", *flags]),
                        TrainConfig)


@pytest.fixture(autouse=True)
def one_process(monkeypatch):
    for name in ("WORLD_SIZE", "NPROC_PER_NODE", "NNODES"):
        monkeypatch.delenv(name, raising=False)


def test_swift_simpo_takes_swift_defaults(caplog):
    caplog.set_level(logging.INFO, logger="fastdpo")
    cfg = parse("--rlhf_type", "simpo")
    assert (cfg.loss_type, cfg.beta, cfg.simpo_gamma, cfg.rpo_alpha) == ("simpo", 2.0, 1.0, 1.0)
    assert (cfg.train_type, cfg.learning_rate, cfg.num_train_epochs) == ("lora", 1e-4, 3.0)
    assert (cfg.lr_scheduler_type, cfg.weight_decay, cfg.adam_beta2) == ("cosine", 0.1, 0.95)
    assert cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps == 16
    assert cfg.apply_chat_template is True
    block = [r.getMessage() for r in caplog.records if "ms-swift's meaning" in r.getMessage()]
    assert len(block) == 1 and block[0].count("\n") >= 5, caplog.text
    for needle in ("--beta 2.0", "--simpo_gamma 1.0", "--rpo_alpha 1.0 (ms-swift's SimPO adds --cpo_alpha 1",
                   "--train_type lora", "--learning_rate 0.0001", "--apply_chat_template true"):
        assert needle in block[0]


def test_explicit_flags_win():
    cfg = parse("--rlhf_type", "simpo", "--beta", "2.5", "--simpo_gamma", "0.3", "--cpo_alpha", "0",
                "--train_type", "full", "--learning_rate", "3e-7", "--max_steps", "10",
                "--per_device_train_batch_size", "2", "--apply_chat_template", "false")
    assert (cfg.beta, cfg.simpo_gamma, cfg.rpo_alpha, cfg.train_type) == (2.5, 0.3, 0.0, "full")
    assert (cfg.learning_rate, cfg.num_train_epochs, cfg.apply_chat_template) == (3e-7, 1.0, False)
    assert (cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps) == (2, 8)  # ms-swift: ceil(16 / 2)
    assert parse("--rlhf_type", "dpo", "--train_type", "full").learning_rate == 1e-5
    assert parse("--rlhf_type", "orpo", "--beta", "0.25").orpo_alpha == 0.25  # ms-swift's beta is ORPO's lambda
    assert parse("--rlhf_type", "dpo", "--input_template", "Q: {}\nA:").apply_chat_template is False


def test_step_size_follows_the_world_size(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    cfg = parse("--rlhf_type", "dpo")
    assert (cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps) == (2, 1)  # 16 pairs, as ms-swift's


def test_lora_flags_of_a_swift_script_need_no_train_type():
    """ms-swift scripts leave out --train_type (lora is its default): with --rlhf_type that is what they train."""
    cfg = parse("--rlhf_type", "dpo", "--lora_rank", "16")
    assert (cfg.train_type, cfg.lora_rank) == ("lora", 16)


def test_hf_flags_alone_keep_fastdpo_defaults():
    cfg = parse("--bf16", "true", "--save_strategy", "no")
    assert (cfg.train_type, cfg.learning_rate, cfg.beta, cfg.apply_chat_template) == ("full", 5e-7, 0.1, False)


def test_seed_rows_are_read_through_the_chat_template(tmp_path):
    """Seed-format rows (prompt/chosen/rejected text) under ms-swift's flags: the prompt is a user turn, as ms-swift
    renders it."""
    from data_helpers import tokenizer_dir

    from fastdpo.data.load import load_rows
    from fastdpo.data.prepare import DataOptions, tokenize_pairs

    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "w1 w2", "chosen": "w5", "rejected": "w7"}])
    tok = tokenizer_dir(tmp_path / "tok")
    cfg = build_config(build_parser().parse_args(["train", "--model", str(tok), "--dataset", str(data),
                                                  "--rlhf_type", "dpo"]), TrainConfig)
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tok)
    opts = DataOptions.from_config(cfg)
    pairs, _ = tokenize_pairs(load_rows(cfg.dataset, read=opts.read), t, opts)
    assert t.decode(pairs[0].prompt).startswith("<|im_start|> user w1 w2 <|im_end|>")


def test_without_a_chat_template_the_error_names_the_plain_reading(tmp_path):
    from data_helpers import chat_tokenizer

    from fastdpo.data.columns import RowOptions
    from fastdpo.data.formats import RowError, to_row
    from fastdpo.data.tokenize import TokenizeOptions, tokenize_rows

    row = RowOptions(apply_chat_template=True).adapt(to_row({"prompt": "w1", "chosen": "w5", "rejected": "w7"}, "d:1"))
    with pytest.raises(RowError, match="no chat_template. Pass --template .* --apply_chat_template false"):
        tokenize_rows(chat_tokenizer(None), [row], options=TokenizeOptions())


def test_step_size_counts_data_parallel_ranks_under_sequence_parallelism(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    cfg = parse("--rlhf_type", "dpo", "--ulysses_num_heads", "4")  # 2 data-parallel groups of 4 ranks
    assert cfg.sequence_parallel_size == 4
    assert cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * 2 == 16
