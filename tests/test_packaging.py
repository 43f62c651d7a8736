"""The `test` extra holds what the suite needs to run in full: a pinned TRL, so the parity tests that compare
fastdpo with TRL's own code run in CI instead of skipping, without bringing a torch of its own."""

import importlib.metadata
import importlib.util
import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_the_test_extra_pins_trl():
    extra = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]["test"]
    pins = [r for r in extra if re.match(r"trl\b", r)]
    assert len(pins) == 1 and re.fullmatch(r"trl==\d+\.\d+\.\d+", pins[0]), pins
    if importlib.util.find_spec("trl") is not None:  # installed with the extra: the pinned version
        assert importlib.metadata.version("trl") == pins[0].split("==")[1]
        assert not any(re.match(r"torch\b", r) for r in importlib.metadata.requires("trl") or [])
