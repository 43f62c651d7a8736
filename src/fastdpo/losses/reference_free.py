"""The reference-free losses (no reference model is loaded for them), each a pure function registered under its
--loss_type name: per-pair loss (B,). Notation as in the package docstring (`fastdpo.losses`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastdpo.losses.inputs import LossInputs, LossParams
from fastdpo.losses.registry import extra_metrics, loss
from fastdpo.losses.terms import chosen_nll, log1mexp, mean_logps, sequence_nll, smoothed_logistic


@loss("sft", needs_reference=False, f_divergence=True)
def sft_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """Supervised NLL of chosen (token mean over the step): loss = nll. With sigmoid it makes MPO / RPO."""
    return chosen_nll(x)


@loss("simpo", needs_reference=False, mean_logps=True)
def simpo_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """SimPO (Meng et al. 2024), reference-free, gamma = --simpo_gamma: with u = beta (pi_c / n_c - pi_r / n_r) - gamma,
    loss = -(1 - eps) ls(u) - eps ls(-u)."""
    a_c, a_r = mean_logps(x)
    return smoothed_logistic(p.beta * (a_c - a_r) - p.simpo_gamma, p.label_smoothing)


@loss("cpo", needs_reference=False)
def cpo_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """CPO (Xu et al. 2024), reference-free, alpha = --cpo_alpha:
    loss = -(1 - eps) ls(beta (pi_c - pi_r)) - eps ls(-beta (pi_c - pi_r)) + alpha nll."""
    return smoothed_logistic(p.beta * (x.policy_chosen - x.policy_rejected), p.label_smoothing) + p.cpo_alpha * chosen_nll(x)


def orpo_log_odds(x: LossInputs) -> torch.Tensor:
    """ORPO's log odds ratio o = (a_c - a_r) - (log(1 - e^a_c) - log(1 - e^a_r)), a_c = pi_c / n_c, a_r = pi_r / n_r."""
    a_c, a_r = mean_logps(x)
    return (a_c - a_r) - (log1mexp(a_c) - log1mexp(a_r))


@loss("orpo", needs_reference=False, mean_logps=True, prompt_nll=True)
def orpo_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """ORPO (Hong et al. 2024), reference-free, lambda = --orpo_alpha: with the log odds ratio o (`orpo_log_odds`)
    and TRL's NLL over prompt + chosen (`sequence_nll`), loss = -(pi_p + pi_c) / (tokens_per_pair +
    prompt_tokens_per_pair) - lambda ls(o)."""
    return sequence_nll(x) - p.orpo_alpha * F.logsigmoid(orpo_log_odds(x))


@extra_metrics("orpo", "nll_loss", "log_odds_ratio", "log_odds_chosen")
def orpo_metrics(x: LossInputs, p: LossParams) -> dict[str, torch.Tensor]:
    """TRL's ORPOTrainer's own metrics, per pair (B,): summed over the step and divided by its pairs, TRL's values.
    nll_loss: the NLL term; log_odds_ratio: ls(o); log_odds_chosen: o (TRL's names)."""
    o = orpo_log_odds(x)
    return {"nll_loss": sequence_nll(x), "log_odds_ratio": F.logsigmoid(o), "log_odds_chosen": o}
