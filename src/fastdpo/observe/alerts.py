"""Alerts on the vital signs of a DPO run, each with advice, raised once and then rate-limited.

The engine is a pure function of the logged records (plus the expected update gap): feed it every logged step.

| alert | condition | likely meaning |
|---|---|---|
| swapped_labels | rewards/margins < 0 and rewards/accuracies < 0.5 for `patience` logged steps | chosen/rejected swapped |
| kl_ratio | kl_ratio = abs(logratio/mean) / rewards/margins > `kl_ratio_threshold` | drift outpaces the margin |
| grad_spike | grad_norm > `spike_factor` x running median of earlier logged steps | learning rate too high, bad batch |
| grad_collapse | grad_norm < `collapse_below` for `patience` logged steps | vanished gradients, lr ~ 0 |
| accuracy_stuck | mean rewards/accuracies within `stuck_band` of 0.5 over 4 x `patience` logged steps | nothing learned |
| nonfinite | loss or gradients NaN/Inf since the last log (those updates were skipped) | overflow, lr, bad rows |
| update_gap | optimizer updates per micro-steps differ from gradient accumulation | accumulation logic broken |
| stuck_at_ln2 | loss within 2e-3 of ln 2, margins within 1e-3 of 0, `patience` logged steps | nothing moves (cause named) |
| accuracy_zero | rewards/accuracies 0 with negative margins for `patience` logged steps | labels swapped |
| memory_rising | peak or held memory higher at each of `patience` logged steps | a leak, longer rows (cause named) |
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import asdict, dataclass

ADVICE = {
    "swapped_labels": "chosen and rejected may be swapped; check the data (read a few rows, check the column "
                      "mapping, and that --ref_model is the model the policy started from).",
    "kl_ratio": "the policy moves away from the reference faster than the reward margin grows: raise --beta, lower "
                "--learning_rate, or check data quality (mislabelled pairs push rejected log-probs down).",
    "grad_spike": "learning rate too high or a noisy batch: lower --learning_rate, add warm-up (--warmup_ratio), keep "
                  "--max_grad_norm on, and look at the rows of this step.",
    "grad_collapse": "gradients vanished: the learning rate may have decayed to ~0, the loss saturated (beta too large), "
                     "chosen and rejected are identical, or pairs contradict each other (the same pair again with "
                     "chosen and rejected swapped); check the schedule and the data.",
    "accuracy_stuck": "no preference is being learned: check that chosen and rejected differ and are not randomly "
                      "ordered, then try a higher --learning_rate or --beta.",
    "nonfinite": "the update was skipped. Lower --learning_rate, prefer bfloat16 over float16, keep --max_grad_norm on, "
                 "and check the rows of that step (empty or extremely long completions).",
    "update_gap": "optimizer updates do not match the micro-steps consumed: gradient accumulation is not stepping once "
                  "per accumulation cycle (a wrapper or scaler skipped or added optimizer.step calls).",
    "accuracy_zero": "every pair prefers the rejected answer: chosen and rejected are swapped. Check the column mapping "
                     "(--columns, --chosen_key / --rejected_key) and which column holds the better answer in your "
                     "data, and read a few rows.",
}
# stuck_at_ln2: the advice follows the cause the record shows
STUCK_ADVICE = {
    "lr_zero": "the learning rate is 0 at these steps: a warm-up that starts at 0 has not risen yet, or the schedule "
               "has ended. Check --warmup_steps / --warmup_ratio, --lr_scheduler_type and --learning_rate.",
    "same_model": "the policy and its reference give exactly the same log-probs after these updates: the updates "
                  "change nothing the forward uses, or the reference is the policy itself. With LoRA, check that "
                  "--target_modules names modules of this model (else no adapter trains); check that grad_norm is "
                  "not 0.",
    "too_slow": "the policy moves, but too slowly for the margin to grow: raise --learning_rate (full fine-tuning "
                "usually trains DPO at 5e-7 to 5e-6, LoRA at 5e-6 to 1e-4) or --beta.",
}
# memory_rising: the advice follows the cause the record shows
MEMORY_ADVICE = {
    "leak": "something keeps each step's tensors alive: a callback or your own code that stores metrics or outputs as "
            "tensors (keep float(x) or x.item() instead), or a tensor that holds the autograd graph. On a GPU, find it with "
            "--profile_steps N-M --profile_memory, which names what is alive at the peak by source line.",
    "lengths": "the data's longer rows are arriving: the peak follows the largest micro-batch so far, and settles at "
               "the longest one. If it will not fit, cap it with --max_tokens_per_batch or --max_length; `fastdpo "
               "check-data` shows the length distribution.",
    "allocator": "neither the memory held between steps nor the largest micro-batch grew: the allocator's cache is "
                 "fragmenting. Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.",
}
LN2 = math.log(2)
MEMORY_WARM_UP = 2  # logged steps before memory counts (the optimizer's state and the kernels' buffers arrive first)
LEAK_MIN_GIB = 1 / 16  # growth of the held memory over the window below which it is noise (allocator rounding)


@dataclass
class AlertRules:
    patience: int = 5  # logged steps a sustained condition must hold
    kl_ratio_threshold: float = 0.3
    spike_factor: float = 10.0
    spike_history: int = 50  # logged grad norms the running median covers
    spike_min_history: int = 5
    collapse_below: float = 1e-3
    stuck_band: float = 0.05
    cooldown: int = 50  # logged steps before the same alert may be raised again
    ln2_band: float = 2e-3  # stuck_at_ln2: the loss this close to ln 2 ...
    zero_margin: float = 1e-3  # ... and the margin this close to 0
    leak_share: float = 0.01  # memory_rising: the held memory grew by this share of itself (and LEAK_MIN_GIB)


@dataclass
class Alert:
    name: str
    step: int
    message: str
    advice: str
    repeats: int = 0  # times the condition held while the alert was rate-limited

    def text(self) -> str:
        again = f" (held {self.repeats} more times while rate-limited)" if self.repeats else ""
        return f"alert [{self.name}] step {self.step}: {self.message}{again}. Advice: {self.advice}"

    def to_dict(self) -> dict:
        return asdict(self)


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


class AlertEngine:
    """Feed `check` every logged record; it returns the alerts to show now."""

    def __init__(self, rules: AlertRules | None = None):
        self.rules = rules or AlertRules()
        self.streaks: dict[str, int] = {}
        self.norms: deque[float] = deque(maxlen=self.rules.spike_history)
        self.accuracies: deque[float] = deque(maxlen=4 * self.rules.patience)
        self.checks = 0
        self.skipped = 0
        self.last_raised: dict[str, int] = {}  # name -> check index
        self.suppressed: dict[str, int] = {}
        self.raised: dict[str, int] = {}  # name -> times shown (for the summary)
        self.stuck_cause = ""  # what stuck_at_ln2 found, for its advice
        self.memory: deque[tuple] = deque(maxlen=self.rules.patience + 1)  # (held, peak, largest micro-batch)
        self.memory_cause = ""

    def _streak(self, name: str, holds: bool) -> int:
        self.streaks[name] = self.streaks.get(name, 0) + 1 if holds else 0
        return self.streaks[name]

    def check(self, record: dict, expected_update_gap: float | None = None) -> list[Alert]:
        r, rules = record, self.rules
        self.checks += 1
        found: list[tuple[str, str]] = []

        margin, acc = r.get("rewards/margins"), r.get("rewards/accuracies")
        if _finite(margin) and _finite(acc):
            if self._streak("accuracy_zero", margin < 0 and acc == 0) >= rules.patience:
                found.append(("accuracy_zero", f"rewards/accuracies 0 (rewards/margins {margin:.4g}) for "
                                               f"{self.streaks['accuracy_zero']} logged steps"))
            elif self._streak("swapped_labels", margin < 0 and acc < 0.5) >= rules.patience:
                found.append(("swapped_labels", f"rewards/margins {margin:.4g} < 0 and rewards/accuracies {acc:.2f} "
                                                f"< 0.5 for {self.streaks['swapped_labels']} logged steps"))
            self.accuracies.append(acc)
            mean_acc = sum(self.accuracies) / len(self.accuracies)
            if len(self.accuracies) == self.accuracies.maxlen and abs(mean_acc - 0.5) <= rules.stuck_band:
                found.append(("accuracy_stuck", f"rewards/accuracies averaged {mean_acc:.3f} over the last "
                                                f"{len(self.accuracies)} logged steps"))

        for rule in (self._stuck_at_ln2, self._memory_rising):
            if (hit := rule(r)) is not None:
                found.append(hit)

        ratio = r.get("kl_ratio")
        if _finite(ratio) and ratio > rules.kl_ratio_threshold:
            found.append(("kl_ratio", f"kl_ratio {ratio:.3g} > {rules.kl_ratio_threshold:g} (logratio/mean "
                                      f"{r.get('logratio/mean', 0):.4g} per token, rewards/margins "
                                      f"{r.get('rewards/margins', 0):.4g})"))

        norm = r.get("grad_norm")
        if _finite(norm):
            if len(self.norms) >= rules.spike_min_history:
                median = statistics.median(self.norms)
                if median > 0 and norm > rules.spike_factor * median:
                    found.append(("grad_spike", f"grad_norm {norm:.4g} is {norm / median:.0f}x the running median "
                                                f"{median:.3g}"))
            self.norms.append(norm)
            if self._streak("grad_collapse", norm < rules.collapse_below) >= rules.patience:
                found.append(("grad_collapse", f"grad_norm {norm:.3g} < {rules.collapse_below:g} for "
                                               f"{self.streaks['grad_collapse']} logged steps"))

        skipped = int(r.get("skipped_steps", 0))
        skipped_now, self.skipped = skipped - self.skipped, skipped
        loss = r.get("loss")
        if skipped_now > 0 or (loss is not None and not _finite(loss)):
            found.append(("nonfinite", f"{skipped_now} step(s) since the last log had a NaN/Inf loss or gradient "
                                       f"({skipped} in all)"))

        gap = r.get("update_gap")
        if expected_update_gap is not None and gap is not None and not math.isclose(gap, expected_update_gap,
                                                                                    rel_tol=1e-6):
            found.append(("update_gap", f"update_gap {gap:.3g} micro-steps per optimizer update, expected "
                                        f"{expected_update_gap:.3g}"))

        return [a for name, msg in found if (a := self._rate_limit(name, msg, int(r.get("step", 0)))) is not None]

    def _stuck_at_ln2(self, r: dict) -> tuple[str, str] | None:
        """Loss at ln 2 with zero margins for `patience` logged steps, and which cause the record shows."""
        loss, margin = r.get("loss"), r.get("rewards/margins")
        holds = (_finite(loss) and _finite(margin) and abs(loss - LN2) <= self.rules.ln2_band
                 and abs(margin) <= self.rules.zero_margin)
        if self._streak("stuck_at_ln2", holds) < self.rules.patience:
            return None
        lr, drift = r.get("learning_rate"), [r.get("logratio/chosen"), r.get("logratio/rejected")]
        if _finite(lr) and lr == 0:
            cause = "lr_zero"
        elif all(_finite(v) and abs(v) < 1e-9 for v in drift):
            cause = "same_model"
        else:
            cause = "too_slow"
        what = {"lr_zero": "the learning rate is 0",
                "same_model": "every policy - reference log-ratio is exactly 0",
                "too_slow": f"the policy moved {abs(r.get('logratio/mean') or 0):.2g} nats per token from the "
                            f"reference at learning rate {lr:g}" if _finite(lr) else "the policy barely moved"}[cause]
        self.stuck_cause = cause
        return "stuck_at_ln2", (f"loss {loss:.4f} ≈ ln 2 with rewards/margins {margin:.2g} for "
                                f"{self.streaks['stuck_at_ln2']} logged steps: {what}")

    def _memory_rising(self, r: dict) -> tuple[str, str] | None:
        """The memory held between steps (`memory/allocated_gib`, or the process's `memory/rss_gib` on the CPU) or
        the peak higher at each of the last `patience` logged steps, and which cause the record shows: the held
        memory grew (a leak), the largest micro-batch grew with the peak (longer rows), or neither (the allocator)."""
        held = r.get("memory/allocated_gib", r.get("memory/rss_gib"))
        peak = r.get("memory/peak_gib") or r.get("memory/peak_rss_gib")
        if self.checks <= MEMORY_WARM_UP or not (_finite(held) and _finite(peak)):
            return None
        self.memory.append((held, peak, r.get("batch/largest_tokens") or 0))
        if len(self.memory) < self.memory.maxlen:
            return None
        helds, peaks, tokens = zip(*self.memory)
        grew = all(b > a for a, b in zip(helds, helds[1:]))
        leak = grew and helds[-1] - helds[0] >= max(LEAK_MIN_GIB, self.rules.leak_share * helds[0])
        rising = all(b > a for a, b in zip(peaks, peaks[1:]))
        if not (leak or rising):
            return None
        cause = "leak" if leak else "lengths" if tokens[-1] > tokens[0] else "allocator"
        self.memory_cause = cause
        n = len(self.memory) - 1
        what = {"leak": f"the memory held between steps grew from {helds[0]:.3f} to {helds[-1]:.3f} GiB",
                "lengths": f"the largest micro-batch grew from {tokens[0]} to {tokens[-1]} tokens",
                "allocator": f"the largest micro-batch stayed at or below {max(tokens)} tokens and the memory held "
                             f"between steps at {max(helds):.3f} GiB"}[cause]
        self.memory.clear()  # a new window: the same growth is not counted twice
        return "memory_rising", (f"peak memory {peaks[0]:.3f} -> {peaks[-1]:.3f} GiB over the last {n} logged steps: "
                                 f"{what}")

    def _rate_limit(self, name: str, message: str, step: int) -> Alert | None:
        last = self.last_raised.get(name)
        if last is not None and self.checks - last < self.rules.cooldown:
            self.suppressed[name] = self.suppressed.get(name, 0) + 1
            return None
        self.last_raised[name] = self.checks
        self.raised[name] = self.raised.get(name, 0) + 1
        advice = (STUCK_ADVICE[self.stuck_cause] if name == "stuck_at_ln2" else
                  MEMORY_ADVICE[self.memory_cause] if name == "memory_rising" else ADVICE[name])
        return Alert(name, step, message, advice, self.suppressed.pop(name, 0))

    def summary(self) -> dict[str, int]:
        """Times each alert was raised (shown) during the run."""
        return dict(self.raised)
