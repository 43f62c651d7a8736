"""The losses that compare the policy with a reference, each a pure function registered under its --loss_type
name: per-pair loss (B,). Notation as in the package docstring (`fastdpo.losses`)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fastdpo.losses.inputs import LossInputs, LossParams, whole_step
from fastdpo.losses.registry import loss
from fastdpo.losses.terms import logratios, ranks, scores, smoothed_logistic


@loss("sigmoid", f_divergence=True)
def dpo_sigmoid_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """DPO (Rafailov et al. 2023), with conservative label smoothing (cDPO):
    loss = -(1 - eps) ls(beta h) - eps ls(-beta h)."""
    s_c, s_r = scores(x, p)
    return smoothed_logistic(p.beta * (s_c - s_r), p.label_smoothing)


@loss("robust", f_divergence=True)
def robust_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """Robust DPO (Chowdhury et al. 2024), eps = probability that a label is flipped:
    loss = (-(1 - eps) ls(beta h) + eps ls(-beta h)) / (1 - 2 eps)."""
    s_c, s_r = scores(x, p)
    h, eps = s_c - s_r, p.label_smoothing
    return (-(1 - eps) * F.logsigmoid(p.beta * h) + eps * F.logsigmoid(-p.beta * h)) / (1 - 2 * eps)


@loss("ipo", f_divergence=True)
def ipo_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """IPO (Azar et al. 2023, eq. 17) on length-normalised scores, as TRL computes it:
    loss = (s_c / n_c - s_r / n_r - 1 / (2 beta))^2."""
    s_c, s_r = scores(x, p)
    d = s_c / x.chosen_tokens.clamp(min=1) - s_r / x.rejected_tokens.clamp(min=1)
    return (d - 1 / (2 * p.beta)) ** 2


@loss("hinge", f_divergence=True)
def hinge_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """SLiC hinge (Zhao et al. 2023): loss = relu(1 - beta h)."""
    s_c, s_r = scores(x, p)
    return torch.relu(1 - p.beta * (s_c - s_r))


@loss("exo_pair", f_divergence=True)
def exo_pair_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """EXO-pref (Ji et al. 2024, eq. 16), the KL from q = softmax over {chosen, rejected} to labels (1 - eps, eps):
    loss = sigmoid(beta h) (ls(beta h) - log(1 - eps)) + sigmoid(-beta h) (ls(-beta h) - log eps), eps > 0."""
    s_c, s_r = scores(x, p)
    u, eps = p.beta * (s_c - s_r), p.label_smoothing
    return (torch.sigmoid(u) * (F.logsigmoid(u) - math.log1p(-eps))
            + torch.sigmoid(-u) * (F.logsigmoid(-u) - math.log(eps)))


@loss("nca_pair")
def nca_pair_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """NCA (Chen et al. 2024): with r_c = beta lr_c, r_r = beta lr_r,
    loss = -ls(r_c) - ls(-r_c) / 2 - ls(-r_r) / 2."""
    lr_c, lr_r = logratios(x)
    r_c, r_r = p.beta * lr_c, p.beta * lr_r
    return -F.logsigmoid(r_c) - 0.5 * F.logsigmoid(-r_c) - 0.5 * F.logsigmoid(-r_r)


@loss("bco_pair")
def bco_pair_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """BCO on pairs (Jung et al. 2024), as TRL's bco_pair: loss = -ls(beta lr_c) - ls(-beta lr_r)."""
    lr_c, lr_r = logratios(x)
    return -F.logsigmoid(p.beta * lr_c) - F.logsigmoid(-p.beta * lr_r)


@loss("sppo_hard")
def sppo_hard_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """SPPO with hard win probabilities (Wu et al. 2024):
    loss = (lr_c - 1 / (2 beta))^2 + (lr_r + 1 / (2 beta))^2."""
    lr_c, lr_r = logratios(x)
    return (lr_c - 0.5 / p.beta) ** 2 + (lr_r + 0.5 / p.beta) ** 2


@loss("aot", sorts_step=True)
def aot_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """AOT, paired (Melnyk et al. 2024): the policy margins m = pi_c - pi_r and the reference margins
    m_ref = ref_c - ref_r are sorted over the optimizer step and matched by rank: d_k = m_(k) - m_ref_(k),
    loss_k = -(1 - eps) ls(beta d_k) - eps ls(-beta d_k). Per pair: the pair whose margin has rank k gets d_k."""
    v = whole_step(x)
    rank = ranks(v.policy_chosen - v.policy_rejected)[v.pos]
    ref_sorted = torch.sort(v.ref_chosen - v.ref_rejected).values
    d = (x.policy_chosen - x.policy_rejected) - ref_sorted[rank]
    return smoothed_logistic(p.beta * d, p.label_smoothing)


@loss("aot_unpaired", sorts_step=True)
def aot_unpaired_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """AOT, unpaired (Melnyk et al. 2024): the chosen log-ratios and the rejected log-ratios are sorted over the step
    separately and matched by rank: d_k = lr_c_(k) - lr_r_(k), loss_k = -(1 - eps) ls(beta d_k) - eps ls(-beta d_k).
    Per pair i: the term of its chosen's rank k, whose gradient reaches lr_c_i; the gradient that reaches lr_r_i
    (through the term of its rejected's rank) rides on a term of value zero."""
    v = whole_step(x)
    c_step, r_step = v.policy_chosen - v.ref_chosen, v.policy_rejected - v.ref_rejected
    partner_r = torch.sort(r_step).values[ranks(c_step)[v.pos]]  # the rejected log-ratio at pair i's chosen rank
    partner_c = torch.sort(c_step).values[ranks(r_step)[v.pos]]  # the chosen log-ratio at pair i's rejected rank
    lr_c, lr_r = logratios(x)
    term = lambda d: smoothed_logistic(p.beta * d, p.label_smoothing)
    via_rejected = term(partner_c - lr_r)
    return term(lr_c - partner_r) + (via_rejected - via_rejected.detach())


@loss("apo_zero")
def apo_zero_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """APO-zero (D'Oosterlinck et al. 2024, eq. 7): raise chosen, lower rejected:
    loss = 1 - sigmoid(beta lr_c) + sigmoid(beta lr_r)."""
    lr_c, lr_r = logratios(x)
    return 1 - torch.sigmoid(p.beta * lr_c) + torch.sigmoid(p.beta * lr_r)


@loss("apo_down")
def apo_down_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """APO-down (D'Oosterlinck et al. 2024, eq. 8): lower both, rejected more:
    loss = sigmoid(beta lr_c) + 1 - sigmoid(beta (lr_c - lr_r))."""
    lr_c, lr_r = logratios(x)
    return torch.sigmoid(p.beta * lr_c) + 1 - torch.sigmoid(p.beta * (lr_c - lr_r))


@loss("discopop", f_divergence=True)
def discopop_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """DiscoPOP (Lu et al. 2024, eq. 5), tau = --discopop_tau: with u = beta h and m = sigmoid(u / tau),
    loss = -ls(u) (1 - m) + exp(-u) m."""
    s_c, s_r = scores(x, p)
    u = p.beta * (s_c - s_r)
    m = torch.sigmoid(u / p.discopop_tau)
    return -F.logsigmoid(u) * (1 - m) + torch.exp(-u) * m


@loss("sigmoid_norm", f_divergence=True)
def sigmoid_norm_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """DPO on length-normalised scores: loss = -ls(beta (s_c / n_c - s_r / n_r))."""
    s_c, s_r = scores(x, p)
    d = s_c / x.chosen_tokens.clamp(min=1) - s_r / x.rejected_tokens.clamp(min=1)
    return -F.logsigmoid(p.beta * d)
