"""Reference log-probs (DESIGN §5): `copy` (a frozen copy for full fine-tuning), `adapter_off` (LoRA: the same model
with adapters disabled), `separate` (--ref_model). All run the same packed layout as the policy, without grad."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fastdpo.data.pack import PairBatch
from fastdpo.model import Backend, prepare_packed, sequence_logps


@dataclass
class Reference:
    strategy: str  # copy | adapter_off | separate | none
    model: torch.nn.Module | None
    runner: Callable | None = None  # under FSDP2: (batch, mask) -> logps through the sharded module

    @torch.no_grad()
    def logps(self, policy, batch: PairBatch, backend: Backend, mask=None) -> torch.Tensor:
        """(2B,) float32 completion log-prob sums under the reference."""
        if self.runner is not None:
            return self.runner(batch, mask)[0]
        if self.strategy == "adapter_off":
            ctx = policy.disable_adapter()
            model = policy
        else:
            ctx = contextlib.nullcontext()
            model = self.model
        with ctx:
            return sequence_logps(model, batch, backend, mask)[0]


def _freeze(model: torch.nn.Module) -> torch.nn.Module:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def build_reference(policy, train_type: str, ref_model, needs_reference: bool, backend: Backend) -> Reference:
    """Choose the strategy. `policy` must not yet carry LoRA adapters when `train_type` is full."""
    if not needs_reference:
        return Reference("none", None)
    if ref_model is not None:
        model = _freeze(ref_model)
    elif train_type == "lora":
        return Reference("adapter_off", None)
    else:
        model = _freeze(copy.deepcopy(policy))
    if backend.name != "padded":
        prepare_packed(model, backend)
    return Reference("separate" if ref_model is not None else "copy", model)
