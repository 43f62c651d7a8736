"""Flags of ms-swift / HF TrainingArguments scripts: accepted and mapped, accepted with a note, or refused
with a message that says what to do; the same in YAML; --shuffle false keeps the dataset order."""

import logging

import pytest
import yaml
from cli_helpers import run_cli

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
                "--eval_strategy", "no", "--ulysses_num_heads", "1", "--use_liger_kernel", "true",
                "--ring_attn", "false", "--ring_attn_window_size", "512")
    assert cfg.loss_type == "sigmoid" and cfg.torch_dtype == "bfloat16" and cfg.save_steps == 0
    assert cfg.eval_steps == 0 and cfg.shuffle is True and cfg.deepspeed == "zero3"
    notes = caplog.text
    assert "--flash_attn_version 2.6.3: ignored" in notes and "--zero3_save_16bit_model true: ignored" in notes
    assert "--use_liger_kernel true: ignored" in notes and "--ring_attn_window_size 512: ignored" in notes


def test_rlhf_type_selects_the_loss():
    assert parse("--rlhf_type", "simpo").loss_type == "simpo"
    assert parse("--rlhf_type", "orpo", "--loss_type", "orpo").loss_type == "orpo"
    with pytest.raises(FastDPOError, match="--rlhf_type simpo and --loss_type ipo disagree"):
        parse("--rlhf_type", "simpo", "--loss_type", "ipo")
    assert parse("--rlhf_type", "kto").loss_type == "kto"  # ms-swift's KTO: TRL's KTOTrainer, loss_type kto
    cfg = parse("--rlhf_type", "kto", "--loss_type", "apo_zero_unpaired", "--desirable_weight", "1.33")
    assert (cfg.loss_type, cfg.desirable_weight, cfg.undesirable_weight) == ("apo_zero_unpaired", 1.33, 1.0)
    assert cfg.per_device_train_batch_size > 1  # its KL estimate needs rows to rotate
    with pytest.raises(FastDPOError, match="reward models, PPO and GRPO"):
        parse("--rlhf_type", "rm")


@pytest.mark.parametrize("flags,needle", [
    (("--ulysses_num_heads", "4", "--sequence_parallel_size", "2"), "--ulysses_num_heads 4 means "
     "--sequence_parallel_size 4, but --sequence_parallel_size is already 2"),
    (("--ulysses_num_heads", "2", "--ring_attn", "true"), "--ring_attn true means --sequence_parallel_mode ring"),
    (("--ulysses_num_heads", "0"), "--ulysses_num_heads 0: expected a number of ranks"),
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


def test_sequence_parallel_flags_of_ms_swift_map_onto_the_fields(caplog):
    caplog.set_level(logging.INFO, logger="fastdpo")
    cfg = parse("--ulysses_num_heads", "4")
    assert (cfg.sequence_parallel_size, cfg.sequence_parallel_mode) == (4, "ulysses")
    cfg = parse("--sequence_parallel_size", "2", "--ring_attn", "true", "--ring_attn_window_size", "512")
    assert (cfg.sequence_parallel_size, cfg.sequence_parallel_mode) == (2, "ring")
    assert "--ring_attn_window_size 512: ignored" in caplog.text
    cfg = parse("--ulysses_num_heads", "1", "--ring_attn", "false")
    assert (cfg.sequence_parallel_size, cfg.sequence_parallel_mode) == (1, "auto")
    cfg = parse("--sequence_parallel_size", "2")  # fastdpo's own flag: no ms-swift defaults come with it
    assert cfg.lr_scheduler_type == TrainConfig.lr_scheduler_type


def test_refusal_is_one_clean_line_from_the_cli(capsys):
    rc, out = run_cli(capsys, "train", "--model", "m", "--dataset", "d.jsonl", "--ulysses_num_heads", "2",
                      "--ring_attn", "true")
    assert rc != 0 and "--sequence_parallel_mode ring" in out and "Traceback" not in out


def test_foreign_keys_in_yaml(tmp_path):
    y = tmp_path / "run.yaml"
    y.write_text(yaml.safe_dump({"model": "m", "dataset": ["d.jsonl"], "rlhf_type": "cpo", "fp16": True,
                                 "optim": "adamw_torch_fused", "shuffle": False}))
    cfg = build_config(build_parser().parse_args(["train", "--config", str(y)]), TrainConfig)
    assert cfg.loss_type == "cpo" and cfg.torch_dtype == "float16" and cfg.shuffle is False
    y.write_text(yaml.safe_dump({"model": "m", "ring_attn": True, "sequence_parallel_size": 2}))
    cfg = build_config(build_parser().parse_args(["train", "--config", str(y)]), TrainConfig)
    assert (cfg.sequence_parallel_size, cfg.sequence_parallel_mode) == (2, "ring")


def test_shuffle_false_keeps_the_dataset_order():
    assert step_order(7, 3, seed=1, epoch=0, shuffle=False) == [[0, 1, 2], [3, 4, 5], [6]]
    shuffled = step_order(7, 3, seed=1, epoch=0)
    assert sorted(sum(shuffled, [])) == list(range(7)) and shuffled != [[0, 1, 2], [3, 4, 5], [6]]
    assert step_order(7, 3, seed=1, epoch=1, shuffle=False) == step_order(7, 3, seed=1, epoch=0, shuffle=False)


def test_training_passes_shuffle_to_the_step_order(tmp_path, model_dirs, monkeypatch):
    from data_helpers import easy_rows, write_jsonl

    from fastdpo.training import loop as train_mod
    from fastdpo.training import trainer as step_mod

    seen = []
    real = step_mod.step_order
    monkeypatch.setattr(step_mod, "step_order", lambda *a: seen.append(a) or real(*a))
    data = write_jsonl(tmp_path / "d.jsonl", easy_rows(8))
    cfg = TrainConfig(model=str(model_dirs("qwen3")), dataset=[str(data)], output_dir=str(tmp_path / "o"),
                      max_steps=1, per_device_train_batch_size=4, shuffle=False)
    train_mod.train(cfg, progress=False)
    assert seen and seen[0][4] is False  # (rows, pairs per step, seed, epoch, shuffle, prompt runs)


def test_swift_qlora_spelling_trains_qlora(caplog):
    """ms-swift writes QLoRA as --train_type lora --quant_method bnb --quant_bits 4 (lora is its default)."""
    caplog.set_level(logging.INFO, logger="fastdpo")
    cfg = parse("--train_type", "lora", "--quant_method", "bnb", "--quant_bits", "8")
    assert (cfg.train_type, cfg.quant_bits) == ("qlora", 8)
    assert "training QLoRA: --train_type qlora (LoRA on a 8-bit base)" in caplog.text
    assert parse("--quant_method", "bnb", "--quant_bits", "4").train_type == "qlora"
    assert parse("--train_type", "qlora", "--quant_method", "bitsandbytes").train_type == "qlora"
    with pytest.raises(FastDPOError, match="--quant_method bnb with --train_type full: a quantised base can only"):
        parse("--train_type", "full", "--quant_method", "bnb")


def test_swift_fp8_spelling_trains_lora_on_the_fp8_base(caplog):
    """ms-swift's FP8 base is --quant_method fp8 --quant_bits 8: here LoRA with --fp8_base, bnb still QLoRA."""
    caplog.set_level(logging.INFO, logger="fastdpo")
    cfg = parse("--quant_method", "fp8", "--quant_bits", "8")
    assert (cfg.train_type, cfg.fp8_base) == ("lora", True)
    assert "--train_type lora --fp8_base" in caplog.text and "--quant_bits" not in caplog.text  # no no-op note
    assert parse("--train_type", "lora", "--quant_method", "FP8").fp8_base
    assert parse("--quant_method", "bnb", "--quant_bits", "8").fp8_base is False
    with pytest.raises(FastDPOError, match="--quant_method fp8 --quant_bits 4: an FP8 base has 8 bits"):
        parse("--quant_method", "fp8", "--quant_bits", "4")
    with pytest.raises(FastDPOError, match="--quant_method fp8 with --train_type full: the FP8 base is the frozen"):
        parse("--train_type", "full", "--quant_method", "fp8")
    with pytest.raises(FastDPOError, match="--quant_method fp8 means --fp8_base True, but --fp8_base is already"):
        parse("--quant_method", "fp8", "--fp8_base", "false")


@pytest.mark.parametrize("flags,needle", [
    (("--fp8_base", "true"), "--train_type full trains every weight. For FP8 products in a full fine-tune use --fp8"),
    (("--train_type", "qlora", "--fp8_base", "true"), "--fp8_base and --train_type qlora both quantise"),
    (("--train_type", "lora", "--fp8_base", "true", "--device", "cpu"), "--fp8_base needs a CUDA GPU with FP8"),
])
def test_fp8_base_is_refused_where_it_cannot_serve(flags, needle):
    cfg = parse("--model", "m", "--dataset", "d", *flags)
    with pytest.raises(FastDPOError, match=needle):
        cfg.validate_training()
    assert parse("--model", "m", "--dataset", "d", "--train_type", "lora", "--fp8_base", "true").fp8_base
    assert parse("--model", "m", "--dataset", "d").fp8_base is False  # off by default


@pytest.mark.parametrize("flags", [("--lora_rank", "8", "--lora_alpha", "32"), ("--target_modules", "q_proj,v_proj"),
                                   ("--train_type", "full", "--lora_dropout", "0.1")])
def test_adapter_flags_on_a_full_fine_tune_are_refused(flags):
    with pytest.raises(FastDPOError, match="set, but --train_type is full .* Add --train_type lora"):
        parse(*flags)
    assert parse(*flags, "--train_type", "lora").train_type == "lora"


def test_adapter_values_in_yaml_count_only_when_not_the_defaults(tmp_path):
    """A saved config.yaml lists every field, LoRA defaults included: it loads back for a full run. A YAML that sets
    a LoRA value of its own on a full run is refused like the flag."""
    from fastdpo.config import save_config

    save_config(parse(), tmp_path / "saved.yaml")
    assert build_config(build_parser().parse_args(["train", "--config", str(tmp_path / "saved.yaml")]),
                        TrainConfig).train_type == "full"
    y = tmp_path / "run.yaml"
    y.write_text(yaml.safe_dump({"model": "m", "dataset": ["d.jsonl"], "lora_rank": 64}))
    with pytest.raises(FastDPOError, match="--lora_rank set, but --train_type is full"):
        build_config(build_parser().parse_args(["train", "--config", str(y)]), TrainConfig)


def test_float16_full_fine_tuning_is_refused_before_loading_anything():
    """float16 weights cannot hold AdamW's state (the run turned to NaN after one step and saved NaN weights):
    refused for full training, allowed for LoRA on a float16 base and for scoring."""
    with pytest.raises(FastDPOError, match="--torch_dtype float16 .* with --train_type full: AdamW's updates"):
        parse("--fp16", "true").validate_training()
    with pytest.raises(FastDPOError, match="Use --torch_dtype bfloat16"):
        parse("--torch_dtype", "float16").validate_training()
    parse("--torch_dtype", "float16", "--train_type", "lora").validate_training()
    parse("--torch_dtype", "float16").validate()  # precompute, check-data: no update


def test_float16_full_fine_tuning_is_one_clean_line_from_the_cli(capsys, tmp_path):
    rc, out = run_cli(capsys, "train", "--model", "m", "--dataset", "d.jsonl", "--fp16", "true",
                      "--output_dir", str(tmp_path / "o"))
    assert rc != 0 and "AdamW's updates and second moments do not fit in float16" in out and "Traceback" not in out
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv,needle", [
    (("export", "--model", "m", "--checkpoint", "c"), "--checkpoint is a flag of `fastdpo infer / eval`, not of "
                                                      "`fastdpo export`"),
    (("train", "--model", "m", "--learning_rat", "1e-5"), "Did you mean --learning_rate?"),
    (("infer", "--model", "m", "--zzzz", "3"), "See `fastdpo infer --help` for its flags"),
])
def test_unknown_flag_hints_come_from_the_command_given(capsys, argv, needle):
    rc, out = run_cli(capsys, *argv)
    assert rc != 0 and needle in out and "Did you mean --checkpoint" not in out


def test_fewer_than_32_pairs_per_step_warns(caplog):
    from fastdpo.training.setup import warn_small_steps

    caplog.set_level(logging.WARNING, logger="fastdpo")
    warn_small_steps(parse("--per_device_train_batch_size", "3", "--gradient_accumulation_steps", "1"), 1)
    assert "3 pairs per optimizer step" in caplog.text and "Raise --gradient_accumulation_steps to 11" in caplog.text
    caplog.clear()
    warn_small_steps(parse("--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "4"), 2)
    assert caplog.text == ""


@pytest.mark.parametrize("flags, warned", [
    ((), False),  # fastdpo's own 8 pairs
    (("--rlhf_type", "dpo"), False),  # ms-swift's 16 pairs, set by its defaults
    (("--rlhf_type", "dpo", "--per_device_train_batch_size", "2"), False),  # still ms-swift's 16
    (("--rlhf_type", "dpo", "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "4"), True),
    (("--per_device_train_batch_size", "4"), True),
])
def test_small_step_warning_only_for_a_step_size_the_user_chose(caplog, flags, warned):
    from fastdpo.training.setup import warn_small_steps

    caplog.set_level(logging.WARNING, logger="fastdpo")
    cfg = parse(*flags)
    assert cfg.pairs_per_step < 32
    warn_small_steps(cfg, 1)
    assert ("pairs per optimizer step" in caplog.text) == warned, caplog.text


@pytest.mark.parametrize("lr", ["1e39", "nan", "-1e-5"])
def test_impossible_learning_rates_are_one_clean_line(capsys, lr):
    """1e39 used to end in a raw overflow traceback inside AdamW's first step."""
    rc, out = run_cli(capsys, "train", "--model", "m", "--dataset", "d.jsonl", f"--learning_rate={lr}")
    assert rc != 0 and "--learning_rate must be a number from 0 to 1e+06" in out and "Traceback" not in out
