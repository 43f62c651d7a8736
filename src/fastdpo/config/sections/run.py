"""The run section: the seed, the device and the progress bar."""

from __future__ import annotations

from dataclasses import dataclass

from fastdpo.config.fields import Section, option


@dataclass
class RunSection(Section):
    """Where and how reproducibly the run runs."""

    name = "run"
    title = "Device and progress"

    seed: int = option(42, "Seed for data order, init and dropout.")
    device: str = option("auto", "auto|cpu|cuda|cuda:N.")
    disable_progress: bool = option(False, "No progress bar (logs only).")
