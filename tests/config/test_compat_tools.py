"""Commands and configs of TRL, LLaMA-Factory and OpenRLHF: mapped onto the config with their tools' meaning, noted,
or refused with what to use instead; conflicts refused; bare boolean flags parse."""

import json
import logging

import pytest
import yaml
from cli_helpers import run_cli
from data_helpers import easy_rows, write_jsonl

from fastdpo.cli import build_parser
from fastdpo.config import TrainConfig, build_config
from fastdpo.errors import FastDPOError


def parse(*flags):
    return build_config(build_parser().parse_args(["train", *flags]), TrainConfig)


def from_yaml(tmp_path, data: dict, *flags):
    y = tmp_path / "dpo.yaml"
    y.write_text(yaml.safe_dump(data), encoding="utf-8")
    return parse("--config", str(y), *flags)


# ---------------------------------------------------------------- TRL


def test_trl_command_line(caplog):
    caplog.set_level(logging.INFO, logger="fastdpo")
    cfg = parse("--model_name_or_path", "Qwen/Qwen3-0.6B", "--dataset_name", "trl-lib/ultrafeedback_binarized",
                "--dataset_config", "default", "--dataset_train_split", "train", "--dataset_test_split", "test",
                "--eval_strategy", "steps", "--eval_steps", "50", "--learning_rate", "5e-7", "--beta", "0.1",
                "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "8", "--max_length", "1024",
                "--gradient_checkpointing", "true", "--bf16", "true", "--attn_implementation", "flash_attention_2",
                "--dtype", "bfloat16", "--use_peft", "--lora_r", "32", "--lora_alpha", "16",
                "--lora_target_modules", "q_proj", "k_proj", "--output_dir", "out")
    cfg.validate()
    assert cfg.model == "Qwen/Qwen3-0.6B" and cfg.dataset == ["trl-lib/ultrafeedback_binarized:default"]
    assert (cfg.split, cfg.val_dataset, cfg.val_split) == ("train", ["trl-lib/ultrafeedback_binarized:default"], "test")
    assert (cfg.train_type, cfg.lora_rank, cfg.lora_alpha, cfg.target_modules) == ("lora", 32, 16, "q_proj,k_proj")
    assert (cfg.torch_dtype, cfg.attn_impl, cfg.gradient_checkpointing) == ("bfloat16", "flash_attention_2", "true")
    assert (cfg.max_length, cfg.eval_steps, cfg.gradient_accumulation_steps) == (1024, 50, 8)


def test_a_refused_yaml_value_names_its_file_and_key(tmp_path):
    y = tmp_path / "dpo.yaml"
    y.write_text(yaml.safe_dump({"model": "m", "dataset": ["d.jsonl"], "pref_beta": "high"}), encoding="utf-8")
    with pytest.raises(FastDPOError, match=f"^{y}: key 'pref_beta': --pref_beta high: expected a number"):
        parse("--config", str(y))
    with pytest.raises(FastDPOError, match="^--pref_beta x: expected a number"):  # the command line's value wins
        parse("--config", str(y), "--pref_beta", "x")


def test_trl_commands_take_trl_defaults_for_what_they_leave_out(caplog):
    """`trl dpo --model_name_or_path M --dataset_name D` trains with DPOConfig's learning rate and max_length and HF's
    three epochs there; the same command here must not silently train differently."""
    caplog.set_level(logging.INFO, logger="fastdpo")
    cfg = parse("--model_name_or_path", "m", "--dataset_name", "org/prefs")
    assert (cfg.learning_rate, cfg.max_length, cfg.num_train_epochs) == (1e-6, 1024, 3.0)
    assert "TRL's defaults for what the command leaves out: --learning_rate 1e-06, --max_length 1024, " \
           "--num_train_epochs 3.0." in caplog.text
    cfg = parse("--model_name_or_path", "m", "--dataset_name", "org/prefs", "--learning_rate", "5e-7",
                "--max_steps", "10")
    assert (cfg.learning_rate, cfg.max_length, cfg.num_train_epochs) == (5e-7, 1024, TrainConfig().num_train_epochs)
    # --model_name_or_path alone (LLaMA-Factory configs use it too) keeps fastdpo's defaults
    cfg = parse("--model_name_or_path", "m", "--dataset", "d.jsonl")
    assert (cfg.learning_rate, cfg.max_length) == (TrainConfig().learning_rate, TrainConfig().max_length)


def test_trl_peft_defaults_and_quantisation(caplog):
    caplog.set_level(logging.INFO, logger="fastdpo")
    cfg = parse("--model_name_or_path", "m", "--dataset_name", "d", "--use_peft", "--load_in_4bit")
    assert (cfg.train_type, cfg.quant_bits, cfg.lora_rank, cfg.target_modules) == ("qlora", 4, 16, "default")
    assert "PEFT's default modules" in caplog.text and "double quantisation" in caplog.text
    assert cfg.val_dataset == []
    cfg = parse("--model_name_or_path", "m", "--dataset_name", "d", "--dataset_test_split", "test")
    assert cfg.val_dataset == [] and "TRL evaluates on it only with --eval_strategy" in caplog.text
    cfg = parse("--model_name_or_path", "m", "--dataset_name", "d", "--dataset_test_split", "test", "--eval_steps", "2")
    assert (cfg.val_dataset, cfg.val_split) == (["d"], "test")  # fastdpo's own --eval_steps asks for the evaluation
    assert parse("--model", "m", "--dataset", "d", "--use_peft", "--load_in_8bit").quant_bits == 8


@pytest.mark.parametrize("flags,needle", [
    (("--load_in_4bit",), "--load_in_4bit quantises the base for LoRA adapters: add --use_peft"),
    (("--dataset_config", "en"), "--dataset_config en names a subset of --dataset_name"),
    (("--attn_implementation", "flash_attention_3"), "accepted names: auto, varlen, flex"),
    (("--use_peft", "--load_in_4bit", "--bnb_4bit_quant_type", "fp4"), "fastdpo's 4-bit base is nf4"),
    (("--use_peft", "--train_type", "full"), "--use_peft True means --train_type lora, but --train_type is already full"),
    (("--dataset_name", "x"), "--dataset_name x means --dataset \\['x'\\], but --dataset is already \\['d'\\]"),
])
def test_trl_refusals(flags, needle):
    with pytest.raises(FastDPOError, match=needle):
        parse("--model", "m", "--dataset", "d", *flags)


# ---------------------------------------------------------------- LLaMA-Factory


def llamafactory_yaml(data_file: str) -> dict:
    """examples/train_lora/llama3_lora_dpo.yaml, with a data file for `dataset` (no dataset_dir)."""
    return {"model_name_or_path": "meta-llama/Meta-Llama-3-8B-Instruct", "trust_remote_code": True,
            "stage": "dpo", "do_train": True, "finetuning_type": "lora", "lora_rank": 8, "lora_target": "all",
            "pref_beta": 0.1, "pref_loss": "sigmoid", "dataset": data_file, "template": "llama3",
            "cutoff_len": 2048, "max_samples": 1000, "overwrite_cache": True, "preprocessing_num_workers": 16,
            "dataloader_num_workers": 4, "output_dir": "saves/llama3-8b/lora/dpo", "logging_steps": 10,
            "save_steps": 500, "overwrite_output_dir": True, "save_only_model": False,
            "report_to": "none", "per_device_train_batch_size": 1, "gradient_accumulation_steps": 8,
            "learning_rate": 5.0e-6, "num_train_epochs": 3.0, "lr_scheduler_type": "cosine", "warmup_ratio": 0.1,
            "bf16": True, "ddp_timeout": 180000000, "resume_from_checkpoint": None, "val_size": 0.1,
            "per_device_eval_batch_size": 1, "eval_strategy": "steps", "eval_steps": 500}


def test_llamafactory_yaml(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="fastdpo")
    cfg = from_yaml(tmp_path, llamafactory_yaml("data/dpo_en_demo.json"))
    cfg.validate_data()
    assert (cfg.model, cfg.trust_remote_code, cfg.dataset) == ("meta-llama/Meta-Llama-3-8B-Instruct", True,
                                                              ["data/dpo_en_demo.json"])
    assert (cfg.train_type, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.target_modules) == (
        "lora", 8, 16, 0.0, "all-linear")  # LLaMA-Factory: alpha = 2 x rank, dropout 0
    assert (cfg.beta, cfg.loss_type, cfg.max_length, cfg.template) == (0.1, "sigmoid", 2048, "llama3")
    assert (cfg.dataset_num_proc, cfg.load_from_cache_file, cfg.torch_dtype) == (16, False, "bfloat16")
    assert (cfg.split_dataset_ratio, cfg.eval_steps, cfg.save_steps, cfg.resume_from_checkpoint) == (0.1, 500, 500, "")
    assert (cfg.learning_rate, cfg.num_train_epochs, cfg.lr_scheduler_type, cfg.ddp_timeout, cfg.max_samples) == (
        5e-6, 3.0, "cosine", 180000000, 1000)
    assert "template llama3: fastdpo's built-in llama3 template" in caplog.text


def test_llamafactory_defaults_quantisation_and_templates(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="fastdpo")
    base = {"model_name_or_path": "m", "stage": "dpo", "dataset": "d.jsonl"}
    cfg = from_yaml(tmp_path, {**base, "lora_rank": 16, "template": "qwen", "pref_loss": "simpo", "simpo_gamma": 0.7})
    assert (cfg.train_type, cfg.lora_alpha, cfg.template, cfg.loss_type, cfg.simpo_gamma) == (
        "lora", 32, "", "simpo", 0.7)
    assert "LoRA, LLaMA-Factory's default" in caplog.text and "render with the tokenizer's own" in caplog.text
    cfg = from_yaml(tmp_path, {**base, "quantization_bit": 4, "lora_target": "q_proj,v_proj", "flash_attn": "fa2"})
    assert (cfg.train_type, cfg.quant_bits, cfg.target_modules, cfg.attn_impl) == (
        "qlora", 4, "q_proj,v_proj", "flash_attention_2")
    assert from_yaml(tmp_path, {**base, "finetuning_type": "full"}).train_type == "full"
    assert from_yaml(tmp_path, {**base, "train_type": "full"}).train_type == "full"
    assert parse("--model", "m", "--dataset", "d", "--stage", "dpo", "--pref_beta", "0.3").beta == 0.3


def test_llamafactory_fp8_is_the_fp8_base_under_lora_and_fp8_training_under_full(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="fastdpo")
    base = {"model_name_or_path": "m", "stage": "dpo", "dataset": "d.jsonl"}
    cfg = from_yaml(tmp_path, {**base, "fp8": True})
    assert (cfg.train_type, cfg.fp8_base) == ("lora", True) and "--fp8_base" in caplog.text
    assert from_yaml(tmp_path, {**base, "fp8": False}).fp8_base is False
    full = from_yaml(tmp_path, {**base, "finetuning_type": "full", "fp8": True})  # a full fine-tune in FP8
    assert (full.train_type, full.fp8, full.fp8_base) == ("full", True, False)
    # fastdpo's own keys (a full fine-tune by default): fp8 is --fp8 itself, as Axolotl's fp8 means
    own = from_yaml(tmp_path, {"model": "m", "dataset": "d.jsonl", "fp8": True})
    assert (own.train_type, own.fp8, own.fp8_base) == ("full", True, False)
    with pytest.raises(FastDPOError, match="hold it in FP8 with --train_type lora --fp8_base"):
        from_yaml(tmp_path, {"model": "m", "dataset": "d.jsonl", "fp8": True, "train_type": "lora"}).validate()


def test_llamafactory_kto_stage(tmp_path, caplog):
    """stage kto trains KTO, its weights under LLaMA-Factory's names, with a note on how its KL estimate is built."""
    caplog.set_level(logging.INFO, logger="fastdpo")
    cfg = from_yaml(tmp_path, {"model_name_or_path": "m", "stage": "kto", "dataset": "d.jsonl", "pref_beta": 0.2,
                               "kto_chosen_weight": 1.2, "kto_rejected_weight": 0.8})
    assert (cfg.loss_type, cfg.beta, cfg.desirable_weight, cfg.undesirable_weight) == ("kto", 0.2, 1.2, 0.8)
    assert "as TRL's KTOTrainer computes it" in caplog.text


@pytest.mark.parametrize("keys,needle", [
    ({"stage": "sft"}, "stage sft: fastdpo trains preference losses"),
    ({"pref_loss": "kto_pair"}, "kto_pair has no counterpart"),
    ({"pref_loss": "orpo"}, "mean over pairs of each chosen answer's per-token NLL.*--loss_type orpo"),
    ({"pref_ftx": 0.5}, "pref_ftx 0.5: LLaMA-Factory's SFT term is the mean over pairs.*--rpo_alpha 0.5"),
    ({"finetuning_type": "freeze"}, "freezing layers and OFT are not available"),
    ({"quantization_bit": 3}, "quantization_bit 3: the base is quantised with bitsandbytes"),
    ({"finetuning_type": "full", "quantization_bit": 4}, "a quantised base can only train adapters"),
    ({"val_size": 200}, "val_size 200: a number of held-out rows is not supported"),
    ({"use_unsloth": True}, "Unsloth's kernels are not used"),
    ({"do_train": False}, "do_train false: this config would not train"),
    ({"pref_beta": 0.2, "beta": 0.1}, "--pref_beta 0.2 means --beta 0.2, but --beta is already 0.1"),
    ({"pref_loss": "simpo", "dpo_label_smoothing": 0.1}, "LLaMA-Factory ignores it for SimPO"),
])
def test_llamafactory_refusals(tmp_path, keys, needle):
    with pytest.raises(FastDPOError, match=needle):
        from_yaml(tmp_path, {"model_name_or_path": "m", "stage": "dpo", "dataset": "d.jsonl", **keys})


# ---------------------------------------------------------------- OpenRLHF

OPENRLHF = ("--save_path", "out", "--save_steps", "-1", "--logging_steps", "1", "--eval_steps", "-1",
            "--train_batch_size", "128", "--micro_train_batch_size", "2", "--pretrain", "m", "--bf16",
            "--max_epochs", "1", "--max_len", "4096", "--zero_stage", "3", "--learning_rate", "5e-7", "--beta", "0.1",
            "--dataset", "d.jsonl", "--flash_attn", "--load_checkpoint", "--gradient_checkpointing")


def test_openrlhf_command_line(caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="fastdpo")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("NPROC_PER_NODE", "8")
    cfg = parse(*OPENRLHF)
    assert (cfg.model, cfg.output_dir, cfg.max_length, cfg.num_train_epochs) == ("m", "out", 4096, 1.0)
    assert (cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps) == (2, 8)  # 128 / (2 x 8 GPUs)
    assert (cfg.save_steps, cfg.eval_steps, cfg.deepspeed, cfg.torch_dtype) == (0, 0, "zero3", "bfloat16")
    assert (cfg.attn_impl, cfg.gradient_checkpointing, cfg.resume_from_checkpoint) == ("flash_attn", "true", "latest")
    assert (cfg.learning_rate, cfg.warmup_ratio, cfg.lr_scheduler_type, cfg.lr_scheduler_kwargs) == (
        5e-7, 0.03, "cosine_with_min_lr", {"min_lr_rate": 0.1})
    assert (cfg.adam_beta1, cfg.adam_beta2, cfg.train_type) == (0.9, 0.95, "full")
    assert "OpenRLHF's defaults for what the command leaves out: --warmup_ratio 0.03" in caplog.text
    monkeypatch.setenv("WORLD_SIZE", "4")  # inside a worker
    cfg = parse(*OPENRLHF, "--lora_rank", "64", "--target_modules", "q_proj", "v_proj", "--load_in_4bit",
                "--adam_betas", "0.9", "0.99", "--l2", "0.01", "--lr_warmup_ratio", "0.1")
    assert (cfg.gradient_accumulation_steps, cfg.train_type, cfg.quant_bits, cfg.lora_rank) == (16, "qlora", 4, 64)
    assert (cfg.lora_alpha, cfg.lora_dropout, cfg.target_modules) == (16, 0.0, "q_proj,v_proj")
    assert (cfg.adam_beta2, cfg.weight_decay, cfg.warmup_ratio) == (0.99, 0.01, 0.1)


def test_openrlhf_defaults_when_left_out(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("NPROC_PER_NODE", raising=False)
    cfg = parse("--pretrain", "m", "--dataset", "d.jsonl")
    assert (cfg.learning_rate, cfg.max_length, cfg.per_device_train_batch_size) == (1e-5, 512, 8)
    assert (cfg.gradient_accumulation_steps, cfg.adam_beta2) == (16, 0.95)  # 128 pairs per step on one GPU
    assert parse("--pretrain", "m", "--dataset", "d.jsonl", "--gradient_accumulation_steps", "2").pairs_per_step == 16


def test_openrlhf_column_keys_alone_keep_fastdpo_defaults():
    """--prompt_key and friends are shorthand for --columns; on their own they do not make a command OpenRLHF's."""
    cfg = parse("--model", "m", "--dataset", "d.jsonl", "--prompt_key", "question", "--chosen_key", "good")
    assert cfg.columns == {"question": "prompt", "good": "chosen"}
    default = TrainConfig()
    assert (cfg.learning_rate, cfg.max_length, cfg.gradient_accumulation_steps) == \
        (default.learning_rate, default.max_length, default.gradient_accumulation_steps)
    with_pretrain = parse("--pretrain", "m", "--dataset", "d.jsonl", "--prompt_key", "question")
    assert with_pretrain.columns == {"question": "prompt"} and with_pretrain.learning_rate == 1e-5


@pytest.mark.parametrize("flags,needle", [
    (("--train_batch_size", "100", "--micro_train_batch_size", "4"),
     "--train_batch_size 100 is not a multiple of --micro_train_batch_size 4 x 2 ranks = 8.*e.g. 96"),
    (("--ipo",), "OpenRLHF's IPO uses summed log-probs"),
    (("--nll_loss_coef", "0.2"), "--nll_loss_coef 0.2: OpenRLHF's NLL term is the mean over pairs.*--rpo_alpha 0.2"),
    (("--ref_offload",), "--ref_offload True: DeepSpeed's CPU offload is not available"),
    (("--zero_stage", "5"), "choose 0, 1, 2 or 3"),
    (("--model", "other"), "--pretrain m means --model m, but --model is already other"),
    (("--model_name_or_path", "other"), "--model_name_or_path other means --model other, but --model is already m"),
    (("--train_batch_size", "16", "--micro_train_batch_size", "2", "--gradient_accumulation_steps", "2"),
     "--train_batch_size 16 means --gradient_accumulation_steps 4, but --gradient_accumulation_steps is already 2"),
    (("--max_len", "long"), "--max_len long: expected an integer"),
])
def test_openrlhf_refusals(monkeypatch, flags, needle):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("NPROC_PER_NODE", "2")
    with pytest.raises(FastDPOError, match=needle):
        parse("--pretrain", "m", "--dataset", "d.jsonl", *flags)


def test_bare_and_valued_boolean_flags():
    assert parse("--model", "m", "--dataset", "d", "--bf16").torch_dtype == "bfloat16"
    assert parse("--model", "m", "--dataset", "d", "--bf16", "true").torch_dtype == "bfloat16"
    assert parse("--model", "m", "--dataset", "d", "--bf16", "false").torch_dtype == "auto"
    assert parse("--model", "m", "--dataset", "d", "--gradient_checkpointing").gradient_checkpointing == "true"
    assert parse("--model", "m", "--dataset", "d", "--gradient_checkpointing", "ffn").gradient_checkpointing == "ffn"
    assert parse("--model", "m", "--dataset", "d", "--ipo", "false").loss_type == "sigmoid"


def test_val_split_selects_the_split_of_held_out_dataset_dirs(tmp_path):
    """TRL's --dataset_test_split: the held-out rows come from that split of the same dataset dir."""
    from datasets import Dataset, DatasetDict

    from fastdpo.data import split as evaluate

    rows = easy_rows(6, seed=2)
    DatasetDict({"train": Dataset.from_list(rows[:4]), "test": Dataset.from_list(rows[4:])}).save_to_disk(tmp_path / "ds")
    cfg = TrainConfig(model="m", dataset=[str(tmp_path / "ds")], val_dataset=[str(tmp_path / "ds")], val_split="test")
    _, held_out = evaluate.held_out_rows(cfg, [])
    assert [r.prompt for r in held_out] == [r["prompt"] for r in rows[4:]]
    cfg.val_split = "train"
    assert [r.prompt for r in evaluate.held_out_rows(cfg, [])[1]] == [r["prompt"] for r in rows[:4]]


def test_foreign_flags_are_grouped_by_tool_in_help(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    out = capsys.readouterr().out
    for title in ("accepted from TRL scripts", "accepted from LLaMA-Factory configs",
                  "accepted from OpenRLHF's train_dpo", "accepted from ms-swift / HF TrainingArguments scripts"):
        assert title in out
    assert "--pretrain VALUE" in out and "--use_peft [VALUE]" in out


def test_openrlhf_command_trains_end_to_end(tmp_path, model_dirs, capsys, restore_logging, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("NPROC_PER_NODE", raising=False)
    data = write_jsonl(tmp_path / "d.jsonl", easy_rows(16, seed=1))
    out = tmp_path / "ckpt"
    rc, text = run_cli(capsys, "train", "--pretrain", model_dirs("qwen3"), "--save_path", out, "--dataset", data,
                       "--micro_train_batch_size", "4", "--train_batch_size", "8", "--max_epochs", "1",
                       "--max_len", "64", "--learning_rate", "1e-3", "--beta", "0.1", "--l2", "0.0",
                       "--adam_betas", "0.9", "0.95", "--save_steps", "-1", "--eval_steps", "-1",
                       "--logging_steps", "1", "--gradient_checkpointing", "--load_checkpoint", "--seed", "42",
                       "--device", "cpu", "--disable_progress", "true")
    assert rc == 0, text
    saved = yaml.safe_load((out / "config.yaml").read_text(encoding="utf-8"))
    assert (saved["gradient_accumulation_steps"], saved["per_device_train_batch_size"], saved["max_length"]) == (2, 4, 64)
    assert (saved["lr_scheduler_type"], saved["adam_beta2"], saved["gradient_checkpointing"]) == (
        "cosine_with_min_lr", 0.95, "true")
    steps = [json.loads(line) for line in open(out / "metrics.jsonl") if '"loss"' in line]
    assert len(steps) == 2  # 16 pairs, 8 per optimizer step
