"""The configuration of the training run that wrote a model dir (its final/ or a checkpoint-N/), for the commands
that use a trained model as that run did: `infer --load_data_args`, and `eval` reading prompts as training read
them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from fastdpo.checkpoint.layout import read_config, saved_config
from fastdpo.config import TrainConfig


def run_config(tuned: str) -> tuple[TrainConfig | None, Path]:
    """The TrainConfig of the fastdpo run that wrote `tuned`, or None where there is no saved one; and the run's
    output_dir."""
    here = Path(tuned).expanduser()
    run = here.parent
    saved = saved_config(here) or read_config(run / "config.yaml")
    if not saved.get("dataset"):
        return None, run
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in saved.items() if k in names}), run
