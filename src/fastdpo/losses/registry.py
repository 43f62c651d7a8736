"""The registry that maps `--loss_type` names to loss functions and their traits. A loss registers itself where it
is defined (`@loss("sigmoid", f_divergence=True)`), so adding a loss touches one file; config validates names and
traits against `LOSSES`. Also how the terms of a run combine (`total_loss`) and the metrics a loss logs besides the
shared ones (`@extra_metrics`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from fastdpo.losses.inputs import LossInputs, LossParams
from fastdpo.losses.terms import chosen_nll

LossFn = Callable[[LossInputs, LossParams], torch.Tensor]
MetricsFn = Callable[[LossInputs, LossParams], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class LossSpec:
    """A --loss_type: its function (per-pair loss, (B,)) and what it needs and allows."""

    fn: LossFn
    needs_reference: bool = True
    f_divergence: bool = False  # defined for every --f_divergence_type (built on the reward difference h)
    sorts_step: bool = False  # couples the pairs of a step: needs the step's log-probs before the backward
    mean_logps: bool = False  # its implicit reward is beta x the per-token mean log-prob: logged so, as TRL logs it
    prompt_nll: bool = False  # its NLL term covers the chosen sequence's prompt too: batches carry prompt targets
    unpaired: bool = False  # trains on unpaired rows (a completion and its label), not on pairs: stands alone
    kl_completions: bool = False  # unpaired: needs each row's KL completion (another row's completion)
    listwise: bool = False  # over rankings of completions, given as their adjacent pairs: stands alone


LOSSES: dict[str, LossSpec] = {}  # in the order the losses are defined

# Metrics a loss logs besides the shared ones, under TRL's names: (names, per-pair values (B,) of each).
LOSS_METRICS: dict[str, tuple[tuple[str, ...], MetricsFn]] = {}


def loss(name: str, *, needs_reference: bool = True, f_divergence: bool = False, sorts_step: bool = False,
         mean_logps: bool = False, prompt_nll: bool = False, unpaired: bool = False,
         kl_completions: bool = False, listwise: bool = False) -> Callable[[LossFn], LossFn]:
    """Register the decorated function as --loss_type `name`, with its traits (see `LossSpec`)."""

    def register(fn: LossFn) -> LossFn:
        assert name not in LOSSES, f"--loss_type {name} is registered twice"
        LOSSES[name] = LossSpec(fn, needs_reference, f_divergence, sorts_step, mean_logps, prompt_nll, unpaired,
                                kl_completions, listwise)
        return fn

    return register


def extra_metrics(name: str, *names: str) -> Callable[[MetricsFn], MetricsFn]:
    """Register the decorated function as the metrics `names` of --loss_type `name` (per-pair values, (B,))."""

    def register(fn: MetricsFn) -> MetricsFn:
        assert name not in LOSS_METRICS, f"--loss_type {name} has its metrics registered twice"
        LOSS_METRICS[name] = (names, fn)
        return fn

    return register


def mean_logp_rewards(names: Iterable[str]) -> bool:
    """Whether the losses `names` log their log-probs and rewards as per-token means (beta x mean log-prob), as TRL's
    CPOTrainer logs SimPO and its ORPOTrainer logs ORPO; losses with a reference (and CPO) log sums, as TRL's
    trainers do."""
    specs = [LOSSES[n] for n in names]
    return any(sp.mean_logps for sp in specs) and not any(sp.needs_reference for sp in specs)


def needs_prompt_targets(names: Iterable[str]) -> bool:
    """Whether the losses `names` need the prompt tokens' log-probs (ORPO's NLL, over prompt + chosen as in TRL's
    ORPOTrainer). Without such a loss the batches carry no prompt targets and the output head sees none."""
    return any(LOSSES[n].prompt_nll for n in names)


def trains_unpaired(names: Iterable[str]) -> bool:
    """Whether the losses `names` train on unpaired rows (KTO): then they are the run's only loss."""
    return any(LOSSES[n].unpaired for n in names)


def trains_rankings(names: Iterable[str]) -> bool:
    """Whether the losses `names` train on rankings (Plackett-Luce): then they are the run's only loss."""
    return any(LOSSES[n].listwise for n in names)


def needs_kl_completions(names: Iterable[str]) -> bool:
    """Whether the losses `names` need each unpaired row's KL completion (KTO's KL estimate)."""
    return any(LOSSES[n].kl_completions for n in names)


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


def total_loss(x: LossInputs, p: LossParams, terms: list[tuple[str, float]], rpo_alpha: float = 0.0) -> torch.Tensor:
    """Per-pair loss (B,): sum_k weight_k * loss_k (each times the WPO pair weight when given) + rpo_alpha * nll."""
    out = torch.zeros_like(x.policy_chosen)
    for name, weight in terms:
        per_pair = LOSSES[name].fn(x, p)
        if x.pair_weights is not None:
            per_pair = per_pair * x.pair_weights
        if x.row_scale is not None:
            per_pair = per_pair * x.row_scale
        out = out + weight * per_pair
    if rpo_alpha:
        out = out + rpo_alpha * chosen_nll(x)
    return out
