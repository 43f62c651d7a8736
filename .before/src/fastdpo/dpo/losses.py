"""Preference losses as pure functions, and the registry that maps `--loss_type` names to them.

Every loss takes `LossInputs` (per-pair log-probs of policy and reference) and `LossParams` and returns a per-pair
loss (B,). The training step sums these and divides by the number of pairs in the whole optimizer step. Terms that
are token means over the step (the NLL of `sft`, `cpo`, `orpo` and `--rpo_alpha`) are therefore written per pair as
-log p(chosen) / tokens_per_pair, with tokens_per_pair the step's chosen tokens divided by its pairs. ORPO's NLL, as
TRL's ORPOTrainer takes it, also covers each chosen sequence's prompt (every token after the sequence's first):
-(log p(prompt) + log p(chosen)) / (tokens_per_pair + prompt_tokens_per_pair).

Notation of the docstrings: pi_c, pi_r are the policy log-probs of chosen and rejected (sums over completion
tokens; LD-DPO weighted when --ld_alpha < 1); ref_c, ref_r the same under the reference; n_c, n_r the completion
token counts; lr_c = pi_c - ref_c and lr_r = pi_r - ref_r the log-ratios; s_c = f(lr_c), s_r = f(lr_r) the
f-divergence scores (f is the identity for the default reverse KL); h = s_c - s_r; ls = log sigmoid; eps the label
smoothing; beta the KL strength; nll = -pi_c / tokens_per_pair; pi_p the log-prob of the prompt's tokens after its
first, n_p their count.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fastdpo.config import F_DIVERGENCE_TYPES, LOSS_TRAITS
from fastdpo.model.seqlogps import SeqLogps


@dataclass
class StepView:
    """Detached log-probs (S,) of all S pairs of the optimizer step, and the step positions `pos` (B,) of the pairs
    in this micro-batch: for the losses that sort over the step (aot, aot_unpaired)."""

    policy_chosen: torch.Tensor
    policy_rejected: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor
    pos: torch.Tensor | None = None


@dataclass
class LossInputs:
    """Per-pair quantities, each (B,) float32. Reference tensors are None for reference-free losses.

    chosen_nll_logps: plain log-prob sums of chosen (no LD-DPO weighting) for NLL terms; default `policy_chosen`.
    tokens_per_pair: the step's chosen tokens / the step's pairs; default this batch's mean chosen length.
    prompt_logps, prompt_tokens: each pair's prompt log-prob pi_p and its n_p targets (the prompt's tokens after its
      first), for NLL terms over prompt + chosen (ORPO); None unless the batch carried prompt targets.
    prompt_tokens_per_pair: the step's prompt targets / the step's pairs; default this batch's mean n_p.
    pair_weights: WPO weights (detached), multiplying each loss term; None without --use_weighting.
    step: the whole step's log-probs, for losses that sort over it; None means this batch is the whole step.
    """

    policy_chosen: torch.Tensor
    policy_rejected: torch.Tensor
    ref_chosen: torch.Tensor | None
    ref_rejected: torch.Tensor | None
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    chosen_nll_logps: torch.Tensor | None = None
    tokens_per_pair: float | torch.Tensor | None = None
    pair_weights: torch.Tensor | None = None
    step: StepView | None = None
    prompt_logps: torch.Tensor | None = None
    prompt_tokens: torch.Tensor | None = None
    prompt_tokens_per_pair: float | torch.Tensor | None = None


@dataclass
class LossParams:
    beta: float | torch.Tensor = 0.1  # a 0-d tensor under an adaptive beta schedule
    label_smoothing: float = 0.0
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    discopop_tau: float = 0.05
    simpo_gamma: float = 0.5
    cpo_alpha: float = 1.0
    orpo_alpha: float = 0.1


def loss_params(cfg, beta: float | torch.Tensor) -> LossParams:
    """LossParams from a TrainConfig (same field names), with the step's beta."""
    return LossParams(beta=beta, **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(LossParams)
                                     if f.name != "beta"})


# ---------------------------------------------------------------- shared pieces


def _alpha_score(t: torch.Tensor, a: float) -> torch.Tensor:
    if abs(a - 1.0) < 1e-6:  # the limit a -> 1 is the reverse KL
        return t
    # clamp so exp stays finite in float32
    return (torch.exp(torch.clamp((a - 1.0) * t, max=80.0)) - 1.0) / (a - 1.0)


# f'(u) at u = exp(t) for the f-divergences of f-DPO (Wang et al. 2023), as functions of the log-ratio t
F_DIVERGENCES: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "reverse_kl": lambda t, a: t,
    "forward_kl": lambda t, a: 1 - torch.exp(-t),
    "js_divergence": lambda t, a: math.log(2) + F.logsigmoid(t),
    "alpha_divergence": _alpha_score,
}
assert F_DIVERGENCES.keys() == set(F_DIVERGENCE_TYPES), "every --f_divergence_type has a function here"


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


def _mean_logps(x: LossInputs) -> tuple[torch.Tensor, torch.Tensor]:
    return x.policy_chosen / x.chosen_tokens.clamp(min=1), x.policy_rejected / x.rejected_tokens.clamp(min=1)


def _ranks(v: torch.Tensor) -> torch.Tensor:
    """rank[i] = position of v[i] in ascending order."""
    order = torch.sort(v, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(v.numel(), device=v.device)
    return rank


def _step(x: LossInputs) -> StepView:
    if x.step is not None:
        return x.step
    b = x.policy_chosen.numel()
    return StepView(x.policy_chosen.detach(), x.policy_rejected.detach(), x.ref_chosen, x.ref_rejected,
                    torch.arange(b, device=x.policy_chosen.device))


def step_view(parts: list[LossInputs]) -> StepView:
    """The detached step-wide view from the inputs of each micro-batch, in step order (positions set by `at`)."""
    cat = lambda name: torch.cat([getattr(q, name).detach() for q in parts])
    return StepView(cat("policy_chosen"), cat("policy_rejected"), cat("ref_chosen"), cat("ref_rejected"))


def at(view: StepView, offset: int, b: int) -> StepView:
    """`view` for the micro-batch whose B pairs sit at step positions offset..offset+B-1."""
    return dataclasses.replace(view, pos=torch.arange(offset, offset + b, device=view.policy_chosen.device))


# ---------------------------------------------------------------- the losses (each: per-pair loss, (B,))


def dpo_sigmoid_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """DPO (Rafailov et al. 2023), with conservative label smoothing (cDPO):
    loss = -(1 - eps) ls(beta h) - eps ls(-beta h)."""
    s_c, s_r = scores(x, p)
    return smoothed_logistic(p.beta * (s_c - s_r), p.label_smoothing)


def robust_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """Robust DPO (Chowdhury et al. 2024), eps = probability that a label is flipped:
    loss = (-(1 - eps) ls(beta h) + eps ls(-beta h)) / (1 - 2 eps)."""
    s_c, s_r = scores(x, p)
    h, eps = s_c - s_r, p.label_smoothing
    return (-(1 - eps) * F.logsigmoid(p.beta * h) + eps * F.logsigmoid(-p.beta * h)) / (1 - 2 * eps)


def ipo_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """IPO (Azar et al. 2023, eq. 17) on length-normalised scores, as TRL computes it:
    loss = (s_c / n_c - s_r / n_r - 1 / (2 beta))^2."""
    s_c, s_r = scores(x, p)
    d = s_c / x.chosen_tokens.clamp(min=1) - s_r / x.rejected_tokens.clamp(min=1)
    return (d - 1 / (2 * p.beta)) ** 2


def hinge_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """SLiC hinge (Zhao et al. 2023): loss = relu(1 - beta h)."""
    s_c, s_r = scores(x, p)
    return torch.relu(1 - p.beta * (s_c - s_r))


def exo_pair_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """EXO-pref (Ji et al. 2024, eq. 16), the KL from q = softmax over {chosen, rejected} to labels (1 - eps, eps):
    loss = sigmoid(beta h) (ls(beta h) - log(1 - eps)) + sigmoid(-beta h) (ls(-beta h) - log eps), eps > 0."""
    s_c, s_r = scores(x, p)
    u, eps = p.beta * (s_c - s_r), p.label_smoothing
    return (torch.sigmoid(u) * (F.logsigmoid(u) - math.log1p(-eps))
            + torch.sigmoid(-u) * (F.logsigmoid(-u) - math.log(eps)))


def nca_pair_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """NCA (Chen et al. 2024): with r_c = beta lr_c, r_r = beta lr_r,
    loss = -ls(r_c) - ls(-r_c) / 2 - ls(-r_r) / 2."""
    lr_c, lr_r = logratios(x)
    r_c, r_r = p.beta * lr_c, p.beta * lr_r
    return -F.logsigmoid(r_c) - 0.5 * F.logsigmoid(-r_c) - 0.5 * F.logsigmoid(-r_r)


def bco_pair_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """BCO on pairs (Jung et al. 2024), as TRL's bco_pair: loss = -ls(beta lr_c) - ls(-beta lr_r)."""
    lr_c, lr_r = logratios(x)
    return -F.logsigmoid(p.beta * lr_c) - F.logsigmoid(-p.beta * lr_r)


def sppo_hard_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """SPPO with hard win probabilities (Wu et al. 2024):
    loss = (lr_c - 1 / (2 beta))^2 + (lr_r + 1 / (2 beta))^2."""
    lr_c, lr_r = logratios(x)
    return (lr_c - 0.5 / p.beta) ** 2 + (lr_r + 0.5 / p.beta) ** 2


def aot_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """AOT, paired (Melnyk et al. 2024): the policy margins m = pi_c - pi_r and the reference margins
    m_ref = ref_c - ref_r are sorted over the optimizer step and matched by rank: d_k = m_(k) - m_ref_(k),
    loss_k = -(1 - eps) ls(beta d_k) - eps ls(-beta d_k). Per pair: the pair whose margin has rank k gets d_k."""
    v = _step(x)
    rank = _ranks(v.policy_chosen - v.policy_rejected)[v.pos]
    ref_sorted = torch.sort(v.ref_chosen - v.ref_rejected).values
    d = (x.policy_chosen - x.policy_rejected) - ref_sorted[rank]
    return smoothed_logistic(p.beta * d, p.label_smoothing)


def aot_unpaired_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """AOT, unpaired (Melnyk et al. 2024): the chosen log-ratios and the rejected log-ratios are sorted over the step
    separately and matched by rank: d_k = lr_c_(k) - lr_r_(k), loss_k = -(1 - eps) ls(beta d_k) - eps ls(-beta d_k).
    Per pair i: the term of its chosen's rank k, whose gradient reaches lr_c_i; the gradient that reaches lr_r_i
    (through the term of its rejected's rank) rides on a term of value zero."""
    v = _step(x)
    c_step, r_step = v.policy_chosen - v.ref_chosen, v.policy_rejected - v.ref_rejected
    partner_r = torch.sort(r_step).values[_ranks(c_step)[v.pos]]  # the rejected log-ratio at pair i's chosen rank
    partner_c = torch.sort(c_step).values[_ranks(r_step)[v.pos]]  # the chosen log-ratio at pair i's rejected rank
    lr_c, lr_r = logratios(x)
    term = lambda d: smoothed_logistic(p.beta * d, p.label_smoothing)
    via_rejected = term(partner_c - lr_r)
    return term(lr_c - partner_r) + (via_rejected - via_rejected.detach())


def apo_zero_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """APO-zero (D'Oosterlinck et al. 2024, eq. 7): raise chosen, lower rejected:
    loss = 1 - sigmoid(beta lr_c) + sigmoid(beta lr_r)."""
    lr_c, lr_r = logratios(x)
    return 1 - torch.sigmoid(p.beta * lr_c) + torch.sigmoid(p.beta * lr_r)


def apo_down_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """APO-down (D'Oosterlinck et al. 2024, eq. 8): lower both, rejected more:
    loss = sigmoid(beta lr_c) + 1 - sigmoid(beta (lr_c - lr_r))."""
    lr_c, lr_r = logratios(x)
    return torch.sigmoid(p.beta * lr_c) + 1 - torch.sigmoid(p.beta * (lr_c - lr_r))


def discopop_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """DiscoPOP (Lu et al. 2024, eq. 5), tau = --discopop_tau: with u = beta h and m = sigmoid(u / tau),
    loss = -ls(u) (1 - m) + exp(-u) m."""
    s_c, s_r = scores(x, p)
    u = p.beta * (s_c - s_r)
    m = torch.sigmoid(u / p.discopop_tau)
    return -F.logsigmoid(u) * (1 - m) + torch.exp(-u) * m


def sigmoid_norm_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """DPO on length-normalised scores: loss = -ls(beta (s_c / n_c - s_r / n_r))."""
    s_c, s_r = scores(x, p)
    d = s_c / x.chosen_tokens.clamp(min=1) - s_r / x.rejected_tokens.clamp(min=1)
    return -F.logsigmoid(p.beta * d)


def sft_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """Supervised NLL of chosen (token mean over the step): loss = nll. With sigmoid it makes MPO / RPO."""
    return chosen_nll(x)


def simpo_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """SimPO (Meng et al. 2024), reference-free, gamma = --simpo_gamma: with u = beta (pi_c / n_c - pi_r / n_r) - gamma,
    loss = -(1 - eps) ls(u) - eps ls(-u)."""
    a_c, a_r = _mean_logps(x)
    return smoothed_logistic(p.beta * (a_c - a_r) - p.simpo_gamma, p.label_smoothing)


def cpo_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """CPO (Xu et al. 2024), reference-free, alpha = --cpo_alpha:
    loss = -(1 - eps) ls(beta (pi_c - pi_r)) - eps ls(-beta (pi_c - pi_r)) + alpha nll."""
    return smoothed_logistic(p.beta * (x.policy_chosen - x.policy_rejected), p.label_smoothing) + p.cpo_alpha * chosen_nll(x)


def log1mexp(t: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(t)) for t < 0, stable on both sides of -log 2."""
    return torch.where(t < -math.log(2), torch.log1p(-torch.exp(t)), torch.log(-torch.expm1(t)))


def orpo_log_odds(x: LossInputs) -> torch.Tensor:
    """ORPO's log odds ratio o = (a_c - a_r) - (log(1 - e^a_c) - log(1 - e^a_r)), a_c = pi_c / n_c, a_r = pi_r / n_r."""
    a_c, a_r = _mean_logps(x)
    return (a_c - a_r) - (log1mexp(a_c) - log1mexp(a_r))


def orpo_loss(x: LossInputs, p: LossParams) -> torch.Tensor:
    """ORPO (Hong et al. 2024), reference-free, lambda = --orpo_alpha: with the log odds ratio o (`orpo_log_odds`)
    and TRL's NLL over prompt + chosen (`sequence_nll`), loss = -(pi_p + pi_c) / (tokens_per_pair +
    prompt_tokens_per_pair) - lambda ls(o)."""
    return sequence_nll(x) - p.orpo_alpha * F.logsigmoid(orpo_log_odds(x))


def orpo_metrics(x: LossInputs, p: LossParams) -> dict[str, torch.Tensor]:
    """TRL's ORPOTrainer's own metrics, per pair (B,): summed over the step and divided by its pairs, TRL's values.
    nll_loss: the NLL term; log_odds_ratio: ls(o); log_odds_chosen: o (TRL's names)."""
    o = orpo_log_odds(x)
    return {"nll_loss": sequence_nll(x), "log_odds_ratio": F.logsigmoid(o), "log_odds_chosen": o}


@dataclass(frozen=True)
class LossSpec:
    fn: Callable[[LossInputs, LossParams], torch.Tensor]
    needs_reference: bool = True
    f_divergence: bool = False  # defined for every --f_divergence_type (built on the reward difference h)
    sorts_step: bool = False  # couples the pairs of a step: needs the step's log-probs before the backward
    mean_logps: bool = False  # logged as per-token means (see `config.mean_logp_rewards`)
    prompt_nll: bool = False  # its NLL covers the prompt too: needs prompt targets (`config.needs_prompt_targets`)


LOSS_FUNCTIONS: dict[str, Callable[[LossInputs, LossParams], torch.Tensor]] = {
    "sigmoid": dpo_sigmoid_loss,
    "robust": robust_loss,
    "ipo": ipo_loss,
    "hinge": hinge_loss,
    "exo_pair": exo_pair_loss,
    "nca_pair": nca_pair_loss,
    "bco_pair": bco_pair_loss,
    "sppo_hard": sppo_hard_loss,
    "aot": aot_loss,
    "aot_unpaired": aot_unpaired_loss,
    "apo_zero": apo_zero_loss,
    "apo_down": apo_down_loss,
    "discopop": discopop_loss,
    "sigmoid_norm": sigmoid_norm_loss,
    "sft": sft_loss,
    "simpo": simpo_loss,
    "cpo": cpo_loss,
    "orpo": orpo_loss,
}
assert LOSS_FUNCTIONS.keys() == LOSS_TRAITS.keys(), "every loss type of the config has a function here"
LOSSES: dict[str, LossSpec] = {name: LossSpec(fn, **dataclasses.asdict(LOSS_TRAITS[name]))
                               for name, fn in LOSS_FUNCTIONS.items()}

# Metrics a loss logs besides the shared ones, under TRL's names: (names, per-pair values (B,) of each).
LOSS_METRICS: dict[str, tuple[tuple[str, ...], Callable[[LossInputs, LossParams], dict[str, torch.Tensor]]]] = {
    "orpo": (("nll_loss", "log_odds_ratio", "log_odds_chosen"), orpo_metrics),
}


def loss_metric_names(terms: list[tuple[str, float]]) -> tuple[str, ...]:
    """The names `loss_metrics` gives for these loss terms, in order."""
    return tuple(n for name, _ in terms if name in LOSS_METRICS for n in LOSS_METRICS[name][0])


def loss_metrics(x: LossInputs, p: LossParams, terms: list[tuple[str, float]]) -> dict[str, torch.Tensor]:
    """The loss-specific metrics of these terms (unweighted), per pair (B,), detached."""
    out = {}
    for name, _ in terms:
        if name in LOSS_METRICS:
            with torch.no_grad():
                out.update(LOSS_METRICS[name][1](x, p))
    return out


def loss_inputs(pol: SeqLogps, ref: SeqLogps | None, lengths: torch.Tensor, ld_alpha: float = 1.0,
                tokens_per_pair: float | torch.Tensor | None = None, step: StepView | None = None,
                prompt_lengths: torch.Tensor | None = None,
                prompt_tokens_per_pair: float | torch.Tensor | None = None) -> LossInputs:
    """Per-pair inputs from per-sequence summaries (chosen then rejected, (2B,) each). `prompt_lengths` (B,): the
    prompt targets behind `pol.prompt` (`PairBatch.prompt_lengths`), when the batch carried them.

    LD-DPO (Liu et al. 2024): a completion's log-prob counts its first min(n_c, n_r) tokens fully and the rest with
    weight ld_alpha: logp = shared + ld_alpha (sum - shared); ld_alpha = 1 is plain DPO. WPO (Zhou et al. 2024,
    eq. 2): pair weight exp(w_c + w_r), w the mean aligned token log-prob, without grad."""
    b = lengths.numel() // 2

    def ld(s: SeqLogps) -> torch.Tensor:
        return s.sums if ld_alpha == 1.0 else s.shared + ld_alpha * (s.sums - s.shared)

    pol_lp = ld(pol)
    ref_lp = ld(ref) if ref is not None else None
    weights = torch.exp(pol.wpo[:b] + pol.wpo[b:]) if pol.wpo is not None else None
    return LossInputs(
        pol_lp[:b], pol_lp[b:], ref_lp[:b] if ref_lp is not None else None, ref_lp[b:] if ref_lp is not None else None,
        lengths[:b], lengths[b:], chosen_nll_logps=pol.sums[:b], tokens_per_pair=tokens_per_pair,
        pair_weights=weights, step=step, prompt_logps=pol.prompt,
        prompt_tokens=prompt_lengths if pol.prompt is not None else None, prompt_tokens_per_pair=prompt_tokens_per_pair,
    )


def total_loss(x: LossInputs, p: LossParams, terms: list[tuple[str, float]], rpo_alpha: float = 0.0) -> torch.Tensor:
    """Per-pair loss (B,): sum_k weight_k * loss_k (each times the WPO pair weight when given) + rpo_alpha * nll."""
    out = torch.zeros_like(x.policy_chosen)
    for name, weight in terms:
        per_pair = LOSSES[name].fn(x, p)
        if x.pair_weights is not None:
            per_pair = per_pair * x.pair_weights
        out = out + weight * per_pair
    if rpo_alpha:
        out = out + rpo_alpha * chosen_nll(x)
    return out
