"""The beta schedule (`--beta_schedule`): `constant`, or `kl_adaptive`.

kl_adaptive: each optimizer step records its drift, the mean absolute policy-reference log-ratio per completion
token over the step's chosen and rejected completions,

    drift = sum_seq |log pi(y|x) - log ref(y|x)| / sum_seq n_tokens,

and the next step uses, with drift_ma the mean drift of the last `--beta_kl_window` steps,

    beta_t = beta * clamp(1 - RATE * max(0, drift_ma - target), min_ratio, 1).

So beta is lowered while the policy has moved further than `--beta_kl_target` nats per token from the reference,
is back at `--beta` once the drift is in range again, and never goes below `--beta_min_ratio` * beta. Absolute
values, because chosen log-ratios rise while rejected ones fall and signed values would cancel. RATE = 0.2 is the
seed's slope. The state lives on the device (no host sync inside a step); it is read when logged or checkpointed.
"""

from __future__ import annotations

import logging

import torch

from fastdpo.losses import LossInputs, logratios

RATE = 0.2
log = logging.getLogger("fastdpo")


def recent_drifts(history: list[float], count: int) -> list[float]:
    """The drifts a ring buffer `history` holds after `count` steps, oldest first."""
    n = min(count, len(history))
    start = count % len(history) if count > len(history) else 0
    return (history[start:] + history[:start])[:n]


class BetaSchedule:
    def __init__(self, beta: float, kind: str = "constant", target: float = 0.5, window: int = 100,
                 min_ratio: float = 0.5, device: torch.device | str = "cpu"):
        assert kind in ("constant", "kl_adaptive"), kind
        self.beta, self.kind = beta, kind
        self.target, self.window, self.min_ratio = target, window, min_ratio
        self.adaptive = kind == "kl_adaptive"
        if self.adaptive:
            self.history = torch.zeros(window, dtype=torch.float64, device=device)
            self.count = 0
            self._value = torch.tensor(beta, dtype=torch.float32, device=device)
            self._drift = torch.zeros((), dtype=torch.float64, device=device)
            self._tokens = torch.zeros((), dtype=torch.float64, device=device)

    def value(self) -> float | torch.Tensor:
        """Beta for the coming step: a float, or a 0-d device tensor when adaptive."""
        return self._value if self.adaptive else self.beta

    @torch.no_grad()
    def observe(self, x: LossInputs) -> None:
        """Add one micro-batch's log-ratios to the current step's drift."""
        if not self.adaptive:
            return
        lr_c, lr_r = logratios(x)
        self._drift += (lr_c.abs().sum() + lr_r.abs().sum()).double()
        self._tokens += (x.chosen_tokens.sum() + x.rejected_tokens.sum()).double()

    def step_sums(self) -> torch.Tensor | None:
        """The drift and token count the current step has added so far, (2,) float64 on the device; None unless
        adaptive. Under torchrun the ranks sum them and hand the totals back (`take_step_sums`) before `step`, so
        every rank sets the same next beta."""
        if not self.adaptive:
            return None
        return torch.stack([self._drift, self._tokens])

    @torch.no_grad()
    def take_step_sums(self, sums: torch.Tensor) -> None:
        """Replace the current step's drift and token count with `sums` (their totals over all ranks, (2,))."""
        self._drift.copy_(sums[0])
        self._tokens.copy_(sums[1])

    @torch.no_grad()
    def step(self) -> None:
        """Close the step: record its drift and set beta for the next step."""
        if not self.adaptive:
            return
        self.history[self.count % self.window] = self._drift / self._tokens.clamp(min=1)
        self.count += 1
        self._set_value()
        self._drift.zero_()
        self._tokens.zero_()

    def _set_value(self) -> None:
        drift_ma = self.history[: min(self.count, self.window)].mean()
        factor = (1 - RATE * (drift_ma - self.target).clamp(min=0)).clamp(self.min_ratio, 1.0)
        self._value = (self.beta * factor).float()

    def drift_mean(self) -> float:
        return float(self.history[: min(self.count, self.window)].mean()) if self.adaptive and self.count else 0.0

    def state_dict(self) -> dict:
        if not self.adaptive:
            return {}
        return {"history": self.history.tolist(), "count": self.count, "value": float(self._value)}

    def load_state_dict(self, state: dict) -> None:
        if not self.adaptive or not state:
            return
        device = self.history.device
        if len(state["history"]) == self.window:
            self.history = torch.tensor(state["history"], dtype=torch.float64, device=device)
            self.count = int(state["count"])
            self._value = torch.tensor(state["value"], dtype=torch.float32, device=device)
            return
        # another --beta_kl_window: keep the latest drifts, oldest first, so the ring continues where they end
        kept = recent_drifts(state["history"], int(state["count"]))[-self.window:]
        log.info("--beta_kl_window is %d, the checkpoint's was %d: the drift average continues from its last %d "
                 "step(s).", self.window, len(state["history"]), len(kept))
        self.history.zero_()
        self.history[: len(kept)] = torch.tensor(kept, dtype=torch.float64, device=device)
        self.count = len(kept)  # the ring's count restarts from the drifts it holds
        if kept:
            self._set_value()
