"""--fp8_base and --fp8 through set-up and the loop, on the CPU (the emulated FP8 products; the device check that
refuses a CPU run is switched off here): the base is converted before the reference's log-probs are computed, so
policy and reference agree exactly at step 0, and the run saves a plain adapter; a full fine-tune with --fp8 runs its
products in FP8 on the policy and on its reference (a frozen copy, or precomputed), agrees with it at step 0, trains,
passes its certificate and saves bf16 weights."""

import json
import math

import pytest
import torch
from data_helpers import easy_rows, write_jsonl
from safetensors.torch import load_file

from fastdpo.config import TrainConfig
from fastdpo.errors import FastDPOError
from fastdpo.kernels.fp8 import Fp8LinearFunction, Fp8TrainLinearFunction
from fastdpo.training import setup
from fastdpo.training.loop import train


def config(tmp_path, model_dir, name, **kw):
    data = write_jsonl(tmp_path / "data.jsonl", easy_rows(16, seed=1))
    base = dict(learning_rate=5e-3, max_steps=3, logging_steps=1, seed=3, per_device_train_batch_size=4,
                train_type="lora", lora_rank=4, lora_alpha=8, lora_dropout=0.0, fp8_base=True)
    return TrainConfig(model=str(model_dir), dataset=[str(data)], output_dir=str(tmp_path / name), **{**base, **kw})


@pytest.mark.parametrize("reference", ["adapter_off", "precompute"])
def test_policy_and_reference_share_the_fp8_base_from_step_0(tmp_path, model_dirs, monkeypatch, reference):
    monkeypatch.setattr(setup, "check_fp8_device", lambda device, flag: None)
    calls = []
    monkeypatch.setattr(Fp8LinearFunction, "apply", lambda *a, _apply=Fp8LinearFunction.apply: calls.append(1) or _apply(*a))
    cfg = config(tmp_path, model_dirs("llama"), reference, precompute_ref_log_probs=reference == "precompute",
                 ref_cache_dir=str(tmp_path / "refs"))
    result = train(cfg, progress=False)
    assert calls  # the base's products ran in FP8
    rows = [json.loads(line) for line in (tmp_path / reference / "metrics.jsonl").read_text().splitlines()]
    # step 0: fresh adapters (B = 0) over the same FP8 base as the reference: every log-ratio is exactly 0
    assert rows[0]["rewards/chosen"] == 0.0 and rows[0]["rewards/rejected"] == 0.0
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert rows[-1]["rewards/margins"] != 0.0  # and the adapters train
    saved = load_file(f"{result['final_dir']}/adapter_model.safetensors")
    assert saved and all("lora_" in k and v.dtype != torch.float8_e4m3fn for k, v in saved.items())


def test_the_precomputed_reference_of_the_fp8_base_has_a_cache_key_of_its_own(tmp_path, model_dirs):
    from fastdpo.dpo.reference import cache_path

    cfg = config(tmp_path, model_dirs("llama"), "key")
    plain = config(tmp_path, model_dirs("llama"), "key", fp8_base=False)
    (fp8_path, parts), (plain_path, _) = cache_path(cfg, [], []), cache_path(plain, [], [])
    assert fp8_path != plain_path and parts["base"] == "fp8_e4m3_rowwise"


def test_a_cpu_run_is_refused_at_set_up(tmp_path, model_dirs):
    """--device auto that resolves to the CPU: refused when the model is set up (--device cpu is refused earlier)."""
    with pytest.raises(FastDPOError, match="--fp8_base needs a CUDA GPU"):
        train(config(tmp_path, model_dirs("llama"), "cpu", max_steps=1), progress=False)


@pytest.mark.parametrize("reference", ["copy", "precompute"])
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_a_full_fine_tune_with_fp8_products_agrees_with_its_reference_at_step_0_and_trains(
        tmp_path, model_dirs, monkeypatch, reference, recipe):
    """Row-wise scales make each token's products its own (float32 here, the certificate's tight tolerance): the
    reference, a frozen copy or precomputed in other batches, agrees with the policy exactly at step 0. Tensor-wise
    scales are shared by every token of a product, so a sequence's log-probs depend a little on its batch mates: run in
    bfloat16 (the dtype FP8 trains in), exact against a frozen copy (the same batch), within rounding of a table
    precomputed in other batches."""
    monkeypatch.setattr(setup, "check_fp8_device", lambda device, flag: None)
    calls = []
    monkeypatch.setattr(Fp8TrainLinearFunction, "apply",
                        lambda *a, _apply=Fp8TrainLinearFunction.apply: calls.append(1) or _apply(*a))
    name = f"{reference}-{recipe}"
    cfg = config(tmp_path, model_dirs("llama"), name, train_type="full", fp8_base=False, fp8=True, fp8_recipe=recipe,
                 learning_rate=1e-3, precompute_ref_log_probs=reference == "precompute",
                 ref_cache_dir=str(tmp_path / "refs"), torch_dtype="float32" if recipe == "rowwise" else "bfloat16")
    result = train(cfg, progress=False)
    assert calls  # the projections' products ran in FP8
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    first = (rows[0]["rewards/chosen"], rows[0]["rewards/rejected"])
    if recipe == "rowwise" or reference == "copy":
        assert first == (0.0, 0.0)  # the same products at step 0
    else:
        assert 0 < max(map(abs, first)) < 0.05  # other batch mates at precompute time: rounding, no more
    assert rows[-1]["rewards/margins"] != 0.0
    summary = json.loads((tmp_path / name / "summary.json").read_text())
    assert summary["certificate"]["status"] == "PASS", summary["certificate"]
    assert json.loads((tmp_path / name / "plan.json").read_text())["products"] == f"fp8_{recipe}"
    saved = load_file(f"{result['final_dir']}/model.safetensors")
    assert all(v.dtype != torch.float8_e4m3fn for v in saved.values())  # the weights train and save in their dtype
