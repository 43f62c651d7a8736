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
