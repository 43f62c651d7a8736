"""Bad input gets one clear message and a non-zero exit, never a traceback."""

import os
import subprocess
import sys

import pytest
from data_helpers import easy_rows, write_jsonl


def fastdpo(*args, cwd=None):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "fastdpo", *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=300)


def assert_clean_error(res, *needles):
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert "Traceback" not in out, out
    for n in needles:
        assert n in out, out


@pytest.fixture
def data(tmp_path):
    return write_jsonl(tmp_path / "d.jsonl", easy_rows(8))


def test_missing_dataset_file(tmp_path, model_dirs):
    res = fastdpo("train", "--model", str(model_dirs()), "--dataset", str(tmp_path / "nope.jsonl"),
                  "--output_dir", str(tmp_path / "o"))
    assert_clean_error(res, "nope.jsonl", "not found")


def test_missing_field_names_line(tmp_path, model_dirs):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": "b"}\n')
    res = fastdpo("train", "--model", str(model_dirs()), "--dataset", str(bad), "--output_dir", str(tmp_path / "o"))
    assert_clean_error(res, "bad.jsonl:2", "'rejected'", "missing")


def test_invalid_json_names_line(tmp_path, model_dirs):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n\n{"prompt": "a", \n')
    res = fastdpo("train", "--model", str(model_dirs()), "--dataset", str(bad), "--output_dir", str(tmp_path / "o"))
    assert_clean_error(res, "bad.jsonl:3", "invalid JSON")


def test_unknown_flag_suggests(tmp_path, data, model_dirs):
    res = fastdpo("train", "--model", str(model_dirs()), "--dataset", str(data), "--learning_rat", "1e-5")
    assert_clean_error(res, "unrecognized", "--learning_rate")


def test_model_dir_without_tokenizer(tmp_path, data, model_dirs):
    import shutil

    m = tmp_path / "m"
    shutil.copytree(model_dirs(), m)
    for f in m.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            f.unlink()
    res = fastdpo("train", "--model", str(m), "--dataset", str(data), "--output_dir", str(tmp_path / "o"))
    assert_clean_error(res, "no tokenizer files")


def test_adapter_dir_given_as_model_names_its_base(tmp_path, data, model_dirs):
    import json
    import shutil

    base = model_dirs()
    bare, with_tokenizer = tmp_path / "lora", tmp_path / "lora_tok"
    for d in (bare, with_tokenizer):
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": str(base)}))
    for f in base.iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, with_tokenizer)
    for adapter in (bare, with_tokenizer):
        res = fastdpo("train", "--model", str(adapter), "--dataset", str(data), "--output_dir", str(tmp_path / "o"))
        assert_clean_error(res, f"--model {adapter} is a LoRA adapter trained on {base}",
                           f"--model {base} --adapters {adapter}")


def test_unwritable_output_dir(tmp_path, data, model_dirs):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    res = fastdpo("train", "--model", str(model_dirs()), "--dataset", str(data), "--output_dir", str(blocker / "out"))
    assert_clean_error(res, "not writable")


def test_model_type_mismatch(tmp_path, data, model_dirs):
    res = fastdpo("train", "--model", str(model_dirs("qwen3")), "--dataset", str(data), "--model_type", "llama",
                  "--output_dir", str(tmp_path / "o"))
    assert_clean_error(res, "model_type", "qwen3")


def test_yaml_config_and_cli_override(tmp_path, data, model_dirs):
    import yaml

    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"model": str(model_dirs()), "dataset": [str(data)], "max_steps": 2,
                                   "learning_rate": 0.5, "output_dir": str(tmp_path / "o")}))
    res = fastdpo("train", "--config", str(cfg), "--learning_rate", "1e-4", "--disable_progress")
    assert res.returncode == 0, res.stdout + res.stderr
    saved = yaml.safe_load((tmp_path / "o" / "config.yaml").read_text())
    assert saved["learning_rate"] == 1e-4 and saved["max_steps"] == 2


def test_yaml_unknown_key(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("learnin_rate: 1e-5\n")
    assert_clean_error(fastdpo("train", "--config", str(cfg)), "run.yaml", "learning_rate")


def test_qlora_on_cpu_is_a_clear_error(tmp_path, data, model_dirs):
    res = fastdpo("train", "--model", str(model_dirs()), "--dataset", str(data), "--train_type", "qlora",
                  "--quant_bits", "4", "--device", "cpu", "--output_dir", str(tmp_path / "o"))
    assert_clean_error(res, "qlora", "CUDA")


def test_every_command_prints_its_help(capsys):
    """--help for the top level and every subcommand: flag help with a literal % (e.g. "90% of the GPU") once made
    argparse fail with a traceback instead."""
    from fastdpo.cli import build_parser, main

    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    assert {"train", "eval", "infer", "bench"} <= set(commands)
    for argv in [["--help"]] + [[name, "--help"] for name in commands]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0, argv
        out = capsys.readouterr().out
        assert "usage: fastdpo" in out, argv
        if argv[0] in ("train", "precompute-ref"):
            assert "90% of the GPU" in out and "--compile_warmup" in out


def test_unknown_flag_without_a_close_match_points_to_help(capsys):
    from fastdpo.cli import main

    assert main(["env", "--zzzzqqq"]) == 1
    out = capsys.readouterr()
    text = out.out + out.err
    assert "unrecognized arguments: --zzzzqqq" in text and "See `fastdpo env --help` for its flags" in text
    assert "Traceback" not in text
