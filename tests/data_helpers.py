"""Small tokenizers and rows for the data tests."""

from __future__ import annotations

from pathlib import Path

from conftest import WORDS

from fastdpo.data.template import BUILTIN_TEMPLATES
from fastdpo.model.tiny import word_tokenizer

ROLE_WORDS = ["user", "assistant", "system", "tool", "get_time", "get_date"]


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
