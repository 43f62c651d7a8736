"""Rows, data files and token pairs for the tests, and small tokenizers with a chat template."""

from __future__ import annotations

import json
import random
from pathlib import Path

from model_helpers import WORDS

from fastdpo.data.template import BUILTIN_TEMPLATES
from fastdpo.data.tokenize import TokenizedPair
from fastdpo.model.tiny import word_tokenizer

ROLE_WORDS = ["user", "assistant", "system", "tool", "get_time", "get_date"]


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


def chat_tokenizer(template: str | None = "chatml"):
    """The tiny word tokenizer plus ChatML specials and role words, with a built-in chat template (or none)."""
    tok = word_tokenizer(WORDS + ROLE_WORDS)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = BUILTIN_TEMPLATES[template] if template else None
    return tok


def tokenizer_dir(path: Path, template: str | None = "chatml") -> Path:
    chat_tokenizer(template).save_pretrained(path)
    return path


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def write_image(path: Path, width: int = 16, height: int = 16, color: tuple = (200, 30, 30)) -> Path:
    """A small PNG image (the directories made as needed)."""
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (width, height), color).save(path)
    return path
