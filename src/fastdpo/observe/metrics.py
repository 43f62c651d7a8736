"""Step metrics (TRL names, DESIGN §10) with the vital signs of a DPO run, throughput and MFU."""

from __future__ import annotations

import time

import torch

# Per-pair sums accumulated over the micro-batches of one step, divided once by the step's pair count.
PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                "logps/rejected")
# Per-token sums (log-ratio to the reference, log-probs, completion tokens), divided once by the step's completion
# tokens.
TOKEN_SUMS = ("logratio/chosen", "logratio/rejected", "logp/chosen", "logp/rejected", "tokens/chosen", "tokens/rejected")
KL_RATIO_FLOOR = 1e-2  # rewards/margins below this counts as this: no blow-up while the margin is still ~0


class StepMetrics:
    """Sums on the device during a step (no host sync); `finish` divides and reads them once. With `mean_logps`
    (SimPO, ORPO: `losses.mean_logp_rewards`), `logps/*` are each completion's per-token mean and the rewards beta x
    that mean, as TRL logs them; otherwise log-prob sums. `extra` names the loss-specific metrics (ORPO's
    `nll_loss`, `log_odds_ratio`, `log_odds_chosen`): per-pair values (`add_pair_values`), logged as their mean over
    the step's pairs."""

    def __init__(self, device: torch.device, mean_logps: bool = False, extra: tuple[str, ...] = ()):
        self.mean_logps = mean_logps
        self.extra = tuple(extra)
        self.sums = torch.zeros(1 + len(PAIR_METRICS) + len(TOKEN_SUMS) + len(self.extra), dtype=torch.float64,
                                device=device)
        self.pairs = 0
        self.tokens = 0
        self.has_reference = False
        self.micro_batches = 0  # this rank's forwards and backwards in the step
        self.computed_tokens = 0  # token positions they ran, padding and filler included
        self.largest_tokens = 0  # the largest of those micro-batches, in token positions

    @property
    def loss_sum(self) -> torch.Tensor:
        """The step's loss so far, on the device (for the non-finite guard)."""
        return self.sums[0]

    @torch.no_grad()
    def add(self, loss_sum: torch.Tensor, beta: float, pol_c, pol_r, ref_c, ref_r, num_tokens: int,
            len_c: torch.Tensor | None = None, len_r: torch.Tensor | None = None) -> None:
        """Per-pair log-prob sums (B,) of one micro-batch; len_c/len_r (B,) are completion tokens per sequence."""
        zero = pol_c.new_zeros(())
        len_c = pol_c.new_zeros(pol_c.shape) if len_c is None else len_c
        len_r = pol_r.new_zeros(pol_r.shape) if len_r is None else len_r
        lp_c, lp_r = pol_c, pol_r  # what `logps/*` and the reference-free rewards are made of
        if self.mean_logps:
            lp_c, lp_r = pol_c / len_c.clamp(min=1), pol_r / len_r.clamp(min=1)
        rc = beta * (pol_c - ref_c) if ref_c is not None else beta * lp_c
        rr = beta * (pol_r - ref_r) if ref_r is not None else beta * lp_r
        vals = torch.stack([
            loss_sum.detach().float(), rc.sum(), rr.sum(), (rc - rr).sum(), (rc > rr).float().sum(),
            lp_c.sum(), lp_r.sum(),
            (pol_c - ref_c).sum() if ref_c is not None else zero, (pol_r - ref_r).sum() if ref_r is not None else zero,
            pol_c.sum(), pol_r.sum(), len_c.sum().to(pol_c.dtype), len_r.sum().to(pol_r.dtype),
        ])
        self.sums[: vals.numel()] += vals.double()
        self.pairs += int(pol_c.numel())
        self.tokens += num_tokens
        self.has_reference = self.has_reference or ref_c is not None

    @torch.no_grad()
    def add_pair_values(self, values: dict[str, torch.Tensor]) -> None:
        """Per-pair values (B,) of the `extra` metrics for one micro-batch (its pairs are counted by `add`)."""
        assert set(values) == set(self.extra), (sorted(values), self.extra)
        if values:
            base = 1 + len(PAIR_METRICS) + len(TOKEN_SUMS)
            self.sums[base:] += torch.stack([values[name].sum() for name in self.extra]).double()

    def count_batch(self, batch) -> None:
        """One micro-batch run by this rank (zero-weight ones too: they cost the same)."""
        self.micro_batches += 1
        self.computed_tokens += batch.input_ids.numel()
        self.largest_tokens = max(self.largest_tokens, batch.input_ids.numel())

    def finish(self) -> dict:
        v = self.sums.tolist()
        out = {"loss": v[0]}
        for name, s in zip(PAIR_METRICS, v[1:]):
            out[name] = s / max(1, self.pairs)
        lr_c, lr_r, s_c, s_r, n_c, n_r = v[1 + len(PAIR_METRICS): 1 + len(PAIR_METRICS) + len(TOKEN_SUMS)]
        for name, s in zip(self.extra, v[1 + len(PAIR_METRICS) + len(TOKEN_SUMS):]):
            out[name] = s / max(1, self.pairs)
        if n_c and n_r:
            out["logps/chosen_per_token"] = s_c / n_c
            out["logps/rejected_per_token"] = s_r / n_r
            if self.has_reference:  # signed mean log-ratios, not KL: the completions are the data's, not sampled
                out["logratio/chosen"] = lr_c / n_c
                out["logratio/rejected"] = lr_r / n_r
                out["logratio/mean"] = (lr_c + lr_r) / (n_c + n_r)
                out["kl_ratio"] = kl_ratio(out["logratio/mean"], out["rewards/margins"])
        return out


# Per round of unpaired rows (a micro-batch on every rank), summed over ranks: desirable rows, their reward and
# log-prob sums, the same for undesirable rows, and the round's KL estimate (counted once, by the first rank)
ROUND_SUMS = ("count/desirable", "rewards/desirable", "logps/desirable", "count/undesirable", "rewards/undesirable",
              "logps/undesirable", "kl")


class UnpairedMetrics:
    """A step's metrics for unpaired rows (KTO), with TRL 1.16 KTOTrainer's names and arithmetic: per round (one
    micro-batch on each rank), `rewards/chosen` and `logps/chosen` are the means over the round's desirable rows of
    all ranks, `rewards/rejected` and `logps/rejected` over its undesirable rows, `rewards/margins` their difference
    and `kl` the round's estimate; each logged value is the mean over the step's rounds that have such rows (a round
    without desirable rows adds nothing to `rewards/chosen`). `loss` is the step's loss. Same interface as
    `StepMetrics` for the loop."""

    def __init__(self, device: torch.device, rounds: int = 0):
        self.device = device
        self.sums = torch.zeros(1 + rounds * len(ROUND_SUMS), dtype=torch.float64, device=device)
        self.pairs = 0
        self.tokens = 0
        self.micro_batches = 0
        self.computed_tokens = 0
        self.largest_tokens = 0

    def start(self, rounds: int) -> None:
        """The step runs `rounds` micro-batches on every rank."""
        self.sums = torch.zeros(1 + rounds * len(ROUND_SUMS), dtype=torch.float64, device=self.device)

    @property
    def loss_sum(self) -> torch.Tensor:
        return self.sums[0]

    @torch.no_grad()
    def add_loss(self, loss_sum: torch.Tensor) -> None:
        self.sums[0] += loss_sum.detach().double()

    @torch.no_grad()
    def add_round(self, i: int, beta, logps: torch.Tensor, ref_logps: torch.Tensor, labels: torch.Tensor,
                  kl: torch.Tensor | None, first: bool) -> None:
        """Round `i` on this rank: each row's completion log-prob (B,) under policy and reference, its label, the
        round's KL estimate (0-d; counted by the `first` rank only)."""
        rewards = beta * (logps - ref_logps)
        good = labels.to(logps.dtype)
        bad = 1 - good
        vals = torch.stack([good.sum(), (rewards * good).sum(), (logps * good).sum(), bad.sum(), (rewards * bad).sum(),
                            (logps * bad).sum(), kl if kl is not None and first else logps.new_zeros(())])
        at = 1 + i * len(ROUND_SUMS)
        self.sums[at: at + len(ROUND_SUMS)] += vals.double()
        self.pairs += int(logps.numel())

    def count_batch(self, batch) -> None:
        self.micro_batches += 1
        self.computed_tokens += batch.input_ids.numel()
        self.largest_tokens = max(self.largest_tokens, batch.input_ids.numel())

    def finish(self) -> dict:
        v = self.sums.tolist()
        out: dict = {"loss": v[0]}
        rounds = [v[1 + i * len(ROUND_SUMS): 1 + (i + 1) * len(ROUND_SUMS)] for i in range((len(v) - 1) // len(ROUND_SUMS))]
        series: dict[str, list[float]] = {"kl": [], "rewards/chosen": [], "logps/chosen": [], "rewards/rejected": [],
                                          "logps/rejected": [], "rewards/margins": []}
        for n_d, r_d, l_d, n_u, r_u, l_u, kl in rounds:
            series["kl"].append(kl)
            if n_d > 0:
                series["rewards/chosen"].append(r_d / n_d)
                series["logps/chosen"].append(l_d / n_d)
            if n_u > 0:
                series["rewards/rejected"].append(r_u / n_u)
                series["logps/rejected"].append(l_u / n_u)
            if n_d > 0 and n_u > 0:
                series["rewards/margins"].append(r_d / n_d - r_u / n_u)
        for name, values in series.items():
            if values:
                out[name] = sum(values) / len(values)
        out["count/desirable"] = int(sum(r[0] for r in rounds))
        out["count/undesirable"] = int(sum(r[3] for r in rounds))
        return out


def padding(busiest_computed: int, tokens: int, ranks: int = 1) -> float:
    """Token positions run beyond the pairs' own tokens, as a fraction: the busiest rank's computed positions (the
    step waits for it) times the ranks, against the `tokens` of all ranks' pairs. Padding and rank imbalance."""
    return round(busiest_computed * ranks / max(tokens, 1) - 1, 4)


def kl_ratio(logratio_mean: float, margin: float) -> float:
    """|logratio/mean| / rewards/margins: how far the policy drifted from the reference (per completion token, either
    way) per unit of preference margin it gained; nonnegative. A margin below KL_RATIO_FLOOR (none gained, or
    negative) counts as the floor, so drift without a margin gives a large ratio and no division blows up. Rewards
    that fall together (chosen and rejected log-probs both down, a margin still growing) give a small one."""
    return abs(logratio_mean) / max(margin, KL_RATIO_FLOOR)


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return 0.0


def held_memory_gib(device: torch.device) -> float:
    """The device memory in use now, between steps: the weights, the optimizer's state and whatever else is kept."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**30
    return 0.0


class Throughput:
    """Pairs and tokens per second over the steps since the last read."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.pairs = 0
        self.tokens = 0

    def add(self, pairs: int, tokens: int) -> None:
        self.pairs += pairs
        self.tokens += tokens

    def read(self) -> dict:
        dt = max(time.perf_counter() - self.t0, 1e-9)
        out = {"pairs_per_second": self.pairs / dt, "tokens_per_second": self.tokens / dt}
        self.t0, self.pairs, self.tokens = time.perf_counter(), 0, 0
        return out


def model_flops_per_token(config) -> float:
    """Forward FLOPs per token of the decoder matmuls (2 x non-embedding params)."""
    h = config.hidden_size
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", heads) or heads
    hd = getattr(config, "head_dim", None) or h // heads
    inter = config.intermediate_size
    per_layer = h * hd * (heads + 2 * kv) + heads * hd * h + 3 * h * inter
    return 2.0 * layers * per_layer


def step_flops(config, tokens: int, completion_tokens: int, attn_pairs: int, with_reference: bool) -> float:
    """Useful FLOPs of one step (DESIGN §10): policy fwd+bwd (x3) and reference fwd (x1) over the P+C+R tokens, lm_head
    over completion tokens only, attention over the allowed (query, key) pairs."""
    passes = 3.0 + (1.0 if with_reference else 0.0)
    heads = config.num_attention_heads
    hd = getattr(config, "head_dim", None) or config.hidden_size // heads
    attn = 4.0 * config.num_hidden_layers * heads * hd * attn_pairs
    head = 2.0 * config.hidden_size * config.vocab_size * completion_tokens
    return passes * (model_flops_per_token(config) * tokens + attn + head)


PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def device_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, val in PEAK_BF16_FLOPS.items():
        if key in name:
            return val
    return None
