"""Step metrics (TRL names, DESIGN §10), the metrics.jsonl sink, the console and the progress bar."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

# Per-pair sums accumulated over the micro-batches of one step, divided once by the step's pair count.
PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                "logps/rejected")


class StepMetrics:
    """Sums on the device during a step (no host sync); `finish` divides and reads them once."""

    def __init__(self, device: torch.device):
        self.sums = torch.zeros(len(PAIR_METRICS) + 1, dtype=torch.float64, device=device)
        self.pairs = 0
        self.tokens = 0

    @torch.no_grad()
    def add(self, loss_sum: torch.Tensor, beta: float, pol_c, pol_r, ref_c, ref_r, num_tokens: int) -> None:
        rc = beta * (pol_c - ref_c) if ref_c is not None else beta * pol_c
        rr = beta * (pol_r - ref_r) if ref_r is not None else beta * pol_r
        vals = torch.stack([
            loss_sum.detach().float(), rc.sum(), rr.sum(), (rc - rr).sum(), (rc > rr).float().sum(),
            pol_c.sum(), pol_r.sum(),
        ])
        self.sums += vals.double()
        self.pairs += int(pol_c.numel())
        self.tokens += num_tokens

    def finish(self) -> dict:
        v = self.sums.tolist()
        out = {"loss": v[0]}
        for name, s in zip(PAIR_METRICS, v[1:]):
            out[name] = s / max(1, self.pairs)
        return out


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return 0.0


class MetricsSink:
    """One JSON object per logged step in output_dir/metrics.jsonl, plus a console line."""

    def __init__(self, out_dir: Path, console, append: bool):
        self.path = out_dir / "metrics.jsonl"
        self.file = open(self.path, "a" if append else "w", encoding="utf-8")
        self.console = console

    def log(self, record: dict) -> None:
        clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in record.items()}
        self.file.write(json.dumps(clean) + "\n")
        self.file.flush()
        if self.console is not None:
            keys = ("loss", "rewards/margins", "rewards/accuracies", "grad_norm", "learning_rate", "pairs_per_second",
                    "eval_loss", "eval_rewards/margins", "eval_rewards/accuracies")
            shown = "  ".join(f"{_label(k)}={_fmt(record[k])}" for k in keys if k in record)
            self.console.print(f"step {record['step']:>5}  {shown}")

    def close(self) -> None:
        self.file.close()


def _label(key: str) -> str:
    """`rewards/margins` -> `margins`, `eval_rewards/margins` -> `eval_margins`."""
    prefix = "eval_" if key.startswith("eval_") else ""
    return prefix + key.removeprefix("eval_").split("/")[-1]


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


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
