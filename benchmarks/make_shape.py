"""Write a random-init model dir of a bench shape (with the anchor tokenizer) and the anchor workload as JSONL, so that
commands taking --model/--dataset (train, verify, tune, eval) run on the same model and rows as `fastdpo bench`.

    python benchmarks/make_shape.py qwen3-1.7b /tmp/qwen3-1.7b /tmp/anchor.jsonl [--rows 512] [--device cuda]
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from fastdpo.data.anchor import anchor_pairs, anchor_tokenizer  # noqa: E402
from fastdpo.model.shapes import shape_config  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shape")
    p.add_argument("model_dir")
    p.add_argument("dataset")
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    cfg = shape_config(a.shape)
    torch.manual_seed(0)
    with torch.device(a.device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(a.model_dir)
    anchor_tokenizer(cfg.vocab_size).save_pretrained(a.model_dir)
    with open(a.dataset, "w") as f:
        for row in anchor_pairs(a.rows, cfg.vocab_size):
            f.write(json.dumps(row) + "\n")
    print(f"{a.shape}: model in {a.model_dir}, {a.rows} anchor rows in {a.dataset}")


if __name__ == "__main__":
    main()
