"""A sequence-classification reward model (`--reward_model DIR`) used as a reward function: each prompt + answer goes
through the reward model's own tokenizer (its chat template when it has one, the conversation ending with the answer
as the assistant turn; plain text with a space between), and the score is its single output logit. No code from the
dir runs (no trust_remote_code)."""

from __future__ import annotations

from pathlib import Path

import torch

from fastdpo.errors import FastDPOError
from fastdpo.model.load import load_tokenizer
from fastdpo.model.source import check_source, check_weight_files


class RewardModel:
    """`score(prompts, completions)`: one float per completion."""

    def __init__(self, path: str, device: torch.device, dtype: torch.dtype):
        from transformers import AutoConfig, AutoModelForSequenceClassification

        self.path = path
        if not Path(path).expanduser().is_dir():
            check_source(path, "reward_model")  # a misspelt dir says so; a hub id passes
        else:
            check_weight_files(Path(path).expanduser())
        try:
            config = AutoConfig.from_pretrained(path, trust_remote_code=False)
        except (OSError, ValueError) as e:
            raise FastDPOError(f"--reward_model {path}: cannot read its config: {str(e).splitlines()[0]}") from None
        if getattr(config, "auto_map", None):  # never run: a model dir is data, not code
            raise FastDPOError(f"--reward_model {path}: its config.json names its own model code (auto_map), and code "
                               "from a reward model dir is never run. Use a reward model of transformers' own classes, "
                               "or score with your own Python through --reward_fn FILE.py:function.")
        if config.num_labels != 1:
            raise FastDPOError(f"--reward_model {path}: a reward model has one output (num_labels 1); this one has "
                               f"{config.num_labels} (a classifier). Give a reward model, or score with --reward_fn.")
        self.tokenizer = load_tokenizer(path, False, "reward_model")
        try:
            self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype, trust_remote_code=False,
                                                                            use_kernels=False)
        except (OSError, ValueError) as e:
            raise FastDPOError(f"--reward_model {path}: cannot load it as a sequence-classification model: "
                               f"{str(e).splitlines()[0]}") from None
        self.model.to(device).eval()
        self.device = device

    def text(self, prompt: str | list, completion: str) -> str:
        """Prompt + answer as the reward model reads them."""
        if getattr(self.tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            return self.tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": completion}],
                                                      tokenize=False)
        if not isinstance(prompt, str):
            raise FastDPOError(f"--reward_model {self.path}: its tokenizer has no chat template, so it cannot read "
                               "conversational prompts. Use a reward model with a chat template, or plain-text prompts.")
        gap = "" if prompt[-1:].isspace() else " "  # answers are stripped; the prompt's last word must not run on
        return prompt + gap + completion

    @torch.no_grad()
    def score(self, prompts: list, completions: list[str], columns: dict | None = None) -> list[float]:
        """One score per completion, its prompt before it (`columns`: unused, as a reward function may use them)."""
        scores = []
        for p, c in zip(prompts, completions):
            ids = self.tokenizer(self.text(p, c), add_special_tokens=False, return_tensors="pt")["input_ids"]
            scores.append(float(self.model(input_ids=ids.to(self.device)).logits[0, 0].float()))
        return scores
