"""`RunPlan`: what set-up resolves from a run's config on its hardware and data, kept beside the config, never
written into it.

The config is what the user wrote (`--gradient_checkpointing fit`, `--max_tokens_per_batch 0`); the plan is what the
run does with it (checkpointing `ffn`, a budget of 6144 tokens, Triton kernels, varlen attention, the device and
dtype). The plan is saved with the run (`plan.json` in the output dir and in each checkpoint) so a reader sees both.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from fastdpo.config.sections.batching import BatchingSection

PLAN_FILE = "plan.json"


@dataclass
class RunPlan:
    """What the run does, as resolved: filled from the config as written (`RunPlan.of`), then set by set-up."""

    gradient_checkpointing: str  # a named policy: none, full, ffn, attn, every:K, keep:N (never fit or auto)
    max_tokens_per_batch: int  # the token budget of a micro-batch (0: per_device_train_batch_size pairs)
    device: str = ""
    dtype: str = ""
    attention: str = ""  # the attention backend micro-batches run through
    kernels: str = ""  # triton or torch
    products: str = ""  # the decoder projections' matrix products: bf16 (the model's dtype), fp8_base, fp8_rowwise, ...

    @classmethod
    def of(cls, batching: BatchingSection) -> RunPlan:
        """The plan before set-up resolves anything: the config's own values."""
        return cls(str(batching.gradient_checkpointing), batching.max_tokens_per_batch)

    def save(self, directory: Path) -> Path:
        path = Path(directory) / PLAN_FILE
        path.write_text(json.dumps(dataclasses.asdict(self), indent=1) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, directory: Path) -> RunPlan | None:
        path = Path(directory) / PLAN_FILE
        if not path.is_file():
            return None
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in json.loads(path.read_text(encoding="utf-8")).items() if k in known})
