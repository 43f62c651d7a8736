"""Preference losses as pure functions, and the registry that maps `--loss_type` names to them.

Every loss takes the per-pair log-prob sums of policy and reference and returns a per-pair loss (B,). The training
step sums these and divides by the number of pairs in the whole optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class LossInputs:
    """Per-pair quantities, each (B,) float32. Reference tensors are None for reference-free losses."""

    policy_chosen: torch.Tensor
    policy_rejected: torch.Tensor
    ref_chosen: torch.Tensor | None
    ref_rejected: torch.Tensor | None
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor


@dataclass
class LossParams:
    beta: float = 0.1
    label_smoothing: float = 0.0


def dpo_sigmoid_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """DPO (Rafailov et al. 2023) with conservative label smoothing eps (cDPO):

        h = (pi_c - ref_c) - (pi_r - ref_r)
        loss = -(1 - eps) * log sigmoid(beta * h) - eps * log sigmoid(-beta * h)
    """
    h = (x.policy_chosen - x.ref_chosen) - (x.policy_rejected - x.ref_rejected)
    eps = p.label_smoothing
    return -(1 - eps) * F.logsigmoid(p.beta * h) - eps * F.logsigmoid(-p.beta * h)


@dataclass(frozen=True)
class LossSpec:
    fn: Callable[[LossInputs, LossParams], torch.Tensor]
    needs_reference: bool = True


LOSSES: dict[str, LossSpec] = {
    "sigmoid": LossSpec(dpo_sigmoid_loss),
}
