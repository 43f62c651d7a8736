"""One optimizer step, the only one there is (DESIGN §6): `Trainer.step()` runs the step's micro-batches (policy
forward, reference forward, per-pair losses summed and divided by the step's pair count, backward), then clips, takes
the guarded update (a NaN/Inf loss or gradient skips it), and advances the learning-rate and beta schedules.
`fastdpo train`, `fastdpo bench`, `fastdpo tune` and `--gradient_checkpointing auto` all call it, so what is
measured is what trains. Under torchrun every rank runs it on its share of each step's pairs."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch
from torch.profiler import record_function as phase  # names the loop's phases in --profile_steps traces

from fastdpo.config import RunPlan, TrainConfig
from fastdpo.data.pack import PairBatch, step_order, unit_step_order
from fastdpo.data.rankings import ranking_sizes
from fastdpo.data.tokenize import TokenizedPair
from fastdpo.losses import (
    LOSSES,
    LossInputs,
    StepView,
    at,
    loss_inputs,
    loss_metric_names,
    loss_metrics,
    loss_params,
    mean_logp_rewards,
    needs_kl_completions,
    needs_prompt_targets,
    step_view,
    total_loss,
)
from fastdpo.model.backend import FLEX_PAD, build_mask, flex_length, make_batch
from fastdpo.model.memory import offloading
from fastdpo.observe.metrics import StepMetrics, UnpairedMetrics
from fastdpo.optim.optimizer import (
    build_optimizer,
    build_scheduler,
    scales_gradients,
    step_unless_nonfinite,
    undo_step_count,
)
from fastdpo.parallel.collectives import (
    clip_coef,
    clip_grad_norm,
    gather_step_view,
    sum_over_groups,
    total_grad_norm,
)
from fastdpo.parallel.distributed import Dist
from fastdpo.parallel.sequence import split_micro_batch
from fastdpo.parallel.split import rank_micro_batches, rank_units
from fastdpo.parallel.wrap import gather_step_start, grad_sync, policy_logps
from fastdpo.training.certificate import Certificate
from fastdpo.training.monitor import finite_flag
from fastdpo.training.setup import Setup, build_setup, pad_id


def attended_pairs(p: TokenizedPair) -> int:
    """(query, key) pairs the rule allows within one pair: for MFU."""
    n_p, n_c, n_r = len(p.prompt), len(p.chosen), len(p.rejected)
    return n_p * (n_p + 1) // 2 + n_c * n_p + n_c * (n_c + 1) // 2 + n_r * n_p + n_r * (n_r + 1) // 2


def chosen_targets(p: TokenizedPair) -> int:
    """Predicted chosen tokens: no state predicts the first token of an unprompted completion."""
    return len(p.chosen) - (len(p.prompt) == 0)


def prompt_targets(p: TokenizedPair) -> int:
    """Predicted prompt tokens (for an NLL over prompt + chosen): every one after the first."""
    return max(len(p.prompt) - 1, 0)


def with_prompt_targets(s: Setup) -> bool:
    """Whether this run's loss needs the prompt tokens' log-probs (ORPO); otherwise batches carry none."""
    return needs_prompt_targets(name for name, _ in s.loss_terms)


@torch.no_grad()
def step_logps(s: Setup, groups: list[list[TokenizedPair]], filler: list[TokenizedPair]) -> tuple[StepView, list, int]:
    """Every pair's log-probs over the whole step (all ranks), without grad: losses that sort the step's pairs (aot)
    need the ranks before any backward. One extra policy forward, for those losses only; the reference results are
    kept. Also returns where this rank's pairs start in the step-wide view."""
    parts, refs = [], []
    for group in groups:
        batch = make_batch(group or filler, s.backend, pad_id(s.tokenizer), s.device, s.plan.max_tokens_per_batch)
        batch, mask = split_micro_batch(batch, s.backend, s.dist, pad_id(s.tokenizer))
        pol = policy_logps(s.policy, batch, mask)
        refs.append(s.reference.logps(s.model, batch, s.backend, mask))
        if group:
            parts.append(loss_inputs(pol, refs[-1], batch.lengths, s.cfg.ld_alpha))
    view, start = gather_step_view(step_view(parts) if parts else None, s.dist, s.device)
    return view, refs, start


def warm_up_lengths(s: Setup) -> int:
    """Build the kernels of every static micro-batch length up front (--compile_warmup; `fastdpo bench` always):
    the online reference's forward and the policy's forward and backward on a filler pair of each length.
    Gradients are discarded and the random state restored, so training continues exactly as without it. Returns
    the number of lengths."""
    if s.backend.name == "varlen":  # its kernels take any length: nothing to build ahead
        return 0
    budget = s.plan.max_tokens_per_batch
    cuda = s.device.type == "cuda"
    rng = torch.get_rng_state(), torch.cuda.get_rng_state(s.device) if cuda else None
    lengths = sorted({flex_length(t, budget, s.backend.lengths) for t in range(FLEX_PAD, budget + 1, FLEX_PAD)})
    for length in lengths:
        n = length - FLEX_PAD // 2
        pair = TokenizedPair(prompt=[5] * (n // 2), chosen=[6] * (n // 4), rejected=[7] * (n - n // 2 - n // 4), index=0)
        batch = make_batch([pair], s.backend, pad_id(s.tokenizer), s.device, budget, with_prompt_targets(s))
        mask = build_mask(batch, s.backend)
        if s.reference.online:  # its no-grad forward compiles graphs of its own
            s.reference.logps(s.model, batch, s.backend, mask)
        with offloading(s.cfg.activation_offloading, s.model):
            pol = policy_logps(s.policy, batch, mask)
        pol.sums.sum().backward()
    s.model.zero_grad(set_to_none=True)
    torch.set_rng_state(rng[0])
    if cuda:
        torch.cuda.set_rng_state(rng[1], s.device)
        torch.cuda.synchronize(s.device)
    return len(lengths)


@dataclass
class Packed:
    """A micro-batch on the device: `whole` as packed (what the step's counts read), `batch` this rank's share of it
    (under sequence parallelism; else `whole`), and the attention mask the policy and reference forwards share."""

    whole: PairBatch
    batch: PairBatch
    mask: object


@dataclass
class Ahead:
    """The next optimizer step, made ready while the device still runs this one: its pairs, its micro-batches'
    pairs, and the first micro-batch packed (its copy to the device queued behind this step's update)."""

    step: int  # the optimizer steps done when it runs
    pairs: list[TokenizedPair]
    groups: list[list[TokenizedPair]]
    first: Packed


def step_groups(s: Setup, step_pairs: list[TokenizedPair]) -> list[list[TokenizedPair]]:
    """This rank's micro-batches of a step: pairs dealt over the data-parallel groups (the ranks of a
    sequence-parallel group share each micro-batch)."""
    cfg, d = s.cfg, s.dist
    if s.unpaired:  # KTO: each micro-batch is one chunk of rows, the unit its KL estimate is taken over
        return rank_units(step_pairs, d.dp_rank, d.dp_size)
    if s.listwise:  # Plackett-Luce: whole rankings, --per_device_train_batch_size of them per micro-batch
        return rank_units(step_pairs, d.dp_rank, d.dp_size, cfg.per_device_train_batch_size)
    return rank_micro_batches(step_pairs, d.dp_rank, d.dp_size, s.plan.max_tokens_per_batch,
                              cfg.per_device_train_batch_size, s.backend.group, s.backend.dedupe)


def pack_micro_batch(s: Setup, group: list[TokenizedPair], step_pairs: list[TokenizedPair]) -> Packed:
    """Pack a micro-batch (an empty share packs the step's first pair, to be zero-weighted) and build its mask,
    built once and shared by policy and reference forwards and all layers; under sequence parallelism the batch
    becomes this rank's share of the row's tokens."""
    with phase("fastdpo.pack"):
        whole = make_batch(group or step_pairs[:1], s.backend, pad_id(s.tokenizer), s.device,
                           s.plan.max_tokens_per_batch, with_prompt_targets(s))
        batch, mask = split_micro_batch(whole, s.backend, s.dist, pad_id(s.tokenizer))
    return Packed(whole, batch, mask)


def run_step(s: Setup, step_pairs: list[TokenizedPair], metrics: StepMetrics, ahead: Ahead | None = None) -> None:
    """Forward and backward over this rank's share of one optimizer step's pairs (all of them on one process);
    gradients accumulate in .grad and are summed across ranks on the last micro-step. `ahead`: this step's
    micro-batches and first batch, made ready during the previous step."""
    cfg, d = s.cfg, s.dist
    n_pairs = len(step_pairs)  # the whole step, all ranks
    beta = s.beta.value()
    params = loss_params(cfg, beta)
    # NLL terms are token means over the step's chosen tokens, written per pair like every other term; ORPO's also
    # counts the prompt targets (TRL's ORPOTrainer takes its NLL over prompt + chosen)
    tokens_per_pair = sum(chosen_targets(p) for p in step_pairs) / n_pairs
    prompt = with_prompt_targets(s)
    prompt_per_pair = sum(prompt_targets(p) for p in step_pairs) / n_pairs if prompt else None
    groups = ahead.groups if ahead is not None else step_groups(s, step_pairs)
    chunks = len({p.chunk for p in step_pairs}) if s.unpaired or s.listwise else 0  # KTO's chunks, or rankings
    if s.unpaired:
        metrics.start(len(groups))
    view, refs, offset = None, None, 0
    if any(LOSSES[name].sorts_step for name, _ in s.loss_terms):
        view, refs, offset = step_logps(s, groups, step_pairs[:1])
    for i, group in enumerate(groups):
        real = bool(group)  # an empty share still runs (zero-weighted) so every rank joins the same collectives
        packed = ahead.first if ahead is not None and i == 0 else pack_micro_batch(s, group, step_pairs)
        metrics.count_batch(packed.whole)
        batch, mask = packed.batch, packed.mask
        b = batch.num_pairs
        with grad_sync(s.policy, last=i == len(groups) - 1, keep_gathered=d.keeps_gathered):
            with phase("fastdpo.forward"), offloading(cfg.activation_offloading, s.model):
                pol = policy_logps(s.policy, batch, mask, wpo=cfg.use_weighting)
            with phase("fastdpo.loss"):
                ref = refs[i] if refs is not None else s.reference.logps(s.model, batch, s.backend, mask)
                in_step = at(view, offset if real else 0, b) if view is not None else None
                x = loss_inputs(pol, ref, batch.lengths, cfg.ld_alpha, tokens_per_pair, in_step, batch.prompt_lengths,
                                prompt_per_pair)
                if s.unpaired:
                    x = unpaired_inputs(s, x, group or step_pairs[:1], n_pairs, chunks, real)
                elif s.listwise:  # each ranking weighs as one example of the step
                    x = dataclasses.replace(x, rankings=ranking_sizes(group or step_pairs[:1]),
                                            row_scale=x.policy_chosen.new_full((b,), n_pairs / chunks))
                # divide by the pairs of the whole step (all ranks), not the micro-batch: accumulation is then exact
                loss = total_loss(x, params, s.loss_terms, cfg.rpo_alpha).sum() / n_pairs
                if not real:
                    loss = loss * 0.0
            with phase("fastdpo.backward"):
                loss.backward()
        if s.unpaired:
            metrics.add_loss(loss)
            if real:
                metrics.add_round(i, beta, x.policy_chosen.detach(), x.ref_chosen, x.labels, x.kl[0],
                                  d.dp_rank == 0)
                offset += b
        elif real:
            s.beta.observe(x)
            metrics.add(loss, beta, x.policy_chosen.detach(), x.policy_rejected.detach(), x.ref_chosen,
                        x.ref_rejected, sum(p.num_tokens for p in group), x.chosen_tokens, x.rejected_tokens)
            metrics.add_pair_values(loss_metrics(x, params, s.loss_terms))
            offset += b


def unpaired_inputs(s: Setup, x: LossInputs, rows: list[TokenizedPair], n_rows: int, chunks: int,
                    real: bool) -> LossInputs:
    """The loss inputs of one chunk of unpaired rows (KTO; design note "Preference groups", 4.4): each row's label;
    the round's KL estimate, the mean over the round's chunks (one per rank) of each chunk's mean of
    policy - reference log-prob of its KL completions, clamped at 0 (kto only); and each row's weight, so the step
    loss is the mean over the step's chunks of each chunk's mean row loss, as TRL's gradient accumulation takes it."""
    b = x.policy_chosen.numel()
    labels = torch.tensor([bool(p.label) for p in rows], device=x.policy_chosen.device)
    kl = x.policy_chosen.new_zeros(())
    if needs_kl_completions(name for name, _ in s.loss_terms):
        with torch.no_grad():
            raw = (x.policy_rejected.detach() - x.ref_rejected).float().mean()
            t = torch.stack([raw * real, raw.new_tensor(float(real))])
            sum_over_groups(t, s.dist)  # every rank's chunk of this round (an empty share adds nothing)
            kl = (t[0] / t[1].clamp(min=1)).clamp(min=0)
    scale = n_rows / (chunks * len(rows))
    return dataclasses.replace(x, labels=labels, kl=kl.expand(b), row_scale=x.policy_chosen.new_full((b,), scale))


@dataclass
class StepResult:
    """What one optimizer step did. `metrics` holds the step's sums over all ranks (read with `.finish()`)."""

    metrics: StepMetrics
    pairs: list[TokenizedPair]
    tokens: int  # prompt + chosen + rejected tokens of the step's pairs (all ranks)
    grad_norm: torch.Tensor
    learning_rate: float  # the rate this step's update used
    beta: float  # the beta this step's loss used
    finite: bool  # loss and gradient were finite: the update was taken
    stepped: bool  # the optimizer ran (False when it skipped the update on the device as well)
    # the host's side of the step: seconds it took to queue everything (the next step's first micro-batch too), then
    # seconds it waited for the device to finish; a wait near zero means the step was bound by the CPU
    queued_s: float = 0.0
    waited_s: float = 0.0


class Trainer:
    """A policy, its reference, data, optimizer and schedules, advanced one optimizer step at a time.

    `Trainer(cfg)` builds everything from a config (model, data, reference; --gradient_checkpointing must name a
    policy: `auto` is resolved by `fastdpo.train`); `Trainer(cfg, setup=assemble(...))` wraps an assembled setup
    (benchmarks, tuners). `step()` takes the next step of the data order; `step(pairs)` runs these pairs instead."""

    def __init__(self, cfg: TrainConfig, setup: Setup | None = None, dist: Dist | None = None):
        self.cfg = cfg
        self.s = setup if setup is not None else build_setup(cfg, dist)
        s = self.s
        self.optimizer = build_optimizer(s.model, cfg, s.device, seed=cfg.seed)
        self.scheduler = build_scheduler(self.optimizer, cfg, s.total_steps)
        self.trainable = [p for p in s.model.parameters() if p.requires_grad]
        self.pairs_per_step = cfg.pairs_per_step * s.dist.dp_size  # the whole step, all data-parallel groups
        self.global_step = 0  # optimizer steps done (a resume sets it)
        self._orders: dict[int, list[list[int]]] = {}
        self.current_pairs: list[TokenizedPair] = []  # the step running (or last run): named if it runs out of memory
        self.pack_ahead = True  # pack the next step's first micro-batch before waiting for this one's update
        self._ahead: Ahead | None = None
        self.certificate: Certificate | None = None  # checked by this process's first step when set (`train` sets it)
        self.resumed = False  # set by a resume: the policy has trained before this process's first step
        self.resume_record: dict | None = None  # what the resumed checkpoint recorded of the step run first

    @property
    def plan(self) -> RunPlan | None:
        """What set-up resolved from the config (checkpointing policy, token budget, device, dtype, attention,
        kernels); the config itself is left as written."""
        return self.s.plan

    def next_pairs(self) -> list[TokenizedPair]:
        """The pairs of optimizer step `global_step + 1`: the seeded order of its epoch, or the stream's next ones."""
        s = self.s
        if s.stream is not None:  # every rank reads the same stream and takes the whole step
            return s.stream.take(self.pairs_per_step)
        epoch, k = divmod(self.global_step, s.steps_per_epoch)
        if epoch not in self._orders and s.rankings is not None:  # a step of whole rankings
            self._orders = {epoch: unit_step_order(s.rankings, self.pairs_per_step, self.cfg.seed, epoch, s.shuffle)}
        if epoch not in self._orders:
            self._orders = {epoch: step_order(len(s.pairs), self.pairs_per_step, self.cfg.seed, epoch, s.shuffle,
                                              s.prompt_runs)}
        return [s.pairs[i] for i in self._orders[epoch][k]]

    def step(self, pairs: list[TokenizedPair] | None = None, then: list[TokenizedPair] | None = None) -> StepResult:
        """One optimizer step: micro-batches with gradient accumulation, clipping, the update unless the loss or the
        gradient is NaN/Inf, the learning-rate and beta schedules, and TR-DPO's reference sync when due.

        Before waiting for its update, the step packs the next one's first micro-batch, so the device does not idle
        while the host packs: the next step of the data order, or `then` when the caller chooses the pairs."""
        s, cfg = self.s, self.cfg
        t_start = time.perf_counter()
        ahead, self._ahead = self._ahead, None
        if ahead is not None and (ahead.step != self.global_step or (pairs is not None and pairs is not ahead.pairs)):
            ahead = None
        if ahead is not None:
            step_pairs = ahead.pairs
        else:
            step_pairs = self.next_pairs() if pairs is None else pairs
        self.current_pairs = step_pairs
        metrics = UnpairedMetrics(s.device) if s.unpaired else StepMetrics(
            s.device, mean_logp_rewards(name for name, _ in s.loss_terms), loss_metric_names(s.loss_terms))
        beta = s.beta.value()
        cert = self.certificate
        if cert is not None and not cert.checks:  # this process's first step: the checks before its update
            cert.before(s, step_pairs, (ahead.groups if ahead is not None else step_groups(s, step_pairs))[0],
                        self.resumed, self.resume_record)
            cert.enforce(final=False)
        run_step(s, step_pairs, metrics, ahead)
        tokens = sum(p.num_tokens for p in step_pairs)
        # the step's sums over all ranks (the guard below decides alike everywhere); counts are known here
        with phase("fastdpo.metrics"):
            sum_over_groups(metrics.sums, s.dist)
            metrics.pairs, metrics.tokens = len(step_pairs), tokens  # the step's, known on every rank from its pairs
        max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")  # 0: no clipping
        with phase("fastdpo.clip"):
            if scales_gradients(self.optimizer):  # the update scales the gradients as it reads them
                grad_norm = total_grad_norm(self.trainable)
                coef = clip_coef(grad_norm, max_norm)
            else:
                grad_norm, coef = clip_grad_norm(self.trainable, max_norm), None
        lr = self.scheduler.get_last_lr()[0]
        # the update obeys the finite flag on the device, so the host queues it without waiting for the backward,
        # and reads the flag after
        with phase("fastdpo.update"):
            finite = finite_flag(metrics.loss_sum, grad_norm)
            stepped = step_unless_nonfinite(self.optimizer, finite, coef)
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        if self.global_step < s.total_steps:  # full_shard: the next forward's first weights, gathered under host work
            gather_step_start(s.policy)
        drift = s.beta.step_sums()
        if drift is not None:  # kl_adaptive: the drift over all ranks, so every rank sets the same next beta
            s.beta.take_step_sums(sum_over_groups(drift, s.dist))
        s.beta.step()
        nxt = then if then else self.next_pairs() if pairs is None and s.stream is None else None
        if nxt and self.pack_ahead and self.global_step < s.total_steps:
            # the host packs the next step while the device finishes this one (else it would idle through it)
            groups = step_groups(s, nxt)
            self._ahead = Ahead(self.global_step, nxt, groups, pack_micro_batch(s, groups[0], nxt))
        t_queued = time.perf_counter()
        ok = bool(finite)  # the step's one wait for the device
        t_read = time.perf_counter()
        if not ok and stepped:
            undo_step_count(self.optimizer)
        if cfg.sync_ref_model and self.global_step % cfg.ref_model_sync_steps == 0:
            s.reference.sync(s.model, cfg.ref_model_mixup_alpha)
        # the certificate's last check waits for the first update that moves the weights: a warm-up from 0 or a
        # gradient that cancels to 0 (contradicting pairs: the grad_collapse alert's) moves nothing, and a
        # non-finite update is the guard's to judge
        if cert is not None and cert.pending and ok and lr > 0 and float(grad_norm) > 0:
            cert.after(s)
            cert.enforce(final=True)
        return StepResult(metrics, step_pairs, tokens, grad_norm, lr, float(beta), ok, stepped, t_queued - t_start,
                          t_read - t_queued)

    def warm_up(self) -> int:
        """Build the kernels of every static micro-batch length before the first step (see `warm_up_lengths`)."""
        return warm_up_lengths(self.s)
