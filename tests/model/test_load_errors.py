"""Loading a model or tokenizer fails fast with a message, never a traceback or a minute of retries: a misspelt
dir, an id the hub cannot give (offline, unreachable), a damaged weight file, and code named by auto_map, which runs
only with --trust_remote_code."""

import json
import shutil
import time

import pytest
import torch
from cli_helpers import run_cli
from data_helpers import easy_rows, write_jsonl

from fastdpo.errors import FastDPOError
from fastdpo.model.load import load_model, load_tokenizer

CPU = torch.device("cpu")


@pytest.fixture
def model_copy(tmp_path, model_dirs):
    m = tmp_path / "m"
    shutil.copytree(model_dirs("qwen3"), m)
    return m


@pytest.fixture
def no_hub(monkeypatch):
    """The hub and transformers' loaders made to fail at once, as with no network: a test never waits on retries."""
    import transformers

    calls = []

    def unreachable(*a, **k):
        calls.append(a)
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them in "
                      "the cached files.")

    for cls in (transformers.AutoTokenizer, transformers.AutoConfig, transformers.AutoModelForCausalLM):
        monkeypatch.setattr(cls, "from_pretrained", unreachable)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    return calls


# ---------------------------------------------------------------- where the model comes from


def test_a_misspelt_local_dir_says_so_with_the_close_match(tmp_path, model_dirs, monkeypatch, no_hub):
    (tmp_path / "models").mkdir()
    shutil.copytree(model_dirs("qwen3"), tmp_path / "models" / "qwen3")
    monkeypatch.chdir(tmp_path)
    for path in ("./modls/qwen3", str(tmp_path / "models" / "qwen33")):
        with pytest.raises(FastDPOError, match=r"no local dir .* exists \(did you mean .*models/qwen3\?\)"):
            load_tokenizer(path)
        with pytest.raises(FastDPOError, match=r"no local dir .* exists \(did you mean .*models/qwen3\?\)"):
            load_model(path, torch.float32, CPU)
    assert not no_hub


def test_an_id_that_is_not_a_dir_offline_fails_at_once(tmp_path, monkeypatch, no_hub):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    start = time.monotonic()
    with pytest.raises(FastDPOError, match=r"no local dir modls exists \(did you mean models\?\).*HF_HUB_OFFLINE"):
        load_tokenizer("modls")
    with pytest.raises(FastDPOError, match=r"--model org/no-such-model: no local dir .* not in the local HF cache"):
        load_model("org/no-such-model", torch.float32, CPU)
    assert time.monotonic() - start < 5 and not no_hub


def test_a_hub_that_cannot_be_reached_is_said_once_with_what_to_do(monkeypatch, no_hub):
    from fastdpo.model import source

    asked = []
    monkeypatch.setattr(source, "hub_problem", lambda repo: asked.append(repo) or "unreachable (Name or service "
                        "not known)")
    with pytest.raises(FastDPOError, match=r"no local dir org/name exists, and the Hugging Face hub could not be "
                       r"reached.*Name or service not known.*check the id and the network, or set HF_HUB_OFFLINE=1"):
        load_tokenizer("org/name")
    assert asked == ["org/name"] and not no_hub  # one request, no retries, transformers never asked


def test_an_id_the_hub_does_not_have(monkeypatch, no_hub):
    from fastdpo.model import source

    monkeypatch.setattr(source, "hub_problem", lambda repo: "not found")
    with pytest.raises(FastDPOError, match="the hub has no model org/name.*Check the path or the id"):
        load_model("org/name", torch.float32, CPU, flag="ref_model")


def test_train_with_an_offline_id_is_one_clean_message(tmp_path, capsys, monkeypatch, restore_logging):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = write_jsonl(tmp_path / "d.jsonl", easy_rows(8))
    start = time.monotonic()
    code, out = run_cli(capsys, "train", "--model", "org/no-such-model", "--dataset", data, "--output_dir",
                        tmp_path / "out", "--max_steps", "1")
    assert code != 0 and "HF_HUB_OFFLINE" in out and "no local dir org/no-such-model" in out, out
    assert "Traceback" not in out and "Retrying" not in out and time.monotonic() - start < 30, out


# ---------------------------------------------------------------- damaged weights


@pytest.mark.parametrize("cut", ["half", "header"])
def test_a_truncated_safetensors_file_is_named_with_what_to_do(model_copy, cut):
    f = model_copy / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if cut == "half" else data[:5])
    with pytest.raises(FastDPOError, match=rf"{f} is .*bytes.*damaged or was not copied or downloaded completely\. "
                       "Copy or download it again"):
        load_model(str(model_copy), torch.float32, CPU)


def test_train_with_a_truncated_model_is_one_clean_message(model_copy, tmp_path, capsys, restore_logging):
    f = model_copy / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    data = write_jsonl(tmp_path / "d.jsonl", easy_rows(8))
    code, out = run_cli(capsys, "train", "--model", model_copy, "--dataset", data, "--output_dir", tmp_path / "out",
                        "--max_steps", "1")
    assert code != 0 and str(f) in out and "download it again" in out and "Traceback" not in out, out


# ---------------------------------------------------------------- code named by auto_map


def test_config_auto_map_is_refused_without_trust_remote_code(model_copy, tmp_path):
    marker = tmp_path / "code-ran"
    cfg = json.loads((model_copy / "config.json").read_text())  # model_type stays qwen3: a built-in class exists
    cfg["auto_map"] = {"AutoConfig": "modeling_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (model_copy / "config.json").write_text(json.dumps(cfg))
    (model_copy / "modeling_x.py").write_text(f"import os\nos.mkdir({str(marker)!r})\n")
    with pytest.raises(FastDPOError, match=r"config.json names its own model code .*modeling_x.py.*"
                       r"--trust_remote_code true.*built-in qwen3 classes"):
        load_model(str(model_copy), torch.float32, CPU)
    assert not marker.exists()


def test_tokenizer_auto_map_is_refused_without_trust_remote_code(model_copy, tmp_path):
    marker = tmp_path / "code-ran"
    cfg = json.loads((model_copy / "tokenizer_config.json").read_text())
    cfg["auto_map"] = {"AutoTokenizer": ["tokenization_x.XTokenizer", None]}
    (model_copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    (model_copy / "tokenization_x.py").write_text(f"import os\nos.mkdir({str(marker)!r})\n")
    with pytest.raises(FastDPOError, match=r"tokenizer_config.json names its own tokenizer code .*tokenization_x.py"
                       r".*--trust_remote_code true"):
        load_tokenizer(str(model_copy))
    assert not marker.exists()


def test_failing_tokenizer_code_under_trust_remote_code_is_a_message(model_copy):
    cfg = json.loads((model_copy / "tokenizer_config.json").read_text())
    cfg["auto_map"] = {"AutoTokenizer": ["tokenization_x.XTokenizer", None]}
    (model_copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    (model_copy / "tokenization_x.py").write_text("raise RuntimeError('needs a package that is not installed')\n")
    with pytest.raises(FastDPOError, match=r"tokenizer code of .* \(run by --trust_remote_code\) failed: "
                       "RuntimeError: needs a package that is not installed"):
        load_tokenizer(str(model_copy), trust_remote_code=True)


def test_train_refuses_custom_code_in_one_message(model_copy, tmp_path, capsys, restore_logging):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (model_copy / "config.json").write_text(json.dumps(cfg))
    data = write_jsonl(tmp_path / "d.jsonl", easy_rows(8))
    code, out = run_cli(capsys, "train", "--model", model_copy, "--dataset", data, "--output_dir", tmp_path / "out",
                        "--max_steps", "1")
    assert code != 0 and "--trust_remote_code true" in out and "Traceback" not in out, out
    assert not (tmp_path / "out" / "final").exists()
