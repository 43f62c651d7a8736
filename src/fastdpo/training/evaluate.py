"""Evaluation on held-out preference pairs, shared by `fastdpo eval` and evaluation during training.

The pairs go through the same packed forward as training (`sequence_logps`, the reference's `logps`), without grad,
in eval mode. Metrics carry TRL's names (`loss`, `rewards/accuracies`, ...); during training they are logged with an
`eval_` prefix, and the best checkpoint by `--metric_for_best_model` is tracked and protected from rotation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from fastdpo.data.load import Row
from fastdpo.data.pack import split_micro_batches
from fastdpo.data.rankings import ranking_sizes
from fastdpo.data.tokenize import TokenizedPair
from fastdpo.dpo.reference import REF_ADAPTER, Reference, active_adapter, precomputed_table
from fastdpo.kernels.logprob_head import chunk_logits as _chunk_logits
from fastdpo.losses import (
    LOSSES,
    LossInputs,
    LossParams,
    loss_inputs,
    loss_metrics,
    loss_params,
    mean_logp_rewards,
    needs_kl_completions,
    needs_prompt_targets,
    total_loss,
    trains_rankings,
    trains_unpaired,
)
from fastdpo.model.backend import Backend, build_mask, choose_backend, make_batch, output_head, target_hidden
from fastdpo.model.seqlogps import completion_logps
from fastdpo.observe.metrics import UnpairedMetrics

log = logging.getLogger("fastdpo")

# ---------------------------------------------------------------- held-out rows


# ---------------------------------------------------------------- the forward over held-out pairs


def held_out_reference(cfg, policy, device, pairs: list[TokenizedPair], rows: list[Row], pad_id: int):
    """With --precompute_ref_log_probs, the reference table of the held-out pairs (the training table holds the
    training pairs only); None otherwise: the online strategies evaluate with the training reference.
    `policy` must not yet carry the trained LoRA adapter (like the training table)."""
    if not pairs or not cfg.precompute_ref_log_probs or not cfg.needs_reference():
        return None
    backend = choose_backend(policy, cfg.attn_impl, cfg.padding_free, device, cfg.length_buckets)
    return Reference("precompute", table=precomputed_table(cfg, lambda: (policy, backend), pairs, rows, pad_id))


def _batches(pairs: list[TokenizedPair], backend: Backend, pad_id: int, device, max_tokens: int, batch_size: int,
             prompt_targets: bool = False):
    backend = backend.grouping(False)  # per-token figures (kl) count every pair's tokens
    for group in split_micro_batches(pairs, max_tokens, batch_size):
        batch = make_batch(group, backend, pad_id, device, max_tokens, prompt_targets)
        yield batch, build_mask(batch, backend)


LOSS_INPUT_FIELDS = ("policy_chosen", "policy_rejected", "ref_chosen", "ref_rejected", "chosen_tokens",
                     "rejected_tokens", "chosen_nll_logps", "pair_weights", "prompt_logps", "prompt_tokens")


@torch.no_grad()
def pair_logps(model, reference: Reference, pairs: list[TokenizedPair], backend: Backend, pad_id: int, device,
               max_tokens: int = 0, batch_size: int = 8, ld_alpha: float = 1.0, wpo: bool = False,
               policy_forward=None, prompt_targets: bool = False) -> LossInputs:
    """The loss inputs of every pair, policy and reference (None when there is none), through the training forward
    (`completion_logps`, `Reference.logps`) in eval mode: one `LossInputs` over all pairs (micro-batch order, on the
    CPU), so losses that rank pairs see the whole set. `policy_forward(batch, mask, wpo)`: the training module's
    forward instead of `model`'s own (under DDP/FSDP2 the forward must go through the wrapped module).
    `prompt_targets`: with the prompt tokens' log-probs, for a loss whose NLL covers the prompt (ORPO)."""
    parts = []
    with _eval_mode(model):
        for batch, mask in _batches(pairs, backend, pad_id, device, max_tokens, batch_size, prompt_targets):
            if policy_forward is not None:
                pol = policy_forward(batch, mask, wpo)
            else:
                pol = completion_logps(model, batch, backend, mask, wpo=wpo)
            ref = reference.logps(model, batch, backend, mask)
            parts.append(loss_inputs(pol, ref, batch.lengths, ld_alpha, prompt_lengths=batch.prompt_lengths))

    def cat(name: str):
        values = [getattr(x, name) for x in parts]
        return None if values[0] is None else torch.cat([v.detach().float().cpu() for v in values])

    return LossInputs(**{name: cat(name) for name in LOSS_INPUT_FIELDS})


@contextlib.contextmanager
def _eval_mode(model):
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def preference_metrics(x: LossInputs, params: LossParams, terms: list[tuple[str, float]],
                       rpo_alpha: float = 0.0) -> dict:
    """Held-out metrics from per-pair log-probs (TRL names). Implicit rewards are beta x (policy - reference)
    log-prob sums (beta x policy without a reference); accuracy counts pairs whose chosen reward is strictly larger.
    `loss` is the training loss over the set (`total_loss` of the weighted terms, plus RPO, averaged over pairs);
    it is left out when a term needs a reference and there is none. SimPO and ORPO (`mean_logp_rewards`) report
    per-token mean log-probs and beta x those means, reference-free, as TRL does; ORPO adds TRL's `nll_loss`,
    `log_odds_ratio` and `log_odds_chosen` (means over the set: the NLL a token mean over its chosen sequences)."""
    beta = float(params.beta)
    has_ref = x.ref_chosen is not None
    lp_c, lp_r = x.policy_chosen, x.policy_rejected
    if mean_logp_rewards(name for name, _ in terms):
        lp_c, lp_r = lp_c / x.chosen_tokens.clamp(min=1), lp_r / x.rejected_tokens.clamp(min=1)
        has_ref = False
    rc = beta * (x.policy_chosen - x.ref_chosen) if has_ref else beta * lp_c
    rr = beta * (x.policy_rejected - x.ref_rejected) if has_ref else beta * lp_r
    out = {}
    if has_ref or not any(LOSSES[name].needs_reference for name, _ in terms):
        out["loss"] = float(total_loss(x, params, terms, rpo_alpha).mean())
    out.update({
        "rewards/chosen": float(rc.mean()),
        "rewards/rejected": float(rr.mean()),
        "rewards/margins": float((rc - rr).mean()),
        "rewards/accuracies": float((rc > rr).float().mean()),
        "logps/chosen": float(lp_c.mean()),
        "logps/rejected": float(lp_r.mean()),
    })
    out.update({name: float(v.mean()) for name, v in loss_metrics(x, params, terms).items()})
    return out


def held_out_metrics(x: LossInputs, pairs: list[TokenizedPair], params: LossParams, terms: list[tuple[str, float]],
                     rpo_alpha: float = 0.0) -> dict:
    """The metrics of scored held-out `pairs` (`x` in their order for unpaired rows and rankings): KTO's for unpaired
    rows, the pair metrics otherwise, with a listwise loss's `loss` the mean over rankings."""
    names = [name for name, _ in terms]
    if trains_unpaired(names):
        return unpaired_metrics(x, pairs, params, terms)
    if trains_rankings(names):
        sizes = ranking_sizes(pairs)
        x = dataclasses.replace(x, rankings=sizes, row_scale=torch.full((len(pairs),), len(pairs) / len(sizes)))
    return {**preference_metrics(x, params, terms, rpo_alpha), **per_token_logps(x)}


def unpaired_metrics(x: LossInputs, pairs: list[TokenizedPair], params: LossParams,
                     terms: list[tuple[str, float]]) -> dict:
    """Held-out metrics of unpaired rows (KTO) with the training step's arithmetic (`UnpairedMetrics`), each chunk of
    rows (their KL chunks, as TRL builds them for the eval set) in the place of a micro-batch: `loss` the mean over
    chunks of each chunk's mean row loss, `kl` and the per-label rewards and log-probs means over chunks."""
    labels = torch.tensor([bool(p.label) for p in pairs])
    chunk_of = torch.tensor([p.chunk for p in pairs])
    chunks = chunk_of.unique(sorted=True)
    kl = torch.zeros(len(pairs))
    if needs_kl_completions(name for name, _ in terms):
        for c in chunks:
            at = chunk_of == c
            kl[at] = (x.policy_rejected[at] - x.ref_rejected[at]).mean().clamp(min=0)
    rows = LossInputs(x.policy_chosen, x.policy_rejected, x.ref_chosen, x.ref_rejected, x.chosen_tokens,
                      x.rejected_tokens, labels=labels, kl=kl)
    losses = total_loss(rows, params, terms)
    metrics = UnpairedMetrics(torch.device("cpu"), len(chunks))
    for i, c in enumerate(chunks):
        at = chunk_of == c
        metrics.add_loss(losses[at].mean() / len(chunks))
        metrics.add_round(i, float(params.beta), x.policy_chosen[at], x.ref_chosen[at], labels[at], kl[at][0], True)
    return metrics.finish()


def per_token_logps(x: LossInputs) -> dict:
    """Per-token means over the completion tokens (token-weighted), as training logs them: the policy's log-probs
    and, with a reference, its log-probs and the signed log-ratios policy - reference (`logratio/*`, not a KL: the
    completions are the data's, not sampled from the policy)."""
    n_c, n_r = x.chosen_tokens.sum(), x.rejected_tokens.sum()
    out = {"logps/chosen_per_token": float(x.policy_chosen.sum() / n_c),
           "logps/rejected_per_token": float(x.policy_rejected.sum() / n_r)}
    if x.ref_chosen is not None:
        out["ref_logps/chosen_per_token"] = float(x.ref_chosen.sum() / n_c)
        out["ref_logps/rejected_per_token"] = float(x.ref_rejected.sum() / n_r)
        lr_c, lr_r = (x.policy_chosen - x.ref_chosen).sum(), (x.policy_rejected - x.ref_rejected).sum()
        out["logratio/chosen"], out["logratio/rejected"] = float(lr_c / n_c), float(lr_r / n_r)
        out["logratio/mean"] = float((lr_c + lr_r) / (n_c + n_r))
    return out


@torch.no_grad()
def token_kl(model, reference: Reference, pairs: list[TokenizedPair], backend: Backend, pad_id: int, device,
             max_tokens: int = 0, batch_size: int = 8, chunk: int = 2048) -> float:
    """`kl`: the mean per-token KL(policy || reference) of the next-token distributions at every completion position
    of the pairs (chosen and rejected, teacher-forced), exact over the whole vocabulary (nonnegative), in float32, a
    chunk at a time. Needs a reference model (not a precomputed table)."""
    assert reference.strategy not in ("none", "precompute"), reference.strategy
    total, count = 0.0, 0
    with _eval_mode(model):
        for batch, mask in _batches(pairs, backend, pad_id, device, max_tokens, batch_size):
            h = target_hidden(model, batch, backend, mask)
            head = output_head(model)
            if reference.strategy in ("adapter_off", "ref_adapter"):
                ctx = model.disable_adapter() if reference.strategy == "adapter_off" else active_adapter(model,
                                                                                                       REF_ADAPTER)
                with ctx:
                    h_ref = target_hidden(model, batch, backend, mask)
                    head_ref = output_head(model)
            else:
                h_ref = target_hidden(reference.model, batch, backend, mask)
                head_ref = output_head(reference.model)
            for s in range(0, h.shape[0], chunk):
                lp = torch.log_softmax(_chunk_logits(h[s : s + chunk], head.weight, head.scale, head.softcap)[0], -1)
                lq = torch.log_softmax(
                    _chunk_logits(h_ref[s : s + chunk], head_ref.weight, head_ref.scale, head_ref.softcap)[0], -1)
                total += float((lp.exp() * (lp - lq)).sum())
            count += h.shape[0]
    return total / max(count, 1)


# ---------------------------------------------------------------- best checkpoint


def metric_key(name: str) -> str:
    """`loss` or `eval_loss` -> `eval_loss` (HF accepts both)."""
    return name if name.startswith("eval_") else f"eval_{name}"


@dataclass
class BestTracker:
    """The best evaluation so far and the checkpoint saved at its step (HF's best_metric / best_model_checkpoint)."""

    metric: str  # eval_-prefixed
    greater_is_better: bool
    best_metric: float | None = None
    best_step: int | None = None
    best_model_checkpoint: str | None = None

    @classmethod
    def from_config(cls, metric: str, greater_is_better: bool | None) -> BestTracker:
        key = metric_key(metric)
        if greater_is_better is None:  # as HF: lower is better for losses, higher for everything else
            greater_is_better = not key.endswith("loss")
        return cls(key, greater_is_better)

    def update(self, step: int, record: dict) -> bool:
        """Take an evaluation record; True when it is the new best. NaN never wins."""
        value = record.get(self.metric)
        if value is None or not math.isfinite(value):
            return False
        better = self.best_metric is None or (value > self.best_metric if self.greater_is_better
                                              else value < self.best_metric)
        if better:
            self.best_metric, self.best_step = float(value), step
        return better

    def saved(self, step: int, path: Path) -> None:
        """A model was saved at `step` into `path`: it becomes the best checkpoint when its step is the best."""
        if step == self.best_step:
            self.best_model_checkpoint = str(path)

    def state(self) -> dict:
        return {"best_metric": self.best_metric, "best_step": self.best_step,
                "best_model_checkpoint": self.best_model_checkpoint, "metric_for_best_model": self.metric}

    def load(self, state: dict) -> None:
        if state.get("metric_for_best_model") == self.metric:  # a changed metric starts a fresh ranking
            self.best_metric = state.get("best_metric")
            self.best_step = state.get("best_step")
            self.best_model_checkpoint = state.get("best_model_checkpoint")


# ---------------------------------------------------------------- evaluation during training


class TrainingEval:
    """Evaluation every --eval_steps optimizer updates (else at every save) and at the end, on the validation pairs,
    with best-checkpoint tracking. Does nothing without validation pairs."""

    def __init__(self, cfg, pairs: list[TokenizedPair], progress: dict | None = None, reference: Reference | None = None):
        self.cfg = cfg
        self.pairs = pairs
        self.reference = reference  # the held-out table of a precomputed reference; else the training reference
        self.best = BestTracker.from_config(cfg.metric_for_best_model, cfg.greater_is_better)
        self.last_step: int | None = None
        if progress:
            self.best.load(progress)

    def due(self, step: int, total: int) -> bool:
        if not self.pairs:
            return False
        if step == total:
            return True
        if self.cfg.eval_steps > 0:
            return step % self.cfg.eval_steps == 0
        return self.cfg.save_steps > 0 and step % self.cfg.save_steps == 0

    def run(self, s, step: int, epoch: float) -> dict:
        """Evaluate the policy of setup `s` now; returns the eval_-prefixed record (and updates the best)."""
        cfg = self.cfg
        t0 = time.perf_counter()
        pad_id = s.tokenizer.pad_token_id or 0
        from fastdpo.parallel.wrap import policy_logps

        in_order = s.unpaired or s.listwise  # rows in data order: KTO's chunks, whole rankings
        x = pair_logps(s.model, self.reference or s.reference, self.pairs, s.backend, pad_id, s.device,
                       0 if in_order else s.plan.max_tokens_per_batch, cfg.per_device_train_batch_size, cfg.ld_alpha,
                       cfg.use_weighting, functools.partial(policy_logps, s.policy),
                       needs_prompt_targets(n for n, _ in s.loss_terms))
        params = loss_params(cfg, s.beta.value())
        metrics = held_out_metrics(x, self.pairs, params, s.loss_terms, cfg.rpo_alpha)
        dt = time.perf_counter() - t0
        record = {"step": step, "epoch": epoch, **{f"eval_{k}": v for k, v in metrics.items()},
                  "eval_runtime": round(dt, 4), "eval_pairs_per_second": len(self.pairs) / max(dt, 1e-9)}
        self.best.update(step, record)
        self.last_step = step
        return record

    def progress(self) -> dict:
        """What a checkpoint stores so a resumed run keeps ranking against the same best."""
        return self.best.state() if self.pairs else {}

    def summary(self) -> dict:
        if not self.pairs:
            return {}
        return {"eval_pairs": len(self.pairs), **self.best.state()}


# ---------------------------------------------------------------- `fastdpo eval`


