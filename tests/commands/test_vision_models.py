"""The after-training commands with a vision-language model dir (tiny Qwen2.5-VL on CPU, float32): eval's preference
metrics of rows with images equal the plain computation (the model's own forwards, adapter on and off); eval refuses
rows with images for a text-only model; infer with images generates what the model's own `generate` gives on its
processor's inputs, base and tuned side by side, and refuses images it cannot use."""

import dataclasses
import math

import pytest
import torch
from data_helpers import write_jsonl
from vlm_helpers import image_rows, random_vlm_adapter, sequence_logp

from fastdpo.commands.evaluate import EvalConfig, run_eval
from fastdpo.errors import FastDPOError
from fastdpo.model.tiny import build_tiny_vlm_dir

BETA = 0.1


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """(base dir, random adapter dir, data file of rows with images)."""
    root = tmp_path_factory.mktemp("vlm")
    base = build_tiny_vlm_dir(root / "model", "qwen2_5_vl")
    return base, random_vlm_adapter(base, root / "adapter"), write_jsonl(root / "data.jsonl", image_rows(root))


def eval_config(tmp_path, base, data, **kw) -> EvalConfig:
    return EvalConfig(**{"model": str(base), "dataset": [str(data)], "output_dir": str(tmp_path / "eval"),
                         "device": "cpu", "torch_dtype": "float32", "beta": BETA, **kw})


def test_eval_of_rows_with_images_equals_the_plain_computation(tmp_path, vlm):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from fastdpo.data.load import load_rows
    from fastdpo.data.prepare import DataOptions, tokenize_rows
    from fastdpo.model.processor import load_processor

    base, adapter, data = vlm
    cfg = eval_config(tmp_path, base, data, adapters=str(adapter))
    report = run_eval(cfg)
    m = report["metrics"]
    assert report["pairs"] == 4 and report["reference"] == "adapter_off"

    opts = DataOptions.for_scoring(cfg)
    opts = dataclasses.replace(opts, read=dataclasses.replace(opts.read, images=True))
    pairs, _ = tokenize_rows(load_rows([str(data)], read=opts.read), None, opts, processor=load_processor(base))
    assert sum(p.num_images for p in pairs) == 4
    model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(base), adapter).eval()
    with torch.no_grad():
        pol = torch.tensor([[sequence_logp(model, p, p.chosen), sequence_logp(model, p, p.rejected)] for p in pairs])
        with model.disable_adapter():
            ref = torch.tensor([[sequence_logp(model, p, p.chosen), sequence_logp(model, p, p.rejected)]
                                for p in pairs])
    rewards = BETA * (pol - ref)
    margins = rewards[:, 0] - rewards[:, 1]
    assert margins.abs().min() > 1e-3  # the adapter moves every pair: the comparison can fail
    want = {"rewards/chosen": rewards[:, 0].mean(), "rewards/rejected": rewards[:, 1].mean(),
            "rewards/margins": margins.mean(), "rewards/accuracies": (margins > 0).float().mean(),
            "logps/chosen": pol[:, 0].mean(), "logps/rejected": pol[:, 1].mean(),
            "loss": -torch.nn.functional.logsigmoid(margins).mean()}
    for name, value in want.items():
        assert m[name] == pytest.approx(float(value), abs=1e-4), name
    assert math.isfinite(m["kl"]) and m["kl"] > 0


def test_eval_without_an_adapter_has_zero_margins_against_itself(tmp_path, vlm):
    base, _, data = vlm
    m = run_eval(eval_config(tmp_path, base, data, ref_model=str(base)))["metrics"]
    assert m["rewards/margins"] == pytest.approx(0.0, abs=1e-5) and m["loss"] == pytest.approx(math.log(2), abs=1e-5)


def test_eval_refuses_rows_with_images_for_a_text_only_model(tmp_path, vlm, model_dirs):
    with pytest.raises(FastDPOError, match=r"data.jsonl:1.*text-only"):
        run_eval(eval_config(tmp_path, model_dirs("qwen3"), vlm[2]))
