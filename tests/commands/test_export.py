"""`fastdpo export --merge_lora`: a standalone model dir that generates exactly what base + adapter generates."""

import json

import pytest
import torch
from cli_helpers import run_cli
from transformers import AutoModelForCausalLM

from fastdpo.commands.export import ExportConfig, merge_lora
from fastdpo.model.generate import GenerationArgs, ModelArgs, generate_ids, load_for_generation

PROMPTS = ["w10 w11", "w12", "w13 w14 w15 w16 w17", "w40 w22 w31", "w50 w51 w52"]


def random_adapter(base_dir, out_dir):
    """A LoRA adapter with random (non-zero) A and B on every linear layer: a large, easy-to-see change."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    cfg = LoraConfig(r=4, lora_alpha=16, target_modules="all-linear", init_lora_weights=False, task_type="CAUSAL_LM")
    get_peft_model(model, cfg).save_pretrained(out_dir)
    return out_dir


def assert_same_generation(base, adapter, merged, max_new_tokens):
    gen = GenerationArgs(max_new_tokens=max_new_tokens)
    tuned = load_for_generation(ModelArgs(model=str(base), adapters=str(adapter)))
    alone = load_for_generation(ModelArgs(model=str(merged)))
    assert not hasattr(alone.model, "peft_config")  # a plain transformers model
    want = generate_ids(tuned.model, tuned.tokenizer, PROMPTS, gen)
    assert generate_ids(alone.model, alone.tokenizer, PROMPTS, gen) == want
    with tuned.base_model() as b:
        assert generate_ids(b, tuned.tokenizer, PROMPTS, gen) != want  # the adapter matters: the test can fail
    ids = torch.tensor([alone.tokenizer(PROMPTS[2])["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(alone.model(ids).logits, tuned.model(ids).logits, rtol=1e-4, atol=1e-4)


def test_merged_export_generates_like_base_plus_adapter(tmp_path, capsys, lora_run):
    base, adapter, _ = lora_run
    out = tmp_path / "merged"
    rc, text = run_cli(capsys, "export", "--model", base, "--adapters", adapter, "--merge_lora", "--output_dir", out)
    assert rc == 0, text
    assert f"wrote {out}: a copy of {base} with the adapter {adapter} merged into its weights" in text, text
    assert f"({base} is unchanged)" in text and f"into {base}:" not in text, text
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    assert "adapter_config.json" not in names and not (tmp_path / ".merged.tmp").exists()
    assert json.loads((out / "fastdpo.json").read_text())["merged_from"]["adapters"] == str(adapter)
    assert_same_generation(base, adapter, out, max_new_tokens=8)


def test_merge_of_a_large_adapter_is_token_exact(tmp_path, model_dirs):
    base = model_dirs("llama")
    adapter = random_adapter(base, tmp_path / "adapter")
    out = merge_lora(ExportConfig(model=str(base), adapters=str(adapter), merge_lora=True,
                                  output_dir=str(tmp_path / "merged")))
    assert_same_generation(base, adapter, out, max_new_tokens=16)


def test_export_keeps_the_stored_dtype_unless_asked(tmp_path, model_dirs):
    base = model_dirs("qwen2")
    adapter = random_adapter(base, tmp_path / "adapter")
    out = merge_lora(ExportConfig(model=str(base), adapters=str(adapter), merge_lora=True,
                                  output_dir=str(tmp_path / "a")))
    assert AutoModelForCausalLM.from_pretrained(out, dtype="auto").dtype == torch.float32
    out = merge_lora(ExportConfig(model=str(base), adapters=str(adapter), merge_lora=True,
                                  output_dir=str(tmp_path / "b"), torch_dtype="bfloat16"))
    assert AutoModelForCausalLM.from_pretrained(out, dtype="auto").dtype == torch.bfloat16


def test_export_errors(tmp_path, capsys, model_dirs):
    base = model_dirs("llama")
    adapter = random_adapter(base, tmp_path / "adapter")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    cases = [
        (["--adapters", adapter, "--output_dir", tmp_path / "o"], ["--merge_lora"]),
        (["--adapters", adapter, "--merge_lora", "--output_dir", busy], ["not empty"]),
        (["--adapters", adapter, "--merge_lora", "--output_dir", adapter], ["same directory", "--adapters"]),
        (["--adapters", base, "--merge_lora", "--output_dir", tmp_path / "o"], ["full model"]),
        (["--adapters", tmp_path / "nope", "--merge_lora", "--output_dir", tmp_path / "o"], ["not found"]),
    ]
    for args, needles in cases:
        rc, text = run_cli(capsys, "export", "--model", base, *args)
        assert rc == 1, text
        for n in needles:
            assert n in text, text
    assert not (tmp_path / "o").exists()


def test_export_defaults_next_to_the_adapter(tmp_path, capsys, model_dirs):
    """`fastdpo export --adapters DIR --merge_lora true`, ms-swift's command: the merged model goes to DIR-merged,
    the base is the one the adapter names; a second export refuses to overwrite it."""
    base = model_dirs("llama")
    adapter = random_adapter(base, tmp_path / "checkpoint-4")
    rc, text = run_cli(capsys, "export", "--adapters", str(adapter) + "/", "--merge_lora", "true")
    assert rc == 0, text
    assert (tmp_path / "checkpoint-4-merged" / "config.json").is_file()
    assert_same_generation(base, adapter, tmp_path / "checkpoint-4-merged", max_new_tokens=4)
    rc, text = run_cli(capsys, "export", "--adapters", adapter, "--merge_lora", "true")
    assert rc == 1 and "exists and is not empty" in text, text


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "llava"])
def test_merge_of_an_adapter_on_a_vision_language_model_keeps_its_processor(tmp_path, family):
    from peft import PeftModel
    from PIL import Image
    from transformers import AutoModelForImageTextToText
    from vlm_helpers import build_vlm_dir, image_rows, random_vlm_adapter

    from fastdpo.model.processor import load_processor

    base = build_vlm_dir(tmp_path / "vlm", family)
    adapter = random_vlm_adapter(base, tmp_path / "adapter")
    out = merge_lora(ExportConfig(model=str(base), adapters=str(adapter), merge_lora=True,
                                  output_dir=str(tmp_path / "merged")))
    image_config = "processor_config.json" if family == "llava" else "preprocessor_config.json"
    assert {image_config, "chat_template.jinja", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    processor = load_processor(out)
    row = image_rows(tmp_path)[1]
    images = [Image.open(p).convert("RGB") for p in row["images"]]
    messages = [{"role": "user", "content": [{"type": "text", "text": "w3 "}, {"type": "image"},
                                             {"type": "text", "text": "w4 "}, {"type": "image"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=images, return_tensors="pt")
    merged = AutoModelForImageTextToText.from_pretrained(out).eval()
    tuned = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(base), adapter).eval()
    with torch.no_grad():
        want = tuned(**inputs).logits
        torch.testing.assert_close(merged(**inputs).logits, want, rtol=1e-4, atol=1e-4)
        with tuned.disable_adapter():
            assert not torch.allclose(tuned(**inputs).logits, want, atol=1e-3)  # the adapter matters
