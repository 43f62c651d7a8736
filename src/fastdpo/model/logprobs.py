"""Per-sequence sums of token values, and the next-token distributions' log sum p² (WPO's weight alignment): the
log-prob helpers beside the head's op (`fastdpo.kernels.logprob_head.token_logps`, which gives each target token's
log-prob a chunk of logits at a time)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastdpo.kernels.logprob_head import DEFAULT_CHUNK, chunk_logits
from fastdpo.model.load import base_causal_lm


@dataclass
class Head:
    """What the log-prob computation needs from the output layer."""

    weight: torch.Tensor
    scale: float
    softcap: float | None
    kernels: bool = False  # the Triton log-prob kernels (`fuse_layers(..., use_kernels=True)` marks the head)


def output_head(model) -> Head:
    lm = base_causal_lm(model)
    head = lm.get_output_embeddings()
    assert getattr(head, "bias", None) is None, "lm_head with a bias is not supported"
    cfg = lm.config
    scale = float(getattr(cfg, "logit_scale", None) or 1.0)
    if getattr(cfg, "logits_scaling", None):
        scale /= float(cfg.logits_scaling)
    return Head(head.weight, scale, getattr(cfg, "final_logit_softcapping", None), getattr(head, "_fastdpo_kernels", False))


def sequence_sums(values: torch.Tensor, seq: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Sum per-token values into per-sequence totals: values (N,), seq (N,) -> (num_seqs,)."""
    return torch.zeros(num_seqs, dtype=values.dtype, device=values.device).index_add_(0, seq, values)


@torch.no_grad()
def token_log_sum_sq_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    chunk: int = DEFAULT_CHUNK,
    scale: float = 1.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """log sum_v p_v^2 of each of N next-token distributions, (N,) fp32, without grad (WPO's weight alignment).
    Computed as logsumexp(2 * logits) - 2 * logsumexp(logits), one chunk of logits at a time."""
    out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    for s in range(0, hidden.shape[0], chunk):
        logits, _ = chunk_logits(hidden[s : s + chunk], weight, scale, softcap)
        out[s : s + chunk] = torch.logsumexp(2 * logits, dim=-1) - 2 * torch.logsumexp(logits, dim=-1)
    return out
