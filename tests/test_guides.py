"""The guides' runnable data examples run: each `cat > FILE <<'ROWS'` block of the data guide is written out and
checked with the command that follows it, and says what the guide says it says."""

import re
from pathlib import Path

import pytest
from cli_helpers import run_cli

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guides" / "data.md"
BLOCK = re.compile(r"cat > (\S+) <<'ROWS'\n(.*?)\nROWS\nfastdpo check-data (.*?)\n", re.S)


def examples() -> list[tuple[str, str, str]]:
    return BLOCK.findall(GUIDE.read_text(encoding="utf-8"))


def test_the_data_guide_has_its_examples():
    assert {name for name, _, _ in examples()} >= {"ranked.jsonl", "kto.jsonl"}


@pytest.mark.parametrize("name,rows,flags", examples())
def test_a_data_guide_example_checks_as_written(tmp_path, capsys, monkeypatch, name, rows, flags):
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).write_text(rows + "\n", encoding="utf-8")
    rc, text = run_cli(capsys, "check-data", *flags.split())
    assert rc == 0 and "OK: no errors" in text, text
    expected = {"ranked.jsonl": "3 rows", "kto.jsonl": "2 desirable (label true), 1 undesirable"}
    assert expected[name] in text


VLM_EXAMPLE = re.compile(r"```bash\n(mkdir -p vlm/img\n.*?<<'PAIRS'\n.*?)```", re.S)
HUB_VLM = "Qwen/Qwen2.5-VL-3B-Instruct"


def test_the_vision_language_example_runs_as_written(tmp_path, capsys, monkeypatch):
    """The data guide's vision-language example, line by line, with a tiny Qwen2.5-VL dir (its tokenizer knows the
    example's words) in place of the Hub's model: the images are made, the rows check, one LoRA run trains on them
    and writes its adapter, and infer answers with it."""
    import shlex
    import subprocess
    import sys

    from fastdpo.model.tiny import build_tiny_vlm_dir

    (block,) = VLM_EXAMPLE.findall(GUIDE.read_text(encoding="utf-8"))
    shell, rest = block.split("cat > ", 1)
    target, rest = rest.split(" <<'PAIRS'\n", 1)
    rows, commands = rest.split("\nPAIRS\n", 1)
    words = ["user", "assistant", "system", "What", "colour", "is", "this", "square?", "Orange.", "Blue."]
    model = build_tiny_vlm_dir(tmp_path / "tiny", words=words)
    monkeypatch.chdir(tmp_path)
    for line in shell.strip().splitlines():
        argv = shlex.split(line)
        subprocess.run([sys.executable if argv[0] == "python" else argv[0], *argv[1:]], check=True, cwd=tmp_path)
    (tmp_path / target).write_text(rows + "\n", encoding="utf-8")
    outputs = {}
    for line in commands.strip().splitlines():
        argv = [str(model) if a == HUB_VLM else a for a in shlex.split(line)]
        assert argv[0] == "fastdpo"
        extra = ["--max_new_tokens", "4"] if argv[1] == "infer" else []
        rc, outputs[argv[1]] = run_cli(capsys, *argv[1:], *extra)
        assert rc == 0, outputs[argv[1]]
    assert "images: 2 rows hold 2 images, each opened and verified." in outputs["check-data"], outputs["check-data"]
    final = tmp_path / "vlm" / "run" / "final"
    assert all((final / f).is_file() for f in ("adapter_model.safetensors", "preprocessor_config.json"))
    assert "2 images of the pairs kept hold" in outputs["check-data"] and outputs["infer"].strip(), outputs
