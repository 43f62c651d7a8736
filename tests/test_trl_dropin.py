"""`from fastdpo import DPOConfig, DPOTrainer`: TRL's DPO API on fastdpo. A TRL script switches with its import line
and trains as `fastdpo train` does on the same rows."""

import json

import pytest
import torch
from data_helpers import easy_rows, write_jsonl
from safetensors.torch import load_file

# TRL's DPO quick start (docs/source/dpo_trainer.md), adapted only for a local tiny model and local data
QUICKSTART = '''
from datasets import load_dataset
from trl import DPOConfig, DPOTrainer
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{model}")
tokenizer = AutoTokenizer.from_pretrained("{model}")
train_dataset = load_dataset("json", data_files="{data}", split="train")

training_args = DPOConfig(output_dir="Qwen2-0.5B-DPO")
trainer = DPOTrainer(model=model, args=training_args, processing_class=tokenizer, train_dataset=train_dataset)
trainer.train()
'''


def losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").open()]


def test_trl_quickstart_runs_with_the_import_line_changed(tmp_path, model_dirs, monkeypatch):
    script = QUICKSTART.format(model=model_dirs("qwen3"), data=write_jsonl(tmp_path / "prefs.jsonl", easy_rows(16)))
    script = script.replace("from trl import", "from fastdpo import")
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(script, "train_dpo.py", "exec"), scope)
    trainer, out = scope["trainer"], tmp_path / "Qwen2-0.5B-DPO"
    assert trainer.model is scope["model"]  # the loaded model was trained, not a copy from disk
    assert len(losses(out)) == 6  # TRL's defaults: 3 epochs of 16 rows in steps of 8
    assert trainer.config.learning_rate == 1e-6 and trainer.config.max_length == 1024
    final = load_file(str(out / "final" / "model.safetensors"))
    weights = trainer.model.state_dict()
    assert all(torch.equal(v, weights[k]) for k, v in final.items())


def test_a_trl_script_trains_as_fastdpo_train_does(tmp_path, model_dirs):
    """The same rows, flags and starting weights: per-step losses and final weights agree to float32 rounding."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fastdpo import DPOConfig, DPOTrainer
    from fastdpo.cli import main

    m, rows = str(model_dirs("qwen3")), easy_rows(16, seed=2)
    flags = dict(learning_rate=1e-3, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=3,
                 logging_steps=1, seed=5, beta=0.2, max_length=64, lr_scheduler_type="cosine", warmup_ratio=0.3,
                 rpo_alpha=0.5)
    args = DPOConfig(output_dir=str(tmp_path / "trl"), **flags)
    model = AutoModelForCausalLM.from_pretrained(m, dtype=torch.float32)
    trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=AutoTokenizer.from_pretrained(m))
    trainer.train()
    cli = [f"--{k}={v}" for k, v in flags.items()]
    assert main(["train", "--model", m, "--dataset", str(write_jsonl(tmp_path / "rows.jsonl", rows)), "--output_dir",
                 str(tmp_path / "cli"), "--torch_dtype", "float32", "--disable_progress", "true", *cli]) == 0
    assert losses(tmp_path / "trl") == pytest.approx(losses(tmp_path / "cli"), rel=1e-5)
    ours, theirs = load_file(str(tmp_path / "cli" / "final" / "model.safetensors")), trainer.model.state_dict()
    for k, v in ours.items():
        torch.testing.assert_close(theirs[k], v, rtol=1e-5, atol=1e-6)


def test_peft_config_trains_lora_adapters_and_save_model_writes_them(tmp_path, model_dirs):
    from peft import LoraConfig

    from fastdpo import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=4)
    trainer = DPOTrainer(model=str(model_dirs("qwen3")), args=args, train_dataset=easy_rows(8),
                         peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    assert trainer.config.train_type == "lora" and trainer.config.lora_rank == 4
    assert trainer.config.target_modules == "q_proj,v_proj"
    trainer.train()
    assert type(trainer.model).__name__.startswith("Peft")
    trainer.save_model(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("make, match", [
    (lambda m: dict(args=_config(remove_unsed_columns=False)), "remove_unsed_columns"),
    (lambda m: dict(data_collator=object()), "data_collator"),
    (lambda m: dict(peft_config=_lora(use_rslora=True)), "use_rslora"),
    (lambda m: dict(callbacks=[_trainer_callback()]), "TrainerCallback"),
])
def test_what_fastdpo_cannot_honour_is_refused_by_name(tmp_path, model_dirs, make, match):
    from fastdpo import DPOTrainer
    from fastdpo.errors import FastDPOError

    with pytest.raises(FastDPOError, match=match):  # DPOConfig refuses an unknown name as it is made
        kw = {"args": _config(output_dir=str(tmp_path)), "train_dataset": easy_rows(4), **make(model_dirs("qwen3"))}
        DPOTrainer(model=str(model_dirs("qwen3")), **kw)


def _config(**kw):
    from fastdpo import DPOConfig

    return DPOConfig(**kw)


def _lora(**kw):
    from peft import LoraConfig

    return LoraConfig(r=4, **kw)


def _trainer_callback():
    from transformers import TrainerCallback

    return TrainerCallback()


def test_a_reference_model_by_name_or_loaded_is_the_reference(tmp_path, model_dirs, monkeypatch):
    """TRL's newer quick start names the model twice (model=NAME, ref_model=NAME); a loaded reference is used as
    it is. Without args, the run writes to TRL's default dir, <model name>-DPO."""
    from transformers import AutoModelForCausalLM

    from fastdpo import DPOConfig, DPOTrainer

    m = str(model_dirs("qwen3"))
    monkeypatch.chdir(tmp_path)
    by_name = DPOTrainer(model=m, ref_model=m, train_dataset=easy_rows(8))
    assert not by_name.config.ref_model and by_name.args.output_dir == f"{model_dirs('qwen3').name}-DPO"
    ref = AutoModelForCausalLM.from_pretrained(m)
    used = []
    loaded = DPOTrainer(model=m, ref_model=ref, args=DPOConfig(output_dir="out", max_steps=1, learning_rate=1e-3),
                        train_dataset=easy_rows(8), callbacks=[_Begin(lambda t: used.append(t.s.reference.model))])
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    result = loaded.train()
    assert result.info["reference"] == "separate" and used == [ref]  # the object given, not a copy from disk
    assert all(torch.equal(v, before[k]) for k, v in ref.state_dict().items())  # the reference stays frozen
    assert any(not torch.equal(v, before[k]) for k, v in loaded.model.state_dict().items())


class _Begin:
    def __init__(self, fn):
        self.on_train_begin = fn
