"""`fastdpo demo`: train a built-in tiny model on CPU through the ordinary training path (no download)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from fastdpo.config import TrainConfig
from fastdpo.tiny import build_tiny_model
from fastdpo.train import train


def _rows(n: int, seed: int) -> list[dict]:
    r = random.Random(seed)
    return [{"prompt": " ".join(f"w{r.randrange(10, 60)}" for _ in range(r.randint(1, 8))),
             "chosen": " w5 w6", "rejected": " w7 w8 w9"} for _ in range(n)]


def run_demo(output_dir: str, console=None, quick: bool = False) -> dict:
    out = Path(output_dir)
    model_dir = build_tiny_model(out / "base", "qwen3", [f"w{i}" for i in range(60)], seed=0)
    data = out / "pairs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in _rows(256, 0)))
    cfg = TrainConfig(model=str(model_dir), dataset=[str(data)], output_dir=str(out / "run"), learning_rate=2e-3,
                      beta=0.5, max_steps=10 if quick else 40, per_device_train_batch_size=8, logging_steps=5)
    result = train(cfg, console=console, progress=console is not None)
    if console is not None:
        console.print(f"reward accuracy {result['last']['rewards/accuracies']:.2f}, "
                      f"margin {result['last']['rewards/margins']:.3f}")
    return result
