"""Flags of ms-swift / HF TrainingArguments scripts (seed 002): accepted and mapped, accepted with a note, or refused
with a message that says what to do; the same in YAML; --shuffle false keeps the dataset order."""

import logging

import pytest
import yaml
from conftest import run_cli

from fastdpo.cli import build_parser
from fastdpo.config import TrainConfig, build_config
from fastdpo.data.pack import step_order
from fastdpo.errors import FastDPOError


def parse(*flags):
    return build_config(build_parser().parse_args(["train", "--model", "m", "--dataset", "d.jsonl", *flags]),
                        TrainConfig)


def test_seed_002_script_flags_are_accepted(caplog):
    caplog.set_level(logging.INFO, logger="fastdpo")
    cfg = parse("--rlhf_type", "dpo", "--model_type", "qwen3", "--train_type", "full", "--attn_impl", "flash_attn",
                "--flash_attn_version", "2.6.3", "--padding_free", "true", "--deepspeed", "zero3",
                "--zero3_save_16bit_model", "true", "--offload_optimizer", "false", "--offload_param", "false",
                "--shuffle", "true", "--seed", "42", "--bf16", "true", "--save_strategy", "no",
                "--eval_strategy", "no", "--ulysses_num_heads", "1", "--use_liger_kernel", "true")
    assert cfg.loss_type == "sigmoid" and cfg.torch_dtype == "bfloat16" and cfg.save_steps == 0
    assert cfg.eval_steps == 0 and cfg.shuffle is True and cfg.deepspeed == "zero3"
    notes = caplog.text
    assert "--flash_attn_version 2.6.3: ignored" in notes and "--zero3_save_16bit_model true: ignored" in notes
    assert "--use_liger_kernel true: ignored" in notes


def test_rlhf_type_selects_the_loss():
    assert parse("--rlhf_type", "simpo").loss_type == "simpo"
    assert parse("--rlhf_type", "orpo", "--loss_type", "orpo").loss_type == "orpo"
    with pytest.raises(FastDPOError, match="--rlhf_type simpo and --loss_type ipo disagree"):
        parse("--rlhf_type", "simpo", "--loss_type", "ipo")
    with pytest.raises(FastDPOError, match="KTO, reward models, PPO and GRPO"):
        parse("--rlhf_type", "kto")


@pytest.mark.parametrize("flags,needle", [
    (("--ulysses_num_heads", "8"), "--ulysses_num_heads 8: sequence parallelism is not available"),
    (("--ring_attn", "true"), "--ring_attn true: sequence parallelism"),
    (("--sequence_parallel_size", "2"), "--sequence_parallel_size 2"),
    (("--offload_optimizer", "true"), "--offload_optimizer true: DeepSpeed's CPU offload is not available"),
    (("--offload_param", "cpu"), "--deepspeed zero3 \\(FSDP2 sharding\\)"),
    (("--quant_method", "awq"), "--quant_method awq: QLoRA quantises the base with bitsandbytes"),
    (("--optim", "adafactor"), "--optim adafactor: fastdpo trains with AdamW"),
    (("--save_strategy", "best"), "choose steps, epoch or no"),
    (("--fp16", "true", "--torch_dtype", "bfloat16"), "--fp16 true and --torch_dtype bfloat16 disagree"),
])
def test_what_cannot_be_honoured_is_refused(flags, needle):
    with pytest.raises(FastDPOError, match=needle):
        parse(*flags)


def test_refusal_is_one_clean_line_from_the_cli(capsys):
    rc, out = run_cli(capsys, "train", "--model", "m", "--dataset", "d.jsonl", "--ulysses_num_heads", "8")
    assert rc != 0 and "sequence parallelism is not available" in out and "Traceback" not in out


def test_foreign_keys_in_yaml(tmp_path):
    y = tmp_path / "run.yaml"
    y.write_text(yaml.safe_dump({"model": "m", "dataset": ["d.jsonl"], "rlhf_type": "cpo", "fp16": True,
                                 "optim": "adamw_torch_fused", "shuffle": False}))
    cfg = build_config(build_parser().parse_args(["train", "--config", str(y)]), TrainConfig)
    assert cfg.loss_type == "cpo" and cfg.torch_dtype == "float16" and cfg.shuffle is False
    y.write_text(yaml.safe_dump({"model": "m", "ring_attn": True}))
    with pytest.raises(FastDPOError, match="sequence parallelism"):
        build_config(build_parser().parse_args(["train", "--config", str(y)]), TrainConfig)


def test_shuffle_false_keeps_the_dataset_order():
    assert step_order(7, 3, seed=1, epoch=0, shuffle=False) == [[0, 1, 2], [3, 4, 5], [6]]
    shuffled = step_order(7, 3, seed=1, epoch=0)
    assert sorted(sum(shuffled, [])) == list(range(7)) and shuffled != [[0, 1, 2], [3, 4, 5], [6]]
    assert step_order(7, 3, seed=1, epoch=1, shuffle=False) == step_order(7, 3, seed=1, epoch=0, shuffle=False)


def test_training_passes_shuffle_to_the_step_order(tmp_path, model_dirs, monkeypatch):
    from conftest import easy_rows, write_jsonl

    from fastdpo import train as train_mod

    seen = []
    real = train_mod.step_order
    monkeypatch.setattr(train_mod, "step_order", lambda *a: seen.append(a) or real(*a))
    data = write_jsonl(tmp_path / "d.jsonl", easy_rows(8))
    cfg = TrainConfig(model=str(model_dirs("qwen3")), dataset=[str(data)], output_dir=str(tmp_path / "o"),
                      max_steps=1, per_device_train_batch_size=4, shuffle=False)
    train_mod.train(cfg, progress=False)
    assert seen and seen[0][-1] is False
