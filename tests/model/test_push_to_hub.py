"""--push_to_hub / --hub_model_id upload final/ (or export's merged model) through huggingface_hub, here against a local
stand-in of its upload API; pushes that cannot happen are refused before training. --template NAME of another tool
means the same on the command line and in YAML."""

import logging
import shutil
from pathlib import Path

import huggingface_hub
import pytest
import yaml
from cli_helpers import run_cli
from data_helpers import easy_rows, write_jsonl

from fastdpo.cli import build_parser
from fastdpo.config import TrainConfig, build_config
from fastdpo.errors import FastDPOError


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A local stand-in for the Hub: create_repo / upload_folder copy files under tmp_path/hub/REPO."""
    root = tmp_path / "hub"
    calls = []

    def create_repo(self, repo_id, repo_type=None, private=False, exist_ok=False, **kw):
        calls.append(("create", repo_id, private))
        full = repo_id if "/" in repo_id else f"me/{repo_id}"  # the hub puts a bare name in the user's namespace
        (root / full).mkdir(parents=True, exist_ok=True)
        return huggingface_hub.RepoUrl(f"https://huggingface.co/{full}")

    def upload_folder(self, folder_path, repo_id, repo_type=None, commit_message=None, **kw):
        calls.append(("upload", repo_id, commit_message))
        shutil.copytree(folder_path, root / repo_id, dirs_exist_ok=True)

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return root, calls


def parse(*flags):
    return build_config(build_parser().parse_args(["train", *flags]), TrainConfig)


def test_training_pushes_final(tmp_path, model_dirs, hub, capsys, restore_logging):
    root, calls = hub
    data = write_jsonl(tmp_path / "d.jsonl", easy_rows(8))
    rc, out = run_cli(capsys, "train", "--model", model_dirs(), "--dataset", data, "--output_dir", tmp_path / "run",
                      "--train_type", "lora", "--max_steps", "1", "--per_device_train_batch_size", "4",
                      "--push_to_hub", "--hub_model_id", "me/tiny-dpo", "--hub_private_repo", "true")
    assert rc == 0, out
    assert calls[0] == ("create", "me/tiny-dpo", True) and calls[1][:2] == ("upload", "me/tiny-dpo")
    assert (root / "me/tiny-dpo" / "adapter_config.json").is_file()
    assert "--push_to_hub: uploaded the LoRA adapter in" in out and "https://huggingface.co/me/tiny-dpo" in out


def test_export_pushes_the_merged_model(tmp_path, lora_run, hub, capsys):
    root, calls = hub
    _, adapter, _ = lora_run
    rc, out = run_cli(capsys, "export", "--adapters", adapter, "--merge_lora", "--output_dir", tmp_path / "merged",
                      "--push_to_hub", "true")
    assert rc == 0, out
    assert calls[0] == ("create", "merged", False) and calls[1][1] == "me/merged"
    assert (root / "me/merged" / "model.safetensors").is_file() and "uploaded" in out


def test_pushes_that_cannot_happen_are_refused_before_training(monkeypatch, caplog):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FastDPOError, match="--push_to_hub with HF_HUB_OFFLINE=1: nothing can be uploaded"):
        parse("--model", "m", "--dataset", "d", "--push_to_hub").validate_training()
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(FastDPOError, match="--hub_token: give the token as HF_TOKEN"):
        parse("--model", "m", "--dataset", "d", "--push_to_hub", "--hub_token", "hf_secret")
    caplog.set_level(logging.WARNING, logger="fastdpo")
    parse("--model", "m", "--dataset", "d", "--hub_model_id", "me/x").validate_training()
    assert "--hub_model_id me/x without --push_to_hub: nothing is uploaded" in caplog.text


def test_a_failed_upload_says_where_the_model_is(tmp_path, monkeypatch):
    from fastdpo.model.upload import push_folder

    def offline(self, *a, **k):
        raise ConnectionError("no network")

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", offline)
    with pytest.raises(FastDPOError, match=r"uploading .*final to me/x failed \(no network\)\. The model is saved in "
                                           r".*final; upload it with `hf upload me/x "):
        push_folder(tmp_path / "final", "me/x")


@pytest.mark.parametrize("name", ["qwen3", "qwen2_5", "glm4"])
def test_another_tools_template_name_means_the_same_on_the_command_line_and_in_yaml(tmp_path, caplog, name):
    caplog.set_level(logging.INFO, logger="fastdpo")
    cli = parse("--model", "m", "--dataset", "d.jsonl", "--template", name)
    y = tmp_path / "run.yaml"
    y.write_text(yaml.safe_dump({"model": "m", "dataset": ["d.jsonl"], "template": name}))
    from_yaml = parse("--config", str(y))
    lf = tmp_path / "lf.yaml"
    lf.write_text(yaml.safe_dump({"model_name_or_path": "m", "stage": "dpo", "dataset": "d.jsonl", "template": name}))
    from_lf = parse("--config", str(lf))
    assert cli.template == from_yaml.template == from_lf.template == ""
    cli.validate_data()
    assert caplog.text.count(f"--template {name}: ms-swift's and LLaMA-Factory's template names") == 3


def test_a_misspelt_built_in_template_is_refused_everywhere(tmp_path):
    with pytest.raises(FastDPOError, match="neither a built-in"):
        parse("--model", "m", "--dataset", "d.jsonl", "--template", "chatlm").validate_data()
    y = tmp_path / "run.yaml"
    y.write_text(yaml.safe_dump({"model": "m", "dataset": ["d.jsonl"], "template": "chatlm"}))
    with pytest.raises(FastDPOError, match="neither a built-in"):
        parse("--config", str(y)).validate_data()
    assert Path(tmp_path).exists()
