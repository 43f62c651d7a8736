"""The losses of unpaired rows: one completion per row with a label, desirable or undesirable, as TRL 1.16's
KTOTrainer computes them (its `loss_type`). Per row: lr = pi - ref the completion's log-ratio (sums over its tokens),
z the detached KL estimate of the row's round (`LossInputs.kl`), w the label's weight (--desirable_weight,
--undesirable_weight). "chosen" in `LossInputs` is the row's completion; "rejected" its KL completion, read only by
the step that builds `kl`."""

from __future__ import annotations

import torch

from fastdpo.losses.inputs import LossInputs, LossParams
from fastdpo.losses.registry import loss


def label_weights(x: LossInputs, p: LossParams) -> torch.Tensor:
    """w per row: --desirable_weight for a desirable row, --undesirable_weight for an undesirable one."""
    return torch.where(x.labels, torch.full_like(x.policy_chosen, p.desirable_weight),
                       torch.full_like(x.policy_chosen, p.undesirable_weight))


@loss("kto", unpaired=True, kl_completions=True)
def kto_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """KTO (Ethayarajh et al. 2024, eq. 7), as TRL computes it: w (1 - sigmoid(beta (lr - z))) for a desirable row,
    w (1 - sigmoid(beta (z - lr))) for an undesirable one."""
    lr = x.policy_chosen - x.ref_chosen
    desirable = 1 - torch.sigmoid(p.beta * (lr - x.kl))
    undesirable = 1 - torch.sigmoid(p.beta * (x.kl - lr))
    return label_weights(x, p) * torch.where(x.labels, desirable, undesirable)


@loss("apo_zero_unpaired", unpaired=True)
def apo_zero_unpaired_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """APO-zero for unpaired rows (D'Oosterlinck et al. 2024), as TRL computes it: w (1 - sigmoid(beta lr)) for a
    desirable row, w sigmoid(beta lr) for an undesirable one; no KL estimate."""
    lr = x.policy_chosen - x.ref_chosen
    return label_weights(x, p) * torch.where(x.labels, 1 - torch.sigmoid(p.beta * lr), torch.sigmoid(p.beta * lr))
