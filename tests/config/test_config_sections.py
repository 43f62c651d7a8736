"""The config in sections: nested YAML, building from sections, each section's own checks, and the resolved plan
saved beside the config instead of written into it."""

import dataclasses
import json

import pytest
import yaml
from data_helpers import easy_rows, write_jsonl

from fastdpo.cli import build_parser
from fastdpo.config import (
    TRAIN_SECTIONS,
    LossSection,
    ModelSection,
    OptimizerSection,
    RunPlan,
    TrainConfig,
    build_config,
)
from fastdpo.errors import FastDPOError


def from_yaml(tmp_path, data: dict, *flags) -> TrainConfig:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return build_config(build_parser().parse_args(["train", "--config", str(path), *flags]), TrainConfig)


def test_a_yaml_nested_by_section_equals_the_flat_one(tmp_path):
    flat = from_yaml(tmp_path, {"model": "m", "dataset": "d.jsonl", "beta": 0.3, "loss_type": "ipo",
                                "learning_rate": 2e-6, "max_steps": 7, "lora_rank": 4, "train_type": "lora"})
    nested = from_yaml(tmp_path, {"model": "m", "dataset": "d.jsonl", "loss": {"beta": 0.3, "loss_type": "ipo"},
                                  "optimizer": {"learning_rate": 2e-6, "max_steps": 7},
                                  "lora": {"lora_rank": 4, "train_type": "lora"}})
    assert nested == flat
    assert (nested.beta, nested.loss_type, nested.max_steps, nested.lora_rank) == (0.3, "ipo", 7, 4)


def test_the_command_line_wins_over_a_nested_key(tmp_path):
    cfg = from_yaml(tmp_path, {"model": "m", "dataset": "d", "loss": {"beta": 0.3}}, "--beta", "0.05")
    assert cfg.beta == 0.05


def test_a_model_section_and_a_model_flag_mix(tmp_path):
    cfg = from_yaml(tmp_path, {"model": {"model": "m", "torch_dtype": "float32"}, "dataset": "d"})
    assert (cfg.model, cfg.torch_dtype) == ("m", "float32")


def test_a_key_in_the_wrong_section_is_named_with_its_file(tmp_path):
    with pytest.raises(FastDPOError) as e:
        from_yaml(tmp_path, {"model": "m", "dataset": "d", "loss": {"learning_rate": 1e-6}})
    assert "run.yaml" in str(e.value) and "learning_rate" in str(e.value) and "loss" in str(e.value)
    with pytest.raises(FastDPOError) as e:
        from_yaml(tmp_path, {"model": "m", "dataset": "d", "loss": {"betta": 0.2}})
    assert "beta" in str(e.value)  # the close match is offered


def test_from_sections_and_back():
    cfg = TrainConfig.from_sections(ModelSection(model="m"), LossSection(beta=0.2, loss_type="hinge"),
                                    OptimizerSection(max_steps=3), dataset="d.jsonl", beta=0.25)
    assert (cfg.model, cfg.loss_type, cfg.beta, cfg.max_steps, cfg.dataset) == ("m", "hinge", 0.25, 3, ["d.jsonl"])
    parts = cfg.sections()
    assert [type(p) for p in parts.values()] == list(TRAIN_SECTIONS)
    assert parts["loss"].beta == 0.25 and parts["optimizer"].max_steps == 3
    parts["loss"].beta = 9.0  # a copy
    assert cfg.beta == 0.25
    rebuilt = TrainConfig.from_sections(*parts.values())
    assert dataclasses.replace(rebuilt, beta=0.25) == cfg


def test_every_train_flag_is_in_exactly_one_section():
    owned = [name for sec in TRAIN_SECTIONS for name in (f.name for f in dataclasses.fields(sec))]
    assert sorted(owned) == sorted(f.name for f in dataclasses.fields(TrainConfig))
    assert len(owned) == len(set(owned))


def test_a_section_validates_its_own_flags():
    with pytest.raises(FastDPOError, match="max_steps"):
        OptimizerSection(max_steps=0, num_train_epochs=0).validate_optimizer()
    with pytest.raises(FastDPOError, match="beta"):
        TrainConfig(model="m", dataset="d", beta=-1.0).validate_loss()
    OptimizerSection(max_steps=3).validate_optimizer()


def test_the_resolved_plan_is_saved_and_the_config_is_left_as_written(tmp_path, model_dirs):
    from fastdpo.training.loop import train

    data = write_jsonl(tmp_path / "data.jsonl", easy_rows(16, seed=1))
    cfg = TrainConfig(model=str(model_dirs("qwen3")), dataset=[str(data)], output_dir=str(tmp_path / "out"),
                      max_steps=2, save_steps=1, gradient_checkpointing="fit", seed=3)
    written = dataclasses.asdict(cfg)
    train(cfg, progress=False)
    assert dataclasses.asdict(cfg) == written  # fit and the token budget resolved onto the plan, not the config
    plan = RunPlan.load(tmp_path / "out")
    assert plan is not None and plan.gradient_checkpointing not in ("fit", "auto")
    assert (plan.device, plan.dtype, plan.kernels) == ("cpu", "float32", "torch") and plan.attention
    assert RunPlan.load(tmp_path / "out" / "checkpoint-2" / "state") == plan
    saved = yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())
    assert saved["gradient_checkpointing"] == "fit"
    assert json.loads((tmp_path / "out" / "plan.json").read_text()) == dataclasses.asdict(plan)


def test_trainer_exposes_its_plan(tmp_path, model_dirs):
    from fastdpo.training.trainer import Trainer

    data = write_jsonl(tmp_path / "data.jsonl", easy_rows(8, seed=1))
    trainer = Trainer(TrainConfig(model=str(model_dirs("qwen3")), dataset=[str(data)], output_dir=str(tmp_path / "o"),
                                  max_steps=1, gradient_checkpointing="ffn", max_tokens_per_batch=64))
    assert (trainer.plan.gradient_checkpointing, trainer.plan.max_tokens_per_batch) == ("ffn", 64)
