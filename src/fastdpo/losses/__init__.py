"""Preference losses as pure functions, each registered under its `--loss_type` name with its traits
(`registry.LOSSES`); they import only torch, so config can check names and traits against them.

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

Files: `inputs` (what a loss takes), `terms` (the shared pieces), `registry` (names, traits, the run's total),
`with_reference`, `reference_free`, `unpaired` and `listwise` (the losses; the last two on unpaired rows, KTO, and
on rankings, Plackett-Luce). A new loss is one decorated function in one of the last four.
"""

# each loss registers itself when its module is imported: LOSSES keeps this order (with a reference first)
from fastdpo.losses import with_reference  # noqa: F401

# isort: split
from fastdpo.losses import reference_free  # noqa: F401

# isort: split
from fastdpo.losses import unpaired  # noqa: F401

# isort: split
from fastdpo.losses import listwise  # noqa: F401
from fastdpo.losses.inputs import LossInputs, LossParams, StepView, at, loss_inputs, loss_params, step_view
from fastdpo.losses.registry import (
    LOSS_METRICS,
    LOSSES,
    LossSpec,
    extra_metrics,
    loss,
    loss_metric_names,
    loss_metrics,
    mean_logp_rewards,
    needs_kl_completions,
    needs_prompt_targets,
    total_loss,
    trains_rankings,
    trains_unpaired,
)
from fastdpo.losses.terms import F_DIVERGENCES, chosen_nll, logratios, sequence_nll

__all__ = [
    "F_DIVERGENCES", "LOSSES", "LOSS_METRICS", "LossInputs", "LossParams", "LossSpec", "StepView", "at", "chosen_nll",
    "extra_metrics", "logratios", "loss", "loss_inputs", "loss_metric_names", "loss_metrics", "loss_params",
    "mean_logp_rewards", "needs_kl_completions", "needs_prompt_targets", "sequence_nll", "step_view", "total_loss",
    "trains_rankings", "trains_unpaired",
]
