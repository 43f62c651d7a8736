"""The random-number state a checkpoint keeps (Python's and torch's, CUDA's where there is a GPU), so that a resumed
run draws what the uninterrupted run would have drawn."""

from __future__ import annotations

import random

import torch


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
