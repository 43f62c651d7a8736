import json
import logging
import random
from pathlib import Path

import pytest
import torch

from fastdpo.data.tokenize import TokenizedPair
from fastdpo.model.tiny import build_tiny_model

WORDS = [f"w{i}" for i in range(60)]


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


def random_pairs(n: int, vocab: int, seed: int = 0, max_prompt: int = 12, max_comp: int = 10) -> list[TokenizedPair]:
    """Random token pairs; the first has a one-token prompt."""
    r = random.Random(seed)
    out = []
    for i in range(n):
        p = 1 if i == 0 else r.randint(1, max_prompt)
        out.append(TokenizedPair(
            [r.randrange(4, vocab) for _ in range(p)],
            [r.randrange(4, vocab) for _ in range(r.randint(1, max_comp))],
            [r.randrange(4, vocab) for _ in range(r.randint(1, max_comp))],
            i,
        ))
    return out


def easy_rows(n: int, seed: int = 0) -> list[dict]:
    """An easy preference: chosen always ends the prompt with 'w5 w6', rejected with 'w7 w8 w9'."""
    r = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt = " ".join(f"w{r.randrange(10, 60)}" for _ in range(r.randint(1, 8)))
        rows.append({"prompt": prompt, "chosen": " w5 w6", "rejected": " w7 w8 w9"})
    return rows


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


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


def run_cli(capsys, *args) -> tuple[int, str]:
    """`fastdpo ARGS` in this process (fast); returns (exit code, everything printed)."""
    from fastdpo.cli import main

    capsys.readouterr()
    rc = main([str(a) for a in args])
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


def saved_bytes(model, forward) -> int:
    """Bytes autograd keeps for the backward while `forward()` runs: each storage once, `model`'s weights (and views
    of them) not counted."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in weights:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    del out
    return sum(seen.values())
