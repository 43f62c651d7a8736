"""`fastdpo verify --run DIR`: a finished run's certificate checked again on its saved model passes for sound runs
(full fine-tuning, LoRA, a precomputed reference), fails when the saved weights or the reference changed since
training, and says what to do when there is nothing to check."""

import json

import pytest
import torch
from cli_helpers import run_cli
from data_helpers import easy_rows, write_jsonl
from safetensors.torch import load_file, save_file

from fastdpo.commands.verify_run import verify_saved_run
from fastdpo.config import TrainConfig
from fastdpo.errors import FastDPOError
from fastdpo.model.tiny import build_tiny_model
from fastdpo.training.loop import train


@pytest.fixture(autouse=True)
def _logging(restore_logging):
    pass


def trained(tmp_path, base, name, **kw):
    data = tmp_path / "data.jsonl"
    if not data.exists():
        write_jsonl(data, easy_rows(16, seed=4))
    cfg = TrainConfig(**{**dict(model=str(base), dataset=[str(data)], output_dir=str(tmp_path / name), device="cpu",
                                max_steps=2, learning_rate=1e-3, per_device_train_batch_size=4, save_steps=0,
                                disable_progress=True), **kw})
    train(cfg, progress=False)
    return tmp_path / name


def checks(cert) -> dict:
    return {c.name: c for c in cert.checks}


@pytest.mark.parametrize("kw", [{}, {"train_type": "lora"}, {"precompute_ref_log_probs": True}],
                         ids=["full", "lora", "precompute"])
def test_a_sound_run_passes_again_on_its_saved_model(tmp_path, model_dirs, kw):
    if kw.get("precompute_ref_log_probs"):
        kw["ref_cache_dir"] = str(tmp_path / "cache")
    out = trained(tmp_path, model_dirs("qwen3"), "run", **kw)
    record = json.loads((out / "summary.json").read_text())["certificate"]["record"]
    assert len(record["indices"]) == 2 and len(record["sums"]) == len(record["ref_sums"]) == 4
    cert = verify_saved_run(str(out))
    c = checks(cert)
    assert cert.status == "PASS", [x.line() for x in cert.checks]
    assert set(c) == {"saved_model", "fast_path", "head_float32", "reference", "reference_apart"}
    assert c["saved_model"].measured <= 1e-6 and c["reference"].measured <= 1e-6
    assert c["reference_apart"].measured > 0
    assert ("precomputed table" in c["reference"].detail) == bool(kw.get("precompute_ref_log_probs"))


def test_saved_weights_changed_after_training_fail(tmp_path, model_dirs, capsys):
    """Weights edited in final/ after the run (a bad copy, a conversion that changed them): the saved model no longer
    gives the recorded log-probs; the command says FAIL and exits 1."""
    out = trained(tmp_path, model_dirs("qwen3"), "run")
    path = out / "final" / "model.safetensors"
    weights = load_file(str(path))
    name = next(k for k in weights if "mlp.down_proj" in k)
    weights[name] = weights[name] * 1.5
    save_file(weights, str(path), metadata={"format": "pt"})
    rc, text = run_cli(capsys, "verify", "--run", out, "--json", tmp_path / "v.json")
    assert rc == 1 and "certificate saved_model: FAIL" in text and f"{out}: certificate FAIL" in text
    report = json.loads((tmp_path / "v.json").read_text())
    assert report["status"] == "FAIL" and report["checks"][0]["name"] == "saved_model"


def test_a_base_model_changed_since_training_fails_the_reference(tmp_path):
    """LoRA adapters are saved alone, on the base model the run named: a base overwritten since training changes
    both the saved policy and the reference, and both checks say so."""
    base = build_tiny_model(tmp_path / "base", "llama", seed=0)
    out = trained(tmp_path, base, "run", train_type="lora")
    assert verify_saved_run(str(out)).status == "PASS"
    build_tiny_model(tmp_path / "base", "llama", seed=1)  # another model under the same path
    c = checks(verify_saved_run(str(out)))
    assert c["saved_model"].status == "FAIL" and c["reference"].status == "FAIL"


def test_nothing_to_check_says_what_to_do(tmp_path, model_dirs, capsys):
    out = trained(tmp_path, model_dirs("qwen3"), "off", certificate="off")
    with pytest.raises(FastDPOError, match="recorded no certificate.*--certificate off"):
        verify_saved_run(str(out))
    with pytest.raises(FastDPOError, match="no final/ model or summary.json"):
        verify_saved_run(str(tmp_path / "nowhere"))
    rc, text = run_cli(capsys, "verify")
    assert rc != 0 and "--model and --dataset" in text and "--run DIR" in text


def test_data_changed_since_training_is_named(tmp_path, model_dirs):
    out = trained(tmp_path, model_dirs("qwen3"), "run")
    rows = easy_rows(16, seed=4)
    for r in rows:
        r["chosen"] += " w3 w4"
    write_jsonl(tmp_path / "data.jsonl", rows)
    with pytest.raises(FastDPOError, match="changed since training"):
        verify_saved_run(str(out))


def test_the_record_is_the_last_weights(tmp_path, model_dirs):
    """The recorded sums are the trained policy's (they moved from the reference's by the run's updates)."""
    out = trained(tmp_path, model_dirs("qwen3"), "run")
    record = json.loads((out / "summary.json").read_text())["certificate"]["record"]
    assert not torch.allclose(torch.tensor(record["sums"]), torch.tensor(record["ref_sums"]))
    assert record["dtype"] == "float32"
