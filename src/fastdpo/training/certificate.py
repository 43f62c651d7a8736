"""The run's certificate: checks, on the run's own model and its first real micro-batch, that what trains is what is
claimed, each PASS, FAIL or SKIP (with why) with the measured figure and the tolerance it was held to. Written to
summary.json and the run's log; a FAIL stops the run before its first update is kept, unless `--certificate warn`.

- `fast_path`: the policy's completion log-probs through the run's packed layout against the plain padded path (one
  row per sequence, the model's own attention), both in the run's dtype, before the first update: a wrong attention
  mask, positions or targets change them.
- `head_float32`: the completion log-probs from the plain path's final hidden states through the run's log-prob head
  (its fused kernels, its dtype) against a float32 computation of the same head (logits, soft-cap, log-softmax),
  chunked over the vocabulary: a head kernel that computes something else fails it.
- `reference_at_start`: the reference's log-probs of that batch against the policy's before the first update, where
  they must agree (a frozen copy, LoRA adapters switched off, a precomputed or cached table of the starting weights):
  a stale or foreign cache, or a reference that is not the starting model, fails it.
- `reference_apart`: after the first update the policy's log-probs of that batch differ from the reference's, both
  computed then: a reference that follows the policy (the policy itself) fails it.
- `resumed_step` (a resumed run): the first pairs of its first step and their log-probs against what the checkpoint
  recorded of the step it would have run next: a data order or weights not restored fail it.

Cost: a packed and a padded policy forward and a reference forward of two pairs of the first micro-batch before the
first step (the packed one serves two checks, the padded one's hidden states the head's), a policy and a reference
forward after it, and at the end of the run the same two again for the record `fastdpo verify --run` checks the
saved model against (`final_record`), all without gradient; in the run's summary as `certificate.seconds`.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import asdict, dataclass, field

import torch

from fastdpo.data.tokenize import TokenizedPair
from fastdpo.errors import FastDPOError
from fastdpo.model import seqlogps
from fastdpo.model.backend import build_mask, make_batch, output_head, target_hidden
from fastdpo.model.fused import eager_layers
from fastdpo.model.seqlogps import completion_logps, summarise
from fastdpo.parallel.collectives import any_rank
from fastdpo.parallel.wrap import policy_logps

log = logging.getLogger("fastdpo")
# the difference allowed between two computations of the same completions' log-probs, by dtype: the sum over
# sequences of |difference of log-prob sums| per completion token (nats per token; rounding stays far below, a
# wrong mask or a stale table far above)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-1, torch.float16: 5e-2}
VOCAB_CHUNK = 16384  # rows of lm_head the float32 head takes at a time (a float32 copy of 16384 x 4096: 256 MiB)
PAIRS = 2  # pairs of the first micro-batch the checks run on: enough to see a mask, little to compute
# reference strategies whose log-probs equal the starting policy's (a --ref_model or --ref_adapters differs)
STARTS_EQUAL = ("copy", "adapter_off", "precompute")


@dataclass
class Check:
    name: str
    status: str  # PASS | FAIL | SKIP
    detail: str
    measured: float | None = None  # the difference found, nats per completion token (`per_token`)
    tolerance: float | None = None

    def line(self) -> str:
        figures = (f" (measured {self.measured:.3g}, tolerance {self.tolerance:.3g} nats per token)"
                   if self.measured is not None else "")
        return f"certificate {self.name}: {self.status}{figures}: {self.detail}"


@dataclass
class Certificate:
    """The checks of one run, filled in by its first step (`Trainer.step` calls `before` and `after`) on the first
    `PAIRS` pairs of that step's first micro-batch (this rank's)."""

    mode: str = "on"  # on: a FAIL stops the run; warn: logged only
    checks: list[Check] = field(default_factory=list)
    seconds: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)  # seconds of each stage (what `seconds` sums)
    # what the checks before the first update cost besides seconds (`costs_since`): full Python garbage collections,
    # and on CUDA the caching allocator's new segments and its retries (a retry frees the whole cache: slow)
    costs: dict[str, int] = field(default_factory=dict)
    record: dict | None = None  # the checked pairs' log-probs with the run's last weights (`final_record`)
    _batch: list[TokenizedPair] | None = None
    _first: list[TokenizedPair] | None = None
    _ref: torch.Tensor | None = None

    @property
    def status(self) -> str:
        if any(c.status == "FAIL" for c in self.checks):
            return "FAIL"
        return "PASS" if self.checks else "SKIP"

    def to_dict(self) -> dict:
        out = {"status": self.status, "seconds": round(self.seconds, 3),
               "seconds_by_part": {k: round(v, 3) for k, v in self.parts.items()}, "costs": dict(self.costs),
               "checks": [asdict(c) for c in self.checks]}
        if self.record is not None:
            out["record"] = self.record
        return out

    def before(self, s, step_pairs: list[TokenizedPair], first: list[TokenizedPair], resumed: bool = False,
               record: dict | None = None) -> None:
        """Before the first update: the fast path against the plain path, and the reference against the policy, on
        the step's first micro-batch `first` (this rank's). A `resumed` run's policy has trained: it is not checked
        against the reference, only apart from it after its first update; instead its first step is checked against
        `record`, what the checkpoint wrote of it (`next_step_record`)."""
        t0, counts = time.perf_counter(), cost_counts(s.device)
        try:
            self._before(s, step_pairs, first, resumed, record, t0)
        finally:
            self.costs = costs_since(counts, s.device)

    def _before(self, s, step_pairs: list[TokenizedPair], first: list[TokenizedPair], resumed: bool,
                record: dict | None, t0: float) -> None:
        pairs = (first or step_pairs[:1])[:PAIRS]
        self._batch = self._first = pairs
        dtype = next(s.model.parameters()).dtype
        tol = TOLERANCE.get(dtype, 1e-2)
        if resumed:
            self._resumed_step(s, step_pairs, record, tol)
            self._took("resumed_step", t0)
        fast = self._fast_path(s, pairs, tol)  # the policy's sums through the run's layout, reused below
        t1 = time.perf_counter()
        ref = s.reference
        if ref.strategy == "none":
            self.checks.append(Check("reference_at_start", "SKIP", "the loss is reference-free"))
        elif s.dist.sp_size > 1 or s.dist.mode == "fsdp":  # forwards outside the step would disturb the sharding
            self.checks.append(Check("reference_at_start", "SKIP", "the weights are sharded or the packed row is split "
                                     "over ranks"))
        else:
            self._ref = reference_sums(s, pairs)
            if resumed:
                self.checks.append(Check("reference_at_start", "SKIP", "a resumed run: the policy has trained"))
            elif ref.strategy in STARTS_EQUAL and not (ref.strategy == "precompute" and (s.cfg.ref_model or
                                                                                         s.cfg.ref_adapters)):
                what = {"copy": "the frozen copy", "adapter_off": "the model with its adapters switched off",
                        "precompute": "the precomputed table"}[ref.strategy]
                if fast is None:
                    with _eval(s.model):
                        fast = _sums(s, pairs)
                self._add("reference_at_start", per_token(self._ref, fast, completion_tokens(pairs)), tol,
                          f"{what} against the starting policy on {len(pairs)} pair(s)", s)
            else:
                self.checks.append(Check("reference_at_start", "SKIP", f"the reference ({ref.strategy}) is another "
                                         "model than the starting policy"))
        self._took("reference_at_start", t1)

    def _fast_path(self, s, pairs: list[TokenizedPair], tol: float) -> torch.Tensor | None:
        """`fast_path` and `head_float32` on `pairs`; the policy's sums through the run's layout (None where that
        path is not checked)."""
        if s.dist.sp_size > 1 or s.dist.mode == "fsdp":
            why = "the weights are sharded or the packed row is split over ranks; `fastdpo verify` checks that path"
            self.checks += [Check("fast_path", "SKIP", why), Check("head_float32", "SKIP", why)]
            return None
        with _eval(s.model):
            t0 = time.perf_counter()
            fast = _sums(s, pairs)
            self._took("fast_path", t0)
            t0 = time.perf_counter()
            try:
                plain, exact = _plain_sums(s, pairs)
            except torch.OutOfMemoryError:  # the padded rows' attention next to the run: not worth the run
                plain = exact = None
                if s.device.type == "cuda":
                    torch.cuda.empty_cache()
            self._took("plain_path", t0)
        if not any_rank(plain is None, s.dist, s.device):
            tokens, kind = completion_tokens(pairs), str(next(s.model.parameters()).dtype).removeprefix("torch.")
            self._add("fast_path", per_token(fast, plain, tokens), tol, f"policy log-probs of {len(pairs)} pair(s) "
                      f"through the {s.backend.name} layout against the padded two-forward path, {kind}", s)
            self._add("head_float32", per_token(plain, exact, tokens), tol, "the log-prob head of the run "
                      f"({'fused kernels' if output_head(s.model).kernels else 'chunked'}, {kind} hidden states) "
                      "against a float32 computation of the same head", s)
        else:
            why = ("the padded path did not fit in memory next to the run; `fastdpo verify` checks the fast path on a "
                   "smaller batch")
            self.checks += [Check("fast_path", "SKIP", why), Check("head_float32", "SKIP", why)]
        return fast

    def _resumed_step(self, s, step_pairs: list[TokenizedPair], record: dict | None, tol: float) -> None:
        """The checkpoint's record of the step it would have run next against the resumed step: its recorded pairs
        are in this step (the data order restored; micro-batching and the world size may have changed) and their
        log-probs are as recorded (the weights restored)."""
        if record is None:
            self.checks.append(Check("resumed_step", "SKIP", "the checkpoint holds no record of its next step (written "
                                     "before records were kept, by a stream, or with sharded weights)"))
            return
        if s.dist.mode == "fsdp" or s.dist.sp_size > 1:
            self.checks.append(Check("resumed_step", "SKIP", "the resumed run shards the weights or splits the row "
                                     "over ranks: one rank cannot run the recorded pairs alone"))
            return
        if s.cfg.resume_ignore_changes:
            self.checks.append(Check("resumed_step", "SKIP", "--resume_ignore_changes: the data order or objective "
                                     "may differ from the checkpoint's on purpose"))
            return
        err, what = 0.0, "the pairs the checkpoint recorded for its next step and their log-probs, as recorded"
        by_index = {p.index: p for p in step_pairs}
        if s.dist.dp_rank == 0 and s.dist.speaks_for_group:  # the record is rank 0's
            missing = [i for i in record["indices"] if i not in by_index]
            if missing:
                err, what = float("inf"), (f"rows {missing}, recorded by the checkpoint for its next step, are not in "
                                            "the resumed step: the data order was not restored")
            else:
                now = next_step_sums(s, [by_index[i] for i in record["indices"]])
                err = per_token(now, torch.tensor(record["sums"], device=now.device), record["tokens"])
        self._add("resumed_step", err, tol, what, s)

    @property
    def pending(self) -> bool:
        """`before` ran and `after` has not: waiting for the first update that moves the weights."""
        return self._batch is not None

    def after(self, s) -> None:
        """After the first update with a learning rate above 0: the policy's log-probs of the same batch have moved
        away from the reference's."""
        t0 = time.perf_counter()
        if self._ref is not None and s.cfg.sync_ref_model:
            self.checks.append(Check("reference_apart", "SKIP", "--sync_ref_model moves the reference toward the "
                                     "policy by design (TR-DPO)"))
        elif self._ref is not None:
            with _eval(s.model):
                policy = _sums(s, self._batch)
            ref = reference_sums(s, self._batch)
            moved = per_token(policy, ref, completion_tokens(self._batch))
            apart = any_rank(moved > 0.0, s.dist, s.device)
            check = Check("reference_apart", "PASS" if apart else "FAIL",
                          "the policy's log-probs after the first update differ from the reference's" if apart else
                          "after the first update the policy's log-probs equal the reference's exactly: the reference "
                          "follows the policy (it is the policy itself), or the update changed nothing the forward "
                          "uses (check --target_modules with LoRA, and that grad_norm is not 0)", moved, 0.0)
            self.checks.append(check)
        self._took("reference_apart", t0)
        self._batch, self._ref = None, None

    def _took(self, part: str, since: float) -> None:
        """Add the seconds since `since` to `part`, the GPU's queued work included (the stages are timed apart)."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        took = time.perf_counter() - since
        self.parts[part] = self.parts.get(part, 0.0) + took
        self.seconds += took

    def finish(self, s=None) -> None:
        """At the end of the run: a check still waiting for an update that moved the weights is skipped, said why;
        with the run's set-up `s`, the checked pairs' log-probs with its last weights are recorded, for `fastdpo
        verify --run` to check the saved model against."""
        if s is not None and self._first and self.record is None:
            t0 = time.perf_counter()
            self.record = final_record(s, self._first)
            self._took("record", t0)
        if self.pending:
            if self._ref is not None:
                self.checks.append(Check("reference_apart", "SKIP", "no update of this run moved the weights (a "
                                         "learning rate of 0, or gradients that cancel to 0)"))
            self._batch, self._ref = None, None
            self.enforce(final=True)

    def _add(self, name: str, err: float, tol: float, what: str, s) -> None:
        failed = any_rank(not err <= tol, s.dist, s.device)  # NaN fails too
        self.checks.append(Check(name, "FAIL" if failed else "PASS", what, err, tol))

    def enforce(self, final: bool) -> None:
        """Raise on a FAIL unless the run asked to continue (`--certificate warn`); when `final`, log every check."""
        if final or self.status == "FAIL":
            for c in self.checks:
                (log.info if c.status != "FAIL" else log.error)("%s", c.line())
        if self.status == "FAIL" and self.mode == "on":
            failed = "; ".join(c.line() for c in self.checks if c.status == "FAIL")
            raise FastDPOError(f"The run's certificate failed, so what would train is not what is claimed: {failed}. "
                               "Nothing was saved from this step. Report it with the run's log; "
                               "--certificate warn trains anyway.")


@torch.no_grad()
def next_step_sums(s, pairs: list[TokenizedPair]) -> torch.Tensor:
    """The model's own completion log-prob sums of `pairs` (no wrapper, so one rank alone may run it), in eval mode."""
    with _eval(s.model):
        batch = make_batch(pairs, s.backend, _pad(s), s.device, s.plan.max_tokens_per_batch)
        return completion_logps(s.model, batch, s.backend, prompt=False).sums.float()


def next_step_record(s, first: list[TokenizedPair]) -> dict | None:
    """What a checkpoint records of the step a resume will run first: the first pairs of this rank's first
    micro-batch, their completion tokens and log-prob sums (None under FSDP2 or sequence parallelism, whose forward
    needs every rank)."""
    if s.dist.mode == "fsdp" or s.dist.sp_size > 1 or not first:
        return None
    pairs = first[:PAIRS]
    return {"indices": [p.index for p in pairs], "tokens": completion_tokens(pairs),
            "sums": next_step_sums(s, pairs).tolist()}


@torch.no_grad()
def reference_sums(s, pairs: list[TokenizedPair]) -> torch.Tensor:
    """The run's reference's completion log-prob sums of `pairs` (its table, copy, adapters off, or model)."""
    with _eval(s.model):
        batch = make_batch(pairs, s.backend, _pad(s), s.device, s.plan.max_tokens_per_batch)
        return s.reference.logps(s.model, batch, s.backend, build_mask(batch, s.backend)).resolved(batch).sums.float()


def final_record(s, pairs: list[TokenizedPair]) -> dict | None:
    """The pairs' completion log-prob sums under the policy's current weights and under the run's reference, what
    `check_saved` holds a saved model to (None under FSDP2 or sequence parallelism, whose forward needs every rank,
    and for a stream, whose pairs cannot be found again by index)."""
    if s.dist.mode == "fsdp" or s.dist.sp_size > 1 or s.stream is not None:
        return None
    ref = None if s.reference.strategy == "none" else reference_sums(s, pairs).tolist()
    return {**next_step_record(s, pairs), "ref_sums": ref, "reference": s.reference.strategy,
            "dtype": str(next(s.model.parameters()).dtype).removeprefix("torch.")}


def check_saved(s, pairs: list[TokenizedPair], record: dict) -> Certificate:
    """A finished run's certificate checked again on its saved model (`fastdpo verify --run`): `s` is set up with
    the saved weights and a live reference, `pairs` are the run's recorded pairs. `saved_model`: their log-probs as
    the run's last weights gave them; `fast_path` and `head_float32` as in training; `reference`: the reference the
    run trained against (its table or forward) against a live forward of that reference now; `reference_apart`: the
    saved policy differs from it."""
    cert = Certificate("warn")
    t0 = time.perf_counter()
    tol = TOLERANCE.get(next(s.model.parameters()).dtype, 1e-2)
    now = next_step_sums(s, pairs)
    cert._add("saved_model", per_token(now, torch.tensor(record["sums"], device=now.device), record["tokens"]), tol,
              f"the saved model's log-probs of the run's {len(pairs)} recorded pair(s) against its last weights' "
              f"({record.get('dtype', '?')})", s)
    cert._fast_path(s, pairs, tol)
    if record.get("ref_sums") is None:
        cert.checks.append(Check("reference", "SKIP", "the run was reference-free"))
    elif s.cfg.sync_ref_model:
        cert.checks.append(Check("reference", "SKIP", "--sync_ref_model moved the reference during the run (TR-DPO)"))
    else:
        live = reference_sums(s, pairs)
        what = "its precomputed table" if record.get("reference") == "precompute" else "its forward"
        cert._add("reference", per_token(live, torch.tensor(record["ref_sums"], device=live.device),
                                         record["tokens"]), tol,
                  f"the reference the run trained against ({what}) against a live forward of the reference now", s)
        moved = per_token(now, live, record["tokens"])
        cert.checks.append(Check("reference_apart", "PASS" if moved > 0 else "FAIL",
                                 "the saved policy's log-probs differ from the reference's" if moved > 0 else
                                 "the saved policy's log-probs equal the reference's: nothing of the training was "
                                 "saved, or the saved adapters are not applied", moved, 0.0))
    cert.seconds = time.perf_counter() - t0
    return cert


def cost_counts(device: torch.device) -> dict[str, int]:
    """Counters of what a stage may cost besides its arithmetic: Python's full (oldest generation) garbage
    collections, and on CUDA the caching allocator's segments allocated and its allocation retries."""
    out = {"gc_full_collections": gc.get_stats()[-1]["collections"]}
    if device.type == "cuda" and torch.cuda.is_initialized():
        stats = torch.cuda.memory_stats(device)
        out["cuda_segments_allocated"] = stats.get("segment.all.allocated", 0)
        out["cuda_alloc_retries"] = stats.get("num_alloc_retries", 0)
    return out


def costs_since(before: dict[str, int], device: torch.device) -> dict[str, int]:
    """How much each of `cost_counts` grew since `before`."""
    return {k: v - before.get(k, 0) for k, v in cost_counts(device).items()}


def _pad(s) -> int:
    return s.tokenizer.pad_token_id or 0


@torch.no_grad()
def _sums(s, pairs: list[TokenizedPair]) -> torch.Tensor:
    """The policy's completion log-prob sums through the run's own forward (its layout, DDP or FSDP2 wrapping)."""
    batch = make_batch(pairs, s.backend, _pad(s), s.device, s.plan.max_tokens_per_batch)  # the run's static lengths
    return policy_logps(s.policy, batch, build_mask(batch, s.backend), prompt=False).sums.float()


@torch.no_grad()
def _plain_sums(s, pairs: list[TokenizedPair]) -> tuple[torch.Tensor, torch.Tensor]:
    """The same through the plain path (padded rows, one per sequence, the model's own attention and its modules' own
    eager ops, not the run's kernels), its final hidden states through the run's head and through a float32 one."""
    plain = s.backend.plain()
    batch = make_batch(pairs, plain, _pad(s), s.device, 0)
    with eager_layers(s.model):  # torch's own ops: no kernel built for the padded shapes, nothing shared with the run's
        hidden = target_hidden(s.model, batch, plain)
    head = output_head(s.model)
    run = seqlogps.token_logps(hidden, head.weight, batch.tgt, scale=head.scale, softcap=head.softcap,
                               kernels=head.kernels)  # as `completion_logps` calls it
    exact = float32_token_logps(hidden, head.weight, batch.tgt, head.scale, head.softcap)
    return tuple(summarise(tok, batch.seq, batch.lengths).resolved(batch).sums.float() for tok in (run, exact))


def float32_token_logps(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, scale: float = 1.0,
                        softcap: float | None = None) -> torch.Tensor:
    """log p(target | hidden) computed plainly in float32: logits = scale * hidden @ weight^T (soft-capped), and
    log-softmax, VOCAB_CHUNK rows of the weight at a time (a running log-sum-exp)."""
    h = hidden.float()
    lse = torch.full((h.shape[0],), float("-inf"), device=h.device)
    picked = torch.zeros(h.shape[0], device=h.device)
    for start in range(0, weight.shape[0], VOCAB_CHUNK):
        logits = (h @ weight[start:start + VOCAB_CHUNK].float().T) * scale
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        lse = torch.logaddexp(lse, torch.logsumexp(logits, dim=-1))
        inside = (targets >= start) & (targets < start + logits.shape[1])
        here = logits.gather(1, (targets - start).clamp(0, logits.shape[1] - 1)[:, None]).squeeze(1)
        picked = torch.where(inside, here, picked)
    return picked - lse


def completion_tokens(pairs: list[TokenizedPair]) -> int:
    """Completion tokens of the pairs' sequences (what their log-prob sums run over)."""
    return sum(len(p.chosen) + len(p.rejected) for p in pairs)


def per_token(a: torch.Tensor, b: torch.Tensor, tokens: int) -> float:
    """sum over sequences of |a - b| (their completion log-prob sums) per completion token, in nats."""
    return float((a - b).abs().sum()) / max(tokens, 1)


@contextlib.contextmanager
def _eval(model):
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)
