"""The embedded demo: bundled files are small, consistent and shipped; a shortened `fastdpo demo` gains accuracy."""

import hashlib
import json
import zipfile

import pytest

from fastdpo.cli import main
from fastdpo.commands import demo


def rows(name):
    return [json.loads(line) for line in (demo.ASSETS / name).read_text().splitlines() if line.strip()]


def test_assets_small_and_intact():
    manifest = json.loads((demo.ASSETS / "manifest.json").read_text())
    files = [p for p in demo.ASSETS.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 20 * 2**20
    for rel, digest in manifest["files"].items():
        assert hashlib.sha256((demo.ASSETS / rel).read_bytes()).hexdigest() == digest, rel


def test_pairs_and_heldout_are_verified_and_disjoint():
    pairs, heldout = rows("pairs.jsonl"), rows("heldout.jsonl")
    assert len(pairs) >= 1000 and len(heldout) >= demo.HELDOUT
    for r in pairs:
        q = demo.question_of(r["prompt"])
        assert demo.verify(q, r["chosen"]) and not demo.verify(q, r["rejected"])
    for r in heldout:
        assert demo.verify(r["question"], r["answer"]) and r["prompt"] == demo.prompt_text(r["question"])
    assert not {r["prompt"] for r in pairs} & {r["prompt"] for r in heldout}


def test_tokenizer_and_chat_template():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(demo.ASSETS / "model"))
    text = tok.apply_chat_template([{"role": "user", "content": "347+589"}], add_generation_prompt=True, tokenize=False)
    assert text == demo.prompt_text("347+589")
    ids = tok(text + "936" + tok.eos_token)["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["<bos>", "<|user|>", *"347+589", "<|assistant|>", *"936", "<eos>"]
    assert tok.decode(ids, skip_special_tokens=True) == "347+589936"


def test_verifier():
    assert demo.verify("347+589", "936") and demo.verify("347+589", " 936 ")
    assert not demo.verify("347+589", "836") and not demo.verify("347+589", "") and not demo.verify("347+589", "93 6")


def test_quick_demo_gains_accuracy(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--output_dir", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads((out / "demo_result.json").read_text())
    assert result["tuned_accuracy"] - result["base_accuracy"] >= 0.25, {k: v for k, v in result.items() if k != "answers"}
    assert f"DPO {100 * result['tuned_accuracy']:.1f}%" in printed and "held-out accuracy" in printed
    assert (out / "final" / "model.safetensors").is_file() and (out / "metrics.jsonl").is_file()
    # the side-by-side table shows answers DPO fixed
    assert any(a["base"] != a["answer"] and a["dpo"] == a["answer"] for a in result["answers"])
    assert (out / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_wheel_ships_the_demo(tmp_path):
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("setuptools", minversion="77")  # what pyproject's build-system asks for (SPDX license)
    root = Path(__file__).resolve().parents[1]
    tree = tmp_path / "tree"  # build from a copy: setuptools writes build/ and egg-info next to the sources
    shutil.copytree(root / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, tree / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path),
                    str(tree)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("fastdpo-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for p in demo.ASSETS.rglob("*"):
        if p.is_file():
            assert f"fastdpo/assets/demo/{p.relative_to(demo.ASSETS).as_posix()}" in names
