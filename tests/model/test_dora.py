"""DoRA adapters (--use_dora): trained through PEFT's own forward, the reference with the adapters off, saved with
their magnitude vectors, merged by `fastdpo export --merge_lora`; one step's gradients as PEFT's DoRA computed
plainly."""

import json
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from data_helpers import easy_rows, write_jsonl
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from fastdpo.cli import build_parser
from fastdpo.commands.export import ExportConfig, merge_lora
from fastdpo.config import TrainConfig, build_config
from fastdpo.errors import FastDPOError
from fastdpo.model import lora
from fastdpo.training.loop import train
from fastdpo.training.trainer import Trainer


def dora_config(tmp_path, base, **kw) -> TrainConfig:
    data = write_jsonl(tmp_path / "train.jsonl", easy_rows(32, seed=1))
    return TrainConfig(**{**dict(model=str(base), dataset=[str(data)], output_dir=str(tmp_path / "out"),
                                 train_type="lora", use_dora=True, lora_rank=4, lora_alpha=8, lora_dropout=0.0,
                                 learning_rate=1e-2, beta=0.5, max_steps=4, per_device_train_batch_size=4,
                                 seed=3), **kw})


def test_dora_trains_saves_its_magnitudes_and_merges(tmp_path, model_dirs, one_thread, caplog):
    caplog.set_level(logging.INFO, logger="fastdpo")
    base = model_dirs("qwen3")
    result = train(dora_config(tmp_path, base), progress=False)
    assert lora.DORA_NOTE in caplog.text
    losses = [json.loads(line)["loss"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 4 and losses[-1] != losses[0]
    final = Path(result["final_dir"])
    assert json.loads((final / "adapter_config.json").read_text())["use_dora"] is True
    saved = load_file(final / "adapter_model.safetensors")
    assert any("lora_magnitude_vector" in name for name in saved)

    merged = merge_lora(ExportConfig(model=str(base), adapters=str(final), merge_lora=True,
                                     output_dir=str(tmp_path / "merged")))
    ids = torch.randint(4, 60, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        tuned = PeftModel.from_pretrained(plain, final).eval()(input_ids=ids).logits
        out = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()(input_ids=ids).logits
    torch.testing.assert_close(out, tuned, rtol=1e-4, atol=1e-4)


def seq_logp(model, prompt, completion) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0].float(), -1)
    return sum(logp[t - 1, ids[0, t]] for t in range(len(prompt), ids.shape[1]))


def test_a_dora_step_has_peft_s_plain_gradients(tmp_path, model_dirs, one_thread):
    """After one step (B no longer zero), the next step's gradients of A, B and the magnitudes equal those of PEFT's
    DoRA model on separate forwards, full logits, float32, with the reference its adapters off."""
    base = model_dirs("qwen3")
    cfg = dora_config(tmp_path, base, max_grad_norm=0.0, attn_impl="dense", kernels="torch")
    trainer = Trainer(cfg)
    trainer.step()
    pairs = trainer.next_pairs()
    model = trainer.s.model
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    grads = {}
    hooks = [p.register_post_accumulate_grad_hook(lambda p, n=n: grads.__setitem__(n, p.grad.detach().clone()))
             for n, p in model.named_parameters() if p.requires_grad]
    trainer.step(pairs)
    for h in hooks:
        h.remove()

    torch.manual_seed(0)
    plain = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager"),
                           LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", use_dora=True,
                                      task_type="CAUSAL_LM"))
    missing = plain.load_state_dict(before, strict=False)
    assert not missing.unexpected_keys
    with torch.no_grad(), plain.disable_adapter():
        ref = [(seq_logp(plain, p.prompt, p.chosen), seq_logp(plain, p.prompt, p.rejected)) for p in pairs]
    loss = sum(-F.logsigmoid(cfg.beta * ((seq_logp(plain, p.prompt, p.chosen) - rc)
                                          - (seq_logp(plain, p.prompt, p.rejected) - rr)))
               for p, (rc, rr) in zip(pairs, ref)) / len(pairs)
    loss.backward()
    expected = {n: p.grad for n, p in plain.named_parameters() if p.requires_grad}
    assert set(expected) == set(grads) and any("lora_magnitude_vector" in n for n in grads)
    for n, g in expected.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-6, msg=n)


def test_dora_flags_of_each_tool(tmp_path):
    def parse(*flags):
        return build_config(build_parser().parse_args(["train", "--model", "m", "--dataset", "d.jsonl", *flags]),
                            TrainConfig)

    assert parse("--rlhf_type", "dpo", "--use_dora", "true").use_dora  # ms-swift (LoRA by default there)
    assert parse("--use_peft", "--use_dora").use_dora  # TRL's bare flag
    yaml_file = tmp_path / "dpo.yaml"
    yaml_file.write_text("stage: dpo\nfinetuning_type: lora\nuse_dora: true\n")
    assert parse("--config", str(yaml_file)).use_dora  # LLaMA-Factory
    with pytest.raises(FastDPOError, match="--use_dora set, but --train_type is full"):
        parse("--use_dora", "true")
    with pytest.raises(FastDPOError, match="--use_dora trains DoRA adapters"):
        TrainConfig(model="m", dataset=["d.jsonl"], use_dora=True).validate()
