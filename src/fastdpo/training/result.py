"""What `train()` returns: the trained model and tokenizer in memory, the final metrics, where the run wrote."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainResult:
    """A finished (or stopped) run. `model` is the trained policy, unwrapped (no DDP), on its device, in eval mode,
    LoRA adapters attached; under FSDP2 its weights are this rank's shards (load `final_dir` for the whole model).
    `model` and `tokenizer` are None when `train(..., keep_model=False)` (the `fastdpo train` command)."""

    output_dir: str
    final_dir: str | None  # output_dir/final; None when the run stopped early
    metrics: dict  # the last logged metrics record
    summary: dict  # the run summary (summary.json): runtime, rates, peak memory, final metrics
    model: Any = None
    tokenizer: Any = None
    stopped: str | None = None  # what stopped the run early: a signal's name, or "callback"
    checkpoint: str | None = None  # the checkpoint saved when stopped early
    exit_code: int = 0  # the process exit status the command uses
    info: dict = field(default_factory=dict, repr=False)  # everything the run reported, as train() once returned it

    def __getitem__(self, key: str) -> Any:
        """`result["final_dir"]`, `result["last"]`, ...: the keys of the dict `train()` returned before this class."""
        return self.info[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.info.get(key, default)

    def __contains__(self, key: str) -> bool:
        return key in self.info
