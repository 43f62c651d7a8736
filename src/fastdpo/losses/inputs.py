"""What every loss takes: per-pair log-probs (`LossInputs`), the loss settings (`LossParams`), and the step-wide view
(`StepView`) the losses that sort a step's pairs read. `loss_inputs` builds the per-pair inputs from per-sequence
summaries, with LD-DPO's weighting and WPO's pair weights."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch


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
    labels: unpaired rows (KTO) only, (B,) bool, True for a desirable completion. For such rows "chosen" is the row's
      completion and "rejected" its KL completion (another row's completion after the same prompt).
    kl: unpaired rows, (B,) the detached KL estimate of each row's round (0 where the loss builds none).
    row_scale: (B,) each row's weight in the step's sum (the step divides by its number of rows): for unpaired rows,
      rows / (chunks x the row's chunk size), so the step loss is the mean over chunks of each chunk's mean; for
      rankings, pairs / rankings of the step, so each ranking counts as one example.
    rankings: for a listwise loss, the number of adjacent pairs of each ranking, in batch order (their pairs are
      consecutive); None: every pair is a ranking of two.
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
    labels: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    row_scale: torch.Tensor | None = None
    rankings: list[int] | None = None


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
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0


def loss_params(cfg, beta: float | torch.Tensor) -> LossParams:
    """LossParams from a TrainConfig (same field names), with the step's beta."""
    return LossParams(beta=beta, **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(LossParams)
                                     if f.name != "beta"})


class SequenceSums(Protocol):
    """Per-sequence log-prob summaries, chosen then rejected, (2B,) each (`fastdpo.model.seqlogps.SeqLogps`):
    `sums` over each completion's tokens, `shared` over its first min(n_c, n_r) tokens, `wpo` WPO's mean aligned
    log-weight (or None), and `prompt` (B,) the prompt targets' log-prob (or None)."""

    sums: torch.Tensor
    shared: torch.Tensor
    wpo: torch.Tensor | None
    prompt: torch.Tensor | None


def loss_inputs(pol: SequenceSums, ref: SequenceSums | None, lengths: torch.Tensor, ld_alpha: float = 1.0,
                tokens_per_pair: float | torch.Tensor | None = None, step: StepView | None = None,
                prompt_lengths: torch.Tensor | None = None,
                prompt_tokens_per_pair: float | torch.Tensor | None = None) -> LossInputs:
    """Per-pair inputs from per-sequence summaries (chosen then rejected, (2B,) each). `prompt_lengths` (B,): the
    prompt targets behind `pol.prompt` (`PairBatch.prompt_lengths`), when the batch carried them.

    LD-DPO (Liu et al. 2024): a completion's log-prob counts its first min(n_c, n_r) tokens fully and the rest with
    weight ld_alpha: logp = shared + ld_alpha (sum - shared); ld_alpha = 1 is plain DPO. WPO (Zhou et al. 2024,
    eq. 2): pair weight exp(w_c + w_r), w the mean aligned token log-prob, without grad."""
    b = lengths.numel() // 2

    def ld(s: SequenceSums) -> torch.Tensor:
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


def step_view(parts: list[LossInputs]) -> StepView:
    """The detached step-wide view from the inputs of each micro-batch, in step order (positions set by `at`)."""
    cat = lambda name: torch.cat([getattr(q, name).detach() for q in parts])
    return StepView(cat("policy_chosen"), cat("policy_rejected"), cat("ref_chosen"), cat("ref_rejected"))


def at(view: StepView, offset: int, b: int) -> StepView:
    """`view` for the micro-batch whose B pairs sit at step positions offset..offset+B-1."""
    return dataclasses.replace(view, pos=torch.arange(offset, offset + b, device=view.policy_chosen.device))


def whole_step(x: LossInputs) -> StepView:
    """The step-wide view of `x`: its own, or `x` itself when the batch is the whole step."""
    if x.step is not None:
        return x.step
    b = x.policy_chosen.numel()
    return StepView(x.policy_chosen.detach(), x.policy_rejected.detach(), x.ref_chosen, x.ref_rejected,
                    torch.arange(b, device=x.policy_chosen.device))
