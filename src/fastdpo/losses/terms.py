"""The pieces the losses are built from: log-ratios, the f-divergence scores, the smoothed logistic, the NLL terms,
per-token mean log-probs and ranks over a step. Notation as in the package docstring (`fastdpo.losses`)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from fastdpo.losses.inputs import LossInputs, LossParams


def alpha_score(t: torch.Tensor, a: float) -> torch.Tensor:
    """The alpha-divergence's score of the log-ratio t: (exp((a - 1) t) - 1) / (a - 1)."""
    if abs(a - 1.0) < 1e-6:  # the limit a -> 1 is the reverse KL
        return t
    # clamp so exp stays finite in float32
    return (torch.exp(torch.clamp((a - 1.0) * t, max=80.0)) - 1.0) / (a - 1.0)


# f'(u) at u = exp(t) for the f-divergences of f-DPO (Wang et al. 2023), as functions of the log-ratio t: one per
# --f_divergence_type
F_DIVERGENCES: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "reverse_kl": lambda t, a: t,
    "forward_kl": lambda t, a: 1 - torch.exp(-t),
    "js_divergence": lambda t, a: math.log(2) + F.logsigmoid(t),
    "alpha_divergence": alpha_score,
}


def logratios(x: LossInputs) -> tuple[torch.Tensor, torch.Tensor]:
    return x.policy_chosen - x.ref_chosen, x.policy_rejected - x.ref_rejected


def scores(x: LossInputs, p: LossParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(s_c, s_r): the log-ratios through the chosen f-divergence."""
    f = F_DIVERGENCES[p.f_divergence_type]
    lr_c, lr_r = logratios(x)
    return f(lr_c, p.f_alpha_divergence_coef), f(lr_r, p.f_alpha_divergence_coef)


def smoothed_logistic(u: torch.Tensor, eps: float) -> torch.Tensor:
    """-(1 - eps) ls(u) - eps ls(-u)."""
    return -(1 - eps) * F.logsigmoid(u) - eps * F.logsigmoid(-u)


def chosen_nll(x: LossInputs) -> torch.Tensor:
    """-log p(chosen) / tokens_per_pair: summed over the step and divided by its pairs, the token-mean NLL of the
    step's chosen completions."""
    logp = x.chosen_nll_logps if x.chosen_nll_logps is not None else x.policy_chosen
    per_pair = x.tokens_per_pair
    if per_pair is None:
        per_pair = x.chosen_tokens.sum() / x.chosen_tokens.numel()
    return -logp / per_pair


def sequence_nll(x: LossInputs) -> torch.Tensor:
    """-(pi_p + log p(chosen)) / (tokens_per_pair + prompt_tokens_per_pair): summed over the step and divided by its
    pairs, the token-mean NLL of the step's chosen sequences, prompt and completion, every token after a sequence's
    first (TRL's ORPOTrainer: cross-entropy over the chosen rows' [prompt | chosen] tokens)."""
    assert x.prompt_logps is not None and x.prompt_tokens is not None, "the batch carries no prompt targets"
    logp = x.chosen_nll_logps if x.chosen_nll_logps is not None else x.policy_chosen
    per_pair = x.tokens_per_pair
    if per_pair is None:
        per_pair = x.chosen_tokens.sum() / x.chosen_tokens.numel()
    prompt_per_pair = x.prompt_tokens_per_pair
    if prompt_per_pair is None:
        prompt_per_pair = x.prompt_tokens.sum() / x.prompt_tokens.numel()
    return -(x.prompt_logps + logp) / (per_pair + prompt_per_pair)


def mean_logps(x: LossInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(pi_c / n_c, pi_r / n_r): the per-token mean log-probs."""
    return x.policy_chosen / x.chosen_tokens.clamp(min=1), x.policy_rejected / x.rejected_tokens.clamp(min=1)


def ranks(v: torch.Tensor) -> torch.Tensor:
    """rank[i] = position of v[i] in ascending order."""
    order = torch.sort(v, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(v.numel(), device=v.device)
    return rank


def log1mexp(t: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(t)) for t < 0, stable on both sides of -log 2."""
    return torch.where(t < -math.log(2), torch.log1p(-torch.exp(t)), torch.log(-torch.expm1(t)))
