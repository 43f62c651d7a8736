"""Fixtures, hooks and markers only. What tests share besides fixtures lives in the helper modules beside this file
(tests/*_helpers.py), imported by name (`from data_helpers import easy_rows`): tests/ is on sys.path (pytest's
`pythonpath` in pyproject.toml), so test files in any subfolder import them the same way."""

import logging
from pathlib import Path

import pytest
import torch
from data_helpers import easy_rows, write_jsonl
from model_helpers import WORDS

from fastdpo.model.tiny import build_tiny_model


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def one_thread():
    """One intra-op thread, like a training subprocess (identical float summation order); tiny models run fastest
    that way, too."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """Tiny random-init model dirs, built once per family (and variant) per session."""
    root = tmp_path_factory.mktemp("models")
    cache = {}

    def get(family: str = "qwen3", **overrides) -> Path:
        key = (family, tuple(sorted(overrides.items())))
        if key not in cache:
            name = family + "".join(f"-{k}{v}" for k, v in sorted(overrides.items()))
            cache[key] = build_tiny_model(root / name, family, WORDS, seed=0, **overrides)
        return cache[key]

    return get


@pytest.fixture
def restore_logging():
    """Tests that call `fastdpo.cli.main` in-process: the CLI sets up logging for a terminal; undo it afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(scope="session")
def lora_run(tmp_path_factory, model_dirs):
    """A LoRA adapter trained on the easy preference (qwen3 base): (base dir, adapter dir, training output dir)."""
    from fastdpo.config import TrainConfig
    from fastdpo.training.loop import train

    root = tmp_path_factory.mktemp("lora_run")
    base = model_dirs("qwen3")
    data = write_jsonl(root / "train.jsonl", easy_rows(64, seed=1))
    cfg = TrainConfig(model=str(base), dataset=[str(data)], output_dir=str(root / "out"), train_type="lora",
                      lora_rank=4, lora_alpha=8, learning_rate=8e-3, beta=0.5, max_steps=12,
                      per_device_train_batch_size=8, seed=3)
    result = train(cfg, progress=False)
    return base, Path(result["final_dir"]), root / "out"
