"""The listwise loss: Plackett-Luce over a ranking of one prompt's completions (DPO paper, appendix A.3; design note
"Preference groups", section 3). A ranking y_1 > y_2 > ... > y_K reaches the loss as its K-1 adjacent pairs
(y_k, y_k+1), consecutive in the batch (`LossInputs.rankings` gives how many pairs each ranking has), with implicit
rewards r_k = beta (pi_k - ref_k). Pair k carries the k-th factor of the likelihood,

    loss_k = -r_k + logsumexp(r_k, ..., r_K),

so a ranking's pairs sum to -log P(ranking); the step then weighs each ranking as one example (`row_scale`). With
K = 2 the one pair's term is -log sigmoid(r_1 - r_2): sigmoid DPO."""

from __future__ import annotations

import torch

from fastdpo.losses.inputs import LossInputs, LossParams
from fastdpo.losses.registry import loss


def ranking_rewards(x: LossInputs, p: LossParams, at: int, n: int) -> torch.Tensor:
    """The K = n + 1 rewards of the ranking whose n pairs start at `at`, in rank order: each pair's chosen, then the
    last pair's rejected."""
    r_c = p.beta * (x.policy_chosen[at: at + n] - x.ref_chosen[at: at + n])
    r_last = p.beta * (x.policy_rejected[at + n - 1: at + n] - x.ref_rejected[at + n - 1: at + n])
    return torch.cat([r_c, r_last]).float()


@loss("plackett_luce", listwise=True)
def plackett_luce_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """Plackett-Luce: per pair k of a ranking, -r_k + logsumexp_{j >= k} r_j (suffix log-sum-exps in float32)."""
    rankings = x.rankings if x.rankings is not None else [1] * x.policy_chosen.numel()  # pairs: rankings of two
    terms, at = [], 0
    for n in rankings:
        r = ranking_rewards(x, p, at, n)
        suffix = torch.logcumsumexp(r.flip(0), 0).flip(0)
        terms.append(suffix[:n] - r[:n])
        at += n
    return torch.cat(terms).to(x.policy_chosen.dtype)
